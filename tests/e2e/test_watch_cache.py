"""The watch cache against a real apiserver: adds, updates, deletes, an apiserver restart,
and a relist after 410 Gone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from harness.localcluster import ClusterSpec, LocalCluster
from harness.toolchain import Toolchain
from kubekit.client import CONFIGMAPS, JSON, ClientSettings, KubeClient
from kubekit.informer import Informer, object_key


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, toolchain: Toolchain
) -> Iterator[LocalCluster]:
    # Its own cluster: the test restarts the apiserver, which the shared federation must not see.
    cluster = LocalCluster(
        ClusterSpec("watch", "upper"), tmp_path_factory.mktemp("watch"), toolchain
    )
    cluster.start()
    yield cluster
    cluster.stop()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def on_add(self, obj: JSON) -> None:
        self.events.append(("add", object_key(obj), str(obj.get("data"))))

    def on_update(self, obj: JSON) -> None:
        self.events.append(("update", object_key(obj), str(obj.get("data"))))

    def on_delete(self, obj: JSON) -> None:
        self.events.append(("delete", object_key(obj), str(obj.get("data"))))


async def eventually(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        # The condition reads state that an informer task changes: polling is the point.
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running(informer: Informer) -> AsyncIterator[None]:
    task = asyncio.create_task(informer.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def kubectl(cluster: LocalCluster, *args: str) -> None:
    await asyncio.to_thread(cluster.kubectl, *args)


async def test_cache_follows_changes_and_survives_an_apiserver_restart(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    async with await KubeClient.connect(
        ClientSettings(kubeconfig=str(cluster.kubeconfig))
    ) as client:
        await kubectl(cluster, "create", "configmap", "before-start", "--from-literal=k=0")
        informer = Informer(client, CONFIGMAPS, namespace="default")
        recorder = Recorder()
        informer.add_handler(recorder)
        async with running(informer):
            async with asyncio.timeout(60):
                await informer.wait_synced()
            assert informer.get("default/before-start") is not None, "listed at start"

            await kubectl(cluster, "create", "configmap", "alpha", "--from-literal=k=1")
            await eventually(lambda: ("add", "default/alpha", "{'k': '1'}") in recorder.events)
            await kubectl(cluster, "patch", "configmap", "alpha", "-p", '{"data":{"k":"2"}}')
            await eventually(lambda: ("update", "default/alpha", "{'k': '2'}") in recorder.events)
            assert informer.get("default/alpha")["data"] == {"k": "2"}  # type: ignore[index]
            await kubectl(cluster, "delete", "configmap", "alpha")
            await eventually(lambda: informer.get("default/alpha") is None)
            assert recorder.events[-1][:2] == ("delete", "default/alpha")

            await asyncio.to_thread(cluster.restart, "kube-apiserver")
            await kubectl(cluster, "create", "configmap", "after-restart", "--from-literal=k=3")
            await eventually(lambda: informer.get("default/after-restart") is not None, timeout=90)
            # A fresh apiserver's watch cache may not reach back to our version (410, then
            # a relist) or may (the watch resumes): either way the cache must equal the truth.
            names = await asyncio.to_thread(
                cluster.kubectl, "get", "configmaps", "-o", "jsonpath={.items[*].metadata.name}"
            )
            assert sorted(informer.keys()) == sorted(f"default/{n}" for n in names.stdout.split())


async def test_410_gone_relists_and_reports_what_was_missed(cluster: LocalCluster) -> None:
    async with await KubeClient.connect(
        ClientSettings(kubeconfig=str(cluster.kubeconfig))
    ) as client:
        informer = Informer(client, CONFIGMAPS, namespace="default")
        recorder = Recorder()
        informer.add_handler(recorder)
        await kubectl(cluster, "create", "configmap", "doomed")
        async with running(informer):
            async with asyncio.timeout(60):
                await informer.wait_synced()
        assert informer.get("default/doomed") is not None

        # While nobody watches: one object goes, one comes.
        await kubectl(cluster, "delete", "configmap", "doomed")
        await kubectl(cluster, "create", "configmap", "newcomer")
        # A version the apiserver has long compacted away: it answers 410 Gone.
        informer.resource_version = "1"
        async with running(informer):
            await eventually(lambda: informer.relists == 2)
            await eventually(lambda: informer.get("default/newcomer") is not None)
        assert informer.get("default/doomed") is None
        assert ("delete", "default/doomed", "None") in recorder.events
        assert ("add", "default/newcomer", "None") in recorder.events
