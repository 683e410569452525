import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import REGISTRY, Histogram

from kubekit import metrics
from kubekit.client import ApiError
from kubekit.health import Health
from kubekit.workqueue import WorkQueue


@pytest.mark.parametrize(
    ("path", "resource"),
    [
        ("/api/v1/namespaces/ns/pods", "pods"),
        ("/api/v1/namespaces/ns/pods/web-1", "pods"),
        ("/api/v1/namespaces/ns/pods/web-1/log", "pods/log"),
        ("/api/v1/namespaces/ns/pods/web-1/eviction?dryRun=All", "pods/eviction"),
        ("/api/v1/nodes/vk-1/status", "nodes/status"),
        ("/api/v1/namespaces/kube-system", "namespaces"),
        ("/api/v1/namespaces", "namespaces"),
        ("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/vk-1", "leases"),
        ("/apis/discovery.k8s.io/v1/endpointslices", "endpointslices"),
        ("/api/v1", "<discovery>"),
        ("/version", "<other>"),
    ],
)
def test_api_paths_are_labelled_by_resource(path: str, resource: str) -> None:
    assert metrics.api_resource(path) == resource


def sample(metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


async def test_a_work_queue_counts_adds_depth_retries_errors_and_work() -> None:
    queue: WorkQueue[str] = WorkQueue("metrics-test")
    failures = {"b": 1}
    handled: list[str] = []
    both = asyncio.Event()

    async def reconcile(key: str) -> None:
        if failures.get(key):
            failures[key] -= 1
            raise ApiError(409, {"reason": "Conflict"})
        handled.append(key)
        if sorted(handled) == ["a", "b"]:
            both.set()

    for key in ("a", "b", "a"):
        queue.add(key)
    assert sample("workqueue_depth", name="metrics-test") == 2
    assert sample("workqueue_adds_total", name="metrics-test") == 2, "a key waiting is added once"
    workers = asyncio.create_task(queue.run_workers(1, reconcile))
    await asyncio.wait_for(both.wait(), 5)
    queue.shut_down()
    await workers
    assert sample("workqueue_depth", name="metrics-test") == 0
    assert sample("workqueue_retries_total", name="metrics-test") == 1
    assert sample("kubestrata_reconcile_errors_total", name="metrics-test", reason="Conflict") == 1
    assert sample("workqueue_work_duration_seconds_count", name="metrics-test") == 3


async def test_timed_observes_each_call_failed_ones_too() -> None:
    histogram = Histogram("timed_test_seconds", "a test", ["method"], registry=None)

    @metrics.timed(histogram, "Estimate")
    async def answer(fail: bool) -> str:
        if fail:
            raise ValueError("bad pod")
        return "fits"

    assert await answer(False) == "fits"
    with pytest.raises(ValueError):
        await answer(True)
    assert histogram.labels("Estimate")._sum.get() > 0
    (family,) = histogram.collect()
    counts = [s.value for s in family.samples if s.name == "timed_test_seconds_count"]
    assert counts == [2]


async def test_health_serves_the_process_metrics() -> None:
    async with TestClient(TestServer(Health().app())) as client:
        response = await client.get("/metrics")
        assert response.status == 200
        assert response.content_type == "text/plain"
        text = await response.text()
    assert "# TYPE workqueue_adds_total counter" in text
    assert "# TYPE rest_client_request_duration_seconds histogram" in text
