"""An aiohttp application served over TLS on a loopback port, for client tests."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from kubekit import pki


@dataclass(frozen=True)
class TlsServer:
    port: int
    ca: pki.KeyPair  # signed the serving certificate

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def kubeconfig(self, directory: Path) -> Path:
        """A kubeconfig for this server, with a client certificate its CA signed."""
        return pki.write_kubeconfig(
            directory / "kubeconfig",
            cluster="test",
            server=self.url,
            ca=self.ca.cert_path,
            user=pki.issue(self.ca, directory / "user", "user", client=True),
        )


@asynccontextmanager
async def serving_over_tls(
    directory: Path,
    app: web.Application,
    server_names: tuple[str, ...] = ("127.0.0.1",),
    client_certificates: bool = False,
) -> AsyncIterator[TlsServer]:
    """Serves ``app``; with ``client_certificates``, only to clients presenting one its CA
    signed."""
    ca = pki.create_ca(directory, "test")
    serving = pki.issue(ca, directory / "server", "server", server_names=server_names)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(serving.cert_path, serving.key_path)
    if client_certificates:
        context.load_verify_locations(ca.cert_path)
        context.verify_mode = ssl.CERT_REQUIRED
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    try:
        yield TlsServer(site._server.sockets[0].getsockname()[1], ca)  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def hello_websocket(request: web.Request) -> web.WebSocketResponse:
    """A WebSocket that says hello and closes."""
    socket = web.WebSocketResponse()
    await socket.prepare(request)
    await socket.send_bytes(b"hello")
    await socket.close()
    return socket
