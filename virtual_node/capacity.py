"""What a lower cluster can still run: the pure capacity arithmetic of the virtual Node."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from kubekit.fit import JSON, NO_EXECUTE, NO_SCHEDULE, Resources, add, node_is_ready

# What a pod takes is the fit rules' business now; still importable from here.
from kubekit.fit import pod_holds_resources as pod_holds_resources
from kubekit.fit import pod_requests as pod_requests
from kubekit.quantity import format_quantity, parse_quantity

_REPELLING = frozenset({NO_SCHEDULE, NO_EXECUTE})


def node_is_usable(node: JSON) -> bool:
    """Schedulable and Ready: a node the lower scheduler would place pods on."""
    return not (node.get("spec") or {}).get("unschedulable") and node_is_ready(node)


def node_counts(node: JSON, counted_taint_keys: Collection[str] = ()) -> bool:
    """Usable and free of NoSchedule and NoExecute taints except those keyed in
    ``counted_taint_keys``: a tainted node (control plane, dedicated, GPU) takes only
    pods that tolerate it, which the upper scheduler cannot tell apart, so its room is
    offered only when the operator says federated pods tolerate the taint."""
    return node_is_usable(node) and all(
        taint.get("effect") not in _REPELLING or taint.get("key") in counted_taint_keys
        for taint in (node.get("spec") or {}).get("taints") or []
    )


@dataclass(frozen=True, slots=True)
class PodUsage:
    """What one lower pod takes from its node."""

    node_name: str
    requests: Resources
    # One of our mirrored pods: the upper scheduler counts it against the Node already.
    mirrored: bool = False


def pod_usage(pod: JSON, is_mirrored: Callable[[JSON], bool]) -> PodUsage | None:
    """What a lower pod takes from its node; None for pods that hold nothing."""
    if not pod_holds_resources(pod):
        return None
    return PodUsage(pod["spec"]["nodeName"], pod_requests(pod), is_mirrored(pod))


def node_share(allocatable: Resources, others: Resources, ours: Resources) -> Resources:
    """What one counted lower node adds to the virtual Node: the room other pods and ours
    leave it, never below zero, plus what ours take. The upper scheduler subtracts ours
    from the whole Node, so the share less ours is this node's own free room even when its
    allocatable shrank under them (a device plugin restarting): counted only as the room
    left, ours would be taken a second time, from the room of the other nodes."""
    return {
        name: max(
            Fraction(0),
            allocatable.get(name, Fraction(0))
            - others.get(name, Fraction(0))
            - ours.get(name, Fraction(0)),
        )
        + ours.get(name, Fraction(0))
        # Other pods asking for a resource the node does not list take nothing it offers.
        for name in sorted(allocatable.keys() | ours.keys())
    }


def free_capacity(
    nodes: Iterable[JSON], usages: Iterable[PodUsage], counted_taint_keys: Collection[str] = ()
) -> Resources:
    """What the virtual Node offers, never below zero: for each lower node that counts,
    its share (``node_share``: its allocatable less what every pod on it takes, never
    below zero, plus what ours take, which the upper scheduler subtracts itself), plus
    what ours take on nodes that do not count. The upper scheduler subtracts those too,
    from room they never were in: a lower node cordoned under our pods would otherwise be
    offered less than nothing."""
    allocatable_by_node: dict[str, Resources] = {
        node["metadata"]["name"]: {
            name: parse_quantity(value)
            for name, value in ((node.get("status") or {}).get("allocatable") or {}).items()
        }
        for node in nodes
        if node_counts(node, counted_taint_keys)
    }
    others: dict[str, Resources] = {name: {} for name in allocatable_by_node}
    ours: dict[str, Resources] = {name: {} for name in allocatable_by_node}
    free: Resources = {}
    for usage in usages:
        if usage.node_name in allocatable_by_node:
            add((ours if usage.mirrored else others)[usage.node_name], usage.requests)
        elif usage.mirrored:
            add(free, usage.requests)
    for name, allocatable in allocatable_by_node.items():
        add(free, node_share(allocatable, others[name], ours[name]))
    return {name: max(Fraction(0), value) for name, value in free.items()}


def free_slot(node: str, free_milli: Mapping[str, int]) -> dict[str, str]:
    """What a lower node has left (milli-units, as the fit rules count), as quantities,
    with the node's name."""
    return {
        **as_resource_list({name: Fraction(value, 1000) for name, value in free_milli.items()}),
        "node": node,
    }


def as_resource_list(resources: Mapping[str, Fraction]) -> dict[str, str]:
    return {
        name: format_quantity(value if name != "pods" else Fraction(int(value)), name)
        for name, value in sorted(resources.items())
    }
