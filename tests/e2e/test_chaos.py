"""Control-plane components killed (SIGKILL) while pods are being mirrored, and started
again: the virtual node never exits, its Node goes NotReady and back to Ready when its
lower cluster is the one hit, and every pod converges with no duplicate and none lost."""

from __future__ import annotations

import time
from typing import Any

import pytest

from harness.federation import Federation, virtual_node_name
from harness.localcluster import LocalCluster
from kubekit import keys

from .helpers import (
    apply,
    federated_deployment,
    get_json,
    namespace,
    node_ready,
    rollout,
    wait_for,
)

REPLICAS = 60
# An upper apiserver that is down sees no Node go NotReady: it is kept down this long.
UPPER_OUTAGE_SECONDS = 25
# The Node goes NotReady once the upper node controller's grace period (50 s) passes
# without a lease renewal, up to one monitor period (5 s) later.
NOT_READY_TIMEOUT = 120


def lower_pods_by_upper_uid(lower: LocalCluster, namespace_name: str) -> dict[str, list[str]]:
    pods = get_json(lower, "pods", "-n", namespace_name, "-l", keys.MANAGED_BY_LABEL)["items"]
    found: dict[str, list[str]] = {}
    for pod in pods:
        uid = pod["metadata"]["annotations"][keys.UPPER_UID_ANNOTATION]
        found.setdefault(uid, []).append(pod["metadata"]["name"])
    return found


def upper_pods(upper: LocalCluster, namespace_name: str) -> list[dict[str, Any]]:
    return list(get_json(upper, "pods", "-n", namespace_name)["items"])


@pytest.mark.parametrize(
    ("victim", "component"),
    [("lower-1", "kube-apiserver"), ("lower-1", "etcd"), ("upper", "kube-apiserver")],
)
def test_a_killed_control_plane_component_is_waited_out(
    federation: Federation, victim: str, component: str
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-1"]
    cluster = upper if victim == "upper" else lower
    name = f"chaos-{victim}-{component}".replace("kube-", "")
    virtual_node = federation.components[virtual_node_name("lower-1")]
    pid = virtual_node.pid
    apply(upper, namespace(name))
    apply(
        upper,
        federated_deployment(
            "burst", name, REPLICAS, node_selector={keys.CLUSTER_ID_LABEL: "lower-1"}
        ),
    )
    wait_for(
        lambda: bool(lower_pods_by_upper_uid(lower, name)),
        "the burst to be under way below",
        interval=0.1,
    )

    cluster.processes[component].kill()
    try:
        if victim == "upper":
            time.sleep(UPPER_OUTAGE_SECONDS)
        else:
            wait_for(
                lambda: node_ready(federation, "vk-lower-1") == "Unknown",
                "vk-lower-1 NotReady while its lower cluster cannot be used",
                timeout=NOT_READY_TIMEOUT,
                interval=2,
            )
    finally:
        cluster.restart(component)
        if component == "etcd":
            cluster.restart("kwok")  # its pod watch does not resume after a long outage
    assert virtual_node.running() and virtual_node.pid == pid, "the virtual node never exited"

    wait_for(
        lambda: node_ready(federation, "vk-lower-1") == "True",
        "vk-lower-1 Ready again",
        timeout=120,
        interval=2,
    )
    rollout(upper, "burst", name, timeout=300)

    def converged() -> bool:
        above = upper_pods(upper, name)
        below = lower_pods_by_upper_uid(lower, name)
        return len(above) == REPLICAS and below == {
            pod["metadata"]["uid"]: [pod["metadata"]["name"]] for pod in above
        }

    wait_for(converged, "one lower pod per upper pod, and no other", timeout=120, interval=2)
    assert all(pod["status"]["phase"] == "Running" for pod in upper_pods(upper, name))
    assert virtual_node.running() and virtual_node.pid == pid
    upper.kubectl("delete", "namespace", name, "--wait=false")
