"""What a lower cluster's RuntimeClasses make of a pod (pure).

A RuntimeClass names a container runtime configured on the nodes (gVisor, Kata): it is
the lower cluster's to have, never copied down. The lower apiserver refuses a pod of a
class it has no RuntimeClass of, and gives the pod its own class's overhead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

JSON = dict[str, Any]

# {class name: its overhead's podFixed, or None for a class without overhead}
RuntimeClasses = Mapping[str, Mapping[str, str] | None]


def pod_fixed(runtime_class: Mapping[str, Any]) -> dict[str, str] | None:
    fixed = (runtime_class.get("overhead") or {}).get("podFixed")
    return dict(fixed) if fixed else None


def runtime_refusal(
    lower: Mapping[str, Any], classes: RuntimeClasses, cluster_id: str
) -> str | None:
    """Why the lower cluster cannot run the pod's runtime class, or None."""
    wanted = (lower.get("spec") or {}).get("runtimeClassName")
    if wanted and wanted not in classes:
        return f"lower cluster {cluster_id} has no runtime class {wanted}"
    return None


def with_class_overhead(lower: JSON, classes: RuntimeClasses) -> JSON:
    """The lower pod as the lower apiserver's RuntimeClass admission leaves it: the
    overhead of the lower class of that name, if it has one."""
    spec = lower.get("spec") or {}
    fixed = classes.get(spec.get("runtimeClassName") or "")
    return {**lower, "spec": {**spec, "overhead": dict(fixed)}} if fixed else lower
