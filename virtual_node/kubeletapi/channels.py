"""Sans-IO codecs for the Kubernetes channel protocols carried over WebSocket.

Exec, attach and port-forward over WebSocket multiplex numbered channels onto one connection,
one WebSocket message per write. aiohttp does the WebSocket framing; this module does what goes
inside a message, as the apimachinery `wsstream` package does:

- binary protocols (``channel.k8s.io``, ``v4.channel.k8s.io``, ``v5.channel.k8s.io``, and no
  subprotocol at all): one byte of channel number, then the payload;
- base64 protocols (``base64.channel.k8s.io``, ``v4.base64.channel.k8s.io``): one character
  ``'0' + channel``, then the payload in standard base64, sent as a text message;
- ``v5.channel.k8s.io`` adds the half-close message ``[255, channel]``.

Upstream quietly skips empty messages and messages for channels it does not know; here they
raise `ChannelProtocolError`, and the I/O shell decides whether to skip or close.

Port-forward gives each requested port two channels, data then error, and the server's first
message on each is the port as two little-endian bytes (`PortForwardChannels`). Exec's error
channel carries, in v4 and v5, one JSON `metav1.Status` that reports the exit code; the helpers
at the end build and read it with the wording kubelets and container runtimes use.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

STDIN = 0
STDOUT = 1
STDERR = 2
ERROR = 3
RESIZE = 4
CLOSE = 255

V5_PROTOCOL = "v5.channel.k8s.io"
V4_PROTOCOL = "v4.channel.k8s.io"
V4_BASE64_PROTOCOL = "v4.base64.channel.k8s.io"
CHANNEL_PROTOCOL = "channel.k8s.io"
BASE64_CHANNEL_PROTOCOL = "base64.channel.k8s.io"

# Newest first, as kubectl offers them; upstream servers take the first offered they support.
EXEC_PROTOCOLS = (
    V5_PROTOCOL,
    V4_PROTOCOL,
    V4_BASE64_PROTOCOL,
    CHANNEL_PROTOCOL,
    BASE64_CHANNEL_PROTOCOL,
)
PORT_FORWARD_PROTOCOLS = (V4_PROTOCOL, V4_BASE64_PROTOCOL)

# "" is a client that offered no subprotocol; upstream serves it the binary framing.
_BASE64_BY_PROTOCOL = {
    "": False,
    CHANNEL_PROTOCOL: False,
    V4_PROTOCOL: False,
    V5_PROTOCOL: False,
    BASE64_CHANNEL_PROTOCOL: True,
    V4_BASE64_PROTOCOL: True,
}
_TEXT_STATUS_PROTOCOLS = frozenset({"", CHANNEL_PROTOCOL, BASE64_CHANNEL_PROTOCOL})
_BASE64_CHANNEL_ORIGIN = ord("0")
# The channel character must stay ASCII, or a text message would carry it as two UTF-8 bytes.
_MAX_BASE64_CHANNELS = 0x80 - _BASE64_CHANNEL_ORIGIN
# Byte 255 is reserved (v5 uses it for close), so a binary channel number stops at 254.
_MAX_BINARY_CHANNELS = CLOSE

NON_ZERO_EXIT_CODE_REASON = "NonZeroExitCode"
# How an apiserver words an error it did not expect (apimachinery's NewInternalError).
INTERNAL_ERROR_REASON = "InternalError"
INTERNAL_ERROR_PREFIX = "Internal error occurred: "
EXIT_CODE_CAUSE = "ExitCode"
_MAX_EXIT_CODE = 255


class ChannelProtocolError(ValueError):
    """A message, or an error-channel Status, that the protocol does not allow."""


class ExecFailure(Exception):
    """The error channel reported a failure that is not a process exit code."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ChannelData:
    channel: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class CloseChannel:
    """v5 half-close: the sender will write no more on `channel`."""

    channel: int


class ChannelCodec:
    """Encodes and decodes the messages of one connection's negotiated subprotocol."""

    def __init__(self, protocol: str, channel_count: int) -> None:
        if protocol not in _BASE64_BY_PROTOCOL:
            raise ValueError(f"unknown channel protocol {protocol!r}")
        self.protocol = protocol
        self.base64 = _BASE64_BY_PROTOCOL[protocol]
        self.supports_close = protocol == V5_PROTOCOL
        # Before v4 the error channel carries a failure's message as plain text, and
        # nothing on success.
        self.status_as_text = protocol in _TEXT_STATUS_PROTOCOLS
        limit = _MAX_BASE64_CHANNELS if self.base64 else _MAX_BINARY_CHANNELS
        if not 0 < channel_count <= limit:
            raise ValueError(f"{protocol!r} carries 1..{limit} channels, not {channel_count}")
        self.channel_count = channel_count

    def encode(self, channel: int, payload: bytes) -> bytes | str:
        """The message for `payload` on `channel`: text for base64 protocols, else binary."""
        self._require_channel(channel, ValueError)
        if self.base64:
            return chr(_BASE64_CHANNEL_ORIGIN + channel) + base64.b64encode(payload).decode()
        return bytes((channel,)) + payload

    def encode_close(self, channel: int) -> bytes:
        """The v5 message that half-closes `channel`."""
        if not self.supports_close:
            raise ValueError(f"{self.protocol!r} has no close message")
        self._require_channel(channel, ValueError)
        return bytes((CLOSE, channel))

    def decode(self, message: bytes | str) -> ChannelData | CloseChannel:
        """Reads one received message, text or binary, as upstream accepts either."""
        if isinstance(message, str):
            if self.base64 and not message.isascii():
                raise ChannelProtocolError("base64 channel message is not ASCII")
            try:
                message = message.encode()
            except UnicodeEncodeError as error:
                raise ChannelProtocolError(f"text message is not UTF-8: {error}") from error
        if not message:
            raise ChannelProtocolError("empty message has no channel")
        if self.supports_close and message[0] == CLOSE:
            if len(message) != 2:
                raise ChannelProtocolError("close message must name exactly one channel")
            self._require_channel(message[1], ChannelProtocolError)
            return CloseChannel(message[1])
        if self.base64:
            channel = message[0] - _BASE64_CHANNEL_ORIGIN
            self._require_channel(channel, ChannelProtocolError)
            try:
                payload = base64.b64decode(message[1:], validate=True)
            except binascii.Error as error:
                raise ChannelProtocolError(f"bad base64 on channel {channel}: {error}") from error
            return ChannelData(channel, payload)
        self._require_channel(message[0], ChannelProtocolError)
        return ChannelData(message[0], bytes(message[1:]))

    def _require_channel(self, channel: int, error: type[ValueError]) -> None:
        if not 0 <= channel < self.channel_count:
            raise error(f"channel {channel} is not one of the {self.channel_count} in use")


class PortForwardChannels:
    """The channel layout of a WebSocket port-forward: port i has data channel 2i and error
    channel 2i+1. The server announces each channel's port in its first message there; the
    receiving side checks and strips that announcement."""

    def __init__(self, ports: Sequence[int]) -> None:
        if not ports:
            raise ValueError("port-forward needs at least one port")
        for port in ports:
            if not 0 < port <= 0xFFFF:
                raise ValueError(f"port {port} out of range")
        self.ports = tuple(ports)
        self.channel_count = 2 * len(self.ports)
        self._announced: set[int] = set()

    def data_channel(self, index: int) -> int:
        """The data channel of the `index`-th requested port."""
        return 2 * self._require_index(index)

    def error_channel(self, index: int) -> int:
        """The error channel of the `index`-th requested port."""
        return 2 * self._require_index(index) + 1

    def port_of(self, channel: int) -> int:
        if not 0 <= channel < self.channel_count:
            raise ValueError(f"channel {channel} is not one of the {self.channel_count} in use")
        return self.ports[channel // 2]

    def announcements(self) -> list[tuple[int, bytes]]:
        """The (channel, payload) messages a server sends first, one per channel in order."""
        return [
            (channel, self.port_of(channel).to_bytes(2, "little"))
            for channel in range(self.channel_count)
        ]

    def receive(self, channel: int, payload: bytes) -> bytes:
        """The payload with the port announcement stripped if this is the channel's first
        message; raises if that announcement is missing or names another port."""
        try:
            port = self.port_of(channel)
        except ValueError as error:
            raise ChannelProtocolError(str(error)) from error
        if channel in self._announced:
            return payload
        if len(payload) < 2:
            raise ChannelProtocolError(f"channel {channel} opened without its port")
        announced = int.from_bytes(payload[:2], "little")
        if announced != port:
            raise ChannelProtocolError(f"channel {channel} announced {announced}, not {port}")
        self._announced.add(channel)
        return payload[2:]

    def _require_index(self, index: int) -> int:
        if not 0 <= index < len(self.ports):
            raise ValueError(f"port index {index} is not one of the {len(self.ports)} requested")
        return index


def success_status() -> bytes:
    """The error-channel Status of a command that exited 0."""
    return _encode_status({"metadata": {}, "status": "Success"})


def internal_error_status(message: str) -> bytes:
    """The error-channel Status of a session that failed on the way (kubectl prints its
    message and exits 1)."""
    return _encode_status(
        {
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": INTERNAL_ERROR_REASON,
            "code": 500,
        }
    )


def exit_code_status(exit_code: int, command: Sequence[str]) -> bytes:
    """The error-channel Status of a command that exited non-zero, worded as the kubelet wraps
    the container runtime's error ("error executing command [sh -c exit 3], exit code 3")."""
    if not 0 < exit_code <= _MAX_EXIT_CODE:
        raise ValueError(f"exit code {exit_code} is not in 1..{_MAX_EXIT_CODE}")
    runtime_error = f"error executing command [{' '.join(command)}], exit code {exit_code}"
    return _encode_status(
        {
            "metadata": {},
            "status": "Failure",
            "message": f"command terminated with non-zero exit code: {runtime_error}",
            "reason": NON_ZERO_EXIT_CODE_REASON,
            "details": {"causes": [{"reason": EXIT_CODE_CAUSE, "message": str(exit_code)}]},
        }
    )


def unwrapped_internal_error(payload: bytes) -> bytes:
    """The error-channel Status as the kubelet below sent it, when an apiserver wrapped it
    as an internal error of its own (``Internal error occurred: <its message>``, the
    message its one cause): the apiserver above wraps it again, and with the lower
    apiserver's wrapping left on, kubectl would read one more than directly. Any other
    payload is returned as it is."""
    try:
        status: Any = json.loads(payload)
    except (ValueError, RecursionError):
        return payload
    if not isinstance(status, dict) or status.get("reason") != INTERNAL_ERROR_REASON:
        return payload
    details = status.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    if not (isinstance(causes, list) and len(causes) == 1 and isinstance(causes[0], dict)):
        return payload
    inner = causes[0].get("message")
    if not isinstance(inner, str) or status.get("message") != INTERNAL_ERROR_PREFIX + inner:
        return payload
    return _encode_status(
        {
            **status,
            "message": inner,
            "details": {"causes": [{"message": inner.removeprefix(INTERNAL_ERROR_PREFIX)}]},
        }
    )


def status_text(status: bytes) -> bytes:
    """The error channel's Status as protocols before v4 carry it, as the kubelet writes
    it for them: nothing for success, else the failure's message."""
    try:
        parsed: Any = json.loads(status)
    except (ValueError, RecursionError):
        return status
    if not isinstance(parsed, dict):
        return status
    if parsed.get("status") == "Success":
        return b""
    return str(parsed.get("message") or "").encode()


def parse_exec_status(payload: bytes) -> int | None:
    """Reads the error channel's Status as client-go does: None for success, the exit code for
    a non-zero exit, `ExecFailure` for any other failure, `ChannelProtocolError` for a Status
    that is not one. The payload is everything the channel carried, joined."""
    try:
        status: Any = json.loads(payload)
    except (ValueError, RecursionError) as error:
        raise ChannelProtocolError(f"error stream protocol error: {error}") from error
    if not isinstance(status, dict):
        raise ChannelProtocolError("error stream protocol error: Status is not an object")
    outcome = status.get("status")
    if outcome == "Success":
        return None
    if outcome != "Failure":
        raise ChannelProtocolError("error stream protocol error: unknown error")
    reason = status.get("reason")
    if reason == NON_ZERO_EXIT_CODE_REASON:
        return _exit_code_from_details(status.get("details"))
    message = status.get("message")
    raise ExecFailure(
        message if isinstance(message, str) else "", reason if isinstance(reason, str) else ""
    )


def _exit_code_from_details(details: Any) -> int:
    if not isinstance(details, dict):
        raise ChannelProtocolError("error stream protocol error: details must be set")
    causes = details.get("causes")
    for cause in causes if isinstance(causes, list) else []:
        if not isinstance(cause, dict) or cause.get("reason") != EXIT_CODE_CAUSE:
            continue
        code = cause.get("message")
        # client-go parses it as an unsigned 8-bit decimal, leading zeros allowed; the length
        # check keeps int() away from its limit on digit strings thousands of digits long.
        digits = code.lstrip("0") if isinstance(code, str) else ""
        if not (
            isinstance(code, str)
            and code.isascii()
            and code.isdecimal()
            and len(digits) <= 3
            and int(digits or "0") <= _MAX_EXIT_CODE
        ):
            raise ChannelProtocolError(f"error stream protocol error: bad exit code {code!r}")
        return int(digits or "0")
    raise ChannelProtocolError(f"error stream protocol error: no {EXIT_CODE_CAUSE} cause given")


def _encode_status(status: dict[str, Any]) -> bytes:
    return json.dumps(status, separators=(",", ":"), ensure_ascii=False).encode()
