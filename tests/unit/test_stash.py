import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubekit import keys, stash
from kubekit.stash import (
    PROVIDER_TOLERATION,
    VIRTUAL_NODE_SELECTOR,
    StashError,
    restore_scheduling,
    stash_scheduling,
    stash_update,
)

label_keys = st.sampled_from(
    [
        keys.CLUSTER_ID_LABEL,
        "topology.kubernetes.io/region",
        "topology.kubernetes.io/zone",
        "disk",
        "kubernetes.io/hostname",
        "gpu",
    ]
)
values = st.text("abcdef0123", min_size=1, max_size=4)
expressions = st.lists(
    st.fixed_dictionaries(
        {
            "key": label_keys,
            "operator": st.just("In"),
            "values": st.lists(values, min_size=1, max_size=2),
        }
    ),
    max_size=3,
)
name_fields = st.lists(
    st.fixed_dictionaries(
        {
            "key": st.just("metadata.name"),
            "operator": st.sampled_from(["In", "NotIn"]),
            "values": st.lists(st.sampled_from(["vk-lower-1", "vk-lower-2"]), min_size=1),
        }
    ),
    max_size=1,
)
terms = st.fixed_dictionaries(
    {"matchExpressions": expressions}, optional={"matchFields": name_fields}
)
node_affinity = st.fixed_dictionaries(
    {},
    optional={
        "requiredDuringSchedulingIgnoredDuringExecution": st.fixed_dictionaries(
            {"nodeSelectorTerms": st.lists(terms, min_size=1, max_size=3)}
        ),
        "preferredDuringSchedulingIgnoredDuringExecution": st.lists(
            st.fixed_dictionaries({"weight": st.integers(1, 100), "preference": terms}), max_size=2
        ),
    },
)
pod_term = st.fixed_dictionaries(
    {
        "topologyKey": label_keys,
        "labelSelector": st.fixed_dictionaries(
            {"matchLabels": st.dictionaries(values, values, max_size=1)}
        ),
    }
)
pod_affinity = st.fixed_dictionaries(
    {},
    optional={
        "requiredDuringSchedulingIgnoredDuringExecution": st.lists(pod_term, max_size=2),
        "preferredDuringSchedulingIgnoredDuringExecution": st.lists(
            st.fixed_dictionaries({"weight": st.integers(1, 100), "podAffinityTerm": pod_term}),
            max_size=2,
        ),
    },
)
tolerations = st.lists(
    st.fixed_dictionaries(
        {
            "key": st.sampled_from(
                [keys.PROVIDER_TAINT_KEY, "node.kubernetes.io/not-ready", "dedicated", "gpu"]
            ),
            "operator": st.sampled_from(["Exists", "Equal"]),
        },
        optional={"effect": st.sampled_from(["NoSchedule", "NoExecute"]), "value": values},
    ),
    max_size=4,
)
spread = st.lists(
    st.fixed_dictionaries(
        {
            "maxSkew": st.integers(1, 3),
            "topologyKey": label_keys,
            "whenUnsatisfiable": st.sampled_from(["DoNotSchedule", "ScheduleAnyway"]),
        }
    ),
    max_size=2,
)
specs = st.fixed_dictionaries(
    {"containers": st.just([{"name": "c", "image": "i"}])},
    optional={
        "nodeSelector": st.dictionaries(label_keys, values, max_size=3),
        "affinity": st.fixed_dictionaries(
            {},
            optional={
                "nodeAffinity": node_affinity,
                "podAffinity": pod_affinity,
                "podAntiAffinity": pod_affinity,
            },
        ),
        "tolerations": tolerations,
        "topologySpreadConstraints": spread,
    },
)


@given(specs)
def test_restore_of_stash_is_the_original(spec: dict[str, Any]) -> None:
    stashed, annotations = stash_scheduling(spec, {"other": "kept"})
    assert annotations["other"] == "kept"
    assert restore_scheduling(stashed, annotations.get(keys.STASH_ANNOTATION)) == spec


@given(specs)
def test_stashing_twice_changes_nothing(spec: dict[str, Any]) -> None:
    once = stash_scheduling(spec, {})
    assert stash_scheduling(*once) == once


@given(specs)
def test_upper_view_only_speaks_of_cluster_level_keys(spec: dict[str, Any]) -> None:
    stashed, _ = stash_scheduling(spec, {})
    kept = {keys.CLUSTER_ID_LABEL, "topology.kubernetes.io/region"}
    # And the virtual nodes' own label, which keeps the pod off ordinary upper nodes: one
    # a kubelet cannot set on its own Node.
    selector = stashed.get("nodeSelector") or {}
    if not spec.get("nodeName"):
        assert selector[keys.PROVEN_VIRTUAL_NODE_LABEL] == keys.VIRTUAL_NODE_LABEL_VALUE
    assert set(selector) - {keys.PROVEN_VIRTUAL_NODE_LABEL} <= kept
    for constraint in stashed.get("topologySpreadConstraints") or []:
        assert constraint["topologyKey"] in kept
    assert PROVIDER_TOLERATION in stashed["tolerations"] or any(
        t.get("key") == keys.PROVIDER_TAINT_KEY
        and t.get("operator") == "Exists"
        and t.get("effect") in (None, "NoSchedule")
        for t in stashed["tolerations"]
    )
    node_affinity = (stashed.get("affinity") or {}).get("nodeAffinity") or {}
    for term in (node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get(
        "nodeSelectorTerms", []
    ):
        assert term.get("matchExpressions") or term.get("matchFields")
        # Or keeping nodes away by a virtual Node's own labels, which may keep it off one.
        assert all(
            e["key"] in kept
            or (e["key"] in stash.OWN_LABEL_KEYS and e["operator"] not in stash.SELECTING_OPERATORS)
            for e in term.get("matchExpressions") or []
        )
        assert all(f["key"] == "metadata.name" for f in term.get("matchFields") or [])


def test_a_pin_to_a_virtual_node_by_name_holds_above() -> None:
    """Dropped, the pod could be bound to another virtual node, whose lower nodes all fail
    the pin: it would wait below for good."""
    pin = {"key": "metadata.name", "operator": "In", "values": ["vk-lower-1"]}
    spec = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [pin],
                            "matchExpressions": [
                                {"key": "disk", "operator": "In", "values": ["a"]}
                            ],
                        }
                    ]
                }
            }
        }
    }
    stashed, _ = stash_scheduling(spec, {})
    required = stashed["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == {"nodeSelectorTerms": [{"matchFields": [pin]}]}


def test_required_affinity_with_an_unconstrained_branch_is_dropped_above() -> None:
    spec = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "disk", "operator": "In", "values": ["ssd"]}
                            ]
                        },
                        {
                            "matchExpressions": [
                                {"key": keys.CLUSTER_ID_LABEL, "operator": "In", "values": ["a"]}
                            ]
                        },
                    ]
                }
            }
        }
    }
    stashed, _ = stash_scheduling(spec, {})
    assert "affinity" not in stashed


def test_unreadable_stash_is_an_error() -> None:
    with pytest.raises(StashError, match="not JSON"):
        restore_scheduling({}, "{")
    with pytest.raises(StashError, match="unknown stash version 7"):
        restore_scheduling({}, '{"version": 7, "originals": {}}')
    with pytest.raises(StashError, match="keys among"):
        restore_scheduling({}, '{"version": 1, "originals": {"containers": []}}')
    # JSON's true is no version 1, though Python's True == 1.
    with pytest.raises(StashError, match="unknown stash version True"):
        restore_scheduling({}, '{"version": true, "originals": {}}')


@pytest.mark.parametrize(
    ("originals", "where"),
    [
        ('{"tolerations": "x"}', "originals.tolerations must be a JSON array, not str"),
        ('{"tolerations": ["x"]}', "originals.tolerations[0] must be a JSON object, not str"),
        ('{"nodeSelector": {"disk": 1}}', "originals.nodeSelector.disk must be a str, not int"),
        ('{"affinity": []}', "originals.affinity must be a JSON object, not list"),
        (
            '{"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": '
            '{"nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "values": "b"}]}]}}}}',
            "nodeSelectorTerms[0].matchExpressions[0].values must be a JSON array, not str",
        ),
        (
            '{"topologySpreadConstraints": [{"maxSkew": true}]}',
            "originals.topologySpreadConstraints[0].maxSkew must be a int, not bool",
        ),
    ],
)
def test_a_stash_whose_fields_a_pod_could_not_have_is_an_error(originals: str, where: str) -> None:
    """Anyone may write the annotation; what would break the code reading the restored
    pod is refused with where it is."""
    with pytest.raises(StashError) as refused:
        restore_scheduling({}, f'{{"version": 1, "originals": {originals}}}')
    assert where in str(refused.value)


@given(specs)
def test_every_toleration_stays_above(spec: dict[str, Any]) -> None:
    stashed, _ = stash_scheduling(spec, {})
    tolerations = spec.get("tolerations") or []
    assert stashed["tolerations"][: len(tolerations)] == tolerations


def test_a_toleration_of_every_taint_stays_above_and_tolerates_the_provider_taint() -> None:
    """The node controller's unreachable taint would otherwise evict, after the default
    300 s, a pod meant to tolerate everything."""
    spec = {"tolerations": [{"operator": "Exists"}]}
    stashed, annotations = stash_scheduling(spec, {})
    assert stashed["tolerations"] == [{"operator": "Exists"}]
    assert stash.decode(annotations[keys.STASH_ANNOTATION]) == {"nodeSelector": None}


def test_tolerations_added_above_reach_the_restored_pod() -> None:
    spec = {"tolerations": [{"key": "dedicated", "operator": "Exists"}]}
    stashed, annotations = stash_scheduling(spec, {})
    assert stashed["tolerations"] == [*spec["tolerations"], PROVIDER_TOLERATION]
    spot = {"key": "spot", "operator": "Exists", "effect": "NoExecute"}
    stashed["tolerations"].append(spot)
    restored = restore_scheduling(stashed, annotations[keys.STASH_ANNOTATION])
    assert restored["tolerations"] == [*spec["tolerations"], spot]


def test_a_stash_cannot_give_the_lower_pod_a_toleration_the_upper_pod_lacks() -> None:
    """Anyone may write the annotation, and the upper cluster's admission (a policy on
    tolerations) sees only the spec: a toleration of every taint written into the stash
    would have let the lower pod past the lower nodes' taints, drains included."""
    forged = json.dumps({"version": 1, "originals": {"tolerations": [{"operator": "Exists"}]}})
    restored = restore_scheduling({"tolerations": [PROVIDER_TOLERATION]}, forged)
    assert not restored["tolerations"]
    dedicated = {"key": "dedicated", "operator": "Exists"}
    restored = restore_scheduling({"tolerations": [dedicated, PROVIDER_TOLERATION]}, forged)
    assert restored["tolerations"] == [dedicated]


@given(specs)
def test_stashing_the_stashed_pod_again_changes_nothing(spec: dict[str, Any]) -> None:
    stashed, annotations = stash_scheduling(spec, {})
    assert stash_scheduling(stashed, annotations) == (stashed, annotations)


GVISOR = {"sandbox": "gvisor"}
IN_LOWER_1 = {keys.CLUSTER_ID_LABEL: "lower-1"}
# The view above of a node selector whose only cluster-level entry is IN_LOWER_1.
ABOVE_IN_LOWER_1 = {**VIRTUAL_NODE_SELECTOR, **IN_LOWER_1}


def test_node_selector_entries_put_back_after_the_webhook_are_stashed_again() -> None:
    """After the webhook changed a pod the apiserver runs the RuntimeClass plugin again,
    which puts its class's node selector back; reinvoked, the webhook moves it again."""
    spec = {"nodeSelector": {**GVISOR, "disk": "ssd", **IN_LOWER_1}}
    stashed, annotations = stash_scheduling(spec, {})
    assert stashed["nodeSelector"] == ABOVE_IN_LOWER_1
    put_back = {**stashed, "nodeSelector": {**stashed["nodeSelector"], **GVISOR}}
    again, annotations_again = stash_scheduling(put_back, annotations)
    assert (again, annotations_again) == (stashed, annotations)


def test_a_node_selector_not_stashed_at_first_is_stashed_once_entries_come_back() -> None:
    spec: dict[str, Any] = {
        "nodeSelector": dict(ABOVE_IN_LOWER_1),
        "tolerations": [PROVIDER_TOLERATION],
    }
    stashed, annotations = stash_scheduling(spec, {})
    assert (stashed, annotations) == (spec, {})
    put_back = {**spec, "nodeSelector": {**ABOVE_IN_LOWER_1, **GVISOR}}
    # A stash written meanwhile (another field's) is kept beside it.
    other = {keys.STASH_ANNOTATION: stash.encode({"topologySpreadConstraints": None})}
    again, annotations_again = stash_scheduling(put_back, other)
    assert again["nodeSelector"] == ABOVE_IN_LOWER_1
    restored = restore_scheduling(again, annotations_again[keys.STASH_ANNOTATION])
    assert restored["nodeSelector"] == {**ABOVE_IN_LOWER_1, **GVISOR}
    assert (
        stash.decode(annotations_again[keys.STASH_ANNOTATION])["topologySpreadConstraints"] is None
    )


def test_a_stashed_affinity_is_the_one_the_spec_shows_when_they_differ() -> None:
    """A stash written by hand beside an affinity a policy imposed (or a webhook changed
    after ours): the lower pod gets the spec's, which the upper admission saw."""
    imposed = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["t1"]}]}
                ]
            }
        }
    }
    forged = stash.encode({"affinity": None})
    spec = {"affinity": imposed, "tolerations": [PROVIDER_TOLERATION]}
    stashed, annotations = stash_scheduling(spec, {keys.STASH_ANNOTATION: forged})
    assert "affinity" not in stashed
    restored = restore_scheduling(stashed, annotations[keys.STASH_ANNOTATION])
    assert restored["affinity"] == imposed


def update(old: dict[str, Any], annotations: dict[str, str], new: dict[str, Any]) -> Any:
    return stash_update(old, annotations[keys.STASH_ANNOTATION], new, annotations)


@given(specs)
def test_a_manifest_applied_again_leaves_the_stashed_pod_as_it_was(spec: dict[str, Any]) -> None:
    """``kubectl apply`` of the pod's manifest again sets every field the manifest has
    (those the webhook moved included); the update changes none of them."""
    stashed, annotations = stash_scheduling(spec, {})
    applied = {**stashed, **{f: spec[f] for f in stash.FIELDS if f in spec}}
    if keys.STASH_ANNOTATION in annotations:
        assert update(stashed, annotations, applied) == (stashed, annotations)


def test_a_manifest_applied_again_over_a_node_selector_the_apiserver_extended() -> None:
    """The RuntimeClass plugin added its class's entries at create; an apply merges the
    manifest's entries into the upper selector, which then holds part of the stashed one."""
    stashed, annotations = stash_scheduling({"nodeSelector": {**GVISOR, "disk": "ssd"}}, {})
    applied = {**stashed, "nodeSelector": {"disk": "ssd"}}
    assert update(stashed, annotations, applied) == (stashed, annotations)


SPOT = {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}


def test_an_applied_manifest_without_the_provider_toleration_keeps_it() -> None:
    spec = {"nodeSelector": {"disk": "ssd"}, "tolerations": [SPOT]}
    stashed, annotations = stash_scheduling(spec, {})
    assert stashed["tolerations"] == [SPOT, PROVIDER_TOLERATION]
    added = {"key": "gpu", "operator": "Exists"}
    updated, _ = update(stashed, annotations, {**stashed, "tolerations": [SPOT, added]})
    assert updated["tolerations"] == [SPOT, added, PROVIDER_TOLERATION]
    assert updated["nodeSelector"] == VIRTUAL_NODE_SELECTOR


GATED = {"schedulingGates": [{"name": "example.com/quota"}]}
GPU_TYPE = {"type": "gpu"}


def test_a_pod_given_the_entry_of_before_keeps_it_and_gains_no_stash_entry() -> None:
    """Until 2026-11-29 the webhook selected kubestrata.io/virtual-node, which a kubelet
    may set on its own Node; a pod given it then keeps it (the field is immutable), an
    apply without it puts it back, and it is never taken for one of the pod's own: a copy
    made of it (the descheduler's) gets today's entry, with the same stash."""
    before = {"nodeSelector": {keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE}}
    stashed, annotations = stash_scheduling({"nodeSelector": dict(GPU_TYPE)}, {})
    admitted = {**stashed, **before}
    copied, copy_annotations = stash_scheduling(admitted, annotations)
    assert copied == stashed and copy_annotations == annotations
    updated, _ = update(admitted, annotations, {**admitted, "nodeSelector": dict(GPU_TYPE)})
    assert updated["nodeSelector"] == before["nodeSelector"]
    assert restore_scheduling(updated, annotations[keys.STASH_ANNOTATION])["nodeSelector"] == (
        GPU_TYPE
    )


def test_a_pod_keeps_to_virtual_nodes_above_whatever_its_own_type_entry() -> None:
    """The virtual nodes' entry is a key of our own: a pod's `type` entry (lower nodes'
    label) is stashed as any other, and an apply that writes it again is put back."""
    stashed, annotations = stash_scheduling({"nodeSelector": dict(GPU_TYPE)}, {})
    assert stashed["nodeSelector"] == VIRTUAL_NODE_SELECTOR
    assert restore_scheduling(stashed, annotations[keys.STASH_ANNOTATION])["nodeSelector"] == (
        GPU_TYPE
    )
    for applied in (GPU_TYPE, {**VIRTUAL_NODE_SELECTOR, **GPU_TYPE}):
        assert update(stashed, annotations, {**stashed, "nodeSelector": applied}) == (
            stashed,
            annotations,
        )


def test_a_pod_made_bound_to_a_node_gets_no_virtual_node_entry() -> None:
    """No scheduler reads it, and an ordinary node's kubelet would refuse the pod for it
    (`kubectl debug node/...` in a federated namespace)."""
    stashed, annotations = stash_scheduling({"nodeName": "worker-1"}, {})
    assert "nodeSelector" not in stashed
    assert "nodeSelector" not in stash.decode(annotations[keys.STASH_ANNOTATION])


def test_a_bound_copy_of_a_stashed_pod_stashes_nothing_more() -> None:
    """The descheduler's copy of a bare pod keeps the spec as it was above (the virtual
    nodes' entry included) and is bound to a virtual node: the entry is ours, not one
    added since, and never reaches the lower pod."""
    stashed, annotations = stash_scheduling({"nodeSelector": {"disk": "ssd"}}, {})
    copy = {**stashed, "nodeName": "vk-lower-2"}
    again, annotations_again = stash_scheduling(copy, annotations)
    assert annotations_again == annotations
    assert restore_scheduling(again, annotations_again[keys.STASH_ANNOTATION])["nodeSelector"] == {
        "disk": "ssd"
    }


def test_a_gated_pod_given_a_type_entry_has_it_stashed() -> None:
    stashed, annotations = stash_scheduling(dict(GATED), {})
    given = {**stashed, "nodeSelector": {**stashed["nodeSelector"], **GPU_TYPE}}
    updated, updated_annotations = update(stashed, annotations, given)
    assert updated["nodeSelector"] == VIRTUAL_NODE_SELECTOR
    restored = restore_scheduling(updated, updated_annotations[keys.STASH_ANNOTATION])
    assert restored["nodeSelector"] == GPU_TYPE


def test_a_gated_pod_given_a_node_selector_has_it_stashed_beside_the_stashed_one() -> None:
    """A queueing controller gives a gated pod its node selector before it lifts the gate;
    the entries only lower nodes carry join the stash, a cluster-level one stays above."""
    stashed, annotations = stash_scheduling({**GATED, "nodeSelector": {"disk": "ssd"}}, {})
    given_more = {**stashed, "nodeSelector": {**IN_LOWER_1, "flavor": "spot"}}
    updated, updated_annotations = update(stashed, annotations, given_more)
    assert updated["nodeSelector"] == ABOVE_IN_LOWER_1
    restored = restore_scheduling(updated, updated_annotations[keys.STASH_ANNOTATION])
    assert restored["nodeSelector"] == {"disk": "ssd", "flavor": "spot", **IN_LOWER_1}


@given(specs, st.dictionaries(label_keys, values, max_size=3))
def test_stashing_an_update_again_changes_nothing(
    spec: dict[str, Any], given: dict[str, str]
) -> None:
    """After another webhook changed the pod the webhook is called again on its own
    answer, with the old pod as it was stored."""
    stashed, annotations = stash_scheduling({**spec, **GATED}, {})
    if keys.STASH_ANNOTATION not in annotations:
        annotations = {keys.STASH_ANNOTATION: stash.encode({})}
    new = {**stashed, "nodeSelector": {**given, **(stashed.get("nodeSelector") or {})}}
    old_stash = annotations[keys.STASH_ANNOTATION]
    try:
        once = stash_update(stashed, old_stash, new, annotations)
    except stash.StashRefused:
        return
    assert stash_update(stashed, old_stash, *once) == once


@pytest.mark.parametrize("entry", [keys.VIRTUAL_NODE_LABEL, keys.PROVEN_VIRTUAL_NODE_LABEL])
def test_a_gated_pod_of_either_webhook_entry_given_more_keeps_its_entry_alone(
    entry: str,
) -> None:
    """A gated pod admitted with the entry of before 2026-11-29 (or today's) that a
    queueing controller gives a lower node's entry: its entry stays the only one of the
    webhook's above, neither entry joins the stash as the pod's, and the webhook called
    again on its own answer changes nothing more."""
    stashed, annotations = stash_scheduling({**GATED, "nodeSelector": {"disk": "ssd"}}, {})
    admitted = {**stashed, "nodeSelector": {entry: keys.VIRTUAL_NODE_LABEL_VALUE}}
    other = ({*stash.WEBHOOK_SELECTOR_ENTRIES} - {entry}).pop()
    given = {"flavor": "spot", entry: "true", other: "true"}
    updated, updated_annotations = update(
        admitted, annotations, {**admitted, "nodeSelector": given}
    )
    assert updated["nodeSelector"] == {entry: keys.VIRTUAL_NODE_LABEL_VALUE}
    restored = restore_scheduling(updated, updated_annotations[keys.STASH_ANNOTATION])
    assert restored["nodeSelector"] == {"disk": "ssd", "flavor": "spot"}
    again = stash_update(admitted, annotations[keys.STASH_ANNOTATION], updated, updated_annotations)
    assert again == (updated, updated_annotations)


def test_a_gated_pod_asking_for_another_value_of_a_stashed_key_is_refused() -> None:
    """The apiserver sees no entry for the key above and would take it; the stashed one
    would be lost."""
    stashed, annotations = stash_scheduling({**GATED, "nodeSelector": {"disk": "ssd"}}, {})
    with pytest.raises(stash.StashRefused, match="asks for disk=ssd already"):
        update(stashed, annotations, {**stashed, "nodeSelector": {"disk": "hdd"}})


def test_a_gated_pod_given_a_cluster_level_node_affinity_keeps_it_above_only() -> None:
    original = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}}
            ]
        }
    }
    stashed, annotations = stash_scheduling({**GATED, "affinity": original}, {})
    in_lower_1 = {"key": keys.CLUSTER_ID_LABEL, "operator": "In", "values": ["lower-1"]}
    given = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [in_lower_1]}]
            }
        }
    }
    updated, updated_annotations = update(stashed, annotations, {**stashed, "affinity": given})
    assert updated["affinity"] == given
    restored = restore_scheduling(updated, updated_annotations[keys.STASH_ANNOTATION])
    assert restored["affinity"] == original
    on_disk = {"key": "disk", "operator": "In", "values": ["ssd"]}
    lower_level = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [on_disk]}]
            }
        }
    }
    with pytest.raises(stash.StashRefused, match="give those labels as a nodeSelector"):
        update(stashed, annotations, {**stashed, "affinity": lower_level})


@pytest.mark.parametrize(
    ("spec", "changed"),
    [
        ({"nodeSelector": {"disk": "ssd"}}, {"nodeSelector": {"disk": "hdd"}}),
        ({**GATED, "nodeSelector": IN_LOWER_1}, {"nodeSelector": None}),
        (
            {**GATED, "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]},
            {"topologySpreadConstraints": [{"maxSkew": 5, "topologyKey": "zone"}]},
        ),
    ],
    ids=["running pod's node selector", "gated pod's entry dropped", "gated pod's spread"],
)
def test_a_change_kubernetes_refuses_is_left_to_the_apiserver(
    spec: dict[str, Any], changed: dict[str, Any]
) -> None:
    """The apiserver refuses it, as it would without kubestrata; stashed, the update would
    be taken and the stash would no longer say what the lower pod runs with."""
    stashed, annotations = stash_scheduling(spec, {})
    annotations = annotations or {keys.STASH_ANNOTATION: stash.encode({})}
    new = {**stashed, **changed}
    assert update(stashed, annotations, new) == (new, annotations)


def test_a_stash_may_change_only_as_the_webhook_changes_it() -> None:
    stored = stash.encode({"nodeSelector": {"pool": "a"}, "affinity": None})
    spec: dict[str, Any] = {"nodeSelector": stash.VIRTUAL_NODE_SELECTOR}
    gated = {**spec, "schedulingGates": [{"name": "q"}]}
    grown = stash.encode({"nodeSelector": {"pool": "a", "disk": "ssd"}, "affinity": None})
    assert stash.stash_change_refusal(spec, stored, stored) is None
    assert stash.stash_change_refusal(spec, stored, None) is None  # put back by the webhook
    assert stash.stash_change_refusal(gated, stored, grown) is None
    assert stash.stash_change_refusal(spec, stored, grown) is not None  # not gated
    changed = stash.encode({"nodeSelector": {"pool": "b"}, "affinity": None})
    assert stash.stash_change_refusal(gated, stored, changed) is not None
    spread = stash.encode({"nodeSelector": {"pool": "a"}, "topologySpreadConstraints": []})
    assert stash.stash_change_refusal(gated, stored, spread) is not None
    # A node affinity recorded where there was none is the one the spec had.
    bare = stash.encode({"nodeSelector": {"pool": "a"}})
    affinity: dict[str, Any] = {"podAffinity": {}}
    with_affinity = stash.encode({"nodeSelector": {"pool": "a"}, "affinity": affinity})
    assert stash.stash_change_refusal({**gated, "affinity": affinity}, bare, with_affinity) is None
    assert stash.stash_change_refusal(gated, bare, with_affinity) is not None
    # Nothing stored (made before the webhook): a gated pod's node selector as it was,
    # with entries added.
    made_before = {"schedulingGates": [{"name": "q"}], "nodeSelector": {"pool": "a"}}
    first = stash.encode({"nodeSelector": {"pool": "a", "disk": "ssd"}})
    assert stash.stash_change_refusal(made_before, None, first) is None
    assert stash.stash_change_refusal({"nodeSelector": {"pool": "a"}}, None, first) is not None
    assert stash.stash_change_refusal(made_before, None, changed) is not None


def test_requirements_keeping_nodes_away_by_a_virtual_nodes_own_labels_stay_above() -> None:
    """Below every lower node meets them, so only the upper scheduler can keep the pod
    off the virtual node they exclude: stashed, it was bound there, and then failed."""
    away = [
        {"key": keys.HOSTNAME_LABEL, "operator": "NotIn", "values": ["vk-lower-1"]},
        {"key": keys.NODE_TYPE_LABEL, "operator": "DoesNotExist"},
    ]
    picking = {"key": keys.HOSTNAME_LABEL, "operator": "In", "values": ["worker-3"]}
    terms = {"nodeSelectorTerms": [{"matchExpressions": [*away, picking]}]}
    field = "requiredDuringSchedulingIgnoredDuringExecution"
    view = stash.upper_view({"affinity": {"nodeAffinity": {field: terms}}})
    assert view["affinity"]["nodeAffinity"][field] == {
        "nodeSelectorTerms": [{"matchExpressions": away}]
    }


def test_the_webhook_guards_the_pods_its_configuration_selects() -> None:
    federated = {keys.FEDERATION_LABEL: keys.FEDERATION_ENABLED}
    opted_out = {keys.FEDERATION_LABEL: keys.FEDERATION_DISABLED}
    assert stash.unguarded_reason("shop", federated, {}) is None
    assert stash.unguarded_reason("shop", {}, {}) == (
        "namespace shop is not labelled kubestrata.io/federation=enabled"
    )
    assert stash.unguarded_reason("shop", federated, opted_out) == (
        "the pod opted out (kubestrata.io/federation=disabled)"
    )
    assert stash.unguarded_reason("kube-system", federated, {}) == (
        "namespace kube-system is never federated"
    )
