import hashlib
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from virtual_node.kubeletapi.spdy import (
    DATA_CHUNK_SIZE,
    HEADER_DICTIONARY,
    DataReceived,
    Event,
    GoAwayReceived,
    GoAwayStatus,
    HeadersReceived,
    LocalProtocolError,
    PingAcknowledged,
    PingReceived,
    RstStatus,
    SpdyConnection,
    SpdyProtocolError,
    StreamClosedError,
    StreamOpened,
    StreamReplied,
    StreamReset,
)

# Written by moby/spdystream v0.5.1's Framer (the library kubectl and the kubelet use): a client
# sending SYN_STREAM 1 {streamtype: error}, SYN_STREAM 3 {streamtype: stdout} on one compression
# context, then DATA 1 "hello" with FIN; and a server sending SYN_REPLY 1 with FIN and the two
# values a, b of X-Multi, then PING 2.
GO_CLIENT_FRAMES = bytes.fromhex(
    "80030001000000290000000100000000000078f9e3c6a7c26260606004a7b392a2d4c45c6851c29a0a0a68"
    "00000000ffff800300010000001900000003000000000000c22ac5565c92925f5a02000000ffff00000001"
    "0100000568656c6c6f"
)
GO_SERVER_FRAMES = bytes.fromhex(
    "80030002010000220000000178f9e3c6a7c26260606004a5c70adddcd29c924c70a9c89004000000ffff80"
    "0300060000000400000002"
)
FIRST_SYN_STREAM_BLOCK = GO_CLIENT_FRAMES[18:49]


def raw_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    parts = [struct.pack(">I", len(headers))]
    for name, value in headers:
        parts += [struct.pack(">I", len(name)), name, struct.pack(">I", len(value)), value]
    return b"".join(parts)


class HeaderCompressor:
    """A peer's header compression, built apart from the module under test."""

    def __init__(self) -> None:
        self._compressor = zlib.compressobj(zdict=HEADER_DICTIONARY)

    def block(self, raw: bytes) -> bytes:
        return self._compressor.compress(raw) + self._compressor.flush(zlib.Z_SYNC_FLUSH)


FrameBuilder = Callable[[HeaderCompressor], bytes]


def control_frame(frame_type: int, payload: bytes, flags: int = 0, version: int = 3) -> bytes:
    return struct.pack(">HHI", 0x8000 | version, frame_type, flags << 24 | len(payload)) + payload


def data_frame(stream_id: int, data: bytes, flags: int = 0) -> bytes:
    return struct.pack(">II", stream_id, flags << 24 | len(data)) + data


def syn_stream(compressor: HeaderCompressor, stream_id: int, raw: bytes, flags: int = 0) -> bytes:
    payload = struct.pack(">IIBB", stream_id, 0, 0, 0) + compressor.block(raw)
    return control_frame(1, payload, flags)


def syn_reply(compressor: HeaderCompressor, stream_id: int, raw: bytes, flags: int = 0) -> bytes:
    return control_frame(2, struct.pack(">I", stream_id) + compressor.block(raw), flags)


def pair() -> tuple[SpdyConnection, SpdyConnection]:
    return SpdyConnection(client_side=True), SpdyConnection()


def deliver(sender: SpdyConnection, receiver: SpdyConnection) -> list[Event]:
    return receiver.receive_data(sender.data_to_send())


def rst_frame(stream_id: int, status: int) -> bytes:
    return control_frame(3, struct.pack(">II", stream_id, status))


# ---- dictionary and wire format -------------------------------------------------------------


def test_dictionary_is_the_spdy3_one() -> None:
    # The digest of the 1423 bytes in the draft, as spdystream's spdy/dictionary.go lists them.
    assert len(HEADER_DICTIONARY) == 1423
    assert (
        hashlib.sha256(HEADER_DICTIONARY).hexdigest()
        == "51d27341373f923f3cd88e1eb7162aeaa3723d7585ff2399201dc06498407f02"
    )


def test_go_header_block_decodes_with_a_fresh_decompressor() -> None:
    decompressor = zlib.decompressobj(zdict=HEADER_DICTIONARY)
    assert decompressor.decompress(FIRST_SYN_STREAM_BLOCK) == raw_block([(b"streamtype", b"error")])


def test_our_header_block_decodes_with_a_fresh_decompressor() -> None:
    client = SpdyConnection(client_side=True)
    client.open_stream({"streamtype": "error", "x-multi": "a\x00b"})
    frame = client.data_to_send()
    decompressor = zlib.decompressobj(zdict=HEADER_DICTIONARY)
    assert decompressor.decompress(frame[18:]) == raw_block(
        [(b"streamtype", b"error"), (b"x-multi", b"a\x00b")]
    )


def test_frames_written_by_spdystream_client() -> None:
    server = SpdyConnection()
    assert server.receive_data(GO_CLIENT_FRAMES) == [
        StreamOpened(1, 0, 0, {"streamtype": "error"}, fin=False),
        StreamOpened(3, 0, 0, {"streamtype": "stdout"}, fin=False),
        DataReceived(1, b"hello", fin=True),
    ]
    assert server.last_remote_stream_id == 3


def test_frames_written_by_spdystream_server() -> None:
    client = SpdyConnection(client_side=True)
    client.open_stream({"streamtype": "error"}, fin=True)
    client.data_to_send()
    assert client.receive_data(GO_SERVER_FRAMES) == [
        StreamReplied(1, {"x-multi": "a\x00b"}, fin=True),
        PingReceived(2),
    ]
    assert client.data_to_send() == control_frame(6, struct.pack(">I", 2))
    assert client._streams == {}, "both sides sent FIN"


def test_control_frame_layouts() -> None:
    client = SpdyConnection(client_side=True)
    stream_id = client.open_stream({}, fin=True, priority=3, associated_id=7)
    frame = client.data_to_send()
    assert frame[:8] == struct.pack(">HHI", 0x8003, 1, 0x01 << 24 | len(frame) - 8)
    assert frame[8:18] == bytes.fromhex("00000001 00000007 60 00")
    client.ping(5)
    assert client.data_to_send() == bytes.fromhex("80030006 00000004 00000005")
    client.reset(stream_id, RstStatus.REFUSED_STREAM)
    assert client.data_to_send() == bytes.fromhex("80030003 00000008 00000001 00000003")
    client.goaway(9, GoAwayStatus.INTERNAL_ERROR)
    assert client.data_to_send() == bytes.fromhex("80030007 00000008 00000009 00000002")


def test_data_frame_layout_and_splitting() -> None:
    client, server = pair()
    stream_id = client.open_stream({})
    deliver(client, server)
    server.reply(stream_id, {})
    deliver(server, client)
    payload = bytes(range(256)) * (2 * DATA_CHUNK_SIZE // 256 + 3)
    client.send_data(stream_id, payload, fin=True)
    wire = client.data_to_send()
    assert wire[:8] == struct.pack(">II", 1, DATA_CHUNK_SIZE)
    events = server.receive_data(wire)
    assert [len(e.data) for e in events if isinstance(e, DataReceived)] == [
        DATA_CHUNK_SIZE,
        DATA_CHUNK_SIZE,
        len(payload) - 2 * DATA_CHUNK_SIZE,
    ]
    assert [e.fin for e in events if isinstance(e, DataReceived)] == [False, False, True]
    assert b"".join(e.data for e in events if isinstance(e, DataReceived)) == payload


def test_empty_data_sends_only_a_fin() -> None:
    client = SpdyConnection(client_side=True)
    stream_id = client.open_stream({})
    client.data_to_send()
    client.send_data(stream_id, b"")
    assert client.data_to_send() == b""
    client.send_data(stream_id, b"", fin=True)
    assert client.data_to_send() == data_frame(stream_id, b"", flags=1)


# ---- conversations --------------------------------------------------------------------------


def test_stream_round_trip_and_half_close() -> None:
    client, server = pair()
    stream_id = client.open_stream({"streamtype": "stdin", "port": "80"}, priority=2)
    assert deliver(client, server) == [
        StreamOpened(stream_id, 0, 2, {"streamtype": "stdin", "port": "80"}, fin=False)
    ]
    server.reply(stream_id, {"status": "ok"})
    assert deliver(server, client) == [StreamReplied(stream_id, {"status": "ok"}, fin=False)]

    client.send_data(stream_id, b"ping", fin=True)
    assert deliver(client, server) == [DataReceived(stream_id, b"ping", fin=True)]
    with pytest.raises(StreamClosedError):
        client.send_data(stream_id, b"more")

    server.send_data(stream_id, b"pong")
    server.headers(stream_id, {"trailer": "x"}, fin=True)
    assert deliver(server, client) == [
        DataReceived(stream_id, b"pong", fin=False),
        HeadersReceived(stream_id, {"trailer": "x"}, fin=True),
    ]
    assert client._streams == {} and server._streams == {}


def test_server_initiated_stream() -> None:
    client, server = pair()
    stream_id = server.open_stream({"kind": "push"}, fin=True)
    assert stream_id == 2
    assert deliver(server, client) == [StreamOpened(2, 0, 0, {"kind": "push"}, fin=True)]
    client.reply(2, {}, fin=True)
    assert deliver(client, server) == [StreamReplied(2, {}, fin=True)]
    assert client._streams == {} and server._streams == {}


def test_stream_ids_follow_the_side() -> None:
    client, server = pair()
    assert [client.open_stream({}) for _ in range(3)] == [1, 3, 5]
    assert [server.open_stream({}) for _ in range(2)] == [2, 4]


def test_frames_fed_one_byte_at_a_time() -> None:
    client, server = pair()
    stream_id = client.open_stream({"streamtype": "error"})
    client.send_data(stream_id, b"x" * 300)
    second = client.open_stream({"streamtype": "stdout"}, fin=True)
    client.ping(1)
    wire = client.data_to_send()
    events: list[Event] = []
    for index in range(len(wire)):
        events += server.receive_data(wire[index : index + 1])
    assert events == [
        StreamOpened(stream_id, 0, 0, {"streamtype": "error"}, fin=False),
        DataReceived(stream_id, b"x" * 300, fin=False),
        StreamOpened(second, 0, 0, {"streamtype": "stdout"}, fin=True),
        PingReceived(1),
    ]


def test_peer_reset_forgets_the_stream() -> None:
    client, server = pair()
    stream_id = client.open_stream({})
    deliver(client, server)
    server.reset(stream_id, RstStatus.REFUSED_STREAM)
    assert deliver(server, client) == [StreamReset(stream_id, RstStatus.REFUSED_STREAM)]
    assert client._streams == {} and server._streams == {}
    with pytest.raises(StreamClosedError):
        client.send_data(stream_id, b"late")
    server.reset(stream_id)
    assert server.data_to_send() == b"", "resetting a closed stream sends nothing"


def test_reset_for_an_unknown_stream_is_not_answered() -> None:
    server = SpdyConnection()
    assert server.receive_data(rst_frame(41, RstStatus.CANCEL)) == []
    assert server.data_to_send() == b""


def test_ping_is_echoed_and_acknowledged() -> None:
    client, server = pair()
    client.ping(7)
    assert deliver(client, server) == [PingReceived(7)]
    assert deliver(server, client) == [PingAcknowledged(7)]
    assert server.data_to_send() == client.data_to_send() == b""


@pytest.mark.parametrize("ping_id", [0, 2, 2**32 + 1])
def test_client_ping_ids_are_odd_and_32_bit(ping_id: int) -> None:
    with pytest.raises(ValueError):
        SpdyConnection(client_side=True).ping(ping_id)


def test_goaway_both_ways() -> None:
    client, server = pair()
    stream_id = client.open_stream({})
    deliver(client, server)
    server.goaway()
    in_flight = client.open_stream({"sent": "before the GOAWAY arrived"})
    client.send_data(in_flight, b"ignored")
    assert deliver(client, server) == [], "streams opened after our GOAWAY are ignored"
    assert deliver(server, client) == [GoAwayReceived(stream_id, GoAwayStatus.OK)]
    assert server.data_to_send() == b"", "and draw no reset"
    with pytest.raises(LocalProtocolError):
        client.open_stream({})


# ---- the peer breaking a stream -------------------------------------------------------------


def rst_of(wire: bytes) -> tuple[int, int]:
    assert wire[:8] == bytes.fromhex("8003000300000008")
    stream_id, status = struct.unpack(">II", wire[8:16])
    return stream_id, status


def test_data_for_an_unknown_stream_draws_invalid_stream() -> None:
    server = SpdyConnection()
    assert server.receive_data(data_frame(5, b"who?")) == []
    assert rst_of(server.data_to_send()) == (5, RstStatus.INVALID_STREAM)


def test_data_after_the_peers_fin_draws_stream_already_closed() -> None:
    client, server = pair()
    stream_id = client.open_stream({}, fin=True)
    deliver(client, server)
    events = server.receive_data(data_frame(stream_id, b"after fin"))
    assert events == [StreamReset(stream_id, RstStatus.STREAM_ALREADY_CLOSED, remote=False)]
    assert rst_of(server.data_to_send()) == (stream_id, RstStatus.STREAM_ALREADY_CLOSED)
    assert server._streams == {}


def test_data_before_the_reply_is_a_protocol_error() -> None:
    client = SpdyConnection(client_side=True)
    stream_id = client.open_stream({})
    client.data_to_send()
    events = client.receive_data(data_frame(stream_id, b"too early"))
    assert events == [StreamReset(stream_id, RstStatus.PROTOCOL_ERROR, remote=False)]
    assert rst_of(client.data_to_send()) == (stream_id, RstStatus.PROTOCOL_ERROR)


def test_second_reply_draws_stream_in_use() -> None:
    client = SpdyConnection(client_side=True)
    stream_id = client.open_stream({})
    client.data_to_send()
    compressor = HeaderCompressor()
    assert client.receive_data(syn_reply(compressor, stream_id, raw_block([]))) == [
        StreamReplied(stream_id, {}, fin=False)
    ]
    events = client.receive_data(syn_reply(compressor, stream_id, raw_block([])))
    assert events == [StreamReset(stream_id, RstStatus.STREAM_IN_USE, remote=False)]
    assert rst_of(client.data_to_send()) == (stream_id, RstStatus.STREAM_IN_USE)


@pytest.mark.parametrize(
    ("stream_ids", "refused"),
    [
        ((2,), 2),  # a server's id from the client
        ((5, 3), 3),  # going backwards
        ((5, 5), 5),  # reused
    ],
)
def test_bad_syn_stream_ids_draw_protocol_error(stream_ids: tuple[int, ...], refused: int) -> None:
    server = SpdyConnection()
    compressor = HeaderCompressor()
    wire = b"".join(syn_stream(compressor, i, raw_block([])) for i in stream_ids)
    server.receive_data(wire)
    assert rst_of(server.data_to_send()) == (refused, RstStatus.PROTOCOL_ERROR)


def test_reused_id_resets_the_open_stream_too() -> None:
    server = SpdyConnection()
    compressor = HeaderCompressor()
    server.receive_data(syn_stream(compressor, 1, raw_block([])))
    events = server.receive_data(syn_stream(compressor, 1, raw_block([])))
    assert events == [StreamReset(1, RstStatus.PROTOCOL_ERROR, remote=False)]


def test_unidirectional_stream_takes_no_reply() -> None:
    server = SpdyConnection()
    events = server.receive_data(syn_stream(HeaderCompressor(), 1, raw_block([]), flags=0x02))
    assert events == [StreamOpened(1, 0, 0, {}, fin=False, unidirectional=True)]
    with pytest.raises(LocalProtocolError):
        server.reply(1, {})
    with pytest.raises(StreamClosedError):
        server.send_data(1, b"no")
    assert server.receive_data(data_frame(1, b"yes", flags=1)) == [DataReceived(1, b"yes", True)]
    assert server._streams == {}


def test_settings_window_update_and_unknown_types_are_ignored() -> None:
    server = SpdyConnection()
    wire = (
        control_frame(4, struct.pack(">III", 1, 0x07, 65536))
        + control_frame(9, struct.pack(">II", 1, 1024))
        + control_frame(0x7777, b"future")
    )
    assert server.receive_data(wire) == []
    assert server.data_to_send() == b""


# ---- the peer breaking the connection -------------------------------------------------------


def assert_connection_failed(server: SpdyConnection, wire: bytes) -> None:
    with pytest.raises(SpdyProtocolError):
        server.receive_data(wire)
    out = server.data_to_send()
    assert out[:4] == bytes.fromhex("80030007"), "GOAWAY queued for the shell to flush"
    assert struct.unpack(">I", out[12:16])[0] == GoAwayStatus.PROTOCOL_ERROR
    with pytest.raises(SpdyProtocolError):
        server.receive_data(b"")


def test_bad_version_fails_the_connection() -> None:
    assert_connection_failed(SpdyConnection(), control_frame(6, b"\0\0\0\1", version=2))


def test_oversized_frame_fails_before_its_body_arrives() -> None:
    server = SpdyConnection(max_frame_size=1024)
    assert_connection_failed(server, struct.pack(">II", 1, 1025))


def test_garbage_header_block_fails_the_connection() -> None:
    payload = struct.pack(">IIBB", 1, 0, 0, 0) + b"\x78\xbbnot zlib at all"
    assert_connection_failed(SpdyConnection(), control_frame(1, payload))


@pytest.mark.parametrize(
    "block",
    [
        raw_block([(b"Upper", b"x")]),
        raw_block([(b"", b"x")]),
        raw_block([(b"a", b"1"), (b"a", b"2")]),
        raw_block([(b"a", b"1")]) + b"trailing",
        raw_block([(b"a", b"1")])[:-1],
        struct.pack(">I", 1000),
        b"\0\0",
    ],
)
def test_malformed_header_block_fails_the_connection(block: bytes) -> None:
    assert_connection_failed(SpdyConnection(), syn_stream(HeaderCompressor(), 1, block))


def test_decompression_bomb_is_refused() -> None:
    bomb = raw_block([(b"x", b"a" * 100_000)])
    assert len(syn_stream(HeaderCompressor(), 1, bomb)) < 1000
    assert_connection_failed(
        SpdyConnection(max_header_block=64 * 1024), syn_stream(HeaderCompressor(), 1, bomb)
    )


@pytest.mark.parametrize(
    "wire",
    [
        control_frame(6, b"\0\0\0\1\0"),  # PING of 5 bytes
        control_frame(3, b"\0\0\0\1"),  # short RST_STREAM
        control_frame(7, b"\0\0\0\1"),  # short GOAWAY
        control_frame(9, b"\0"),  # short WINDOW_UPDATE
        control_frame(1, b"\0" * 9),  # SYN_STREAM without room for its fields
        control_frame(2, b"\0\0"),  # SYN_REPLY without a stream id
        data_frame(0, b"x"),  # DATA on stream 0
        rst_frame(0, 1),  # RST_STREAM on stream 0
    ],
)
def test_malformed_frames_fail_the_connection(wire: bytes) -> None:
    assert_connection_failed(SpdyConnection(), wire)


# ---- local misuse ---------------------------------------------------------------------------


def test_local_misuse_is_refused() -> None:
    client, server = pair()
    stream_id = client.open_stream({})
    deliver(client, server)
    with pytest.raises(LocalProtocolError):
        client.reply(stream_id, {})
    with pytest.raises(LocalProtocolError):
        server.send_data(stream_id, b"before reply")
    server.reply(stream_id, {})
    with pytest.raises(LocalProtocolError):
        server.reply(stream_id, {})
    with pytest.raises(StreamClosedError):
        server.reply(99, {})
    with pytest.raises(ValueError):
        client.open_stream({"Upper": "x"})
    with pytest.raises(ValueError):
        client.open_stream({"x": "\u2603"})
    with pytest.raises(ValueError):
        client.open_stream({}, priority=8)
    with pytest.raises(ValueError):
        client.reset(stream_id, 0)
    assert client._next_stream_id == 3, "refused opens do not use up ids"


def test_stream_ids_run_out() -> None:
    client = SpdyConnection(client_side=True)
    client._next_stream_id = 0x7FFFFFFF
    assert client.open_stream({}) == 0x7FFFFFFF
    with pytest.raises(LocalProtocolError):
        client.open_stream({})


# ---- properties -----------------------------------------------------------------------------

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_FRAME = 4096


def frame_builders() -> st.SearchStrategy[FrameBuilder]:
    """Frames that get past the 8-byte header: valid SYN_STREAMs on a shared compressor, and
    control and data frames with arbitrary bodies."""
    header_values = st.lists(
        st.tuples(st.sampled_from([b"streamtype", b"port", b"a", b"B"]), st.binary(max_size=8)),
        max_size=3,
    )

    def syn(stream_id: int, flags: int, pairs: list[tuple[bytes, bytes]]) -> FrameBuilder:
        return lambda compressor: syn_stream(compressor, stream_id, raw_block(pairs), flags)

    def reply(stream_id: int, flags: int, pairs: list[tuple[bytes, bytes]]) -> FrameBuilder:
        return lambda compressor: syn_reply(compressor, stream_id, raw_block(pairs), flags)

    def control(frame_type: int, flags: int, body: bytes) -> FrameBuilder:
        return lambda _compressor: control_frame(frame_type, body, flags)

    def data(stream_id: int, flags: int, body: bytes) -> FrameBuilder:
        return lambda _compressor: data_frame(stream_id, body, flags)

    def noise(raw: bytes) -> FrameBuilder:
        return lambda _compressor: raw

    stream_ids = st.integers(0, 9)
    flags = st.integers(0, 3)
    return st.one_of(
        st.builds(syn, stream_ids, flags, header_values),
        st.builds(reply, stream_ids, flags, header_values),
        st.builds(control, st.integers(0, 12), flags, st.binary(max_size=24)),
        st.builds(data, stream_ids, flags, st.binary(max_size=24)),
        st.builds(noise, st.binary(max_size=40)),
    )


@FAST
@given(frames=st.lists(frame_builders(), max_size=12), cuts=st.lists(st.integers(1, 64)))
def test_arbitrary_input_only_raises_protocol_errors(
    frames: list[FrameBuilder], cuts: list[int]
) -> None:
    compressor = HeaderCompressor()
    wire = b"".join(frame(compressor) for frame in frames)
    server = SpdyConnection(max_frame_size=MAX_FRAME, max_header_block=1024)
    position = 0
    try:
        for cut in [*cuts, len(wire)]:
            server.receive_data(wire[position : position + cut])
            position += cut
            assert len(server._buffer) <= MAX_FRAME + 8
            server.data_to_send()
    except SpdyProtocolError:
        assert server._buffer == b""


@FAST
@given(noise=st.binary(max_size=2 * MAX_FRAME))
def test_random_bytes_only_raise_protocol_errors(noise: bytes) -> None:
    server = SpdyConnection(max_frame_size=MAX_FRAME)
    try:
        server.receive_data(noise)
    except SpdyProtocolError:
        return
    assert len(server._buffer) < MAX_FRAME + 8


@dataclass(frozen=True)
class Step:
    action: str
    side: str
    fin: bool
    pick: int
    payload: bytes
    cuts: tuple[int, ...]


steps = st.builds(
    Step,
    action=st.sampled_from(
        ["open", "open", "reply", "reply", "data", "data", "data", "reset", "ping"]
    ),
    side=st.sampled_from(["client", "server"]),
    fin=st.integers(0, 3).map(lambda n: n == 0),
    pick=st.integers(0, 7),
    payload=st.binary(max_size=64),
    cuts=st.lists(st.integers(0, 100), max_size=3).map(lambda cuts: tuple(sorted(cuts))),
)


def other(side: str) -> str:
    return "server" if side == "client" else "client"


class Conversation:
    """Drives a client and a server with valid calls and checks what each side observes."""

    def __init__(self) -> None:
        self.client, self.server = pair()
        self.replied: set[int] = set()
        self.open: set[int] = set()
        self.closed: dict[tuple[str, int], bool] = {}
        self.sent: dict[tuple[str, int], bytearray] = {}
        self.received: dict[tuple[str, int], bytearray] = {}
        self.fin_seen: set[tuple[str, int]] = set()
        self.pings = 0

    def side(self, name: str) -> SpdyConnection:
        return self.client if name == "client" else self.server

    def transmit(self, sender: str, cuts: tuple[int, ...]) -> list[Event]:
        """Delivers what `sender` queued, split at `cuts` percent of its length."""
        wire = self.side(sender).data_to_send()
        events: list[Event] = []
        start = 0
        for cut in [*(len(wire) * percent // 100 for percent in cuts), len(wire)]:
            events += self.side(other(sender)).receive_data(wire[start:cut])
            start = cut
        for event in events:
            if isinstance(event, DataReceived):
                self.received.setdefault((other(sender), event.stream_id), bytearray()).extend(
                    event.data
                )
            if isinstance(event, DataReceived | StreamReplied | StreamOpened) and event.fin:
                self.fin_seen.add((other(sender), event.stream_id))
        return events

    def may_send(self, name: str, stream_id: int) -> bool:
        return not self.closed.get((name, stream_id)) and (
            name == "client" or stream_id in self.replied
        )

    def run(self, step: Step) -> None:
        pending = sorted(self.open - self.replied)
        sender = (
            step.side if any(self.may_send(step.side, s) for s in self.open) else other(step.side)
        )
        sendable = sorted(s for s in self.open if self.may_send(sender, s))
        if step.action == "open" and len(self.open) < 4:
            headers = {"streamtype": ["stdin", "stdout", "error"][step.pick % 3]}
            stream_id = self.client.open_stream(headers, fin=step.fin)
            self.open.add(stream_id)
            self.closed[("client", stream_id)] = step.fin
            events = self.transmit("client", step.cuts)
            assert events == [StreamOpened(stream_id, 0, 0, headers, step.fin)]
        elif step.action == "reply" and pending:
            stream_id = pending[step.pick % len(pending)]
            self.server.reply(stream_id, {"ok": "1"}, fin=step.fin)
            self.replied.add(stream_id)
            self.closed[("server", stream_id)] = step.fin
            events = self.transmit("server", step.cuts)
            assert events == [StreamReplied(stream_id, {"ok": "1"}, step.fin)]
        elif step.action == "data" and sendable:
            stream_id = sendable[step.pick % len(sendable)]
            self.side(sender).send_data(stream_id, step.payload, fin=step.fin)
            self.sent.setdefault((sender, stream_id), bytearray()).extend(step.payload)
            self.closed[(sender, stream_id)] = step.fin
            self.transmit(sender, step.cuts)
        elif step.action == "reset" and self.open:
            stream_id = sorted(self.open)[step.pick % len(self.open)]
            self.side(step.side).reset(stream_id)
            events = self.transmit(step.side, step.cuts)
            assert events == [StreamReset(stream_id, RstStatus.CANCEL)]
            self.open.discard(stream_id)
        elif step.action == "ping":
            self.pings += 1
            ping_id = 2 * self.pings - (1 if step.side == "client" else 0)
            self.side(step.side).ping(ping_id)
            assert self.transmit(step.side, step.cuts) == [PingReceived(ping_id)]
            assert self.transmit(other(step.side), ()) == [PingAcknowledged(ping_id)]
        for stream_id in list(self.open):
            if self.closed.get(("client", stream_id)) and self.closed.get(("server", stream_id)):
                self.open.discard(stream_id)

    def check(self) -> None:
        for (sender, stream_id), data in self.sent.items():
            assert self.received.get((other(sender), stream_id), b"") == data
        for (sender, stream_id), closed in self.closed.items():
            if closed:
                assert (other(sender), stream_id) in self.fin_seen
        assert set(self.client._streams) == self.open, "closed streams are forgotten"
        assert set(self.server._streams) == self.open, "closed streams are forgotten"


@FAST
@given(st.lists(steps, min_size=4, max_size=25))
def test_random_conversations_round_trip(plan: list[Step]) -> None:
    conversation = Conversation()
    for step in plan:
        conversation.run(step)
    conversation.check()
