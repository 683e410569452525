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
from kubekit import keys, stash

from .helpers import apply, federated_namespace, get_json, pods_by_name, rollout, wait_for

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
    assert above["spec"]["nodeSelector"] == {keys.CLUSTER_ID_LABEL: "lower-1"}
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
    assert "nodeSelector" not in shown["spec"]
    assert upper.kubectl("get", "pod", "-n", "wh-dry", "dry", check=False).returncode != 0


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
