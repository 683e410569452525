"""The scheduling-stash webhook called by a real upper apiserver: pods keep their
lower-cluster scheduling semantics without confusing the upper scheduler."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from harness.federation import Federation
from harness.localcluster import LocalCluster, NodeSpec
from kubekit import keys, stash

from .helpers import (
    apply,
    federated_deployment,
    federated_namespace,
    get_json,
    pods_by_name,
    rollout,
    wait_for,
)

SSD = {"disk": "ssd"}


@pytest.fixture
def ssd_node(federation: Federation) -> Iterator[str]:
    """One node of lower-1 labelled disk=ssd (the virtual node does not carry it: the
    other lower node lacks it)."""
    lower = federation.clusters["lower-1"]
    name = f"{lower.name}-node-1"
    lower.kubectl("label", "node", name, "disk=ssd")
    yield name
    lower.kubectl("label", "node", name, "disk-")


def container() -> dict[str, Any]:
    return {"name": "app", "image": "registry.k8s.io/pause:3.10"}


def lower_pod(federation: Federation, cluster: str, ns: str, name: str) -> Any:
    lower = federation.clusters[cluster]

    def running() -> Any:
        found = lower.kubectl("get", "pod", "-n", ns, name, "-o", "json", check=False)
        if found.returncode != 0:
            return None
        pod = json.loads(found.stdout)
        return pod if pod["status"].get("phase") == "Running" else None

    return wait_for(running, f"lower pod {ns}/{name} Running in {cluster}")


def test_node_selector_and_affinity_are_stashed_above_and_restored_below(
    federation: Federation, ssd_node: str
) -> None:
    upper = federation.upper
    apply(upper, federated_namespace("wh-ssd"))
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}
                ]
            }
        }
    }
    node_selector = {**SSD, keys.CLUSTER_ID_LABEL: "lower-1"}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "fast", "namespace": "wh-ssd"},
        "spec": {
            "nodeSelector": node_selector,
            "affinity": affinity,
            "terminationGracePeriodSeconds": 0,
            "containers": [container()],
        },
    }
    upper.kubectl("create", "-f", "-", input=json.dumps(pod))

    def scheduled() -> Any:
        found = get_json(upper, "pod", "-n", "wh-ssd", "fast")
        return found if found["spec"].get("nodeName") else None

    above = wait_for(scheduled, "the pod scheduled in the upper cluster")
    assert above["spec"]["nodeName"] == "vk-lower-1"
    assert above["spec"]["nodeSelector"] == {
        keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
        keys.CLUSTER_ID_LABEL: "lower-1",
    }
    assert "affinity" not in above["spec"]
    assert stash.PROVIDER_TOLERATION in above["spec"]["tolerations"]
    saved = stash.decode(above["metadata"]["annotations"][keys.STASH_ANNOTATION])
    assert saved["nodeSelector"] == node_selector
    assert saved["affinity"] == affinity

    below = lower_pod(federation, "lower-1", "wh-ssd", "fast")
    # The cluster-id key only virtual nodes carry is dropped below; the rest is restored.
    assert below["spec"]["nodeSelector"] == SSD
    # Restored as it was, each required term pinned to the node the estimator held room on.
    for term in below["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]:
        assert term.pop("matchFields") == [
            {"key": "metadata.name", "operator": "In", "values": [ssd_node]}
        ]
    assert below["spec"]["affinity"] == affinity
    assert below["spec"]["nodeName"] == ssd_node
    assert not any(
        t.get("key") == keys.PROVIDER_TAINT_KEY for t in below["spec"].get("tolerations", [])
    )


def test_every_toleration_stays_above_and_added_ones_reach_the_lower_pod(
    federation: Federation,
) -> None:
    """A toleration of every taint stays above (the pod would otherwise get the default
    300 s for the node controller's unreachable taint) and tolerates the provider's
    taint; one added to the running pod above is added to the lower pod."""
    upper = federation.upper
    apply(upper, federated_namespace("wh-tolerate"))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "anywhere", "namespace": "wh-tolerate"},
        "spec": {
            "nodeSelector": {keys.CLUSTER_ID_LABEL: "lower-1"},
            "tolerations": [{"operator": "Exists"}],
            "terminationGracePeriodSeconds": 0,
            "containers": [container()],
        },
    }
    upper.kubectl("create", "-f", "-", input=json.dumps(pod))
    above = get_json(upper, "pod", "-n", "wh-tolerate", "anywhere")
    assert above["spec"]["tolerations"] == [{"operator": "Exists"}]
    below = lower_pod(federation, "lower-1", "wh-tolerate", "anywhere")
    assert below["spec"]["tolerations"] == [{"operator": "Exists"}]
    spot = {"key": "spot", "operator": "Exists", "effect": "NoExecute"}
    upper.kubectl(
        "patch", "pod", "anywhere", "-n", "wh-tolerate", "--type=json",
        "-p", json.dumps([{"op": "add", "path": "/spec/tolerations/-", "value": spot}]),
    )  # fmt: skip
    wait_for(
        lambda: (
            spot
            in lower_pod(federation, "lower-1", "wh-tolerate", "anywhere")["spec"]["tolerations"]
        ),
        "the added toleration on the lower pod",
    )


def test_a_runtime_class_node_selector_put_back_by_the_apiserver_is_stashed_again(
    federation: Federation, ssd_node: str
) -> None:
    """The RuntimeClass admission plugin adds its class's node selector, and adds it
    again after the webhook changed the pod; the webhook, called again, stashes it again:
    the pod is not left Pending above asking the virtual nodes for disk=ssd."""
    runtime_class = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": "wh-ssd-runtime"},
        "handler": "runc",
        "scheduling": {"nodeSelector": SSD},
    }
    upper, lower = federation.upper, federation.clusters["lower-1"]
    apply(upper, runtime_class, federated_namespace("wh-runtime"))
    apply(lower, {**runtime_class, "scheduling": None})
    try:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "sandboxed", "namespace": "wh-runtime"},
            "spec": {
                "runtimeClassName": "wh-ssd-runtime",
                "terminationGracePeriodSeconds": 0,
                "containers": [container()],
            },
        }
        upper.kubectl("create", "-f", "-", input=json.dumps(pod))
        above = get_json(upper, "pod", "-n", "wh-runtime", "sandboxed")
        assert "disk" not in (above["spec"].get("nodeSelector") or {})
        saved = stash.decode(above["metadata"]["annotations"][keys.STASH_ANNOTATION])
        assert saved["nodeSelector"] == SSD
        below = lower_pod(federation, "lower-1", "wh-runtime", "sandboxed")
        assert below["spec"]["nodeSelector"] == SSD
        assert below["spec"]["nodeName"] == ssd_node
    finally:
        upper.kubectl("delete", "namespace", "wh-runtime", "--wait=false")
        for cluster in (upper, lower):
            cluster.kubectl("delete", "runtimeclass", "wh-ssd-runtime", "--ignore-not-found")


def test_a_pin_to_a_virtual_node_by_name_holds_above(federation: Federation) -> None:
    """The pin stays above and is met below. (Here the multischeduler would also keep the
    pods off vk-lower-1, whose lower nodes all fail the restored pin; without it, a pin
    stashed above let the upper scheduler bind them there: tests/unit/test_stash.py.)"""
    upper = federation.upper
    apply(upper, federated_namespace("wh-pinned"))
    pin = {"key": "metadata.name", "operator": "In", "values": ["vk-lower-2"]}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [pin]}]
            }
        }
    }
    for index in range(3):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"pinned-{index}", "namespace": "wh-pinned"},
            "spec": {
                "affinity": affinity,
                "terminationGracePeriodSeconds": 0,
                "containers": [container()],
            },
        }
        upper.kubectl("create", "-f", "-", input=json.dumps(pod))
    for index in range(3):
        below = lower_pod(federation, "lower-2", "wh-pinned", f"pinned-{index}")
        # Held of every lower node: gone below (but for the pin to the lower node the
        # estimator held room on).
        assert "vk-lower-2" not in json.dumps(below["spec"].get("affinity") or {})
        above = get_json(upper, "pod", "-n", "wh-pinned", f"pinned-{index}")
        assert above["spec"]["nodeName"] == "vk-lower-2"


def test_topology_spread_across_zones_keeps_its_semantics_below(federation: Federation) -> None:
    upper = federation.upper
    apply(upper, federated_namespace("wh-spread"))
    spread = [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": "spread"}},
        }
    ]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "spread", "namespace": "wh-spread"},
        "spec": {
            "replicas": 4,
            "selector": {"matchLabels": {"app": "spread"}},
            "template": {
                "metadata": {"labels": {"app": "spread"}},
                "spec": {
                    # The virtual nodes carry no zone label (lower nodes differ): unstashed,
                    # this constraint would leave every replica Pending above.
                    "topologySpreadConstraints": spread,
                    "nodeSelector": {keys.CLUSTER_ID_LABEL: "lower-2"},
                    "terminationGracePeriodSeconds": 0,
                    "containers": [container()],
                },
            },
        },
    }
    apply(upper, deployment)
    rollout(upper, "spread", "wh-spread")
    lower = federation.clusters["lower-2"]
    zones = {
        n["metadata"]["name"]: n["metadata"]["labels"]["topology.kubernetes.io/zone"]
        for n in get_json(lower, "nodes")["items"]
    }

    def placed() -> dict[str, Any]:
        pods = pods_by_name(lower, "wh-spread", "app=spread")
        done = len(pods) == 4 and all(p["spec"].get("nodeName") for p in pods.values())
        return pods if done else {}

    pods = wait_for(placed, "4 lower pods placed")
    per_zone: dict[str, int] = {}
    for pod in pods.values():
        assert pod["spec"]["topologySpreadConstraints"] == spread
        zone = zones[pod["spec"]["nodeName"]]
        per_zone[zone] = per_zone.get(zone, 0) + 1
    assert sorted(per_zone.values()) == [2, 2], per_zone


def ssd_pod(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"nodeSelector": SSD, "containers": [container()]},
    }


def test_pods_of_other_namespaces_are_untouched(federation: Federation) -> None:
    upper = federation.upper
    upper.kubectl("create", "namespace", "wh-plain")
    pod = ssd_pod("plain", "wh-plain")
    created = json.loads(
        upper.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(pod)).stdout
    )
    assert keys.STASH_ANNOTATION not in created["metadata"].get("annotations", {})
    assert created["spec"]["nodeSelector"] == SSD
    assert all(t["key"] != keys.PROVIDER_TAINT_KEY for t in created["spec"]["tolerations"])


def test_a_stash_written_on_a_pod_the_webhook_does_not_guard_is_not_read(
    federation: Federation,
) -> None:
    """Outside a federated namespace anyone may write the annotation, past what the upper
    admission held the spec to: bound to a virtual node, the pod waits above saying why,
    and is never made below with the fields it names."""
    upper = federation.upper
    upper.kubectl("create", "namespace", "wh-forged")
    forged = stash.encode({"nodeSelector": {"disk": "hdd"}})
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "forged",
            "namespace": "wh-forged",
            "annotations": {keys.STASH_ANNOTATION: forged},
        },
        "spec": {
            "nodeName": "vk-lower-1",
            "tolerations": [{"key": keys.PROVIDER_TAINT_KEY, "operator": "Exists"}],
            "terminationGracePeriodSeconds": 0,
            "containers": [container()],
        },
    }
    upper.kubectl("create", "-f", "-", input=json.dumps(pod))

    why = "namespace wh-forged is not labelled kubestrata.io/federation=enabled"

    def refused() -> Any:
        found = get_json(upper, "pod", "-n", "wh-forged", "forged")
        conditions = found["status"].get("conditions") or []
        scheduled = [c for c in conditions if c["type"] == "PodScheduled"]
        # (At first, maybe, its namespace not seen yet by the virtual node.)
        return scheduled[0] if scheduled and why in scheduled[0].get("message", "") else None

    scheduled = wait_for(refused, "the pod with a stash nobody guards said to wait")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "StashNotGuarded")
    lower = federation.clusters["lower-1"]
    assert lower.kubectl("get", "pod", "-n", "wh-forged", "forged", check=False).returncode != 0


def test_server_side_dry_run_shows_the_stash(federation: Federation) -> None:
    upper = federation.upper
    apply(upper, federated_namespace("wh-dry"))
    pod = ssd_pod("dry", "wh-dry")
    shown = json.loads(
        upper.kubectl(
            "create", "--dry-run=server", "-f", "-", "-o", "json", input=json.dumps(pod)
        ).stdout
    )
    assert keys.STASH_ANNOTATION in shown["metadata"]["annotations"]
    assert shown["spec"]["nodeSelector"] == stash.VIRTUAL_NODE_SELECTOR
    assert upper.kubectl("get", "pod", "-n", "wh-dry", "dry", check=False).returncode != 0


def test_kubectl_warns_of_a_descheduler_annotation_it_reads_as_never(
    federation: Federation,
) -> None:
    upper = federation.upper
    apply(upper, federated_namespace("wh-warn"))
    pod = ssd_pod("warned", "wh-warn")
    pod["metadata"]["annotations"] = {keys.DESCHEDULER_ANNOTATION: "false"}
    created = upper.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod))
    assert (
        "Warning: annotation kubestrata.io/descheduler='false' is read as 'never'" in created.stderr
    )
    pod["metadata"]["annotations"] = {keys.DESCHEDULER_ANNOTATION: "never"}
    created = upper.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod))
    assert "Warning" not in created.stderr


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{oops", "body is not JSON"),
        (b'{"apiVersion": "v1", "kind": "Pod"}', "expected apiVersion admission.k8s.io/v1"),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}',
            "request.uid",
        ),
    ],
)
def test_malformed_admission_reviews_get_400(
    federation: Federation, body: bytes, message: str
) -> None:
    url = federation.webhook_url
    assert url is not None
    context = ssl.create_default_context(
        cafile=str(federation.state_dir / "webhook" / "webhook-ca.crt")
    )
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, context=context, timeout=10)
    assert raised.value.code == 400
    assert message in json.loads(raised.value.read())["message"]


EVERY_TAINT = [{"operator": "Exists"}]
# The virtual nodes' taint by its key: a DaemonSet that means virtual nodes.
VIRTUAL_NODES_TAINT = [{"key": keys.PROVIDER_TAINT_KEY, "operator": "Exists"}]


def daemonset(name: str, ns: str, tolerations: list[Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "tolerations": tolerations,
                    "terminationGracePeriodSeconds": 0,
                    "containers": [container()],
                    **spec,
                },
            },
        },
    }


def pinned_node(pod: dict[str, Any]) -> str | None:
    """The node a DaemonSet's pod is pinned to by name (None: the pin is not there)."""
    required = (
        (pod["spec"].get("affinity") or {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
    )
    for term in required.get("nodeSelectorTerms") or []:
        for field in term.get("matchFields") or []:
            if field["key"] == "metadata.name" and field["operator"] == "In":
                return str(field["values"][0])
    return None


def nodes_of(upper: LocalCluster, name: str) -> list[str]:
    pods = pods_by_name(upper, "daemons", f"app={name}").values()
    return sorted(str(p["spec"].get("nodeName") or pinned_node(p)) for p in pods)


def lower_apps(federation: Federation, cluster: str) -> list[str]:
    below = get_json(federation.clusters[cluster], "pods", "-n", "daemons")["items"]
    return sorted(p["metadata"]["labels"]["app"] for p in below)


def test_daemonsets_on_virtual_nodes_only_when_they_mean_them_and_without_churn(
    federation: Federation,
) -> None:
    """Node agents tolerating every taint are kept off virtual nodes, also once a
    DaemonSet's template comes to tolerate every taint; one tolerating the virtual nodes'
    taint by its key runs once in each lower cluster (its pods keep their pins to one node
    each: stashed, a pod for one node was bound to another, deleted there by its DaemonSet
    and made again without end), and one the lower clusters refuse (it asks for their
    hosts' network) stays unbound above with the reason, never made and failed."""
    upper = federation.upper
    assert isinstance(upper, LocalCluster)
    apply(upper, federated_namespace("daemons"))
    plain = "upper-plain"
    upper.add_nodes([NodeSpec(name=plain, cpu="4", memory="8Gi", pods=110)])
    everywhere = sorted([plain, "vk-lower-1", "vk-lower-2"])
    try:
        apply(
            upper,
            daemonset("node-agents", "daemons", EVERY_TAINT),
            daemonset("cluster-agents", "daemons", VIRTUAL_NODES_TAINT),
            daemonset("host-agents", "daemons", VIRTUAL_NODES_TAINT, hostNetwork=True),
        )
        for name in ("node-agents", "cluster-agents"):
            upper.kubectl("rollout", "status", "-n", "daemons", f"ds/{name}", "--timeout=90s")
        assert nodes_of(upper, "node-agents") == [plain]
        assert nodes_of(upper, "cluster-agents") == everywhere
        cluster_agents = pods_by_name(upper, "daemons", "app=cluster-agents")
        for cluster in ("lower-1", "lower-2"):
            (name,) = [
                n for n, p in cluster_agents.items() if p["spec"]["nodeName"] == f"vk-{cluster}"
            ]
            lower_pod(federation, cluster, "daemons", name)

        refusal = "runs no pod that uses its nodes' host (spec.hostNetwork)"

        def refused_in_each_cluster() -> bool:
            pods = pods_by_name(upper, "daemons", "app=host-agents").values()
            pins = {
                p["metadata"]["name"]: pinned_node(p) for p in pods if not p["spec"].get("nodeName")
            }
            events = get_json(
                upper, "events", "-n", "daemons", "--field-selector", "reason=FailedScheduling"
            )["items"]
            said = {
                (e["involvedObject"]["name"], node)
                for e in events
                for node in ("vk-lower-1", "vk-lower-2")
                if f"{node}: lower cluster {node[3:]} {refusal}" in e["message"]
            }
            return (
                sorted(str(n) for n in pins.values()) == ["vk-lower-1", "vk-lower-2"]
                and set(pins.items()) <= said
            )

        wait_for(refused_in_each_cluster, "the host agents' pods for virtual nodes to be refused")
        assert nodes_of(upper, "host-agents") == everywhere
        for cluster in ("lower-1", "lower-2"):
            assert lower_apps(federation, cluster) == ["cluster-agents"]
        assert set(pods_by_name(upper, "daemons", "app=cluster-agents")) == set(cluster_agents)
        deleted = get_json(
            upper, "events", "-n", "daemons", "--field-selector", "reason=SuccessfulDelete"
        )["items"]
        assert deleted == [], [e["message"] for e in deleted]

        # Its template changed to tolerate every taint, a DaemonSet leaves the virtual nodes.
        upper.kubectl(
            "patch",
            "-n",
            "daemons",
            "ds/cluster-agents",
            "--type=json",
            "-p",
            json.dumps(
                [{"op": "replace", "path": "/spec/template/spec/tolerations", "value": EVERY_TAINT}]
            ),
        )
        wait_for(
            lambda: (
                nodes_of(upper, "cluster-agents") == [plain]
                and not any(lower_apps(federation, c) for c in ("lower-1", "lower-2"))
            ),
            "the DaemonSet's pods to leave the virtual nodes and the lower clusters",
        )
    finally:
        upper.kubectl("delete", "namespace", "daemons", "--wait=false")
        upper.kubectl("delete", "node", plain, "--ignore-not-found")


def test_a_bare_pod_manifest_applied_again_updates_the_pod(
    federation: Federation, ssd_node: str
) -> None:
    """Applying a pod's manifest again (a new image, a label) puts back the scheduling
    fields the webhook moved into the stash and drops the provider's toleration it added;
    the webhook, called on that update, moves them again, so the update changes only what
    the manifest changed, as it does without kubestrata. Client-side and server-side
    apply both."""
    upper = federation.upper
    apply(upper, federated_namespace("wh-reapply"))
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "again", "namespace": "wh-reapply", "labels": {"v": "1"}},
        "spec": {
            "nodeSelector": SSD,
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 0,
            "containers": [container()],
        },
    }
    upper.kubectl("apply", "-f", "-", input=json.dumps(pod))
    lower_pod(federation, "lower-1", "wh-reapply", "again")
    before = get_json(upper, "pod", "-n", "wh-reapply", "again")

    pod["metadata"]["labels"] = {"v": "2"}
    pod["spec"]["containers"] = [{**container(), "image": "registry.k8s.io/pause:3.9"}]
    upper.kubectl("apply", "-f", "-", input=json.dumps(pod))
    pod["metadata"]["labels"] = {"v": "3"}
    upper.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(pod))

    after = get_json(upper, "pod", "-n", "wh-reapply", "again")
    assert after["metadata"]["labels"]["v"] == "3"
    assert after["spec"]["containers"][0]["image"] == "registry.k8s.io/pause:3.9"
    for field in stash.FIELDS:
        assert after["spec"].get(field) == before["spec"].get(field), field
    assert (
        after["metadata"]["annotations"][keys.STASH_ANNOTATION]
        == before["metadata"]["annotations"][keys.STASH_ANNOTATION]
    )
    wait_for(
        lambda: (
            lower_pod(federation, "lower-1", "wh-reapply", "again")["spec"]["containers"][0][
                "image"
            ]
            == "registry.k8s.io/pause:3.9"
        ),
        "the new image on the lower pod",
    )
    assert lower_pod(federation, "lower-1", "wh-reapply", "again")["spec"]["nodeSelector"] == SSD
    # An update that leaves the scheduling fields alone is not sent to the webhook (nor
    # refused while it is away): the apiserver counts it as excluded by the match condition.
    excluded = _match_condition_exclusions(upper)
    upper.kubectl("label", "pod", "again", "-n", "wh-reapply", "v=4", "--overwrite")
    assert _match_condition_exclusions(upper) == excluded + 1
    # What a running pod may not change it still may not, through the stash or not.
    elsewhere = upper.kubectl(
        "patch", "pod", "again", "-n", "wh-reapply",
        "-p", json.dumps({"spec": {"nodeSelector": {"disk": "hdd"}}}), check=False,
    )  # fmt: skip
    assert elsewhere.returncode != 0
    assert "pod updates may not change fields" in elsewhere.stderr


def test_a_gated_pod_given_a_node_selector_before_its_gate_is_lifted_runs_where_it_says(
    federation: Federation, ssd_node: str
) -> None:
    """What a queueing controller (Kueue) does: the pod waits on a scheduling gate, is
    given a node selector, then the gate is lifted. The selector is stashed (above, no
    virtual node carries disk=ssd) and restored below."""
    upper = federation.upper
    apply(upper, federated_namespace("wh-gated"))
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "queued", "namespace": "wh-gated"},
        "spec": {
            "schedulingGates": [{"name": "example.com/quota"}],
            "terminationGracePeriodSeconds": 0,
            "containers": [container()],
        },
    }
    upper.kubectl("create", "-f", "-", input=json.dumps(pod))
    upper.kubectl(
        "patch", "pod", "queued", "-n", "wh-gated",
        "-p", json.dumps({"spec": {"nodeSelector": SSD}}),
    )  # fmt: skip
    gated = get_json(upper, "pod", "-n", "wh-gated", "queued")
    assert gated["spec"]["nodeSelector"] == stash.VIRTUAL_NODE_SELECTOR
    # The apiserver cannot see the stashed entry: the webhook refuses another value.
    other = upper.kubectl(
        "patch", "pod", "queued", "-n", "wh-gated",
        "-p", json.dumps({"spec": {"nodeSelector": {"disk": "hdd"}}}), check=False,
    )  # fmt: skip
    assert other.returncode != 0
    assert "the pod asks for disk=ssd already" in other.stderr
    # Nor is the record the pod's to write: the lower pod is made from it.
    record = json.loads(gated["metadata"]["annotations"][keys.STASH_ANNOTATION])
    record["originals"]["nodeSelector"] = {"disk": "hdd"}
    written = upper.kubectl(
        "annotate", "--overwrite", "pod", "queued", "-n", "wh-gated",
        f"{keys.STASH_ANNOTATION}={json.dumps(record)}", check=False,
    )  # fmt: skip
    assert written.returncode != 0
    assert "nodeSelector differs from the one recorded" in written.stderr
    excluded = _match_condition_exclusions(upper)
    upper.kubectl(
        "patch", "pod", "queued", "-n", "wh-gated", "--type=json",
        "-p", json.dumps([{"op": "remove", "path": "/spec/schedulingGates"}]),
    )  # fmt: skip
    # Lifting the gate changes no scheduling field: the webhook is not asked.
    assert _match_condition_exclusions(upper) == excluded + 1
    below = lower_pod(federation, "lower-1", "wh-gated", "queued")
    assert below["spec"]["nodeSelector"] == SSD
    assert below["spec"]["nodeName"] == ssd_node


def _match_condition_exclusions(upper: LocalCluster) -> float:
    metric = "apiserver_admission_match_condition_exclusions_total{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in upper.kubectl("get", "--raw", "/metrics").stdout.splitlines()
        if line.startswith(metric) and 'name="stash.kubestrata.io"' in line
    )


def test_a_spread_with_match_label_keys_on_a_cluster_level_key_runs_below(
    federation: Federation,
) -> None:
    """A Deployment's spread over regions with matchLabelKeys [pod-template-hash] stays
    above (region is a cluster-level key), where the apiserver merges the key into the
    selector; the lower apiserver must not be asked to merge it again (it refused the
    pod, and the ReplicaSet made it again without end)."""
    upper = federation.upper
    apply(upper, federated_namespace("wh-spread-keys"))
    deployment = federated_deployment("spread", "wh-spread-keys", 1)
    deployment["spec"]["template"]["spec"]["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/region",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app": "spread"}},
            "matchLabelKeys": ["pod-template-hash"],
        }
    ]
    apply(upper, deployment)
    rollout(upper, "spread", "wh-spread-keys")
    (above,) = pods_by_name(upper, "wh-spread-keys", "app=spread").values()
    cluster = above["spec"]["nodeName"].removeprefix("vk-")
    below = lower_pod(federation, cluster, "wh-spread-keys", above["metadata"]["name"])
    (spread,) = below["spec"]["topologySpreadConstraints"]
    assert "matchLabelKeys" not in spread


def test_a_pod_outside_federation_tolerating_every_taint_stays_off_virtual_nodes(
    federation: Federation,
) -> None:
    """An operator of kube-system (or of any namespace not federated) tolerating every
    taint tolerates the virtual nodes' too: the upper scheduler bound it to one, and it
    ran in a lower cluster (until 2026-11-28). A federated pod tolerating every taint
    still goes to a virtual node."""
    upper = federation.upper
    operator = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "e2e-operator", "namespace": "kube-system"},
        "spec": {"tolerations": EVERY_TAINT, "containers": [container()]},
    }
    ns = "wh-tolerant"
    federated = {**operator, "metadata": {"name": "tolerant", "namespace": ns}}
    apply(upper, federated_namespace(ns))
    try:
        made = json.loads(
            upper.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(operator)).stdout
        )
        terms = made["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        assert terms == [
            {"matchExpressions": [{"key": keys.CLUSTER_ID_LABEL, "operator": "DoesNotExist"}]}
        ]
        apply(upper, federated)
        bound = wait_for(
            lambda: get_json(upper, "pod", "-n", ns, "tolerant")["spec"].get("nodeName"),
            "the federated pod bound",
        )
        assert keys.CLUSTER_ID_LABEL in get_json(upper, "node", bound)["metadata"]["labels"]
        node = get_json(upper, "pod", "-n", "kube-system", "e2e-operator")["spec"].get("nodeName")
        if node:  # an ordinary node of the upper cluster, if it has one
            labels = get_json(upper, "node", node)["metadata"]["labels"]
            assert keys.CLUSTER_ID_LABEL not in labels
    finally:
        upper.kubectl(
            "delete",
            "pod",
            "-n",
            "kube-system",
            "e2e-operator",
            "--ignore-not-found",
            "--grace-period=0",
            "--force",
        )
        upper.kubectl("delete", "namespace", ns, "--wait=false")
