"""The asyncio shell around the sans-IO SpdyConnection, on a connection aiohttp upgraded.

aiohttp only upgrades WebSocket connections itself, so after answering 101 the handler
installs ``_RawFeed`` as the connection's payload parser: every byte read from the socket
then goes to the SPDY state machine instead of the HTTP parser, and frames go out through
a plain aiohttp ``StreamWriter`` (no chunking), which also gives write backpressure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from aiohttp.http_writer import StreamWriter

from virtual_node.kubeletapi import spdy

log = logging.getLogger("virtual_node.kubeletapi")

# Read pausing: beyond this many bytes received and not yet consumed, stop reading the
# socket so a slow lower leg pushes back on the sender instead of growing memory.
_PAUSE_ABOVE = 4 * 1024 * 1024
_RESUME_BELOW = 1024 * 1024
MAX_FRAME_SIZE = 1024 * 1024
# Frames sent within one turn of the loop go out in one write up to this size; beyond it
# they are written at once, so the transport's backpressure (drain) still holds a sender
# that never yields.
_COALESCE_UP_TO = 256 * 1024


class _RawFeed:
    """aiohttp's payload-parser interface, handing raw bytes to the session."""

    def __init__(self, session: SpdySession) -> None:
        self._session = session

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self._session._received(data)
        return False, b""

    def feed_eof(self) -> None:
        self._session._lost()


class SpdyStream:
    """One stream the peer opened: its headers, what it sends, and our half."""

    def __init__(self, session: SpdySession, opened: spdy.StreamOpened) -> None:
        self.session = session
        self.id = opened.stream_id
        self.headers = opened.headers
        self._chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.remote_closed = opened.fin
        self.local_closed = False
        self.ignoring_input = False
        if opened.fin:
            self._chunks.put_nowait(b"")

    def header(self, name: str) -> str:
        return self.headers.get(name, "").split("\x00")[0]

    async def read(self) -> bytes:
        """The next data the peer sent; b"" once it half-closed or the stream ended."""
        chunk = await self._chunks.get()
        if chunk is None or chunk == b"":
            self._chunks.put_nowait(chunk)  # later reads see the end again
            return b""
        self.session._consumed(len(chunk))
        return chunk

    async def write(self, data: bytes, *, fin: bool = False) -> None:
        if self.local_closed:
            return
        self.local_closed = fin
        sent = self.session.send(lambda c: c.send_data(self.id, data, fin=fin))
        self._forget_when_done()
        if sent:
            await self.session.drain()

    async def close(self) -> None:
        await self.write(b"", fin=True)

    def reset(self) -> None:
        self.local_closed = True
        self.ignore_input()
        self.session._streams.pop(self.id, None)
        self.session.send(lambda c: c.reset(self.id))

    def ignore_input(self) -> None:
        """Drops what the peer sent and will send here: a stream nobody reads would
        otherwise hold its data against the session's read budget for good, and once
        that is spent, the session reads nothing more, not even the peer's goodbye."""
        self.ignoring_input = True
        while not self._chunks.empty():
            if chunk := self._chunks.get_nowait():
                self.session._consumed(len(chunk))

    def _push(self, data: bytes, fin: bool) -> None:
        if data and not self.ignoring_input:
            self._chunks.put_nowait(data)
        if fin and not self.remote_closed:
            self.remote_closed = True
            self._chunks.put_nowait(b"")
            self._forget_when_done()

    def _forget_when_done(self) -> None:
        """Both halves closed, nothing more can arrive for the stream, and the connection
        forgets it (a peer's later reset of it is no event): kept, every connection of a
        long port-forward would stay in the session until its end."""
        if self.local_closed and self.remote_closed:
            self.session._streams.pop(self.id, None)

    def _end(self) -> None:
        self.local_closed = True
        self._chunks.put_nowait(None)


class SpdySession:
    """A server-side SPDY/3.1 connection: ``accept()`` yields the streams the peer opens."""

    def __init__(self, request: web.BaseRequest) -> None:
        # Peers send frames of at most 32 KiB of data (io.Copy buffers) and small header
        # blocks: anything near the protocol's 16 MiB limit is refused, not buffered.
        self._connection = spdy.SpdyConnection(max_frame_size=MAX_FRAME_SIZE)
        protocol = request.protocol
        assert protocol is not None and request.transport is not None
        self._transport = request.transport
        self._writer = StreamWriter(protocol, asyncio.get_running_loop())
        self._streams: dict[int, SpdyStream] = {}
        self._opened: asyncio.Queue[SpdyStream | None] = asyncio.Queue()
        self._buffered = 0
        # Why the socket is not read: "input" received and not consumed, "output"
        # answers (pings, replies, resets) the peer does not read.
        self._stalled: set[str] = set()
        self._resuming: asyncio.Task[None] | None = None
        self._flush_pending = False
        self._protocol = protocol
        self.closed = asyncio.Event()
        # When a frame last went either way (for the streaming idle timeout).
        self.last_activity = asyncio.get_running_loop().time()
        protocol.keep_alive(False)
        protocol.set_parser(_RawFeed(self))  # type: ignore[arg-type]  # duck-typed by aiohttp

    async def accept(self) -> SpdyStream | None:
        """The next stream the peer opened; None once the connection is gone."""
        stream = await self._opened.get()
        if stream is None:
            self._opened.put_nowait(None)
        return stream

    def send(self, action: Any) -> bool:
        """Runs a send method of the connection; what it queued is written at the end of
        the loop's turn, with whatever else was sent in it: a forwarded port's lower
        connection is read 256 KiB at a time, eight 32 KiB messages, and one write of them
        costs one TLS write and socket send where there were eight (a download's socket
        sends were a third of the virtual node's busy time). False when the stream or
        connection is already gone."""
        if self.closed.is_set():
            return False
        self.last_activity = asyncio.get_running_loop().time()
        try:
            action(self._connection)
        except spdy.LocalProtocolError:
            return False
        if self._connection.queued_size() >= _COALESCE_UP_TO:
            self._flush()
        elif not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)
        return True

    async def drain(self) -> None:
        if not self.closed.is_set():
            try:
                await self._writer.drain()
            except ConnectionError:
                self._lost()

    async def close(self) -> None:
        """GOAWAY, then close the socket once written."""
        if self.closed.is_set():
            return
        self.send(lambda c: c.goaway())
        self._flush()
        await self.drain()
        self._transport.close()
        self._lost()

    def _flush(self) -> None:
        self._flush_pending = False
        data = self._connection.data_to_send()
        if data and not self._transport.is_closing():
            self._transport.write(data)

    def _received(self, data: bytes) -> None:
        self.last_activity = asyncio.get_running_loop().time()
        try:
            events = self._connection.receive_data(data)
        except spdy.SpdyProtocolError as error:
            log.info("closing a SPDY connection: %s", error)
            self._flush()
            self._transport.close()
            self._lost()
            return
        for event in events:
            self._dispatch(event)
        self._flush()
        # Every frame may draw an answer: a peer that sends and never reads would
        # otherwise fill the write buffer without bound.
        if self._protocol.writing_paused and "output" not in self._stalled:
            self._stall("output")
            self._resuming = asyncio.create_task(self._resume_when_drained())

    def _dispatch(self, event: spdy.Event) -> None:
        match event:
            case spdy.StreamOpened(unidirectional=False):
                # Every stream is accepted; the handler decides what it is for.
                try:
                    self._connection.reply(event.stream_id, {})
                except spdy.LocalProtocolError:
                    return  # reset by a later frame of the same read: nothing to hand over
                stream = SpdyStream(self, event)
                self._streams[event.stream_id] = stream
                self._opened.put_nowait(stream)
            case spdy.DataReceived(stream_id=stream_id, data=data, fin=fin):
                if (receiver := self._streams.get(stream_id)) is not None:
                    if not receiver.ignoring_input:
                        self._buffered += len(data)
                    receiver._push(data, fin)
                    if self._buffered > _PAUSE_ABOVE:
                        self._stall("input")
            case spdy.HeadersReceived(stream_id=stream_id, fin=True):
                # A half-close may come as HEADERS too (legal, if not spdystream's way).
                if (receiver := self._streams.get(stream_id)) is not None:
                    receiver._push(b"", fin=True)
            case spdy.StreamReset(stream_id=stream_id):
                if (reset := self._streams.pop(stream_id, None)) is not None:
                    # What it sent before the reset will not be read (kubectl resets a
                    # port-forward's data stream once the pod's side closed).
                    reset.ignore_input()
                    reset._end()
            case spdy.GoAwayReceived():
                self._opened.put_nowait(None)
            case _:
                pass  # pings are answered by the connection; replies do not occur here

    def _consumed(self, size: int) -> None:
        self._buffered -= size
        if self._buffered < _RESUME_BELOW:
            self._unstall("input")

    async def _resume_when_drained(self) -> None:
        await self.drain()
        self._unstall("output")

    def _stall(self, reason: str) -> None:
        if not self._stalled:
            self._transport.pause_reading()
        self._stalled.add(reason)

    def _unstall(self, reason: str) -> None:
        if reason in self._stalled:
            self._stalled.discard(reason)
            if not self._stalled:
                self._transport.resume_reading()

    def _lost(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self._opened.put_nowait(None)
        for stream in self._streams.values():
            stream._end()
        self._streams.clear()


def choose_protocol(offered: Sequence[str], supported: Sequence[str]) -> str | None:
    """The first protocol of the client's X-Stream-Protocol-Version list we speak."""
    for protocol in offered:
        if protocol in supported:
            return protocol
    return None


def offered_protocols(request: web.BaseRequest) -> list[str]:
    values = request.headers.getall("X-Stream-Protocol-Version", [])
    return [p.strip() for value in values for p in value.split(",") if p.strip()]


def is_spdy_upgrade(request: web.BaseRequest) -> bool:
    connection = request.headers.get("Connection", "").lower()
    return "upgrade" in connection and request.headers.get("Upgrade", "").lower() == "spdy/3.1"


async def upgrade(request: web.Request, protocol: str) -> SpdySession:
    """Answers 101 with the chosen protocol and takes the connection over."""
    response = web.StreamResponse(
        status=101,
        headers={
            "Connection": "Upgrade",
            "Upgrade": "SPDY/3.1",
            "X-Stream-Protocol-Version": protocol,
        },
    )
    await response.prepare(request)
    return SpdySession(request)
