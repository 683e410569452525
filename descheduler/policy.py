"""The descheduler's policy file: YAML, every key optional, every value checked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml


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
    max_evictions_per_cycle: int = 10
    max_evictions_per_namespace: int = 5
    max_evictions_per_node: int = 5


# The file's keys, as Kubernetes spells its fields.
_KEYS = {
    "pendingTimeout": "pending_timeout",
    "clusterDownTimeout": "cluster_down_timeout",
    "interval": "interval",
    "maxEvictionsPerCycle": "max_evictions_per_cycle",
    "maxEvictionsPerNamespace": "max_evictions_per_namespace",
    "maxEvictionsPerNode": "max_evictions_per_node",
}
# Keys of the design that this version does not carry out: refused rather than ignored,
# so nobody believes them in force.
_NOT_YET = {"defragAfter": "defragmentation is not available in this version"}


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
        if key in _NOT_YET:
            raise PolicyError(f"{key}: {_NOT_YET[key]}")
        name = _KEYS.get(key)
        if name is None:
            raise PolicyError(f"unknown key {key!r} (known: {', '.join(sorted(_KEYS))})")
        values[name] = _number(key, value, integer=isinstance(getattr(defaults, name), int))
    return Policy(**values)


def _number(key: str, value: Any, integer: bool) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(f"{key}: {value!r} is not a number")
    if integer:
        if not isinstance(value, int) or value < 0:
            raise PolicyError(f"{key}: {value!r} is not a whole number of 0 or more")
        return value
    if not 0 < value <= 86400:
        raise PolicyError(f"{key}: {value!r} seconds is not above 0 and at most a day")
    return float(value)
