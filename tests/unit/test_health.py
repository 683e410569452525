"""The probe endpoints: alive at once, ready only when the component says so."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from kubekit.health import Health


async def test_alive_from_the_start_and_ready_only_once_marked() -> None:
    health = Health()
    async with TestClient(TestServer(health.app())) as client:
        assert (await client.get("/healthz")).status == 200
        starting = await client.get("/readyz")
        assert (starting.status, await starting.text()) == (503, "not ready: starting")
        health.mark_ready()
        ready = await client.get("/readyz")
        assert (ready.status, await ready.text()) == (200, "ok")
        assert (await client.get("/healthz")).status == 200
        assert (await client.post("/healthz")).status == 405
