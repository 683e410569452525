"""The fit rules, filter by filter, against the kube-scheduler v1.35 plugins' behaviour
and their exact reasons."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest

from kubekit import fit
from kubekit.fit import Headroom, HostPort, Kind, NodeFacts, PodFacts

JSON = dict[str, Any]


def node(
    name: str = "n1",
    *,
    labels: Mapping[str, str] | None = None,
    taints: Sequence[JSON] = (),
    unschedulable: bool = False,
    ready: bool | str | None = True,
    extended: Mapping[str, str] | None = None,
    **allocatable: str,
) -> JSON:
    conditions = [] if ready is None else [{"type": "Ready", "status": str(ready)}]
    defaults = {"cpu": "4", "memory": "8Gi", "pods": "110"}
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": {"unschedulable": unschedulable, "taints": list(taints)},
        "status": {
            "allocatable": {**defaults, **allocatable, **(extended or {})},
            "conditions": conditions,
        },
    }


def container(
    name: str = "app",
    ports: Sequence[Any] = (),
    extended: Mapping[str, str] | None = None,
    **requests: str,
) -> JSON:
    resources = {"requests": {**requests, **(extended or {})}}
    return {"name": name, "resources": resources, "ports": list(ports)}


def pod(
    name: str = "p",
    *,
    namespace: str = "ns",
    labels: Mapping[str, str] | None = None,
    on: str | None = None,
    phase: str = "Running",
    containers: Sequence[JSON] | None = None,
    deleting: bool = False,
    **spec: Any,
) -> JSON:
    metadata: JSON = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": metadata,
        "spec": {"containers": list(containers or [container()]), "nodeName": on, **spec},
        "status": {"phase": phase},
    }


def diagnose(query: JSON, nodes: Iterable[JSON], pods: Iterable[JSON] = ()) -> dict[str, list[str]]:
    """Every node's reasons for the pod, recomputed from the objects themselves."""
    facts = PodFacts.of(query)
    known = {n.name: n for n in map(NodeFacts.of, nodes)}
    requested: defaultdict[str, Counter[str]] = defaultdict(Counter)
    ports: defaultdict[str, Counter[HostPort]] = defaultdict(Counter)
    placed: defaultdict[str, defaultdict[Kind, Counter[str]]] = defaultdict(
        lambda: defaultdict(Counter)
    )
    anti_affinity = []
    for p in pods:
        if not fit.pod_holds_resources(p):
            continue
        other, name = PodFacts.of(p), p["spec"]["nodeName"]
        requested[name].update(other.requests)
        ports[name].update(other.host_ports)
        placed[other.kind.namespace][other.kind][name] += 1
        if other.anti_affinity and name in known:
            anti_affinity.append((known[name], other))
    counts = fit.cluster_counts(facts, known, placed, anti_affinity)
    return {
        name: fit.failures(
            facts, n, Headroom.of(name, n.allocatable, requested[name]), ports[name], counts
        )
        for name, n in known.items()
    }


def reasons(
    query: JSON, target: JSON, others: Iterable[JSON] = (), pods: Iterable[JSON] = ()
) -> list[str]:
    """The reasons the pod does not fit ``target`` in a cluster of it and ``others``."""
    return diagnose(query, [target, *others], pods)[target["metadata"]["name"]]


def affinity(*terms: JSON) -> JSON:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


def expression(key: str, operator: str, *values: str) -> JSON:
    return {"key": key, "operator": operator, "values": list(values)}


def taint(key: str, effect: str, value: str = "") -> JSON:
    return {"key": key, "value": value, "effect": effect}


def toleration(effect: str = "", operator: str = "", key: str = "", value: str = "") -> JSON:
    fields = {"key": key, "operator": operator, "value": value, "effect": effect}
    return {k: v for k, v in fields.items() if v}


# -- NodeUnschedulable, Ready, NodeName --------------------------------------------------

CORDONED = node(unschedulable=True)


@pytest.mark.parametrize(
    ("query", "target", "expected"),
    [
        (pod(), CORDONED, [fit.UNSCHEDULABLE]),
        (
            pod(tolerations=[toleration("NoSchedule", "Exists", fit.UNSCHEDULABLE_TAINT_KEY)]),
            CORDONED,
            [],
        ),
        (pod(tolerations=[toleration(operator="Exists")]), CORDONED, []),
        (
            pod(tolerations=[toleration("NoExecute", "Exists", fit.UNSCHEDULABLE_TAINT_KEY)]),
            CORDONED,
            [fit.UNSCHEDULABLE],
        ),
        # Only the first filter that rejects a node is reported.
        (pod(), node(unschedulable=True, ready=False), [fit.UNSCHEDULABLE]),
        (pod(), node(ready=False), [fit.NOT_READY]),
        (pod(), node(ready=None), [fit.UNREACHABLE]),
        (pod(), node(ready="Unknown"), [fit.UNREACHABLE]),
        (
            pod(tolerations=[toleration("NoSchedule", "Exists", fit.UNREACHABLE_TAINT_KEY)]),
            node(ready="Unknown"),
            [],
        ),
        (
            pod(tolerations=[toleration("NoSchedule", "Exists", fit.NOT_READY_TAINT_KEY)]),
            node(ready="Unknown"),
            [fit.UNREACHABLE],
        ),
        (
            pod(tolerations=[toleration("NoSchedule", "Exists", fit.NOT_READY_TAINT_KEY)]),
            node(ready=False),
            [],
        ),
        (
            pod(tolerations=[toleration("NoExecute", "Exists", fit.NOT_READY_TAINT_KEY)]),
            node(ready=False),
            [fit.NOT_READY],
        ),
        (pod(nodeName="n2"), node(), [fit.NODE_NAME]),
        (pod(nodeName="n1"), node(), []),
        (pod(nodeName="n2"), CORDONED, [fit.UNSCHEDULABLE]),
    ],
    ids=[
        "cordoned",
        "tolerates cordon",
        "tolerates everything",
        "cordon is NoSchedule",
        "cordon first",
        "not ready",
        "no Ready condition",
        "Ready unknown",
        "tolerates unreachable",
        "not-ready is not unreachable",
        "tolerates not ready",
        "not-ready is NoSchedule here",
        "other node named",
        "this node named",
        "cordon before name",
    ],
)
def test_node_state_and_name(query: JSON, target: JSON, expected: list[str]) -> None:
    assert reasons(query, target) == expected


# -- TaintToleration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("taints", "tolerations", "fits"),
    [
        ([taint("gpu", "NoSchedule", "yes")], [], False),
        ([taint("gpu", "NoExecute", "yes")], [], False),
        ([taint("gpu", "PreferNoSchedule", "yes")], [], True),
        (
            [taint("gpu", "NoSchedule", "yes")],
            [toleration("NoSchedule", "Equal", "gpu", "yes")],
            True,
        ),
        ([taint("gpu", "NoSchedule", "yes")], [toleration("NoSchedule", "", "gpu", "yes")], True),
        (
            [taint("gpu", "NoSchedule", "yes")],
            [toleration("NoSchedule", "Equal", "gpu", "no")],
            False,
        ),
        ([taint("gpu", "NoSchedule", "yes")], [toleration("", "Exists", "gpu")], True),
        ([taint("gpu", "NoSchedule", "yes")], [toleration("NoExecute", "Exists", "gpu")], False),
        ([taint("gpu", "NoSchedule", "yes")], [toleration("", "Exists")], True),
        ([taint("gpu", "NoSchedule", "yes")], [toleration("", "Equal", "", "yes")], True),
        ([taint("gpu", "NoSchedule", "7")], [toleration("", "Gt", "gpu", "5")], False),
        (
            [taint("a", "NoSchedule"), taint("b", "NoExecute")],
            [toleration("", "Exists", "a")],
            False,
        ),
        (
            [taint("a", "NoSchedule"), taint("b", "NoExecute")],
            [toleration("", "Exists", "a"), toleration("NoExecute", "Exists", "b")],
            True,
        ),
    ],
    ids=[
        "NoSchedule",
        "NoExecute",
        "PreferNoSchedule only scores",
        "Equal",
        "operator defaults to Equal",
        "other value",
        "Exists on the key",
        "other effect",
        "empty key with Exists",
        "empty key with Equal compares the value",
        "comparison operators are alpha and off",
        "every taint must be tolerated",
        "all tolerated",
    ],
)
def test_taints(taints: list[JSON], tolerations: list[JSON], fits: bool) -> None:
    expected = [] if fits else [fit.UNTOLERATED_TAINT]
    assert reasons(pod(tolerations=tolerations), node(taints=taints)) == expected


# -- NodeAffinity ------------------------------------------------------------------------

LABELLED = node(labels={"zone": "a", "disk": "ssd", "generation": "5"})


@pytest.mark.parametrize(
    ("spec", "fits"),
    [
        ({"nodeSelector": {"zone": "a"}}, True),
        ({"nodeSelector": {"zone": "a", "disk": "hdd"}}, False),
        ({"nodeSelector": {"rack": ""}}, False),
        ({"affinity": affinity({"matchExpressions": [expression("zone", "In", "a", "b")]})}, True),
        ({"affinity": affinity({"matchExpressions": [expression("zone", "In", "b")]})}, False),
        ({"affinity": affinity({"matchExpressions": [expression("zone", "NotIn", "b")]})}, True),
        ({"affinity": affinity({"matchExpressions": [expression("rack", "NotIn", "r1")]})}, True),
        ({"affinity": affinity({"matchExpressions": [expression("zone", "NotIn", "a")]})}, False),
        ({"affinity": affinity({"matchExpressions": [expression("disk", "Exists")]})}, True),
        ({"affinity": affinity({"matchExpressions": [expression("rack", "Exists")]})}, False),
        ({"affinity": affinity({"matchExpressions": [expression("rack", "DoesNotExist")]})}, True),
        ({"affinity": affinity({"matchExpressions": [expression("disk", "DoesNotExist")]})}, False),
        ({"affinity": affinity({"matchExpressions": [expression("generation", "Gt", "4")]})}, True),
        (
            {"affinity": affinity({"matchExpressions": [expression("generation", "Gt", "5")]})},
            False,
        ),
        ({"affinity": affinity({"matchExpressions": [expression("generation", "Lt", "6")]})}, True),
        (
            {"affinity": affinity({"matchExpressions": [expression("generation", "Lt", "-1")]})},
            False,
        ),
        ({"affinity": affinity({"matchExpressions": [expression("zone", "Gt", "1")]})}, False),
        (
            {"affinity": affinity({"matchExpressions": [expression("generation", "Gt", "x")]})},
            False,
        ),
        (
            {
                "affinity": affinity(
                    {"matchExpressions": [expression("generation", "Gt", "1", "2")]}
                )
            },
            False,
        ),
        ({"affinity": affinity({"matchExpressions": [expression("rack", "Lt", "9")]})}, False),
        ({"affinity": affinity({"matchExpressions": [expression("zone", "Near", "a")]})}, False),
        ({"affinity": affinity({"matchExpressions": [expression("zone", "In")]})}, False),
        ({"affinity": affinity({"matchExpressions": [expression("zone", "NotIn")]})}, False),
        ({"affinity": affinity({"matchExpressions": [expression("zone", "Exists", "a")]})}, False),
        (
            {
                "affinity": affinity(
                    {
                        "matchExpressions": [
                            expression("zone", "In", "a"),
                            expression("disk", "In", "hdd"),
                        ]
                    }
                )
            },
            False,
        ),
        (
            {
                "affinity": affinity(
                    {"matchExpressions": [expression("zone", "In", "b")]},
                    {"matchExpressions": [expression("disk", "In", "ssd")]},
                )
            },
            True,
        ),
        ({"affinity": affinity()}, False),
        ({"affinity": affinity({})}, False),
        ({"affinity": affinity({}, {"matchExpressions": [expression("zone", "In", "a")]})}, True),
        (
            {
                "affinity": affinity(
                    {"matchExpressions": [expression("zone", "Gt", "x")]},
                    {"matchExpressions": [expression("zone", "In", "a")]},
                )
            },
            True,
        ),
        ({"affinity": affinity({"matchFields": [expression("metadata.name", "In", "n1")]})}, True),
        ({"affinity": affinity({"matchFields": [expression("metadata.name", "In", "n2")]})}, False),
        (
            {"affinity": affinity({"matchFields": [expression("metadata.name", "NotIn", "n2")]})},
            True,
        ),
        (
            {
                "affinity": affinity(
                    {"matchFields": [expression("metadata.name", "In", "n1", "n2")]}
                )
            },
            False,
        ),
        ({"affinity": affinity({"matchFields": [expression("metadata.uid", "In", "n1")]})}, False),
        ({"affinity": affinity({"matchFields": [expression("metadata.name", "Exists")]})}, False),
        (
            {
                "affinity": affinity(
                    {
                        "matchExpressions": [expression("zone", "In", "a")],
                        "matchFields": [expression("metadata.name", "In", "n2")],
                    }
                )
            },
            False,
        ),
        (
            {
                "nodeSelector": {"disk": "hdd"},
                "affinity": affinity({"matchExpressions": [expression("zone", "In", "a")]}),
            },
            False,
        ),
        (
            {
                "affinity": {
                    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": None}
                }
            },
            True,
        ),
        ({"affinity": affinity({"matchExpressions": "zone"})}, False),
        (
            {"affinity": affinity({"matchExpressions": [{"key": "zone", "operator": ["In"]}]})},
            False,
        ),
        (
            {
                "affinity": affinity(
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": "a"}]}
                )
            },
            False,
        ),
        ({"nodeSelector": {"zone": 1}}, False),
    ],
    ids=[
        "selector",
        "selector needs every label",
        "selector on an absent label",
        "In",
        "In other",
        "NotIn",
        "NotIn absent label",
        "NotIn excluded",
        "Exists",
        "Exists absent",
        "DoesNotExist",
        "DoesNotExist present",
        "Gt",
        "Gt equal",
        "Lt",
        "Lt negative",
        "Gt on a word",
        "Gt on a non-integer",
        "Gt with two values",
        "Lt on an absent label",
        "unknown operator",
        "In without values",
        "NotIn without values",
        "Exists with values",
        "expressions are ANDed",
        "terms are ORed",
        "no terms",
        "an empty term",
        "an empty term beside a matching one",
        "a broken term beside a matching one",
        "matchFields In",
        "matchFields In other",
        "matchFields NotIn",
        "matchFields with two values",
        "matchFields on another field",
        "matchFields with Exists",
        "labels and fields ANDed",
        "selector and affinity ANDed",
        "null required affinity",
        "expressions not a list",
        "operator not a string",
        "values not a list",
        "selector value not a string",
    ],
)
def test_node_affinity(spec: JSON, fits: bool) -> None:
    assert reasons(pod(**spec), LABELLED) == ([] if fits else [fit.NODE_AFFINITY])


def test_preferred_terms_sum_the_weights_of_matching_ones() -> None:
    preferred = [
        {"weight": 5, "preference": {"matchExpressions": [expression("zone", "In", "a")]}},
        {"weight": 7, "preference": {"matchExpressions": [expression("disk", "Exists")]}},
        {"weight": 11, "preference": {"matchExpressions": [expression("zone", "In", "b")]}},
        {"weight": 13, "preference": {}},
        {"weight": 0, "preference": {"matchExpressions": [expression("zone", "In", "a")]}},
    ]
    facts = PodFacts.of(
        pod(
            affinity={
                "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}
            }
        )
    )
    target = NodeFacts.of(LABELLED)
    assert fit.preference(facts, target.labels, target.name) == 12


# -- NodeResourcesFit --------------------------------------------------------------------

SIDECAR = {**container("proxy", cpu="1"), "restartPolicy": "Always"}


@pytest.mark.parametrize(
    ("query", "target", "others", "expected"),
    [
        (pod(containers=[container(cpu="4")]), node(), [], []),
        (pod(containers=[container(cpu="4100m")]), node(), [], ["Insufficient cpu"]),
        (
            pod(containers=[container(cpu="5", memory="9Gi")]),
            node(),
            [],
            ["Insufficient cpu", "Insufficient memory"],
        ),
        (
            pod(containers=[container(cpu="1")]),
            node(),
            [pod("o", on="n1", containers=[container(cpu="3500m")])],
            ["Insufficient cpu"],
        ),
        (
            pod(containers=[container(cpu="1")]),
            node(),
            [pod("o", on="n1", containers=[container(cpu="3500m")], phase="Succeeded")],
            [],
        ),
        (
            pod(containers=[container(cpu="1")]),
            node(),
            [pod("o", on="n1", containers=[container(cpu="3500m")], phase="Failed")],
            [],
        ),
        (
            pod(containers=[container(cpu="1")]),
            node(),
            [pod("o", on="n2", containers=[container(cpu="3500m")])],
            [],
        ),
        (pod(), node(pods="1"), [pod("o", on="n1")], [fit.TOO_MANY_PODS]),
        (pod(), node(pods="2"), [pod("o", on="n1")], []),
        (
            pod(containers=[container(cpu="5")]),
            node(pods="0"),
            [],
            [fit.TOO_MANY_PODS, "Insufficient cpu"],
        ),
        (
            pod(containers=[container(cpu="1")], initContainers=[container("init", cpu="3")]),
            node(cpu="2"),
            [],
            ["Insufficient cpu"],
        ),
        (
            pod(containers=[container(cpu="1")], initContainers=[container("init", cpu="3")]),
            node(cpu="3"),
            [],
            [],
        ),
        # The sidecar runs beside the app, and beside the init container started after it.
        (
            pod(
                containers=[container(cpu="1")],
                initContainers=[SIDECAR, container("init", cpu="1500m")],
            ),
            node(cpu="2500m"),
            [],
            [],
        ),
        (
            pod(
                containers=[container(cpu="1")],
                initContainers=[SIDECAR, container("init", cpu="1500m")],
            ),
            node(cpu="2400m"),
            [],
            ["Insufficient cpu"],
        ),
        (
            pod(containers=[container(cpu="1700m")], initContainers=[SIDECAR]),
            node(cpu="2600m"),
            [],
            ["Insufficient cpu"],
        ),
        (
            pod(containers=[container(cpu="1")], overhead={"cpu": "500m"}),
            node(cpu="1400m"),
            [],
            ["Insufficient cpu"],
        ),
        (pod(containers=[container(cpu="1")], overhead={"cpu": "500m"}), node(cpu="1500m"), [], []),
        (
            pod(containers=[container(extended={"nvidia.com/gpu": "1"})]),
            node(),
            [],
            ["Insufficient nvidia.com/gpu"],
        ),
        (
            pod(containers=[container(extended={"nvidia.com/gpu": "1"})]),
            node(extended={"nvidia.com/gpu": "1"}),
            [],
            [],
        ),
        (
            pod(containers=[container(extended={"nvidia.com/gpu": "1"})]),
            node(extended={"nvidia.com/gpu": "1"}),
            [pod("o", on="n1", containers=[container(extended={"nvidia.com/gpu": "1"})])],
            ["Insufficient nvidia.com/gpu"],
        ),
        (
            pod(containers=[container(extended={"hugepages-2Mi": "4Mi"})]),
            node(extended={"hugepages-2Mi": "2Mi"}),
            [],
            ["Insufficient hugepages-2Mi"],
        ),
        (
            pod(containers=[container(extended={"ephemeral-storage": "2Gi"})]),
            node(extended={"ephemeral-storage": "1Gi"}),
            [],
            ["Insufficient ephemeral-storage"],
        ),
        # Unprefixed names the scheduler does not know it never compares.
        (pod(containers=[container(widgets="3")]), node(), [], []),
        # Zero requests are not checked, even on an overcommitted node.
        (
            pod(containers=[container(cpu="0", memory="1Gi")]),
            node(),
            [pod("o", on="n1", containers=[container(cpu="5")])],
            [],
        ),
        (pod(containers=[container()]), node(cpu="0", memory="0"), [], []),
        (
            pod(containers=[{"name": "app", "resources": {"limits": {"cpu": "5"}}}]),
            node(),
            [],
            ["Insufficient cpu"],
        ),
        (
            pod(
                containers=[
                    {
                        "name": "app",
                        "resources": {
                            "requests": {"cpu": "1"},
                            "limits": {"cpu": "1", "memory": "9Gi"},
                        },
                    }
                ]
            ),
            node(),
            [],
            ["Insufficient memory"],
        ),
        (pod(containers=[container(cpu="lots")]), node(), [], []),
    ],
    ids=[
        "fits exactly",
        "cpu",
        "cpu and memory",
        "taken by a pod",
        "a succeeded pod holds nothing",
        "a failed pod holds nothing",
        "a pod on another node",
        "pods",
        "room for one more",
        "pods and cpu",
        "init container peak",
        "init container peak fits",
        "sidecar beside init",
        "sidecar beside init, short",
        "sidecar beside the app",
        "overhead",
        "overhead fits",
        "extended resource the node lacks",
        "extended resource",
        "extended resource taken",
        "hugepages",
        "ephemeral storage",
        "unknown unprefixed resource",
        "zero requests",
        "nothing requested, nothing allocatable",
        "requests default to limits",
        "each request left out defaults to its limit",
        "unreadable quantity",
    ],
)
def test_resources(query: JSON, target: JSON, others: list[JSON], expected: list[str]) -> None:
    assert sorted(reasons(query, target, pods=others)) == sorted(expected)


def test_quantities_are_milli_units_rounded_up() -> None:
    facts = PodFacts.of(pod(containers=[container(cpu="0.0001", memory="1Ki")]))
    assert facts.requests == {"cpu": 1, "memory": 1024_000, "pods": 1000}


# -- NodePorts ---------------------------------------------------------------------------


def with_port(name: str, port: int, on: str | None = None, **fields: Any) -> JSON:
    return pod(
        name,
        on=on,
        containers=[container(ports=[{"containerPort": 8080, "hostPort": port, **fields}])],
    )


@pytest.mark.parametrize(
    ("query", "existing", "conflict"),
    [
        (with_port("p", 80), with_port("o", 80, "n1"), True),
        (with_port("p", 80), with_port("o", 81, "n1"), False),
        (with_port("p", 80), with_port("o", 80, "n1", protocol="UDP"), False),
        (with_port("p", 80, protocol="TCP"), with_port("o", 80, "n1"), True),
        (with_port("p", 80, hostIP="127.0.0.1"), with_port("o", 80, "n1"), True),
        (with_port("p", 80, hostIP="0.0.0.0"), with_port("o", 80, "n1", hostIP="10.0.0.1"), True),
        (with_port("p", 80), with_port("o", 80, "n1", hostIP="10.0.0.1"), True),
        (with_port("p", 80, hostIP="10.0.0.2"), with_port("o", 80, "n1", hostIP="10.0.0.1"), False),
        (with_port("p", 80, hostIP="10.0.0.1"), with_port("o", 80, "n1", hostIP="10.0.0.1"), True),
        (with_port("p", 0), with_port("o", 80, "n1"), False),
        (
            pod(containers=[container(ports=[{"containerPort": 80}])]),
            with_port("o", 80, "n1"),
            False,
        ),
        (with_port("p", 80), {**with_port("o", 80, "n1"), "status": {"phase": "Succeeded"}}, False),
        (
            pod(
                initContainers=[
                    {**container("proxy", ports=[{"hostPort": 80}]), "restartPolicy": "Always"}
                ]
            ),
            with_port("o", 80, "n1"),
            True,
        ),
        (
            pod(initContainers=[container("init", ports=[{"hostPort": 80}])]),
            with_port("o", 80, "n1"),
            False,
        ),
    ],
    ids=[
        "same port",
        "other port",
        "other protocol",
        "protocol defaults to TCP",
        "an address against all addresses",
        "all addresses against an address",
        "unset address is all addresses",
        "two addresses",
        "one address",
        "no host port",
        "container port only",
        "a finished pod frees its port",
        "sidecar ports",
        "plain init container ports",
    ],
)
def test_host_ports(query: JSON, existing: JSON, conflict: bool) -> None:
    assert reasons(query, node(), pods=[existing]) == ([fit.NODE_PORTS] if conflict else [])


def test_ports_are_judged_before_resources() -> None:
    query = pod(containers=[container(cpu="9", ports=[{"hostPort": 80}])])
    assert reasons(query, node(), pods=[with_port("o", 80, "n1")]) == [fit.NODE_PORTS]


# -- InterPodAffinity --------------------------------------------------------------------

ZONE = "topology.kubernetes.io/zone"
HOSTNAME = "kubernetes.io/hostname"
A1, A2, B1 = (node(n, labels={ZONE: z}) for n, z in (("a1", "a"), ("a2", "a"), ("b1", "b")))
BARE = node("bare")
CLUSTER = [A1, A2, B1, BARE]


def term(labels: Mapping[str, str] | None, key: str = ZONE, **fields: Any) -> JSON:
    selector = None if labels is None else {"matchLabels": dict(labels)}
    return {"labelSelector": selector, "topologyKey": key, **fields}


def pod_affinity(*terms: JSON, anti: bool = False) -> JSON:
    kind = "podAntiAffinity" if anti else "podAffinity"
    return {kind: {"requiredDuringSchedulingIgnoredDuringExecution": list(terms)}}


def fitting(query: JSON, pods: Iterable[JSON] = ()) -> list[str]:
    return sorted(name for name, why in diagnose(query, CLUSTER, pods).items() if not why)


def rejected(query: JSON, pods: Iterable[JSON] = ()) -> Counter[str]:
    return Counter(r for why in diagnose(query, CLUSTER, pods).values() for r in why)


DB = pod("db", labels={"app": "db"}, on="a1")


@pytest.mark.parametrize(
    ("query", "pods", "fits"),
    [
        (pod(affinity=pod_affinity(term({"app": "db"}))), [DB], ["a1", "a2"]),
        (pod(affinity=pod_affinity(term({"app": "db"}, HOSTNAME))), [DB], ["a1"]),
        (pod(affinity=pod_affinity(term({"app": "web"}))), [DB], []),
        # The first of a group with affinity to itself goes anywhere with the key.
        (
            pod(labels={"app": "web"}, affinity=pod_affinity(term({"app": "web"}))),
            [DB],
            ["a1", "a2", "b1"],
        ),
        (
            pod(labels={"app": "web"}, affinity=pod_affinity(term({"app": "web"}))),
            [],
            ["a1", "a2", "b1"],
        ),
        (
            pod(labels={"app": "db"}, affinity=pod_affinity(term({"app": "db"}))),
            [DB],
            ["a1", "a2"],
        ),
        (pod(affinity=pod_affinity(term(None))), [DB], []),
        (pod(affinity=pod_affinity(term({}))), [DB], ["a1", "a2"]),
        (
            pod(affinity=pod_affinity(term({"app": "db"}))),
            [pod("db", namespace="other", labels={"app": "db"}, on="a1")],
            [],
        ),
        (
            pod(affinity=pod_affinity(term({"app": "db"}, namespaces=["other"]))),
            [pod("db", namespace="other", labels={"app": "db"}, on="a1")],
            ["a1", "a2"],
        ),
        (
            pod(affinity=pod_affinity(term({"app": "db"}, namespaceSelector={}))),
            [pod("db", namespace="other", labels={"app": "db"}, on="b1")],
            ["b1"],
        ),
        # Namespaces' labels are not known: a non-empty namespaceSelector selects none.
        (
            pod(
                affinity=pod_affinity(
                    term({"app": "db"}, namespaceSelector={"matchLabels": {"team": "x"}})
                )
            ),
            [pod("db", namespace="other", labels={"app": "db"}, on="b1")],
            [],
        ),
        # Every term must be met by the same pods.
        (
            pod(affinity=pod_affinity(term({"app": "db"}), term({"tier": "x"}))),
            [DB, pod("x", labels={"tier": "x"}, on="a1")],
            [],
        ),
        (
            pod(affinity=pod_affinity(term({"app": "db"}), term({"tier": "x"}))),
            [pod("both", labels={"app": "db", "tier": "x"}, on="b1")],
            ["b1"],
        ),
        (
            pod(
                labels={"version": "2"},
                affinity=pod_affinity(term({"app": "db"}, matchLabelKeys=["version"])),
            ),
            [pod("db", labels={"app": "db", "version": "1"}, on="a1")],
            [],
        ),
        (
            pod(
                labels={"version": "1"},
                affinity=pod_affinity(term({"app": "db"}, matchLabelKeys=["version"])),
            ),
            [pod("db", labels={"app": "db", "version": "1"}, on="a1")],
            ["a1", "a2"],
        ),
        (
            pod(
                labels={"version": "1"},
                affinity=pod_affinity(term({"app": "db"}, mismatchLabelKeys=["version"])),
            ),
            [pod("db", labels={"app": "db", "version": "1"}, on="a1")],
            [],
        ),
        (pod(affinity=pod_affinity(term({"app": "db"}), anti=True)), [DB], ["b1", "bare"]),
        (
            pod(affinity=pod_affinity(term({"app": "db"}, HOSTNAME), anti=True)),
            [DB],
            ["a2", "b1", "bare"],
        ),
        (
            pod(affinity=pod_affinity(term({"app": "web"}), anti=True)),
            [DB],
            ["a1", "a2", "b1", "bare"],
        ),
        (
            pod(labels={"app": "web"}),
            [
                pod(
                    "db",
                    labels={"app": "db"},
                    on="a1",
                    affinity=pod_affinity(term({"app": "web"}), anti=True),
                )
            ],
            ["b1", "bare"],
        ),
        (
            pod(labels={"app": "api"}),
            [
                pod(
                    "db",
                    labels={"app": "db"},
                    on="a1",
                    affinity=pod_affinity(term({"app": "web"}), anti=True),
                )
            ],
            ["a1", "a2", "b1", "bare"],
        ),
        (
            pod(labels={"app": "web"}, namespace="other"),
            [
                pod(
                    "db",
                    labels={"app": "db"},
                    on="a1",
                    affinity=pod_affinity(term({"app": "web"}), anti=True),
                )
            ],
            ["a1", "a2", "b1", "bare"],
        ),
        (
            pod(labels={"app": "web"}),
            [
                pod(
                    "db",
                    labels={"app": "db"},
                    on="a1",
                    affinity=pod_affinity(term({"app": "web"}, "rack"), anti=True),
                )
            ],
            ["a1", "a2", "b1", "bare"],
        ),
    ],
    ids=[
        "affinity by zone",
        "affinity by host",
        "nothing to be near",
        "first of a group",
        "first of a group, alone",
        "a group already placed",
        "nil selector selects nothing",
        "empty selector selects everything",
        "own namespace by default",
        "listed namespace",
        "every namespace",
        "namespace selector unsupported",
        "all terms by the same pods",
        "all terms met",
        "matchLabelKeys",
        "matchLabelKeys met",
        "mismatchLabelKeys",
        "anti-affinity by zone",
        "anti-affinity by host",
        "anti-affinity with nothing",
        "existing anti-affinity",
        "existing anti-affinity elsewhere",
        "existing anti-affinity in its namespace",
        "existing anti-affinity on a key the node lacks",
    ],
)
def test_inter_pod_affinity(query: JSON, pods: list[JSON], fits: list[str]) -> None:
    assert fitting(query, pods) == fits


def test_a_stored_pods_terms_are_as_its_apiserver_merged_them() -> None:
    # Created with version 1, whose matchLabelKeys the apiserver merged into its
    # anti-affinity then; relabelled to version 2 since, which leaves its terms alone.
    merged = term(
        None,
        HOSTNAME,
        labelSelector={
            "matchLabels": {"app": "web"},
            "matchExpressions": [{"key": "version", "operator": "In", "values": ["1"]}],
        },
        matchLabelKeys=["version"],
    )
    relabelled = pod(
        "w1",
        labels={"app": "web", "version": "2"},
        on="a1",
        affinity=pod_affinity(merged, anti=True),
    )
    relabelled["metadata"]["uid"] = "4b1e"
    assert fitting(pod(labels={"app": "web", "version": "1"}), [relabelled]) == ["a2", "b1", "bare"]
    # A pod yet to be created gets the merge from its own labels.
    unmerged = term({"app": "web"}, HOSTNAME, matchLabelKeys=["version"])
    query = pod(labels={"app": "web", "version": "2"}, affinity=pod_affinity(unmerged, anti=True))
    assert fitting(query, [relabelled]) == ["a2", "b1", "bare"]
    assert fitting(query, [pod("w1", labels={"app": "web", "version": "1"}, on="a1")]) == [
        "a1",
        "a2",
        "b1",
        "bare",
    ]


def test_inter_pod_reasons() -> None:
    near = pod(affinity=pod_affinity(term({"app": "db"})))
    assert rejected(near, [DB]) == {fit.POD_AFFINITY: 2}
    apart = pod(affinity=pod_affinity(term({"app": "db"}), anti=True))
    assert rejected(apart, [DB]) == {fit.POD_ANTI_AFFINITY: 2}
    guarded = pod(
        "db", labels={"app": "db"}, on="a1", affinity=pod_affinity(term({"app": "web"}), anti=True)
    )
    assert rejected(pod(labels={"app": "web"}), [guarded]) == {fit.EXISTING_ANTI_AFFINITY: 2}
    both = pod(labels={"app": "web"}, affinity=pod_affinity(term({"app": "db"})))
    assert rejected(both, [guarded]) == {fit.POD_AFFINITY: 2, fit.EXISTING_ANTI_AFFINITY: 2}


# -- PodTopologySpread -------------------------------------------------------------------


def spread(max_skew: int = 1, key: str = ZONE, **fields: Any) -> JSON:
    return {
        "maxSkew": max_skew,
        "topologyKey": key,
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"app": "web"}},
        **fields,
    }


def web(name: str, on: str, **fields: Any) -> JSON:
    return pod(name, labels={"app": "web"}, on=on, **fields)


def spreading(*constraints: JSON, **fields: Any) -> JSON:
    return pod(labels={"app": "web"}, topologySpreadConstraints=list(constraints), **fields)


@pytest.mark.parametrize(
    ("query", "pods", "fits"),
    [
        (spreading(spread()), [], ["a1", "a2", "b1"]),
        (spreading(spread()), [web("w1", "a1")], ["b1"]),
        (spreading(spread(2)), [web("w1", "a1")], ["a1", "a2", "b1"]),
        (spreading(spread()), [web("w1", "a1"), web("w2", "b1")], ["a1", "a2", "b1"]),
        # Fewer domains than minDomains: the global minimum is 0.
        (spreading(spread(minDomains=3)), [web("w1", "a1"), web("w2", "b1")], []),
        (spreading(spread(minDomains=2)), [web("w1", "a1"), web("w2", "b1")], ["a1", "a2", "b1"]),
        (
            spreading(spread(whenUnsatisfiable="ScheduleAnyway")),
            [web("w1", "a1")],
            ["a1", "a2", "b1", "bare"],
        ),
        # A pod its own selector does not match adds nothing to the skew.
        (pod(topologySpreadConstraints=[spread()]), [web("w1", "a1")], ["a1", "a2", "b1"]),
        (spreading(spread()), [web("w1", "a1", deleting=True)], ["a1", "a2", "b1"]),
        (
            spreading(spread()),
            [pod("w1", labels={"app": "web"}, namespace="other", on="a1")],
            ["a1", "a2", "b1"],
        ),
        (spreading(spread()), [web("w1", "a1", phase="Succeeded")], ["a1", "a2", "b1"]),
        # A key the pod lacks adds nothing to the selector.
        (spreading(spread(matchLabelKeys=["version"])), [web("w1", "a1")], ["b1"]),
        (
            pod(
                labels={"app": "web", "version": "2"},
                topologySpreadConstraints=[spread(matchLabelKeys=["version"])],
            ),
            [pod("w1", labels={"app": "web", "version": "1"}, on="a1")],
            ["a1", "a2", "b1"],
        ),
        (
            pod(
                labels={"app": "web", "version": "1"},
                topologySpreadConstraints=[spread(matchLabelKeys=["version"])],
            ),
            [pod("w1", labels={"app": "web", "version": "1"}, on="a1")],
            ["b1"],
        ),
        # Nodes the pod's node affinity excludes hold no domain (Honor by default)...
        (spreading(spread(), nodeSelector={ZONE: "a"}), [web("w1", "a1")], ["a1", "a2"]),
        # ...unless the policy says Ignore.
        (
            spreading(spread(nodeAffinityPolicy="Ignore"), nodeSelector={ZONE: "a"}),
            [web("w1", "a1")],
            [],
        ),
        (spreading(spread(), spread(key=HOSTNAME)), [web("w1", "a1")], ["b1"]),
        (spreading(spread(3), spread(key=HOSTNAME)), [web("w1", "a1")], ["a2", "b1"]),
        # An empty selector counts no other pod, only the pod itself.
        (
            spreading(spread(labelSelector={})),
            [web("w1", "a1"), pod("o1", labels={"app": "other"}, on="a1")],
            ["a1", "a2", "b1"],
        ),
    ],
    ids=[
        "empty cluster",
        "skew",
        "larger skew",
        "balanced",
        "minDomains above the domains",
        "minDomains met",
        "ScheduleAnyway is not a filter",
        "no self-match",
        "terminating pods are not counted",
        "other namespaces are not counted",
        "finished pods are not counted",
        "matchLabelKeys absent from the pod",
        "matchLabelKeys with another value",
        "matchLabelKeys with the same value",
        "node affinity honoured",
        "node affinity ignored",
        "two constraints",
        "each constraint on its own",
        "empty selector",
    ],
)
def test_topology_spread(query: JSON, pods: list[JSON], fits: list[str]) -> None:
    assert fitting(query, pods) == fits


def test_spread_taints_policy() -> None:
    tainted = node("b1", labels={ZONE: "b"}, taints=[taint("gpu", "NoSchedule")])
    cluster = [A1, A2, tainted]
    ignored = spreading(spread(), tolerations=[toleration(operator="Exists", key="x")])
    honoured = spreading(
        spread(nodeTaintsPolicy="Honor"), tolerations=[toleration(operator="Exists", key="x")]
    )
    pods = [web("w1", "a1")]
    # b1 still holds a domain with none: a1 and a2 are one above it.
    assert diagnose(ignored, cluster, pods)["a2"] == [fit.SPREAD]
    # b1's taint takes its domain out: zone a is the only one, its minimum its own count.
    assert diagnose(honoured, cluster, pods)["a2"] == []


def test_spread_reasons() -> None:
    assert rejected(spreading(spread()), [web("w1", "a1")]) == {
        fit.SPREAD: 2,
        fit.SPREAD_LABEL: 1,
    }


# -- selectors and malformed input -------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        (None, {"a": "1"}, False),
        ({}, {"a": "1"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
        ({"matchExpressions": [expression("a", "In", "1", "2")]}, {"a": "2"}, True),
        ({"matchExpressions": [expression("a", "NotIn", "1")]}, {}, True),
        ({"matchExpressions": [expression("a", "Exists")]}, {"a": ""}, True),
        ({"matchExpressions": [expression("a", "DoesNotExist")]}, {"a": ""}, False),
        ({"matchExpressions": [expression("a", "Gt", "1")]}, {"a": "2"}, False),
        ({"matchExpressions": [expression("a", "Bogus")]}, {"a": "1"}, False),
        ({"matchLabels": {"a": 1}}, {"a": "1"}, False),
        ("app=web", {"app": "web"}, False),
    ],
    ids=[
        "nil",
        "empty",
        "matchLabels",
        "matchLabels other",
        "In",
        "NotIn absent",
        "Exists empty value",
        "DoesNotExist",
        "Gt is for node selectors",
        "unknown operator",
        "value not a string",
        "not an object",
    ],
)
def test_label_selector(selector: Any, labels: dict[str, str], matches: bool) -> None:
    assert fit.selector_matches(fit.label_selector(selector), labels) is matches


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("42", 42),
        ("-7", -7),
        ("+3", 3),
        ("007", 7),
        ("4.0", None),
        (" 4", None),
        ("1_0", None),
        ("", None),
        (str(2**63), None),
        (str(-(2**63)), -(2**63)),
    ],
)
def test_integers_are_parsed_as_go_does(text: str, number: int | None) -> None:
    assert fit.requirement(expression("k", "Gt", text), fit.NODE_OPERATORS) == (
        None if number is None else fit.Requirement("k", "Gt", bound=number)
    )


def test_malformed_pods_and_nodes_do_not_crash() -> None:
    query = pod(
        containers=[container(cpu="1", ports=[{"hostPort": "80"}, "x"])],
        tolerations=["x", {"key": 1}],
        nodeSelector="zone=a",
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": "x"}
            },
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": 3}]
            },
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": "x"},
        },
        topologySpreadConstraints=[{"whenUnsatisfiable": "DoNotSchedule", "maxSkew": "1"}, 5],
        overhead={"cpu": None},
    )
    strange = {
        "metadata": {"name": "odd", "labels": {"a": 1}},
        "spec": {"taints": ["x"]},
        "status": {"allocatable": {"cpu": "x"}},
    }
    assert set(diagnose(query, [strange, node()])) == {"odd", "n1"}
