"""What a lower cluster can still run: the pure capacity arithmetic of the virtual Node."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kubekit.quantity import QuantityError, format_quantity, parse_quantity

Resources = dict[str, Fraction]
JSON = Mapping[str, Any]


def add(total: Resources, extra: Mapping[str, Fraction]) -> None:
    for name, value in extra.items():
        total[name] = total.get(name, Fraction(0)) + value


def _requests(container: JSON) -> Resources:
    resources = container.get("resources") or {}
    # Without requests the apiserver defaults them to the limits.
    declared = resources.get("requests") or resources.get("limits") or {}
    result: Resources = {}
    for name, value in declared.items():
        try:
            result[name] = parse_quantity(value)
        except QuantityError:
            continue  # the apiserver validated it; an unknown form is not ours to judge
    return result


def pod_requests(pod: JSON) -> Resources:
    """What the scheduler reserves for a pod: the larger of the app containers' sum
    (restartable init containers, i.e. sidecars, included) and each init container's
    peak, plus the pod overhead; ``pods`` counts one."""
    spec = pod.get("spec") or {}
    total: Resources = {}
    for container in spec.get("containers") or []:
        add(total, _requests(container))
    sidecars: Resources = {}
    init_peak: Resources = {}
    for container in spec.get("initContainers") or []:
        requests = _requests(container)
        if container.get("restartPolicy") == "Always":
            add(sidecars, requests)
            continue
        # A plain init container runs beside the sidecars started before it.
        for name, value in requests.items():
            init_peak[name] = max(
                init_peak.get(name, Fraction(0)), value + sidecars.get(name, Fraction(0))
            )
    add(total, sidecars)
    for name, value in init_peak.items():
        total[name] = max(total.get(name, Fraction(0)), value)
    for name, value in (spec.get("overhead") or {}).items():
        add(total, {name: parse_quantity(value)})
    total["pods"] = Fraction(1)
    return total


def node_is_usable(node: JSON) -> bool:
    """Schedulable and Ready: a node the lower scheduler would place pods on."""
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_holds_resources(pod: JSON) -> bool:
    """Bound and not finished: the scheduler counts it against its node."""
    phase = (pod.get("status") or {}).get("phase")
    return bool((pod.get("spec") or {}).get("nodeName")) and phase not in {"Succeeded", "Failed"}


@dataclass(frozen=True, slots=True)
class PodUsage:
    """What one lower pod takes from its node."""

    node_name: str
    requests: Resources


def pod_usage(pod: JSON, is_mirrored: Callable[[JSON], bool]) -> PodUsage | None:
    """What a lower pod takes from the capacity the virtual Node offers: None for our own
    mirrored pods (the upper cluster accounts for those already) and for pods that hold
    nothing."""
    if not pod_holds_resources(pod) or is_mirrored(pod):
        return None
    return PodUsage(pod["spec"]["nodeName"], pod_requests(pod))


def free_capacity(nodes: Iterable[JSON], usages: Iterable[PodUsage]) -> Resources:
    """Allocatable of usable lower nodes minus what the pods on them take, never below
    zero."""
    usable = {node["metadata"]["name"]: node for node in nodes if node_is_usable(node)}
    free: Resources = {}
    for node in usable.values():
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        add(free, {name: parse_quantity(value) for name, value in allocatable.items()})
    for usage in usages:
        if usage.node_name in usable:
            for name, value in usage.requests.items():
                if name in free:
                    free[name] -= value
    return {name: max(Fraction(0), value) for name, value in free.items()}


def as_resource_list(resources: Mapping[str, Fraction]) -> dict[str, str]:
    return {
        name: format_quantity(value if name != "pods" else Fraction(int(value)), name)
        for name, value in sorted(resources.items())
    }
