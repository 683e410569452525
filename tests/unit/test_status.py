import datetime
import json
from typing import Any

from kubekit import keys
from kubekit.status import VirtualNodeStatus, as_json, free_after_bound_pods, statuses, table

NOW = datetime.datetime(2026, 11, 25, 3, 0, 0, tzinfo=datetime.UTC)


def virtual_node(
    name: str, cluster: str, ready: str = "True", slot: str | None = None, **free: str
) -> dict[str, Any]:
    annotations = {} if slot is None else {keys.LARGEST_FREE_SLOT_ANNOTATION: slot}
    return {
        "metadata": {
            "name": name,
            "labels": {
                keys.CLUSTER_ID_LABEL: cluster,
                keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
            },
            "annotations": annotations,
        },
        "status": {
            "allocatable": free,
            "conditions": [{"type": "MemoryPressure", "status": "False"}]
            + ([{"type": "Ready", "status": ready}] if ready else []),
        },
    }


def unproven(name: str, cluster: str, ready: str = "True", **free: str) -> dict[str, Any]:
    """A Node labelled virtual without the label no kubelet can set: a virtual node before
    2026-11-29, or a kubelet that labelled itself."""
    node = virtual_node(name, cluster, ready, **free)
    del node["metadata"]["labels"][keys.PROVEN_VIRTUAL_NODE_LABEL]
    return node


def bound_pod(**requests: str) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "c", "resources": {"requests": requests}}]}}


def lease(renewed: str) -> dict[str, Any]:
    return {"spec": {"holderIdentity": "x", "renewTime": renewed}}


def test_one_row_per_virtual_node_from_its_node_lease_and_pods() -> None:
    rows = statuses(
        [
            virtual_node(
                "vk-lower-2",
                "lower-2",
                slot='{"cpu":"7","memory":"30Gi","node":"lower-2-node-1","nvidia.com/gpu":"2"}',
                cpu="40",
                memory="120Gi",
                **{"nvidia.com/gpu": "3", "amd.com/gpu": "1"},
            ),
            unproven("vk-lower-1", "lower-1", ready="", cpu="0", memory="0"),
        ],
        {"vk-lower-2": lease("2026-11-25T02:59:55.500000Z")},
        {
            "vk-lower-2": [bound_pod(cpu="2", memory="4Gi", **{"nvidia.com/gpu": "1"})]
            + [bound_pod(cpu="500m", memory="1Gi")] * 11,
            "vk-lower-1": [bound_pod(cpu="1")],
        },
        NOW,
    )
    assert rows == [
        VirtualNodeStatus(
            node="vk-lower-1",
            cluster="lower-1",
            ready="Unknown",
            lease_age_seconds=None,
            free={"cpu": "0", "memory": "0"},
            largest_free_slot={},
            pods=1,
            proven=False,
        ),
        VirtualNodeStatus(
            node="vk-lower-2",
            cluster="lower-2",
            ready="True",
            lease_age_seconds=4.5,
            # What the scheduler leaves: the Node's allocatable less the pods bound to it.
            free={"cpu": "32500m", "memory": "105Gi", "nvidia.com/gpu": "2", "amd.com/gpu": "1"},
            largest_free_slot={
                "cpu": "7",
                "memory": "30Gi",
                "node": "lower-2-node-1",
                "nvidia.com/gpu": "2",
            },
            pods=12,
            proven=True,
        ),
    ]
    slot = "7 cpu, 30Gi, 2 gpu on lower-2-node-1"
    left = "NODE         CLUSTER   READY     LEASE   CPU      MEMORY   GPU   "
    assert table(rows).splitlines() == [
        f"{left}{'LARGEST SLOT':<36}   PODS   PROVEN",
        f"vk-lower-1   lower-1   Unknown   -       0        0        -     {'-':<36}   1      no",
        f"vk-lower-2   lower-2   True      4s      32500m   105Gi    3     {slot}   12     yes",
    ]
    document = json.loads(as_json(rows))
    assert document["virtualNodes"][1]["lease_age_seconds"] == 4.5
    assert document["virtualNodes"][1]["largest_free_slot"]["node"] == "lower-2-node-1"


def test_free_is_what_the_upper_scheduler_leaves_of_the_node_after_its_pods() -> None:
    """The Node's allocatable is what the lower cluster has left before our own pods;
    shown as it was, the free column offered their room again."""
    allocatable = {"cpu": "4", "pods": "110", "nvidia.com/gpu": "1"}
    bound = [bound_pod(cpu="3"), bound_pod(cpu="2", **{"example.com/dongle": "1"})]
    assert free_after_bound_pods(allocatable, bound) == {
        "cpu": "0",
        "pods": "108",
        "nvidia.com/gpu": "1",
    }
    assert free_after_bound_pods(allocatable, []) == allocatable


def test_a_slot_annotation_that_is_not_json_reads_as_none() -> None:
    (row,) = statuses([virtual_node("vk-a", "a", slot="{broken")], {}, {}, NOW)
    assert row.largest_free_slot == {}
    (row,) = statuses([virtual_node("vk-a", "a", slot='["a list"]')], {}, {}, NOW)
    assert row.largest_free_slot == {}


def test_a_slot_quantity_that_does_not_read_is_left_out() -> None:
    """The table sums the GPUs: it raised out of `kubestrata status`."""
    slot = '{"node": "n1", "cpu": "2", "nvidia.com/gpu": "two", "memory": [1]}'
    rows = statuses([virtual_node("vk-a", "a", slot=slot)], {}, {}, NOW)
    assert rows[0].largest_free_slot == {"node": "n1", "cpu": "2"}
    assert "2 cpu, 0 on n1" in table(rows)


def test_long_lease_ages_read_in_minutes_and_hours() -> None:
    nodes = [virtual_node(f"vk-{n}", n) for n in "abc"]
    leases = {
        "vk-a": lease("2026-11-25T02:58:30Z"),
        "vk-b": lease("2026-11-25T00:00:00Z"),
        "vk-c": lease("2026-11-25T03:00:01Z"),  # a clock ahead of ours
    }
    ages = [line.split()[3] for line in table(statuses(nodes, leases, {}, NOW)).splitlines()[1:]]
    assert ages == ["90s", "3h", "0s"]
