"""A WebSocket takes its pooled connection for good; the client dials the next one's
connection at once, so a new stream (an exec, a port-forward connection) finds a warm
one instead of paying a TLS handshake."""

import asyncio
from pathlib import Path

from aiohttp import web

from kubekit.client import ClientSettings, KubeClient
from tests.unit.tlsserver import hello_websocket, serving_over_tls


async def test_the_next_websocket_takes_the_connection_dialled_after_the_last(
    tmp_path: Path,
) -> None:
    # Client port of each request, in order: one port per TCP connection.
    seen: list[tuple[str, int]] = []

    async def readyz(request: web.Request) -> web.Response:
        seen.append(("readyz", request.transport.get_extra_info("peername")[1]))  # type: ignore[union-attr]
        return web.Response(text="ok")

    async def stream(request: web.Request) -> web.WebSocketResponse:
        seen.append(("websocket", request.transport.get_extra_info("peername")[1]))  # type: ignore[union-attr]
        return await hello_websocket(request)

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/stream", stream)
    async with serving_over_tls(tmp_path, app) as server:
        kubeconfig = server.kubeconfig(tmp_path)
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            for _ in range(3):
                socket = await client.websocket("/stream", [], ())
                assert (await socket.receive_bytes()) == b"hello"
                await socket.close()
                # The spare is back in the pool once its answer is read.
                assert client._dialing_spare is not None
                await asyncio.wait_for(client._dialing_spare, timeout=10)
    kinds = [kind for kind, _ in seen]
    assert kinds == ["websocket", "readyz"] * 3
    ports = [port for _, port in seen]
    # Each spare is dialled anew (the WebSocket kept the one before), and the next
    # WebSocket goes over it.
    assert len(set(ports[1::2])) == 3
    assert ports[2] == ports[1] and ports[4] == ports[3]
