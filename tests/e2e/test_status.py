"""`kubestrata status` against the test federation's upper cluster: a row per virtual node
with what fragmentation leaves of its free capacity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.federation import Federation
from kubekit import keys
from kubekit.quantity import parse_quantity

from .conftest import TEST_FEDERATION
from .helpers import apply, federated_deployment, get_json, namespace, rollout, wait_for


def status(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kubekit.cli", "status", f"--kubeconfig={kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def rows(federation: Federation) -> dict[str, dict[str, Any]]:
    shown = status(federation.upper.kubeconfig, "-o", "json")
    assert shown.returncode == 0, shown.stderr
    return {row["node"]: row for row in json.loads(shown.stdout)["virtualNodes"]}


def active_pods(federation: Federation, node: str) -> int:
    selector = f"spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"
    return len(get_json(federation.upper, "pods", "-A", "--field-selector", selector)["items"])


def test_status_shows_each_virtual_node_and_the_largest_slot_fragmentation_leaves(
    federation: Federation,
) -> None:
    upper = federation.upper
    # A pod on each lower node that leaves it 3 cpu: 3 cpu per node free in all, and no
    # pod of 4 fits anywhere.
    left = 3
    apply(
        upper,
        namespace("fragments"),
        federated_deployment(
            "wide",
            "fragments",
            TEST_FEDERATION.nodes_per_lower,
            cpu=str(int(TEST_FEDERATION.node_cpu) - left),
            node_selector={keys.CLUSTER_ID_LABEL: "lower-2"},
        ),
    )
    rollout(upper, "wide", "fragments")

    def fragmented() -> dict[str, dict[str, Any]] | None:
        shown = rows(federation)
        slot = shown["vk-lower-2"]["largest_free_slot"]
        return shown if slot and parse_quantity(slot["cpu"]) == left else None

    shown = wait_for(fragmented, f"vk-lower-2's largest slot to shrink to {left} cpu")
    assert shown is not None
    assert set(shown) == {"vk-lower-1", "vk-lower-2"}
    row = shown["vk-lower-2"]
    assert row["cluster"] == "lower-2" and row["ready"] == "True" and row["proven"] is True
    assert 0 <= row["lease_age_seconds"] < 40
    node = get_json(upper, "node", "vk-lower-2")
    assert set(row["free"]) == set(node["status"]["allocatable"])
    # What the upper scheduler leaves: the allocatable less the pods bound to the Node,
    # at most what the roomiest lower node has left on each.
    free_cpu = parse_quantity(row["free"]["cpu"])
    assert free_cpu <= left * TEST_FEDERATION.nodes_per_lower
    assert row["largest_free_slot"]["node"].startswith("lower-2-node-")
    assert parse_quantity(row["largest_free_slot"]["cpu"]) <= free_cpu
    assert row["pods"] == active_pods(federation, "vk-lower-2")
    assert shown["vk-lower-1"]["largest_free_slot"]["node"].startswith("lower-1-node-")

    table = status(federation.upper.kubeconfig)
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.split()[:4] == ["NODE", "CLUSTER", "READY", "LEASE"]
    (line,) = [line for line in lines if line.startswith("vk-lower-2 ")]
    assert f"{left} cpu, {row['largest_free_slot']['memory']} on lower-2-node-" in line

    upper.kubectl("delete", "namespace", "fragments", "--timeout=120s")


def test_status_of_an_unreachable_cluster_is_a_clear_error(federation: Federation) -> None:
    config = json.loads(federation.upper.kubectl("config", "view", "--raw", "-o", "json").stdout)
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = "https://127.0.0.1:1"
    unreachable = federation.state_dir / "unreachable.kubeconfig"
    unreachable.write_text(json.dumps(config))
    shown = status(unreachable)
    assert shown.returncode == 1
    assert shown.stderr.startswith(
        f"kubestrata status: cannot read the virtual nodes with {unreachable}: "
    ), shown.stderr
