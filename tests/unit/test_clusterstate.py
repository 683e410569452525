"""The incremental view of a lower cluster: its bookkeeping through watch events in any
order, assumptions, replicas, and a property check against a from-scratch diagnosis."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import event as note_event
from hypothesis import given, settings
from hypothesis import strategies as st

from kubekit import fit
from kubekit.clusterstate import ClusterState, Estimate
from tests.unit.test_fit import container, diagnose, node, pod, toleration

JSON = dict[str, Any]


def state(*objects: JSON) -> ClusterState:
    cluster = ClusterState()
    for obj in objects:
        if "containers" in obj["spec"]:
            cluster.set_pod(obj)
        else:
            cluster.set_node(obj)
    return cluster


def needs(cpu: str, **spec: Any) -> JSON:
    return pod("q", containers=[container(cpu=cpu)], **spec)


def test_a_pod_may_arrive_before_its_node() -> None:
    cluster = state(pod("o", on="n1", containers=[container(cpu="3")]))
    assert cluster.estimate(needs("2")).total_nodes == 0
    cluster.set_node(node(cpu="4"))
    assert cluster.estimate(needs("2")).reasons == {"Insufficient cpu": 1}
    assert cluster.estimate(needs("1")).fitting == ("n1",)


def test_a_finished_pod_frees_what_it_held() -> None:
    running = pod("o", on="n1", containers=[container(cpu="3")])
    cluster = state(node(cpu="4"), running)
    assert not cluster.estimate(needs("2")).fitting
    cluster.set_pod({**running, "status": {"phase": "Succeeded"}})
    assert cluster.estimate(needs("2")).fitting == ("n1",)


def test_an_update_replaces_what_the_pod_counted() -> None:
    cluster = state(node(cpu="4"), pod("o", on="n1", containers=[container(cpu="3")]))
    cluster.set_pod(pod("o", on="n1", containers=[container(cpu="1")]))
    assert cluster.estimate(needs("3")).fitting == ("n1",)
    cluster.set_pod(pod("o", on="n1", containers=[container(cpu="2")]))
    assert not cluster.estimate(needs("3")).fitting
    cluster.remove_pod("ns/o")
    assert cluster.estimate(needs("4")).fitting == ("n1",)


def test_a_status_update_keeps_the_pod_as_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    running = pod("o", on="n1", containers=[container(cpu="3")])
    cluster = state(node(cpu="4"), running)
    compiled: list[JSON] = []
    compile_pod = fit.PodFacts.of

    def counted(obj: JSON) -> fit.PodFacts:
        compiled.append(obj)
        return compile_pod(obj)

    monkeypatch.setattr(fit.PodFacts, "of", counted)
    cluster.set_pod({**running, "status": {"phase": "Running", "podIP": "10.0.0.7"}})
    assert compiled == []
    assert cluster.estimate(needs("1")).fitting == ("n1",)
    assert not cluster.estimate(needs("2")).fitting


ANTI_DB = {
    "podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {
                "labelSelector": {"matchLabels": {"app": "db"}},
                "topologyKey": "kubernetes.io/hostname",
            }
        ]
    }
}


def test_new_labels_of_a_placed_pod_count_at_once() -> None:
    placed = pod("o", on="n1", labels={"app": "web"}, containers=[container(cpu="1")])
    cluster = state(node(cpu="4", labels={"kubernetes.io/hostname": "n1"}), placed)
    assert cluster.estimate(needs("1", affinity=ANTI_DB)).fitting == ("n1",)
    cluster.set_pod(pod("o", on="n1", labels={"app": "db"}, containers=[container(cpu="1")]))
    assert not cluster.estimate(needs("1", affinity=ANTI_DB)).fitting
    cluster.remove_pod("ns/o")
    cluster.set_pod(placed)
    assert cluster.estimate(needs("1", affinity=ANTI_DB)).fitting == ("n1",)


def test_pending_pods_hold_nothing_until_bound() -> None:
    cluster = state(node(cpu="4"), pod("o", containers=[container(cpu="3")], phase="Pending"))
    assert cluster.estimate(needs("4")).fitting == ("n1",)


def test_a_pod_nominated_after_preempting_holds_its_node_until_bound() -> None:
    waiting = pod("o", containers=[container(cpu="3")], phase="Pending")
    waiting["status"]["nominatedNodeName"] = "n1"
    cluster = state(node("n1", cpu="4"), node("n2", cpu="4"), waiting)
    assert cluster.estimate(needs("2")).fitting == ("n2",)
    # Bound elsewhere after all: it holds that node instead.
    bound = pod("o", on="n2", containers=[container(cpu="3")], phase="Pending")
    bound["status"]["nominatedNodeName"] = "n1"
    cluster.set_pod(bound)
    assert cluster.estimate(needs("2")).fitting == ("n1",)
    # Nominated no more and not bound: it holds nothing.
    cluster.set_pod(pod("o", containers=[container(cpu="3")], phase="Pending"))
    assert cluster.estimate(needs("2")).fitting == ("n1", "n2")


def test_pods_of_a_removed_node_count_again_when_it_returns() -> None:
    cluster = state(
        node(cpu="4"), node("n2", cpu="1"), pod("o", on="n1", containers=[container(cpu="3")])
    )
    cluster.remove_node("n1")
    estimate = cluster.estimate(needs("2"))
    assert (estimate.total_nodes, estimate.fitting) == (1, ())
    cluster.set_node(node(cpu="4"))
    assert cluster.estimate(needs("1")).fitting == ("n1", "n2")
    assert cluster.estimate(needs("2")).fitting == ()


def test_node_updates_move_it_between_groups() -> None:
    cluster = state(node(labels={"disk": "hdd"}))
    ssd = needs("1", nodeSelector={"disk": "ssd"})
    assert cluster.estimate(ssd).reasons == {fit.NODE_AFFINITY: 1}
    cluster.set_node(node(labels={"disk": "ssd"}))
    assert cluster.estimate(ssd).fitting == ("n1",)
    cluster.set_node(node(labels={"disk": "ssd"}, unschedulable=True))
    assert cluster.estimate(ssd).reasons == {fit.UNSCHEDULABLE: 1}


def test_a_node_counts_under_each_resource_it_lacks() -> None:
    cluster = state(node(cpu="1", memory="1Gi"), node("n2", cpu="8", memory="1Gi"))
    query = pod("q", containers=[container(cpu="2", memory="2Gi")])
    assert cluster.estimate(query).reasons == {"Insufficient cpu": 1, "Insufficient memory": 2}


def test_reasons_follow_the_scheduler_order_per_node() -> None:
    cluster = state(
        node("n1", unschedulable=True, ready=False),
        node("n2", ready=False, labels={"disk": "ssd"}),
        node("n3", labels={"disk": "hdd"}),
        node("n4", labels={"disk": "ssd"}, cpu="1"),
    )
    query = needs("2", nodeSelector={"disk": "ssd"})
    assert cluster.estimate(query).reasons == {
        fit.UNSCHEDULABLE: 1,
        fit.NOT_READY: 1,
        fit.NODE_AFFINITY: 1,
        "Insufficient cpu": 1,
    }
    named = needs("1", nodeName="n3", nodeSelector={"disk": "ssd"})
    assert cluster.estimate(named).reasons == {
        fit.UNSCHEDULABLE: 1,
        fit.NODE_NAME: 2,
        fit.NODE_AFFINITY: 1,
    }


def test_message() -> None:
    cluster = state(node("n1", cpu="1"), node("n2", cpu="1"), node("n3", unschedulable=True))
    assert cluster.estimate(needs("2")).message() == (
        "0/3 nodes are available: 2 Insufficient cpu, 1 node(s) were unschedulable"
    )
    assert cluster.estimate(needs("1")).message() == "2/3 nodes fit"
    assert ClusterState().estimate(needs("1")).message() == "0/0 nodes are available"
    tied = Estimate(3, (), {"b": 1, "a": 1, "c": 2}, 0, 0.0, 0.0, 0)
    assert tied.message() == "0/3 nodes are available: 2 c, 1 a, 1 b"


def test_best_fit_and_least_allocated() -> None:
    cluster = state(
        node("big", cpu="8", memory="8Gi"),
        node("small", cpu="4", memory="4Gi"),
        pod("o", on="small", containers=[container(cpu="1", memory="1Gi")]),
    )
    estimate = cluster.estimate(pod("q", containers=[container(cpu="1", memory="1Gi")]))
    # small: 2/4 of cpu and of memory requested once placed; big: 1/8.
    assert estimate.best_fit == pytest.approx(0.5)
    assert estimate.least_allocated == pytest.approx(1 - 1 / 8)
    gpu = state(node("g", cpu="4", memory="4Gi", extended={"nvidia.com/gpu": "4"}))
    wants = pod(
        "q", containers=[container(cpu="1", memory="1Gi", extended={"nvidia.com/gpu": "2"})]
    )
    assert gpu.estimate(wants).best_fit == pytest.approx((0.25 + 0.25 + 0.5) / 3)


def test_preferred() -> None:
    cluster = state(node("n1", labels={"zone": "a"}), node("n2", labels={"zone": "b"}, cpu="1"))
    terms = [
        {
            "weight": 3,
            "preference": {
                "matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]
            },
        },
        {
            "weight": 9,
            "preference": {
                "matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]
            },
        },
    ]
    query = needs(
        "2", affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": terms}}
    )
    # n2 would be worth 9 but the pod does not fit there.
    assert cluster.estimate(query).preferred == 3


def test_the_pod_takes_the_roomiest_of_the_nodes_it_prefers_most() -> None:
    """The cluster was chosen for the preference a node of it meets: pinned to the
    roomiest node instead, the pod ran where it preferred not to."""
    cluster = state(
        node("big", cpu="32", labels={"disk": "hdd"}),
        node("ssd-1", cpu="4", labels={"disk": "ssd"}),
        node("ssd-2", cpu="8", labels={"disk": "ssd"}),
    )
    term = {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}
    prefers = {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": term}]
    }
    query = needs("2", affinity={"nodeAffinity": prefers})
    estimate = cluster.estimate(query)
    assert (estimate.preferred, estimate.roomiest) == (100, "ssd-2")
    assert cluster.assume("uid-1", query) == "ssd-2"
    assert cluster.assume("uid-2", needs("2")) == "big", "no preference: the roomiest"


def test_assume_takes_the_roomiest_node_and_forget_gives_it_back() -> None:
    cluster = state(node("roomy", cpu="8"), node("snug", cpu="2"))
    assert cluster.assume("uid-1", needs("2")) == "roomy"
    assert cluster.estimate(needs("6")).fitting == ("roomy",)
    assert cluster.assume("uid-2", needs("6")) == "roomy"
    assert cluster.estimate(needs("1")).fitting == ("snug",)
    assert cluster.assume("uid-3", needs("2")) == "snug"
    assert cluster.assume("uid-4", needs("1")) is None
    assert cluster.forget("uid-1") == "roomy"
    assert cluster.forget("uid-1") is None
    assert cluster.estimate(needs("2")).fitting == ("roomy",)


def test_assume_breaks_ties_by_name() -> None:
    cluster = state(node("b", cpu="4"), node("a", cpu="4"))
    assert cluster.assume("uid-1", needs("1")) == "a"
    assert cluster.assume("uid-2", needs("1")) == "b"


def test_assume_on_a_given_node_and_again() -> None:
    cluster = state(node("a", cpu="4"), node("b", cpu="4"))
    assert cluster.assume("uid", needs("3"), "b") == "b"
    assert cluster.estimate(needs("2")).fitting == ("a",)
    # Assuming again moves the pod: it is counted once.
    assert cluster.assume("uid", needs("3"), "a") == "a"
    assert cluster.estimate(needs("2")).fitting == ("b",)


def test_ties_go_to_the_first_name() -> None:
    cluster = state(node("b"), node("a"), node("c"))
    assert cluster.assume("uid", needs("1")) == "a"


def test_assumptions_and_pods_are_keyed_apart() -> None:
    cluster = state(node(cpu="4"))
    cluster.assume("ns/p", needs("2"), "n1")
    cluster.set_pod(pod("p", on="n1", containers=[container(cpu="1")]))
    assert cluster.estimate(needs("1")).fitting == ("n1",)
    assert cluster.estimate(needs("2")).fitting == ()
    cluster.remove_pod("ns/p")
    assert cluster.estimate(needs("2")).fitting == ("n1",)
    assert cluster.forget("ns/p") == "n1"
    assert cluster.estimate(needs("4")).fitting == ("n1",)


def test_an_assumption_on_an_unknown_node_counts_when_it_comes() -> None:
    cluster = ClusterState()
    assert cluster.assume("uid", needs("3"), "n1") == "n1"
    cluster.set_node(node(cpu="4"))
    assert cluster.estimate(needs("2")).fitting == ()


@pytest.mark.parametrize(
    ("query", "replicas", "expected"),
    [
        (needs("1"), 10, 6),
        (needs("1"), 4, 4),
        (needs("1"), 0, 0),
        (needs("5"), 3, 0),
        (pod("q", containers=[container(cpu="1", ports=[{"hostPort": 80}])]), 10, 2),
        (
            pod(
                "q",
                labels={"app": "web"},
                containers=[container(cpu="1")],
                affinity={
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "labelSelector": {"matchLabels": {"app": "web"}},
                                "topologyKey": "kubernetes.io/hostname",
                            }
                        ]
                    }
                },
            ),
            10,
            2,
        ),
        (
            pod(
                "q",
                labels={"app": "web"},
                containers=[container(cpu="1")],
                topologySpreadConstraints=[
                    {
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "DoNotSchedule",
                        "labelSelector": {"matchLabels": {"app": "web"}},
                    }
                ],
            ),
            10,
            # b, a, b, a, then a full b keeps a within one of it: a takes a third.
            5,
        ),
    ],
    ids=[
        "resources",
        "fewer asked",
        "none asked",
        "none fit",
        "host port",
        "anti-affinity",
        "spread",
    ],
)
def test_max_replicas(query: JSON, replicas: int, expected: int) -> None:
    cluster = state(node("a", cpu="4"), node("b", cpu="2"))
    assert cluster.estimate(query, replicas).max_replicas == expected


def test_replicas_are_simulated_without_touching_the_state() -> None:
    cluster = state(node("a", cpu="4"), node("b", cpu="2"))
    before = cluster.estimate(needs("1"))
    cluster.estimate(needs("1"), 5)
    assert cluster.estimate(needs("1")) == before


# -- property: the incremental view equals a diagnosis from scratch ----------------------

NODE_NAMES = ["n0", "n1", "n2", "n3"]
# Few names, so that pods are often updated and removed again.
POD_NAMES = ["p0", "p1", "p2"]
KEYS = ["zone", "disk", "rank"]
POD_NAME = st.sampled_from(POD_NAMES)
ANY_NODE = st.sampled_from([None, *NODE_NAMES, "ghost"])

# Most nodes are in a zone, so that zones make domains.
label_sets = st.builds(
    lambda zone, others: {**others, **zone},
    st.sampled_from([{"zone": "a"}, {"zone": "b"}, {"zone": "b"}, {}]),
    st.dictionaries(st.sampled_from(KEYS), st.sampled_from(["a", "b", "1", "3"]), max_size=2),
)
# Barriers are drawn seldom, so that most nodes get as far as the filters after them.
taints = st.sampled_from(
    [
        [],
        [],
        [],
        [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}],
        [{"key": "spot", "value": "", "effect": "NoExecute"}],
        [{"key": "soft", "value": "", "effect": "PreferNoSchedule"}],
    ]
)
nodes = st.builds(
    lambda name, labels, taint_list, unschedulable, ready, cpu, memory, pods, gpu: node(
        name,
        labels=labels,
        taints=taint_list,
        unschedulable=unschedulable,
        ready=ready,
        cpu=cpu,
        memory=memory,
        pods=pods,
        extended={"nvidia.com/gpu": gpu} if gpu else None,
    ),
    st.sampled_from(NODE_NAMES),
    label_sets,
    taints,
    st.sampled_from([False] * 7 + [True]),
    st.sampled_from([True] * 7 + [False, None]),
    st.sampled_from(["0", "500m", "1", "2", "4"]),
    st.sampled_from(["512Mi", "1Gi", "4Gi"]),
    st.sampled_from(["1", "2", "3", "110"]),
    st.sampled_from(["", "1"]),
)
requests = st.fixed_dictionaries(
    {},
    optional={
        "cpu": st.sampled_from(["0", "250m", "500m", "1"]),
        "memory": st.sampled_from(["128Mi", "512Mi"]),
        "nvidia.com/gpu": st.sampled_from(["0", "0", "1"]),
    },
)
expressions = st.lists(
    st.one_of(
        st.builds(
            lambda k, op, vs: {"key": k, "operator": op, "values": vs},
            st.sampled_from(KEYS),
            st.sampled_from(["In", "NotIn"]),
            st.lists(st.sampled_from(["a", "b", "1"]), min_size=1, max_size=2),
        ),
        st.builds(
            lambda k, op: {"key": k, "operator": op},
            st.sampled_from(KEYS),
            st.sampled_from(["Exists", "DoesNotExist"]),
        ),
        st.builds(
            lambda op, v: {"key": "rank", "operator": op, "values": [v]},
            st.sampled_from(["Gt", "Lt"]),
            st.sampled_from(["0", "2", "x"]),
        ),
    ),
    max_size=2,
)
pod_terms = st.lists(
    st.fixed_dictionaries(
        {
            "labelSelector": st.sampled_from(
                [{"matchLabels": {"app": "a"}}, {"matchLabels": {"app": "b"}}, {}]
            ),
            "topologyKey": st.sampled_from(["zone", "kubernetes.io/hostname"]),
        },
        optional={"namespaces": st.just(["ns", "other"])},
    ),
    max_size=2,
)
node_affinities = st.one_of(
    st.none(),
    st.none(),
    st.fixed_dictionaries(
        {
            "requiredDuringSchedulingIgnoredDuringExecution": st.fixed_dictionaries(
                {
                    "nodeSelectorTerms": st.lists(
                        st.fixed_dictionaries(
                            {"matchExpressions": expressions},
                            optional={
                                "matchFields": st.lists(
                                    st.builds(
                                        lambda op, v: {
                                            "key": "metadata.name",
                                            "operator": op,
                                            "values": [v],
                                        },
                                        st.sampled_from(["In", "NotIn"]),
                                        st.sampled_from(NODE_NAMES),
                                    ),
                                    max_size=1,
                                )
                            },
                        ),
                        max_size=2,
                    )
                }
            )
        }
    ),
)
affinities = st.builds(
    lambda node_affinity, others: {
        **others,
        **({"nodeAffinity": node_affinity} if node_affinity else {}),
    },
    node_affinities,
    st.fixed_dictionaries(
        {},
        optional={
            "podAffinity": st.fixed_dictionaries(
                {"requiredDuringSchedulingIgnoredDuringExecution": pod_terms}
            ),
            "podAntiAffinity": st.fixed_dictionaries(
                {"requiredDuringSchedulingIgnoredDuringExecution": pod_terms}
            ),
        },
    ),
)
spreads = st.lists(
    st.fixed_dictionaries(
        {
            "maxSkew": st.integers(1, 2),
            "topologyKey": st.sampled_from(["zone", "kubernetes.io/hostname"]),
            "whenUnsatisfiable": st.sampled_from(["DoNotSchedule", "ScheduleAnyway"]),
            "labelSelector": st.sampled_from([{"matchLabels": {"app": "a"}}, None]),
        },
        optional={
            "minDomains": st.integers(1, 3),
            "nodeAffinityPolicy": st.sampled_from(["Honor", "Ignore"]),
            "nodeTaintsPolicy": st.sampled_from(["Honor", "Ignore"]),
        },
    ),
    max_size=2,
)


@st.composite
def pods(
    draw: st.DrawFn,
    name: st.SearchStrategy[str] = POD_NAME,
    on: st.SearchStrategy[str | None] = ANY_NODE,
) -> JSON:
    ports = draw(
        st.lists(
            st.fixed_dictionaries(
                {"hostPort": st.sampled_from([80, 443])},
                optional={
                    "hostIP": st.sampled_from(["", "127.0.0.1", "0.0.0.0"]),
                    "protocol": st.sampled_from(["TCP", "UDP"]),
                },
            ),
            max_size=1,
        )
    )
    spec: JSON = {
        "tolerations": draw(
            st.lists(
                st.sampled_from(
                    [
                        toleration(operator="Exists", key="gpu"),
                        toleration("NoExecute", "Exists", "spot"),
                        toleration(operator="Exists"),
                        toleration("NoSchedule", "Exists", fit.UNSCHEDULABLE_TAINT_KEY),
                        toleration("NoSchedule", "Exists", fit.NOT_READY_TAINT_KEY),
                    ]
                ),
                max_size=2,
            )
        ),
        "affinity": draw(affinities),
        "topologySpreadConstraints": draw(spreads),
    }
    selector = draw(st.dictionaries(st.sampled_from(KEYS), st.sampled_from(["a", "b"]), max_size=1))
    keep_selector = draw(st.booleans())
    if selector and keep_selector:
        spec["nodeSelector"] = selector
    return pod(
        draw(name),
        namespace=draw(st.sampled_from(["ns", "ns", "ns", "other"])),
        labels=draw(st.sampled_from([{"app": "a"}, {"app": "a"}, {"app": "b"}, {}])),
        on=draw(on),
        phase=draw(st.sampled_from(["Running"] * 4 + ["Pending", "Succeeded", "Failed"])),
        deleting=draw(st.booleans()),
        containers=[container(ports=ports, extended=draw(requests))],
        **spec,
    )


events = st.lists(
    st.one_of(
        st.tuples(st.just("set_node"), nodes),
        st.tuples(st.just("set_pod"), pods()),
        st.tuples(st.just("set_pod"), pods()),
        st.tuples(st.just("set_pod"), pods()),
        st.tuples(st.just("remove_node"), st.sampled_from(NODE_NAMES)),
        st.tuples(st.just("set_pod"), pods()),
        st.tuples(
            st.just("remove_pod"),
            st.sampled_from([f"{ns}/{name}" for ns in ("ns", "other") for name in POD_NAMES]),
        ),
        st.tuples(st.just("assume"), pods(st.sampled_from(["u0", "u1"]))),
        st.tuples(st.just("forget"), st.sampled_from(["u0", "u1"])),
    ),
    min_size=4,
    max_size=30,
)
# Nodes first, so that most histories leave some; then anything in any order.
histories = st.builds(
    lambda first, rest: [("set_node", n) for n in first] + rest,
    st.lists(nodes, min_size=1, max_size=4),
    events,
)
# Nodes that let every pod through to the filters that count pods: spread and affinity.
open_nodes = st.builds(
    lambda name, zone, cpu, pods: node(name, labels=zone, cpu=cpu, memory="8Gi", pods=pods),
    st.sampled_from(NODE_NAMES),
    st.sampled_from([{"zone": "a"}, {"zone": "b"}, {"zone": "b"}, {}]),
    st.sampled_from(["1", "2", "8"]),
    st.sampled_from(["2", "3", "110"]),
)
placed_pods = pods(on=st.sampled_from(NODE_NAMES))
crowded_histories = st.builds(
    lambda first, rest: [("set_node", n) for n in first] + rest,
    st.lists(open_nodes, min_size=1, max_size=4),
    st.lists(
        st.one_of(
            st.tuples(st.just("set_pod"), placed_pods),
            st.tuples(st.just("set_pod"), placed_pods),
            st.tuples(st.just("remove_pod"), st.sampled_from([f"ns/{p}" for p in POD_NAMES])),
            st.tuples(st.just("set_node"), open_nodes),
            st.tuples(st.just("assume"), pods(st.sampled_from(["u0", "u1"]))),
            st.tuples(st.just("forget"), st.sampled_from(["u0", "u1"])),
        ),
        min_size=8,
        max_size=30,
    ),
)
# What is asked about is seldom bound to a node already.
queries = pods(on=st.sampled_from([None, None, None, None, "n1"]))


def replay(history: list[tuple[str, Any]]) -> tuple[ClusterState, list[JSON], list[JSON]]:
    """The state fed the events, and the objects they leave, as the brute force sees
    them: assumptions are pods bound where they were assumed."""
    cluster = ClusterState()
    final_nodes: dict[str, JSON] = {}
    final_pods: dict[str, JSON] = {}
    assumed: dict[str, JSON] = {}
    for event, obj in history:
        if event == "set_node":
            cluster.set_node(obj)
            final_nodes[obj["metadata"]["name"]] = obj
        elif event == "remove_node":
            cluster.remove_node(obj)
            final_nodes.pop(obj, None)
        elif event == "set_pod":
            cluster.set_pod(obj)
            final_pods[f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"] = obj
        elif event == "remove_pod":
            cluster.remove_pod(obj)
            final_pods.pop(obj, None)
        elif event == "assume":
            uid = obj["metadata"]["name"]
            target = obj["spec"]["nodeName"]
            placed = cluster.assume(uid, obj, target)
            assumed.pop(uid, None)
            if placed is not None:
                bound = {
                    **obj,
                    "spec": {**obj["spec"], "nodeName": placed},
                    "status": {"phase": "Running"},
                }
                assumed[uid] = bound
        else:
            cluster.forget(obj)
            assumed.pop(obj, None)
    return cluster, list(final_nodes.values()), [*final_pods.values(), *assumed.values()]


# Asked after every history beside the drawn pod: each looks at one kind of bookkeeping.
PROBES = [
    needs("1"),
    pod("q", containers=[container(ports=[{"hostPort": 80}])]),
    pod(
        "q",
        labels={"app": "a"},
        topologySpreadConstraints=[
            {
                "maxSkew": 1,
                "topologyKey": "zone",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app": "a"}},
            }
        ],
    ),
    pod(
        "q",
        labels={"app": "a"},
        affinity={
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": {"app": "a"}}, "topologyKey": "zone"}
                ]
            }
        },
    ),
]


@settings(max_examples=200, deadline=None)
@given(st.one_of(histories, crowded_histories), queries)
def test_the_incremental_view_matches_a_diagnosis_from_scratch(
    history: list[tuple[str, Any]], query: JSON
) -> None:
    cluster, final_nodes, final_pods = replay(history)
    for asked in (query, *PROBES):
        expected = diagnose(asked, final_nodes, final_pods)
        estimate = cluster.estimate(asked)
        assert estimate.fitting == tuple(sorted(n for n, why in expected.items() if not why))
        assert estimate.reasons == Counter(r for why in expected.values() for r in why)
        assert estimate.total_nodes == len(final_nodes)


@settings(max_examples=100, deadline=None)
@given(histories, queries, st.integers(1, 4))
def test_estimates_leave_the_state_as_they_found_it_and_name_the_node_assume_takes(
    history: list[tuple[str, Any]], query: JSON, replicas: int
) -> None:
    cluster, _, _ = replay(history)
    before = cluster.estimate(query)
    cluster.estimate(query, replicas)
    taken = cluster.assume("probe", query)
    # The estimate names the node assume takes, so a caller asking both reads the pod
    # and evaluates the cluster once.
    assert before.roomiest == taken
    assert taken is None or taken in before.fitting
    if taken is not None:
        cluster.forget("probe")
    assert cluster.estimate(query) == before


# -- making room by evicting ------------------------------------------------------------


def small(name: str, on: str, cpu: str = "1", **spec: Any) -> JSON:
    return pod(name, on=on, labels={"app": name}, containers=[container(cpu=cpu)], **spec)


def replacement(victim: JSON) -> JSON:
    """What a controller would make in the victim's place: the same pod, unbound."""
    spec = {k: v for k, v in victim["spec"].items() if k != "nodeName"}
    return {**victim, "spec": spec, "status": {}}


def movable(*victims: JSON) -> dict[str, JSON]:
    return {f"ns/{v['metadata']['name']}": replacement(v) for v in victims}


def test_fit_in_turn_places_each_pod_on_what_the_earlier_ones_left() -> None:
    cluster = state(node("a", cpu="4"), node("b", cpu="2"))
    assert cluster.fit_in_turn([needs("3"), needs("2"), needs("2")]) == ["a", "b", None]
    assert cluster.estimate(needs("4")).fitting == ("a",), "nothing stays assumed"


def test_freeing_finds_the_fewest_evictions_and_where_the_evicted_go() -> None:
    # a: 3 of 4 cpu taken by three pods; b: 1.5 of 4 by one pod. A 4-cpu pod fits neither.
    pods = [small("a1", "a"), small("a2", "a"), small("a3", "a"), small("b1", "b", cpu="1500m")]
    cluster = state(node("a", cpu="4"), node("b", cpu="4"), *pods)
    plans = cluster.freeing(needs("4"), movable(*pods), most=5)
    assert [(p.node, p.evicted) for p in plans] == [
        ("b", ("ns/b1",)),
        ("a", ("ns/a1", "ns/a2", "ns/a3")),
    ]
    # b1 needs 1.5 cpu and a has 1 free; of a's pods, b (held for the pod no more) takes two.
    assert plans[0].homeless == ("ns/b1",)
    assert plans[1].homeless == ("ns/a3",)
    assert cluster.estimate(needs("1")).fitting == ("a", "b"), "the state is as it was"


def test_freeing_respects_the_most_evictions_and_what_may_move() -> None:
    pods = [small("a1", "a"), small("a2", "a"), small("a3", "a")]
    cluster = state(node("a", cpu="4"), *pods)
    assert cluster.freeing(needs("4"), movable(*pods), most=2) == []
    assert cluster.freeing(needs("3"), movable(*pods), most=2)[0].evicted == ("ns/a1", "ns/a2")
    # a3 must stay: the two that may go free only 2 of the 3 cpu missing... plus the free one.
    assert cluster.freeing(needs("4"), movable(pods[0], pods[1]), most=5) == []


def test_freeing_evicts_the_big_pod_rather_than_several_small_ones() -> None:
    pods = [small("s1", "a"), small("s2", "a"), small("big", "a", cpu="2")]
    cluster = state(node("a", cpu="4"), *pods)
    (plan,) = cluster.freeing(needs("2"), movable(*pods), most=3)
    assert plan.evicted == ("ns/big",)


def test_freeing_only_considers_nodes_the_pod_may_take_and_fits_already_means_nothing() -> None:
    pods = [small("a1", "a", cpu="4"), small("b1", "b", cpu="4")]
    cluster = state(node("a", cpu="4"), node("b", cpu="4", labels={"disk": "ssd"}), *pods)
    (plan,) = cluster.freeing(needs("2", nodeSelector={"disk": "ssd"}), movable(*pods), most=3)
    assert (plan.node, plan.evicted) == ("b", ("ns/b1",))
    assert cluster.freeing(needs("0"), movable(*pods), most=3) == []


def test_freeing_judges_every_filter_not_only_resources() -> None:
    # Room enough on a, but a pod there the asked pod refuses to share a node with.
    anti = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"app": "db"}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
    pods = [
        small("web", "a"),
        pod("db", on="a", labels={"app": "db"}, containers=[container(cpu="1")]),
    ]
    cluster = state(node("a", cpu="4"), *pods)
    (plan,) = cluster.freeing(needs("1", affinity=anti), movable(*pods), most=2)
    assert plan.evicted == ("ns/db",)


# Nodes filled with running pods, and pods that need room: plans are common.
packed_histories = st.builds(
    lambda first, rest: [("set_node", n) for n in first] + [("set_pod", p) for p in rest],
    st.lists(open_nodes, min_size=1, max_size=3),
    st.lists(
        st.builds(
            lambda name, on, cpu, labels: pod(
                name, on=on, labels=labels, containers=[container(cpu=cpu)]
            ),
            st.sampled_from([f"f{i}" for i in range(12)]),
            st.sampled_from(NODE_NAMES),
            st.sampled_from(["250m", "500m", "1"]),
            st.sampled_from([{"app": "a"}, {}]),
        ),
        max_size=14,
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(packed_histories, crowded_histories),
    st.one_of(queries, st.sampled_from([needs("1"), needs("2"), needs("4"), *PROBES[1:]])),
)
def test_a_plan_makes_room_per_a_diagnosis_from_scratch_and_leaves_the_state_alone(
    history: list[tuple[str, Any]], query: JSON
) -> None:
    cluster, final_nodes, final_pods = replay(history)
    real = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in final_pods}
    before = [cluster.estimate(asked) for asked in (query, *PROBES)]
    plans = cluster.freeing(query, {key: replacement(p) for key, p in real.items()}, most=3)
    note_event(f"plans: {min(len(plans), 2)}")
    for plan in plans:
        left = [
            p
            for p in final_pods
            if f"{p['metadata']['namespace']}/{p['metadata']['name']}" not in plan.evicted
        ]
        assert not diagnose(query, final_nodes, left)[plan.node], plan
        assert 1 <= len(plan.evicted) <= 3
    assert [len(p.evicted) for p in plans] == sorted(len(p.evicted) for p in plans)
    assert [cluster.estimate(asked) for asked in (query, *PROBES)] == before


def test_a_search_with_too_many_sets_gives_up_without_a_plan() -> None:
    # Room only if all 40 pods go; sets of up to 40 of 40 are far more than a search looks at.
    pods = [small(f"s{i:02}", "a", cpu="100m") for i in range(40)]
    cluster = state(node("a", cpu="4"), *pods)
    assert cluster.freeing(needs("4"), movable(*pods), most=40) == []
    assert cluster.freeing(needs("4"), movable(*pods), most=39) == [], "all of them could not"
    (plan,) = cluster.freeing(needs("100m"), movable(*pods), most=40)
    assert plan.evicted == ("ns/s00",)


def test_the_largest_free_slot_is_the_usable_node_with_most_cpu_left() -> None:
    cluster = state(
        node("a", cpu="8", memory="16Gi"),
        node("b", cpu="8", memory="32Gi"),
        node("cordoned", cpu="64", unschedulable=True),
        node("down", cpu="64", ready=False),
        pod("big", on="a", containers=[container(cpu="6", memory="1Gi")]),
        pod("over", on="b", containers=[container(cpu="1", memory="40Gi")]),
    )
    # b: 7 cpu left but memory overcommitted, which reads as none left.
    assert cluster.largest_free_slot() == (
        "b",
        {"cpu": 7000, "memory": 0, "pods": 109_000},
    )
    # What is in flight counts: an assumed pod takes its room before it lands.
    cluster.assume("flight", needs("6"), node_name="b")
    slot = cluster.largest_free_slot()
    assert slot is not None and slot[0] == "a" and slot[1]["cpu"] == 2000
    assert ClusterState().largest_free_slot() is None
    assert state(node("x", unschedulable=True)).largest_free_slot() is None
