"""Random and hostile input against the kubelet API server on 127.0.0.1: request targets
and queries, SPDY/3.1 and WebSocket traffic after a valid upgrade, oversized headers and
frames, clients that stop reading. Every case must end in a status below 500 (or the
provider's own error) or a clean close within a bound, with every exec session and port
connection it opened closed, nothing logged as an error, and the server answering the
next valid request. Examples are few and share one server: that it survives them all is
part of the point."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import pytest
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.test_utils import BaseTestServer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.unit.fakekubelet import (
    AUTH,
    TIMEOUT,
    EchoProcess,
    FakeProvider,
    Kubelet,
    SpdyPeer,
    control_frame,
    read_response,
    serving,
    spdy_upgrade,
)
from virtual_node.kubeletapi import channels, spdysession
from virtual_node.kubeletapi import server as server_module
from virtual_node.kubeletapi.provider import ExecOptions, LogOptions, PortConnection, RemoteProcess
from virtual_node.kubeletapi.spdy import (
    GoAwayReceived,
    GoAwayStatus,
    LocalProtocolError,
    PingAcknowledged,
    StreamReset,
)

# One server across all examples of a test: a fixture shared by examples is the intent.
FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
EXEC_PATH = "/exec/default/p/app?command=cat&input=1&output=1&error=1"


async def settled(kubelet: Kubelet, caplog: pytest.LogCaptureFixture) -> None:
    """What must hold after every case, whatever the client did."""
    processes = [process for _, _, process in kubelet.provider.processes]
    waits = [p.closed.wait() for p in processes] + [
        c.closed.wait() for c in kubelet.provider.connections
    ]
    try:
        async with asyncio.timeout(TIMEOUT):
            await asyncio.gather(*waits)
    except TimeoutError:
        pytest.fail("an exec session or port connection outlived its client")
    assert server_errors(caplog) == []
    healthz = await kubelet.client.get("/healthz", headers=AUTH)
    assert healthz.status == 200 and await healthz.text() == "ok"


def server_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What was logged as an error, less aiohttp's reports of requests it could not parse
    (answered 400: the client's fault, however loudly aiohttp logs them)."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno >= logging.ERROR
        and not (record.exc_info and isinstance(record.exc_info[1], HttpProcessingError))
    ]


async def eof_within(reader: asyncio.StreamReader, bound: float = TIMEOUT) -> None:
    """Reads and drops what the server sends until it closes, failing after ``bound``."""
    async with asyncio.timeout(bound):
        with contextlib.suppress(ConnectionResetError):
            while await reader.read(65536):
                pass


# --- request targets and queries ---------------------------------------------------------

texts = st.text(st.characters(codec="utf-8"), max_size=12)
segments = st.one_of(
    st.sampled_from(["default", "p", "app", "setup", "broken", "nope", "", ".", ".."]),
    st.sampled_from(["%2e%2e", "%2F", "%00", "%ff", "%", "%zz", "%E2%88%95", "a%20b"]),
    texts.map(lambda text: quote(text, safe="")),
    texts,  # unencoded: spaces, controls and non-ASCII on the request line
)
paths = st.one_of(
    st.builds("/containerLogs/{}/{}/{}".format, segments, segments, segments),
    st.builds(
        "/{}/{}/{}/{}".format, st.sampled_from(["exec", "attach"]), segments, segments, segments
    ),
    st.builds("/portForward/{}/{}".format, segments, segments),
    st.sampled_from(
        [
            "/stats/summary",
            "/metrics/resource",
            "/runningpods/",
            "/pods",
            "/healthz",
            "/",
            "*",
            "//pods",
            "/stats/../exec/default/p/app",
            "http://kubelet/pods",
        ]
    ),
    st.lists(segments, max_size=5).map(lambda parts: "/" + "/".join(parts)),
)
query_names = st.one_of(
    st.sampled_from(
        [
            "command",
            "input",
            "output",
            "error",
            "stdin",
            "stdout",
            "stderr",
            "tty",
            "port",
            "follow",
            "tailLines",
            "limitBytes",
            "previous",
            "sinceSeconds",
            "sinceTime",
            "timestamps",
        ]
    ),
    texts,
)
query_values = st.one_of(
    st.sampled_from(["true", "false", "1", "0", "", "-1", "TRUE", "yes", "8080", "81", "8080,81"]),
    st.sampled_from(["2024-05-01T10:20:30Z", "65536", "\u0663", "\uff11", " 1", "1_0", "0x10"]),
    st.integers(-(2**70), 2**70).map(str),
    texts,
    st.just("9" * 5000),  # beyond int()'s digit limit
)
queries = st.lists(st.tuples(query_names, query_values, st.booleans()), max_size=6).map(
    lambda pairs: "&".join(
        f"{quote(name) if encode else name}={quote(value) if encode else value}"
        for name, value, encode in pairs
    )
)
WEBSOCKET = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Version": "13",
    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
}


def spdy_headers(protocols: str) -> dict[str, str]:
    return {"Connection": "Upgrade", "Upgrade": "SPDY/3.1", "X-Stream-Protocol-Version": protocols}


upgrades = st.one_of(
    st.just({}),
    st.builds(
        spdy_headers,
        st.sampled_from(["v5.channel.k8s.io", "portforward.k8s.io", "bogus", "", ", ,"]),
    ),
    st.builds(
        lambda protocols: {**WEBSOCKET, "Sec-WebSocket-Protocol": protocols},
        st.sampled_from(["v5.channel.k8s.io", "v4.base64.channel.k8s.io", "chat", ""]),
    ),
    st.just(WEBSOCKET),
    st.just({"Connection": "Upgrade", "Upgrade": "websocket"}),
)
authorizations = st.sampled_from(["Bearer alice", "", "Bearer mallory", "Bearer stats-reader"])


def request_bytes(method: str, target: str, headers: Mapping[str, str]) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: kubelet", "Content-Length: 0"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if "Upgrade" not in headers:
        lines.append("Connection: close")
    # Lone surrogates go out as the invalid UTF-8 they stand for.
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogatepass")


async def exchange(
    server: BaseTestServer, method: str, request: bytes
) -> tuple[int, dict[str, str], bytes] | None:
    """The response to a raw request; None when the server hung up without one."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(request)
        try:
            return await read_response(reader, method=method)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None
    finally:
        writer.close()


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "get", "X"]),
    path=paths,
    query=queries,
    upgrade=upgrades,
    authorization=authorizations,
)
@example(
    method="POST",
    path="/exec/default/p/app",
    query="command=cat&input=1&output=1",
    upgrade={**WEBSOCKET, "Sec-WebSocket-Protocol": "v5.channel.k8s.io"},
    authorization="Bearer alice",
).via("a WebSocket exec client leaving at once kept the session open")
async def test_any_request_target_gets_a_status_below_500(
    kubelet: Kubelet,
    caplog: pytest.LogCaptureFixture,
    method: str,
    path: str,
    query: str,
    upgrade: dict[str, str],
    authorization: str,
) -> None:
    caplog.clear()
    headers = {**upgrade, "Authorization": authorization} if authorization else upgrade
    target = f"{path}?{query}" if query else path
    response = await exchange(kubelet.server, method, request_bytes(method, target, headers))
    if response is not None:
        status, _headers, body = response
        provider_failure = status == 502 and b"lower cluster:" in body
        assert status < 500 or provider_failure, (status, body)
        assert status != 101 or upgrade
    await settled(kubelet, caplog)


# --- SPDY/3.1 after a valid upgrade --------------------------------------------------------


class Action(Protocol):
    """One thing a SPDY client does; True when the client no longer knows the state the
    server's codec is in (it sent bytes that are not the frames its own codec made)."""

    def apply(self, peer: SpdyPeer, opened: list[int], out: bytearray) -> bool: ...


def _pick(opened: list[int], index: int) -> int | None:
    return opened[index % len(opened)] if opened else None


@dataclass(frozen=True)
class Open:
    headers: dict[str, str]
    fin: bool

    def apply(self, peer: SpdyPeer, opened: list[int], out: bytearray) -> bool:
        opened.append(peer.spdy.open_stream(self.headers, fin=self.fin))
        return False


@dataclass(frozen=True)
class Data:
    index: int
    payload: bytes
    fin: bool

    def apply(self, peer: SpdyPeer, opened: list[int], out: bytearray) -> bool:
        if (stream := _pick(opened, self.index)) is not None:
            peer.spdy.send_data(stream, self.payload, fin=self.fin)
        return False


@dataclass(frozen=True)
class Headers:
    index: int
    headers: dict[str, str]
    fin: bool

    def apply(self, peer: SpdyPeer, opened: list[int], out: bytearray) -> bool:
        if (stream := _pick(opened, self.index)) is not None:
            peer.spdy.headers(stream, self.headers, fin=self.fin)
        return False


@dataclass(frozen=True)
class Reset:
    index: int

    def apply(self, peer: SpdyPeer, opened: list[int], out: bytearray) -> bool:
        if (stream := _pick(opened, self.index)) is not None:
            peer.spdy.reset(stream)
        return False


@dataclass(frozen=True)
class Raw:
    """Bytes the client codec did not make: well-formed frames of its own choosing, or not."""

    data: bytes
    confusing: bool

    def apply(self, peer: SpdyPeer, opened: list[int], out: bytearray) -> bool:
        out += self.data
        return self.confusing


header_names = st.one_of(
    st.sampled_from(["streamtype", "port", "requestid"]),
    st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=10),
)
header_values = st.one_of(
    st.sampled_from(["error", "stdin", "stdout", "stderr", "resize", "data", "8080", "81", "0"]),
    st.text(st.characters(max_codepoint=255), max_size=16),
)
header_blocks = st.dictionaries(header_names, header_values, max_size=4)
stream_ids = st.integers(0, 2**31 - 1)
words = st.integers(0, 2**32 - 1)
raw_frames = st.one_of(
    st.builds(lambda ping: control_frame(3, 6, struct.pack(">I", ping)), words),
    st.builds(
        lambda last, status: control_frame(3, 7, struct.pack(">II", last, status)), words, words
    ),
    st.builds(lambda sid, delta: control_frame(3, 9, struct.pack(">II", sid, delta)), words, words),
    st.builds(lambda sid, code: control_frame(3, 3, struct.pack(">II", sid, code)), words, words),
    st.builds(
        lambda entries: control_frame(
            3,
            4,
            struct.pack(">I", len(entries)) + b"".join(struct.pack(">II", *e) for e in entries),
        ),
        st.lists(st.tuples(words, words), max_size=3),
    ),
    st.builds(
        lambda sid, flags, payload: struct.pack(">II", sid, flags << 24 | len(payload)) + payload,
        stream_ids,
        st.integers(0, 255),
        st.binary(max_size=32),
    ),
).map(lambda frame: Raw(frame, confusing=False))
junk = st.one_of(
    st.builds(
        control_frame,
        st.integers(0, 0x7FFF),
        st.integers(0, 12),
        st.binary(max_size=40),
        st.integers(0, 255),
    ),
    st.binary(min_size=1, max_size=48),
).map(lambda data: Raw(data, confusing=True))
actions: st.SearchStrategy[Action] = st.one_of(
    st.builds(Open, header_blocks, st.booleans()),
    st.builds(Data, st.integers(0, 7), st.binary(max_size=64), st.booleans()),
    st.builds(Headers, st.integers(0, 7), header_blocks, st.booleans()),
    st.builds(Reset, st.integers(0, 7)),
    raw_frames,
    junk,
)
SPDY_TARGETS = {
    "exec": (EXEC_PATH, "v5.channel.k8s.io", ("error", "stdin", "stdout", "stderr")),
    "tty": (
        "/exec/default/p/app?command=sh&input=1&output=1&tty=1",
        "v4.channel.k8s.io",
        ("error", "stdin", "stdout", "resize"),
    ),
    "attach": ("/attach/default/p/app?output=1", "v5.channel.k8s.io", ("error", "stdout")),
    "port-forward": ("/portForward/default/p", "portforward.k8s.io", ()),
}
CLIENT_PING = 0x7FFFFFFF  # odd: a client's


@FUZZ
@given(
    target=st.sampled_from(sorted(SPDY_TARGETS)),
    handshake=st.booleans(),
    steps=st.lists(actions, max_size=10),
    pieces=st.lists(st.integers(1, 64), max_size=4),
)
@example(
    target="exec",
    handshake=False,
    steps=[Open({"streamtype": "stdin"}, fin=False), Reset(0)],
    pieces=[],
).via("a stream reset in the same read as its SYN_STREAM failed data_received")
async def test_spdy_traffic_after_an_upgrade_ends_cleanly(
    kubelet: Kubelet,
    caplog: pytest.LogCaptureFixture,
    target: str,
    handshake: bool,
    steps: list[Action],
    pieces: list[int],
) -> None:
    caplog.clear()
    path, protocol, streams = SPDY_TARGETS[target]
    async with spdy_upgrade(kubelet.server, path, protocol) as peer:
        opened: list[int] = []
        out = bytearray()
        confused = False
        if handshake:
            for streamtype in streams:
                opened.append(peer.spdy.open_stream({"streamtype": streamtype}))
        for step in steps:
            # The client codec refusing what the step asks is no input for the server.
            with contextlib.suppress(LocalProtocolError, ValueError):
                confused |= step.apply(peer, opened, out)
            out += peer.spdy.data_to_send()
        # In one write, or cut into pieces that land in separate reads of the server.
        with contextlib.suppress(ConnectionError):
            for size in pieces:
                peer.writer.write(out[:size])
                del out[:size]
                await peer.writer.drain()
            peer.writer.write(out)
            if not confused:
                # The server still reads and answers frames, unless it hung up.
                peer.spdy.ping(CLIENT_PING)
                peer.flush()
                await peer.until(
                    lambda p: any(
                        isinstance(e, PingAcknowledged) and e.ping_id == CLIENT_PING
                        for e in p.events
                    )
                )
            peer.writer.write_eof()
        await peer.until(lambda p: False)
        assert peer.eof
    await settled(kubelet, caplog)


# --- WebSocket after a valid upgrade -------------------------------------------------------


class Message(Protocol):
    def send(self, codec: channels.ChannelCodec) -> bytes | str: ...


@dataclass(frozen=True)
class Channel:
    number: int
    payload: bytes

    def send(self, codec: channels.ChannelCodec) -> bytes | str:
        if self.number < codec.channel_count:
            return codec.encode(self.number, self.payload)
        return bytes((self.number,)) + self.payload


@dataclass(frozen=True)
class Anything:
    message: bytes | str

    def send(self, codec: channels.ChannelCodec) -> bytes | str:
        return self.message


messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Channel, st.integers(0, 255), st.binary(max_size=32)),
    st.builds(Anything, st.binary(max_size=32)),
    st.builds(Anything, st.text(max_size=32)),
    st.builds(Anything, st.builds(lambda c: bytes((channels.CLOSE, c)), st.integers(0, 255))),
)
MARKER = b"still-echoing"


@FUZZ
@given(protocol=st.sampled_from(channels.EXEC_PROTOCOLS), sent=st.lists(messages, max_size=8))
async def test_websocket_messages_after_an_upgrade_end_cleanly(
    kubelet: Kubelet, caplog: pytest.LogCaptureFixture, protocol: str, sent: list[Message]
) -> None:
    caplog.clear()
    codec = channels.ChannelCodec(protocol, 5)
    socket = await kubelet.client.ws_connect(EXEC_PATH, protocols=(protocol,), headers=AUTH)
    try:
        for message in [*sent, Channel(channels.STDIN, MARKER)]:
            encoded = message.send(codec)
            if isinstance(encoded, str):
                await socket.send_str(encoded)
            else:
                await socket.send_bytes(encoded)
        # Unless stdin was closed, the session still echoes.
        echoed = b""
        async with asyncio.timeout(TIMEOUT):
            async for received in socket:
                decoded = codec.decode(received.data)
                if isinstance(decoded, channels.ChannelData) and decoded.channel == 1:
                    echoed += decoded.payload
                if MARKER in echoed:
                    break
    finally:
        async with asyncio.timeout(TIMEOUT):
            await socket.close()
    await settled(kubelet, caplog)


@dataclass(frozen=True)
class Frame:
    """A WebSocket frame as a client sends it, its header fields free to be wrong."""

    opcode: int
    payload: bytes
    fin: bool = True
    rsv: int = 0
    masked: bool = True
    announced: int | None = None

    def encode(self) -> bytes:
        length = len(self.payload) if self.announced is None else self.announced
        mask = 0x80 if self.masked else 0
        head = bytes(((0x80 if self.fin else 0) | self.rsv << 4 | self.opcode,))
        if length < 126:
            head += bytes((mask | length,))
        elif length < 1 << 16:
            head += bytes((mask | 126,)) + length.to_bytes(2, "big")
        else:
            head += bytes((mask | 127,)) + length.to_bytes(8, "big")
        if not self.masked:
            return head + self.payload
        key = b"\x37\xfa\x21\x3d"
        return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(self.payload))


frames = st.one_of(
    st.builds(Frame, st.sampled_from([0x1, 0x2, 0x9, 0xA, 0x8]), st.binary(max_size=40)),
    st.builds(
        Frame,
        st.integers(0, 15),
        st.binary(max_size=40),
        st.booleans(),
        st.integers(0, 7),
        st.booleans(),
        st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    ),
)


async def websocket_upgrade(
    server: BaseTestServer, path: str, protocol: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection past the 101 of a WebSocket handshake."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    headers = {**WEBSOCKET, **AUTH, "Sec-WebSocket-Protocol": protocol}
    writer.write(request_bytes("GET", path, headers))
    status, _headers, _body = await read_response(reader)
    assert status == 101
    return reader, writer


@FUZZ
@given(
    path=st.sampled_from([EXEC_PATH, "/portForward/default/p?port=8080&port=8081"]),
    sent=st.lists(st.one_of(frames.map(Frame.encode), st.binary(max_size=40)), max_size=8),
)
@example(path=EXEC_PATH, sent=[]).via(
    "a client leaving without closing stdin kept the exec session open"
)
async def test_raw_websocket_frames_end_in_a_close(
    kubelet: Kubelet, caplog: pytest.LogCaptureFixture, path: str, sent: list[bytes]
) -> None:
    caplog.clear()
    reader, writer = await websocket_upgrade(kubelet.server, path, channels.V4_PROTOCOL)
    try:
        with contextlib.suppress(ConnectionError):
            writer.write(b"".join(sent))
            writer.write_eof()
        await eof_within(reader)
    finally:
        writer.close()
    await settled(kubelet, caplog)


class GatedProvider(FakeProvider):
    """A lower cluster slow to start an exec, reach a port or send the first line of a
    log that then never grows: until ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.open_logs = 0

    async def container_logs(
        self, pod: Mapping[str, Any], container: str, options: LogOptions
    ) -> AsyncGenerator[bytes, None]:
        self.open_logs += 1
        try:
            await self.gate.wait()
            yield b"the first line\n"
            await asyncio.Event().wait()
        finally:
            self.open_logs -= 1

    async def exec(
        self, pod: Mapping[str, Any], container: str, options: ExecOptions, *, attach: bool
    ) -> RemoteProcess:
        await self.gate.wait()
        return await super().exec(pod, container, options, attach=attach)

    async def port_forward(self, pod: Mapping[str, Any], port: int) -> PortConnection:
        await self.gate.wait()
        return await super().port_forward(pod, port)


async def until(condition: Callable[[], bool]) -> None:
    """Polls, for what has no event to wait on; failing after TIMEOUT."""
    async with asyncio.timeout(TIMEOUT):
        while True:
            if condition():
                return
            await asyncio.sleep(0.01)


LEAVING = {
    "logs": ("GET", "/containerLogs/default/p/app?follow=1", {}),
    "websocket exec": (
        "GET",
        EXEC_PATH,
        {**WEBSOCKET, "Sec-WebSocket-Protocol": "v4.channel.k8s.io"},
    ),
    "spdy exec": ("POST", EXEC_PATH, spdy_headers(channels.V4_PROTOCOL)),
    "websocket port-forward": (
        "GET",
        "/portForward/default/p?port=8080&port=8081",
        {**WEBSOCKET, "Sec-WebSocket-Protocol": "v4.channel.k8s.io"},
    ),
}


@pytest.mark.parametrize("how", sorted(LEAVING))
async def test_a_client_leaving_while_the_lower_starts_leaves_nothing_open(
    caplog: pytest.LogCaptureFixture, how: str
) -> None:
    provider = GatedProvider()
    method, path, headers = LEAVING[how]
    async with serving(provider) as kubelet:
        _reader, writer = await asyncio.open_connection(kubelet.server.host, kubelet.server.port)
        writer.write(request_bytes(method, path, {**headers, **AUTH}))
        await until(lambda: len(server_transports(kubelet)) == 1)
        [transport] = server_transports(kubelet)
        writer.transport.abort()
        await until(transport.is_closing)
        provider.gate.set()
        await until(lambda: bool(provider.processes or provider.connections) or how == "logs")
        await until(lambda: provider.open_logs == 0)
        await settled(kubelet, caplog)


async def test_a_client_leaving_a_quiet_followed_log_closes_its_lower_stream(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No line comes after it left, so no write finds it gone: the handler looks."""
    monkeypatch.setattr(server_module, "CLIENT_CHECK_SECONDS", 0.05)
    provider = GatedProvider()
    provider.gate.set()
    async with serving(provider) as kubelet:
        reader, writer = await asyncio.open_connection(kubelet.server.host, kubelet.server.port)
        method, path, headers = LEAVING["logs"]
        writer.write(request_bytes(method, path, {**headers, **AUTH}))
        async with asyncio.timeout(TIMEOUT):
            received = b""
            while b"the first line" not in received:
                received += await reader.read(4096)
        assert provider.open_logs == 1
        writer.transport.abort()
        await until(lambda: provider.open_logs == 0)
        await settled(kubelet, caplog)


# --- oversized and slow input --------------------------------------------------------------


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /pods HTTP/1.1\r\nHost: k\r\nX-Big: " + b"a" * 2**20 + b"\r\n\r\n",
        b"GET /pods?" + b"a" * 2**20 + b" HTTP/1.1\r\nHost: k\r\n\r\n",
        b"GET /pods HTTP/1.1\r\n" + b"X-Many: header\r\n" * 100_000 + b"\r\n",
        b"GET /pods HTTP/1.1\r\nX-Folded: a\r\n" + b" folded\r\n" * 10_000 + b"\r\n",
    ],
    ids=["1 MiB header line", "1 MiB target", "100k headers", "folded header"],
)
async def test_oversized_request_heads_are_refused_at_once(
    kubelet: Kubelet, caplog: pytest.LogCaptureFixture, request_head: bytes
) -> None:
    reader, writer = await asyncio.open_connection(kubelet.server.host, kubelet.server.port)
    try:
        with contextlib.suppress(ConnectionError):
            writer.write(request_head)
        try:
            status, _headers, _body = await read_response(reader)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            pass  # hung up before answering: refused just as well
        else:
            assert 400 <= status < 500
        await eof_within(reader)
    finally:
        writer.close()
    await settled(kubelet, caplog)


async def test_a_spdy_frame_longer_than_the_limit_closes_without_waiting_for_it(
    kubelet: Kubelet, caplog: pytest.LogCaptureFixture
) -> None:
    async with spdy_upgrade(kubelet.server, EXEC_PATH, channels.V5_PROTOCOL) as peer:
        announced = spdysession.MAX_FRAME_SIZE + 1
        peer.writer.write(struct.pack(">II", 1, announced) + bytes(1024))
        # The client neither sends the rest nor leaves: the server may not wait for it.
        await peer.until(lambda p: False)
    assert peer.eof
    [goaway] = [e for e in peer.events if isinstance(e, GoAwayReceived)]
    assert goaway.status == GoAwayStatus.PROTOCOL_ERROR
    await settled(kubelet, caplog)


async def test_a_frame_that_never_ends_before_the_streams_times_out(
    kubelet: Kubelet, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "STREAM_CREATION_TIMEOUT", 0.3)
    async with spdy_upgrade(kubelet.server, EXEC_PATH, channels.V5_PROTOCOL) as peer:
        # Within the limit, so the server waits for the rest, but not past the time
        # the streams have to be created in.
        peer.writer.write(struct.pack(">II", 1, spdysession.MAX_FRAME_SIZE) + bytes(4096))
        await peer.until(lambda p: False)
    assert peer.eof
    await settled(kubelet, caplog)


def small_receive_buffer() -> socket.socket:
    """A client socket whose kernel buffer holds little, so what a server that ignores
    backpressure would queue shows in its own buffers, not the kernel's."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.setblocking(False)
    return sock


async def connect(server: BaseTestServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = small_receive_buffer()
    await asyncio.get_running_loop().sock_connect(sock, (server.host, server.port))
    return await asyncio.open_connection(sock=sock)


async def plateau(read: Callable[[], int]) -> int:
    """The value once it has stopped growing for a while; growing for 20 s is a failure."""
    async with asyncio.timeout(20):
        last = -1
        while (now := read()) != last:
            last = now
            await asyncio.sleep(0.3)
    return last


CHUNK = b"y\n" * 32 * 1024
# What the kernel's socket buffers on both ends can hold, with room to spare.
PRODUCED_BOUND = 16 * 2**20
# aiohttp's high-water mark is 64 KiB; one chunk may go over it before a write waits.
WRITE_BUFFER_BOUND = 2**20


class FloodProcess(EchoProcess):
    """Output that never ends: the provider's endless log."""

    def __init__(self, options: ExecOptions, provider: FloodProvider) -> None:
        super().__init__(options)
        self.provider = provider

    async def output(self) -> AsyncIterator[tuple[int, bytes]]:
        async for chunk in self.provider.container_logs({}, "app", LogOptions()):
            yield channels.STDOUT, chunk


class FloodProvider(FakeProvider):
    """Logs and exec output that never end, counting what the server took of them."""

    def __init__(self) -> None:
        super().__init__(lambda options: FloodProcess(options, self))
        self.produced = 0

    async def container_logs(
        self, pod: Mapping[str, Any], container: str, options: LogOptions
    ) -> AsyncGenerator[bytes, None]:
        while True:
            await asyncio.sleep(0)  # as a real lower stream waits for the network
            self.produced += len(CHUNK)
            yield CHUNK


FLOODS = {
    "logs": ("GET", "/containerLogs/default/p/app?follow=1", {}),
    "websocket": ("GET", EXEC_PATH, {**WEBSOCKET, "Sec-WebSocket-Protocol": channels.V5_PROTOCOL}),
    "spdy": (
        "POST",
        "/exec/default/p/app?command=yes&output=1",
        spdy_headers(channels.V5_PROTOCOL),
    ),
}


@contextlib.asynccontextmanager
async def flood(kubelet: Kubelet, how: str) -> AsyncIterator[None]:
    """A connection whose server writes without end to a client that reads no more
    than the response head."""
    method, path, headers = FLOODS[how]
    reader, writer = await connect(kubelet.server)
    try:
        writer.write(request_bytes(method, path, {**headers, **AUTH}))
        async with asyncio.timeout(TIMEOUT):
            await reader.readuntil(b"\r\n\r\n")
        if how == "spdy":
            peer = SpdyPeer(reader, writer)
            peer.open(streamtype="error")
            peer.open(streamtype="stdout")
        yield
    finally:
        writer.close()


def server_transports(kubelet: Kubelet) -> list[asyncio.BaseTransport]:
    runner = kubelet.server.runner
    assert runner is not None and runner.server is not None
    assert isinstance(runner.server, web.Server)
    return [h.transport for h in runner.server.connections if h.transport is not None]


@pytest.mark.parametrize("how", ["logs", "websocket", "spdy"])
async def test_a_client_that_stops_reading_stops_the_producer(
    caplog: pytest.LogCaptureFixture, how: str
) -> None:
    provider = FloodProvider()
    async with serving(provider) as kubelet:
        async with flood(kubelet, how):
            produced = await plateau(lambda: provider.produced)
            assert 0 < produced < PRODUCED_BOUND
            [transport] = server_transports(kubelet)
            assert isinstance(transport, asyncio.WriteTransport)
            assert transport.get_write_buffer_size() < WRITE_BUFFER_BOUND
        await settled(kubelet, caplog)


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> list[spdysession.SpdySession]:
    """The SPDY sessions the server upgrades to, as they are made."""
    made: list[spdysession.SpdySession] = []
    original = spdysession.upgrade

    async def upgrade(request: web.Request, protocol: str) -> spdysession.SpdySession:
        made.append(await original(request, protocol))
        return made[-1]

    monkeypatch.setattr(server_module, "upgrade", upgrade)
    return made


async def test_pings_from_a_client_that_stops_reading_stop_being_read(
    kubelet: Kubelet, caplog: pytest.LogCaptureFixture, sessions: list[spdysession.SpdySession]
) -> None:
    pings = b"".join(control_frame(3, 6, struct.pack(">I", 2 * i + 1)) for i in range(2**16))
    reader, writer = await connect(kubelet.server)
    try:
        headers = {**AUTH, **spdy_headers("portforward.k8s.io")}
        writer.write(request_bytes("POST", "/portForward/default/p", headers))
        async with asyncio.timeout(TIMEOUT):
            await reader.readuntil(b"\r\n\r\n")
        stalled = False
        # Each ping is answered with as many bytes: a server that reads on regardless
        # piles the answers to a client that never reads up in its write buffer.
        for _ in range(128):
            writer.write(pings)
            try:
                async with asyncio.timeout(1):
                    await writer.drain()
            except TimeoutError:
                stalled = True
                break
        [session] = sessions
        assert session._transport.get_write_buffer_size() < WRITE_BUFFER_BOUND
        assert stalled, "the server read on"
    finally:
        # close() would wait for the unsent pings to go first, which they never do.
        writer.transport.abort()
    await settled(kubelet, caplog)


async def test_data_on_streams_nobody_reads_is_dropped(
    kubelet: Kubelet, caplog: pytest.LogCaptureFixture, sessions: list[spdysession.SpdySession]
) -> None:
    chunk = bytes(spdysession.MAX_FRAME_SIZE // 2)
    async with spdy_upgrade(kubelet.server, EXEC_PATH, channels.V5_PROTOCOL) as peer:
        error, stdin, stdout, _stderr = (
            peer.open(streamtype=kind) for kind in ("error", "stdin", "stdout", "stderr")
        )
        late = peer.open(streamtype="stdin")
        # Twice the read budget, kept, would stop the reading of the session for good.
        for _ in range(8):
            for stream in (stdout, late):
                peer.send(stream, chunk)
            await peer.writer.drain()
        peer.send(stdin, MARKER, fin=True)
        await peer.until(lambda p: p.finished(error))
        assert peer.data(stdout) == MARKER
        assert any(isinstance(e, StreamReset) and e.stream_id == late for e in peer.events)
        [session] = sessions
        assert session._buffered == 0
    await settled(kubelet, caplog)


async def test_what_a_client_sends_after_the_pods_side_closed_is_not_held(
    kubelet: Kubelet, caplog: pytest.LogCaptureFixture, sessions: list[spdysession.SpdySession]
) -> None:
    chunk = bytes(spdysession.MAX_FRAME_SIZE // 2)
    async with spdy_upgrade(kubelet.server, "/portForward/default/p", "portforward.k8s.io") as peer:
        error = peer.open(streamtype="error", port="8080", requestid="0")
        data = peer.open(streamtype="data", port="8080", requestid="0")
        peer.send(data, b"ping")
        await peer.until(lambda p: p.data(data) == b"echo:ping")
        # The pod answers and closes (an HTTP 413 to an upload) while the client is
        # still sending; kubectl resets the data stream once it sees the close.
        [connection] = kubelet.provider.connections
        await connection.close()
        await peer.until(lambda p: p.finished(data) and p.finished(error))
        for _ in range(6):
            peer.send(data, chunk)
        peer.spdy.reset(data)
        # Its echo says the server read every frame before it.
        peer.spdy.ping(CLIENT_PING)
        peer.flush()
        await peer.until(
            lambda p: any(
                isinstance(e, PingAcknowledged) and e.ping_id == CLIENT_PING for e in p.events
            )
        )
        [session] = sessions
        assert session._buffered == 0
        # The session reads on: a second connection of the same session still flows.
        error = peer.open(streamtype="error", port="8080", requestid="1")
        data = peer.open(streamtype="data", port="8080", requestid="1")
        for _ in range(10):
            peer.send(data, chunk)
        peer.send(data, b"pong")
        await peer.until(lambda p: p.data(data).endswith(b"echo:pong"))
        assert "input" not in session._stalled
    await settled(kubelet, caplog)


class StuckProcess(EchoProcess):
    """A process whose lower end takes no stdin until it exits."""

    def __init__(self, options: ExecOptions) -> None:
        super().__init__(options)
        self.exit = asyncio.Event()

    async def send_stdin(self, data: bytes) -> None:
        await self.exit.wait()

    async def output(self) -> AsyncIterator[tuple[int, bytes]]:
        await self.exit.wait()
        return
        yield  # an async generator, with nothing to yield


async def test_stdin_a_stuck_lower_does_not_take_stops_the_reading_at_the_bound(
    caplog: pytest.LogCaptureFixture, sessions: list[spdysession.SpdySession]
) -> None:
    chunk = bytes(spdysession.MAX_FRAME_SIZE // 2)
    async with (
        serving(FakeProvider(StuckProcess)) as kubelet,
        spdy_upgrade(kubelet.server, EXEC_PATH, channels.V5_PROTOCOL) as peer,
    ):
        _error, stdin, _stdout, _stderr = (
            peer.open(streamtype=kind) for kind in ("error", "stdin", "stdout", "stderr")
        )
        for _ in range(64):
            peer.send(stdin, chunk)
            try:
                async with asyncio.timeout(1):
                    await peer.writer.drain()
            except TimeoutError:
                break
        [session] = sessions
        assert "input" in session._stalled
        bound = spdysession._PAUSE_ABOVE + 2 * spdysession.MAX_FRAME_SIZE
        assert session._buffered <= bound
        [(_, _, process)] = kubelet.provider.processes
        assert isinstance(process, StuckProcess)
        process.exit.set()
        peer.writer.transport.abort()
        await settled(kubelet, caplog)
