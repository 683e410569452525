import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from virtual_node.kubeletapi.channels import (
    BASE64_CHANNEL_PROTOCOL,
    CHANNEL_PROTOCOL,
    ERROR,
    EXEC_PROTOCOLS,
    RESIZE,
    STDERR,
    STDIN,
    STDOUT,
    V4_BASE64_PROTOCOL,
    V4_PROTOCOL,
    V5_PROTOCOL,
    ChannelCodec,
    ChannelData,
    ChannelProtocolError,
    CloseChannel,
    ExecFailure,
    PortForwardChannels,
    exit_code_status,
    parse_exec_status,
    success_status,
    unwrapped_internal_error,
)

FAST = settings(max_examples=200, deadline=None)
# An explicit alphabet spares Hypothesis building its Unicode tables, which costs seconds on a
# fresh checkout; these few characters still cover ASCII, Latin-1, the BMP and beyond.
short_text = st.text(alphabet='az09 +/="\\\x00\u00e9\u2603\U0001f600', max_size=8)
ALL_PROTOCOLS = ["", *EXEC_PROTOCOLS]
EXEC_CHANNELS = RESIZE + 1


def test_channel_numbers_are_the_upstream_ones() -> None:
    assert (STDIN, STDOUT, STDERR, ERROR, RESIZE) == (0, 1, 2, 3, 4)


# ---- message codecs -------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["", CHANNEL_PROTOCOL, V4_PROTOCOL, V5_PROTOCOL])
def test_binary_protocols_prefix_the_channel_byte(protocol: str) -> None:
    codec = ChannelCodec(protocol, EXEC_CHANNELS)
    assert codec.encode(STDOUT, b"\n") == b"\x01\n"
    assert codec.decode(b"\x00foo\n") == ChannelData(STDIN, b"foo\n")
    assert codec.decode(b"\x01") == ChannelData(STDOUT, b""), "the kubelet's hello message"


@pytest.mark.parametrize("protocol", [BASE64_CHANNEL_PROTOCOL, V4_BASE64_PROTOCOL])
def test_base64_protocols_prefix_a_digit(protocol: str) -> None:
    codec = ChannelCodec(protocol, EXEC_CHANNELS)
    # The session in apimachinery's wsstream documentation.
    assert codec.decode("1Cg==") == ChannelData(STDOUT, b"\n")
    assert codec.encode(STDIN, b"foo\n") == "0Zm9vCg=="
    assert codec.decode(b"0Zm9vCg==") == ChannelData(STDIN, b"foo\n"), "binary frames too"
    assert codec.decode("3") == ChannelData(ERROR, b"")


def test_binary_protocols_accept_text_messages() -> None:
    assert ChannelCodec(V4_PROTOCOL, 3).decode("\x02é") == ChannelData(STDERR, "é".encode())


def test_v5_close_message() -> None:
    codec = ChannelCodec(V5_PROTOCOL, EXEC_CHANNELS)
    assert codec.encode_close(STDIN) == b"\xff\x00"
    assert codec.decode(b"\xff\x00") == CloseChannel(STDIN)
    for bad in (b"\xff", b"\xff\x00\x00", b"\xff\x09"):
        with pytest.raises(ChannelProtocolError):
            codec.decode(bad)


def test_close_is_v5_only() -> None:
    codec = ChannelCodec(V4_PROTOCOL, EXEC_CHANNELS)
    with pytest.raises(ValueError):
        codec.encode_close(STDIN)
    with pytest.raises(ChannelProtocolError):
        codec.decode(b"\xff\x00")


@pytest.mark.parametrize(
    ("protocol", "message"),
    [
        (V4_PROTOCOL, b""),
        (V4_PROTOCOL, ""),
        (V4_PROTOCOL, b"\x05data"),
        (V4_BASE64_PROTOCOL, ""),
        (V4_BASE64_PROTOCOL, "5Zm9v"),
        (V4_BASE64_PROTOCOL, "/Zm9v"),
        (V4_BASE64_PROTOCOL, "0Zm9"),
        (V4_BASE64_PROTOCOL, "0Zm 9v"),
        (V4_BASE64_PROTOCOL, "0Zm9vCg=\u00e9"),
        (V4_PROTOCOL, "\x00\ud800"),
    ],
)
def test_malformed_messages(protocol: str, message: bytes | str) -> None:
    with pytest.raises(ChannelProtocolError):
        ChannelCodec(protocol, EXEC_CHANNELS).decode(message)


@pytest.mark.parametrize(
    ("protocol", "channel_count"),
    [("v6.channel.k8s.io", 5), (V4_PROTOCOL, 0), (V4_PROTOCOL, 256), (V4_BASE64_PROTOCOL, 81)],
)
def test_codec_limits(protocol: str, channel_count: int) -> None:
    with pytest.raises(ValueError):
        ChannelCodec(protocol, channel_count)


def test_encoding_an_unknown_channel_is_refused() -> None:
    with pytest.raises(ValueError):
        ChannelCodec(V4_PROTOCOL, EXEC_CHANNELS).encode(EXEC_CHANNELS, b"")


@FAST
@given(
    protocol=st.sampled_from(ALL_PROTOCOLS),
    channel_count=st.integers(1, 80),
    pick=st.integers(0, 79),
    payload=st.binary(max_size=256),
)
def test_messages_round_trip(protocol: str, channel_count: int, pick: int, payload: bytes) -> None:
    codec = ChannelCodec(protocol, channel_count)
    channel = pick % channel_count
    message = codec.encode(channel, payload)
    assert isinstance(message, str) == codec.base64
    assert codec.decode(message) == ChannelData(channel, payload)
    if codec.supports_close:
        assert codec.decode(codec.encode_close(channel)) == CloseChannel(channel)


@FAST
@given(
    protocol=st.sampled_from(ALL_PROTOCOLS),
    message=st.one_of(
        st.binary(max_size=64),
        st.binary(max_size=64).map(lambda raw: raw.decode("latin-1")),
        st.lists(short_text).map("".join),
    ),
)
def test_arbitrary_messages_only_raise_protocol_errors(protocol: str, message: bytes | str) -> None:
    codec = ChannelCodec(protocol, EXEC_CHANNELS)
    try:
        decoded = codec.decode(message)
    except ChannelProtocolError:
        return
    assert 0 <= decoded.channel < EXEC_CHANNELS


# ---- port-forward ---------------------------------------------------------------------------


def test_port_forward_layout_and_announcements() -> None:
    layout = PortForwardChannels([8080, 53])
    assert layout.channel_count == 4
    assert (layout.data_channel(1), layout.error_channel(1)) == (2, 3)
    assert [layout.port_of(channel) for channel in range(4)] == [8080, 8080, 53, 53]
    assert layout.announcements() == [
        (0, b"\x90\x1f"),
        (1, b"\x90\x1f"),
        (2, b"\x35\x00"),
        (3, b"\x35\x00"),
    ]
    with pytest.raises(ValueError):
        layout.data_channel(2)
    with pytest.raises(ValueError):
        layout.port_of(4)


def test_port_forward_receiver_strips_the_announcement_once() -> None:
    layout = PortForwardChannels([8080])
    assert layout.receive(0, b"\x90\x1f") == b""
    assert layout.receive(0, b"\x90\x1fdata") == b"\x90\x1fdata", (
        "only the first is an announcement"
    )
    assert layout.receive(1, b"\x90\x1ferror text") == b"error text"


@pytest.mark.parametrize(
    ("channel", "payload"), [(0, b"\x90"), (0, b"\x35\x00"), (2, b"\x90\x1f"), (-1, b"\x90\x1f")]
)
def test_port_forward_receiver_refuses_bad_announcements(channel: int, payload: bytes) -> None:
    with pytest.raises(ChannelProtocolError):
        PortForwardChannels([8080]).receive(channel, payload)


@pytest.mark.parametrize("ports", [[], [0], [65536]])
def test_port_forward_ports_are_checked(ports: list[int]) -> None:
    with pytest.raises(ValueError):
        PortForwardChannels(ports)


@FAST
@given(ports=st.lists(st.integers(1, 65535), min_size=1, max_size=8), tail=st.binary(max_size=8))
def test_announcements_are_accepted_by_a_receiver(ports: list[int], tail: bytes) -> None:
    sender, receiver = PortForwardChannels(ports), PortForwardChannels(ports)
    for channel, announcement in sender.announcements():
        assert receiver.receive(channel, announcement + tail) == tail
        assert receiver.receive(channel, tail) == tail


# ---- exec status ----------------------------------------------------------------------------


def test_success_status_bytes() -> None:
    assert success_status() == b'{"metadata":{},"status":"Success"}'
    assert parse_exec_status(success_status()) is None


def test_exit_code_status_bytes() -> None:
    assert exit_code_status(3, ["sh", "-c", "exit 3"]) == (
        b'{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit code:'
        b' error executing command [sh -c exit 3], exit code 3","reason":"NonZeroExitCode",'
        b'"details":{"causes":[{"reason":"ExitCode","message":"3"}]}}'
    )


@pytest.mark.parametrize("exit_code", [0, 256, -1])
def test_exit_code_status_needs_a_non_zero_byte(exit_code: int) -> None:
    with pytest.raises(ValueError):
        exit_code_status(exit_code, ["true"])


@FAST
@given(exit_code=st.integers(1, 255), command=st.lists(short_text, max_size=4))
def test_exit_code_status_round_trips(exit_code: int, command: list[str]) -> None:
    assert parse_exec_status(exit_code_status(exit_code, command)) == exit_code


def test_other_failures_carry_their_message() -> None:
    # What the kubelet sends when the runtime fails outright (apierrors.NewInternalError).
    status = {
        "metadata": {},
        "status": "Failure",
        "message": "Internal error occurred: error executing command in container: boom",
        "reason": "InternalError",
        "details": {"causes": [{"message": "error executing command in container: boom"}]},
        "code": 500,
    }
    with pytest.raises(ExecFailure) as caught:
        parse_exec_status(json.dumps(status).encode())
    assert caught.value.message == status["message"]
    assert caught.value.reason == "InternalError"


def test_exit_code_with_leading_zeros_parses_as_go_does() -> None:
    assert parse_exec_status(non_zero_exit("007")) == 7


def non_zero_exit(code: Any) -> bytes:
    return json.dumps(
        {
            "status": "Failure",
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": code}]},
        }
    ).encode()


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"not json",
        b"[]",
        b'{"status":"Weird"}',
        b'{"status":"Failure","reason":"NonZeroExitCode"}',
        b'{"status":"Failure","reason":"NonZeroExitCode","details":{"causes":"x"}}',
        b'{"status":"Failure","reason":"NonZeroExitCode","details":{"causes":[{"reason":"X"}]}}',
        non_zero_exit("256"),
        non_zero_exit("-1"),
        non_zero_exit("1e2"),
        non_zero_exit("\u0663"),
        non_zero_exit("9" * 5000),
        non_zero_exit(3),
        b"[" * 100_000,
    ],
)
def test_malformed_statuses(payload: bytes) -> None:
    with pytest.raises(ChannelProtocolError):
        parse_exec_status(payload)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | short_text,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(short_text, children, max_size=3)
    ),
    max_leaves=8,
)
status_like = st.fixed_dictionaries(
    {},
    optional={
        "status": st.sampled_from(["Success", "Failure"]) | json_values,
        "reason": st.sampled_from(["NonZeroExitCode", "InternalError"]) | json_values,
        "message": json_values,
        "details": st.fixed_dictionaries(
            {},
            optional={
                "causes": st.lists(
                    st.fixed_dictionaries(
                        {},
                        optional={
                            "reason": st.just("ExitCode") | json_values,
                            "message": st.integers(0, 999).map(str) | json_values,
                        },
                    )
                    | json_values,
                    max_size=3,
                )
                | json_values
            },
        )
        | json_values,
    },
)


@FAST
@given(payload=st.one_of(st.binary(max_size=64), status_like.map(lambda s: json.dumps(s).encode())))
def test_arbitrary_statuses_only_raise_documented_errors(payload: bytes) -> None:
    try:
        exit_code = parse_exec_status(payload)
    except (ChannelProtocolError, ExecFailure):
        return
    assert exit_code is None or 0 <= exit_code <= 255


def internal_error(message: str) -> dict[str, Any]:
    """An apiserver's Status for an error it did not expect (apimachinery's wording)."""
    return {
        "metadata": {},
        "status": "Failure",
        "code": 500,
        "reason": "InternalError",
        "message": f"Internal error occurred: {message}",
        "details": {"causes": [{"message": message}]},
    }


def test_an_apiservers_wrapping_of_the_kubelets_internal_error_comes_off() -> None:
    kubelets = internal_error("error executing command in container: not found")
    wrapped = json.dumps(internal_error(kubelets["message"])).encode()
    assert json.loads(unwrapped_internal_error(wrapped)) == kubelets
    refused = internal_error("container x is not valid")
    refused["details"]["causes"][0]["message"] = "something else"
    for payload in (
        json.dumps(refused).encode(),
        json.dumps({**kubelets, "reason": "BadRequest"}).encode(),
        json.dumps({**kubelets, "details": {"causes": []}}).encode(),
        json.dumps({**kubelets, "details": "x"}).encode(),
        b"not json",
        b"[]",
    ):
        assert unwrapped_internal_error(payload) == payload
