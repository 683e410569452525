"""The pod controller's orphan path, fed through the upper pod informer as a watch would:
a lower pod whose upper pod is gone is deleted with the grace the upper pod was deleted
with, so a force delete above is a force delete below."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubekit.client import PODS
from kubekit.informer import Informer
from kubekit.workqueue import WorkQueue
from virtual_node.podcontroller import Gone, PodController, SyncResult, Waiting


class RecordingBackend:
    def __init__(self) -> None:
        self.orphans: list[tuple[str, int | None]] = []
        self.synced: list[str] = []

    async def sync(self, upper: Mapping[str, Any]) -> SyncResult:
        self.synced.append(upper["metadata"]["name"])
        return Waiting()

    def mirror_version(self, upper_key: str) -> str | None:
        return None

    async def delete(self, upper: Mapping[str, Any]) -> dict[str, Any] | Gone:
        return upper.get("status") or {}

    async def remove_orphan(self, upper_key: str, grace_period_seconds: int | None) -> None:
        self.orphans.append((upper_key, grace_period_seconds))


def upper_pod(name: str, grace: int | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": "shop",
        "uid": f"uid-{name}",
        "resourceVersion": "1",
    }
    if grace is not None:
        metadata["deletionTimestamp"] = "2026-11-24T10:00:00Z"
        metadata["deletionGracePeriodSeconds"] = grace
    return {"metadata": metadata, "spec": {"nodeName": "vk-lower-1"}, "status": {}}


def controller() -> tuple[PodController, Informer, RecordingBackend]:
    pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    backend = RecordingBackend()
    queue: WorkQueue[str] = WorkQueue("pods")
    return PodController(None, pods, backend, "vk-lower-1", queue), pods, backend  # type: ignore[arg-type]


async def test_a_force_deleted_upper_pod_takes_its_lower_pod_with_grace_0() -> None:
    pods_controller, pods, backend = controller()
    pods.apply({"type": "ADDED", "object": upper_pod("web")})
    pods.apply({"type": "DELETED", "object": upper_pod("web", grace=0)})
    await pods_controller.reconcile("shop/web")
    assert backend.orphans == [("shop/web", 0)]


async def test_an_upper_pod_gone_gracefully_passes_its_grace_once() -> None:
    pods_controller, pods, backend = controller()
    pods.apply({"type": "ADDED", "object": upper_pod("web")})
    pods.apply({"type": "DELETED", "object": upper_pod("web", grace=45)})
    await pods_controller.reconcile("shop/web")
    # A second look (the periodic sweep) knows nothing more: the lower pod's own grace.
    await pods_controller.reconcile("shop/web")
    assert backend.orphans == [("shop/web", 45), ("shop/web", None)]


async def test_a_pod_deleted_with_no_grace_recorded_leaves_the_lower_grace() -> None:
    pods_controller, pods, backend = controller()
    pods.apply({"type": "ADDED", "object": upper_pod("web")})
    pods.apply({"type": "DELETED", "object": upper_pod("web")})
    await pods_controller.reconcile("shop/web")
    assert backend.orphans == [("shop/web", None)]


async def test_a_pod_made_again_under_the_same_name_forgets_the_old_grace() -> None:
    pods_controller, pods, backend = controller()
    pods.apply({"type": "ADDED", "object": upper_pod("web")})
    pods.apply({"type": "DELETED", "object": upper_pod("web", grace=0)})
    pods.apply({"type": "ADDED", "object": upper_pod("web")})
    await pods_controller.reconcile("shop/web")
    assert backend.synced == ["web"]
    pods.apply({"type": "DELETED", "object": upper_pod("web")})
    await pods_controller.reconcile("shop/web")
    assert backend.orphans == [("shop/web", None)]
