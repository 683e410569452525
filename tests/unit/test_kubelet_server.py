"""The kubelet API server in process, over plain HTTP: authentication, routing, logs, the
WebSocket and SPDY/3.1 streaming protocols, and what hostile SPDY peers get."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

import pytest
from aiohttp import ClientResponse, WSMsgType
from aiohttp.test_utils import BaseTestServer, TestClient, TestServer

from virtual_node.kubeletapi import channels
from virtual_node.kubeletapi import server as server_module
from virtual_node.kubeletapi.auth import AuthError, Authorizer, User, node_attributes
from virtual_node.kubeletapi.provider import (
    JSON,
    ExecOptions,
    LogOptions,
    PortConnection,
    ProviderError,
    RemoteProcess,
)
from virtual_node.kubeletapi.server import KubeletServer
from virtual_node.kubeletapi.spdy import (
    HEADER_DICTIONARY,
    DataReceived,
    Event,
    GoAwayReceived,
    GoAwayStatus,
    SpdyConnection,
    StreamReplied,
    StreamReset,
)

POD: JSON = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "p", "namespace": "default", "uid": "0b1c"},
    "spec": {
        "nodeName": "vn-1",
        "initContainers": [{"name": "setup"}],
        "containers": [{"name": "app"}, {"name": "broken"}],
    },
    "status": {
        "initContainerStatuses": [
            {"name": "setup", "image": "busybox", "state": {"terminated": {"exitCode": 0}}}
        ],
        "containerStatuses": [
            {"name": "app", "image": "pause:3.10", "state": {"running": {}}},
            {"name": "broken", "image": "pause:3.10", "state": {"waiting": {}}},
        ],
    },
}
LOG_CHUNKS = (b"line one\n", b"line two\n", b"line three\n")
AUTH = {"Authorization": "Bearer alice"}
TIMEOUT = 3.0


class EchoProcess:
    """Writes back on stdout what arrives on stdin (and on stderr, upper-cased, if asked)."""

    def __init__(self, options: ExecOptions) -> None:
        self.options = options
        self.resizes: list[bytes] = []
        self.closed = asyncio.Event()
        self._stdin: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def send_stdin(self, data: bytes) -> None:
        await self._stdin.put(data)

    async def close_stdin(self) -> None:
        await self._stdin.put(None)

    async def resize(self, payload: bytes) -> None:
        self.resizes.append(payload)

    async def output(self) -> AsyncIterator[tuple[int, bytes]]:
        while (data := await self._stdin.get()) is not None:
            yield channels.STDOUT, data
            if self.options.stderr:
                yield channels.STDERR, data.upper()

    def status(self) -> bytes:
        return channels.exit_code_status(3, self.options.command)

    async def close(self) -> None:
        self.closed.set()


class EchoConnection:
    """A pod port that answers b"echo:" + what it got."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.closed = asyncio.Event()
        self._replies: asyncio.Queue[bytes] = asyncio.Queue()

    async def send(self, data: bytes) -> None:
        await self._replies.put(b"echo:" + data)

    async def receive(self) -> bytes:
        return await self._replies.get()

    def error(self) -> str:
        return ""

    async def close(self) -> None:
        self.closed.set()
        self._replies.put_nowait(b"")


class FakeProvider:
    """One pod, default/p; port 81 has nothing listening."""

    def __init__(self) -> None:
        self.log_requests: list[tuple[str, LogOptions]] = []
        self.processes: list[tuple[str, bool, EchoProcess]] = []
        self.connections: list[EchoConnection] = []

    def pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return POD if (namespace, name) == ("default", "p") else None

    def pods(self) -> list[JSON]:
        return [POD]

    async def container_logs(
        self, pod: Mapping[str, Any], container: str, options: LogOptions
    ) -> AsyncGenerator[bytes, None]:
        self.log_requests.append((container, options))
        if container == "broken":
            raise ProviderError(502, "lower cluster: the log stream broke")
        for chunk in LOG_CHUNKS:
            await asyncio.sleep(0)
            yield chunk

    async def exec(
        self, pod: Mapping[str, Any], container: str, options: ExecOptions, *, attach: bool
    ) -> RemoteProcess:
        process = EchoProcess(options)
        self.processes.append((container, attach, process))
        return process

    async def port_forward(self, pod: Mapping[str, Any], port: int) -> PortConnection:
        if port == 81:
            raise ProviderError(502, "lower cluster: nothing listens on port 81")
        connection = EchoConnection(port)
        self.connections.append(connection)
        return connection

    async def stats_summary(self) -> JSON:
        return {"node": {"nodeName": "vn-1"}, "pods": []}

    async def resource_metrics(self) -> str:
        return "# TYPE node_cpu_usage_seconds_total counter\nnode_cpu_usage_seconds_total 1 2\n"


class FakeAuthorizer(Authorizer):
    """Bearer <name> is user <name>; mallory may do nothing, stats-reader only stats."""

    def __init__(self) -> None:  # no upper apiserver to ask
        self.checks: list[tuple[str, str, str]] = []

    async def authenticate(self, peercert: dict[str, Any] | None, authorization: str) -> User:
        if not authorization:
            raise AuthError(401, "Unauthorized: no client certificate or bearer token")
        return User(authorization.removeprefix("Bearer "))

    async def authorize(self, user: User, method: str, path: str) -> None:
        self.checks.append((user.name, method, path))
        verb, subresource = node_attributes(method, path)
        if user.name == "mallory" or (user.name == "stats-reader" and subresource != "stats"):
            raise AuthError(403, f"Forbidden (user={user.name}, verb={verb}, resource=nodes)")


class Kubelet:
    def __init__(
        self, client: TestClient[Any, Any], provider: FakeProvider, authorizer: FakeAuthorizer
    ) -> None:
        self.client = client
        self.server = client.server
        self.provider = provider
        self.authorizer = authorizer


@pytest.fixture
async def kubelet() -> AsyncIterator[Kubelet]:
    provider, authorizer = FakeProvider(), FakeAuthorizer()
    server = TestServer(KubeletServer(provider, authorizer).app())
    async with TestClient(server) as client:
        yield Kubelet(client, provider, authorizer)


async def status_of(response: ClientResponse) -> tuple[int, JSON]:
    body: JSON = await response.json()
    assert body["kind"] == "Status" and body["status"] == "Failure"
    assert body["code"] == response.status
    return response.status, body


# --- plain HTTP ------------------------------------------------------------------------------


async def test_no_credentials_is_401_before_anything_else(kubelet: Kubelet) -> None:
    for path in ("/pods", "/containerLogs/default/p/app", "/no/such/route"):
        code, body = await status_of(await kubelet.client.get(path))
        assert (code, body["reason"]) == (401, "Unauthorized")
    assert kubelet.authorizer.checks == []
    assert kubelet.provider.log_requests == []


async def test_forbidden_user_is_403_and_reaches_no_pod(kubelet: Kubelet) -> None:
    response = await kubelet.client.get(
        "/containerLogs/default/p/app", headers={"Authorization": "Bearer mallory"}
    )
    code, body = await status_of(response)
    assert (code, body["reason"]) == (403, "Forbidden")
    assert "user=mallory" in body["message"]
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
    code, body = await status_of(response)
    assert (code, body["reason"]) == (502, "InternalError")
    assert body["message"] == "lower cluster: the log stream broke"


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
        ("/exec/default/p/nope?command=ls&output=1", 404, "container 'nope'"),
        ("/attach/default/p/app?output=1", 400, "Upgrade:"),
        ("/portForward/default/p", 400, "Upgrade:"),
        ("/portForward/default/nope", 404, "pod default/nope not found"),
    ],
)
async def test_bad_requests_are_statuses(
    kubelet: Kubelet, path: str, code: int, words: str
) -> None:
    method = "POST" if path.startswith(("/exec", "/attach", "/portForward")) else "GET"
    response = await kubelet.client.request(method, path, headers=AUTH)
    got, body = await status_of(response)
    assert got == code
    assert words in body["message"]
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
    announced = [await socket.receive_bytes(timeout=TIMEOUT) for _ in range(3)]
    assert announced == [
        bytes([channels.STDOUT]),
        bytes([channels.STDERR]),
        bytes([channels.ERROR]),
    ]
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
    _code, body = await status_of(response)
    assert body["message"].startswith("Sec-WebSocket-Protocol")


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


async def test_websocket_port_forward_closes_opened_ports_when_one_fails(kubelet: Kubelet) -> None:
    response = await kubelet.client.post(
        "/portForward/default/p?port=8080&port=81",
        headers={
            **WEBSOCKET_UPGRADE,
            "Sec-WebSocket-Protocol": channels.V4_PROTOCOL,
        },
    )
    code, body = await status_of(response)
    assert code == 502 and "port 81" in body["message"]
    [opened] = kubelet.provider.connections
    assert opened.closed.is_set()


# --- SPDY/3.1 --------------------------------------------------------------------------------


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    async with asyncio.timeout(TIMEOUT):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


class SpdyPeer:
    """The client end of an upgraded connection: a sans-IO SPDY client over raw streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.spdy = SpdyConnection(client_side=True)
        self.events: list[Event] = []
        self.eof = False

    def open(self, **headers: str) -> int:
        stream_id = self.spdy.open_stream(headers)
        self.flush()
        return stream_id

    def send(self, stream_id: int, data: bytes, *, fin: bool = False) -> None:
        self.spdy.send_data(stream_id, data, fin=fin)
        self.flush()

    def flush(self) -> None:
        self.writer.write(self.spdy.data_to_send())

    async def until(self, done: Callable[[SpdyPeer], bool]) -> None:
        async with asyncio.timeout(TIMEOUT):
            while not done(self) and not self.eof:
                data = await self.reader.read(65536)
                if not data:
                    self.eof = True
                else:
                    self.events += self.spdy.receive_data(data)

    def data(self, stream_id: int) -> bytes:
        return b"".join(
            e.data for e in self.events if isinstance(e, DataReceived) and e.stream_id == stream_id
        )

    def finished(self, stream_id: int) -> bool:
        return any(
            isinstance(e, DataReceived) and e.stream_id == stream_id and e.fin for e in self.events
        )


async def spdy_request(
    server: BaseTestServer, path: str, protocols: str, authorization: str = "Bearer alice"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: kubelet\r\nConnection: Upgrade\r\n"
        f"Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: {protocols}\r\n"
        f"Authorization: {authorization}\r\nContent-Length: 0\r\n\r\n".encode()
    )
    return reader, writer


@contextlib.asynccontextmanager
async def spdy_upgrade(
    server: BaseTestServer, path: str, protocols: str
) -> AsyncIterator[SpdyPeer]:
    reader, writer = await spdy_request(server, path, protocols)
    try:
        async with asyncio.timeout(TIMEOUT):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        assert head.startswith("http/1.1 101 ")
        assert "upgrade: spdy/3.1\r\n" in head
        assert f"x-stream-protocol-version: {protocols.split(',')[0].lower()}\r\n" in head
        yield SpdyPeer(reader, writer)
    finally:
        writer.close()


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
    assert headers["content-type"].startswith("application/json")
    status_body = json.loads(body)
    assert status_body["reason"] == "Forbidden"
    assert "offered foo" in status_body["message"]
    assert kubelet.provider.processes == []


def _control(version: int, frame_type: int, payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">HHI", 0x8000 | version, frame_type, flags << 24 | len(payload)) + payload


def _syn_stream(raw_block: bytes) -> bytes:
    compressor = zlib.compressobj(zdict=HEADER_DICTIONARY)
    block = compressor.compress(raw_block) + compressor.flush(zlib.Z_SYNC_FLUSH)
    return _control(3, 1, struct.pack(">IIBB", 1, 0, 0, 0) + block)


def _pair(name: bytes, value: bytes) -> bytes:
    return struct.pack(">I", len(name)) + name + struct.pack(">I", len(value)) + value


HOSTILE = {
    "version 2 SYN_STREAM": _control(2, 1, bytes(10)),
    "undecompressible headers": _control(3, 1, struct.pack(">IIBB", 1, 0, 0, 0) + b"garbage!"),
    "uppercase header name": _syn_stream(struct.pack(">I", 1) + _pair(b"StreamType", b"data")),
    "header pair count beyond the block": _syn_stream(struct.pack(">I", 1_000_000)),
    "DATA on stream 0": struct.pack(">II", 0, 4) + b"abcd",
    "short PING": _control(3, 6, b"\x00\x00\x01"),
    "long GOAWAY": _control(3, 7, bytes(12)),
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
