"""Random JSON, and random edits of valid JSON documents, for the fuzz tests."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from hypothesis import strategies as st

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


def paths(value: Any, prefix: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Every place in a JSON document, the document itself first."""
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from paths(child, (*prefix, index))


@st.composite
def edited(draw: st.DrawFn, documents: st.SearchStrategy[Any]) -> Any:
    """A document from ``documents`` with a few of its values replaced or removed."""
    # A copy: the edits would otherwise change values the strategies hand out again.
    document = copy.deepcopy(draw(documents))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(list(paths(document))))
        if not where:
            document = draw(json_values)
            continue
        parent = document
        for step in where[:-1]:
            parent = parent[step]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[where[-1]]
        else:
            parent[where[-1]] = draw(json_values)
    return document
