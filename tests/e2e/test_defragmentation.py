"""Defragmentation end to end: the stock upper scheduler with the extender, and
`kubestrata descheduler --once` run by the test, so each step is seen on its own.

A pool of its own, tainted and labelled for this module:

    lower-1: defrag node 4 cpu, where the three 1-cpu pods of `small` run
    lower-2: defrag node 2 cpu, added once they run

`big` (3 cpu) then fits no node: lower-1 has 1 cpu free, lower-2 has 2. Evicting two of
`small` frees lower-1's node for it, and lower-2 takes their replacements.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.federation import Federation
from harness.localcluster import LocalCluster, NodeSpec

from .helpers import apply, federated_namespace, get_json, pods_by_name, wait_for

NAMESPACE = "defrag"
POOL = {"kubestrata.io/e2e-pool": "defrag"}
POOL_TAINT = {"key": "kubestrata.io/e2e-pool", "value": "defrag", "effect": "NoSchedule"}
NODE_CPU = {"lower-1": "4", "lower-2": "2"}


def defrag_node(cluster: str) -> str:
    return f"{cluster}-defrag"


def add_node(federation: Federation, cluster: str) -> None:
    lower = federation.clusters[cluster]
    assert isinstance(lower, LocalCluster)
    lower.add_nodes(
        [
            NodeSpec(
                name=defrag_node(cluster),
                cpu=NODE_CPU[cluster],
                memory="16Gi",
                pods=110,
                labels={**POOL, "topology.kubernetes.io/region": cluster},
                taints=(POOL_TAINT,),
            )
        ]
    )


def pool_spec(cpu: str) -> dict[str, Any]:
    return {
        "nodeSelector": POOL,
        "tolerations": [{**POOL_TAINT, "operator": "Equal"}],
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {
                "name": "app",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": cpu}},
            }
        ],
    }


SMALL = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "small", "namespace": NAMESPACE},
    "spec": {
        "replicas": 3,
        "selector": {"matchLabels": {"app": "small"}},
        "template": {"metadata": {"labels": {"app": "small"}}, "spec": pool_spec("1")},
    },
}
BIG = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "big", "namespace": NAMESPACE, "labels": {"app": "big"}},
    "spec": pool_spec("3"),
}
# Every pod of `small` must stay: no eviction is allowed.
GUARD = {
    "apiVersion": "policy/v1",
    "kind": "PodDisruptionBudget",
    "metadata": {"name": "small", "namespace": NAMESPACE},
    "spec": {"minAvailable": 3, "selector": {"matchLabels": {"app": "small"}}},
}


def running(federation: Federation, selector: str) -> dict[str, dict[str, Any]]:
    pods = pods_by_name(federation.upper, NAMESPACE, selector)
    return {
        name: pod
        for name, pod in pods.items()
        if pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")
    }


def events(federation: Federation, reason: str) -> list[dict[str, Any]]:
    found = get_json(
        federation.upper, "events", "-n", NAMESPACE, "--field-selector", f"reason={reason}"
    )["items"]
    return list(found)


@pytest.fixture(scope="module")
def defragmenting(federation: Federation) -> Iterator[Federation]:
    # Cleaned up even when the set-up fails half way: later modules count the nodes.
    try:
        add_node(federation, "lower-1")
        apply(federation.upper, federated_namespace(NAMESPACE), SMALL)
        wait_for(lambda: len(running(federation, "app=small")) == 3, "the three small pods Running")
        add_node(federation, "lower-2")
        apply(federation.upper, BIG)
        yield federation
    finally:
        federation.upper.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        for cluster in NODE_CPU:
            federation.clusters[cluster].kubectl(
                "delete", "node", defrag_node(cluster), "--ignore-not-found", "--wait=false"
            )


def descheduler_once(federation: Federation, tmp_path: Path, *flags: str) -> str:
    policy = tmp_path / "policy.yaml"
    policy.write_text("defragAfter: 1\n")
    args = [*federation.descheduler_args(policy), "--once", *flags]
    result = subprocess.run(
        [sys.executable, "-m", "kubekit.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def big_waits(federation: Federation) -> bool:
    pod = get_json(federation.upper, "pod", "-n", NAMESPACE, "big")
    scheduled = [c for c in pod["status"].get("conditions") or [] if c["type"] == "PodScheduled"]
    return bool(scheduled and scheduled[0].get("reason") == "Unschedulable")


def test_a_budget_that_allows_no_eviction_leaves_every_pod_in_place(
    defragmenting: Federation, tmp_path: Path
) -> None:
    apply(defragmenting.upper, GUARD)
    wait_for(
        lambda: (
            get_json(defragmenting.upper, "pdb", "-n", NAMESPACE, "small")
            .get("status", {})
            .get("observedGeneration")
        ),
        "the budget observed",
    )
    wait_for(lambda: big_waits(defragmenting), "big unschedulable above")
    before = set(running(defragmenting, "app=small"))
    output = descheduler_once(defragmenting, tmp_path)
    assert "no complete plan makes room" in output, output
    (said,) = events(defragmenting, "NotDefragmented")
    assert said["involvedObject"]["name"] == "big"
    assert set(running(defragmenting, "app=small")) == before
    assert not events(defragmenting, "Descheduled")


def test_a_dry_run_prints_the_plan_and_evicts_nothing(
    defragmenting: Federation, tmp_path: Path
) -> None:
    defragmenting.upper.kubectl("delete", "pdb", "-n", NAMESPACE, "small", "--ignore-not-found")
    before = set(running(defragmenting, "app=small"))
    output = descheduler_once(defragmenting, tmp_path, "--dry-run")
    assert f"dry run: free lower node {defrag_node('lower-1')} of vk-lower-1 for pod" in output
    assert output.count(f"{NAMESPACE}/small-") == 2, output
    assert set(running(defragmenting, "app=small")) == before
    assert not events(defragmenting, "Descheduled") and not events(defragmenting, "Defragmenting")


def test_the_planned_evictions_free_a_node_and_all_four_pods_run(
    defragmenting: Federation, tmp_path: Path
) -> None:
    defragmenting.upper.kubectl("delete", "pdb", "-n", NAMESPACE, "small", "--ignore-not-found")
    before = set(running(defragmenting, "app=small"))
    descheduler_once(defragmenting, tmp_path)
    (planned,) = events(defragmenting, "Defragmenting")
    evicted = {e["involvedObject"]["name"] for e in events(defragmenting, "Descheduled")}
    assert len(evicted) == 2 and evicted <= before, evicted
    for name in evicted:
        assert f"{NAMESPACE}/{name}" in planned["message"]

    def settled() -> bool:
        small = running(defragmenting, "app=small")
        return len(small) == 3 and bool(running(defragmenting, "app=big"))

    wait_for(settled, "big and three small pods Running", timeout=120)
    small = running(defragmenting, "app=small")
    assert set(small) & before == before - evicted, "exactly the planned evictions"
    big = get_json(defragmenting.upper, "pod", "-n", NAMESPACE, "big")
    assert big["spec"]["nodeName"] == "vk-lower-1"
    (below,) = pods_by_name(defragmenting.clusters["lower-1"], NAMESPACE, "app=big").values()
    assert below["spec"]["nodeName"] == defrag_node("lower-1")
    assert sorted(p["spec"]["nodeName"] for p in small.values()) == [
        "vk-lower-1",
        "vk-lower-2",
        "vk-lower-2",
    ]
