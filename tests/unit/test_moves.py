from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from kubekit import keys, stash
from kubekit.moves import controller_uid, keep_off, kept_off, parse_moves, record_move
from kubekit.stash import restore_scheduling, stash_scheduling
from tests.unit.test_stash import specs

NOW = datetime(2026, 11, 25, 10, 0, 0, tzinfo=UTC)
LATER = NOW + timedelta(minutes=10)


def owned_pod(owner: str | None, controller: bool = True) -> dict[str, Any]:
    references = [] if owner is None else [{"uid": owner, "controller": controller}]
    return {"metadata": {"name": "p", "ownerReferences": references}, "spec": {}}


def test_a_move_is_recorded_per_controller_and_node_until_its_time() -> None:
    data = record_move({}, "rs-1", "vk-lower-1", LATER, NOW)
    assert data == {"rs-1": json.dumps({"vk-lower-1": "2026-11-25T10:10:00Z"})}
    data = record_move(parse_moves(data), "rs-1", "vk-lower-2", LATER, NOW)
    assert parse_moves(data) == {"rs-1": {"vk-lower-1": LATER, "vk-lower-2": LATER}}


def test_recording_drops_what_has_lapsed() -> None:
    moves = {"old": {"vk-lower-1": NOW - timedelta(seconds=1)}, "rs-1": {"vk-lower-2": NOW}}
    data = record_move(moves, "rs-2", "vk-lower-1", LATER, NOW)
    assert set(data) == {"rs-2"}, "an entry whose every node lapsed is gone"


def test_an_entry_edited_into_nonsense_is_left_out_the_others_hold() -> None:
    moves = parse_moves(
        {
            "bad-json": "{",
            "not-an-object": "[]",
            "bad-time": json.dumps({"vk-lower-1": "yesterday"}),
            # Compared with an aware moment it raised TypeError: the descheduler ended
            # at its next move of that controller's pod, again and again.
            "no-zone": json.dumps({"vk-lower-1": "2026-12-01T00:00:00"}),
            "rs-1": json.dumps({"vk-lower-1": "2026-11-25T10:10:00Z"}),
        }
    )
    assert moves == {"rs-1": {"vk-lower-1": LATER}}
    assert set(record_move(moves, "no-zone", "vk-lower-2", LATER, NOW)) == {"rs-1", "no-zone"}


def test_a_new_pod_stays_off_the_nodes_its_controller_left_until_the_record_lapses() -> None:
    moves = {"rs-1": {"vk-lower-1": LATER, "vk-lower-3": NOW}}
    assert kept_off(moves, owned_pod("rs-1"), NOW) == ["vk-lower-1"]
    assert kept_off(moves, owned_pod("rs-1"), LATER) == []
    assert kept_off(moves, owned_pod("rs-2"), NOW) == []
    assert kept_off(moves, owned_pod("rs-1", controller=False), NOW) == []
    assert kept_off(moves, owned_pod(None), NOW) == []
    assert controller_uid(owned_pod("rs-1")) == "rs-1"


# The apiserver refuses a field requirement of more than one value: one per node.
NOT_IN = [
    {"key": "metadata.name", "operator": "NotIn", "values": ["vk-a"]},
    {"key": "metadata.name", "operator": "NotIn", "values": ["vk-b"]},
]


def test_keeping_off_adds_the_expression_to_every_required_term() -> None:
    assert keep_off(None, ["vk-b", "vk-a"]) == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": NOT_IN}]
            }
        }
    }
    region = {"key": "topology.kubernetes.io/region", "operator": "In", "values": ["r"]}
    preferred = [{"weight": 1, "preference": {"matchExpressions": [region]}}]
    affinity: dict[str, Any] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [region]}, {"matchFields": [region]}]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": preferred,
        },
        "podAffinity": {"x": 1},
    }
    kept = keep_off(affinity, ["vk-a", "vk-b"])
    required = kept["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"] == [
        {"matchExpressions": [region], "matchFields": NOT_IN},
        {"matchFields": [region, *NOT_IN]},
    ]
    assert kept["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    assert kept["podAffinity"] == {"x": 1}
    first_term = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0]
    assert "matchFields" not in first_term, "the argument is not changed"


@given(specs, st.lists(st.sampled_from(["vk-lower-1", "vk-lower-2"]), min_size=1, unique=True))
def test_a_kept_off_pod_is_kept_off_above_and_never_below(
    spec: dict[str, Any], nodes: list[str]
) -> None:
    upper, annotations = stash_scheduling(spec, {}, kept_off=nodes)
    terms = upper["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms and all(
        {"key": "metadata.name", "operator": "NotIn", "values": [node]} in term["matchFields"]
        for term in terms
        for node in nodes
    )
    assert restore_scheduling(upper, annotations.get(keys.STASH_ANNOTATION)) == spec


MOVES = st.lists(st.sampled_from(["vk-lower-1", "vk-lower-2"]), unique=True)


@given(specs, MOVES, MOVES)
@example(
    # The pod's own term excludes the node it is also kept off: the second exclusion was
    # taken for a change of its own, and the view stashed in place of the original.
    spec={
        "containers": [{"name": "c", "image": "i"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [],
                            "matchFields": [
                                {
                                    "key": "metadata.name",
                                    "operator": "NotIn",
                                    "values": ["vk-lower-1"],
                                }
                            ],
                        }
                    ]
                }
            }
        },
    },
    first=["vk-lower-1"],
    second=[],
)
def test_a_move_record_that_comes_or_lapses_between_two_calls_loses_nothing_below(
    spec: dict[str, Any], first: list[str], second: list[str]
) -> None:
    """The apiserver calls the webhook again on its own answer when a later webhook
    changed the pod, and the moves read then may differ (a record written by the
    descheduler just before its eviction, or lapsing): until 2026-11-28 the spec's
    affinity, the view with the other moves, was taken for a changed one and stashed
    in place of the original, and the lower pod lost its own node affinity."""
    upper, annotations = stash_scheduling(spec, {}, kept_off=first)
    again, annotations_again = stash_scheduling(upper, annotations, kept_off=second)
    assert restore_scheduling(again, annotations_again.get(keys.STASH_ANNOTATION)) == spec
    if "affinity" in stash.decode(annotations.get(keys.STASH_ANNOTATION, "{}")):
        # Its first answer stands (without a stash of it, the pod is kept off as new).
        assert (again, annotations_again) == (upper, annotations)
