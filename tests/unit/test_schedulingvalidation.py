"""The apiserver's rules for the scheduling fields the webhook moves out of its sight."""

from typing import Any

import pytest

from kubekit.schedulingvalidation import Invalid, check_scheduling_fields

REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def node_affinity(*expressions: dict[str, Any], fields: Any = ()) -> dict[str, Any]:
    term: dict[str, Any] = {"matchExpressions": list(expressions)}
    if fields:
        term["matchFields"] = list(fields)
    return {"affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [term]}}}}


def spread(**changes: Any) -> dict[str, Any]:
    constraint = {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"app": "web"}},
    }
    return {"topologySpreadConstraints": [{**constraint, **changes}]}


def pod_affinity(term: dict[str, Any], weight: int | None = None) -> dict[str, Any]:
    if weight is None:
        return {"affinity": {"podAntiAffinity": {REQUIRED: [term]}}}
    entry = {"weight": weight, "podAffinityTerm": term}
    return {"affinity": {"podAffinity": {PREFERRED: [entry]}}}


VALID = [
    {"nodeSelector": {"disk": "ssd", "node-role.kubernetes.io/gpu": "", "a.b/c_d.e": "X-1"}},
    node_affinity(
        {"key": "gpu", "operator": "In", "values": ["a100"]},
        {"key": "cores", "operator": "Gt", "values": ["8"]},
        {"key": "spot", "operator": "DoesNotExist"},
        fields=[{"key": "metadata.name", "operator": "NotIn", "values": ["vk-1"]}],
    ),
    {"affinity": {"nodeAffinity": {PREFERRED: [{"weight": 100, "preference": {}}]}}},
    spread(minDomains=2, nodeAffinityPolicy="Honor", nodeTaintsPolicy="Ignore"),
    spread(whenUnsatisfiable="ScheduleAnyway"),
    # Neither does the apiserver hold these to a form: the scheduler takes a term with a
    # value that does not parse for one matching no node.
    node_affinity({"key": "gpu-mem", "operator": "Gt", "values": ["16Gi"]}),
    spread(topologyKey="Example.com/rack", whenUnsatisfiable="ScheduleAnyway"),
    pod_affinity({"topologyKey": "kubernetes.io/hostname", "labelSelector": {}}, weight=1),
]


@pytest.mark.parametrize("fields", VALID)
def test_what_the_apiserver_takes_passes(fields: dict[str, Any]) -> None:
    check_scheduling_fields(fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nodeSelector": {"bad key": "x"}}, "spec.nodeSelector: Invalid value: 'bad key'"),
        ({"nodeSelector": {"Ex.com/a": "x"}}, "not a label key"),
        ({"nodeSelector": {"disk": "-ssd"}}, "spec.nodeSelector[disk]: Invalid value: '-ssd'"),
        (
            node_affinity({"key": "gpu", "operator": "Equals", "values": ["a"]}),
            "nodeSelectorTerms[0].matchExpressions[0].operator: Invalid value: 'Equals'",
        ),
        (node_affinity({"key": "gpu", "operator": "In"}), "values: Required value: needed for In"),
        (node_affinity({"key": "gpu", "operator": "Exists", "values": ["a"]}), "Forbidden"),
        (node_affinity({"key": "c", "operator": "Gt", "values": ["1", "2"]}), "exactly one"),
        (
            node_affinity(
                fields=[{"key": "metadata.name", "operator": "In", "values": ["a", "b"]}]
            ),
            "matchFields[0].values: Required value: exactly one",
        ),
        (
            node_affinity(fields=[{"key": "spec.x", "operator": "In", "values": ["a"]}]),
            "only metadata.name",
        ),
        (
            {"affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": []}}}},
            "at least one node selector term",
        ),
        (
            {"affinity": {"nodeAffinity": {PREFERRED: [{"weight": 0, "preference": {}}]}}},
            "weight: Invalid value: 0: must be in the range 1-100",
        ),
        (pod_affinity({"topologyKey": ""}), "podAntiAffinity.requiredDuringScheduling"),
        (pod_affinity({"topologyKey": "zone"}, weight=101), "range 1-100"),
        (
            pod_affinity(
                {"topologyKey": "zone", "labelSelector": {"matchExpressions": [{"key": "a"}]}}
            ),
            "labelSelector.matchExpressions[0].operator",
        ),
        (spread(maxSkew=0), "topologySpreadConstraints[0].maxSkew: Invalid value: 0"),
        (spread(maxSkew=2**31), "maxSkew"),
        (spread(topologyKey=""), "topologyKey: Required value"),
        (spread(whenUnsatisfiable="Foo"), "whenUnsatisfiable: Unsupported value: 'Foo'"),
        (spread(minDomains=0), "minDomains: Invalid value: 0"),
        (spread(minDomains=2, whenUnsatisfiable="ScheduleAnyway"), "only with DoNotSchedule"),
        (spread(nodeTaintsPolicy="honor"), "nodeTaintsPolicy: Unsupported value"),
    ],
)
def test_what_the_apiserver_refuses_is_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(Invalid) as raised:
        check_scheduling_fields(fields)
    assert message in str(raised.value)
