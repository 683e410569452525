"""Helpers the benchmarks share: deleting a run's namespaces and waiting until their pods
are gone, in the upper cluster and below it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from harness.localcluster import KubectlClient
from kubekit.client import NAMESPACES, PODS, ApiError, ClientSettings, KubeClient, is_not_found


async def delete_namespaces(cluster: KubectlClient, names: Iterable[str]) -> None:
    """Deletes namespaces and waits until they, their pods and events are gone."""
    names = list(names)
    async with await KubeClient.connect(ClientSettings(str(cluster.kubeconfig))) as client:
        for name in names:
            await client.delete(NAMESPACES, name)
        for name in names:
            async with asyncio.timeout(900):
                while True:
                    try:
                        await client.get(NAMESPACES, name)
                    except ApiError as error:
                        if is_not_found(error):
                            break
                        raise
                    await asyncio.sleep(1)


async def wait_no_pods(cluster: KubectlClient, names: Iterable[str]) -> None:
    """Waits until the namespaces ``names`` of ``cluster`` hold no pod."""
    async with await KubeClient.connect(ClientSettings(str(cluster.kubeconfig))) as client:
        for name in names:
            async with asyncio.timeout(900):
                # Another cluster's pods: no event here to wait on, polling is the point.
                while (await client.list(PODS, name, limit=1))["items"]:  # noqa: ASYNC110
                    await asyncio.sleep(1)
