"""What a lower cluster's RuntimeClasses make of a pod (pure).

A RuntimeClass names a container runtime configured on the nodes (gVisor, Kata): it is
the lower cluster's to have, never copied down. The lower apiserver refuses a pod of a
class it has no RuntimeClass of, and its RuntimeClass admission gives the pod the class's
overhead and merges the class's scheduling into it: its nodeSelector (a pod whose own
selector gives one of those keys another value is refused) and its tolerations, which
say on which nodes the runtime is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]


@dataclass(frozen=True)
class RuntimeClassFacts:
    """What of a lower RuntimeClass the pods of its class get."""

    pod_fixed: Mapping[str, str] | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[JSON, ...] = ()


RuntimeClasses = Mapping[str, RuntimeClassFacts]


def runtime_class_facts(runtime_class: Mapping[str, Any]) -> RuntimeClassFacts:
    fixed = (runtime_class.get("overhead") or {}).get("podFixed")
    scheduling = runtime_class.get("scheduling") or {}
    return RuntimeClassFacts(
        dict(fixed) if fixed else None,
        dict(scheduling.get("nodeSelector") or {}),
        tuple(scheduling.get("tolerations") or ()),
    )


def _conflicts(spec: Mapping[str, Any], facts: RuntimeClassFacts) -> list[str]:
    selector = spec.get("nodeSelector") or {}
    return [k for k, v in facts.node_selector.items() if k in selector and selector[k] != v]


def runtime_refusal(
    lower: Mapping[str, Any], classes: RuntimeClasses, cluster_id: str
) -> str | None:
    """Why the lower cluster cannot run the pod's runtime class, or None."""
    spec = lower.get("spec") or {}
    wanted = spec.get("runtimeClassName")
    if not wanted:
        return None
    if wanted not in classes:
        return f"lower cluster {cluster_id} has no runtime class {wanted}"
    conflicts = _conflicts(spec, classes[wanted])
    if conflicts:
        selector, scheduling = spec["nodeSelector"], classes[wanted].node_selector
        return f"lower cluster {cluster_id}'s runtime class {wanted} runs on " + ", ".join(
            f"{key}={scheduling[key]}, the pod asks for {key}={selector[key]}" for key in conflicts
        )
    return None


def with_runtime_class(lower: JSON, classes: RuntimeClasses) -> JSON:
    """The lower pod as the lower apiserver's RuntimeClass admission leaves it: the
    overhead of the lower class of that name, if it has one, and the class's node
    selector and tolerations merged in (a pod that conflicts with them is left as it is:
    ``runtime_refusal`` refuses it)."""
    spec = lower.get("spec") or {}
    facts = classes.get(spec.get("runtimeClassName") or "")
    if facts is None or _conflicts(spec, facts):
        return lower
    merged = dict(spec)
    if facts.pod_fixed:
        merged["overhead"] = dict(facts.pod_fixed)
    if facts.node_selector:
        merged["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **facts.node_selector}
    if facts.tolerations:
        tolerations = list(spec.get("tolerations") or [])
        merged["tolerations"] = tolerations + [t for t in facts.tolerations if t not in tolerations]
    return {**lower, "spec": merged}
