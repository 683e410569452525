"""Deep copies of JSON values: what the API sends and what the caches hold (dicts, lists,
strings, numbers, booleans and None)."""

from __future__ import annotations

from typing import TypeVar

import orjson

T = TypeVar("T")


def json_copy(value: T) -> T:
    """A deep copy through orjson: about ten times faster than ``copy.deepcopy`` on a pod
    spec, which made copying most of a busy virtual node's CPU."""
    copied: T = orjson.loads(orjson.dumps(value))
    return copied
