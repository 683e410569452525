"""Where an upper object lives in the lower cluster (pure)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kubekit import keys

Strategy = Literal["same", "prefix"]

_MAX_NAMESPACE = 63
# With a dash and at least one character after it, a DNS label. No dash of its own: the
# first dash of a lower name then ends the prefix, so two tenants' prefixes never name one
# lower namespace (`acme` + `dev-x` and `acme-dev` + `x` would both be `acme-dev-x`).
_PREFIX = re.compile(r"[a-z0-9]{1,61}")
# The lower cluster's own namespaces: nothing of an upper cluster goes into them. Its
# kube-system takes a Secret of type bootstrap token for a credential to join the lower
# cluster, and our ledger of quota slices lives in SYSTEM_NAMESPACE; an upper cluster's
# admin is not the lower cluster's.
LOWER_CLUSTERS_OWN = frozenset(
    {"kube-system", "kube-public", "kube-node-lease", keys.SYSTEM_NAMESPACE}
)


class NamingError(ValueError):
    """An upper name that has no valid lower counterpart."""


@dataclass(frozen=True)
class NamespaceMapping:
    """``same``: a namespace keeps its name below. ``prefix``: ``<prefix>-<namespace>``,
    for lower clusters that several upper clusters share."""

    strategy: Strategy = "same"
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.strategy not in ("same", "prefix"):
            raise NamingError(
                f"namespace strategy {self.strategy!r} is not one of 'same', 'prefix'"
            )
        if self.strategy == "same" and self.prefix:
            # Tenants that meant to be kept apart by their prefixes would share namespaces.
            raise NamingError(
                f"namespace prefix {self.prefix!r} is used only by the prefix namespace "
                "strategy: set it too"
            )
        if self.strategy == "prefix" and not self.prefix:
            raise NamingError("the prefix namespace strategy needs a prefix")
        if self.strategy == "prefix" and not _PREFIX.fullmatch(self.prefix):
            # Every namespace made below would be refused, and its pods wait for good.
            raise NamingError(
                f"namespace prefix {self.prefix!r} must be at most 61 lowercase letters "
                "and digits (no '-': another tenant's prefix could then name the same "
                "lower namespaces)"
            )

    def lower(self, upper_namespace: str) -> str:
        if self.strategy == "same":
            return upper_namespace
        name = f"{self.prefix}-{upper_namespace}"
        if len(name) > _MAX_NAMESPACE:
            raise NamingError(
                f"namespace {upper_namespace!r} with prefix {self.prefix!r} is longer than "
                f"{_MAX_NAMESPACE} characters below"
            )
        return name

    def refusal(self, upper_namespace: str) -> str | None:
        """Why nothing of an upper namespace may be made below (None: it may): its lower
        namespace is the lower cluster's own. What an earlier version made there is still
        found and removed by ``lower``."""
        name = self.lower(upper_namespace)
        if name not in LOWER_CLUSTERS_OWN:
            return None
        return (
            f"namespace {name} is the lower cluster's own: nothing of an upper cluster is "
            "made in it"
            + (
                f" (with --namespace-strategy prefix, upper namespace {upper_namespace} is "
                f"<prefix>-{upper_namespace} below)"
                if self.strategy == "same"
                else ""
            )
        )

    def upper(self, lower_namespace: str) -> str | None:
        """The upper namespace of a lower one, or None if it is not one of ours."""
        if self.strategy == "same":
            return lower_namespace
        head = f"{self.prefix}-"
        return lower_namespace[len(head) :] if lower_namespace.startswith(head) else None


def made_under_another_mapping(
    mirrored: Mapping[str, str], mapping: NamespaceMapping
) -> list[tuple[str, str]]:
    """The (lower key, upper key) of our pods below (``mirrored``: lower -> upper) that
    ``mapping`` would not give their upper pods: made before the namespace strategy or
    prefix changed. Looked up under the new mapping, each is taken for lost and made
    again beside the one still running, and never removed."""
    stale = []
    for lower_key, upper_key in mirrored.items():
        namespace, _, name = upper_key.partition("/")
        try:
            wanted = f"{mapping.lower(namespace)}/{name}"
        except NamingError:
            wanted = None
        if wanted != lower_key:
            stale.append((lower_key, upper_key))
    return sorted(stale)
