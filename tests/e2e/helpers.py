"""Small helpers for end-to-end tests: JSON from kubectl, waiting for a condition."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from harness.federation import Federation
from harness.localcluster import LocalCluster
from kubekit import keys

T = TypeVar("T")


def get_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def get_raw(cluster: LocalCluster, path: str) -> Any:
    """An API path's JSON, or None while the apiserver refuses it (not found, not ready)."""
    found = cluster.kubectl("get", "--raw", path, check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def wait_for(
    probe: Callable[[], T], description: str, timeout: float = 90.0, interval: float = 0.5
) -> T:
    """Polls ``probe`` until it returns something truthy; fails with the last value."""
    deadline = time.monotonic() + timeout
    last: T = probe()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {description}; last: {last!r}"
            )
        time.sleep(interval)
        last = probe()
    return last


def apply(cluster: LocalCluster, *manifests: dict[str, Any]) -> None:
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifests)}),
    )


def federated_deployment(
    name: str,
    namespace: str,
    replicas: int,
    *,
    cpu: str = "0",
    node_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Deployment whose pods tolerate the virtual nodes' taint (what the webhook adds)."""
    spec: dict[str, Any] = {
        "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {
                "name": "app",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": cpu}} if cpu != "0" else {},
            }
        ],
    }
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


def bound_pod(name: str, namespace: str, node_name: str, **spec: Any) -> dict[str, Any]:
    """A bare pause pod bound to a node by its spec.nodeName, with no scheduler."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
            **spec,
        },
    }


def cluster_pod(
    name: str, namespace: str, cluster: str, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    """A bare pause pod for the virtual node of one lower cluster, placed by the upper
    scheduler (the virtual node's taint tolerated; no webhook needed)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": {
            "nodeSelector": {keys.CLUSTER_ID_LABEL: cluster},
            "tolerations": [{"key": keys.PROVIDER_TAINT_KEY, "operator": "Exists"}],
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
        },
    }


def namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def wait_for_default_account(cluster: LocalCluster, namespace_name: str) -> None:
    """A bare pod created in a namespace made a moment ago is refused until the
    controller-manager has made its `default` ServiceAccount."""
    wait_for(
        lambda: (
            cluster.kubectl(
                "get", "serviceaccount", "default", "-n", namespace_name, check=False
            ).returncode
            == 0
        ),
        f"the default ServiceAccount of {namespace_name}",
        interval=0.2,
    )


def federated_namespace(name: str) -> dict[str, Any]:
    """A namespace whose pods the webhook federates (their scheduling fields stashed)."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {keys.FEDERATION_LABEL: keys.FEDERATION_ENABLED}},
    }


def pods_by_name(cluster: LocalCluster, namespace: str, selector: str) -> dict[str, dict[str, Any]]:
    items = get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"]
    return {p["metadata"]["name"]: p for p in items}


def rollout(cluster: LocalCluster, deployment: str, namespace: str, timeout: int = 120) -> None:
    """Waits for a Deployment to be rolled out; on failure the error carries what the
    cluster showed (pods, nodes, events), since the cluster is gone after the run."""
    result = cluster.kubectl(
        "rollout",
        "status",
        f"deployment/{deployment}",
        "-n",
        namespace,
        f"--timeout={timeout}s",
        timeout=timeout + 10,
        check=False,
    )
    if result.returncode != 0:
        pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        nodes = cluster.kubectl("describe", "nodes", check=False).stdout
        events = cluster.kubectl("get", "events", "-n", namespace, check=False).stdout
        workloads = cluster.kubectl(
            "get", "deployments,replicasets,pods", "-n", namespace, "-o", "yaml", check=False
        ).stdout
        raise AssertionError(
            f"deployment {namespace}/{deployment} not rolled out: {result.stderr}\n"
            f"pods:\n{pods}\nevents:\n{events}\nnodes:\n{nodes}\nobjects:\n{workloads}"
        )


def node_ready(federation: Federation, name: str) -> str:
    node = get_json(federation.upper, "node", name)
    return str(next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"))


def refusing_policy(
    name: str, resources: list[str], expression: str, message: str
) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy named ``name`` and its binding, refusing (422) the
    creation of core ``resources`` for which ``expression`` (CEL) is false."""
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": resources,
                        }
                    ]
                },
                "validations": [{"expression": expression, "message": message}],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name, "validationActions": ["Deny"]},
        },
    ]
