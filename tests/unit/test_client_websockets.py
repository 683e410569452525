"""Opening a WebSocket to an apiserver (exec, attach, port-forward below): a refusal keeps
the apiserver's reason, and the kubeconfig's connection settings hold as for requests."""

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import WSMsgType, web

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


async def test_a_websocket_whose_reader_waits_is_not_closed_under_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session whose client stops reading (`kubectl exec … | less` on its first page)
    stops reading the lower socket too, so a ping's pong goes unread: a heartbeat (30 s)
    closed the session 15 s later, the output cut short. TCP keepalive keeps the
    connection instead: no heartbeat is asked of aiohttp, and a reader that waits gets
    everything."""
    payload = bytes(range(256)) * 4096  # 1 MiB: past what the client reads ahead
    asked: list[dict[str, Any]] = []
    connect = aiohttp.ClientSession.ws_connect

    def recording(self: aiohttp.ClientSession, *args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs)
        return connect(self, *args, **kwargs)

    monkeypatch.setattr(aiohttp.ClientSession, "ws_connect", recording)

    async def talker(request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse(autoping=False)
        await socket.prepare(request)
        for offset in range(0, len(payload), 32768):
            await socket.send_bytes(payload[offset : offset + 32768])
        await socket.close()
        return socket

    app = web.Application()
    app.router.add_get("/exec", talker)
    async with serving_over_tls(tmp_path, app) as server:
        kubeconfig = server.kubeconfig(tmp_path)
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            socket = await client.websocket("/exec", [], ())
            await asyncio.sleep(2.0)  # the reader waits
            received = bytearray()
            async with asyncio.timeout(10):
                async for message in socket:
                    assert message.type is WSMsgType.BINARY, message
                    received += message.data
            assert bytes(received) == payload
    assert [kwargs.get("heartbeat") for kwargs in asked] == [None]
