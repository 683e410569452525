"""Types of decoded JSON checked against a shape (a pure function), for what arrives from
outside the apiserver's own validation: an AdmissionReview from a client that is not an
apiserver, a stash annotation a user wrote.

A shape is ``{field: shape}`` for an object (other fields are not looked at), ``[shape]``
for an array, ``MapOf(shape)`` for an object of any keys, or a type for a scalar. Absent
or null is fine everywhere but where ``Required`` and in arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ShapeError(ValueError):
    """A value that does not have its shape; the message names where."""


@dataclass(frozen=True)
class Required:
    shape: Any


@dataclass(frozen=True)
class MapOf:
    shape: Any


def check(value: Any, shape: Any, where: str) -> None:
    if isinstance(shape, Required):
        if value is None:
            raise ShapeError(f"{where} is required")
        shape = shape.shape
    if value is None:
        return
    if isinstance(shape, dict | MapOf):
        if not isinstance(value, dict):
            raise ShapeError(f"{where} must be a JSON object, not {type(value).__name__}")
        if isinstance(shape, MapOf):
            for key, inner in value.items():
                check(inner, Required(shape.shape), f"{where}.{key}")
        else:
            for key, inner in shape.items():
                check(value.get(key), inner, f"{where}.{key}")
    elif isinstance(shape, list):
        if not isinstance(value, list):
            raise ShapeError(f"{where} must be a JSON array, not {type(value).__name__}")
        for index, item in enumerate(value):
            check(item, Required(shape[0]), f"{where}[{index}]")
    elif not isinstance(value, shape) or isinstance(value, bool) is not (shape is bool):
        raise ShapeError(f"{where} must be a {shape.__name__}, not {type(value).__name__}")


# A pod's scheduling fields as far as kubestrata reads them (the stash, the fit rules),
# typed as the apiserver decodes them into a v1.Pod.
_REQUIREMENT = {"key": str, "operator": str, "values": [str]}
_LABEL_SELECTOR = {"matchLabels": MapOf(str), "matchExpressions": [_REQUIREMENT]}
_NODE_TERM = {"matchExpressions": [_REQUIREMENT], "matchFields": [_REQUIREMENT]}
_POD_TERM = {
    "labelSelector": _LABEL_SELECTOR,
    "namespaceSelector": _LABEL_SELECTOR,
    "namespaces": [str],
    "topologyKey": str,
    "matchLabelKeys": [str],
    "mismatchLabelKeys": [str],
}
_POD_AFFINITY = {
    "requiredDuringSchedulingIgnoredDuringExecution": [_POD_TERM],
    "preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": Required(int), "podAffinityTerm": _POD_TERM}
    ],
}
SCHEDULING_FIELDS = {
    "nodeSelector": MapOf(str),
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [_NODE_TERM]},
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": Required(int), "preference": _NODE_TERM}
            ],
        },
        "podAffinity": _POD_AFFINITY,
        "podAntiAffinity": _POD_AFFINITY,
    },
    "tolerations": [
        {"key": str, "operator": str, "value": str, "effect": str, "tolerationSeconds": int}
    ],
    "topologySpreadConstraints": [
        {
            "maxSkew": int,
            "topologyKey": str,
            "whenUnsatisfiable": str,
            "labelSelector": _LABEL_SELECTOR,
            "minDomains": int,
            "nodeAffinityPolicy": str,
            "nodeTaintsPolicy": str,
            "matchLabelKeys": [str],
        }
    ],
}
