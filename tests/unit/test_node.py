"""The virtual Node's registration: where its estimator listens, and since when."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from kubekit import keys
from kubekit.client import ApiError
from kubekit.serving import host_port
from tests.unit.fakeapi import FakeClient, not_found, status_error
from virtual_node import nodecontroller
from virtual_node.node import (
    NodeIdentity,
    NodeReport,
    keys_record,
    node_status,
    nodes_digest,
    not_started_taint,
    provider_taint,
    recorded_resource_keys,
    registration,
    registration_patch,
    report_annotations,
    shared_labels,
    status_changed,
    status_patch,
    without_foreign_resources,
)

REPORT = NodeReport(ready=True, allocatable={"cpu": "8"})
ZONE = "topology.kubernetes.io/zone"


def identity(**fields: object) -> NodeIdentity:
    return NodeIdentity("vk-lower-1", "lower-1", "10.1.2.3", 10250, **fields)  # type: ignore[arg-type]


def test_a_node_with_an_estimator_says_where_it_listens_and_since_when() -> None:
    node = registration(identity(estimator_port=10352, estimator_started="t1"), REPORT)
    annotations = node["metadata"]["annotations"]
    assert annotations.pop(keys.NODE_LABEL_KEYS_ANNOTATION) == keys_record(
        node["metadata"]["labels"]
    )
    assert annotations.pop(keys.NODE_RESOURCE_KEYS_ANNOTATION) == '["cpu"]'
    assert annotations == {
        keys.ESTIMATOR_ADDRESS_ANNOTATION: "10.1.2.3:10352",
        keys.ESTIMATOR_STARTED_ANNOTATION: "t1",
    }
    assert list(registration(identity(), REPORT)["metadata"]["annotations"]) == [
        keys.NODE_LABEL_KEYS_ANNOTATION,
        keys.NODE_RESOURCE_KEYS_ANNOTATION,
    ]


def test_a_label_set_before_that_the_lower_nodes_no_longer_share_goes_at_registration() -> None:
    """The lower nodes changed while no virtual node ran (a zone-b pool added): the
    Node kept zone=a for good. A label a user put on it is left."""
    region = "topology.kubernetes.io/region"
    zoned = dataclasses.replace(REPORT, labels={region: "eu", ZONE: "a"})
    moved = dataclasses.replace(REPORT, labels={region: "eu"})  # zones a and b now
    existing = registration(identity(), zoned)
    existing["metadata"] |= {"resourceVersion": "7"}
    existing["metadata"]["labels"]["team"] = "ours"
    patch = registration_patch(existing, identity(), moved)
    assert patch is not None
    assert patch["metadata"]["labels"] == {ZONE: None}
    record = patch["metadata"]["annotations"][keys.NODE_LABEL_KEYS_ANNOTATION]
    assert ZONE not in json.loads(record) and "team" not in json.loads(record)
    # No lower node counts at the moment (all NotReady, an upgrade): that says nothing of
    # the labels, which stay, recorded still.
    assert registration_patch(existing, identity(), dataclasses.replace(zoned, labels={})) is None
    arm = registration(identity(), dataclasses.replace(REPORT, labels={keys.ARCH_LABEL: "arm64"}))
    arm["metadata"]["resourceVersion"] = "8"
    assert registration_patch(arm, identity(), dataclasses.replace(REPORT, labels={})) is None, (
        "the architecture is not defaulted over the Node's"
    )
    # A Node of a run that kept no record: nothing is taken off.
    unrecorded = registration(identity(), zoned)
    del unrecorded["metadata"]["annotations"][keys.NODE_LABEL_KEYS_ANNOTATION]
    unrecorded["metadata"]["resourceVersion"] = "7"
    patch = registration_patch(unrecorded, identity(), moved)
    assert patch is not None and "labels" not in patch["metadata"]


def test_a_users_label_on_a_key_the_lower_nodes_share_is_left_at_registration() -> None:
    """The user zoned the Node user-z; the lower nodes share eu-1a: the user's value
    stays, and is not recorded as ours, to be taken off once they stop sharing it."""
    existing = registration(identity(), REPORT)
    existing["metadata"] |= {"resourceVersion": "7"}
    existing["metadata"]["labels"][ZONE] = "user-z"
    zoned = dataclasses.replace(REPORT, labels={ZONE: "eu-1a"})
    patch = registration_patch(existing, identity(), zoned)
    assert patch is None or ZONE not in patch["metadata"].get("labels", {})
    assert ZONE not in (patch or existing)["metadata"]["annotations"].get(
        keys.NODE_LABEL_KEYS_ANNOTATION, ""
    )
    # A Node of a version that kept no record: its labels were all that version's.
    del existing["metadata"]["annotations"][keys.NODE_LABEL_KEYS_ANNOTATION]
    patch = registration_patch(existing, identity(), zoned)
    assert patch is not None and patch["metadata"]["labels"] == {ZONE: "eu-1a"}


async def registered_with_labels() -> tuple[
    FakeClient, LabelledLowerCluster, nodecontroller.NodeController
]:
    upper = FakeClient()
    lower = LabelledLowerCluster(**{keys.ARCH_LABEL: "amd64"})
    controller = nodecontroller.NodeController(upper, identity(), lower)
    controller.reachable = True
    await controller.register()
    return upper, lower, controller


async def test_a_users_label_on_a_key_the_lower_nodes_come_to_share_is_left_alone() -> None:
    """Set on the Node while we ran: the lower nodes coming to share eu-1a overwrote it,
    and took it off once they stopped sharing it. Left, it is read once, not at every
    update; taken off by the user, the key is ours when the lower nodes share it anew."""
    path = "/api/v1/nodes/vk-lower-1"
    upper, lower, controller = await registered_with_labels()
    users = {"metadata": {"name": "vk-lower-1", "resourceVersion": "9", "labels": {ZONE: "user-z"}}}
    upper.answer("GET", path, users)

    def label_patches() -> list[object]:
        patches = [
            r.body["metadata"] for r in upper.requests if (r.method, r.path) == ("PATCH", path)
        ]
        return [p["labels"] for p in patches if "labels" in p]

    reads = []
    for shared in ({ZONE: "eu-1a"}, {ZONE: "eu-1a"}, {}):
        upper.requests.clear()
        lower.labels = {keys.ARCH_LABEL: "amd64", **shared}
        await controller.update_status(force=False)
        assert label_patches() == []
        reads.append(len([r for r in upper.requests if (r.method, r.path) == ("GET", path)]))
    assert reads == [1, 0, 0]
    users["metadata"]["labels"] = {}
    upper.answer("GET", path, users)
    upper.requests.clear()
    lower.labels = {keys.ARCH_LABEL: "amd64", ZONE: "eu-1b"}
    await controller.update_status(force=False)
    assert label_patches() == [{ZONE: "eu-1b"}]
    (patch,) = [r.body for r in upper.requests if r.method == "PATCH" and r.path == path]
    assert patch["metadata"]["resourceVersion"] == "9", "conditional on what was read"


async def test_our_label_whose_patch_answer_was_lost_is_still_ours() -> None:
    """The patch went through and its answer was lost (an apiserver restart): read back,
    the label was taken for a user's, and stayed once the lower nodes stopped sharing it."""
    path = "/api/v1/nodes/vk-lower-1"
    upper, lower, controller = await registered_with_labels()
    ours = {
        "metadata": {
            "name": "vk-lower-1",
            "resourceVersion": "9",
            "labels": {ZONE: "eu-1a"},
            "annotations": {keys.NODE_LABEL_KEYS_ANNOTATION: f'["{ZONE}"]'},
        }
    }
    upper.answer("GET", path, ours)
    upper.answer("PATCH", path, ApiError(503, "the apiserver restarted"))
    lower.labels = {keys.ARCH_LABEL: "amd64", ZONE: "eu-1a"}
    await controller.update_status(force=False)
    upper.answer("GET", path, ours)
    await controller.update_status(force=False)
    upper.requests.clear()
    lower.labels = {keys.ARCH_LABEL: "amd64"}
    await controller.update_status(force=False)
    patches = [r.body["metadata"] for r in upper.requests if (r.method, r.path) == ("PATCH", path)]
    assert [p["labels"] for p in patches if "labels" in p] == [{ZONE: None}]


def test_a_restarted_estimator_is_news_and_other_annotations_are_left_alone() -> None:
    existing = registration(identity(estimator_port=10352, estimator_started="t1"), REPORT)
    existing["metadata"]["resourceVersion"] = "7"
    existing["metadata"]["annotations"]["someone.else/note"] = "kept"
    assert (
        registration_patch(existing, identity(estimator_port=10352, estimator_started="t1"), REPORT)
        is None
    )
    patch = registration_patch(
        existing, identity(estimator_port=10352, estimator_started="t2"), REPORT
    )
    assert patch == {
        "metadata": {
            "annotations": {keys.ESTIMATOR_STARTED_ANNOTATION: "t2"},
            "resourceVersion": "7",
        }
    }


def test_an_estimator_turned_off_takes_its_address_off_the_node() -> None:
    """Left there, the multischeduler dials a former run's address (a pod IP maybe given
    to another pod since) and waits each call out instead of failing at once."""
    existing = registration(identity(estimator_port=10352, estimator_started="t1"), REPORT)
    existing["metadata"]["resourceVersion"] = "7"
    patch = registration_patch(existing, identity(), REPORT)
    assert patch is not None
    assert patch["metadata"]["annotations"] == {
        keys.ESTIMATOR_ADDRESS_ANNOTATION: None,
        keys.ESTIMATOR_STARTED_ANNOTATION: None,
    }
    assert registration_patch(registration(identity(), REPORT), identity(), REPORT) is None


def test_an_ipv6_estimator_address_is_bracketed() -> None:
    """Bare, ``fd00::5:10352`` is read as a host without a port: the estimator could not
    listen on it, nor the multischeduler dial it."""
    v6 = NodeIdentity("vk-lower-1", "lower-1", "fd00::5", 10250, estimator_port=10352)
    annotations = registration(v6, REPORT)["metadata"]["annotations"]
    assert annotations[keys.ESTIMATOR_ADDRESS_ANNOTATION] == "[fd00::5]:10352"
    assert host_port("10.1.2.3", 10352) == "10.1.2.3:10352"
    assert host_port("[fd00::5]", 1) == "[fd00::5]:1"


def lower_node(name: str, **labels: str) -> dict[str, object]:
    return {
        "metadata": {"name": name, "labels": labels, "resourceVersion": "1"},
        "spec": {},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "allocatable": {}},
    }


def test_the_lower_nodes_digest_moves_with_what_node_filters_read_and_only_that() -> None:
    a, b = lower_node("a", disk="hdd"), lower_node("b")
    digest = nodes_digest([a, b])
    assert nodes_digest([b, a]) == digest, "order of the cache is no change"
    busy = {**a, "status": {**a["status"], "allocatable": {"cpu": "1"}}}  # type: ignore[dict-item]
    assert nodes_digest([busy, b]) == digest, "usage shows in allocatable, not here"
    assert nodes_digest([lower_node("a", disk="ssd"), b]) != digest
    tainted = {**a, "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}}
    assert nodes_digest([tainted, b]) != digest
    cordoned = {**a, "spec": {"unschedulable": True}}
    assert nodes_digest([cordoned, b]) != digest
    assert nodes_digest([a]) != digest


def test_the_node_annotations_say_what_the_lower_nodes_offer_and_the_largest_slot() -> None:
    assert report_annotations(REPORT) == {
        keys.LOWER_NODES_ANNOTATION: None,
        keys.LOWER_QUOTAS_ANNOTATION: None,
        keys.LARGEST_FREE_SLOT_ANNOTATION: None,
    }
    report = NodeReport(
        ready=True,
        allocatable={"cpu": "8"},
        nodes_digest="abc",
        quotas_digest="def",
        largest_free_slot={"node": "n1", "memory": "1Gi", "cpu": "2"},
    )
    assert report_annotations(report) == {
        keys.LOWER_NODES_ANNOTATION: "abc",
        keys.LOWER_QUOTAS_ANNOTATION: "def",
        keys.LARGEST_FREE_SLOT_ANNOTATION: '{"cpu":"2","memory":"1Gi","node":"n1"}',
    }


class FlakyLowerCluster:
    """A NodeProvider whose lower cluster answers as ``answers`` say, one ping each."""

    def __init__(self, *answers: bool) -> None:
        self.changed = asyncio.Event()
        self.answers = list(answers)

    async def ping(self) -> bool:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def report(self, reachable: bool) -> NodeReport:
        return NodeReport(ready=reachable, allocatable={"cpu": "8"})


async def test_the_pods_are_resynced_once_the_node_is_ready_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After an outage the upper node controller has marked every pod not ready; the
    virtual node reports them again, after the Node's Ready status went up."""
    monkeypatch.setattr(nodecontroller, "LEASE_INTERVAL_SECONDS", 0.01)
    monkeypatch.setattr(nodecontroller, "STATUS_COALESCE_SECONDS", 0.01)
    upper = FakeClient()
    resynced = asyncio.Event()
    status_writes_before: list[int] = []

    def resync() -> None:
        status_writes_before.append(len(upper.writes("PATCH")))
        resynced.set()

    lower = FlakyLowerCluster(True, False, False, True)
    controller = nodecontroller.NodeController(upper, identity(), lower, on_reachable=resync)
    running = asyncio.create_task(controller.run())
    try:
        await asyncio.wait_for(resynced.wait(), 2)
    finally:
        running.cancel()
    assert status_writes_before and status_writes_before[0] >= 1
    assert lower.answers == [True], "resynced once it answered again, not before"
    statuses = [r.body for r in upper.requests if r.path == "/api/v1/nodes/vk-lower-1/status"]
    ready = statuses[-1]["status"]["conditions"]
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in ready)


@pytest.mark.parametrize("failure", ["lower cluster unreachable", "status write refused"])
async def test_a_status_not_sent_is_tried_again_after_a_pause(
    monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Once the heartbeat is due, a status that cannot go (the lower cluster unreachable:
    silence is the signal; the upper apiserver refusing it) waits before the next try
    rather than trying again at once, which spun a core for the whole outage."""
    monkeypatch.setattr(nodecontroller, "STATUS_COALESCE_SECONDS", 0.0)
    monkeypatch.setattr(nodecontroller, "STATUS_INTERVAL_SECONDS", 0.0)
    monkeypatch.setattr(nodecontroller, "STATUS_RETRY_SECONDS", 0.2)
    upper = FakeClient()
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    await controller.update_status(force=True)  # the Node's status is there
    if failure == "lower cluster unreachable":
        controller.reachable = False
    else:
        controller.reachable = True
        path = "/api/v1/nodes/vk-lower-1/status"
        upper.answer("PATCH", path, *[ApiError(403, "forbidden")] * 100)
        # Read before each next try (what we sent may not be what the Node holds).
        node = {"metadata": {"name": "vk-lower-1", "uid": "uid-1"}, "status": {}}
        upper.answer("GET", "/api/v1/nodes/vk-lower-1", *[node] * 100)
    tries = 0
    update_status = controller.update_status

    async def counted(force: bool) -> None:
        nonlocal tries
        tries += 1
        await update_status(force)

    monkeypatch.setattr(controller, "update_status", counted)
    looping = asyncio.create_task(controller._status_loop())
    await asyncio.sleep(0.5)
    looping.cancel()
    assert 1 <= tries <= 4, tries


def test_a_resource_gone_from_the_report_is_patched_to_null() -> None:
    before = {"capacity": {"cpu": "8", "nvidia.com/gpu": "2"}, "allocatable": {"cpu": "8"}}
    now = {"capacity": {"cpu": "8"}, "allocatable": {}, "conditions": []}
    assert status_patch(before, now) == {
        "capacity": {"nvidia.com/gpu": None, "cpu": "8"},
        "allocatable": {"cpu": None},
        "conditions": [],
    }
    assert status_patch(now, now) == now
    assert status_patch({}, now) == now


DONGLE = "example.com/dongle"
GPU = "nvidia.com/gpu"
STATUS_PATH = "/api/v1/nodes/vk-lower-1/status"


class ResizedLowerCluster(FlakyLowerCluster):
    """A reachable lower cluster whose nodes' allocatable may change."""

    def __init__(self, **allocatable: str) -> None:
        super().__init__(True)
        self.allocatable = allocatable

    def report(self, reachable: bool) -> NodeReport:
        return NodeReport(ready=reachable, allocatable=dict(self.allocatable))


def with_dongles(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` as an admin leaves it who advertised 4 dongles on the Node (Kubernetes'
    guide "Advertise Extended Resources for a Node"; allocatable too, which the upper
    scheduler reads, and no kubelet here copies capacity into)."""
    return {
        **status,
        "capacity": {**status["capacity"], DONGLE: "4"},
        "allocatable": {**status["allocatable"], DONGLE: "4"},
    }


def status_patches(upper: FakeClient) -> list[dict[str, Any]]:
    return [r.body["status"] for r in upper.requests if r.path == STATUS_PATH]


async def test_a_resource_someone_else_put_on_the_node_is_left_there() -> None:
    """The status we patch reads the admin's dongles back; the patch after it wrote them
    as null, as if the lower nodes had lost them, and every status was a change. Our GPUs
    gone from the lower nodes still go."""
    upper = FakeClient()
    lower = ResizedLowerCluster(cpu="8", **{GPU: "2"})
    controller = nodecontroller.NodeController(upper, identity(), lower)
    controller.reachable = True
    await controller.register()
    (sent,) = status_patches(upper)
    upper.answer("PATCH", STATUS_PATH, {"status": with_dongles(sent)})
    await controller.update_status(force=True)
    upper.requests.clear()
    lower.allocatable = {"cpu": "8"}
    await controller.update_status(force=False)
    (patch,) = status_patches(upper)
    assert patch["capacity"] == patch["allocatable"] == {GPU: None, "cpu": "8"}
    upper.requests.clear()
    await controller.update_status(force=False)
    assert status_patches(upper) == [], "the dongles are no change of ours"


async def test_a_restart_takes_off_the_resources_a_former_run_set_and_only_those() -> None:
    """The GPU node went while no virtual node ran (a restart, a standby taking over):
    the Node's record says the GPUs were ours, so they go; the dongles stay."""
    gpus = NodeReport(ready=True, allocatable={"cpu": "8", GPU: "2"})
    node = registration(identity(), gpus)
    node["metadata"] |= {"uid": "uid-1", "resourceVersion": "7"}
    node["status"] = with_dongles(node["status"])
    upper = FakeClient()
    upper.answer("GET", "/api/v1/nodes/vk-lower-1", node)
    controller = nodecontroller.NodeController(upper, identity(), ResizedLowerCluster(cpu="8"))
    controller.reachable = True
    await controller.register()
    (patch,) = status_patches(upper)
    assert patch["capacity"] == patch["allocatable"] == {GPU: None, "cpu": "8"}
    upper.requests.clear()
    await controller.update_status(force=False)
    (metadata,) = [r.body["metadata"] for r in upper.requests if r.path.endswith("vk-lower-1")]
    assert metadata["annotations"] == {keys.NODE_RESOURCE_KEYS_ANNOTATION: '["cpu"]'}


def test_a_node_without_a_record_of_its_resources_counts_them_all_ours() -> None:
    """A version that kept no record took off every resource it did not report."""
    node = registration(identity(), REPORT)
    node["status"] = with_dongles(node["status"])
    assert recorded_resource_keys(node) == {"cpu"}
    del node["metadata"]["annotations"][keys.NODE_RESOURCE_KEYS_ANNOTATION]
    assert recorded_resource_keys(node) == {"cpu", DONGLE}


def test_the_status_compared_with_ours_leaves_out_resources_not_ours() -> None:
    status = {"capacity": {"cpu": "8", DONGLE: "4"}, "allocatable": {DONGLE: "4"}, "x": 1}
    assert without_foreign_resources(status, {"cpu"}) == {
        "capacity": {"cpu": "8"},
        "allocatable": {},
        "x": 1,
    }
    assert without_foreign_resources({}, {"cpu"}) == {}


def test_changed_addresses_replace_the_whole_list() -> None:
    """Strategic merge by type would keep a Hostname address an older version wrote."""
    internal = [{"type": "InternalIP", "address": "10.0.0.7"}]
    before = {"addresses": [{"type": "Hostname", "address": "vk-lower-1"}, *internal]}
    assert status_patch(before, {"addresses": internal}) == {
        "addresses": [*internal, {"$patch": "replace"}]
    }
    assert status_patch({"addresses": internal}, {"addresses": internal}) == {"addresses": internal}
    assert status_patch({}, {"addresses": internal}) == {"addresses": internal}


async def test_a_node_changed_while_registering_is_read_again() -> None:
    """The conditional patch meets a Node written meanwhile (a 409): the process read it
    again rather than ending."""
    upper = FakeClient()
    path = "/api/v1/nodes/vk-lower-1"
    existing = {
        "metadata": {
            "name": "vk-lower-1",
            "uid": "node-uid",
            "resourceVersion": "5",
            "annotations": {keys.NODE_RESOURCE_KEYS_ANNOTATION: '["cpu"]'},
        },
        "spec": {},
        "status": {},
    }
    upper.answer("GET", path, existing, {**existing, "metadata": {**existing["metadata"]}})
    conflict = status_error(409, "Conflict", "the object has been modified")
    upper.answer("PATCH", path, conflict, existing)
    controller = nodecontroller.NodeController(
        upper, identity(estimator_port=10352, estimator_started="t2"), FlakyLowerCluster(True)
    )
    controller.reachable = True
    await controller.register()
    node_requests = [(r.method, r.path) for r in upper.requests if r.path == path]
    assert node_requests == [("GET", path), ("PATCH", path), ("GET", path), ("PATCH", path)]


class LabelledLowerCluster(FlakyLowerCluster):
    """A reachable lower cluster whose nodes share ``labels``, which may change."""

    def __init__(self, **labels: str) -> None:
        super().__init__(True)
        self.labels = labels
        self.slot: dict[str, str] = {}

    def report(self, reachable: bool) -> NodeReport:
        return NodeReport(
            ready=reachable,
            allocatable={"cpu": "8"},
            labels=dict(self.labels),
            largest_free_slot=self.slot,
        )


async def test_the_labels_the_lower_nodes_share_follow_them() -> None:
    """Registered while the nodes were amd64 in region a; they are arm64 now, in no one
    region: the Node's labels follow, and the region label we set goes."""
    upper = FakeClient()
    lower = LabelledLowerCluster(**{"topology.kubernetes.io/region": "a", keys.ARCH_LABEL: "amd64"})
    controller = nodecontroller.NodeController(upper, identity(), lower)
    controller.reachable = True
    await controller.register()
    upper.requests.clear()
    lower.labels = {keys.ARCH_LABEL: "arm64"}
    await controller.update_status(force=False)
    (patch,) = [r.body for r in upper.requests if r.path == "/api/v1/nodes/vk-lower-1"]
    assert patch["metadata"]["labels"] == {
        keys.ARCH_LABEL: "arm64",
        "topology.kubernetes.io/region": None,
    }
    upper.requests.clear()
    await controller.update_status(force=False)
    assert [r for r in upper.requests if r.path == "/api/v1/nodes/vk-lower-1"] == []
    # No node counts for a moment (all NotReady): the labels stay as they are, and so
    # does the Node's nodeInfo (it read amd64, the default, meanwhile).
    lower.labels = {}
    await controller.update_status(force=False)
    assert [r for r in upper.requests if r.path == "/api/v1/nodes/vk-lower-1"] == []
    assert not [
        r.body
        for r in upper.requests
        if r.path == "/api/v1/nodes/vk-lower-1/status" and "nodeInfo" in r.body["status"]
    ]


async def registered_then_relabelled() -> tuple[FakeClient, nodecontroller.NodeController]:
    """A Node registered while its lower nodes were amd64; they are arm64 now."""
    upper = FakeClient()
    lower = LabelledLowerCluster(**{keys.ARCH_LABEL: "amd64"})
    controller = nodecontroller.NodeController(upper, identity(), lower)
    controller.reachable = True
    await controller.register()
    upper.requests.clear()
    lower.labels = {keys.ARCH_LABEL: "arm64"}
    return upper, controller


async def test_a_node_deleted_while_its_labels_change_is_registered_again() -> None:
    """The label patch that comes before the status meets the Node gone: registered
    again, not a warning every few seconds while the Node stays away."""
    upper, controller = await registered_then_relabelled()
    upper.answer("PATCH", "/api/v1/nodes/vk-lower-1", status_error(404, "NotFound", "gone"))
    await controller.update_status(force=True)
    created = [r.body for r in upper.requests if (r.method, r.path) == ("POST", "/api/v1/nodes")]
    assert len(created) == 1
    assert created[0]["metadata"]["labels"][keys.ARCH_LABEL] == "arm64"


async def test_a_node_deleted_is_registered_again_at_the_next_lease_renewal() -> None:
    """Its Lease went with it: the renewal that finds the Lease gone registers the Node
    again and makes the Lease for the new one, rather than a Lease of the old Node's UID
    (the GC takes that away too) while the status waits for its next heartbeat."""
    upper = FakeClient()
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    controller.reachable = True
    await controller.register()
    upper.requests.clear()
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{keys.NODE_LEASE_NAMESPACE}/leases"
    upper.answer("PATCH", f"{lease_path}/vk-lower-1", status_error(404, "NotFound", "gone"))
    await controller.renew_lease()
    posted = [r for r in upper.requests if r.method == "POST"]
    assert [r.path for r in posted] == ["/api/v1/nodes", lease_path]
    (owner,) = posted[1].body["metadata"]["ownerReferences"]
    assert owner["uid"] == "uid-2", "the new Node's"


@pytest.mark.parametrize("uncordoned_before", [False, True])
async def test_a_node_deleted_while_cordoned_is_registered_again_cordoned(
    uncordoned_before: bool,
) -> None:
    """Cordon, drain, delete: the usual way to retire a node. Made again open, the Node
    took new pods within seconds of its deletion; made again cordoned, it takes none
    until uncordoned (or the virtual node is stopped)."""
    upper = FakeClient()
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    controller.reachable = True
    await controller.register()
    seen = [{"metadata": {"name": "vk-lower-1"}, "spec": {"unschedulable": True}}]
    if uncordoned_before:
        seen.append({"metadata": {"name": "vk-lower-1"}, "spec": {}})
    upper.answer("PATCH", "/api/v1/nodes/vk-lower-1/status", *seen)
    for _ in seen:
        await controller.update_status(force=True)
    upper.answer("PATCH", "/api/v1/nodes/vk-lower-1/status", status_error(404, "NotFound", "gone"))
    upper.requests.clear()
    await controller.update_status(force=True)
    [created] = [r.body for r in upper.requests if (r.method, r.path) == ("POST", "/api/v1/nodes")]
    assert created["spec"].get("unschedulable", False) is not uncordoned_before


async def test_after_an_outage_a_condition_moves_from_what_the_node_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the virtual node was silent the upper node controller set Ready Unknown:
    Ready True afterwards is a transition, dated now, not the old True's date."""
    monkeypatch.setattr(nodecontroller, "STATUS_COALESCE_SECONDS", 0.0)
    upper = FakeClient()
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    controller.reachable = True
    await controller.register()
    before = "2020-01-01T00:00:00Z"
    for condition in controller._last_status["conditions"]:  # type: ignore[attr-defined]
        condition["lastTransitionTime"] = before
    unknown = {
        "metadata": {"name": "vk-lower-1", "uid": "uid-1"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-01-01T00:00:00Z"}
            ]
        },
    }
    upper.answer("GET", "/api/v1/nodes/vk-lower-1", unknown)
    upper.requests.clear()
    sent_once = asyncio.Event()
    update_status = controller.update_status

    async def noted(force: bool) -> None:
        await update_status(force)
        sent_once.set()

    monkeypatch.setattr(controller, "update_status", noted)
    controller._reachability_changed.set()
    looping = asyncio.create_task(controller._status_loop())
    try:
        await asyncio.wait_for(sent_once.wait(), 2)
    finally:
        looping.cancel()
    first = upper.requests[0]
    assert (first.method, first.path) == ("GET", "/api/v1/nodes/vk-lower-1")
    (sent,) = [r.body for r in upper.requests if r.path.endswith("/status")]
    ready = next(c for c in sent["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["lastTransitionTime"] not in (
        before,
        "2026-01-01T00:00:00Z",
    )


async def test_the_lower_cluster_back_during_a_pause_for_other_changes_is_not_missed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lower pod's change wakes the status loop, which waits a moment for more; the
    lower cluster found reachable again in that moment forces a status read from the
    Node (the node controller set it Unknown)."""
    monkeypatch.setattr(nodecontroller, "STATUS_COALESCE_SECONDS", 0.2)
    upper = FakeClient()
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    controller.reachable = True
    await controller.register()
    controller._next_status_at = asyncio.get_running_loop().time() + 3600
    node = {"metadata": {"name": "vk-lower-1", "uid": "uid-1"}, "status": {}}
    upper.answer("GET", "/api/v1/nodes/vk-lower-1", node)
    upper.requests.clear()
    sent = asyncio.Event()
    update_status = controller.update_status
    forced: list[bool] = []

    async def noted(force: bool) -> None:
        forced.append(force)
        await update_status(force)
        sent.set()

    monkeypatch.setattr(controller, "update_status", noted)
    looping = asyncio.create_task(controller._status_loop())
    try:
        controller.provider.changed.set()
        await asyncio.sleep(0.05)
        controller._reachability_changed.set()
        await asyncio.wait_for(sent.wait(), 2)
    finally:
        looping.cancel()
    assert forced == [True]
    assert (upper.requests[0].method, upper.requests[0].path) == (
        "GET",
        "/api/v1/nodes/vk-lower-1",
    )


async def test_a_refused_label_holds_back_neither_status_nor_annotations() -> None:
    """An admission policy refuses a label copied from the lower nodes: the status (the
    capacity) goes all the same, and so do the annotations the multischeduler reads."""
    upper, controller = await registered_then_relabelled()
    assert isinstance(controller.provider, LabelledLowerCluster)
    controller.provider.slot = {"cpu": "7"}
    node = "/api/v1/nodes/vk-lower-1"
    upper.answer("PATCH", node, status_error(403, "Forbidden", "policy"))
    await controller.update_status(force=True)
    patches = [r for r in upper.requests if r.method == "PATCH"]
    assert [r.path for r in patches] == [node, node, f"{node}/status"]
    assert patches[1].body == {
        "metadata": {"annotations": {keys.LARGEST_FREE_SLOT_ANNOTATION: '{"cpu":"7"}'}}
    }
    upper.requests.clear()
    await controller.update_status(force=False)
    (patch,) = [r.body for r in upper.requests if r.path == node]
    assert patch["metadata"]["labels"] == {keys.ARCH_LABEL: "arm64"}, "tried again"


@pytest.mark.parametrize("status", [400, 403, 422])
async def test_a_node_refused_for_a_lower_label_registers_without_it(status: int) -> None:
    """An upper admission policy refuses a label the lower nodes share: the Node is made
    without it (the process ended at every start), and the update tries it again."""
    upper = FakeClient()
    shared = {"example.com/pool": "gpu", keys.ARCH_LABEL: "arm64"}
    controller = nodecontroller.NodeController(upper, identity(), LabelledLowerCluster(**shared))
    controller.reachable = True
    upper.answer("POST", "/api/v1/nodes", status_error(status, "Forbidden", "policy"))
    # Read before the label is tried again: the key might hold a user's value by now.
    made = {"metadata": {"name": "vk-lower-1", "resourceVersion": "2", "labels": {}}}
    absent = not_found("nodes", "vk-lower-1")
    upper.answer("GET", "/api/v1/nodes/vk-lower-1", absent, absent, made)
    await controller.register()
    created = [r.body for r in upper.requests if (r.method, r.path) == ("POST", "/api/v1/nodes")]
    assert len(created) == 2
    assert "example.com/pool" in created[0]["metadata"]["labels"]
    assert "example.com/pool" not in created[1]["metadata"]["labels"]
    (patch,) = [r.body for r in upper.requests if r.method == "PATCH" and r.path.endswith("-1")]
    assert patch["metadata"]["labels"] == {"example.com/pool": "gpu"}, "tried again"
    assert patch["metadata"]["resourceVersion"] == "2"


async def test_a_node_there_refused_a_lower_label_keeps_the_labels_it_has() -> None:
    """Registered again after a restart, the patch bringing a new shared label refused:
    the Node keeps its region and architecture (taken off, the label update, refused
    for the same label, would never put them back)."""
    region = "topology.kubernetes.io/region"
    upper = FakeClient()
    had = {region: "eu", keys.ARCH_LABEL: "arm64"}
    node = registration(identity(), dataclasses.replace(REPORT, labels=had))
    node["metadata"] |= {"uid": "uid-1", "resourceVersion": "7"}
    path = "/api/v1/nodes/vk-lower-1"
    upper.answer("GET", path, node, node, node)
    upper.answer("PATCH", path, status_error(403, "Forbidden", "policy"))
    lower = LabelledLowerCluster(**had, **{"example.com/pool": "gpu"})
    controller = nodecontroller.NodeController(upper, identity(), lower)
    controller.reachable = True
    await controller.register()
    patches = [r.body for r in upper.requests if (r.method, r.path) == ("PATCH", path)]
    assert patches[0]["metadata"]["labels"] == {"example.com/pool": "gpu"}
    for patch in patches[1:]:
        assert patch["metadata"].get("labels") in (None, {"example.com/pool": "gpu"})


async def test_a_node_refused_for_another_reason_is_not_registered_again() -> None:
    upper = FakeClient()
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    controller.reachable = True
    upper.answer("POST", "/api/v1/nodes", status_error(403, "Forbidden", "no create"))
    with pytest.raises(ApiError):
        await controller.register()


async def test_a_label_kept_at_a_registration_without_lower_nodes_goes_once_they_differ() -> None:
    """Restarted while no lower node counted, the labels a former run set stayed; when
    the nodes count again without sharing one, it goes, and later runs forget it."""
    region = "topology.kubernetes.io/region"
    upper = FakeClient()
    node = registration(identity(), dataclasses.replace(REPORT, labels={region: "a"}))
    node["metadata"] |= {"uid": "uid-1", "resourceVersion": "7"}
    upper.answer("GET", "/api/v1/nodes/vk-lower-1", node)
    lower = LabelledLowerCluster()
    restarted = nodecontroller.NodeController(upper, identity(), lower)
    restarted.reachable = True
    await restarted.register()
    assert not [r for r in upper.requests if r.path == "/api/v1/nodes/vk-lower-1" and r.body]
    upper.requests.clear()
    lower.labels = {keys.ARCH_LABEL: "amd64"}
    await restarted.update_status(force=False)
    (patch,) = [r.body for r in upper.requests if r.path == "/api/v1/nodes/vk-lower-1"]
    assert patch["metadata"]["labels"] == {region: None}
    record = json.loads(patch["metadata"]["annotations"][keys.NODE_LABEL_KEYS_ANNOTATION])
    assert region not in record


async def test_a_lease_renewed_again_after_failing_has_the_status_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Renewals failed (the upper apiserver away): the node controller may have set the
    Node Unknown, which a renewed Lease does not undo; the status is sent at once."""
    monkeypatch.setattr(nodecontroller, "LEASE_INTERVAL_SECONDS", 0.01)
    monkeypatch.setattr(nodecontroller, "LEASE_RETRY_SECONDS", 0.01)
    upper = FakeClient()
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    controller.reachable = True
    await controller.register()
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{keys.NODE_LEASE_NAMESPACE}/leases"
    upper.answer("PATCH", f"{lease}/vk-lower-1", ApiError(503, "unavailable"), {})
    looping = asyncio.create_task(controller._lease_loop())
    try:
        await asyncio.wait_for(controller._reachability_changed.wait(), 2)
    finally:
        looping.cancel()


def test_the_node_gives_no_hostname_address_the_apiserver_cannot_resolve() -> None:
    assert node_status(identity(), REPORT)["addresses"] == [
        {"type": "InternalIP", "address": "10.1.2.3"}
    ]


async def test_a_start_that_does_not_end_taints_the_node_and_keeps_its_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kind the lower RBAC refuses is listed for ever and the caches never sync: the
    Node stayed Ready with its old status while nothing was mirrored, and the upper
    scheduler bound pods to it. Let lapse, its Lease would have every pod evicted."""
    monkeypatch.setattr(nodecontroller, "LEASE_INTERVAL_SECONDS", 0.02)
    monkeypatch.setattr(nodecontroller, "START_LIMIT_SECONDS", 0.1)
    upper = FakeClient()
    path = "/api/v1/nodes/vk-lower-1"
    node: dict[str, Any] = {
        "metadata": {"name": "vk-lower-1", "uid": "node-uid", "resourceVersion": "5"},
        "spec": {"taints": [provider_taint()]},
    }
    upper.answer("GET", path, node, node)
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{keys.NODE_LEASE_NAMESPACE}/leases"
    # The certificate, then the caches: one limit for both, each step under it.
    assert await controller.renewing_lease_while(asyncio.sleep(0.07, "signed")) == "signed"
    assert await controller.renewing_lease_while(asyncio.sleep(0.08, "synced")) == "synced"
    renewals = [r for r in upper.requests if r.path.startswith(lease) and r.method == "PATCH"]
    assert len(renewals) >= 4, "the Lease is renewed throughout"
    (tainted,) = [r.body for r in upper.requests if (r.method, r.path) == ("PATCH", path)]
    assert tainted == {
        "metadata": {"resourceVersion": "5"},
        "spec": {"taints": [provider_taint(), not_started_taint()]},
    }
    # Registered once started, the taint goes.
    node["spec"]["taints"] = tainted["spec"]["taints"]
    existing = {**registration(identity(), REPORT), "spec": node["spec"]}
    existing["metadata"]["resourceVersion"] = "6"
    patch = registration_patch(existing, identity(), REPORT)
    assert patch is not None and patch["spec"] == {"taints": [provider_taint()]}


class SlowTaint(FakeClient):
    """Takes its time over a Node patch, and says when it is done."""

    patched = False

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        answer = await super().request(method, path, **kwargs)
        if (method, path) == ("PATCH", "/api/v1/nodes/vk-lower-1"):
            await asyncio.sleep(0.2)
            self.patched = True
        return answer


async def test_a_not_started_taint_under_way_lands_before_the_start_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled in flight, the patch could land after the registration that takes the
    taint off had read the Node, and stay for good."""
    monkeypatch.setattr(nodecontroller, "START_LIMIT_SECONDS", 0.0)
    upper = SlowTaint()
    node = {"metadata": {"name": "vk-lower-1", "uid": "node-uid", "resourceVersion": "5"}}
    upper.answer("GET", "/api/v1/nodes/vk-lower-1", node, node)
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    assert await controller.renewing_lease_while(asyncio.sleep(0.05, "synced")) == "synced"
    assert upper.patched


@pytest.mark.parametrize("registered", [True, "after a failed read", False])
async def test_the_lease_of_a_registered_node_is_renewed_while_the_caches_sync(
    monkeypatch: pytest.MonkeyPatch, registered: bool | str
) -> None:
    """A restart, a standby taking over: the sync of a large cluster can outlast the
    Lease's 40 s, and the Node would go not ready meanwhile. A Node not there yet waits
    for the sync, which what it registers with comes from."""
    monkeypatch.setattr(nodecontroller, "LEASE_INTERVAL_SECONDS", 0.05)
    upper = FakeClient()
    if registered:
        node = {"metadata": {"name": "vk-lower-1", "uid": "node-uid"}, "status": {}}
        failed = [ApiError(503, "unavailable")] if registered == "after a failed read" else []
        upper.answer("GET", "/api/v1/nodes/vk-lower-1", *failed, node)
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    assert await controller.renewing_lease_while(asyncio.sleep(0.3, "signed")) == "signed"
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{keys.NODE_LEASE_NAMESPACE}/leases"
    renewals = [r for r in upper.requests if r.path.startswith(lease)]
    if registered:
        assert 2 <= len([r for r in renewals if r.method == "PATCH"]) <= 8
    else:
        assert renewals == []


async def test_a_lease_renewal_waits_ten_seconds_at_most_and_a_failed_one_is_soon_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A renewal hung on a dead connection for the client's usual 60 s, then 10 s more
    before the next, would outlast the 40 s Lease."""
    monkeypatch.setattr(nodecontroller, "LEASE_RETRY_SECONDS", 0.01)
    upper = FakeClient()
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{keys.NODE_LEASE_NAMESPACE}/leases"
    upper.answer("PATCH", f"{lease}/vk-lower-1", TimeoutError(), {})
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    looping = asyncio.create_task(controller._lease_loop())
    await asyncio.sleep(0.2)
    looping.cancel()
    renewals = [r for r in upper.requests if r.path.startswith(lease)]
    assert [r.method for r in renewals] == ["PATCH", "PATCH"], "the next after 10 s"
    assert {r.timeout for r in renewals} == {nodecontroller.LEASE_REQUEST_TIMEOUT_SECONDS}
    assert nodecontroller.LEASE_REQUEST_TIMEOUT_SECONDS <= 10


async def test_an_annotation_the_lower_cluster_no_longer_gives_is_written_as_null() -> None:
    """A largest free slot left standing would show room that is gone."""
    upper = FakeClient()
    controller = nodecontroller.NodeController(upper, identity(), FlakyLowerCluster(True))
    roomy = NodeReport(ready=True, allocatable={"cpu": "8"}, largest_free_slot={"cpu": "2"})
    await controller._send_metadata(roomy)
    await controller._send_metadata(REPORT)
    await controller._send_metadata(REPORT)
    sent = [r.body["metadata"].get("annotations") for r in upper.requests if r.method == "PATCH"]
    assert sent == [
        {
            keys.LARGEST_FREE_SLOT_ANNOTATION: '{"cpu":"2"}',
            keys.NODE_RESOURCE_KEYS_ANNOTATION: '["cpu"]',
        },
        {keys.LARGEST_FREE_SLOT_ANNOTATION: None},
    ], "and nothing the third time"


class SilentLowerCluster(FlakyLowerCluster):
    """A lower cluster whose ping has not answered yet (it would take its 10 s)."""

    async def ping(self) -> bool:
        await asyncio.Event().wait()
        return False


async def test_a_start_is_not_held_back_by_a_lease_renewal_on_its_way() -> None:
    """The renewal goes beside the work: a ping of an unreachable lower cluster would
    otherwise hold each step of the start for its whole deadline."""
    upper = FakeClient()
    node = {"metadata": {"name": "vk-lower-1", "uid": "node-uid"}, "status": {}}
    upper.answer("GET", "/api/v1/nodes/vk-lower-1", node)
    controller = nodecontroller.NodeController(upper, identity(), SilentLowerCluster(False))
    async with asyncio.timeout(5):
        assert await controller.renewing_lease_while(asyncio.sleep(0, "read")) == "read"


def test_an_empty_capacity_is_the_same_as_the_none_the_apiserver_gives_back() -> None:
    """No lower node counts: the map sent empty comes back left out, and was patched at
    every wake-up."""
    sent = {"capacity": {}, "allocatable": {}, "conditions": [{"type": "Ready", "status": "True"}]}
    read_back = {"conditions": [{"type": "Ready", "status": "True"}]}
    assert not status_changed(read_back, sent)
    assert status_changed(read_back, {**sent, "capacity": {"cpu": "1"}})


def test_the_lower_nodes_share_only_labels_a_kubelet_may_set_on_its_own_node() -> None:
    """A label the lower admins keep to themselves (the NodeRestriction plugin keeps
    kubelets off node-restriction.kubernetes.io and node-role.kubernetes.io) is theirs:
    carried up, an upper workload selecting it was placed into a cluster another admin
    runs, and a one-node lower cluster made its virtual node a control plane."""
    carried = {
        ZONE: "eu-1a",
        "topology.kubernetes.io/region": "eu",
        "node.kubernetes.io/instance-type": "m5.large",
        "kubelet.kubernetes.io/managed": "yes",
        "nvidia.com/gpu.product": "A100",
        "team": "ml",
    }
    common = {
        **carried,
        "node-role.kubernetes.io/control-plane": "",
        "node-restriction.kubernetes.io/pci-zone": "true",
        "example.node-restriction.kubernetes.io/tier": "gold",
        "kubernetes.io/role": "worker",
        "k8s.io/owner": "ops",
        "kubestrata.io/virtual-node": "true",
    }
    lower = [
        {
            "metadata": {"name": n, "labels": {**common, keys.HOSTNAME_LABEL: n}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
        for n in ("a", "b")
    ]
    assert shared_labels(lower) == carried
