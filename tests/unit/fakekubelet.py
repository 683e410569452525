"""An in-process kubelet API server with a fake provider and authorizer, and the client
ends of its streaming protocols: shared by the server tests and the fuzz tests."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

from aiohttp.test_utils import BaseTestServer, TestClient, TestServer
from aiohttp.web_runner import BaseRunner

from virtual_node.kubeletapi import channels
from virtual_node.kubeletapi.auth import AuthError, Authorizer, User, node_attributes
from virtual_node.kubeletapi.provider import (
    JSON,
    ExecOptions,
    LogOptions,
    PortConnection,
    ProviderError,
    RemoteProcess,
)
from virtual_node.kubeletapi.server import RUNNER_OPTIONS, STREAMING_IDLE_TIMEOUT, KubeletServer
from virtual_node.kubeletapi.spdy import DataReceived, Event, SpdyConnection

POD: JSON = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "p", "namespace": "default", "uid": "0b1c"},
    "spec": {
        "nodeName": "vn-1",
        "initContainers": [{"name": "setup"}],
        "containers": [{"name": "app"}, {"name": "broken"}, {"name": "cut-short"}],
    },
    "status": {
        "initContainerStatuses": [
            {"name": "setup", "image": "busybox", "state": {"terminated": {"exitCode": 0}}}
        ],
        "containerStatuses": [
            {"name": "app", "image": "pause:3.10", "state": {"running": {}}},
            {"name": "broken", "image": "pause:3.10", "state": {"waiting": {}}},
            {"name": "cut-short", "image": "pause:3.10", "state": {"waiting": {}}},
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
    """One pod, default/p; port 81 has nothing listening. Exec runs ``process_type``."""

    def __init__(self, process_type: Callable[[ExecOptions], EchoProcess] = EchoProcess) -> None:
        self.process_type = process_type
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
            if container == "cut-short":
                raise ProviderError(502, "the lower log stream broke")

    async def exec(
        self, pod: Mapping[str, Any], container: str, options: ExecOptions, *, attach: bool
    ) -> RemoteProcess:
        process = self.process_type(options)
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

    async def cadvisor_metrics(self) -> str:
        return "# TYPE container_cpu_usage_seconds_total counter\n"


class FakeAuthorizer(Authorizer):
    """Bearer <name> is user <name>; mallory may do nothing, stats-reader only stats."""

    def __init__(self) -> None:  # no upper apiserver to ask
        self.checks: list[tuple[str, str, str]] = []

    async def authenticate(
        self, peercert: dict[str, Any] | None, authorization: str, audience: str | None = None
    ) -> User:
        if not authorization:
            raise AuthError(401, "Unauthorized: no client certificate or bearer token")
        return User(authorization.removeprefix("Bearer "))

    async def authorize(self, user: User, method: str, path: str) -> None:
        self.checks.append((user.name, method, path))
        verb, subresources = node_attributes(method, path)
        if user.name == "mallory" or (user.name == "stats-reader" and "stats" not in subresources):
            raise AuthError(403, f"Forbidden (user={user.name}, verb={verb}, resource=nodes)")


class Kubelet:
    def __init__(
        self, client: TestClient[Any, Any], provider: FakeProvider, authorizer: FakeAuthorizer
    ) -> None:
        self.client = client
        self.server = client.server
        self.provider = provider
        self.authorizer = authorizer


class KubeletTestServer(TestServer):
    """Served as virtual_node.main serves it: aiohttp's test server would cancel a handler
    whose client left, which production does not, and so hide handlers that never end."""

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        kwargs.pop("handler_cancellation", None)
        return await super()._make_runner(**kwargs, **RUNNER_OPTIONS)


@contextlib.asynccontextmanager
async def serving(
    provider: FakeProvider | None = None, streaming_idle_timeout: float = STREAMING_IDLE_TIMEOUT
) -> AsyncIterator[Kubelet]:
    """A kubelet API server on 127.0.0.1 and a client of it, for the time of the block."""
    provider = provider or FakeProvider()
    authorizer = FakeAuthorizer()
    kubelet = KubeletServer(provider, authorizer, streaming_idle_timeout)
    server = KubeletTestServer(kubelet.app(), host="127.0.0.1")
    async with TestClient(server) as client:
        yield Kubelet(client, provider, authorizer)


async def read_response(
    reader: asyncio.StreamReader, *, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: status, headers (lowercase names) and the whole body."""
    async with asyncio.timeout(TIMEOUT):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if method == "HEAD" or status in (101, 204, 304):
            body = b""
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = await _read_chunks(reader)
        else:
            body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def _read_chunks(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)
    await reader.readuntil(b"\r\n")  # no trailers are sent: the empty line that ends them
    return b"".join(chunks)


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
                try:
                    data = await self.reader.read(65536)
                except ConnectionResetError:
                    data = b""  # the server closed with bytes of ours unread
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


def control_frame(version: int, frame_type: int, payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">HHI", 0x8000 | version, frame_type, flags << 24 | len(payload)) + payload
