"""The lower cluster's ResourceQuotas as the fit estimator reads them (pure).

A pod the lower apiserver's quota admission would refuse fits nowhere here, however
much room the nodes have: placed here anyway it waits, refused again and again. Read
are the quotas that cap every pod of their namespace (``scopes`` and ``scopeSelector``
cap only some pods: left to the refusal below) and that are not the quota slices'
(``keys.SLICE_QUOTA``, judged by the slice budgets with their own words). What a quota
has left is its ``hard`` less its ``status.used`` (the lower apiserver adds a pod to it
as it admits one) less the pods bound to this virtual node, or held room by the
estimator, whose lower copy is not made yet: so a burst judged before its first pod is
created below never goes past the quota.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kubekit import keys
from kubekit.fit import milli, pod_limits, pod_requests
from kubekit.quantity import format_quantity, parse_quantity

JSON = dict[str, Any]

# The compute resources a quota names bare, as requests, or as limits.
_COMPUTE = ("cpu", "memory", "ephemeral-storage")


@dataclass(frozen=True)
class Quota:
    name: str
    # Resource name -> amount in thousandths (as kubekit.fit counts), of what it caps.
    hard: Mapping[str, int]
    used: Mapping[str, int]


def _amounts(resources: Any) -> dict[str, int]:
    if not isinstance(resources, Mapping):
        return {}
    found = {}
    for name, value in resources.items():
        try:
            found[str(name)] = math.ceil(parse_quantity(value) * 1000)
        except (ValueError, TypeError):
            continue  # the lower apiserver validated it; a value we cannot read caps nothing
    return found


def read_quota(quota: Mapping[str, Any]) -> Quota | None:
    """The quota as the estimator holds a namespace to it, or None when it caps only some
    pods or is the slices' own."""
    metadata, spec = quota.get("metadata") or {}, quota.get("spec") or {}
    if metadata.get("name") == keys.SLICE_QUOTA:
        return None
    if spec.get("scopes") or spec.get("scopeSelector"):
        return None
    hard = _amounts(spec.get("hard"))
    if not hard:
        return None
    return Quota(
        str(metadata.get("name", "")), hard, _amounts((quota.get("status") or {}).get("used"))
    )


def quota_caps(quota: Mapping[str, Any]) -> str:
    """What a quota caps and for which pods (its spec), as text to compare: its usage
    changes with every pod of its namespace, this only when someone edits the quota."""
    metadata = quota.get("metadata") or {}
    return json.dumps(
        [metadata.get("namespace"), metadata.get("name"), quota.get("spec") or {}],
        sort_keys=True,
    )


def quotas_digest(caps: Iterable[str], changes: int) -> str:
    """What the lower cluster's quotas cap, in a few bytes (``quota_caps`` of each), and
    how many times that changed: a quota made and removed between two Node updates
    changes the digest too (the estimator refused pods for it meanwhile)."""
    text = "\n".join([str(changes), *sorted(caps)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def quota_usage(pod: JSON) -> dict[str, int]:
    """What creating the pod adds to a quota's usage, per quota resource name (thousandths):
    pods, requests (bare and ``requests.``-prefixed for cpu, memory, ephemeral storage and
    hugepages, prefixed for extended resources) and limits."""
    usage = {"pods": 1000, "count/pods": 1000}
    for name, amount in milli(pod_requests(pod)).items():
        if name == "pods" or not amount:
            continue
        usage[f"requests.{name}"] = amount
        if name in _COMPUTE or name.startswith("hugepages-"):
            usage[name] = amount
    for name, amount in milli(pod_limits(pod)).items():
        if name in _COMPUTE and amount:
            usage[f"limits.{name}"] = amount
    return usage


def _describe(resource: str, amount: int) -> str:
    return format_quantity(
        Fraction(amount, 1000), resource.removeprefix("requests.").removeprefix("limits.")
    )


class QuotaBook:
    """The lower namespaces' quotas, and what the pods counted against them but not yet
    in their ``status.used`` take (by pod UID, so a reserved pod then bound counts once)."""

    def __init__(self) -> None:
        # Lower namespace -> quota name -> quota.
        self._quotas: dict[str, dict[str, Quota]] = {}
        self._pending: dict[str, tuple[str, dict[str, int]]] = {}
        self._pending_sum: dict[str, dict[str, int]] = {}

    def quota_changed(self, quota: Mapping[str, Any]) -> bool:
        """Takes the quota as it is now; True when its namespace had none held before
        (whose pods the caller then counts)."""
        metadata = quota.get("metadata") or {}
        namespace, name = str(metadata.get("namespace", "")), str(metadata.get("name", ""))
        read = read_quota(quota)
        newly = namespace not in self._quotas
        if read is None:
            self.quota_deleted(quota)
            return False
        self._quotas.setdefault(namespace, {})[name] = read
        return newly

    def quota_deleted(self, quota: Mapping[str, Any]) -> None:
        metadata = quota.get("metadata") or {}
        namespace = str(metadata.get("namespace", ""))
        held = self._quotas.get(namespace)
        if held is None:
            return
        held.pop(str(metadata.get("name", "")), None)
        if not held:
            del self._quotas[namespace]
            for uid in [uid for uid, (ns, _) in self._pending.items() if ns == namespace]:
                self.uncount(uid)

    def holds(self, namespace: str) -> bool:
        return namespace in self._quotas

    def count(self, uid: str, namespace: str, usage: Mapping[str, int]) -> None:
        """Counts a pod whose lower copy is not made yet (only in namespaces held)."""
        if namespace not in self._quotas:
            return
        self.uncount(uid)
        self._pending[uid] = (namespace, dict(usage))
        total = self._pending_sum.setdefault(namespace, {})
        for name, amount in usage.items():
            total[name] = total.get(name, 0) + amount

    def uncount(self, uid: str) -> None:
        """The pod's lower copy is made (its quota's used has it now), or the pod is gone."""
        counted = self._pending.pop(uid, None)
        if counted is None:
            return
        namespace, usage = counted
        total = self._pending_sum[namespace]
        for name, amount in usage.items():
            total[name] -= amount
        if not any(total.values()):
            del self._pending_sum[namespace]

    def room_for(
        self, namespace: str, uid: str, usage: Mapping[str, int], copies: int, cluster_id: str
    ) -> tuple[int, str]:
        """How many copies of the pod the namespace's quotas here still admit (at most
        ``copies``), and why not one when none."""
        quotas = self._quotas.get(namespace)
        if not quotas:
            return copies, ""
        pending = dict(self._pending_sum.get(namespace, {}))
        if uid in self._pending:
            for name, amount in self._pending[uid][1].items():
                pending[name] -= amount
        taken = copies
        for quota in sorted(quotas.values(), key=lambda q: q.name):
            for resource, hard in sorted(quota.hard.items()):
                asked = usage.get(resource, 0)
                if not asked:
                    continue
                left = hard - quota.used.get(resource, 0) - pending.get(resource, 0)
                fitting = max(0, left // asked)
                if fitting == 0:
                    return 0, (
                        f"lower cluster {cluster_id}: quota {quota.name} of namespace "
                        f"{namespace} has {resource} {_describe(resource, max(0, left))} left "
                        f"of {_describe(resource, hard)}, the pod asks "
                        f"{_describe(resource, asked)}"
                    )
                taken = min(taken, fitting)
        return taken, ""
