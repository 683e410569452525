"""The kubelet API server in process, over plain HTTP: authentication, routing, logs, the
WebSocket and SPDY/3.1 streaming protocols, and what hostile SPDY peers get."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import ClientResponse, WSMsgType, web
from aiohttp.test_utils import TestClient

from kubekit import pki
from kubekit.client import (
    STREAM_KEEPALIVE_IDLE_SECONDS,
    STREAM_KEEPALIVE_INTERVAL_SECONDS,
    STREAM_KEEPALIVE_PROBES,
)
from tests.unit.fakekubelet import (
    AUTH,
    LOG_CHUNKS,
    POD,
    TIMEOUT,
    EchoConnection,
    EchoProcess,
    FakeAuthorizer,
    FakeProvider,
    Kubelet,
    KubeletTestServer,
    SpdyPeer,
    control_frame,
    read_response,
    serving,
    spdy_request,
    spdy_upgrade,
)
from virtual_node.kubeletapi import channels
from virtual_node.kubeletapi import server as server_module
from virtual_node.kubeletapi.provider import ExecOptions, LogOptions
from virtual_node.kubeletapi.server import STREAMING_IDLE_TIMEOUT, KubeletServer
from virtual_node.kubeletapi.spdy import (
    HEADER_DICTIONARY,
    GoAwayReceived,
    GoAwayStatus,
    StreamReplied,
    StreamReset,
)
from virtual_node.kubeletapi.spdysession import SpdySession
from virtual_node.main import KUBELET_API_SHUTDOWN_SECONDS, VirtualNodeConfig, serve_kubelet_api


async def error_of(response: ClientResponse) -> tuple[int, str]:
    """An error answered as the kubelet answers it: its message in plain text."""
    assert response.content_type == "text/plain"
    return response.status, await response.text()


# --- plain HTTP ------------------------------------------------------------------------------


async def test_no_credentials_is_401_before_anything_else(kubelet: Kubelet) -> None:
    for path in ("/pods", "/containerLogs/default/p/app", "/no/such/route"):
        code, message = await error_of(await kubelet.client.get(path))
        assert code == 401 and message.startswith("Unauthorized")
    assert kubelet.authorizer.checks == []
    assert kubelet.provider.log_requests == []


async def test_every_connection_is_kept_alive_with_the_streams_timings() -> None:
    """A stream's lower session lasts as long as its connection: with the system's
    timings (two hours idle) an upper apiserver gone without a word kept exec shells and
    port-forwards open below that long."""

    async def probe(request: web.Request) -> web.Response:
        assert request.transport is not None
        connection = request.transport.get_extra_info("socket")
        options = (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)
        kept = [connection.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)]
        kept += [connection.getsockopt(socket.IPPROTO_TCP, option) for option in options]
        return web.json_response(kept)

    app = KubeletServer(FakeProvider(), FakeAuthorizer(), STREAMING_IDLE_TIMEOUT).app()
    app.router.add_get("/probe", probe)
    async with TestClient(KubeletTestServer(app, host="127.0.0.1")) as client:
        response = await client.get("/probe", headers=AUTH)
        assert await response.json() == [
            1,
            STREAM_KEEPALIVE_IDLE_SECONDS,
            STREAM_KEEPALIVE_INTERVAL_SECONDS,
            STREAM_KEEPALIVE_PROBES,
        ]


async def test_forbidden_user_is_403_and_reaches_no_pod(kubelet: Kubelet) -> None:
    response = await kubelet.client.get(
        "/containerLogs/default/p/app", headers={"Authorization": "Bearer mallory"}
    )
    code, message = await error_of(response)
    assert code == 403 and message.startswith("Forbidden") and "user=mallory" in message
    assert kubelet.authorizer.checks == [("mallory", "GET", "/containerLogs/default/p/app")]
    assert kubelet.provider.log_requests == []


async def test_subresource_authorization_follows_the_path(kubelet: Kubelet) -> None:
    reader = {"Authorization": "Bearer stats-reader"}
    summary = await kubelet.client.get("/stats/summary", headers=reader)
    assert summary.status == 200
    assert await summary.json() == {"node": {"nodeName": "vn-1"}, "pods": []}
    assert (await kubelet.client.get("/pods", headers=reader)).status == 403


async def test_dot_segments_do_not_smuggle_exec_past_stats_authorization(
    kubelet: Kubelet,
) -> None:
    # node_attributes calls "/stats/../exec/..." a stats request; it must not reach exec.
    for target in ("/stats/../exec/default/p/app", "/stats/%2e%2e/exec/default/p/app"):
        reader, writer = await asyncio.open_connection(kubelet.server.host, kubelet.server.port)
        try:
            writer.write(
                f"POST {target}?command=id&output=1 HTTP/1.1\r\nHost: kubelet\r\n"
                "Authorization: Bearer stats-reader\r\nContent-Length: 0\r\n\r\n".encode()
            )
            status, _headers, _body = await read_response(reader)
        finally:
            writer.close()
        assert status == 404
    assert kubelet.provider.processes == []


async def test_pods_healthz_and_metrics(kubelet: Kubelet) -> None:
    pods = await kubelet.client.get("/pods", headers=AUTH)
    assert pods.status == 200
    assert await pods.json() == {
        "kind": "PodList",
        "apiVersion": "v1",
        "metadata": {},
        "items": [POD],
    }
    healthz = await kubelet.client.get("/healthz", headers=AUTH)
    assert await healthz.text() == "ok"
    for path in ("/runningpods/", "/runningpods"):
        running = await kubelet.client.get(path, headers=AUTH)
        assert running.status == 200
        assert await running.json() == {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {},
            "items": [
                {
                    "metadata": {
                        "name": "p",
                        "namespace": "default",
                        "uid": "0b1c",
                        "creationTimestamp": None,
                    },
                    "spec": {
                        "containers": [{"name": "app", "image": "pause:3.10", "resources": {}}]
                    },
                    "status": {},
                }
            ],
        }
    # The kubelet's authorizer calls it nodes/proxy: a reader of stats may not.
    denied = await kubelet.client.get(
        "/runningpods/", headers={"Authorization": "Bearer stats-reader"}
    )
    assert denied.status == 403
    metrics = await kubelet.client.get("/metrics/resource", headers=AUTH)
    assert metrics.content_type == "text/plain"
    assert "node_cpu_usage_seconds_total 1 2" in await metrics.text()
    cadvisor = await kubelet.client.get("/metrics/cadvisor", headers=AUTH)
    assert cadvisor.content_type == "text/plain"
    assert await cadvisor.text() == "# TYPE container_cpu_usage_seconds_total counter\n"
    own = await kubelet.client.get("/metrics", headers=AUTH)
    assert "# TYPE workqueue_adds_total counter" in await own.text()
    # The kubelet's authorizer calls every /metrics path nodes/metrics.
    for path in ("/metrics", "/metrics/cadvisor"):
        denied = await kubelet.client.get(path, headers={"Authorization": "Bearer stats-reader"})
        assert denied.status == 403
        assert ("stats-reader", "GET", path) in kubelet.authorizer.checks


async def test_logs_stream_the_chunks_with_the_options(kubelet: Kubelet) -> None:
    response = await kubelet.client.get(
        "/containerLogs/default/p/app",
        params={"tailLines": "2", "follow": "true", "timestamps": "1"},
        headers=AUTH,
    )
    assert response.status == 200
    assert response.content_type == "text/plain"
    assert await response.read() == b"".join(LOG_CHUNKS)
    assert kubelet.provider.log_requests == [
        ("app", LogOptions(follow=True, tail_lines=2, timestamps=True))
    ]


async def test_logs_of_an_init_container(kubelet: Kubelet) -> None:
    response = await kubelet.client.get("/containerLogs/default/p/setup", headers=AUTH)
    assert response.status == 200
    assert await response.read() == b"".join(LOG_CHUNKS)


async def test_logs_failure_before_the_first_chunk_is_a_status(kubelet: Kubelet) -> None:
    response = await kubelet.client.get("/containerLogs/default/p/broken", headers=AUTH)
    assert await error_of(response) == (502, "lower cluster: the log stream broke")


async def test_logs_broken_after_the_first_chunk_end_cut_short(kubelet: Kubelet) -> None:
    """Too late for a status: the connection closes before the chunked body's end, so the
    client knows the log was cut short rather than ended."""
    response = await kubelet.client.get("/containerLogs/default/p/cut-short", headers=AUTH)
    assert response.status == 200
    assert await response.content.readany() == LOG_CHUNKS[0]
    with pytest.raises(aiohttp.ClientPayloadError):
        await response.read()


@pytest.mark.parametrize(
    ("path", "code", "words"),
    [
        ("/containerLogs/default/nope/app", 404, "pod default/nope not found"),
        ("/containerLogs/other/p/app", 404, "pod other/p not found"),
        ("/containerLogs/default/p/nope", 404, "container 'nope' not found in pod default/p"),
        ("/containerLogs/default/p/app?tailLines=-1", 400, "tailLines:"),
        ("/containerLogs/default/p/app?sinceTime=now", 400, "sinceTime:"),
        ("/exec/default/p/app?command=ls&output=1", 400, "Upgrade:"),
        ("/exec/default/p/app?output=1", 400, "command:"),
        # A terminal's stderr is dropped first, as the kubelet drops it: no stream left.
        ("/exec/default/p/app?command=ls&tty=1&error=1", 400, "at least one stream"),
        ("/exec/default/p/nope?command=ls&output=1", 404, "container 'nope'"),
        ("/attach/default/p/app?output=1", 400, "Upgrade:"),
        ("/portForward/default/p", 400, "Upgrade:"),
        ("/portForward/default/nope", 404, "pod default/nope not found"),
    ],
)
async def test_bad_requests_are_refused_with_a_message(
    kubelet: Kubelet, path: str, code: int, words: str
) -> None:
    method = "POST" if path.startswith(("/exec", "/attach", "/portForward")) else "GET"
    response = await kubelet.client.request(method, path, headers=AUTH)
    got, message = await error_of(response)
    assert got == code
    assert words in message
    assert kubelet.provider.log_requests == []
    assert kubelet.provider.processes == []


# --- WebSocket -------------------------------------------------------------------------------


async def test_websocket_exec_echoes_and_reports_the_exit_code(kubelet: Kubelet) -> None:
    socket = await kubelet.client.ws_connect(
        "/exec/default/p/app?command=cat&input=1&output=1&error=1",
        protocols=(channels.V5_PROTOCOL,),
        headers=AUTH,
    )
    assert socket.protocol == channels.V5_PROTOCOL
    codec = channels.ChannelCodec(channels.V5_PROTOCOL, 5)
    # As the kubelet: one empty message, on the first of stdout, stderr and error.
    assert await socket.receive_bytes(timeout=TIMEOUT) == bytes([channels.STDOUT])
    await socket.send_bytes(bytes([channels.STDIN]) + b"hi")
    await socket.send_bytes(codec.encode_close(channels.STDIN))
    received: list[channels.ChannelData | channels.CloseChannel] = []
    async with asyncio.timeout(TIMEOUT):
        async for message in socket:
            assert message.type == WSMsgType.BINARY
            received.append(codec.decode(message.data))
    assert received[:2] == [
        channels.ChannelData(channels.STDOUT, b"hi"),
        channels.ChannelData(channels.STDERR, b"HI"),
    ]
    last = received[2]
    assert isinstance(last, channels.ChannelData) and last.channel == channels.ERROR
    assert channels.parse_exec_status(last.payload) == 3
    [(container, attach, process)] = kubelet.provider.processes
    assert (container, attach, process.options.command) == ("app", False, ("cat",))
    await asyncio.wait_for(process.closed.wait(), TIMEOUT)


async def test_websocket_exec_in_a_terminal_sends_nothing_on_stderr(kubelet: Kubelet) -> None:
    """A terminal merges stderr into stdout: an empty message announced on stderr had
    client-go print "Unknown stream id 2, discarding message" on the user's terminal."""
    socket = await kubelet.client.ws_connect(
        "/exec/default/p/app?command=sh&input=1&output=1&error=1&tty=1",
        protocols=(channels.V5_PROTOCOL,),
        headers=AUTH,
    )
    codec = channels.ChannelCodec(channels.V5_PROTOCOL, 5)
    await socket.send_bytes(bytes([channels.STDIN]) + b"ls")
    await socket.send_bytes(codec.encode_close(channels.STDIN))
    async with asyncio.timeout(TIMEOUT):
        received = [codec.decode(message.data) async for message in socket]
    assert [getattr(r, "channel", None) for r in received] == [
        channels.STDOUT,
        channels.STDOUT,
        channels.ERROR,
    ]


async def test_a_long_command_and_a_large_stdin_message_pass_as_through_a_kubelet(
    kubelet: Kubelet,
) -> None:
    """A script given as `sh -c` travels URL-encoded in the query (aiohttp's 8190 bytes
    refused a few KB with a 400), and a client may write a whole file to stdin in one
    message (aiohttp's 4 MiB reset the session): the kubelet takes 1 MiB and 32 MiB."""
    script = "echo 'a line of a long script';" * 1000
    socket = await kubelet.client.ws_connect(
        "/exec/default/p/app",
        params=[
            ("command", "sh"),
            ("command", "-c"),
            ("command", script),
            ("input", "1"),
            ("output", "1"),
        ],
        protocols=(channels.V5_PROTOCOL,),
        headers=AUTH,
        max_msg_size=0,  # the echo comes back in one message too
    )
    codec = channels.ChannelCodec(channels.V5_PROTOCOL, 5)
    large = bytes(5 << 20)
    await socket.send_bytes(bytes([channels.STDIN]) + large)
    await socket.send_bytes(codec.encode_close(channels.STDIN))
    echoed = b""
    async with asyncio.timeout(TIMEOUT):
        async for message in socket:
            decoded = codec.decode(message.data)
            if isinstance(decoded, channels.ChannelData) and decoded.channel == channels.STDOUT:
                echoed += decoded.payload
    assert echoed == large
    [(_, _, process)] = kubelet.provider.processes
    assert process.options.command == ("sh", "-c", script)


class SucceedingProcess(EchoProcess):
    def status(self) -> bytes:
        return channels.success_status()


@pytest.mark.parametrize("protocol", [channels.CHANNEL_PROTOCOL, channels.BASE64_CHANNEL_PROTOCOL])
@pytest.mark.parametrize("succeeds", [True, False])
async def test_websocket_exec_before_v4_gets_the_outcome_as_text(
    protocol: str, succeeds: bool
) -> None:
    """As the kubelet writes it for those protocols: nothing on success (a client of them
    takes anything on the error channel for a failure), else the failure's message."""
    provider = FakeProvider(SucceedingProcess if succeeds else EchoProcess)
    async with serving(provider) as kubelet:
        socket = await kubelet.client.ws_connect(
            "/exec/default/p/app?command=cat&input=1&output=1", protocols=(protocol,), headers=AUTH
        )
        codec = channels.ChannelCodec(protocol, 5)
        hi = codec.encode(channels.STDIN, b"hi")
        await (socket.send_str(hi) if isinstance(hi, str) else socket.send_bytes(hi))
        # No close message before v5: the client goes, the command ends.
        received = []
        async with asyncio.timeout(TIMEOUT):
            async for message in socket:
                decoded = codec.decode(message.data)
                if isinstance(decoded, channels.ChannelData) and decoded.payload:
                    received.append(decoded)
                if decoded == channels.ChannelData(channels.STDOUT, b"hi"):
                    [(_container, _attach, process)] = provider.processes
                    await process.close_stdin()
    errors = [d.payload for d in received if d.channel == channels.ERROR]
    if succeeds:
        assert errors == []
    else:
        assert errors == [
            b"command terminated with non-zero exit code: error executing command [cat], "
            b"exit code 3"
        ]


# A handshake offering only the protocols each test names.
WEBSOCKET_UPGRADE = {
    **AUTH,
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Version": "13",
    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
}


async def test_websocket_exec_without_a_channel_protocol_is_refused(kubelet: Kubelet) -> None:
    response = await kubelet.client.post(
        "/exec/default/p/app?command=ls&output=1",
        headers={
            **WEBSOCKET_UPGRADE,
            "Sec-WebSocket-Protocol": "chat.example",
        },
    )
    assert response.status == 400
    assert kubelet.provider.processes == []
    _code, message = await error_of(response)
    assert message.startswith("Sec-WebSocket-Protocol")


async def test_websocket_port_forward_announces_and_echoes(kubelet: Kubelet) -> None:
    socket = await kubelet.client.ws_connect(
        "/portForward/default/p?port=8080", protocols=(channels.V4_PROTOCOL,), headers=AUTH
    )
    announced = [await socket.receive_bytes(timeout=TIMEOUT) for _ in range(2)]
    assert announced == [
        b"\x00" + (8080).to_bytes(2, "little"),
        b"\x01" + (8080).to_bytes(2, "little"),
    ]
    await socket.send_bytes(b"\x00ping")
    assert await socket.receive_bytes(timeout=TIMEOUT) == b"\x00echo:ping"
    await socket.close()
    [connection] = kubelet.provider.connections
    assert connection.port == 8080
    await asyncio.wait_for(connection.closed.wait(), TIMEOUT)


async def test_websocket_port_forward_ends_once_every_ports_connection_has(
    kubelet: Kubelet,
) -> None:
    """As the kubelet: a client's local socket sees the pod's side close only when the
    WebSocket does (the python client's portforward)."""
    socket = await kubelet.client.ws_connect(
        "/portForward/default/p?port=8080&port=8081",
        protocols=(channels.V4_PROTOCOL,),
        headers=AUTH,
    )
    for _ in range(4):
        await socket.receive_bytes(timeout=TIMEOUT)  # the announcements
    first, second = kubelet.provider.connections
    await first.close()
    await socket.send_bytes(b"\x02ping")
    assert await socket.receive_bytes(timeout=TIMEOUT) == b"\x02echo:ping"
    await second.close()
    closing = await socket.receive(timeout=TIMEOUT)
    assert closing.type in (WSMsgType.CLOSE, WSMsgType.CLOSED)
    await socket.close()


async def test_websocket_port_forward_past_its_protocols_channels_is_400(kubelet: Kubelet) -> None:
    ports = "&".join(f"port={port}" for port in range(8000, 8128))  # 256 channels
    response = await kubelet.client.post(
        f"/portForward/default/p?{ports}",
        headers={**WEBSOCKET_UPGRADE, "Sec-WebSocket-Protocol": channels.V4_PROTOCOL},
    )
    code, message = await error_of(response)
    assert code == 400 and message.startswith("port: too many ports")
    assert kubelet.provider.connections == []


async def test_websocket_port_forward_closes_opened_ports_when_one_fails(kubelet: Kubelet) -> None:
    response = await kubelet.client.post(
        "/portForward/default/p?port=8080&port=81",
        headers={
            **WEBSOCKET_UPGRADE,
            "Sec-WebSocket-Protocol": channels.V4_PROTOCOL,
        },
    )
    code, message = await error_of(response)
    assert code == 502 and "port 81" in message
    [opened] = kubelet.provider.connections
    assert opened.closed.is_set()


# --- SPDY/3.1 --------------------------------------------------------------------------------


async def test_spdy_exec_echoes_and_reports_the_exit_code(kubelet: Kubelet) -> None:
    async with spdy_upgrade(
        kubelet.server,
        "/exec/default/p/app?command=cat&input=1&output=1",
        f"{channels.V5_PROTOCOL}, {channels.V4_PROTOCOL}",
    ) as peer:
        error = peer.open(streamtype="error")
        stdin = peer.open(streamtype="stdin")
        stdout = peer.open(streamtype="stdout")
        peer.send(stdin, b"hello\n", fin=True)
        await peer.until(lambda p: p.finished(error))
        replied = {e.stream_id for e in peer.events if isinstance(e, StreamReplied)}
        assert replied == {error, stdin, stdout}
        assert peer.data(stdout) == b"hello\n" and peer.finished(stdout)
        assert channels.parse_exec_status(peer.data(error)) == 3
        await peer.until(lambda p: False)  # the server hangs up after the status
        assert peer.eof and any(isinstance(e, GoAwayReceived) for e in peer.events)
    [(container, attach, process)] = kubelet.provider.processes
    assert (container, attach, process.options.command) == ("app", False, ("cat",))
    assert process.closed.is_set()


async def test_spdy_port_forward_pairs_streams_by_request_id(kubelet: Kubelet) -> None:
    async with spdy_upgrade(kubelet.server, "/portForward/default/p", "portforward.k8s.io") as peer:
        error = peer.open(streamtype="error", port="8080", requestid="0")
        data = peer.open(streamtype="data", port="8080", requestid="0")
        bad_error = peer.open(streamtype="error", port="eighty", requestid="1")
        bad_data = peer.open(streamtype="data", port="eighty", requestid="1")
        refused_error = peer.open(streamtype="error", port="81", requestid="2")
        refused_data = peer.open(streamtype="data", port="81", requestid="2")
        peer.send(data, b"ping")

        def settled(p: SpdyPeer) -> bool:
            reset = any(isinstance(e, StreamReset) and e.stream_id == bad_data for e in p.events)
            return p.data(data) == b"echo:ping" and reset and p.finished(refused_error)

        await peer.until(settled)
        assert peer.data(bad_error) == b"invalid port 'eighty'" and peer.finished(bad_error)
        assert peer.data(refused_error) == b"lower cluster: nothing listens on port 81"
        assert peer.finished(refused_data) and not peer.finished(error)
        [connection] = kubelet.provider.connections
        assert connection.port == 8080
        assert not connection.closed.is_set()
        # The client going away ends the forward and closes the pod's port.
        peer.spdy.goaway()
        peer.flush()
        await peer.until(lambda p: False)
        assert peer.eof
    await asyncio.wait_for(connection.closed.wait(), TIMEOUT)


class _BurstConnection(EchoConnection):
    """A pod port whose answers all arrive at once, once ``release`` is set: as a lower
    WebSocket read 256 KiB at a time hands over several messages."""

    def __init__(self, port: int, chunks: list[bytes]) -> None:
        super().__init__(port)
        self.release = asyncio.Event()
        for chunk in chunks:
            self._replies.put_nowait(chunk)

    async def receive(self) -> bytes:
        await self.release.wait()
        return await super().receive()


@pytest.mark.parametrize(
    ("chunks", "writes"),
    [([b"a" * 16384] * 4, 1), ([b"b" * 32768] * 40, 5)],
    ids=["one write for what came together", "a write per 256 KiB, not one of it all"],
)
async def test_frames_sent_together_go_out_in_few_writes(chunks: list[bytes], writes: int) -> None:
    provider = FakeProvider()
    connection = _BurstConnection(8080, chunks)
    provider.port_forward = lambda pod, port: _returning(connection)  # type: ignore[method-assign]
    async with (
        serving(provider) as kubelet,
        spdy_upgrade(kubelet.server, "/portForward/default/p", "portforward.k8s.io") as peer,
    ):
        error = peer.open(streamtype="error", port="8080", requestid="0")
        data = peer.open(streamtype="data", port="8080", requestid="0")
        await peer.until(
            lambda p: (
                {e.stream_id for e in p.events if isinstance(e, StreamReplied)} == {error, data}
            )
        )
        (session,) = [
            o for o in gc.get_objects() if isinstance(o, SpdySession) and not o.closed.is_set()
        ]
        sizes: list[int] = []
        write = session._transport.write

        def recorded(payload: Any) -> None:
            sizes.append(len(payload))
            write(payload)

        session._transport.write = recorded  # type: ignore[method-assign,assignment]
        connection.release.set()
        expected = b"".join(chunks)
        await peer.until(lambda p: p.data(data) == expected)
    assert len(sizes) == writes, sizes


async def _returning(connection: EchoConnection) -> EchoConnection:
    return connection


async def test_a_forwarded_connection_the_client_closed_closes_the_pods_soon(
    kubelet: Kubelet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "CLIENT_DONE_GRACE", 0.05)
    async with spdy_upgrade(kubelet.server, "/portForward/default/p", "portforward.k8s.io") as peer:
        error = peer.open(streamtype="error", port="8080", requestid="0")
        peer.send(error, b"", fin=True)  # as client-go does: it only reads it
        data = peer.open(streamtype="data", port="8080", requestid="0")
        peer.send(data, b"ping", fin=True)
        await peer.until(lambda p: p.data(data) == b"echo:ping")
        [connection] = kubelet.provider.connections
        # The session stays; this connection's pod side goes, and its streams end.
        await asyncio.wait_for(connection.closed.wait(), TIMEOUT)
        await peer.until(lambda p: p.finished(data) and p.finished(error))
        assert not peer.eof
        # Both halves of both streams closed: the session keeps neither (a long forward
        # of many connections grew by each).
        (session,) = [
            o for o in gc.get_objects() if isinstance(o, SpdySession) and not o.closed.is_set()
        ]
        assert session._streams == {}


async def test_a_half_close_sent_as_headers_closes_the_pods_connection_soon(
    kubelet: Kubelet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SPDY lets a peer half-close with HEADERS and FIN as with DATA: it was dropped, and
    the pod's connection stayed open for the session's life."""
    monkeypatch.setattr(server_module, "CLIENT_DONE_GRACE", 0.05)
    async with spdy_upgrade(kubelet.server, "/portForward/default/p", "portforward.k8s.io") as peer:
        peer.open(streamtype="error", port="8080", requestid="0")
        data = peer.open(streamtype="data", port="8080", requestid="0")
        peer.send(data, b"ping")
        await peer.until(lambda p: p.data(data) == b"echo:ping")
        peer.spdy.headers(data, {}, fin=True)
        peer.flush()
        [connection] = kubelet.provider.connections
        await asyncio.wait_for(connection.closed.wait(), TIMEOUT)


async def test_a_second_stream_of_a_kind_or_one_of_no_kind_is_reset(kubelet: Kubelet) -> None:
    """Kept unread, what it was sent held the session's read budget, and past it every
    connection of the session stalled."""
    async with spdy_upgrade(kubelet.server, "/portForward/default/p", "portforward.k8s.io") as peer:
        data = peer.open(streamtype="data", port="8080", requestid="0")
        again = peer.open(streamtype="data", port="8080", requestid="0")
        odd = peer.open(streamtype="other", port="8080", requestid="0")
        peer.open(streamtype="error", port="8080", requestid="0")
        peer.send(data, b"ping")

        def reset(p: SpdyPeer, stream: int) -> bool:
            return any(isinstance(e, StreamReset) and e.stream_id == stream for e in p.events)

        await peer.until(
            lambda p: p.data(data) == b"echo:ping" and reset(p, again) and reset(p, odd)
        )
        assert len(kubelet.provider.connections) == 1


async def test_half_a_port_forward_pair_is_reset_after_the_creation_timeout(
    kubelet: Kubelet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "STREAM_CREATION_TIMEOUT", 0.2)
    async with spdy_upgrade(kubelet.server, "/portForward/default/p", "portforward.k8s.io") as peer:
        lonely = peer.open(streamtype="data", port="8080", requestid="7")
        await peer.until(
            lambda p: any(isinstance(e, StreamReset) and e.stream_id == lonely for e in p.events)
        )
    assert kubelet.provider.connections == []


@pytest.mark.parametrize(
    "path", ["/portForward/default/p", "/exec/default/p/app?command=ls&output=1"]
)
async def test_spdy_without_a_common_protocol_is_403(kubelet: Kubelet, path: str) -> None:
    reader, writer = await spdy_request(kubelet.server, path, "foo")
    try:
        status, headers, body = await read_response(reader)
    finally:
        writer.close()
    assert status == 403
    assert headers["content-type"].startswith("text/plain")
    assert "offered foo" in body.decode()
    assert kubelet.provider.processes == []


def _syn_stream(raw_block: bytes) -> bytes:
    compressor = zlib.compressobj(zdict=HEADER_DICTIONARY)
    block = compressor.compress(raw_block) + compressor.flush(zlib.Z_SYNC_FLUSH)
    return control_frame(3, 1, struct.pack(">IIBB", 1, 0, 0, 0) + block)


def _pair(name: bytes, value: bytes) -> bytes:
    return struct.pack(">I", len(name)) + name + struct.pack(">I", len(value)) + value


HOSTILE = {
    "version 2 SYN_STREAM": control_frame(2, 1, bytes(10)),
    "undecompressible headers": control_frame(3, 1, struct.pack(">IIBB", 1, 0, 0, 0) + b"garbage!"),
    "uppercase header name": _syn_stream(struct.pack(">I", 1) + _pair(b"StreamType", b"data")),
    "header pair count beyond the block": _syn_stream(struct.pack(">I", 1_000_000)),
    "DATA on stream 0": struct.pack(">II", 0, 4) + b"abcd",
    "short PING": control_frame(3, 6, b"\x00\x00\x01"),
    "long GOAWAY": control_frame(3, 7, bytes(12)),
}


@pytest.mark.parametrize("frames", HOSTILE.values(), ids=HOSTILE.keys())
async def test_hostile_spdy_peer_is_disconnected_and_the_server_goes_on(
    kubelet: Kubelet, frames: bytes
) -> None:
    async with spdy_upgrade(kubelet.server, "/portForward/default/p", "portforward.k8s.io") as peer:
        peer.writer.write(frames)
        await peer.until(lambda p: False)
    assert peer.eof
    goaways = [e for e in peer.events if isinstance(e, GoAwayReceived)]
    assert [g.status for g in goaways] == [GoAwayStatus.PROTOCOL_ERROR]
    assert kubelet.provider.connections == []
    pods = await kubelet.client.get("/pods", headers=AUTH)
    assert pods.status == 200 and (await pods.json())["kind"] == "PodList"


async def test_spdy_peer_leaving_mid_frame_is_disconnected(kubelet: Kubelet) -> None:
    # 24 bits of length cannot exceed the largest frame allowed; the peer then gives up.
    async with spdy_upgrade(kubelet.server, "/portForward/default/p", "portforward.k8s.io") as peer:
        peer.writer.write(struct.pack(">II", 1, 0xFFFFFF) + bytes(1024))
        peer.writer.write_eof()
        await peer.until(lambda p: False)
    assert peer.eof
    pods = await kubelet.client.get("/pods", headers=AUTH)
    assert pods.status == 200


# --- streaming idle timeout ------------------------------------------------------------------


async def test_an_idle_spdy_session_is_closed_and_its_lower_connection_with_it() -> None:
    """A client that neither sends nor reads holds no connection for good."""
    async with serving(streaming_idle_timeout=0.5) as kubelet:
        async with spdy_upgrade(
            kubelet.server, "/portForward/default/p", "portforward.k8s.io"
        ) as peer:
            peer.open(streamtype="error", port="8080", requestid="0")
            peer.open(streamtype="data", port="8080", requestid="0")
            await peer.until(lambda p: False)  # until the server hangs up
        assert peer.eof and any(isinstance(e, GoAwayReceived) for e in peer.events)
        [connection] = kubelet.provider.connections
        await asyncio.wait_for(connection.closed.wait(), TIMEOUT)


async def test_an_idle_websocket_exec_is_closed_but_a_busy_one_is_not() -> None:
    async with serving(streaming_idle_timeout=0.5) as kubelet:
        socket = await kubelet.client.ws_connect(
            "/exec/default/p/app?command=cat&input=1&output=1",
            protocols=(channels.V5_PROTOCOL,),
            headers=AUTH,
        )
        for _ in range(6):  # three idle timeouts, never idle for one
            await socket.send_bytes(bytes([channels.STDIN]) + b"x")
            await asyncio.sleep(0.25)
        assert not socket.closed
        async with asyncio.timeout(TIMEOUT):
            async for _message in socket:
                pass  # what the server sent until it closed the idle socket
        assert socket.closed
        [(_container, _attach, process)] = kubelet.provider.processes
        await asyncio.wait_for(process.closed.wait(), TIMEOUT)


class FloodingProcess(EchoProcess):
    """Writes on stdout without end, whether anyone reads or not."""

    async def output(self) -> AsyncIterator[tuple[int, bytes]]:
        while True:
            yield channels.STDOUT, bytes(65536)


async def test_an_idle_session_whose_client_reads_nothing_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session goes idle with our writes waiting for a client that reads nothing (a
    suspended kubectl): its goodbye would wait for good too, so the connection goes."""
    monkeypatch.setattr(server_module, "IDLE_CLOSE_SECONDS", 0.2)
    started: list[FloodingProcess] = []
    made = asyncio.Event()

    def flooding(options: ExecOptions) -> EchoProcess:
        started.append(FloodingProcess(options))
        made.set()
        return started[0]

    async with (
        serving(FakeProvider(flooding), streaming_idle_timeout=0.5) as kubelet,
        spdy_upgrade(
            kubelet.server, "/exec/default/p/app?command=yes&output=1", channels.V5_PROTOCOL
        ) as peer,
    ):
        peer.open(streamtype="error")
        peer.open(streamtype="stdout")
        # Nothing is read from here on.
        async with asyncio.timeout(TIMEOUT):
            await made.wait()
            await started[0].closed.wait()


class QuietProvider(FakeProvider):
    """A followed log that writes one line, then no more; says when its stream ended."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = asyncio.Event()

    async def container_logs(
        self, pod: Mapping[str, Any], container: str, options: LogOptions
    ) -> AsyncGenerator[bytes, None]:
        try:
            yield LOG_CHUNKS[0]
            await asyncio.Event().wait()
        finally:
            self.closed.set()


async def test_a_stopping_server_ends_the_streams_still_open_within_its_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp waits 60 s for open handlers by default: past a pod's 30 s grace, so the
    process would be killed before it let go of its leader Lease. The lower log stream
    ends with the handler (it was left open, and the handler failed closing it)."""
    ca = pki.create_ca(tmp_path, "test")
    pair = pki.issue(ca, tmp_path / "server", "server", server_names=("127.0.0.1",))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = VirtualNodeConfig(
        "l", "c", client_ca_file=str(ca.cert_path), address="127.0.0.1", kubelet_port=port
    )
    provider = QuietProvider()
    runner, reloading = await serve_kubelet_api(
        config,
        provider,  # type: ignore[arg-type]
        FakeAuthorizer(),
        pair,
    )
    try:
        async with aiohttp.ClientSession() as session:
            response = await session.get(
                f"https://127.0.0.1:{port}/containerLogs/default/p/app?follow=true",
                headers={"Authorization": "Bearer alice"},
                ssl=False,
            )
            assert await response.content.readexactly(len(LOG_CHUNKS[0])) == LOG_CHUNKS[0]
            # Well within a pod's 30 s grace (aiohttp's own wait would be 60 s).
            assert KUBELET_API_SHUTDOWN_SECONDS < 10
            async with asyncio.timeout(20):
                await runner.cleanup()
            assert provider.closed.is_set()
            assert "Error handling request" not in caplog.text
    finally:
        reloading.cancel()
