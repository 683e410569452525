"""The pod controller over the lower-cluster backend, both sides' caches fed through their
informers and both apiservers answered by a fake client: each SyncResult path, deletion,
an unreachable lower cluster, conflicts and a namespace deleted below."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from kubekit import keys
from kubekit.client import NODES, PODS, ApiError
from kubekit.informer import Informer
from kubekit.stash import stash_scheduling
from kubekit.workqueue import WorkQueue
from tests.unit.fakeapi import FakeClient, not_found, status_error
from virtual_node import lower as lower_module
from virtual_node import podcontroller
from virtual_node.lower import LowerCluster, NameTaken, ended_by_its_deletion
from virtual_node.naming import NamespaceMapping
from virtual_node.podcontroller import PodController, RetryLater, SyncResult
from virtual_node.translate import Ownership

OWNER = Ownership(origin="upper-uid", node_name="vk-lower-1", cluster_id="lower-1")
HOST_IP = "10.0.0.9"
LOWER_POD_PATH = "/api/v1/namespaces/shop/pods"
UPPER_STATUS_PATH = "/api/v1/namespaces/shop/pods/web/status"


@dataclass
class Mirroring:
    upper: FakeClient
    lower: FakeClient
    upper_pods: Informer
    lower_pods: Informer
    controller: PodController

    def above(self, pod: dict[str, Any], event: str = "ADDED") -> None:
        self.upper_pods.apply({"type": event, "object": pod})

    def below(self, pod: dict[str, Any], event: str = "ADDED") -> None:
        self.lower_pods.apply({"type": event, "object": pod})

    def upper_statuses(self) -> list[dict[str, Any]]:
        return [r.body["status"] for r in self.upper.requests if r.path == UPPER_STATUS_PATH]

    def pod_scheduled(self) -> dict[str, Any]:
        """The PodScheduled condition of the one status written above."""
        (status,) = self.upper_statuses()
        scheduled: dict[str, Any]
        (scheduled,) = [c for c in status["conditions"] if c["type"] == "PodScheduled"]
        return scheduled

    def upper_event_reasons(self) -> list[str]:
        return [r.body["reason"] for r in self.upper.requests if r.path.endswith("/events")]


@pytest.fixture
def mirroring() -> Mirroring:
    return mirroring_with()


def mirroring_with(
    host_access_namespaces: frozenset[str] = frozenset(),
    mapping: NamespaceMapping | None = None,
    outside_slices: Callable[[str], str | None] | None = None,
    stash_unguarded: Callable[[Mapping[str, Any]], str | None] = lambda _pod: None,
) -> Mirroring:
    upper, lower = FakeClient(), FakeClient()
    upper_pods = Informer(client=upper, resource=PODS)
    lower_pods = Informer(client=lower, resource=PODS)
    backend = LowerCluster(
        lower,
        lower_pods,
        Informer(client=lower, resource=NODES),
        OWNER,
        mapping or NamespaceMapping(),
        HOST_IP,
        host_access_namespaces=host_access_namespaces,
        outside_slices=outside_slices,
        stash_unguarded=stash_unguarded,
    )
    controller = PodController(upper, upper_pods, backend, "vk-lower-1", WorkQueue("pods"))
    return Mirroring(upper, lower, upper_pods, lower_pods, controller)


def upper_pod(*, controlled: bool = False, **spec: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": "web",
        "namespace": "shop",
        "uid": "upper-pod-uid",
        "resourceVersion": "7",
        "labels": {"app": "web"},
    }
    if controlled:
        metadata["ownerReferences"] = [
            {"kind": "ReplicaSet", "name": "web-1", "uid": "rs", "controller": True}
        ]
    return {
        "metadata": metadata,
        "spec": {
            "nodeName": "vk-lower-1",
            "containers": [{"name": "app", "image": "nginx"}],
            **spec,
        },
        "status": {"phase": "Pending"},
    }


def lower_pod(*, ours: bool = True, **status: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": "web",
        "namespace": "shop",
        "uid": "lower-pod-uid",
        "resourceVersion": "3",
        "labels": {"app": "web", **(OWNER.labels() if ours else {})},
        "annotations": {
            keys.UPPER_UID_ANNOTATION: "upper-pod-uid",
            keys.UPPER_NAMESPACE_ANNOTATION: "shop",
            keys.UPPER_KEYS_ANNOTATION: '{"labels":["app"],"annotations":[]}',
        },
    }
    return {
        "metadata": metadata,
        "spec": {"nodeName": "lower-node-1", "containers": [{"name": "app", "image": "nginx"}]},
        "status": status,
    }


async def test_a_new_pod_is_created_below_after_its_namespace_and_service_account(
    mirroring: Mirroring,
) -> None:
    pod = upper_pod()
    pod["metadata"]["generation"] = 1
    mirroring.above(pod)
    mirroring.lower.answer("POST", LOWER_POD_PATH, lower_pod(phase="Pending"))
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.writes() == [
        ("POST", "/api/v1/namespaces"),
        ("POST", "/api/v1/namespaces/shop/serviceaccounts"),
        ("POST", LOWER_POD_PATH),
    ]
    (created,) = [r.body for r in mirroring.lower.requests if r.path == LOWER_POD_PATH]
    assert created["metadata"]["labels"] == {"app": "web", **OWNER.labels()}
    assert "nodeName" not in created["spec"]
    # Not even the observed generation: it rides along with the pod's first real news.
    assert mirroring.upper.writes() == [], "nothing to report before a lower node takes it"


async def test_the_lower_status_comes_up_with_the_virtual_node_as_host(
    mirroring: Mirroring,
) -> None:
    pod = upper_pod()
    pod["metadata"]["generation"] = 1
    mirroring.above(pod)
    mirroring.below(lower_pod(phase="Running", hostIP="192.168.0.5", podIP="10.241.0.7"))
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.writes() == []
    (status,) = mirroring.upper_statuses()
    assert status["phase"] == "Running" and status["podIP"] == "10.241.0.7"
    assert status["observedGeneration"] == 1
    assert status["hostIP"] == HOST_IP and status["hostIPs"] == [{"ip": HOST_IP}]


async def test_a_status_conflict_waits_for_the_next_watch_event(mirroring: Mirroring) -> None:
    mirroring.above(upper_pod())
    mirroring.below(lower_pod(phase="Running"))
    mirroring.upper.answer("PUT", UPPER_STATUS_PATH, status_error(409, "Conflict", "changed"))
    await mirroring.controller.reconcile("shop/web")  # no error: the newer pod comes back
    assert len(mirroring.upper_statuses()) == 1


def count_syncs(mirroring: Mirroring, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The upper resourceVersion of each pod the controller hands its backend to sync."""
    backend = mirroring.controller.backend
    synced: list[str] = []
    sync = backend.sync

    async def counted(upper: Mapping[str, Any]) -> SyncResult:
        synced.append(upper["metadata"]["resourceVersion"])
        return await sync(upper)

    monkeypatch.setattr(backend, "sync", counted)
    return synced


def with_version(pod: dict[str, Any], version: str, **fields: Any) -> dict[str, Any]:
    return {**pod, **fields, "metadata": {**pod["metadata"], "resourceVersion": version}}


async def test_the_watch_events_of_our_own_writes_sync_nothing_again(
    mirroring: Mirroring, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = count_syncs(mirroring, monkeypatch)
    mirroring.above(upper_pod())
    created = lower_pod(phase="Pending")
    mirroring.lower.answer("POST", LOWER_POD_PATH, created)
    await mirroring.controller.reconcile("shop/web")
    mirroring.below(created)  # our create's own event
    await mirroring.controller.reconcile("shop/web")
    assert synced == ["7"]

    running = with_version(lower_pod(phase="Running", podIP="10.241.0.7"), "4")
    mirroring.below(running, "MODIFIED")
    mirroring.upper.answer(
        "PUT", UPPER_STATUS_PATH, with_version(upper_pod(), "8", status={"phase": "Running"})
    )
    await mirroring.controller.reconcile("shop/web")
    (status,) = mirroring.upper_statuses()
    mirroring.above(with_version(upper_pod(), "8", status=status), "MODIFIED")  # our status
    await mirroring.controller.reconcile("shop/web")
    assert synced == ["7", "7"]

    relabelled = with_version(upper_pod(), "9", status=status)
    relabelled["metadata"]["labels"] = {"app": "web", "tier": "front"}
    mirroring.above(relabelled, "MODIFIED")  # someone else's change above
    mirroring.lower.answer("PATCH", f"{LOWER_POD_PATH}/web", with_version(running, "5"))
    await mirroring.controller.reconcile("shop/web")
    assert synced == ["7", "7", "9"]
    assert mirroring.lower.writes("PATCH") == [("PATCH", f"{LOWER_POD_PATH}/web")]
    assert len(mirroring.upper_statuses()) == 1


async def test_a_resync_or_a_lost_status_race_syncs_the_pod_again(
    mirroring: Mirroring, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = count_syncs(mirroring, monkeypatch)
    mirroring.above(upper_pod())
    mirroring.below(lower_pod(phase="Running"))
    mirroring.upper.answer(
        "PUT",
        UPPER_STATUS_PATH,
        status_error(409, "Conflict", "changed"),
        with_version(upper_pod(), "8"),
    )
    await mirroring.controller.reconcile("shop/web")
    await mirroring.controller.reconcile("shop/web")  # the race lost: not in step
    assert synced == ["7", "7"] and len(mirroring.upper_statuses()) == 2
    (_, status) = mirroring.upper_statuses()
    mirroring.above(with_version(upper_pod(), "8", status=status), "MODIFIED")  # our status
    await mirroring.controller.reconcile("shop/web")
    assert synced == ["7", "7"]
    mirroring.controller.resync()
    await mirroring.controller.reconcile(await mirroring.controller.queue.get())
    assert synced == ["7", "7", "8"]


@pytest.mark.parametrize(
    ("refusal", "reason"),
    [
        (
            status_error(422, "Invalid", "spec.containers[0].image: Required value"),
            "LowerClusterRejected",
        ),
        (status_error(400, "BadRequest", "cannot decode"), "LowerClusterRejected"),
    ],
)
async def test_a_pod_the_lower_apiserver_calls_invalid_fails_above(
    mirroring: Mirroring, refusal: ApiError, reason: str
) -> None:
    mirroring.above(upper_pod())
    mirroring.lower.answer("POST", LOWER_POD_PATH, refusal)
    await mirroring.controller.reconcile("shop/web")
    (status,) = mirroring.upper_statuses()
    assert (status["phase"], status["reason"]) == ("Failed", reason)
    assert refusal.message in status["message"]
    assert mirroring.upper_event_reasons() == [reason]


async def test_a_pod_no_node_of_this_cluster_may_take_fails_without_a_lower_write(
    mirroring: Mirroring,
) -> None:
    mirroring.above(upper_pod(nodeSelector={keys.CLUSTER_ID_LABEL: "lower-2"}))
    await mirroring.controller.reconcile("shop/web")
    (status,) = mirroring.upper_statuses()
    assert (status["phase"], status["reason"]) == ("Failed", "TranslationFailed")
    assert mirroring.lower.writes() == []


async def test_a_running_pod_no_longer_translated_runs_on_and_is_not_failed(
    mirroring: Mirroring,
) -> None:
    """Its stash annotation edited into one that cannot be read: failed above, it would run
    on below beside the replacement its controller makes."""
    pod = upper_pod()
    pod["metadata"]["annotations"] = {keys.STASH_ANNOTATION: '{"version": 1, "originals": 7}'}
    mirroring.above(pod)
    mirroring.below(lower_pod(phase="Running", podIP="10.241.0.7"))
    await mirroring.controller.reconcile("shop/web")
    (status,) = mirroring.upper_statuses()
    assert (status["phase"], status.get("podIP")) == ("Running", "10.241.0.7")
    assert mirroring.lower.writes() == []


def in_namespace(pod: dict[str, Any], namespace: str) -> dict[str, Any]:
    pod["metadata"]["namespace"] = namespace
    if "annotations" in pod["metadata"]:
        pod["metadata"]["annotations"][keys.UPPER_NAMESPACE_ANNOTATION] = namespace
    return pod


async def test_a_pod_of_kube_system_fails_without_a_lower_write(mirroring: Mirroring) -> None:
    """Made in the lower cluster's kube-system, with the Secrets it names: a Secret of
    type bootstrap token there is a credential to join the lower cluster."""
    mirroring.above(in_namespace(upper_pod(), "kube-system"))
    await mirroring.controller.reconcile("kube-system/web")
    (status,) = [
        r.body["status"] for r in mirroring.upper.requests if r.path.endswith("/web/status")
    ]
    assert (status["phase"], status["reason"]) == ("Failed", "LowerNamespaceRefused")
    assert mirroring.lower.writes() == []


async def test_a_pod_bound_outside_its_namespace_s_slices_fails_without_a_lower_write() -> None:
    """Bound by its own spec.nodeName, past the extender: made, it would run outside its
    namespace's quota, on room this cluster promised other namespaces."""
    mirroring = mirroring_with(outside_slices={"shop": "no slices here"}.get)
    mirroring.above(upper_pod())
    await mirroring.controller.reconcile("shop/web")
    (status,) = mirroring.upper_statuses()
    assert (status["phase"], status["reason"]) == ("Failed", "OutsideQuotaSlices")
    assert status["message"].endswith("no slices here")
    assert mirroring.lower.writes() == []


async def test_a_pod_the_scheduler_bound_is_not_judged_against_our_slice_records() -> None:
    """Its extender judged it, on records that may be newer than ours (a quota just
    removed above, slices just placed here)."""
    mirroring = mirroring_with(outside_slices={"shop": "no slices here"}.get)
    pod = upper_pod()
    pod["status"] = {"conditions": [{"type": "PodScheduled", "status": "True"}]}
    mirroring.above(pod)
    await mirroring.controller.reconcile("shop/web")
    assert ("POST", "/api/v1/namespaces/shop/pods") in mirroring.lower.writes()


async def test_a_pod_refused_below_for_now_is_judged_against_the_slice_records_again() -> None:
    """Refused below once (its slice quota full), it has our PodScheduled False: its
    slices moved away since, it would run outside them."""
    mirroring = mirroring_with(outside_slices={"shop": "no slices here"}.get)
    pod = upper_pod()
    refused = {"type": "PodScheduled", "status": "False", "reason": "LowerClusterRefused"}
    pod["status"] = {"conditions": [refused]}
    mirroring.above(pod)
    await mirroring.controller.reconcile("shop/web")
    (status,) = mirroring.upper_statuses()
    assert (status["phase"], status["reason"]) == ("Failed", "OutsideQuotaSlices")
    assert mirroring.lower.writes() == []


async def test_a_pod_outside_its_slices_already_made_below_is_not_failed() -> None:
    """Our create's answer lost and the cache behind: failed above for good, its copy
    below would then be removed."""
    mirroring = mirroring_with(outside_slices={"shop": "no slices here"}.get)
    mirroring.above(upper_pod())
    mirroring.lower.answer("GET", "/api/v1/namespaces/shop/pods/web", lower_pod())
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper_statuses() == []
    assert mirroring.lower.writes() == []


async def test_a_pod_made_below_before_its_slices_moved_away_runs_on() -> None:
    mirroring = mirroring_with(outside_slices={"shop": "no slices here"}.get)
    mirroring.above(upper_pod())
    mirroring.below(lower_pod(phase="Running", podIP="10.241.0.7"))
    await mirroring.controller.reconcile("shop/web")
    (status,) = mirroring.upper_statuses()
    assert (status["phase"], status.get("podIP")) == ("Running", "10.241.0.7")
    assert mirroring.lower.writes() == []


async def test_a_pod_whose_ephemeral_volume_asks_for_one_made_by_hand_fails_unmade(
    mirroring: Mirroring,
) -> None:
    """Below, the lower ephemeral volume controller would make its claim from the template,
    and it would bind whichever lower volume matched: another tenant's data."""
    template = {"spec": {"storageClassName": "", "accessModes": ["ReadWriteOnce"]}}
    mirroring.above(
        upper_pod(volumes=[{"name": "data", "ephemeral": {"volumeClaimTemplate": template}}])
    )
    await mirroring.controller.reconcile("shop/web")
    (status,) = mirroring.upper_statuses()
    assert (status["phase"], status["reason"]) == ("Failed", "VolumeRefused")
    assert status["message"].startswith("ephemeral volume data asks for a volume made by hand")
    assert mirroring.lower.writes() == []


async def test_a_pod_of_kube_system_mirrored_before_runs_on_and_goes_with_its_upper_pod(
    mirroring: Mirroring,
) -> None:
    """Mirrored by an earlier version: failed above, it would run on below beside the
    replacement its controller makes."""
    mirroring.above(in_namespace(upper_pod(), "kube-system"))
    mirroring.below(in_namespace(lower_pod(phase="Running", podIP="10.241.0.7"), "kube-system"))
    await mirroring.controller.reconcile("kube-system/web")
    statuses = [
        r.body["status"] for r in mirroring.upper.requests if r.path.endswith("/web/status")
    ]
    assert [(s["phase"], s.get("podIP")) for s in statuses] == [("Running", "10.241.0.7")]
    assert mirroring.lower.writes() == []
    mirroring.above(in_namespace(upper_pod(), "kube-system"), "DELETED")
    await mirroring.controller.reconcile("kube-system/web")
    assert mirroring.lower.writes() == [("DELETE", "/api/v1/namespaces/kube-system/pods/web")]


async def test_a_name_taken_below_by_someone_else_fails_the_pod_and_spares_theirs(
    mirroring: Mirroring,
) -> None:
    mirroring.above(upper_pod())
    mirroring.below(lower_pod(ours=False, phase="Running"))
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper_statuses()[0]["reason"] == "NameConflict"
    assert mirroring.lower.writes() == []


async def test_an_admission_refusal_is_an_event_and_a_retry(mirroring: Mirroring) -> None:
    mirroring.above(upper_pod())
    mirroring.lower.answer(
        "POST", LOWER_POD_PATH, status_error(403, "Forbidden", 'exceeded quota: "compute"')
    )
    with pytest.raises(RetryLater, match="exceeded quota"):
        await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper_event_reasons() == ["LowerClusterRefused"]
    # Nothing failed: the pod waits, saying why where `kubectl describe` and the
    # descheduler look.
    (status,) = mirroring.upper_statuses()
    assert status.get("phase") != "Failed"
    scheduled = mirroring.pod_scheduled()
    assert (scheduled["status"], scheduled["reason"]) == ("False", "LowerClusterRefused")
    assert scheduled["message"].startswith("lower cluster lower-1 refused the pod: ")
    assert 'exceeded quota: "compute"' in scheduled["message"]


@pytest.mark.parametrize("path", ["/api/v1/namespaces", "/api/v1/namespaces/shop/serviceaccounts"])
async def test_a_namespace_or_account_refused_below_makes_the_pod_wait_and_say_why(
    mirroring: Mirroring, path: str
) -> None:
    """A policy below on Namespaces or ServiceAccounts: the pod says why it waits, as
    for its other objects, rather than wait unexplained."""
    mirroring.above(upper_pod())
    mirroring.lower.answer("POST", path, status_error(403, "Forbidden", "labels required"))
    with pytest.raises(RetryLater, match="labels required"):
        await mirroring.controller.reconcile("shop/web")
    assert ("POST", LOWER_POD_PATH) not in mirroring.lower.writes()
    assert mirroring.upper_event_reasons() == ["LowerClusterRefused"]
    scheduled = mirroring.pod_scheduled()
    assert (scheduled["status"], scheduled["reason"]) == ("False", "LowerClusterRefused")


class TakenBelow:
    """Dependencies whose ServiceAccount has a namesake below that is not ours."""

    async def ensure_for_pod(self, pod: Mapping[str, Any]) -> None:
        raise NameTaken("serviceaccounts shop/builder exists in the lower cluster ...")


async def test_a_pod_whose_objects_names_are_taken_below_waits_and_says_why(
    mirroring: Mirroring,
) -> None:
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    backend.dependencies = TakenBelow()
    mirroring.above(upper_pod(serviceAccountName="builder"))
    with pytest.raises(RetryLater, match="serviceaccounts shop/builder"):
        await mirroring.controller.reconcile("shop/web")
    assert ("POST", LOWER_POD_PATH) not in mirroring.lower.writes()
    assert mirroring.upper_event_reasons() == ["LowerNameTaken"]
    scheduled = mirroring.pod_scheduled()
    assert (scheduled["status"], scheduled["reason"]) == ("False", "LowerNameTaken")


async def test_a_debug_container_naming_a_secret_taken_below_is_not_added(
    mirroring: Mirroring,
) -> None:
    """`kubectl debug` with a Secret the upper namespace lacks and the lower one has
    (the lower cluster's, another tenant's): the container would read theirs."""
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    backend.dependencies = TakenBelow()
    pod = upper_pod()
    secret_env = {"name": "P", "valueFrom": {"secretKeyRef": {"name": "db", "key": "p"}}}
    pod["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "b", "env": [secret_env]}]
    mirroring.above(pod)
    mirroring.below(lower_pod(phase="Running"))
    with pytest.raises(RetryLater):
        await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.writes() == []
    assert mirroring.upper_event_reasons() == ["LowerUpdateRefused"]
    assert mirroring.upper_statuses()[0]["phase"] == "Running"


@pytest.mark.parametrize(
    "error",
    [
        status_error(403, "Forbidden", "exceeded quota"),
        # A webhook denying with no code of its own; until 2026-11-29 raised, and the
        # pod's status, its end included, no longer mirrored while the container waited.
        status_error(400, "BadRequest", 'admission webhook "labels" denied the request'),
        status_error(500, "InternalError", "etcdserver: request timed out"),
    ],
)
async def test_a_debug_container_whose_copies_are_refused_holds_back_no_status(
    mirroring: Mirroring, error: ApiError
) -> None:
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    backend.dependencies = FailingCopies(error)
    pod = upper_pod()
    pod["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox"}]
    mirroring.above(pod)
    mirroring.below(lower_pod(phase="Running"))
    with pytest.raises(RetryLater, match=error.message[:12]):
        await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.writes() == []
    assert mirroring.upper_statuses()[0]["phase"] == "Running"


class FailingCopies:
    """Dependencies whose copies the lower apiserver refuses with ``errors``, in turn."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)

    async def ensure_for_pod(self, pod: Mapping[str, Any]) -> None:
        if self.errors:
            raise self.errors.pop(0)


async def test_copies_refused_for_the_quota_make_the_pod_wait_and_say_why(
    mirroring: Mirroring,
) -> None:
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    backend.dependencies = FailingCopies(
        status_error(403, "Forbidden", 'exceeded quota: "objects", requested: count/secrets=1')
    )
    mirroring.above(upper_pod())
    with pytest.raises(RetryLater, match="count/secrets"):
        await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper_event_reasons() == ["LowerClusterRefused"]
    assert ("POST", LOWER_POD_PATH) not in mirroring.lower.writes()


@pytest.mark.parametrize("path", ["/api/v1/namespaces", "/api/v1/namespaces/shop/serviceaccounts"])
async def test_a_namespace_or_account_a_webhook_denies_makes_the_pod_wait_and_say_why(
    mirroring: Mirroring, path: str
) -> None:
    """A webhook denying with no code of its own answers 400: until 2026-11-29 the pod
    was tried again for good, Pending with no word."""
    denied = 'admission webhook "labels" denied the request: team label required'
    mirroring.lower.answer("POST", path, status_error(400, "BadRequest", denied))
    mirroring.above(upper_pod())
    with pytest.raises(RetryLater, match="team label required"):
        await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper_event_reasons() == ["LowerClusterRefused"]
    (status,) = mirroring.upper_statuses()
    (scheduled,) = [c for c in status["conditions"] if c["type"] == "PodScheduled"]
    assert (scheduled["status"], scheduled["reason"]) == ("False", "LowerClusterRefused")
    assert ("POST", LOWER_POD_PATH) not in mirroring.lower.writes()


async def test_copies_refused_for_a_namespace_gone_below_make_it_again(
    mirroring: Mirroring,
) -> None:
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    gone = status_error(404, "NotFound", 'namespaces "shop" not found', kind="namespaces")
    backend.dependencies = FailingCopies(gone)
    mirroring.above(upper_pod())
    with pytest.raises(ApiError):
        await mirroring.controller.reconcile("shop/web")
    mirroring.lower.answer("POST", LOWER_POD_PATH, lower_pod(phase="Pending"))
    await mirroring.controller.reconcile("shop/web")
    made = [path for method, path in mirroring.lower.writes() if path == "/api/v1/namespaces"]
    assert len(made) == 2, "made again after the copies found it gone"


@pytest.mark.parametrize("controlled", [True, False])
async def test_a_lower_pod_deleted_behind_our_back(mirroring: Mirroring, controlled: bool) -> None:
    """A controlled pod goes so its owner replaces it; a bare one is marked Failed."""
    pod = upper_pod(controlled=controlled)
    pod["status"] = {"phase": "Running", "hostIP": HOST_IP}
    mirroring.above(pod)
    await mirroring.controller.reconcile("shop/web")
    assert ("GET", f"{LOWER_POD_PATH}/web") in [
        (r.method, r.path) for r in mirroring.lower.requests
    ]
    assert mirroring.upper_event_reasons() == ["LowerPodDeleted"]
    if controlled:
        assert mirroring.upper.writes("DELETE") == [("DELETE", "/api/v1/namespaces/shop/pods/web")]
        assert mirroring.upper_statuses() == []
    else:
        assert mirroring.upper.writes("DELETE") == []
        (failed,) = mirroring.upper_statuses()
        assert (failed["phase"], failed["reason"]) == ("Failed", "LowerPodDeleted")


async def test_a_pod_failed_after_its_lower_copy_went_is_not_ready(mirroring: Mirroring) -> None:
    """As a kubelet leaves a pod it fails: its containers ended, Ready and ContainersReady
    False (a PodDisruptionBudget counted it healthy, `kubectl wait` saw it ready)."""
    pod = upper_pod()
    ready = [
        {"type": kind, "status": "True", "lastTransitionTime": "2026-11-25T08:00:00Z"}
        for kind in ("Ready", "ContainersReady")
    ]
    pod["status"] = {
        "phase": "Running",
        "hostIP": HOST_IP,
        "conditions": ready,
        "containerStatuses": [RUNNING_CONTAINER],
    }
    mirroring.above(pod)
    await mirroring.controller.reconcile("shop/web")
    (failed,) = mirroring.upper_statuses()
    assert failed["phase"] == "Failed"
    assert [(c["type"], c["status"]) for c in failed["conditions"]] == [
        ("Ready", "False"),
        ("ContainersReady", "False"),
    ]
    (container,) = failed["containerStatuses"]
    assert "terminated" in container["state"] and not container["ready"]


@pytest.mark.parametrize("controlled", [True, False])
async def test_a_lower_pod_terminating_behind_our_back(
    mirroring: Mirroring, controlled: bool
) -> None:
    """Evicted below (a drain, the taint manager of a lower node gone away): a controlled
    pod is Terminating above at once with the same grace, so its owner replaces it now,
    not when the lower pod is gone (maybe never); a bare one shows its status as it ends."""
    pod = upper_pod(controlled=controlled)
    pod["status"] = {"phase": "Running", "hostIP": HOST_IP}
    mirroring.above(pod)
    ending = lower_pod(phase="Running", hostIP="192.168.1.5")
    ending["metadata"] |= {
        "deletionTimestamp": "2026-11-25T08:00:00Z",
        "deletionGracePeriodSeconds": 30,
    }
    mirroring.below(ending)
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.writes() == []
    if controlled:
        assert mirroring.upper_event_reasons() == ["LowerPodDeleted"]
        (delete,) = [r for r in mirroring.upper.requests if r.method == "DELETE"]
        assert delete.path == "/api/v1/namespaces/shop/pods/web"
        assert delete.body["gracePeriodSeconds"] == 30
        assert delete.body["preconditions"] == {"uid": "upper-pod-uid"}
    else:
        assert mirroring.upper.writes("DELETE") == []
        (status,) = mirroring.upper_statuses()
        assert status["phase"] == "Running"


def exited(code: int, at: str) -> dict[str, Any]:
    return {"name": "app", "state": {"terminated": {"exitCode": code, "finishedAt": at}}}


def deleted_below(pod: dict[str, Any], at: str, grace: int) -> dict[str, Any]:
    pod["metadata"] |= {"deletionTimestamp": at, "deletionGracePeriodSeconds": grace}
    return pod


def test_a_pod_ended_by_its_deletion_is_told_from_one_cleaned_up_after_it_finished() -> None:
    assert not ended_by_its_deletion(lower_pod(phase="Succeeded"))
    running = deleted_below(lower_pod(phase="Running"), "2026-11-29T10:00:30Z", 30)
    assert ended_by_its_deletion(running)
    # A kubelet's terminal phase for a deleted pod: its containers ended after the
    # deletion began (10:00:00, its grace before the deletion's time).
    stopped = lower_pod(phase="Succeeded", containerStatuses=[exited(0, "2026-11-29T10:00:02Z")])
    assert ended_by_its_deletion(deleted_below(stopped, "2026-11-29T10:00:30Z", 30))
    # Finished an hour before, removed by the lower pod GC (grace 0).
    done = lower_pod(phase="Succeeded", containerStatuses=[exited(0, "2026-11-29T09:00:00Z")])
    assert not ended_by_its_deletion(deleted_below(done, "2026-11-29T10:00:00Z", 0))
    # Stopped before it started: terminated with no time (ContainerStatusUnknown).
    unknown = {"name": "app", "state": {"terminated": {"exitCode": 137}}}
    never = lower_pod(phase="Failed", containerStatuses=[unknown])
    assert ended_by_its_deletion(deleted_below(never, "2026-11-29T10:00:30Z", 30))
    # Ended a second before the deletion began, by the kubelet's clock: taken for ended by it.
    close = lower_pod(phase="Succeeded", containerStatuses=[exited(0, "2026-11-29T09:59:59Z")])
    assert ended_by_its_deletion(deleted_below(close, "2026-11-29T10:00:30Z", 30))


async def test_a_finished_pod_cleaned_up_below_stays_as_it_ended(mirroring: Mirroring) -> None:
    """A Job's pod that Succeeded, its lower copy removed by the lower pod GC (or an
    admin clearing Completed pods): it was deleted above with a LowerPodDeleted warning,
    and its logs and history went with it."""
    pod = upper_pod(controlled=True)
    pod["status"] = {"phase": "Running", "hostIP": HOST_IP}
    mirroring.above(pod)
    done = lower_pod(phase="Succeeded", containerStatuses=[exited(0, "2026-11-29T09:00:00Z")])
    mirroring.below(deleted_below(done, "2026-11-29T10:00:00Z", 0))
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper.writes("DELETE") == [] and mirroring.upper_event_reasons() == []
    assert [status["phase"] for status in mirroring.upper_statuses()] == ["Succeeded"]


async def test_a_bare_pod_ended_by_its_deletion_below_fails_whatever_its_exit_codes(
    mirroring: Mirroring,
) -> None:
    """Drained, evicted or preempted below, its containers exiting 0 on SIGTERM: the lower
    kubelet writes Succeeded, which came up as a run to its end, with no word."""
    pod = upper_pod()
    pod["status"] = {"phase": "Running", "hostIP": HOST_IP}
    mirroring.above(pod)
    stopped = lower_pod(phase="Succeeded", containerStatuses=[exited(0, "2026-11-29T10:00:02Z")])
    mirroring.below(deleted_below(stopped, "2026-11-29T10:00:30Z", 30))
    await mirroring.controller.reconcile("shop/web")
    (failed,) = mirroring.upper_statuses()
    assert (failed["phase"], failed["reason"]) == ("Failed", "LowerPodDeleted")
    assert failed["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert mirroring.upper_event_reasons() == ["LowerPodDeleted"]
    # Removed with its last status before a reconcile saw it ending: the same, over the
    # exit codes that status holds (until 2026-11-29 every container's was 137, unknown).
    removed = mirroring_with()
    removed.above(pod)
    removed.below(lower_pod(phase="Running"))
    killed = lower_pod(phase="Failed", containerStatuses=[exited(3, "2026-11-29T10:00:02Z")])
    removed.below(deleted_below(killed, "2026-11-29T10:00:30Z", 30), "DELETED")
    removed.lower.answer("GET", f"{LOWER_POD_PATH}/web", not_found("pods", "web"))
    await removed.controller.reconcile("shop/web")
    (failed,) = removed.upper_statuses()
    assert (failed["phase"], failed["reason"]) == ("Failed", "LowerPodDeleted")
    assert failed["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3


async def test_a_pod_with_a_stash_the_webhook_does_not_guard_waits_unmade() -> None:
    """Not failed for good: the namespace's labels may not have been seen yet (made just
    before its pod), and a bare pod failed is lost."""
    why = "namespace shop not seen yet"
    mirroring = mirroring_with(stash_unguarded=lambda _pod: why)
    pod = upper_pod()
    forged = stash_scheduling({"nodeSelector": {"pool": "team-b"}}, {})[1]
    pod["metadata"]["annotations"] = {**(pod["metadata"].get("annotations") or {}), **forged}
    mirroring.above(pod)
    with pytest.raises(RetryLater, match="the webhook does not guard this pod"):
        await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.writes() == []
    scheduled = mirroring.pod_scheduled()
    assert (scheduled["status"], scheduled["reason"]) == ("False", "StashNotGuarded")
    assert why in scheduled["message"]


async def test_a_lower_pod_finished_then_removed_below_ends_as_it_ended(
    mirroring: Mirroring,
) -> None:
    """Removed below (a TTL, the pod GC) right after it finished: its last status, which
    the removal carries, is the pod's end above, not a loss."""
    pod = upper_pod(controlled=True)
    pod["status"] = {"phase": "Running", "hostIP": HOST_IP}
    mirroring.above(pod)
    mirroring.below(lower_pod(phase="Running"))
    mirroring.below(lower_pod(phase="Succeeded"), "DELETED")
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", not_found("pods", "web"))
    await mirroring.controller.reconcile("shop/web")
    assert [status["phase"] for status in mirroring.upper_statuses()] == ["Succeeded"]
    assert mirroring.upper.writes("DELETE") == [] and mirroring.upper_event_reasons() == []


@pytest.mark.parametrize(
    "failure",
    [
        status_error(409, "Conflict", "the upper pod changed meanwhile"),
        status_error(503, "ServiceUnavailable", "the upper apiserver is restarting"),
        "lower",
    ],
    ids=["status-conflict-above", "status-refused-above", "lower-read-failed"],
)
async def test_a_pod_finished_then_removed_below_ends_so_after_a_failed_try(
    mirroring: Mirroring, failure: ApiError | str
) -> None:
    """The removal's last status is read, not taken: the first try's status write may
    fail (or its read of the lower pod), and the next must still find it. Taken, the
    next try found the pod gone and deleted it above as lost: a Job counted a failure
    and ran again what had succeeded."""
    pod = upper_pod(controlled=True)
    pod["status"] = {"phase": "Running", "hostIP": HOST_IP}
    mirroring.above(pod)
    mirroring.below(lower_pod(phase="Running"))
    mirroring.below(lower_pod(phase="Succeeded"), "DELETED")
    if failure == "lower":
        down = status_error(503, "ServiceUnavailable", "the lower apiserver is restarting")
        mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", down)
    else:
        assert isinstance(failure, ApiError)
        mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", not_found("pods", "web"))
        mirroring.upper.answer("PUT", UPPER_STATUS_PATH, failure)
    with contextlib.suppress(ApiError):
        await mirroring.controller.reconcile("shop/web")
    # The next try: the watch's event of the change that won, or the queue's retry.
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", not_found("pods", "web"))
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper_statuses()[-1]["phase"] == "Succeeded"
    assert mirroring.upper.writes("DELETE") == [] and mirroring.upper_event_reasons() == []


async def test_a_pod_finished_and_removed_below_while_the_cluster_was_unreachable_ends_so(
    mirroring: Mirroring,
) -> None:
    """The removal's last status is kept while the lower cluster is out of reach, for the
    reconcile once it is back: dropped, the pod was taken for deleted behind our back."""
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    pod = upper_pod(controlled=True)
    pod["status"] = {"phase": "Running", "hostIP": HOST_IP}
    mirroring.above(pod)
    mirroring.below(lower_pod(phase="Running"))
    mirroring.below(lower_pod(phase="Succeeded"), "DELETED")
    down = ConnectionRefusedError("lower apiserver down")
    mirroring.lower.answer("GET", "/readyz", *[down] * lower_module.PING_ATTEMPTS)
    assert await backend.ping() is False
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper.requests == []
    mirroring.lower.answer("GET", "/version", {"gitVersion": "v1.35.4"})
    assert await backend.ping() is True
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", not_found("pods", "web"))
    await mirroring.controller.reconcile("shop/web")
    assert [status["phase"] for status in mirroring.upper_statuses()] == ["Succeeded"]
    assert mirroring.upper.writes("DELETE") == []


@pytest.mark.parametrize("phase", ["Running", "Succeeded"])
async def test_a_pod_removed_below_before_its_status_came_up_is_not_made_again(
    mirroring: Mirroring, phase: str
) -> None:
    """The upper pod's status does not say yet that it ran (our status write lost a race,
    the upper apiserver was down), but the lower pod removed was ours and a node had
    taken it: made again, it ran twice (a Job's pod, a restartPolicy Never pod)."""
    pod = upper_pod(controlled=True)
    pod["status"] = {"phase": "Pending"}
    mirroring.above(pod)
    mirroring.below(lower_pod(phase="Running", hostIP="192.168.1.5"))
    mirroring.below(lower_pod(phase=phase, hostIP="192.168.1.5"), "DELETED")
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", not_found("pods", "web"))
    await mirroring.controller.reconcile("shop/web")
    assert ("POST", LOWER_POD_PATH) not in mirroring.lower.writes("POST"), "not made again"
    if phase == "Succeeded":
        assert [status["phase"] for status in mirroring.upper_statuses()] == ["Succeeded"]
    else:
        assert mirroring.upper_event_reasons() == ["LowerPodDeleted"]


async def test_a_pod_removed_below_before_a_node_took_it_is_made_again(
    mirroring: Mirroring,
) -> None:
    pod = upper_pod(controlled=True)
    pod["status"] = {"phase": "Pending"}
    mirroring.above(pod)
    mirroring.below(lower_pod(phase="Pending"))
    mirroring.below(lower_pod(phase="Pending"), "DELETED")
    await mirroring.controller.reconcile("shop/web")
    assert ("POST", LOWER_POD_PATH) in mirroring.lower.writes("POST")


async def test_a_finished_pod_is_never_run_again(mirroring: Mirroring) -> None:
    pod = upper_pod()
    pod["status"] = {"phase": "Succeeded", "hostIP": HOST_IP}
    mirroring.above(pod)
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.requests == [] and mirroring.upper.requests == []


def deleting(grace: int, **status: Any) -> dict[str, Any]:
    pod = upper_pod()
    pod["metadata"] |= {
        "deletionTimestamp": "2026-11-25T08:00:00Z",
        "deletionGracePeriodSeconds": grace,
    }
    pod["status"] = status
    return pod


RUNNING_CONTAINER = {"name": "app", "ready": True, "state": {"running": {}}}


async def test_a_deletion_above_goes_below_first_with_its_grace(mirroring: Mirroring) -> None:
    mirroring.above(deleting(17, phase="Running"))
    mirroring.below(lower_pod(phase="Running"))
    await mirroring.controller.reconcile("shop/web")
    (delete,) = [r for r in mirroring.lower.requests if r.method == "DELETE"]
    assert delete.path == f"{LOWER_POD_PATH}/web"
    assert delete.body["gracePeriodSeconds"] == 17
    assert delete.body["preconditions"] == {"uid": "lower-pod-uid"}
    assert mirroring.upper.writes() == [], "the upper pod stays until the lower one is gone"
    mirroring.below(lower_pod(phase="Running"), "DELETED")
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", not_found("pods", "web"))
    await mirroring.controller.reconcile("shop/web")
    (upper_delete,) = [r for r in mirroring.upper.requests if r.method == "DELETE"]
    assert upper_delete.body["gracePeriodSeconds"] == 0
    assert upper_delete.body["preconditions"] == {"uid": "upper-pod-uid"}


async def test_a_shorter_grace_or_a_force_delete_above_shortens_the_one_below(
    mirroring: Mirroring,
) -> None:
    ending = lower_pod(phase="Running")
    ending["metadata"] |= {
        "deletionTimestamp": "2026-11-25T09:00:00Z",
        "deletionGracePeriodSeconds": 3600,
    }
    mirroring.above(deleting(5, phase="Running"))
    mirroring.below(ending)
    await mirroring.controller.reconcile("shop/web")
    (delete,) = [r for r in mirroring.lower.requests if r.method == "DELETE"]
    assert delete.body["gracePeriodSeconds"] == 5
    mirroring.lower.requests.clear()
    # Forced above: the upper pod is gone at once, and the lower one goes with grace 0.
    mirroring.above(deleting(0, phase="Running"), "DELETED")
    await mirroring.controller.reconcile("shop/web")
    (forced,) = [r for r in mirroring.lower.requests if r.method == "DELETE"]
    assert forced.body["gracePeriodSeconds"] == 0


async def test_a_force_delete_before_the_lower_cache_shows_our_create_still_has_grace_0(
    mirroring: Mirroring,
) -> None:
    """Found only by a later sweep, the lower pod was given its own grace (30 s) where a
    force delete promises none."""
    mirroring.above(upper_pod())
    mirroring.above(deleting(0, phase="Pending"), "DELETED")
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", lower_pod(phase="Running"))
    await mirroring.controller.reconcile("shop/web")
    (forced,) = [r for r in mirroring.lower.requests if r.method == "DELETE"]
    assert forced.body["gracePeriodSeconds"] == 0


async def test_an_upper_pod_gone_after_its_lower_pod_asks_nothing_below(
    mirroring: Mirroring,
) -> None:
    """The usual end: the lower pod's removal was seen, so it is not looked for."""
    mirroring.above(deleting(30, phase="Running"))
    mirroring.below(lower_pod(phase="Running"))
    mirroring.below(lower_pod(phase="Running"), "DELETED")
    mirroring.above(deleting(0, phase="Succeeded"), "DELETED")
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.requests == []


async def test_a_deleted_pod_shows_its_containers_end_then_a_terminal_phase_before_it_goes(
    mirroring: Mirroring,
) -> None:
    """As a kubelet: the Job controller lets a pod go only once its phase is terminal."""
    mirroring.above(deleting(30, phase="Running", containerStatuses=[RUNNING_CONTAINER]))
    ended = {
        "name": "app",
        "ready": False,
        "state": {"terminated": {"exitCode": 143, "reason": "Error"}},
    }
    mirroring.below(lower_pod(phase="Running", containerStatuses=[ended]))
    await mirroring.controller.reconcile("shop/web")
    (shutdown,) = mirroring.upper_statuses()
    assert shutdown["containerStatuses"] == [ended], "the exit code comes up as it happens"
    mirroring.above(deleting(30, **shutdown), "MODIFIED")
    mirroring.below(lower_pod(phase="Running", containerStatuses=[ended]), "DELETED")
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", not_found("pods", "web"))
    await mirroring.controller.reconcile("shop/web")
    last = mirroring.upper_statuses()[-1]
    assert last["phase"] == "Failed" and last["containerStatuses"] == [ended]
    writes = mirroring.upper.writes()
    assert writes[-2:] == [
        ("PUT", UPPER_STATUS_PATH),
        ("DELETE", "/api/v1/namespaces/shop/pods/web"),
    ], "the terminal phase first, then the pod goes"


def deleted_above_then_removed_below_after_exit_143(mirroring: Mirroring) -> dict[str, Any]:
    """The lower kubelet's last update (exit 143) and the removal come back to back; the
    container status that update carried."""
    mirroring.above(deleting(30, phase="Running", containerStatuses=[RUNNING_CONTAINER]))
    ended = {
        "name": "app",
        "ready": False,
        "state": {"terminated": {"exitCode": 143, "reason": "Error"}},
    }
    mirroring.below(lower_pod(phase="Running"))
    mirroring.below(lower_pod(phase="Failed", containerStatuses=[ended]), "DELETED")
    return ended


async def test_a_lower_pods_last_status_and_removal_seen_at_once_end_it_as_it_ended(
    mirroring: Mirroring,
) -> None:
    """The lower kubelet's last update (exit 143) and the removal come back to back: the
    removal's object carries that update, which ends the upper pod, not an unknown end."""
    ended = deleted_above_then_removed_below_after_exit_143(mirroring)
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", not_found("pods", "web"))
    await mirroring.controller.reconcile("shop/web")
    (last,) = mirroring.upper_statuses()
    assert (last["phase"], last["containerStatuses"]) == ("Failed", [ended])
    assert mirroring.upper.writes("DELETE") == [("DELETE", "/api/v1/namespaces/shop/pods/web")]


async def test_a_lower_pods_last_status_outlives_a_terminal_status_write_that_lost_a_race(
    mirroring: Mirroring,
) -> None:
    """The terminal status from the removal's last status is refused (409: the upper pod
    changed meanwhile): the next reconcile still ends the pod as it ended below."""
    ended = deleted_above_then_removed_below_after_exit_143(mirroring)
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", *[not_found("pods", "web")] * 2)
    mirroring.upper.answer("PUT", UPPER_STATUS_PATH, status_error(409, "Conflict", "changed"))
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper.writes("DELETE") == []
    await mirroring.controller.reconcile("shop/web")
    lost, last = mirroring.upper_statuses()
    assert lost == last and last["containerStatuses"] == [ended]
    assert mirroring.upper.writes("DELETE") == [("DELETE", "/api/v1/namespaces/shop/pods/web")]


async def test_a_pod_whose_lower_copy_went_unseen_ends_failed_with_its_containers_unknown(
    mirroring: Mirroring,
) -> None:
    mirroring.above(deleting(30, phase="Running", containerStatuses=[RUNNING_CONTAINER]))
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", not_found("pods", "web"))
    await mirroring.controller.reconcile("shop/web")
    (last,) = mirroring.upper_statuses()
    assert last["phase"] == "Failed"
    (container,) = last["containerStatuses"]
    terminated = container["state"]["terminated"]
    assert (terminated["reason"], terminated["exitCode"]) == ("ContainerStatusUnknown", 137)
    assert not container["ready"]
    assert mirroring.upper.writes("DELETE") == [("DELETE", "/api/v1/namespaces/shop/pods/web")]


async def test_a_pod_a_finalizer_holds_gets_its_last_status_once(
    mirroring: Mirroring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Job's pod stays until its finalizer goes: its terminal status was made again,
    with new times, and the pod deleted again, at each of its reconciles."""
    mirroring.above(deleting(30, phase="Running", containerStatuses=[RUNNING_CONTAINER]))
    # Removed below while still running (force-deleted there): its last status is known.
    running_below = lower_pod(phase="Running", containerStatuses=[RUNNING_CONTAINER])
    mirroring.below(running_below)
    mirroring.below(running_below, "DELETED")
    mirroring.lower.answer("GET", f"{LOWER_POD_PATH}/web", *[not_found("pods", "web")] * 2)
    await mirroring.controller.reconcile("shop/web")
    (last,) = mirroring.upper_statuses()
    held = deleting(0, **last)
    held["metadata"] |= {"finalizers": ["batch.kubernetes.io/job-tracking"], "resourceVersion": "9"}
    mirroring.above(held, "MODIFIED")
    monkeypatch.setattr(podcontroller, "now_rfc3339", lambda: "2999-01-01T00:00:00Z")
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper_statuses() == [last]
    assert mirroring.upper.writes("DELETE") == [("DELETE", "/api/v1/namespaces/shop/pods/web")]


async def test_an_unreachable_lower_cluster_is_retried_and_changes_nothing_above(
    mirroring: Mirroring,
) -> None:
    mirroring.above(upper_pod())
    mirroring.lower.answer(
        "POST", "/api/v1/namespaces", aiohttp.ServerDisconnectedError("lower apiserver gone")
    )
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await mirroring.controller.reconcile("shop/web")  # the work queue retries it
    assert mirroring.upper.requests == []
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.writes()[-1] == ("POST", LOWER_POD_PATH)


@pytest.mark.parametrize(
    "gone",
    [
        not_found("namespaces", "shop"),
        status_error(
            403,
            "Forbidden",
            "unable to create new content in namespace shop because it is being terminated",
            causes=[{"reason": "NamespaceTerminating", "field": "metadata.namespace"}],
        ),
    ],
)
async def test_a_namespace_deleted_below_is_made_again(
    mirroring: Mirroring, gone: ApiError
) -> None:
    mirroring.above(upper_pod())
    mirroring.lower.answer("POST", LOWER_POD_PATH, gone)
    with pytest.raises((ApiError, RetryLater)):
        await mirroring.controller.reconcile("shop/web")
    mirroring.lower.requests.clear()
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.writes() == [
        ("POST", "/api/v1/namespaces"),
        ("POST", "/api/v1/namespaces/shop/serviceaccounts"),
        ("POST", LOWER_POD_PATH),
    ]


async def test_a_burst_into_a_new_namespace_makes_it_and_its_account_once(
    mirroring: Mirroring, monkeypatch: pytest.MonkeyPatch
) -> None:
    create = mirroring.lower.create

    async def answered_later(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.01)  # as over the network: the other workers run meanwhile
        return await create(*args, **kwargs)

    monkeypatch.setattr(mirroring.lower, "create", answered_later)
    names = [f"web-{index}" for index in range(5)]
    for index, name in enumerate(names):
        pod = upper_pod()
        pod["metadata"] |= {"name": name, "uid": f"uid-{index}"}
        mirroring.above(pod)
    mirroring.lower.answer("POST", "/api/v1/namespaces", status_error(500, "InternalError", "x"))
    with pytest.raises(ApiError):
        await mirroring.controller.reconcile("shop/web-0")
    mirroring.lower.requests.clear()
    await asyncio.gather(*(mirroring.controller.reconcile(f"shop/{name}") for name in names))
    writes = mirroring.lower.writes()
    assert writes.count(("POST", "/api/v1/namespaces")) == 1, (
        "again after the failed attempt, and once"
    )
    assert writes.count(("POST", "/api/v1/namespaces/shop/serviceaccounts")) == 1
    assert writes.count(("POST", LOWER_POD_PATH)) == 5


async def test_a_namespace_known_below_is_not_created_again(mirroring: Mirroring) -> None:
    mirroring.above(upper_pod())
    await mirroring.controller.reconcile("shop/web")
    mirroring.lower.requests.clear()
    mirroring.above(upper_pod(), "DELETED")
    other = upper_pod()
    other["metadata"] |= {"name": "api", "uid": "other-uid"}
    mirroring.above(other)
    await mirroring.controller.reconcile("shop/api")
    assert mirroring.lower.writes() == [("POST", LOWER_POD_PATH)]


async def test_a_pod_using_the_host_is_not_created_below_unless_its_namespace_may() -> None:
    refusing = mirroring_with()
    refusing.above(upper_pod(hostNetwork=True))
    await refusing.controller.reconcile("shop/web")
    (status,) = refusing.upper_statuses()
    assert (status["phase"], status["reason"]) == ("Failed", "HostAccessRefused")
    assert "spec.hostNetwork" in status["message"] and "--allow-host-access" in status["message"]
    assert refusing.upper_event_reasons() == ["HostAccessRefused"]
    assert refusing.lower.writes() == []

    allowing = mirroring_with(frozenset({"shop"}))
    allowing.above(upper_pod(hostNetwork=True))
    await allowing.controller.reconcile("shop/web")
    assert allowing.lower.writes()[-1] == ("POST", LOWER_POD_PATH)


async def test_a_privileged_debug_container_is_not_added_below(mirroring: Mirroring) -> None:
    pod = upper_pod()
    pod["spec"]["ephemeralContainers"] = [
        {"name": "debugger", "image": "busybox", "securityContext": {"privileged": True}}
    ]
    mirroring.above(pod)
    mirroring.below(lower_pod(phase="Running"))
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.lower.writes() == []
    assert mirroring.upper_event_reasons() == ["LowerUpdateRefused"]
    assert mirroring.upper_statuses()[0]["phase"] == "Running"


async def test_a_debug_container_the_lower_cluster_forbids_is_told_once_and_the_status_flows(
    mirroring: Mirroring,
) -> None:
    """Pod Security admission below answers 403 to `kubectl debug`: the pod's status goes
    on being mirrored (a Job would never see its pod finish) and its owner is told."""
    pod = upper_pod()
    pod["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox"}]
    mirroring.above(pod)
    refused = status_error(403, "Forbidden", 'pods "web" is forbidden: violates PodSecurity')
    debug_path = f"{LOWER_POD_PATH}/web/ephemeralcontainers"
    mirroring.lower.answer("PATCH", debug_path, refused, refused)
    mirroring.below(lower_pod(phase="Running"))
    # Refused for good (a debug container asks no room a quota could free later): not
    # tried again on a backoff for the pod's whole life.
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper_event_reasons() == ["LowerUpdateRefused"]
    mirroring.below(lower_pod(phase="Succeeded"), "MODIFIED")
    await mirroring.controller.reconcile("shop/web")
    assert [status["phase"] for status in mirroring.upper_statuses()] == ["Running", "Succeeded"]
    assert mirroring.upper_event_reasons() == ["LowerUpdateRefused"], "told once"


async def test_a_pod_whose_namespace_has_no_name_below_is_let_go_when_deleted() -> None:
    long = "a" * 60
    mirroring = mirroring_with(mapping=NamespaceMapping("prefix", "tenant"))
    pod = deleting(30, phase="Failed")
    pod["metadata"]["namespace"] = long
    mirroring.above(pod)
    await mirroring.controller.reconcile(f"{long}/web")
    assert mirroring.lower.requests == []
    assert mirroring.upper.writes("DELETE") == [("DELETE", f"/api/v1/namespaces/{long}/pods/web")]


@pytest.mark.usefixtures("no_ping_pause")
async def test_a_deletion_while_the_lower_cluster_is_unreachable_changes_nothing_above(
    mirroring: Mirroring,
) -> None:
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    mirroring.above(
        deleting(30, phase="Running", conditions=[{"type": "Ready", "status": "False"}])
    )
    ending = lower_pod(phase="Running", conditions=[{"type": "Ready", "status": "True"}])
    ending["metadata"]["deletionTimestamp"] = "2026-11-25T08:00:00Z"
    mirroring.below(ending)
    down = ConnectionRefusedError("lower apiserver down")
    mirroring.lower.answer("GET", "/readyz", *[down] * lower_module.PING_ATTEMPTS)
    assert await backend.ping() is False
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper.requests == []


@pytest.mark.usefixtures("no_ping_pause")
async def test_a_lower_apiserver_without_its_etcd_is_unreachable(mirroring: Mirroring) -> None:
    """/version answers with etcd down; /readyz does not."""
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    mirroring.lower.answer("GET", "/version", {"gitVersion": "v1.35.4"}, {"gitVersion": "v1.35.4"})
    assert await backend.ping() is True and backend.version == "v1.35.4"
    failed = ApiError(500, "[-]etcd failed: reason withheld")
    mirroring.lower.answer("GET", "/readyz", *[failed] * lower_module.PING_ATTEMPTS)
    assert await backend.ping() is False


@pytest.mark.usefixtures("no_ping_pause")
async def test_a_version_that_is_not_an_object_is_an_unreachable_cluster(
    mirroring: Mirroring,
) -> None:
    """A proxy's answer at /version: the Lease loop had died on reading it."""
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    listed: Any = ["v1.35.4"]
    mirroring.lower.answer("GET", "/version", *[listed] * lower_module.PING_ATTEMPTS)
    assert await backend.ping() is False and not backend.reachable


@pytest.fixture
def no_ping_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lower_module, "PING_PAUSE_SECONDS", 0.0)


@pytest.mark.usefixtures("no_ping_pause")
async def test_a_ping_that_fails_once_leaves_the_lower_cluster_reachable(
    mirroring: Mirroring,
) -> None:
    """One dropped connection, or one of several lower apiservers restarting: the Node
    stays Ready and mirroring goes on (no resync of every pod once back)."""
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    down = ConnectionRefusedError("lower apiserver restarting")
    mirroring.lower.answer("GET", "/readyz", *[down] * (lower_module.PING_ATTEMPTS - 1))
    mirroring.lower.answer("GET", "/version", {"gitVersion": "v1.35.4"})
    assert await backend.ping() is True and backend.reachable
    readyz = [r for r in mirroring.lower.requests if r.path == "/readyz"]
    assert len(readyz) == lower_module.PING_ATTEMPTS


async def test_pings_that_outlast_the_lease_interval_find_the_lower_cluster_unreachable(
    mirroring: Mirroring, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However slowly the tries fail, the Lease is renewed or the Node is marked not
    ready within the renewal interval."""
    monkeypatch.setattr(lower_module, "PING_DEADLINE_SECONDS", 0.05)
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)

    async def hangs(path: str, **_: Any) -> str:
        await asyncio.sleep(60)
        return "ok"

    monkeypatch.setattr(mirroring.lower, "get_text", hangs)
    assert await asyncio.wait_for(backend.ping(), timeout=5) is False
    assert not backend.reachable


@pytest.mark.usefixtures("no_ping_pause")
async def test_a_ping_whose_first_try_hangs_is_answered_by_the_next(
    mirroring: Mirroring, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lower_module, "PING_REQUEST_SECONDS", 0.01)
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    tries = []

    async def hangs_once(path: str, *, timeout: float, **_: Any) -> str:
        tries.append(timeout)
        if len(tries) == 1:
            await asyncio.sleep(timeout)
            raise TimeoutError(path)
        return "ok"

    monkeypatch.setattr(mirroring.lower, "get_text", hangs_once)
    mirroring.lower.answer("GET", "/version", {"gitVersion": "v1.35.4"})
    assert await asyncio.wait_for(backend.ping(), timeout=5) is True
    assert tries == [0.01, 0.01]


@pytest.mark.usefixtures("no_ping_pause")
async def test_an_unreachable_lower_cluster_is_not_mirrored_until_a_resync(
    mirroring: Mirroring,
) -> None:
    """The node controller above marks the pods not ready; stale lower statuses must not
    undo that, and once the lower cluster is back every pod is reconciled again."""
    backend = mirroring.controller.backend
    assert isinstance(backend, LowerCluster)
    not_ready = upper_pod()
    not_ready["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}
    mirroring.above(not_ready)
    mirroring.below(lower_pod(phase="Running", conditions=[{"type": "Ready", "status": "True"}]))
    down = ConnectionRefusedError("lower apiserver down")
    mirroring.lower.answer("GET", "/readyz", *[down] * lower_module.PING_ATTEMPTS)
    assert await backend.ping() is False
    await mirroring.controller.reconcile("shop/web")
    assert mirroring.upper.requests == []
    assert {r.path for r in mirroring.lower.requests} == {"/readyz"}

    mirroring.lower.answer("GET", "/version", {"gitVersion": "v1.35.4"})
    assert await backend.ping() is True
    mirroring.controller.resync()
    assert len(mirroring.controller.queue) == 1
    await mirroring.controller.reconcile(await mirroring.controller.queue.get())
    (status,) = mirroring.upper_statuses()
    assert status["conditions"] == [{"type": "Ready", "status": "True"}]


def resized_above(mirroring: Mirroring) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """An upper pod resized to 300m cpu whose lower pod runs with the 100m it was given:
    the containers asked for above, and the lower pod."""
    sized = [{"name": "app", "image": "nginx", "resources": {"requests": {"cpu": "300m"}}}]
    mirroring.above(upper_pod(containers=sized))
    below = lower_pod(phase="Running")
    below["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "100m"}}
    below["metadata"]["annotations"][keys.UPPER_RESOURCES_ANNOTATION] = (
        '{"app":{"requests":{"cpu":"100m"}}}'
    )
    mirroring.below(below)
    return sized, below


@pytest.mark.parametrize(("answer", "recorded"), [(None, True), (403, False), (422, True)])
async def test_a_resize_is_recorded_once_made_or_refused_for_good(
    mirroring: Mirroring, answer: int | None, recorded: bool
) -> None:
    """Recorded, it is not asked for again on the next sync; a quota's 403 may have room
    later, so it is not recorded and the resize is tried again."""
    sized, below = resized_above(mirroring)
    resize_path = f"{LOWER_POD_PATH}/web/resize"
    made = {**below, "spec": {**below["spec"], "containers": sized}}
    refused = None if answer is None else status_error(answer, "Refused", "no")
    mirroring.lower.answer("PATCH", resize_path, made if refused is None else refused)
    try:
        await mirroring.controller.reconcile("shop/web")
    except RetryLater:
        assert answer == 403
    writes = [path for _, path in mirroring.lower.writes()]
    assert writes[0] == resize_path
    assert (f"{LOWER_POD_PATH}/web" in writes[1:]) is recorded


def resize_pending(mirroring: Mirroring) -> list[tuple[str, str]]:
    return [
        (c["reason"], c["message"])
        for status in mirroring.upper_statuses()
        for c in status.get("conditions") or []
        if c["type"] == "PodResizePending"
    ]


@pytest.mark.parametrize(("answer", "reason"), [(403, "Deferred"), (422, "Infeasible")])
async def test_a_resize_the_lower_apiserver_refuses_is_pending_above(
    mirroring: Mirroring, answer: int, reason: str
) -> None:
    """As a kubelet tells of a resize it cannot make: Deferred for a quota full today,
    Infeasible for one refused for good, as long as the upper pod asks for it. Until
    2026-11-29 the pod said nothing, and the upper scheduler counted the requests asked
    for."""
    sized, below = resized_above(mirroring)
    refusal = status_error(answer, "Refused", "exceeded quota")
    mirroring.lower.answer("PATCH", f"{LOWER_POD_PATH}/web/resize", refusal)
    message = "lower cluster lower-1 refused the pod's resize: exceeded quota"
    # Refused for good: the refusal is recorded with what it refused, and the record
    # keeps what the pod was last given (a later resize compares with that).
    recorded = copy.deepcopy(below)
    refused = {"message": message, "resources": '{"app":{"requests":{"cpu":"300m"}}}'}
    recorded["metadata"]["annotations"][keys.RESIZE_REFUSED_ANNOTATION] = json.dumps(
        refused, separators=(",", ":")
    )
    mirroring.lower.answer("PATCH", f"{LOWER_POD_PATH}/web", recorded)
    with contextlib.suppress(RetryLater):
        await mirroring.controller.reconcile("shop/web")
    assert resize_pending(mirroring) == [(reason, message)]
    record_patches = [r.body for r in mirroring.lower.requests if r.path == f"{LOWER_POD_PATH}/web"]
    if answer == 403:
        assert record_patches == [], "a quota may have room later: nothing recorded"
    else:
        (record_patch,) = record_patches
        annotations = record_patch["metadata"]["annotations"]
        assert keys.UPPER_RESOURCES_ANNOTATION not in annotations
        assert json.loads(annotations[keys.RESIZE_REFUSED_ANNOTATION]) == refused
        # Not asked again, and said while the pod asks for it.
        mirroring.below(recorded, "MODIFIED")
        mirroring.upper.requests.clear()
        mirroring.lower.requests.clear()
        mirroring.above(upper_pod(containers=sized), "MODIFIED")
        await mirroring.controller.reconcile("shop/web")
        assert all(not path.endswith("/resize") for _, path in mirroring.lower.writes())
        assert resize_pending(mirroring) == [(reason, message)]
        # Asked back to what it has: the refusal goes.
        back = [{**sized[0], "resources": {"requests": {"cpu": "100m"}}}]
        mirroring.above(upper_pod(containers=back), "MODIFIED")
        mirroring.upper.requests.clear()
        await mirroring.controller.reconcile("shop/web")
        (patch,) = [r.body for r in mirroring.lower.requests if r.method == "PATCH"][-1:]
        assert patch["metadata"]["annotations"][keys.RESIZE_REFUSED_ANNOTATION] is None
        assert resize_pending(mirroring) == []


async def test_the_lower_cluster_is_pinged_on_the_heartbeat_client() -> None:
    """The ping decides the Lease: it waits for none of the pods' request budget."""
    lower, heartbeat = FakeClient(), FakeClient()
    backend = LowerCluster(
        lower,
        Informer(client=lower, resource=PODS),
        Informer(client=lower, resource=NODES),
        OWNER,
        NamespaceMapping(),
        HOST_IP,
        heartbeat=heartbeat,
    )
    heartbeat.answer("GET", "/version", {"gitVersion": "v1.35.4"})
    assert await backend.ping() is True
    assert [r.path for r in heartbeat.requests] == ["/readyz", "/version"]
    assert lower.requests == []
