"""`kubestrata status`: the virtual nodes of an upper cluster in one table, from what the
upper apiserver holds (the Nodes, their Leases, the pods bound to them)."""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from kubekit import keys
from kubekit.client import (
    API_ERRORS,
    LEASES,
    NODES,
    PODS,
    ApiError,
    ClientSettings,
    KubeClient,
    KubeconfigError,
    is_not_found,
)
from kubekit.fit import pod_requests
from kubekit.quantity import QuantityError, format_quantity, parse_quantity
from kubekit.timestamps import parse_time

JSON = dict[str, Any]
# What reading an upper cluster fails with: no or a broken kubeconfig, no apiserver, a
# refusal.
READ_ERRORS: tuple[type[Exception], ...] = (KubeconfigError, *API_ERRORS)
# Pods bound to a virtual node that still count there (the phases a kubelet still runs).
_ACTIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"


@dataclass(frozen=True)
class VirtualNodeStatus:
    node: str
    cluster: str
    ready: str  # the Ready condition's status: True, False or Unknown
    lease_age_seconds: float | None  # since the Lease was last renewed; None: no Lease
    free: dict[str, str]  # what the upper scheduler sees left: see free_after_bound_pods
    # The roomiest lower node and what it has left (empty when the virtual node runs no
    # estimator): the biggest pod the cluster could still take.
    largest_free_slot: dict[str, str]
    pods: int  # bound to the virtual node and not finished
    # Labelled as a virtual node under node-restriction.kubernetes.io, which no kubelet
    # can set on itself: federated pods and the multischeduler take only such a Node.
    # Without it: a virtual node before 2026-11-29, or a kubelet that labelled itself.
    proven: bool


def _ready(node: Mapping[str, Any]) -> str:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return str(condition.get("status") or "Unknown")
    return "Unknown"


def _lease_age(lease: Mapping[str, Any] | None, now: datetime.datetime) -> float | None:
    renewed = ((lease or {}).get("spec") or {}).get("renewTime")
    if not renewed:
        return None
    return max(0.0, (now - parse_time(renewed)).total_seconds())


def _slot(node: Mapping[str, Any]) -> dict[str, str]:
    text = ((node.get("metadata") or {}).get("annotations") or {}).get(
        keys.LARGEST_FREE_SLOT_ANNOTATION
    )
    if not text:
        return {}
    try:
        slot = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(slot, dict):
        return {}
    # A quantity that does not read (a hand edit, another version) is left out: the
    # table sums the GPUs, and it raised out of `kubestrata status`.
    return {str(k): str(v) for k, v in slot.items() if k == "node" or _is_quantity(v)}


def _is_quantity(value: Any) -> bool:
    try:
        parse_quantity(str(value))
    except QuantityError:
        return False
    return True


def free_after_bound_pods(
    allocatable: Mapping[str, str], pods: Iterable[Mapping[str, Any]]
) -> dict[str, str]:
    """What the upper scheduler sees free on a virtual Node: its allocatable less the
    requests of the unfinished pods bound to it, never below zero. The allocatable is
    what the lower cluster has left before the federation's own pods (the scheduler
    subtracts those itself): shown as it is, it offered their room again."""
    free = {name: parse_quantity(value) for name, value in allocatable.items()}
    for pod in pods:
        for name, value in pod_requests(pod).items():
            if name in free:
                free[name] -= value
    return {name: format_quantity(max(Fraction(0), value), name) for name, value in free.items()}


def statuses(
    nodes: Iterable[Mapping[str, Any]],
    leases: Mapping[str, Mapping[str, Any]],
    pods: Mapping[str, Sequence[Mapping[str, Any]]],
    now: datetime.datetime,
) -> list[VirtualNodeStatus]:
    """One row per virtual Node, by name; ``leases`` and the unfinished ``pods`` bound to
    each are by node name."""
    rows = []
    for node in nodes:
        metadata = node.get("metadata") or {}
        name = str(metadata.get("name"))
        rows.append(
            VirtualNodeStatus(
                node=name,
                cluster=str((metadata.get("labels") or {}).get(keys.CLUSTER_ID_LABEL, "")),
                ready=_ready(node),
                lease_age_seconds=_lease_age(leases.get(name), now),
                free=free_after_bound_pods(
                    (node.get("status") or {}).get("allocatable") or {}, pods.get(name, ())
                ),
                largest_free_slot=_slot(node),
                pods=len(pods.get(name, ())),
                proven=(metadata.get("labels") or {}).get(keys.PROVEN_VIRTUAL_NODE_LABEL)
                == keys.VIRTUAL_NODE_LABEL_VALUE,
            )
        )
    return sorted(rows, key=lambda row: row.node)


def _gpus(resources: Mapping[str, str]) -> str:
    """The free GPUs of every vendor (resources named */gpu), or '-' for none offered."""
    names = [name for name in resources if name.endswith("/gpu")]
    if not names:
        return "-"
    return format_quantity(sum((parse_quantity(resources[n]) for n in names), Fraction(0)), "")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def _slot_text(slot: Mapping[str, str]) -> str:
    if not slot:
        return "-"
    parts = [f"{slot.get('cpu', '0')} cpu", slot.get("memory", "0")]
    gpus = _gpus(slot)
    if gpus != "-":
        parts.append(f"{gpus} gpu")
    return f"{', '.join(parts)} on {slot.get('node', '?')}"


HEADER = (
    "NODE",
    "CLUSTER",
    "READY",
    "LEASE",
    "CPU",
    "MEMORY",
    "GPU",
    "LARGEST SLOT",
    "PODS",
    "PROVEN",
)


def table(rows: Sequence[VirtualNodeStatus]) -> str:
    """The rows as kubectl prints a table: columns padded to their widest cell."""
    cells = [HEADER] + [
        (
            row.node,
            row.cluster or "-",
            row.ready,
            _age(row.lease_age_seconds),
            row.free.get("cpu", "0"),
            row.free.get("memory", "0"),
            _gpus(row.free),
            _slot_text(row.largest_free_slot),
            str(row.pods),
            "yes" if row.proven else "no",
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(HEADER))]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def as_json(rows: Sequence[VirtualNodeStatus]) -> str:
    return json.dumps({"virtualNodes": [asdict(row) for row in rows]}, indent=2)


async def collect(kubeconfig: str | None) -> list[VirtualNodeStatus]:
    """Reads the virtual Nodes, then their Leases and unfinished pods all at once, from
    the upper cluster."""
    async with await KubeClient.connect(ClientSettings(kubeconfig)) as client:
        selector = f"{keys.VIRTUAL_NODE_LABEL}={keys.VIRTUAL_NODE_LABEL_VALUE}"
        nodes = (await client.list(NODES, labelSelector=selector))["items"]
        names = [node["metadata"]["name"] for node in nodes]
        found = await asyncio.gather(
            *(_lease(client, name) for name in names),
            *(
                client.list(PODS, fieldSelector=f"spec.nodeName={name},{_ACTIVE_PODS}")
                for name in names
            ),
        )
    leases = {name: lease for name, lease in zip(names, found, strict=False) if lease}
    bound = {name: pods["items"] for name, pods in zip(names, found[len(names) :], strict=True)}
    return statuses(nodes, leases, bound, datetime.datetime.now(datetime.UTC))


async def _lease(client: KubeClient, name: str) -> JSON:
    try:
        return await client.get(LEASES, name, keys.NODE_LEASE_NAMESPACE)
    except ApiError as error:
        if is_not_found(error):
            return {}
        raise
