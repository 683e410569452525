"""Opening a WebSocket to an apiserver (exec, attach, port-forward below): a refusal keeps
the apiserver's reason, and the kubeconfig's connection settings hold as for requests."""

import asyncio
from pathlib import Path

import pytest
import yaml
from aiohttp import WSMsgType, web

from kubekit import client as client_module
from kubekit.client import ApiError, ClientSettings, KubeClient
from tests.unit.tlsserver import hello_websocket, serving_over_tls


async def test_a_refused_websocket_says_why(tmp_path: Path) -> None:
    status = {
        "kind": "Status",
        "status": "Failure",
        "message": 'pods "p" is forbidden: User "vk" cannot create resource "pods/exec"',
        "reason": "Forbidden",
        "code": 403,
    }

    async def forbidden(_request: web.Request) -> web.Response:
        return web.json_response(status, status=403)

    async def plain(_request: web.Request) -> web.Response:
        return web.Response(status=404, text="no such container\n")

    app = web.Application()
    app.router.add_get("/exec", forbidden)
    app.router.add_get("/attach", plain)
    async with serving_over_tls(tmp_path, app) as server:
        kubeconfig = server.kubeconfig(tmp_path)
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            with pytest.raises(ApiError) as refused:
                await client.websocket("/exec", [], ())
            assert (refused.value.status, refused.value.body) == (403, status)
            with pytest.raises(ApiError) as missing:
                await client.websocket("/attach", [], ())
            assert (missing.value.status, missing.value.message) == (404, "no such container")


async def test_websockets_honour_the_kubeconfigs_tls_server_name(tmp_path: Path) -> None:
    app = web.Application()
    app.router.add_get("/stream", hello_websocket)
    # The certificate names the apiserver, not the address it is reached at.
    async with serving_over_tls(tmp_path, app, ("apiserver.internal",)) as server:
        kubeconfig = server.kubeconfig(tmp_path)
        config = yaml.safe_load(kubeconfig.read_text())
        config["clusters"][0]["cluster"]["tls-server-name"] = "apiserver.internal"
        kubeconfig.write_text(yaml.safe_dump(config))
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            socket = await client.websocket("/stream", [], ())
            assert (await socket.receive_bytes()) == b"hello"
            await socket.close()


async def test_an_idle_websocket_is_pinged_and_ends_when_its_peer_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle session crosses load balancers that drop silent flows: pinged, it stays
    alive; once its pongs stop coming (the flow dropped), it ends rather than hang."""
    monkeypatch.setattr(client_module, "WEBSOCKET_HEARTBEAT_SECONDS", 0.2)
    pings = 0
    answering = True

    async def silent_peer(request: web.Request) -> web.WebSocketResponse:
        nonlocal pings
        socket = web.WebSocketResponse(autoping=False)
        await socket.prepare(request)
        async for message in socket:
            if message.type == WSMsgType.PING:
                pings += 1
                if answering:
                    await socket.pong(message.data)
        return socket

    app = web.Application()
    app.router.add_get("/exec", silent_peer)
    async with serving_over_tls(tmp_path, app) as server:
        kubeconfig = server.kubeconfig(tmp_path)
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            socket = await client.websocket("/exec", [], ())
            await asyncio.sleep(1.0)
            assert pings >= 2 and not socket.closed, "idle, answered: alive"
            answering = False
            async with asyncio.timeout(5):
                message = await socket.receive()
            assert message.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.ERROR)
