"""The kubelet API's provider for a lower cluster: every call becomes a call to the lower
apiserver's pod subresources for the mirrored pod (pods/log streamed, pods/exec,
pods/attach and pods/portforward over WebSocket, so stdin EOF reaches the process)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import aiohttp

from kubekit.client import CONNECTION_ERRORS, PODS, ApiError, KubeClient
from kubekit.informer import Informer, object_key
from kubekit.timestamps import parse_time
from virtual_node.kubeletapi import channels, metrics
from virtual_node.kubeletapi.provider import (
    JSON,
    ExecOptions,
    LogOptions,
    PortConnection,
    ProviderError,
    RemoteProcess,
)
from virtual_node.naming import NamespaceMapping, NamingError
from virtual_node.translate import made_from

METRICS_GROUP = "/apis/metrics.k8s.io/v1beta1"
# Container runtimes that wrap Go's os/exec error (kwok among them) report a non-zero
# exit as a plain failure ending in this; it is still the command's exit code.
_GO_EXIT_STATUS = re.compile(r"exit status (\d{1,3})$")
LOST_SESSION = (
    "the session with the lower cluster ended before the command's exit status came; "
    "its output may be cut short"
)


def container_starts(pod: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    """When each running container of a pod started, from its status (epoch seconds)."""
    starts = []
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        started = ((status.get("state") or {}).get("running") or {}).get("startedAt")
        if started:
            starts.append((str(status.get("name", "")), parse_time(started).timestamp()))
    return tuple(starts)


def container_images(pod: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """Each container's image as its status reports it (the image the runtime runs)."""
    return tuple(
        (str(status.get("name", "")), str(status.get("image", "")))
        for status in (pod.get("status") or {}).get("containerStatuses") or []
    )


# The codes whose message the apiserver hands on to kubectl: it reads a kubelet's refused
# pods/log answer through its generic response checker, which puts fixed words in place
# of the body for a 404 or a 503 ("the server is currently unable to handle the request",
# read as the upper apiserver being down). A refused upgrade shows any code's body.
NOT_THERE_YET = 400  # as the kubelet answers for a container waiting to start
UNREACHABLE = 502


def _unavailable(error: Exception) -> ProviderError:
    return ProviderError(UNREACHABLE, f"the lower cluster is unreachable: {error}")


# How the apiserver's authorizer words a refusal (an admission refusal never names a user).
_RBAC_REFUSAL = re.compile(r'User "[^"]*" cannot ')


def lower_failure(error: ApiError) -> ProviderError:
    """A lower apiserver's refusal as the kubelet API answers it. A 401, or a 403 of its
    authorizer (`User "…" cannot …`), is the virtual node's own credentials below, not
    the caller's: passed on, kubectl told a user whose credentials are fine "You must be
    logged in to the server". An admission webhook's or policy's 403 is passed on."""
    message = error.message or error.reason or f"HTTP {error.status}"
    if error.status == 401 or (error.status == 403 and _RBAC_REFUSAL.search(message)):
        return ProviderError(502, f"lower cluster refused the virtual node: {message}")
    status = error.status if 400 <= error.status < 500 else 502
    return ProviderError(status, f"lower cluster: {message}")


def exec_status(error_channel: bytes, command: tuple[str, ...]) -> bytes:
    """The Status to report upward for what the lower error channel carried. The lower
    side writes one in every case, Success included: none means the session broke on the
    way (the lower apiserver restarted, a proxy cut the connection), and the output seen
    may be cut short, so it is no success."""
    if not error_channel:
        return channels.internal_error_status(LOST_SESSION)
    try:
        channels.parse_exec_status(error_channel)
    except channels.ExecFailure as failure:
        found = _GO_EXIT_STATUS.search(failure.message)
        if found and 0 < int(found.group(1)) <= 255:
            return channels.exit_code_status(int(found.group(1)), command)
        return channels.unwrapped_internal_error(error_channel)
    except channels.ChannelProtocolError:
        pass
    return error_channel


def dropped(message: aiohttp.WSMessage, socket: aiohttp.ClientWebSocketResponse) -> bool:
    """Whether a WebSocket ended without its peer's goodbye (the connection dropped)."""
    return message.type is aiohttp.WSMsgType.ERROR or (
        message.type is aiohttp.WSMsgType.CLOSED
        and socket.close_code == aiohttp.WSCloseCode.ABNORMAL_CLOSURE
    )


class WebSocketProcess:
    """An exec/attach session on the lower apiserver over v5.channel.k8s.io (or v4)."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse, command: tuple[str, ...]) -> None:
        self._socket = socket
        self._codec = channels.ChannelCodec(socket.protocol or channels.V4_PROTOCOL, 5)
        self._command = command
        self._error = bytearray()

    async def send_stdin(self, data: bytes) -> None:
        await self._send(self._codec.encode(channels.STDIN, data))

    async def close_stdin(self) -> None:
        if self._codec.supports_close:
            await self._send(self._codec.encode_close(channels.STDIN))

    async def resize(self, payload: bytes) -> None:
        await self._send(self._codec.encode(channels.RESIZE, payload))

    async def _send(self, message: bytes | str) -> None:
        if self._socket.closed:
            return
        try:
            if isinstance(message, str):
                await self._socket.send_str(message)
            else:
                await self._socket.send_bytes(message)
        except ConnectionError:
            pass  # the process ended; output() reports how

    async def output(self) -> AsyncIterator[tuple[int, bytes]]:
        async for message in self._socket:
            if message.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                break
            try:
                decoded = self._codec.decode(message.data)
            except channels.ChannelProtocolError:
                continue  # upstream skips empty and unknown-channel messages too
            if isinstance(decoded, channels.CloseChannel):
                continue
            if decoded.channel == channels.ERROR:
                self._error += decoded.payload
            elif decoded.channel in (channels.STDOUT, channels.STDERR) and decoded.payload:
                yield decoded.channel, decoded.payload

    def status(self) -> bytes:
        return exec_status(bytes(self._error), self._command)

    async def close(self) -> None:
        await self._socket.close()


class WebSocketPort:
    """One connection to a lower pod's port over the v4 port-forward channels."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse, port: int) -> None:
        self._socket = socket
        self._channels = channels.PortForwardChannels((port,))
        self._codec = channels.ChannelCodec(socket.protocol or channels.V4_PROTOCOL, 2)
        self._error = bytearray()
        self._closing = False

    async def send(self, data: bytes) -> None:
        if not self._socket.closed:
            message = self._codec.encode(self._channels.data_channel(0), data)
            assert isinstance(message, bytes)
            with contextlib.suppress(ConnectionError):  # the pod side went away: receive() says
                await self._socket.send_bytes(message)

    async def receive(self) -> bytes:
        while True:
            message = await self._socket.receive()
            if message.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                if dropped(message, self._socket) and not self._closing:
                    # Said on the error stream: ended as if the pod had closed it, the
                    # client took what came through for the whole of it.
                    self._error += b"the connection to the lower cluster broke"
                return b""
            try:
                decoded = self._codec.decode(message.data)
            except channels.ChannelProtocolError:
                continue
            if isinstance(decoded, channels.CloseChannel):
                continue
            try:
                payload = self._channels.receive(decoded.channel, decoded.payload)
            except (ValueError, channels.ChannelProtocolError):
                continue
            if decoded.channel == self._channels.error_channel(0):
                self._error += payload
            elif payload:
                return payload

    def error(self) -> str:
        return self._error.decode(errors="replace")

    async def close(self) -> None:
        self._closing = True
        await self._socket.close()


class LowerKubelet:
    """KubeletProvider backed by the lower apiserver."""

    def __init__(
        self,
        node_name: str,
        upper_pods: Informer,
        lower_pods: Informer,
        lower: KubeClient,
        mapping: NamespaceMapping,
    ) -> None:
        self.node_name = node_name
        self.upper_pods = upper_pods
        self.lower_pods = lower_pods
        self.lower = lower
        self.mapping = mapping
        self._cpu_counters = metrics.CpuCounters()

    def pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        pod = self.upper_pods.get(f"{namespace}/{name}")
        if pod is None or pod["spec"].get("nodeName") != self.node_name:
            return None
        return pod

    def pods(self) -> list[JSON]:
        return list(self.upper_pods.items())

    def _lower_key(self, metadata: Mapping[str, Any]) -> str | None:
        """The pod's key below; None when its namespace has no name there (too long for
        the prefix: the pod was never made below, TranslationFailed above)."""
        try:
            return f"{self.mapping.lower(metadata['namespace'])}/{metadata['name']}"
        except NamingError:
            return None

    def _copy_below(self, pod: Mapping[str, Any]) -> JSON | None:
        """The lower pod made from this very upper pod: not a namesake of another tenant
        or of the lower cluster's (the upper pod failed NameConflict), nor one an earlier
        upper pod of the name left."""
        key = self._lower_key(pod["metadata"])
        lower = self.lower_pods.get(key) if key is not None else None
        return lower if lower is not None and made_from(lower, pod) else None

    def _lower_path(self, pod: Mapping[str, Any], subresource: str) -> str:
        metadata = pod["metadata"]
        lower = self._copy_below(pod)
        if lower is None:
            raise ProviderError(
                NOT_THERE_YET,
                f"pod {metadata['namespace']}/{metadata['name']} is not running below yet",
            )
        return PODS.path(lower["metadata"]["namespace"], metadata["name"], subresource)

    async def container_logs(
        self, pod: Mapping[str, Any], container: str, options: LogOptions
    ) -> AsyncGenerator[bytes, None]:
        path = self._lower_path(pod, "log")
        try:
            response = await self.lower.stream(path, {"container": container, **options.query()})
        except ApiError as error:
            raise lower_failure(error) from error
        except CONNECTION_ERRORS as error:
            raise _unavailable(error) from error
        try:
            async for chunk in response.content.iter_any():
                yield chunk
        except CONNECTION_ERRORS as error:
            raise ProviderError(502, f"the lower log stream broke: {error}") from error
        finally:
            response.release()

    async def exec(
        self, pod: Mapping[str, Any], container: str, options: ExecOptions, *, attach: bool
    ) -> RemoteProcess:
        path = self._lower_path(pod, "attach" if attach else "exec")
        query = [("container", container)]
        query += [("command", c) for c in options.command]
        for name, enabled in (
            ("stdin", options.stdin),
            ("stdout", options.stdout),
            ("stderr", options.stderr),
            ("tty", options.tty),
        ):
            if enabled:
                query.append((name, "true"))
        socket = await self._websocket(path, query, (channels.V5_PROTOCOL, channels.V4_PROTOCOL))
        return WebSocketProcess(socket, options.command)

    async def port_forward(self, pod: Mapping[str, Any], port: int) -> PortConnection:
        path = self._lower_path(pod, "portforward")
        socket = await self._websocket(path, [("ports", str(port))], (channels.V4_PROTOCOL,))
        return WebSocketPort(socket, port)

    async def _websocket(
        self, path: str, query: list[tuple[str, str]], protocols: tuple[str, ...]
    ) -> aiohttp.ClientWebSocketResponse:
        try:
            return await self.lower.websocket(path, query, protocols)
        except ApiError as error:
            raise lower_failure(error) from error
        except CONNECTION_ERRORS as error:
            raise _unavailable(error) from error

    async def _metrics(self, plural: str) -> list[JSON]:
        if not (self.upper_pods.synced.is_set() and self.lower_pods.synced.is_set()):
            # Served from the caches as they are, the node would read idle, running
            # nothing (`kubectl top node` about 0, not `<unknown>`).
            raise ProviderError(503, "the virtual node is starting: its pods are not listed yet")
        try:
            listed = await self.lower.request("GET", f"{METRICS_GROUP}/{plural}")
        except ApiError as error:
            if error.status in (404, 503):
                raise ProviderError(
                    503,
                    "resource metrics are not available: the lower cluster serves no "
                    "metrics.k8s.io API (install metrics-server there)",
                ) from error
            raise lower_failure(error) from error
        except CONNECTION_ERRORS as error:
            raise _unavailable(error) from error
        items: list[JSON] = listed.get("items") or []
        return items

    async def stats_summary(self) -> JSON:
        return metrics.summary(
            self.node_name,
            await self._metrics("pods"),
            self._mirrored_by_lower_key(),
            self._cpu_counters,
        )

    async def resource_metrics(self) -> str:
        return metrics.prometheus_text(
            await self._metrics("pods"), self._mirrored_by_lower_key(), self._cpu_counters
        )

    async def cadvisor_metrics(self) -> str:
        return metrics.cadvisor_text(
            await self._metrics("pods"), self._mirrored_by_lower_key(), self._cpu_counters
        )

    def _mirrored_by_lower_key(self) -> dict[str, metrics.UpperPod]:
        """lower namespace/name → the upper pod, of the pods we mirror: a namesake's usage
        below is not theirs (a kubelet reports only the pods it runs)."""
        mirrored = {}
        for pod in self.upper_pods.items():
            metadata = pod["metadata"]
            lower = self._copy_below(pod)
            if lower is None:
                continue  # not made below (yet, or its name taken there): no usage
            lower_key = object_key(lower)
            mirrored[lower_key] = metrics.UpperPod(
                metadata["namespace"],
                metadata["name"],
                metadata.get("uid", ""),
                container_starts(pod),
                container_images(pod),
            )
        return mirrored
