"""The descheduler's policy file: YAML, every key optional, every value checked."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from kubekit.estimatorapi import MAX_HOLD_SECONDS

INT32_MAX = 2**31 - 1


class PolicyError(ValueError):
    """A policy file that cannot be used, with what is wrong in it."""


@dataclass(frozen=True)
class Policy:
    # An upper pod whose lower copy has been unschedulable this long is moved.
    pending_timeout: float = 60.0
    # Pods of a virtual node NotReady this long are moved.
    cluster_down_timeout: float = 300.0
    # Time between two looks at every pod.
    interval: float = 10.0
    # A pod Pending above because no cluster has a node that fits it, for this long,
    # has room made for it by evicting movable pods.
    defrag_after: float = 60.0
    # How long the room a defragmentation frees is kept for the pod it was made for.
    hold_timeout: float = 120.0
    # How long the new pods of a controller whose pod was moved out of a cluster are
    # kept off that cluster's virtual node (by the webhook, kubekit.moves).
    return_after: float = 600.0
    max_evictions_per_cycle: int = 10
    max_evictions_per_namespace: int = 5
    max_evictions_per_node: int = 5


# The file's keys, as Kubernetes spells its fields.
_KEYS = {
    "pendingTimeout": "pending_timeout",
    "clusterDownTimeout": "cluster_down_timeout",
    "interval": "interval",
    "defragAfter": "defrag_after",
    "holdTimeout": "hold_timeout",
    "returnAfter": "return_after",
    "maxEvictionsPerCycle": "max_evictions_per_cycle",
    "maxEvictionsPerNamespace": "max_evictions_per_namespace",
    "maxEvictionsPerNode": "max_evictions_per_node",
}


def parse_policy(text: str) -> Policy:
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise PolicyError(f"the policy is not YAML: {error}") from error
    if document is None:
        return Policy()
    if not isinstance(document, Mapping):
        raise PolicyError("the policy must be a mapping of keys to values")
    defaults = Policy()
    values: dict[str, Any] = {}
    for key, value in document.items():
        name = _KEYS.get(key)
        if name is None:
            raise PolicyError(f"unknown key {key!r} (known: {', '.join(sorted(_KEYS))})")
        values[name] = _number(key, value, integer=isinstance(getattr(defaults, name), int))
    if values.get("hold_timeout", 0) > MAX_HOLD_SECONDS:
        # The estimators refuse a longer hold: every plan would find its room not held.
        raise PolicyError(
            f"holdTimeout: {values['hold_timeout']:g} s is longer than the estimators hold "
            f"room ({MAX_HOLD_SECONDS:.0f} s)"
        )
    return Policy(**values)


def _number(key: str, value: Any, integer: bool) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(f"{key}: {value!r} is not a number")
    if integer:
        # The estimators' API carries a count of evictions as an int32.
        if not isinstance(value, int) or not 0 <= value <= INT32_MAX:
            raise PolicyError(f"{key}: {value!r} is not a whole number from 0 to {INT32_MAX}")
        return value
    if not 0 < value <= 86400:
        raise PolicyError(f"{key}: {value!r} seconds is not above 0 and at most a day")
    return float(value)


class Limits:
    """What evictions are left this cycle: in all, per namespace and per (source)
    virtual node."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.total = 0
        self.per_namespace: Counter[str] = Counter()
        self.per_node: Counter[str] = Counter()

    def take(self, evictions: Sequence[tuple[str, str]]) -> bool:
        """Counts the (namespace, node) evictions if all of them are within the limits;
        takes none otherwise."""
        namespaces = Counter(namespace for namespace, _ in evictions)
        nodes = Counter(node for _, node in evictions)
        policy = self.policy
        if (
            self.total + len(evictions) > policy.max_evictions_per_cycle
            or any(
                self.per_namespace[ns] + n > policy.max_evictions_per_namespace
                for ns, n in namespaces.items()
            )
            or any(
                self.per_node[node] + n > policy.max_evictions_per_node for node, n in nodes.items()
            )
        ):
            return False
        self.count(evictions)
        return True

    def count(self, evictions: Sequence[tuple[str, str]]) -> None:
        """Counts the evictions, within the limits or not."""
        self.total += len(evictions)
        self.per_namespace.update(namespace for namespace, _ in evictions)
        self.per_node.update(node for _, node in evictions)
