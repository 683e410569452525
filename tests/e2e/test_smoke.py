"""A lower cluster is a real cluster: kwok nodes, scheduled pods, logs and exec."""

from __future__ import annotations

import json
import uuid

from harness.federation import Federation


def test_kubectl_get_nodes_shows_the_simulated_nodes(federation: Federation) -> None:
    lower = federation.clusters["lower-1"]
    table = lower.kubectl("get", "nodes").stdout
    assert "lower-1-node-0" in table and "lower-1-node-1" in table
    nodes = json.loads(lower.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    ready = {
        n["metadata"]["name"]: next(
            c["status"] for c in n["status"]["conditions"] if c["type"] == "Ready"
        )
        for n in nodes
    }
    assert ready == {"lower-1-node-0": "True", "lower-1-node-1": "True"}
    assert {n["status"]["allocatable"]["cpu"] for n in nodes} == {"8"}


def test_upper_cluster_has_only_the_virtual_nodes(federation: Federation) -> None:
    names = federation.upper.kubectl("get", "nodes", "-o", "name").stdout.split()
    assert sorted(names) == ["node/vk-lower-1", "node/vk-lower-2"]


def _running_pods(federation: Federation, selector: str) -> list[dict[str, object]]:
    lower = federation.clusters["lower-1"]
    pods: list[dict[str, object]] = json.loads(
        lower.kubectl("get", "pods", "-l", selector, "-o", "json").stdout
    )["items"]
    return pods


def test_deployment_of_three_pods_runs_on_kwok_nodes(federation: Federation) -> None:
    lower = federation.clusters["lower-1"]
    lower.kubectl(
        "create", "deployment", "smoke", "--image=registry.k8s.io/pause:3.10", "--replicas=3"
    )
    lower.kubectl("rollout", "status", "deployment/smoke", "--timeout=120s", timeout=130)
    pods = _running_pods(federation, "app=smoke")
    assert len(pods) == 3
    for pod in pods:
        assert pod["status"]["phase"] == "Running"  # type: ignore[index]
        assert pod["spec"]["nodeName"] in {"lower-1-node-0", "lower-1-node-1"}  # type: ignore[index]


def test_kubectl_logs_and_exec_reach_real_local_processes(federation: Federation) -> None:
    lower = federation.clusters["lower-1"]
    lower.kubectl("run", "shell", "--image=registry.k8s.io/pause:3.10")
    lower.kubectl("wait", "--for=condition=Ready", "pod/shell", "--timeout=120s", timeout=130)

    marker = f"line-{uuid.uuid4()}"
    lower.append_pod_log(marker)
    logs = lower.kubectl("logs", "shell").stdout
    assert f"kwok container log of cluster {lower.name}" in logs
    assert marker in logs

    result = lower.kubectl("exec", "shell", "--", "sh", "-c", "echo $((6*7)); echo oops >&2; pwd")
    assert result.stdout.splitlines() == ["42", str(lower.exec_dir)]
    assert "oops" in result.stderr

    # kwok reports a failed command as an internal error, without its exit code.
    failed = lower.kubectl("exec", "shell", "--", "sh", "-c", "exit 3", check=False)
    assert failed.returncode != 0 and "exit status 3" in failed.stderr
