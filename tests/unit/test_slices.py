from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubekit.slices import (
    Amount,
    Applied,
    ClusterRoom,
    Decision,
    Headroom,
    LedgerEntry,
    Policy,
    Shortfall,
    SliceError,
    applied,
    bound_outside_slices,
    capped_size,
    check_edit,
    decide,
    grows,
    headroom,
    ledger_entry,
    namespace_quota,
    place,
    placement,
    placement_json,
    promised_to_others,
    quota_hard,
    size_changed,
    slice_count,
    slice_size,
    slices_of,
    without_room,
)

GI = 2**30
SLICE = Amount(cpu=2000, memory=4 * GI)
NOTHING = Amount()


def quota(hard: dict[str, str], **spec: object) -> dict[str, object]:
    return {"spec": {"hard": hard, **spec}}


def room(
    cluster: str, *cpus: int, promised: Amount = NOTHING, memory: int = 64 * GI
) -> ClusterRoom:
    return ClusterRoom(cluster, tuple(Amount(cpu * 1000, memory) for cpu in cpus), promised)


# -- quota and slice arithmetic -----------------------------------------------------------


def test_the_strictest_cap_per_resource_counts_and_scoped_quotas_do_not() -> None:
    quotas = [
        quota({"requests.cpu": "10", "requests.memory": "20Gi"}),
        quota({"cpu": "8", "pods": "100"}),
        quota({"requests.cpu": "1"}, scopes=["BestEffort"]),
        quota({"requests.memory": "1Gi"}, scopeSelector={"matchExpressions": []}),
    ]
    assert namespace_quota(quotas) == {"cpu": 8000, "memory": 20 * GI}
    assert namespace_quota([quota({"pods": "10"})]) == {}


def test_the_most_of_two_amounts_in_each_resource() -> None:
    assert Amount(1000, GI).most(Amount(500, 2 * GI)) == Amount(1000, 2 * GI)


def test_millicores_are_exact_and_rounded_up() -> None:
    assert namespace_quota([quota({"requests.cpu": "500m"})]) == {"cpu": 500}
    assert namespace_quota([quota({"requests.cpu": "0.0005"})]) == {"cpu": 1}
    assert slice_count({"cpu": 500}, Amount(cpu=250, memory=GI)) == 2
    # 500m is not 1 CPU (VirtualCluster's Quantity.Value() made it so).
    assert slice_count({"cpu": 2500}, Amount(cpu=500, memory=GI)) == 5


def test_slices_are_the_largest_ceiling_over_capped_resources() -> None:
    assert slice_count({"cpu": 10_000, "memory": 8 * GI}, SLICE) == 5
    assert slice_count({"cpu": 10_000, "memory": 30 * GI}, SLICE) == 8
    assert slice_count({"cpu": 10_001}, SLICE) == 6
    assert slice_count({}, SLICE) == 0
    assert slice_count({"cpu": 0}, SLICE) == 0


def test_only_capped_resources_are_in_a_slice() -> None:
    assert capped_size(SLICE, {"cpu": 1}) == Amount(cpu=2000)
    assert capped_size(SLICE, {"cpu": 1, "memory": 1}) == SLICE


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (None, SLICE),
        ('{"cpu": "1", "memory": "2Gi"}', Amount(1000, 2 * GI)),
        ('{"cpu": "500m"}', Amount(500, 4 * GI)),
        ('{"memory": "1Gi"}', Amount(2000, GI)),
        ('{"cpu": 3}', Amount(3000, 4 * GI)),
    ],
)
def test_slice_size(annotation: str | None, expected: Amount) -> None:
    assert slice_size(annotation) == expected


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        ("{", "not JSON"),
        ('["2"]', "JSON object"),
        ('{"gpu": "1"}', "not gpu"),
        ('{"cpu": "0"}', "above 0"),
        ('{"cpu": "-1"}', "above 0"),
        ('{"cpu": true}', "quantity"),
        ('{"memory": "lots"}', "invalid quantity"),
        ('{"cpu": "1e16"}', "too large"),
    ],
)
def test_a_bad_slice_size_says_what_is_wrong(annotation: str, message: str) -> None:
    with pytest.raises(SliceError, match=message):
        slice_size(annotation)


def test_placement_annotation_round_trip_and_errors() -> None:
    assert placement(None) == {}
    assert placement(" ") == {}
    assert placement('{"b": 2, "a": 0, "c": 1}') == {"b": 2, "c": 1}
    assert placement_json({"b": 2, "a": 0, "c": 1}) == '{"b":2,"c":1}'
    for bad in ('{"a": -1}', '{"a": 1.5}', '{"a": "2"}', "[1]", "{"):
        with pytest.raises(SliceError):
            placement(bad)


def test_headroom_forms() -> None:
    assert headroom("10%") == Headroom(percent=Fraction(10))
    assert headroom("0") == Headroom()
    assert headroom("cpu=2,memory=4Gi") == Headroom(amount=SLICE)
    assert headroom("cpu=500m") == Headroom(amount=Amount(cpu=500))
    assert Headroom(percent=Fraction(10)).of(Amount(6000, 10)) == Amount(600, 1)
    for bad in ("100%", "-1%", "x%", "gpu=1", "cpu=1,cpu=2", "cpu", "cpu=-1"):
        with pytest.raises(SliceError):
            headroom(bad)


# -- placement ----------------------------------------------------------------------------


def test_a_cluster_promises_allocatable_less_headroom_and_others_promises() -> None:
    cluster = ClusterRoom("a", (Amount(4000, 64 * GI), Amount(4000, 64 * GI)), Amount(2000, 0))
    assert cluster.slots(SLICE) == 3
    with_headroom = ClusterRoom(cluster.cluster, cluster.nodes, Amount(), Headroom(Fraction(10)))
    assert with_headroom.limit == Amount(7200, int(128 * GI * 0.9))
    assert with_headroom.slots(SLICE) == 3
    # No node takes a whole slice: none is promised, whatever the sum.
    assert room("small", *([1] * 10)).slots(SLICE) == 0
    assert room("a", 10, memory=6 * GI).slots(SLICE) == 1


def test_ten_cpus_of_two_cpu_slices_over_two_six_cpu_clusters() -> None:
    rooms = [room("lower-1", 2, 2, 2), room("lower-2", 2, 2, 2)]
    count = slice_count({"cpu": 10_000}, SLICE)
    assert place(count, SLICE, rooms, {}) == {"lower-1": 3, "lower-2": 2}
    assert place(count, SLICE, rooms, {}, policy=Policy.PACK) == {"lower-1": 3, "lower-2": 2}
    assert place(2, SLICE, rooms, {}, policy=Policy.PACK) == {"lower-1": 2}
    assert place(2, SLICE, rooms, {}) == {"lower-1": 1, "lower-2": 1}


def test_spread_prefers_the_roomiest_on_a_tie_and_pack_fills_one() -> None:
    rooms = [room("a", 4), room("b", 8)]
    assert place(1, SLICE, rooms, {}) == {"b": 1}
    assert place(3, SLICE, rooms, {}, policy=Policy.PACK) == {"b": 3}


def test_raising_adds_and_lowering_takes_back_where_least_used() -> None:
    rooms = [room("a", 8), room("b", 8)]
    assert place(5, SLICE, rooms, {"a": 1, "b": 1}) == {"a": 3, "b": 2}
    assert place(2, SLICE, rooms, {"a": 2, "b": 2}, used={"a": 2, "b": 0}) == {"a": 2}
    assert place(3, SLICE, rooms, {"a": 2, "b": 2}, used={"a": 1, "b": 1}) == {"a": 1, "b": 2}
    assert place(0, SLICE, rooms, {"a": 2}) == {}


def test_a_promise_grows_when_it_holds_more_of_any_resource() -> None:
    assert grows((5, Amount(cpu=1000)), 3, Amount(cpu=2000)), "fewer slices, more cpu"
    assert not grows((5, Amount(cpu=1000)), 2, Amount(cpu=2000))
    assert grows((2, Amount(cpu=2000)), 2, Amount(cpu=2000, memory=4 * 2**30)), "a cap added"
    assert not grows((2, Amount(cpu=2000, memory=1)), 2, Amount(cpu=2000)), "a cap removed"
    assert grows((0, Amount()), 1, Amount(cpu=1)) and not grows((3, Amount(cpu=1)), 0, Amount())


def test_lowering_never_takes_back_slices_the_pods_use() -> None:
    """A quota lowered to (or below) what runs: the room its pods use stays promised to
    the namespace, or it would be promised to another while they run on it."""
    rooms = [room("a", 8), room("b", 8)]
    assert place(4, SLICE, rooms, {"a": 3, "b": 2}, used={"a": 3, "b": 2}) == {"a": 3, "b": 2}
    assert place(4, SLICE, rooms, {"a": 3, "b": 2}, used={"a": 3, "b": 1}) == {"a": 3, "b": 1}
    assert place(1, SLICE, rooms, {"a": 3, "b": 2}, used={"a": 2}) == {"a": 2}


def test_a_first_placement_starts_where_the_namespace_s_pods_run() -> None:
    """Its pods use 3 slices' worth in a when its quota is added: spread from nothing, a
    got 2 (below what runs there, the rest promised to others) and b and c room the
    namespace could hardly use."""
    rooms = [room("a", 8), room("b", 8), room("c", 8)]
    assert place(4, SLICE, rooms, {}, used={"a": 3}) == {"a": 3, "b": 1}
    # More than the quota runs there: kept for the pods (the caller says so).
    assert place(2, SLICE, rooms, {}, used={"a": 3}) == {"a": 3}
    # Above what runs, held slices stay; below it, within the room only.
    assert place(4, SLICE, rooms, {"a": 1, "b": 1}, used={"a": 2}) == {"a": 2, "b": 1, "c": 1}
    assert place(2, SLICE, [room("a", 2), room("b", 8)], {}, used={"a": 3}) == {"a": 1, "b": 1}


def test_promises_made_are_kept_when_a_cluster_shrinks_or_does_not_answer() -> None:
    assert place(4, SLICE, [room("a", 2)], {"a": 4}) == {"a": 4}
    assert place(3, SLICE, [room("b", 4)], {"gone-quiet": 1}) == {"gone-quiet": 1, "b": 2}


def test_a_cluster_without_room_keeps_what_it_holds_and_takes_no_more() -> None:
    full = without_room(room("a", 8, promised=Amount(2000, 0)))
    assert full.slots(SLICE) == 0
    assert place(3, SLICE, [full, room("b", 8)], {"a": 1}) == {"a": 1, "b": 2}


def test_a_shortfall_keeps_the_placement_and_says_what_is_missing() -> None:
    rooms = [room("a", 2, 2), room("b", 1, 1, 1, 1)]
    result = place(3, SLICE, rooms, {"a": 1})
    assert isinstance(result, Shortfall)
    assert (result.wanted, result.placeable) == (3, 2)
    assert "1 missing (cpu 2, memory 4Gi)" in result.message
    assert "a: room for 2" in result.message
    assert "b: room for 0" in result.message and "no node takes a slice" in result.message


def test_an_edit_is_checked_against_the_room() -> None:
    rooms = [room("a", 4), room("b", 4, promised=Amount(2000, 0))]
    assert check_edit({"a": 2, "b": 1}, 3, SLICE, rooms, {}) is None
    assert "holds 2 slices, the quota makes 3" in str(check_edit({"a": 2}, 3, SLICE, rooms, {}))
    assert "b has room for 1" in str(check_edit({"a": 1, "b": 2}, 3, SLICE, rooms, {}))
    assert "no lower cluster c" in str(check_edit({"c": 3}, 3, SLICE, rooms, {}))
    # Slices already held there stay allowed even if the cluster has shrunk since.
    assert check_edit({"a": 1, "b": 2}, 3, SLICE, rooms, {"b": 2}) is None
    # s holds 2 and does not answer: they stay where they are, or the edit is refused
    # (its ledger cannot be written; recorded as made, the edit would be undone later).
    assert check_edit({"a": 1, "s": 2}, 3, SLICE, rooms, {"s": 2}) is None
    refusal = check_edit({"a": 2, "s": 1}, 3, SLICE, rooms, {"s": 2})
    assert "the estimator of s does not answer" in str(refusal)


@st.composite
def pools(
    draw: st.DrawFn,
) -> tuple[list[ClusterRoom], Amount, int, dict[str, int], dict[str, int], Policy]:
    clusters = draw(st.integers(1, 4))
    rooms = []
    for index in range(clusters):
        nodes = tuple(
            Amount(draw(st.integers(0, 16)) * 500, draw(st.integers(0, 32)) * GI // 2)
            for _ in range(draw(st.integers(0, 5)))
        )
        promised = Amount(draw(st.integers(0, 20)) * 500, draw(st.integers(0, 40)) * GI // 2)
        kept_out = draw(
            st.sampled_from(
                [Headroom(), Headroom(percent=Fraction(10)), Headroom(amount=Amount(1000, GI))]
            )
        )
        rooms.append(ClusterRoom(f"c{index}", nodes, promised, kept_out))
    # cpu only, memory only, or both; never neither.
    cpu, memory = draw(
        st.tuples(st.integers(0, 8), st.integers(0, 8)).filter(lambda pair: any(pair))
    )
    size = Amount(cpu * 500, memory * GI // 2)
    # Some clusters hold slices already, one maybe gone quiet (not among the rooms).
    names = [room.cluster for room in rooms] + ["quiet"]
    current = {name: held for name in names if (held := draw(st.integers(0, 3)))}
    # Pods may use more than is held, or run where nothing is.
    used = {name: used for name in names if (used := draw(st.integers(0, 4)))}
    rooms = draw(st.permutations(rooms))
    return rooms, size, draw(st.integers(0, 12)), current, used, draw(st.sampled_from(list(Policy)))


@settings(max_examples=400, deadline=None)
@given(pools())
def test_placement_never_grows_a_promise_past_the_room_and_is_stable(
    pool: tuple[list[ClusterRoom], Amount, int, dict[str, int], dict[str, int], Policy],
) -> None:
    rooms, size, count, current, used, policy = pool
    result = place(count, size, rooms, current, used, policy)
    # The same state in any order of the clusters gives the same placement.
    assert result == place(
        count, size, sorted(rooms, key=lambda r: r.cluster), current, used, policy
    )
    if isinstance(result, Shortfall):
        # A shortfall only when the room, brute-forced, is short.
        room_for = sum(max(room.slots(size), current.get(room.cluster, 0)) for room in rooms)
        assert room_for + current.get("quiet", 0) < count
        return
    answering = {room.cluster for room in rooms}
    # The quota's count, unless more may not be taken back: what a quiet cluster holds,
    # and in the others what the namespace's pods use of what they held or have room for.
    kept = current.get("quiet", 0) + sum(
        min(used.get(room.cluster, 0), max(current.get(room.cluster, 0), room.slots(size)))
        for room in rooms
    )
    assert sum(result.values()) == max(count, kept)
    assert result.get("quiet", 0) == current.get("quiet", 0), "a quiet cluster is not touched"
    for room in rooms:
        held = result.get(room.cluster, 0)
        if held > current.get(room.cluster, 0):
            # What grew stays within what the cluster can promise beside the others, in
            # every resource a slice holds, and on a node that takes a slice.
            total = room.promised_to_others + size.times(held)
            for resource in ("cpu", "memory"):
                if size.get(resource):
                    assert total.get(resource) <= room.limit.get(resource)
            assert any(size.within(node) for node in room.nodes)
    assert set(result) <= answering | {"quiet"}
    # Placing again from the result changes nothing.
    assert place(count, size, rooms, result, used, policy) == result


# -- decisions from the annotations ------------------------------------------------------


def test_decide_places_on_from_its_own_annotation() -> None:
    rooms = [room("a", 8), room("b", 8)]
    before = Applied(SLICE, {"a": 1})
    decision = decide(placement_json(before.slices), before, 2, SLICE, rooms, {"a": 1}, {})
    assert decision == Decision({"a": 1, "b": 1})
    assert decide(None, None, 2, SLICE, rooms, {}, {}) == Decision({"a": 1, "b": 1})


def test_decide_honours_a_feasible_edit_and_refuses_others() -> None:
    rooms = [room("a", 8), room("b", 8)]
    before = Applied(SLICE, {"a": 1, "b": 1})
    assert decide('{"b": 2}', before, 2, SLICE, rooms, before.slices, {}) == Decision({"b": 2})
    refused = decide('{"a": 1, "b": 5}', before, 6, SLICE, rooms, before.slices, {})
    assert refused.target == {"a": 3, "b": 3}
    assert refused.refused_edit == "b has room for 4 slices of cpu 2, memory 4Gi, not 5"
    broken = decide("{", before, 2, SLICE, rooms, before.slices, {})
    assert broken.target == {"a": 1, "b": 1} and "not JSON" in str(broken.refused_edit)


def test_decide_places_a_cleared_annotation_afresh() -> None:
    rooms = [room("a", 8), room("b", 16)]
    before = Applied(SLICE, {"a": 2})
    assert decide("", before, 2, SLICE, rooms, before.slices, {}) == Decision({"a": 1, "b": 1})


def test_neither_a_cleared_annotation_nor_an_edit_takes_back_slices_in_use() -> None:
    rooms = [room("a", 8), room("b", 8)]
    before = Applied(SLICE, {"a": 4})
    used = {"a": 3}
    for cleared in ("", None, "{}"):
        target = decide(cleared, before, 4, SLICE, rooms, before.slices, used).target
        assert target == {"a": 3, "b": 1}, cleared
    refused = decide('{"a": 1, "b": 3}', before, 4, SLICE, rooms, before.slices, used)
    assert refused.target == {"a": 4}
    assert refused.refused_edit == (
        "the namespace's pods in a use 3 slices of cpu 2, memory 4Gi, more than 1"
    )
    assert decide('{"a": 3, "b": 1}', before, 4, SLICE, rooms, before.slices, used) == Decision(
        {"a": 3, "b": 1}
    )


def test_applied_round_trip_and_what_is_not_ours_is_none() -> None:
    record = Applied(SLICE, {"a": 2})
    assert applied(record.encode()) == record
    for unreadable in (None, "", "{", '{"size": {}}', '{"size": {"cpu": 1, "memory": 1}}'):
        assert applied(unreadable) is None


def test_ledger_entries_sum_and_hold_the_namespace() -> None:
    entry = LedgerEntry("team", "origin", 3, Amount(cpu=500))
    assert ledger_entry("ns", entry.encode()) == entry
    ledger = {"ns": entry.encode(), "other": LedgerEntry("x", "o", 2, SLICE).encode()}
    assert promised_to_others(ledger, "ns") == SLICE.times(2)
    assert promised_to_others(ledger, "other") == Amount(cpu=1500)
    assert quota_hard(entry) == {"requests.cpu": "1500m"}
    assert quota_hard(LedgerEntry("t", "o", 2, SLICE)) == {
        "requests.cpu": "4",
        "requests.memory": "8Gi",
    }
    for bad in (
        "{",
        '{"namespace": "t"}',
        '{"namespace":"t","origin":"o","slices":-1,"size":{"cpu":1,"memory":1}}',
    ):
        with pytest.raises(SliceError, match="entry ns"):
            ledger_entry("ns", bad)


def test_slices_of_usage_round_up() -> None:
    assert slices_of(Amount(cpu=2001), SLICE) == 2
    assert slices_of(Amount(cpu=0, memory=9 * GI), SLICE) == 3
    assert slices_of(Amount(), SLICE) == 0
    assert slices_of(Amount(memory=GI), Amount(cpu=1000)) == 0


def test_a_headroom_larger_than_the_cluster_leaves_nothing() -> None:
    tiny = ClusterRoom("a", (Amount(1000, GI),), Amount(), Headroom(amount=Amount(2000, 2 * GI)))
    assert tiny.limit == Amount()
    short = place(1, SLICE, [tiny], {})
    assert isinstance(short, Shortfall) and "a: room for 0 (can promise 0" in short.message


def test_a_zero_cap_promises_none_of_that_resource() -> None:
    quota = {"cpu": 0, "memory": 10 * GI}
    size = capped_size(SLICE, quota)
    assert size == Amount(memory=4 * GI)
    assert slice_count(quota, size) == 3
    assert slice_count({"cpu": 0}, capped_size(SLICE, {"cpu": 0})) == 0


def test_a_cap_added_or_removed_is_not_a_size_change() -> None:
    assert not size_changed(Amount(cpu=2000), Amount(2000, 4 * GI))
    assert not size_changed(Amount(2000, 4 * GI), Amount(cpu=2000))
    assert size_changed(Amount(cpu=2000), Amount(cpu=1000))
    assert size_changed(Amount(2000, 4 * GI), Amount(2000, 8 * GI))


def test_the_placement_annotation_removed_places_afresh() -> None:
    rooms = [room("a", 8), room("b", 16)]
    before = Applied(SLICE, {"a": 2})
    assert decide(None, before, 2, SLICE, rooms, before.slices, {}) == Decision({"a": 1, "b": 1})


def test_a_pod_bound_past_the_extender_outside_its_slices_is_refused() -> None:
    record = Applied(SLICE, {"a": 2, "b": 1, "c": 0}).encode()
    assert bound_outside_slices("ns", record, "c", held_here=False) == (
        "namespace ns holds no quota slices in c (its slices: a 2, b 1); "
        "a pod bound here by spec.nodeName would run outside it"
    )
    assert bound_outside_slices("ns", record, "d", held_here=False) is not None


@pytest.mark.parametrize(
    ("record", "cluster", "held_here"),
    [
        (None, "c", False),  # not sliced, or not placed yet: nothing to hold it to
        ("not json", "c", False),
        (Applied(SLICE, {"a": 0}).encode(), "c", False),  # promised nothing anywhere
        (Applied(SLICE, {"a": 2, "c": 1}).encode(), "c", False),  # the ledger lags
        (Applied(SLICE, {"a": 2}).encode(), "c", True),  # the record lags
    ],
)
def test_a_pod_bound_where_its_namespace_may_hold_slices_is_made(
    record: str | None, cluster: str, held_here: bool
) -> None:
    assert bound_outside_slices("ns", record, cluster, held_here) is None
