"""The manifests against real apiservers: every overlay is accepted as it is, and the
components of the test federation run with the identities the manifests give them and
nothing more (so every other end-to-end test also proves their RBAC is enough)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness.federation import (
    DESCHEDULER_ACCOUNT,
    MULTISCHEDULER,
    MULTISCHEDULER_ACCOUNT,
    VIRTUAL_NODE_ACCOUNT,
    WEBHOOK,
    WEBHOOK_ACCOUNT,
    Federation,
    virtual_node_name,
)
from harness.localcluster import KubectlClient
from kubekit import keys

MANIFESTS = Path(__file__).parents[2] / "manifests"
# Stand-ins for cert-manager's CRDs (not installed here): the kinds at their real group and
# version, any content, so that the rest of the overlay is checked by the apiserver.
CERT_MANAGER_KINDS = {"Certificate": "certificates", "Issuer": "issuers"}


def rendered(cluster: KubectlClient, overlay: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(cluster.kubectl("kustomize", str(MANIFESTS / overlay)).stdout))


def dry_run(cluster: KubectlClient, objects: list[dict[str, Any]]) -> set[str]:
    """What the apiserver accepts of ``objects`` with `kubectl apply --dry-run=server`
    (apply, not create: the test federation applied some of them already)."""
    result = cluster.kubectl(
        "apply",
        "--dry-run=server",
        "-o",
        "name",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
    )
    return set(result.stdout.split())


def names(objects: list[dict[str, Any]]) -> set[str]:
    """``kind.group/name`` as `kubectl -o name` prints them."""
    result = set()
    for obj in objects:
        group = obj["apiVersion"].rpartition("/")[0]
        kind = obj["kind"].lower() + (f".{group}" if group else "")
        result.add(f"{kind}/{obj['metadata']['name']}")
    return result


def test_the_upper_manifests_are_accepted_as_they_are(federation: Federation) -> None:
    objects = rendered(federation.upper, ".")
    for obj in objects:
        # The local federation's own configuration already holds the name.
        if obj["kind"] == "MutatingWebhookConfiguration":
            obj["metadata"]["name"] = "kubestrata-webhook-from-manifests"
    assert dry_run(federation.upper, objects) == names(objects)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for component in ("webhook", "multischeduler", "descheduler", "virtual-node"):
        assert ("Deployment", f"kubestrata-{component}") in kinds
        # The webhook's rights are all in its namespace (the record of moves).
        role = "Role" if component == "webhook" else "ClusterRole"
        assert (role, f"kubestrata-{component}") in kinds
    # upper/ is all of it but the virtual node, for one overlay per lower cluster beside.
    without_virtual_node = {
        (o["kind"], o["metadata"]["name"]) for o in rendered(federation.upper, "upper")
    }
    renamed = {k for k in kinds if k[0] == "MutatingWebhookConfiguration"}
    assert kinds - renamed - without_virtual_node == {
        ("Deployment", "kubestrata-virtual-node"),
        ("PodDisruptionBudget", "kubestrata-virtual-node"),
    }
    (deployment,) = [
        o
        for o in objects
        if (o["kind"], o["metadata"]["name"]) == ("Deployment", "kubestrata-virtual-node")
    ]
    assert deployment["spec"]["selector"]["matchLabels"][keys.CLUSTER_ID_LABEL] == "lower"


def test_the_two_cluster_example_makes_two_virtual_nodes(federation: Federation) -> None:
    objects = rendered(federation.upper, "examples/two-clusters")
    assert dry_run(federation.upper, objects) == names(objects)
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    budgets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert set(deployments) == {
        "kubestrata-virtual-node-lower-a",
        "kubestrata-virtual-node-lower-b",
    }
    for cluster in ("lower-a", "lower-b"):
        deployment = deployments[f"kubestrata-virtual-node-{cluster}"]
        spec = deployment["spec"]["template"]["spec"]
        [container] = spec["containers"]
        assert f"--cluster-id={cluster}" in container["args"]
        assert "--address=$(POD_IP)" in container["args"]
        assert (
            spec["volumes"][0]["secret"]["secretName"] == f"kubestrata-lower-kubeconfig-{cluster}"
        )
        assert spec["serviceAccountName"] == VIRTUAL_NODE_ACCOUNT
        # Each Deployment owns only its own pods, and its budget covers only them (the
        # Eviction API refuses a pod under two).
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector[keys.CLUSTER_ID_LABEL] == cluster
        budget = budgets[f"kubestrata-virtual-node-{cluster}"]
        assert budget["spec"]["selector"]["matchLabels"] == selector
    shared = {
        (o["kind"], o["metadata"]["name"])
        for o in rendered(federation.upper, "virtual-node/rbac")
        if o["kind"] != "ServiceAccount"
    }
    kinds = {kind for kind, _ in shared}
    assert len([o for o in objects if o["kind"] in kinds]) == len(shared), (
        "one set of RBAC and FlowSchemas (all of virtual-node/rbac) shared by both"
    )


def test_the_lower_manifests_are_accepted_by_every_lower_cluster(federation: Federation) -> None:
    for lower in federation.lowers:
        objects = rendered(lower, "virtual-node-lower")
        assert dry_run(lower, objects) == names(objects), lower.name


@pytest.fixture
def cert_manager_kinds(federation: Federation) -> Iterator[None]:
    definitions = [
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.cert-manager.io"},
            "spec": {
                "group": "cert-manager.io",
                "scope": "Namespaced",
                "names": {"kind": kind, "plural": plural},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            }
                        },
                    }
                ],
            },
        }
        for kind, plural in CERT_MANAGER_KINDS.items()
    ]
    manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": definitions})
    federation.upper.kubectl("apply", "-f", "-", input=manifest)
    federation.upper.kubectl(
        "wait",
        "--for=condition=Established",
        *(f"crd/{plural}.cert-manager.io" for plural in CERT_MANAGER_KINDS.values()),
        "--timeout=60s",
    )
    yield
    federation.upper.kubectl("delete", "-f", "-", input=manifest)


def test_the_cert_manager_overlay_is_accepted(
    federation: Federation, cert_manager_kinds: None
) -> None:
    objects = rendered(federation.upper, "with-cert-manager")
    here = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for obj in objects:
        if obj["kind"] == "MutatingWebhookConfiguration":
            obj["metadata"]["name"] = "kubestrata-webhook-from-manifests"
            annotations = obj["metadata"]["annotations"]
            assert annotations["cert-manager.io/inject-ca-from"] == (
                "kubestrata-system/kubestrata-webhook"
            )
    assert dry_run(federation.upper, objects) == names(objects)
    assert {o["kind"] for o in objects} >= set(CERT_MANAGER_KINDS)
    # Everything of manifests/ but the webhook-cert job, which would fight cert-manager.
    everything = {(o["kind"], o["metadata"]["name"]) for o in rendered(federation.upper, ".")}
    assert {(k, n) for k, n in everything - here if "webhook-cert" not in n} == set()
    assert not any("webhook-cert" in n for k, n in here if k in ("Job", "CronJob"))


def whoami(federation: Federation, kubeconfig: str) -> str:
    """Whom the upper or a lower apiserver takes the holder of ``kubeconfig`` for."""
    kubectl = federation.upper.toolchain.kubectl
    result = subprocess.run(
        [kubectl, f"--kubeconfig={kubeconfig}", "auth", "whoami", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return str(json.loads(result.stdout)["status"]["userInfo"]["username"])


def test_every_component_runs_with_its_service_account_only(federation: Federation) -> None:
    accounts = {
        WEBHOOK: WEBHOOK_ACCOUNT,
        MULTISCHEDULER: MULTISCHEDULER_ACCOUNT,
        **{virtual_node_name(lower.name): VIRTUAL_NODE_ACCOUNT for lower in federation.lowers},
    }
    assert set(accounts) <= set(federation.components)
    for component, account in accounts.items():
        kubeconfigs = [
            value
            for argument in federation.components[component].argv
            for flag, _, value in [argument.partition("=")]
            if flag in ("--kubeconfig", "--upper-kubeconfig", "--lower-kubeconfig")
        ]
        assert len(kubeconfigs) == (2 if account == VIRTUAL_NODE_ACCOUNT else 1), component
        for kubeconfig in kubeconfigs:
            user = f"system:serviceaccount:{keys.SYSTEM_NAMESPACE}:{account}"
            assert whoami(federation, kubeconfig) == user, (component, kubeconfig)
    # The descheduler runs in its own tests; its arguments come with its identity.
    (descheduler_kubeconfig,) = [
        a.partition("=")[2] for a in federation.descheduler_args() if a.startswith("--kubeconfig=")
    ]
    assert whoami(federation, descheduler_kubeconfig).endswith(f":{DESCHEDULER_ACCOUNT}")
    for account in {*accounts.values(), DESCHEDULER_ACCOUNT}:
        user = f"system:serviceaccount:{keys.SYSTEM_NAMESPACE}:{account}"
        allowed = federation.upper.kubectl("auth", "can-i", "*", "*", f"--as={user}", check=False)
        assert allowed.stdout.strip() == "no", account
        assert federation.upper.kubectl(
            "auth", "can-i", "create", "pods", f"--as={user}", "-n", "default", check=False
        ).stdout.strip() == ("yes" if account == DESCHEDULER_ACCOUNT else "no"), account


def dispatched(cluster: KubectlClient) -> dict[tuple[str, str], float]:
    """Requests the apiserver's flow control has dispatched, by (FlowSchema, priority
    level), since it started."""
    counts: dict[tuple[str, str], float] = {}
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "apiserver_flowcontrol_dispatched_requests_total":
                key = (sample.labels["flow_schema"], sample.labels["priority_level"])
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def test_the_virtual_nodes_requests_have_the_priority_of_a_kubelet_s(
    federation: Federation,
) -> None:
    above = dispatched(federation.upper)
    # The heartbeat (Node status, Leases) beside the kubelets' own; the rest at their level.
    assert above.get(("kubestrata-virtual-node-heartbeat", "node-high"), 0) > 0
    assert above.get(("kubestrata-virtual-node", "system"), 0) > 0
    for lower in federation.lowers:
        # Below it creates pods as the upper cluster's controllers: the controllers' level.
        assert dispatched(lower).get(("kubestrata-virtual-node", "workload-high"), 0) > 0
