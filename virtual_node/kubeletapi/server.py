"""The kubelet API over HTTPS: routes, query validation, authentication and the streaming
protocols (SPDY/3.1 from the apiserver, WebSocket channels from direct clients). What
runs the containers is a KubeletProvider."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

from aiohttp import WSMsgType, web

from kubekit.client import keep_alive
from kubekit.health import serve_metrics
from virtual_node.kubeletapi import channels
from virtual_node.kubeletapi.auth import AuthError, Authorizer
from virtual_node.kubeletapi.provider import (
    JSON,
    ExecOptions,
    KubeletProvider,
    LogOptions,
    PortConnection,
    ProviderError,
    RemoteProcess,
)
from virtual_node.kubeletapi.spdysession import (
    SpdySession,
    SpdyStream,
    choose_protocol,
    is_spdy_upgrade,
    offered_protocols,
    upgrade,
)

log = logging.getLogger("virtual_node.kubeletapi")

EXEC_SPDY_PROTOCOLS = (channels.V5_PROTOCOL, channels.V4_PROTOCOL)
PORT_FORWARD_SPDY_PROTOCOL = "portforward.k8s.io"
# The apiserver creates every stream right after the upgrade; 30 s is the kubelet's limit.
STREAM_CREATION_TIMEOUT = 30.0
# How long a forwarded port's pod side may still answer once the client stopped sending.
CLIENT_DONE_GRACE = 1.0
# How often a log stream waiting for its container's next line looks at its client.
CLIENT_CHECK_SECONDS = 1.0
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")


class BadParameter(ValueError):
    pass


def running_pods(pods: Iterable[Mapping[str, Any]]) -> list[JSON]:
    """The pods with a running container, as the kubelet's /runningpods/ lists them from
    its container runtime: name, namespace, uid and the running containers' names and
    images, nothing else."""
    listed = []
    for pod in pods:
        status = pod.get("status") or {}
        containers = [
            {"name": c.get("name", ""), "image": c.get("image", ""), "resources": {}}
            for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses")
            for c in status.get(key) or []
            if "running" in (c.get("state") or {})
        ]
        if not containers:
            continue
        metadata = pod["metadata"]
        listed.append(
            {
                "metadata": {
                    "name": metadata["name"],
                    "namespace": metadata["namespace"],
                    "uid": metadata.get("uid", ""),
                    "creationTimestamp": None,
                },
                "spec": {"containers": containers},
                "status": {},
            }
        )
    return listed


def pod_list(items: list[JSON]) -> web.Response:
    return web.json_response(
        {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
    )


def error_response(code: int, message: str) -> web.Response:
    """An error as the kubelet answers it: the message in plain text. The apiserver takes
    a pods/log error's body as the message it gives kubectl, which would show a JSON
    Status verbatim; client-go reads a refused upgrade's text as "unable to upgrade
    connection: <message>", as with a kubelet."""
    return web.Response(status=code, text=message)


def _boolean(query: Mapping[str, str], name: str) -> bool:
    value = query.get(name)
    if value is None:
        return False
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0", ""):
        return False
    raise BadParameter(f"{name}: {value!r} is not a boolean")


def _integer(query: Mapping[str, str], name: str, minimum: int) -> int | None:
    value = query.get(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise BadParameter(f"{name}: {value!r} is not an integer") from None
    if number < minimum:
        raise BadParameter(f"{name}: must be at least {minimum}, not {number}")
    return number


def parse_log_options(query: Mapping[str, str]) -> LogOptions:
    """containerLogs query → options; BadParameter names the parameter that is wrong."""
    since_time = query.get("sinceTime")
    if since_time is not None and not _RFC3339.fullmatch(since_time):
        raise BadParameter(f"sinceTime: {since_time!r} is not an RFC 3339 time")
    options = LogOptions(
        follow=_boolean(query, "follow"),
        tail_lines=_integer(query, "tailLines", 0),
        limit_bytes=_integer(query, "limitBytes", 1),
        previous=_boolean(query, "previous"),
        since_seconds=_integer(query, "sinceSeconds", 1),
        since_time=since_time,
        timestamps=_boolean(query, "timestamps"),
    )
    if options.since_seconds is not None and options.since_time is not None:
        raise BadParameter("sinceSeconds and sinceTime: give at most one")
    return options


def parse_exec_options(query: Any, *, attach: bool) -> ExecOptions:
    """exec/attach query → options. The apiserver names the streams input/output/error."""

    def flag(*names: str) -> bool:
        return any(_boolean(query, n) for n in names if n in query)

    command = tuple(query.getall("command", []))
    if not attach and not command:
        raise BadParameter("command: required")
    tty = flag("tty")
    # A terminal merges stderr into stdout; the kubelet drops the flag the same way, and
    # only then asks for a stream.
    stderr = flag("error", "stderr") and not tty
    if not (flag("input", "stdin") or flag("output", "stdout") or stderr):
        raise BadParameter("input, output, error: at least one stream is required")
    return ExecOptions(
        command=command,
        stdin=flag("input", "stdin"),
        stdout=flag("output", "stdout"),
        stderr=stderr,
        tty=tty,
    )


def parse_ports(query: Any) -> tuple[int, ...]:
    ports = []
    for value in query.getall("port", []):
        for part in value.split(","):
            try:
                port = int(part)
            except ValueError:
                raise BadParameter(f"port: {part!r} is not a port number") from None
            if not 0 < port < 65536:
                raise BadParameter(f"port: {port} is not in 1..65535")
            ports.append(port)
    return tuple(ports)


# The kubelet's --streaming-connection-idle-timeout default.
STREAMING_IDLE_TIMEOUT = 4 * 3600.0
# How long closing an idle session may wait for the client to read the goodbye.
IDLE_CLOSE_SECONDS = 5.0


# As the kubelet's: its WebSocket streams take messages of up to 32 MiB (aiohttp's 4 MiB
# reset a v4 exec whose client wrote a file to stdin in one message), and its HTTP server
# a request head of up to 1 MiB in all; here half of that per line (an exec's command
# travels in the query, URL-encoded: aiohttp's 8190 bytes refused a script of a few KB
# given as `sh -c` with a 400).
MAX_WEBSOCKET_MESSAGE = 32 << 20
RUNNER_OPTIONS: dict[str, Any] = {"max_line_size": 1 << 19, "max_field_size": 1 << 19}


class KubeletServer:
    def __init__(
        self,
        provider: KubeletProvider,
        authorizer: Authorizer,
        streaming_idle_timeout: float = STREAMING_IDLE_TIMEOUT,
    ) -> None:
        self.provider = provider
        self.authorizer = authorizer
        # An exec, attach or port-forward session that carries nothing either way this
        # long is closed (0: never), as a kubelet closes it.
        self.streaming_idle_timeout = streaming_idle_timeout

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authenticate])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/pods", self._pods)
        for path in ("/runningpods/", "/runningpods"):
            app.router.add_get(path, self._running_pods)
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._logs)
        for verb in ("exec", "attach"):
            for method in ("GET", "POST"):
                app.router.add_route(
                    method, f"/{verb}/{{namespace}}/{{pod}}/{{container}}", self._exec
                )
        for method in ("GET", "POST"):
            app.router.add_route(method, "/portForward/{namespace}/{pod}", self._port_forward)
        app.router.add_get("/stats/summary", self._stats_summary)
        app.router.add_get("/metrics/resource", self._resource_metrics)
        app.router.add_get("/metrics/cadvisor", self._cadvisor_metrics)
        # The process's own metrics, as a kubelet serves its own here.
        app.router.add_get("/metrics", serve_metrics)
        return app

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        transport = request.transport
        peercert = transport.get_extra_info("peercert") if transport is not None else None
        if transport is not None and (connection := transport.get_extra_info("socket")):
            # A stream's lower session lasts as long as this connection: with the system's
            # timings (two hours) an upper apiserver gone without a word (a crashed host, a
            # partition) kept exec shells and port-forwards open below for that long.
            keep_alive(connection)
        try:
            user = await self.authorizer.authenticate(
                peercert, request.headers.get("Authorization", "")
            )
            await self.authorizer.authorize(user, request.method, request.path)
        except AuthError as error:
            return error_response(error.status, error.message)
        try:
            response: web.StreamResponse = await handler(request)
        except BadParameter as error:
            return error_response(400, str(error))
        except ProviderError as error:
            return error_response(error.status, error.message)
        except ConnectionError:
            # The client left before the answer: nobody to tell, nothing to log as an
            # error (aiohttp drops the connection when this goes unsent).
            return web.Response()
        return response

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _pods(self, _request: web.Request) -> web.Response:
        return pod_list(self.provider.pods())

    async def _running_pods(self, _request: web.Request) -> web.Response:
        return pod_list(running_pods(self.provider.pods()))

    def _pod(self, request: web.Request, container: str | None = None) -> Mapping[str, Any]:
        namespace, name = request.match_info["namespace"], request.match_info["pod"]
        pod = self.provider.pod(namespace, name)
        if pod is None:
            raise ProviderError(404, f"pod {namespace}/{name} not found on this node")
        if container is not None:
            spec = pod["spec"]
            names = {
                c["name"]
                for field in ("containers", "initContainers", "ephemeralContainers")
                for c in spec.get(field) or []
            }
            if container not in names:
                raise ProviderError(
                    404, f"container {container!r} not found in pod {namespace}/{name}"
                )
        return pod

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        container = request.match_info["container"]
        options = parse_log_options(request.query)
        pod = self._pod(request, container)
        chunks = self.provider.container_logs(pod, container, options)
        # The first chunk (or the error) arrives before any header is sent, so a lower
        # failure still becomes a proper status.
        try:
            first = await _next_while_connected(request, chunks)
        except ConnectionError:
            await chunks.aclose()
            return web.Response()  # nobody to send it to
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        try:
            await response.prepare(request)
            chunk = first
            while chunk:
                await response.write(chunk)
                chunk = await _next_while_connected(request, chunks)
        except ConnectionError:
            pass  # the client left
        except ProviderError as error:
            # Too late for a status: the connection is closed before the body's end, so
            # the client reads a log cut short, not a log that ended.
            log.warning("logs of %s, container %s: %s", request.path, container, error.message)
            if request.transport is not None:
                request.transport.close()
        finally:
            await chunks.aclose()
        if response.prepared:
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
        return response

    async def _exec(self, request: web.Request) -> web.StreamResponse:
        container = request.match_info["container"]
        attach = request.path.startswith("/attach/")
        options = parse_exec_options(request.query, attach=attach)
        pod = self._pod(request, container)
        if is_spdy_upgrade(request):
            protocol = choose_protocol(offered_protocols(request), EXEC_SPDY_PROTOCOLS)
            if protocol is None:
                return _no_common_protocol(request, EXEC_SPDY_PROTOCOLS)
            process = await self.provider.exec(pod, container, options, attach=attach)
            async with _closed_on_failure(process.close):
                session = await upgrade(request, protocol)
            async with self._closed_when_idle(
                request, lambda: session.last_activity, session.close
            ):
                await _serve_exec_spdy(session, process, options)
            return web.Response()  # never sent: the connection is already closed
        if request.headers.get("Upgrade", "").lower() == "websocket":
            socket = web.WebSocketResponse(
                protocols=channels.EXEC_PROTOCOLS, max_msg_size=MAX_WEBSOCKET_MESSAGE
            )
            if _negotiated(socket, request) is None:
                raise BadParameter("Sec-WebSocket-Protocol: no supported channel protocol")
            process = await self.provider.exec(pod, container, options, attach=attach)
            async with _closed_on_failure(process.close):
                await socket.prepare(request)
            client = _ChannelSocket(socket, 5)
            async with self._closed_when_idle(request, lambda: client.last_activity, socket.close):
                await _serve_exec_websocket(client, process, options)
            return socket
        raise BadParameter("Upgrade: exec and attach need SPDY/3.1 or WebSocket")

    async def _port_forward(self, request: web.Request) -> web.StreamResponse:
        pod = self._pod(request)
        if is_spdy_upgrade(request):
            protocols = (PORT_FORWARD_SPDY_PROTOCOL,)
            if choose_protocol(offered_protocols(request), protocols) is None:
                return _no_common_protocol(request, protocols)
            session = await upgrade(request, PORT_FORWARD_SPDY_PROTOCOL)
            async with self._closed_when_idle(
                request, lambda: session.last_activity, session.close
            ):
                await _serve_port_forward_spdy(session, self.provider, pod)
            return web.Response()
        if request.headers.get("Upgrade", "").lower() == "websocket":
            ports = parse_ports(request.query)
            if not ports:
                raise BadParameter("port: required for a WebSocket port-forward")
            socket = web.WebSocketResponse(
                protocols=channels.PORT_FORWARD_PROTOCOLS, max_msg_size=MAX_WEBSOCKET_MESSAGE
            )
            protocol = _negotiated(socket, request)
            if protocol is None:
                raise BadParameter("Sec-WebSocket-Protocol: no supported port-forward protocol")
            layout = channels.PortForwardChannels(ports)
            try:
                channels.ChannelCodec(protocol, layout.channel_count)
            except ValueError as error:
                raise BadParameter(f"port: too many ports: {error}") from None
            connections: list[PortConnection] = []
            async with _closed_on_failure(lambda: _close_all(connections)):
                for port in ports:
                    connections.append(await self.provider.port_forward(pod, port))
                await socket.prepare(request)
            client = _ChannelSocket(socket, layout.channel_count)
            async with self._closed_when_idle(request, lambda: client.last_activity, socket.close):
                await _serve_port_forward_websocket(client, layout, connections)
            return socket
        raise BadParameter("Upgrade: port-forward needs SPDY/3.1 or WebSocket")

    @contextlib.asynccontextmanager
    async def _closed_when_idle(
        self,
        request: web.Request,
        last_activity: Callable[[], float],
        close: Callable[[], Awaitable[Any]],
    ) -> AsyncIterator[None]:
        """Closes a streaming session once nothing has gone through it, either way, for
        the idle timeout: a client that neither sends nor reads holds no connection for
        good (its buffers are bounded already). A goodbye not written within
        ``IDLE_CLOSE_SECONDS`` (the client reads nothing: its session went idle with our
        writes waiting for it) gives way to dropping the connection."""
        timeout = self.streaming_idle_timeout

        async def watch() -> None:
            loop = asyncio.get_running_loop()
            # A deadline each frame moves later: sleeping to it is the wait.
            while (left := last_activity() + timeout - loop.time()) > 0:  # noqa: ASYNC110
                await asyncio.sleep(left)
            log.info("closing a streaming session idle for %.0f s", timeout)
            try:
                async with asyncio.timeout(IDLE_CLOSE_SECONDS):
                    await close()
            except TimeoutError:
                if request.transport is not None:
                    request.transport.abort()

        watcher = asyncio.create_task(watch()) if timeout > 0 else None
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _stats_summary(self, _request: web.Request) -> web.Response:
        return web.json_response(await self.provider.stats_summary())

    async def _resource_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=await self.provider.resource_metrics(), content_type="text/plain")

    async def _cadvisor_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=await self.provider.cadvisor_metrics(), content_type="text/plain")


@contextlib.asynccontextmanager
async def _closed_on_failure(close: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """Closes what was opened in the lower cluster when it cannot be handed over: a port
    that did not open, or a client that left while it was being opened."""
    try:
        yield
    except BaseException:
        await close()
        raise


async def _close_all(connections: list[PortConnection]) -> None:
    for connection in connections:
        await connection.close()


def _negotiated(socket: web.WebSocketResponse, request: web.Request) -> str | None:
    """The subprotocol the handshake would pick; None when the client offered none we
    speak (aiohttp would go on without one, upstream refuses). No offer at all means the
    plain binary framing, as upstream."""
    ready = socket.can_prepare(request)
    if not ready.ok:
        return None
    if ready.protocol is None:
        return "" if "Sec-WebSocket-Protocol" not in request.headers else None
    return ready.protocol


def _no_common_protocol(request: web.Request, supported: tuple[str, ...]) -> web.Response:
    offered = ", ".join(offered_protocols(request)) or "none"
    return error_response(
        403,
        f"unable to upgrade: no common stream protocol (offered {offered}; "
        f"supported {', '.join(supported)})",
    )


async def _collect_streams(session: SpdySession, wanted: set[str]) -> dict[str, SpdyStream]:
    found: dict[str, SpdyStream] = {}
    async with asyncio.timeout(STREAM_CREATION_TIMEOUT):
        while not wanted <= found.keys():
            stream = await session.accept()
            if stream is None:
                break
            kind = stream.header("streamtype")
            # The last of a type wins, as upstream; the others would be read by nobody.
            outcast = found.get(kind) if kind in wanted else stream
            if outcast is not None:
                outcast.reset()
            if kind in wanted:
                found[kind] = stream
    return found


async def _refuse_streams(session: SpdySession) -> None:
    """Resets the streams opened once an exec has all it asked for."""
    while (stream := await session.accept()) is not None:
        stream.reset()


async def _pump_stdin(read: Any, process: RemoteProcess) -> None:
    while data := await read():
        await process.send_stdin(data)
    await process.close_stdin()


async def _pump_resize(read: Any, process: RemoteProcess) -> None:
    while data := await read():
        await process.resize(data)


async def _serve_exec_spdy(
    session: SpdySession, process: RemoteProcess, options: ExecOptions
) -> None:
    wanted = {"error"}
    wanted |= {
        name
        for name, on in (
            ("stdin", options.stdin),
            ("stdout", options.stdout),
            ("stderr", options.stderr),
            ("resize", options.tty),
        )
        if on
    }
    inputs: list[asyncio.Task[None]] = []
    try:
        try:
            streams = await _collect_streams(session, wanted)
        except TimeoutError:
            log.info("exec: streams %s not created in time", sorted(wanted))
            return
        for kind, opened in streams.items():
            if kind not in ("stdin", "resize"):
                opened.ignore_input()
        inputs.append(asyncio.create_task(_refuse_streams(session)))
        if "stdin" in streams:
            inputs.append(asyncio.create_task(_pump_stdin(streams["stdin"].read, process)))
        if "resize" in streams:
            inputs.append(asyncio.create_task(_pump_resize(streams["resize"].read, process)))
        outputs = {channels.STDOUT: streams.get("stdout"), channels.STDERR: streams.get("stderr")}
        finished = asyncio.create_task(_forward_output(process, outputs))
        gone = asyncio.create_task(session.closed.wait())
        await asyncio.wait((finished, gone), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if finished.done() and not session.closed.is_set():
            for stream in outputs.values():
                if stream is not None:
                    await stream.close()
            if (error := streams.get("error")) is not None:
                await error.write(process.status(), fin=True)
        finished.cancel()
    finally:
        for task in inputs:
            task.cancel()
        await process.close()
        await session.close()


async def _forward_output(process: RemoteProcess, outputs: Mapping[int, SpdyStream | None]) -> None:
    async for channel, data in process.output():
        stream = outputs.get(channel) or outputs.get(channels.STDOUT)
        if stream is not None:
            await stream.write(data)


async def _serve_port_forward_spdy(
    session: SpdySession, provider: KubeletProvider, pod: Mapping[str, Any]
) -> None:
    pending: dict[str, dict[str, SpdyStream]] = {}
    tasks: set[asyncio.Task[None]] = set()
    timers: dict[str, asyncio.TimerHandle] = {}
    loop = asyncio.get_running_loop()

    def expire(request_id: str) -> None:
        # Half a pair that never completes would otherwise be kept for the whole session.
        timers.pop(request_id, None)
        for stream in pending.pop(request_id, {}).values():
            stream.reset()

    try:
        while (stream := await session.accept()) is not None:
            request_id = stream.header("requestid")
            kind = stream.header("streamtype")
            if kind not in ("data", "error") or kind in pending.get(request_id, {}):
                # Kept, the stream would hold what it is sent against the session's read
                # budget for good (nobody reads it), and past it stall every connection.
                stream.reset()
                continue
            if request_id not in pending:
                timers[request_id] = loop.call_later(STREAM_CREATION_TIMEOUT, expire, request_id)
            pair = pending.setdefault(request_id, {})
            pair[kind] = stream
            if "data" in pair and "error" in pair:
                del pending[request_id]
                timers.pop(request_id).cancel()
                task = asyncio.create_task(_forward_port(provider, pod, pair))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
    finally:
        for timer in timers.values():
            timer.cancel()
        for task in tasks:
            task.cancel()
        await session.close()


async def _forward_port(
    provider: KubeletProvider, pod: Mapping[str, Any], pair: dict[str, SpdyStream]
) -> None:
    data, error = pair["data"], pair["error"]
    error.ignore_input()
    try:
        port = int(data.header("port"))
        if not 0 < port < 65536:
            raise ValueError(port)
    except ValueError:
        await error.write(f"invalid port {data.header('port')!r}".encode(), fin=True)
        data.reset()
        return
    try:
        connection = await provider.port_forward(pod, port)
    except ProviderError as failure:
        data.ignore_input()
        await error.write(failure.message.encode(), fin=True)
        await data.close()
        return
    upstream = asyncio.create_task(_pump_to_pod(data.read, connection))
    try:
        while chunk := await connection.receive():
            await data.write(chunk)
        if message := connection.error():
            await error.write(message.encode())
        await data.close()
        await error.close()
    finally:
        upstream.cancel()
        # The pod's side is gone: what the client still sends goes nowhere.
        data.ignore_input()
        await connection.close()


async def _next_while_connected(request: web.Request, chunks: AsyncIterator[bytes]) -> bytes:
    """The provider's next chunk, b"" at the end. aiohttp does not cancel a handler whose
    client left, and a followed log that stays quiet would keep its lower stream open
    until the container wrote again (for ever, maybe): the client is looked at every
    ``CLIENT_CHECK_SECONDS`` meanwhile. Raises ConnectionResetError once it is gone."""
    step = asyncio.ensure_future(anext(chunks, b""))
    try:
        while True:
            done, _ = await asyncio.wait({step}, timeout=CLIENT_CHECK_SECONDS)
            if done:
                return step.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the client left")
    finally:
        # Also when the handler is cancelled (the server stopping): left running, the
        # step kept the lower stream open, and closing the chunks under it failed.
        if not step.done():
            step.cancel()
            await asyncio.wait({step})


async def _pump_to_pod(read: Any, connection: PortConnection) -> None:
    while chunk := await read():
        await connection.send(chunk)
    # The client is done (kubectl's local connection closed). The lower WebSocket cannot
    # half-close, so, as the container runtime closes the pod's connection once the
    # client's side ends, the pod gets a moment to answer and the connection goes: kept,
    # every connection a client closed would stay open in the pod until the session ends.
    await asyncio.sleep(CLIENT_DONE_GRACE)
    await connection.close()


class _ChannelSocket:
    """A served WebSocket speaking one of the channel protocols."""

    def __init__(self, socket: web.WebSocketResponse, channel_count: int) -> None:
        self.socket = socket
        self.codec = channels.ChannelCodec(socket.ws_protocol or "", channel_count)
        self.last_activity = asyncio.get_running_loop().time()

    def _active(self) -> None:
        self.last_activity = asyncio.get_running_loop().time()

    async def send(self, channel: int, payload: bytes) -> None:
        self._active()
        message = self.codec.encode(channel, payload)
        if isinstance(message, str):
            await self.socket.send_str(message)
        else:
            await self.socket.send_bytes(message)

    async def received(self) -> AsyncIterator[channels.ChannelData | channels.CloseChannel]:
        async for message in self.socket:
            if message.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
                return
            self._active()
            try:
                yield self.codec.decode(message.data)
            except channels.ChannelProtocolError:
                continue  # upstream skips empty and unknown-channel messages too


async def _serve_exec_websocket(
    client: _ChannelSocket, process: RemoteProcess, options: ExecOptions
) -> None:

    async def read_input() -> None:
        async for decoded in client.received():
            if isinstance(decoded, channels.CloseChannel):
                if decoded.channel == channels.STDIN:
                    await process.close_stdin()
            elif decoded.channel == channels.STDIN and options.stdin:
                await process.send_stdin(decoded.payload)
            elif decoded.channel == channels.RESIZE and options.tty:
                await process.resize(decoded.payload)

    async def write_output() -> None:
        # As the kubelet: one empty message, on the first channel of stdout, stderr and
        # error the session has, says it is established. (One on a channel the client did
        # not ask for, stderr under a terminal, had client-go print "Unknown stream id".)
        await client.send(
            channels.STDOUT
            if options.stdout
            else channels.STDERR
            if options.stderr
            else channels.ERROR,
            b"",
        )
        async for channel, data in process.output():
            await client.send(channel, data)
        status = process.status()
        if client.codec.status_as_text:
            status = channels.status_text(status)
        if status:
            await client.send(channels.ERROR, status)

    reader = asyncio.create_task(read_input())
    writer = asyncio.create_task(write_output())
    try:
        # The reader ends when the client leaves: the process must not outlive it.
        await asyncio.wait((reader, writer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        reader.cancel()
        writer.cancel()
        try:
            await asyncio.wait((reader, writer))
        finally:
            await process.close()
            await client.socket.close()
    for task in (reader, writer):
        error = None if task.cancelled() else task.exception()
        # The client leaving, or the lower stream breaking after the 101, ends the session.
        if error is not None and not isinstance(error, ConnectionError | ProviderError):
            raise error


async def _serve_port_forward_websocket(
    client: _ChannelSocket, layout: channels.PortForwardChannels, connections: list[PortConnection]
) -> None:

    async def from_pod(index: int, connection: PortConnection) -> None:
        with contextlib.suppress(ConnectionError):  # the client left: so does the reader
            while chunk := await connection.receive():
                await client.send(layout.data_channel(index), chunk)
            if message := connection.error():
                await client.send(layout.error_channel(index), message.encode())

    async def to_pods() -> None:
        with contextlib.suppress(ConnectionError):  # the client left
            async for decoded in client.received():
                if isinstance(decoded, channels.ChannelData) and decoded.channel % 2 == 0:
                    await connections[decoded.channel // 2].send(decoded.payload)

    tasks: list[asyncio.Task[None]] = []
    try:
        for channel, payload in layout.announcements():
            await client.send(channel, payload)
        readers = [asyncio.create_task(from_pod(i, c)) for i, c in enumerate(connections)]

        async def every_port_done() -> None:
            await asyncio.gather(*readers)

        ends = [asyncio.create_task(to_pods()), asyncio.create_task(every_port_done())]
        tasks = [*readers, *ends]
        # As the kubelet: the session ends once every port's connection has (a client's
        # local socket sees its end only then), or once the client leaves.
        await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
    except ConnectionError:
        pass  # the client left
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_all(connections)
        await client.socket.close()
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        # A pod's side breaking after the 101 ends its connection; anything else is ours.
        if error is not None and not isinstance(error, ConnectionError | ProviderError):
            raise error
