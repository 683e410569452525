"""Streams (WebSockets for exec, attach and port-forward; followed logs) hold their
connection while a user keeps them open. They must neither take the connections the
client's requests need (a virtual node mirroring pods while users tail logs) nor wait
for them, nor for the requests' QPS budget."""

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from kubekit import client as client_module
from kubekit import pki
from kubekit.client import CONNECTION_ERRORS, ClientSettings, KubeClient
from tests.unit.tlsserver import serving_over_tls

STREAMS = 5


def held_open_streams() -> tuple[web.Application, asyncio.Event]:
    """An apiserver whose WebSockets and followed logs stay open until ``ended`` is set."""
    ended = asyncio.Event()

    async def readyz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def websocket(request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        await socket.send_bytes(b"hello")
        await ended.wait()
        await socket.close()
        return socket

    async def logs(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"a line\n")
        await ended.wait()
        return response

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/exec", websocket)
    app.router.add_get("/logs", logs)
    return app, ended


@asynccontextmanager
async def client_of(
    directory: Path, settings: ClientSettings
) -> AsyncIterator[tuple[KubeClient, asyncio.Event]]:
    """A client of the server above, and the event that ends its streams."""
    app, ended = held_open_streams()
    async with serving_over_tls(directory, app) as server:
        kubeconfig = server.kubeconfig(directory)
        async with await KubeClient.connect(
            ClientSettings(
                str(kubeconfig),
                qps=settings.qps,
                burst=settings.burst,
                connections=settings.connections,
            )
        ) as client:
            try:
                yield client, ended
            finally:
                ended.set()


async def open_streams(client: KubeClient, ended: asyncio.Event, stack: AsyncExitStack) -> None:
    for _ in range(STREAMS):
        socket = await client.websocket("/exec", [], ())
        stack.push_async_callback(socket.close)
        assert (await socket.receive_bytes()) == b"hello"
        response = await client.stream("/logs", {})
        stack.callback(response.close)
        assert (await response.content.readline()) == b"a line\n"
    # Run first on the way out: the server ends the streams rather than the client
    # waiting for it to answer its close.
    stack.callback(ended.set)


async def test_open_streams_leave_the_requests_their_connections(tmp_path: Path) -> None:
    async with (
        client_of(tmp_path, ClientSettings(connections=2)) as (client, ended),
        AsyncExitStack() as stack,
    ):
        await asyncio.wait_for(open_streams(client, ended, stack), timeout=10)
        # Ten streams open, more than the requests' two connections: requests still go.
        for _ in range(3):
            assert await asyncio.wait_for(client.get_text("/readyz"), timeout=10) == "ok"


async def test_streams_are_not_paced_by_the_requests_budget(tmp_path: Path) -> None:
    async with (
        client_of(tmp_path, ClientSettings(qps=0.01, burst=1)) as (client, ended),
        AsyncExitStack() as stack,
    ):
        assert await client.get_text("/readyz") == "ok"
        # The budget is spent for the next 100 s; streams open all the same.
        await asyncio.wait_for(open_streams(client, ended, stack), timeout=10)
        try:
            await asyncio.wait_for(client.get_text("/readyz"), timeout=0.5)
        except TimeoutError:
            pass
        else:
            raise AssertionError("a request went through with the budget spent")


async def test_streams_connections_are_kept_alive_by_tcp(tmp_path: Path) -> None:
    """A followed log that says nothing for minutes crosses load balancers that drop
    silent flows: with no keepalive, `kubectl logs -f` through the virtual node hung for
    good once one did."""
    async with (
        client_of(tmp_path, ClientSettings()) as (client, ended),
        AsyncExitStack() as stack,
    ):
        response = await client.stream("/logs", {})
        stack.callback(response.close)
        stack.callback(ended.set)
        assert response.connection is not None and response.connection.transport is not None
        raw = response.connection.transport.get_extra_info("socket")
        assert raw.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
        assert raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        socket_ = await client.websocket("/exec", [], ())
        stack.push_async_callback(socket_.close)
        assert (await socket_.receive_bytes()) == b"hello"


async def test_a_log_stream_to_an_apiserver_that_never_answers_its_handshake_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An apiserver whose packets are dropped: `kubectl logs` through the virtual node
    waited out the kernel's two minutes of connect tries (or for good, with a peer that
    accepts and says nothing) before its 502."""
    monkeypatch.setattr(client_module, "STREAM_CONNECT_SECONDS", 0.2)
    accepted: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ca = pki.create_ca(tmp_path, "test")
    kubeconfig = pki.write_kubeconfig(
        tmp_path / "kubeconfig",
        cluster="silent",
        server=f"https://127.0.0.1:{port}",
        ca=ca.cert_path,
        user=pki.issue(ca, tmp_path / "user", "user", client=True),
    )
    try:
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            opening = asyncio.ensure_future(client.stream("/logs", {}))
            done, _ = await asyncio.wait({opening}, timeout=10)
            opening.cancel()
            assert done, "still waiting for the handshake"
            assert isinstance(opening.exception(), CONNECTION_ERRORS)
    finally:
        server.close()
    assert accepted, "the connection was made; its handshake never answered"
