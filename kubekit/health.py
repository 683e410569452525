"""/healthz and /readyz for probes and /metrics for Prometheus: plain HTTP, no
authentication, on a port of their own (the kubelet's healthz port is the model), so the
APIs stay authenticated."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


class Health:
    """Alive as long as the process answers; ready once ``mark_ready`` was called (a
    component calls it when its caches are whole)."""

    def __init__(self) -> None:
        self._not_ready = "starting"

    def mark_ready(self) -> None:
        self._not_ready = ""

    def mark_not_ready(self, reason: str) -> None:
        self._not_ready = reason

    def app(self) -> web.Application:
        async def healthz(_request: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def readyz(_request: web.Request) -> web.Response:
            if self._not_ready:
                return web.Response(status=503, text=f"not ready: {self._not_ready}")
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/metrics", serve_metrics)
        return app

    async def serve(self, host: str, port: int) -> web.AppRunner:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner


async def serve_metrics(_request: web.Request) -> web.Response:
    """Every metric of the process in Prometheus' text format."""
    return web.Response(
        body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )
