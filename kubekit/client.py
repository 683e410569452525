"""Kubernetes API access for every component, on top of ``kubernetes_asyncio``.

``kubernetes_asyncio`` loads kubeconfig and in-cluster credentials (refreshed as client-go
does: ``KubeconfigCredentials``);
this module sends plain-JSON requests with them on its own aiohttp session and adds
client-side rate limits (QPS and burst, as client-go has). Controllers keep objects as
dicts: deserialising every watched object into generated model classes would cost more
CPU and memory than the rest of the work together.
"""

from __future__ import annotations

import asyncio.sslproto
import contextlib
import contextvars
import json
import logging
import math
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config import ConfigException
from kubernetes_asyncio.config.exec_provider import ExecProvider

from kubekit import metrics
from kubekit.certreload import file_version, written_pair
from kubekit.ratelimit import TokenBucket

JSON = dict[str, Any]


class ApiError(Exception):
    """A non-2xx answer of the apiserver, with its Status body when it sent one."""

    def __init__(
        self,
        status: int,
        body: JSON | str,
        method: str = "",
        path: str = "",
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.method = method
        self.path = path
        # Seconds the apiserver asked us to wait (Retry-After of a 429 or a 5xx).
        self.retry_after = retry_after
        super().__init__(f"{method} {path}: {status} {self.reason}: {self.message}")

    @property
    def reason(self) -> str:
        return str(self.body.get("reason", "")) if isinstance(self.body, dict) else ""

    @property
    def message(self) -> str:
        return str(self.body.get("message", "")) if isinstance(self.body, dict) else self.body


# A call that failed on the way to an apiserver, not by its answer: a refused or reset
# connection, a server that hung up (aiohttp's ServerDisconnectedError is no OSError), a
# TLS stream cut short, a timeout. Always worth another try.
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    aiohttp.ClientError,
    TimeoutError,
    ssl.SSLError,
)

log = logging.getLogger(__name__)

# How long a stream's connection may take to open (a watch's, a log's): past it, an
# apiserver whose packets are dropped is unreachable, not waited on for the kernel's
# two minutes.
STREAM_CONNECT_SECONDS = 10.0
# client-go's REST client: as many retries of a request the server said to send again.
RETRIES_WHEN_TOLD = 10
# How often a kubeconfig's credentials are read again, and how long a read (an exec
# plugin's run, killed past it) may take, the first one included.
CREDENTIALS_REFRESH_SECONDS = 60.0
CREDENTIALS_READ_TIMEOUT = 30.0
# After a request refused as unauthenticated, the credentials are read again at once, but
# not again sooner than this: the other requests sent with the same token are refused too.
CREDENTIALS_REREAD_WHEN_REFUSED_SECONDS = 10.0
# How long a killed plugin is waited for (its pipes may be held by what escaped it).
PLUGIN_KILL_WAIT = 5.0
# A Retry-After beyond this is waited this long (the apiserver names 1 to 10 seconds).
LONGEST_WAIT_WHEN_TOLD = 10.0
# How long the requests under way when a new client certificate is read may finish on
# their connections, made with the old one, before those are closed.
OLD_CERTIFICATE_CONNECTIONS_SECONDS = 30.0


class KubeconfigError(Exception):
    """A kubeconfig (or the in-cluster configuration) that cannot be used as it is: no
    later try would do better."""


class WatchSilent(TimeoutError):
    """A watch that sent nothing, not even a bookmark, for longer than it was allowed."""


# Every way a call to an apiserver fails: a loop that must outlive the apiserver's
# outages catches these, and only these.
API_ERRORS: tuple[type[Exception], ...] = (ApiError, *CONNECTION_ERRORS)


def is_transient(error: BaseException) -> bool:
    """Whether the same call may succeed later as it is: a connection error, too many
    requests (429), a server error (5xx), or a watch's resourceVersion gone (410: list
    again). Other refusals (400, 403, 404, 409, 422) want a different call."""
    if isinstance(error, ApiError):
        return error.status in (410, 429) or error.status >= 500
    return isinstance(error, CONNECTION_ERRORS)


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the apiserver sends seconds, never a date)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def is_not_found(error: BaseException) -> bool:
    return isinstance(error, ApiError) and error.status == 404


def is_conflict(error: BaseException) -> bool:
    return isinstance(error, ApiError) and error.status == 409


def is_gone(error: BaseException) -> bool:
    return isinstance(error, ApiError) and error.status == 410


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the API: ``Resource("", "v1", "pods")``."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str = ""
    ) -> str:
        prefix = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        parts = [prefix]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name:
            parts.append(name)
        if subresource:
            parts.append(subresource)
        return "/".join(parts)


PODS = Resource("", "v1", "pods")
NODES = Resource("", "v1", "nodes", namespaced=False)
NAMESPACES = Resource("", "v1", "namespaces", namespaced=False)
CONFIGMAPS = Resource("", "v1", "configmaps")
SECRETS = Resource("", "v1", "secrets")
SERVICEACCOUNTS = Resource("", "v1", "serviceaccounts")
PERSISTENTVOLUMECLAIMS = Resource("", "v1", "persistentvolumeclaims")
PERSISTENTVOLUMES = Resource("", "v1", "persistentvolumes", namespaced=False)
STORAGECLASSES = Resource("storage.k8s.io", "v1", "storageclasses", namespaced=False)
RUNTIMECLASSES = Resource("node.k8s.io", "v1", "runtimeclasses", namespaced=False)
EVENTS = Resource("", "v1", "events")
LEASES = Resource("coordination.k8s.io", "v1", "leases")
SERVICES = Resource("", "v1", "services")
ENDPOINTSLICES = Resource("discovery.k8s.io", "v1", "endpointslices")
PODDISRUPTIONBUDGETS = Resource("policy", "v1", "poddisruptionbudgets")
JOBS = Resource("batch", "v1", "jobs")
RESOURCEQUOTAS = Resource("", "v1", "resourcequotas")
PRIORITYCLASSES = Resource("scheduling.k8s.io", "v1", "priorityclasses", namespaced=False)


@dataclass(frozen=True)
class ClientSettings:
    kubeconfig: str | None = None  # None: in-cluster config
    context: str | None = None
    qps: float = 50.0
    burst: int = 100
    connections: int = 100


class _ExecPlugin(ExecProvider):
    """The library's runner of a kubeconfig's exec plugin, but a run given up (its read
    timed out, its client closed) kills the plugin: the library's run left it running,
    and a plugin that hung, run again every minute, added a process a minute for good."""

    async def run(self, previous_response: str | None = None) -> Any:
        # The library's run starts the process and waits on it in one method that gives no
        # hold on the process: killing it takes the whole run here, the checks of the
        # plugin's answer with it.
        interactive = sys.stdout.isatty()
        spec: JSON = {"interactive": interactive}
        if previous_response:
            spec["response"] = previous_response
        self.env["KUBERNETES_EXEC_INFO"] = json.dumps(
            {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": spec}
        )
        # A group of its own, so that what it starts (a shell script's commands,
        # gke-gcloud-auth-plugin's gcloud) is killed with it; not when it may prompt on
        # our terminal: a process outside the terminal's foreground group that reads from
        # it is stopped.
        starting = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *self.args,
                env=self.env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                process_group=None if interactive else 0,
            )
        )
        plugin: asyncio.subprocess.Process | None = None
        try:
            # Shielded: given up while it makes the process, asyncio kills that process
            # only, and what it had started meanwhile ran on.
            plugin = await asyncio.shield(starting)
            stdout, stderr = await plugin.communicate()
        except BaseException:
            if plugin is None:
                with contextlib.suppress(Exception):
                    plugin = await starting
            if plugin is not None:
                _kill(plugin, interactive)
                # Reaped once its pipes close too: one held by a process that left the
                # group would hold the read, and the next one, for as long as it lives.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PLUGIN_KILL_WAIT):
                        await plugin.wait()
            raise
        # What it left running in the background (a cache refresher, a `sleep`) would
        # otherwise add a process a run.
        _kill(plugin, interactive, group_only=True)
        if plugin.returncode != 0:
            said = stderr.decode(errors="replace").strip()
            raise ConfigException(
                f"exec: process returned {plugin.returncode}" + (f". {said}" if said else "")
            )
        try:
            answer = json.loads(stdout)
        except ValueError as error:
            raise ConfigException(f"exec: failed to decode process output: {error}") from error
        if not isinstance(answer, dict):
            raise ConfigException("exec: malformed response, not an object")
        for key in ("apiVersion", "kind", "status"):
            if key not in answer:
                raise ConfigException(f"exec: malformed response. missing key '{key}'")
        if answer["apiVersion"] != self.api_version:
            raise ConfigException(
                f"exec: plugin api version {answer['apiVersion']} does not match {self.api_version}"
            )
        return answer["status"]


def _kill(plugin: asyncio.subprocess.Process, interactive: bool, group_only: bool = False) -> None:
    """Kills the plugin and its process group (the plugin alone when it shares our
    terminal's group; nothing then when ``group_only``: it has exited). Gone already, or
    its number taken since by a process not ours: nothing to kill."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if not interactive:
            os.killpg(plugin.pid, signal.SIGKILL)
        elif not group_only:
            plugin.kill()


# The loader runs a plugin through this name of its module and takes no other runner:
# replacing it is the one way in short of copying the loader's handling of the plugin's
# answer too (token, client certificate, expiry).
k8s_config.kube_config.ExecProvider = _ExecPlugin  # type: ignore[attr-defined]


class KubeconfigCredentials:
    """Reads a kubeconfig's token again every CREDENTIALS_REFRESH_SECONDS, as client-go
    does: a ``tokenFile`` (a projected token its kubelet rotates), an exec plugin's (run
    again once its token is within five minutes of expiring; EKS's last 15 minutes) or an
    auth provider's. Read once only, it expired and every call was refused for good (the
    lower cluster taken for unreachable, its pods evicted). A client certificate that
    changed (its files rewritten by whoever rotates it, or a plugin's new one) is handed to
    ``on_new_certificate``, as client-go's rotating dialer does."""

    def __init__(
        self,
        loader: k8s_config.kube_config.KubeConfigLoader,
        configuration: k8s_client.Configuration,
    ) -> None:
        self.loader = loader
        self._read_at = time.monotonic()
        self._reading: asyncio.Task[None] | None = None
        self._reread_when_refused_at = -math.inf
        self._certificate = _certificate_files(configuration)
        self.on_new_certificate: Callable[[str, str | None], None] | None = None

    def refresh(self, configuration: k8s_client.Configuration) -> None:
        """Called before each request: starts a read when one is due, and the request
        goes on with the credentials held, which an exec plugin renews five minutes
        before they expire. A request waiting on a plugin's run was cut by its own
        deadline (a Lease renewal's 10 s), the run started again by the next request and
        cut again, the cluster taken for unreachable meanwhile."""
        if (
            self._reading is None
            and time.monotonic() - self._read_at >= CREDENTIALS_REFRESH_SECONDS
        ):
            self._reading = asyncio.get_running_loop().create_task(self._read(configuration))

    def refused(self) -> None:
        """A request was refused as unauthenticated (401): the credentials are read again
        at the next request, and an exec plugin run again though its token has not
        expired (revoked, or a clock ahead of ours), as client-go does. Until then every
        request was refused up to five minutes before the token's end (EKS's ten)."""
        now = time.monotonic()
        if now - self._reread_when_refused_at >= CREDENTIALS_REREAD_WHEN_REFUSED_SECONDS:
            self._reread_when_refused_at = now
            self._read_at = -math.inf
            # The library's record of when the plugin's token expires.
            vars(self.loader).pop("exec_plugin_expiry", None)

    async def _read(self, configuration: k8s_client.Configuration) -> None:
        try:
            async with asyncio.timeout(CREDENTIALS_READ_TIMEOUT):
                await self.loader.load_and_set(configuration)
            certificate = _certificate_files(configuration)
            cert_file = configuration.cert_file
            if cert_file and certificate != self._certificate and self.on_new_certificate:
                # Kept as it was if the new one cannot be loaded (its key not written yet):
                # looked at again at the next read.
                self.on_new_certificate(cert_file, configuration.key_file)
            self._certificate = certificate
        # A plugin may fail any way it likes (its cloud out of reach, hung): the token held
        # may still do, and the requests say if it does not.
        except Exception as error:
            log.warning("credentials not read again, kept: %s", error or type(error).__name__)
        finally:
            self._read_at = time.monotonic()
            self._reading = None

    async def close(self) -> None:
        """Gives up a read under way, once its plugin is killed and reaped."""
        if self._reading is not None:
            self._reading.cancel()
            await asyncio.wait([self._reading])


class KubeClient:
    """JSON requests to one apiserver, paced by a token bucket. Watches are not paced
    beyond their opening request, as in client-go."""

    def __init__(
        self,
        api_client: k8s_client.ApiClient,
        limiter: TokenBucket,
        streams: aiohttp.ClientSession,
        credentials: KubeconfigCredentials | None = None,
    ) -> None:
        self.api = api_client
        self.limiter = limiter
        self.credentials = credentials
        # Streams (exec, attach, port-forward, followed logs) hold their connection for as
        # long as a user keeps them open: in the requests' pool, a hundred `kubectl logs
        # -f` would leave no connection for anything else, and the next stream would wait
        # for one to end. They get a pool of their own, unbounded as a kubelet's streams
        # are, and are not paced by the requests' budget: each was already let through by
        # the apiserver that sent it here.
        self._streams = streams
        self._dialing_spare: asyncio.Task[None] | None = None
        # Requests pools left for a new client certificate, closing.
        self._closing: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(cls, settings: ClientSettings) -> KubeClient:
        """A client of the apiserver ``settings`` name; KubeconfigError when what they
        name cannot be used (nothing is asked of the apiserver yet)."""
        configuration = k8s_client.Configuration()
        credentials = None
        try:
            if settings.kubeconfig is None:
                k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            else:
                # Not from a terminal: a plugin may wait there for a person (a browser
                # sign-in, a second factor).
                limit = None if sys.stdout.isatty() else CREDENTIALS_READ_TIMEOUT
                try:
                    async with asyncio.timeout(limit):
                        loader = await k8s_config.load_kube_config(
                            config_file=settings.kubeconfig,
                            context=settings.context,
                            client_configuration=configuration,
                        )
                # Without a bound, a component whose exec plugin hangs never started and
                # never said why.
                except TimeoutError as error:
                    raise KubeconfigError(
                        f"{settings.kubeconfig}: credentials not read in "
                        f"{CREDENTIALS_READ_TIMEOUT:g} s (an exec plugin that does not end?)"
                    ) from error
                credentials = KubeconfigCredentials(loader, configuration)
            context = _ssl_context(configuration)
        # The library checks little of a file's shape: a list or an empty file fails as a
        # TypeError, bytes not UTF-8 as a ValueError. A missing certificate file fails as
        # an OSError, which would otherwise be taken for a connection failing, and tried
        # again forever.
        except (ConfigException, yaml.YAMLError, OSError, ValueError, TypeError) as error:
            where = settings.kubeconfig or "in-cluster configuration"
            raise KubeconfigError(f"{where}: {error or type(error).__name__}") from error
        configuration.connection_pool_maxsize = settings.connections
        api = k8s_client.ApiClient(configuration)
        await api.rest_client.pool_manager.close()
        api.rest_client.pool_manager = _requests_session(context, settings.connections)
        refusals = aiohttp.TraceConfig()
        refusals.on_request_end.append(_keep_refusal)
        streams = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=context, socket_factory=_kept_alive),
            trust_env=False,
            trace_configs=[refusals],
        )
        client = cls(api, TokenBucket(settings.qps, settings.burst), streams, credentials)
        if credentials is not None:
            credentials.on_new_certificate = partial(client._use_certificate, context)
        return client

    def _use_certificate(
        self, context: ssl.SSLContext, cert_file: str, key_file: str | None
    ) -> None:
        """New connections present the new certificate; those of the requests pool, kept
        alive as long as requests keep them busy, are closed once the requests under way
        had time to finish (a watch among them is resumed), or they would present the old
        one until it expired, and every request be refused. The streams' pool keeps its
        connections: each is a user's session, and an idle one is closed in seconds.

        The pair is tried on a scratch context first, from the bytes then loaded: one
        that does not go together (the certificate written, its key not yet) fails there,
        and the context in use keeps the old pair. Loaded into it, OpenSSL takes the new
        certificate, drops the old key and fails, and every new connection presented no
        certificate at all."""
        cert = Path(cert_file).read_bytes()
        key = Path(key_file).read_bytes() if key_file else cert
        with written_pair(cert, key) as (checked_cert, checked_key):
            ssl.create_default_context().load_cert_chain(checked_cert, checked_key)
            context.load_cert_chain(checked_cert, checked_key)
        log.info("new client certificate %s", cert_file)
        rest = self.api.rest_client
        old = rest.pool_manager
        rest.pool_manager = _requests_session(
            context, self.api.configuration.connection_pool_maxsize
        )
        task = asyncio.create_task(_close_later(old, OLD_CERTIFICATE_CONNECTIONS_SECONDS))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        if self._dialing_spare is not None:
            self._dialing_spare.cancel()
        for closing in list(self._closing):
            closing.cancel()
            await asyncio.wait([closing])
        if self.credentials is not None:
            await self.credentials.close()
        await self._streams.close()
        await self.api.close()

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def _open(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float | aiohttp.ClientTimeout | None = 60.0,
        streaming: bool = False,
        retry_when_told: bool = True,
    ) -> aiohttp.ClientResponse:
        """The response to a request, sent again after the wait the server names when it
        says to come back later, up to ``RETRIES_WHEN_TOLD`` times, as client-go's REST
        client does: an apiserver's flow control sheds load with 429s (the request was not
        acted on), and a caller's own backoff would not know the wait it asked for. A 5xx
        with Retry-After is retried for a GET only: a write it answers may have been
        stored (etcd slow to confirm a create), and a create with generateName would be
        made twice. A caller with a retry or a deadline of its own for such an answer (an
        eviction a disruption budget refused, a call the scheduler times) says so.

        A ``timeout`` in seconds bounds the whole call, retries and waits included, as
        client-go's request timeout does: a Lease renewal said to wait 10 s at most took
        eleven times (the timeout and the wait) under an apiserver shedding load."""
        if not (body is None or isinstance(body, str | bytes)):
            body = orjson.dumps(body)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if isinstance(timeout, int | float) else None
        retries = 0
        while True:
            try:
                return await self._send(method, path, query, body, content_type, timeout, streaming)
            except ApiError as error:
                wait = error.retry_after
                told = error.status == 429 or (method == "GET" and 500 <= error.status < 600)
                if not (retry_when_told and told and wait is not None) or (
                    retries == RETRIES_WHEN_TOLD
                ):
                    raise
                wait = min(wait, LONGEST_WAIT_WHEN_TOLD)
                if deadline is not None:
                    left = deadline - loop.time() - wait
                    if left <= 0:
                        raise
                    timeout = left
                retries += 1
                log.info("%s %s: %s; again in %g s", method, path, error, wait)
                await asyncio.sleep(wait)

    async def _send(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any] | None,
        body: str | bytes | None,
        content_type: str,
        timeout: float | aiohttp.ClientTimeout | None,
        streaming: bool,
    ) -> aiohttp.ClientResponse:
        # Straight to the session rather than through the library's call_api, which
        # walks every request body in Python to "sanitize" it and encodes it again with
        # the json module: a tenth of a busy virtual node's CPU.
        if not streaming:
            await self.limiter.acquire()
        headers = {"Accept": "application/json", "Content-Type": content_type}
        await self._authorize(headers)
        params = [(k, _query_value(v)) for k, v in (query or {}).items() if v is not None]
        session: aiohttp.ClientSession = (
            self._streams if streaming else self.api.rest_client.pool_manager
        )
        verb = "WATCH" if (query or {}).get("watch") else method
        resource = metrics.api_resource(path)
        sent = time.perf_counter()
        try:
            response = await session.request(
                method,
                self._url(path),
                params=params,
                data=body,
                headers=headers,
                timeout=timeout
                if isinstance(timeout, aiohttp.ClientTimeout)
                else aiohttp.ClientTimeout(total=timeout),
                **self._connection_options(),
            )
        except Exception:
            metrics.API_REQUESTS.labels(verb, resource, "<error>").inc()
            raise
        metrics.API_REQUEST_DURATION.labels(verb, resource).observe(time.perf_counter() - sent)
        metrics.API_REQUESTS.labels(verb, resource, str(response.status)).inc()
        if response.status >= 300:
            self._refused(response.status)
            text = await response.text()
            response.release()
            try:
                payload: JSON | str = json.loads(text)
            except ValueError:
                payload = text
            raise ApiError(
                response.status,
                payload,
                method,
                path,
                _retry_after(response.headers.get("Retry-After")),
            )
        return response

    async def _authorize(self, headers: dict[str, str]) -> None:
        # Not in the library's hook before a token is taken: a kubeconfig with a client
        # certificate and no token never calls it, and its certificate was never read again.
        if self.credentials is not None:
            self.credentials.refresh(self.api.configuration)
        await self.api.update_params_for_auth(headers, [], ["BearerToken"])

    def _refused(self, status: int) -> None:
        if status == 401 and self.credentials is not None:
            self.credentials.refused()

    def _url(self, path: str) -> str:
        return str(self.api.configuration.host).rstrip("/") + path

    def _connection_options(self) -> dict[str, Any]:
        """The kubeconfig's proxy-url and tls-server-name, for every connection."""
        rest = self.api.rest_client
        options: dict[str, Any] = {}
        if rest.proxy:
            options["proxy"] = rest.proxy
        if rest.proxy_headers:
            options["proxy_headers"] = rest.proxy_headers
        if rest.server_hostname:
            options["server_hostname"] = rest.server_hostname
        return options

    async def websocket(
        self, path: str, query: Sequence[tuple[str, str]], protocols: Sequence[str]
    ) -> aiohttp.ClientWebSocketResponse:
        """Opens a WebSocket to the apiserver (exec, attach, portforward subresources) over
        the client's credentials, on its pool of streams."""
        headers: dict[str, str] = {}
        await self._authorize(headers)
        refusal: dict[str, bytes] = {}
        token = _REFUSAL.set(refusal)
        try:
            websocket: aiohttp.ClientWebSocketResponse = await self._streams.ws_connect(
                self._url(path),
                params=list(query),
                protocols=tuple(protocols),
                headers=headers,
                max_msg_size=0,
                autoping=True,
                # No heartbeat: a session whose client stops reading (`kubectl exec …
                # | less` on its first page, a paused download through port-forward)
                # stops reading the lower socket too, the pong goes unread, and aiohttp
                # closed the session 45 s later, the output cut short. The connection's
                # TCP keepalive (``_kept_alive``) keeps it through load balancers that
                # drop silent flows, and ends it if its peer is gone.
                **self._connection_options(),
            )
        except aiohttp.WSServerHandshakeError as error:
            self._refused(error.status)
            raise ApiError(
                error.status, _status_body(refusal.get("body")) or error.message, "GET", path
            ) from error
        finally:
            _REFUSAL.reset(token)
        connection = getattr(websocket, "_conn", None)
        _read_in_bulk(connection.transport if connection is not None else None)
        self._dial_spare()
        return websocket

    def _dial_spare(self) -> None:
        """Leaves an idle connection in the pool for the next WebSocket: each one takes a
        connection for good, and a new stream (an exec, a port-forward connection) would
        otherwise pay a TLS handshake (about 2 ms of a 4.3 ms exec dial to an apiserver).
        A request made while no connection is idle dials one and hands it back."""
        if self._dialing_spare is None or self._dialing_spare.done():
            self._dialing_spare = asyncio.create_task(self._request_spare())

    async def _request_spare(self) -> None:
        with contextlib.suppress(*API_ERRORS):
            response = await self._open("GET", "/readyz", timeout=10, streaming=True)
            try:
                await response.read()
            finally:
                response.release()

    async def stream(
        self, path: str, query: Mapping[str, Any], *, timeout: float | None = None
    ) -> aiohttp.ClientResponse:
        """A GET whose body the caller reads as it arrives (logs); the caller releases it.
        Only the connection is timed, not the answer: a followed log of a quiet container
        may send nothing, its headers included, for as long as it stays quiet."""
        response = await self._open(
            "GET",
            path,
            query=query,
            timeout=aiohttp.ClientTimeout(
                total=timeout, sock_connect=STREAM_CONNECT_SECONDS, sock_read=None
            ),
            streaming=True,
        )
        if response.connection is not None:
            _read_in_bulk(response.connection.transport)
        return response

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 60.0,
        retry_when_told: bool = True,
    ) -> JSON:
        response = await self._open(
            method,
            path,
            query=query,
            body=body,
            content_type=content_type,
            timeout=timeout,
            retry_when_told=retry_when_told,
        )
        try:
            body = await response.read()
            result: JSON = orjson.loads(body) if body.strip() else {}
        except orjson.JSONDecodeError as error:
            # A 2xx that is no apiserver's: a proxy's or load balancer's page in front of
            # it. Told as a bad gateway, which every caller retries, not a crash.
            raise ApiError(
                502, f"the answer is not JSON ({error}): {body[:200]!r}", method, path
            ) from error
        finally:
            response.release()
        return result

    async def get_text(
        self, path: str, *, timeout: float = 60.0, retry_when_told: bool = True
    ) -> str:
        """The body of an endpoint that answers in plain text (/readyz, /livez)."""
        response = await self._open("GET", path, timeout=timeout, retry_when_told=retry_when_told)
        try:
            return await response.text()
        finally:
            response.release()

    async def get(self, resource: Resource, name: str, namespace: str | None = None) -> JSON:
        return await self.request("GET", resource.path(namespace, name))

    async def list(self, resource: Resource, namespace: str | None = None, **query: Any) -> JSON:
        return await self.request("GET", resource.path(namespace), query=query)

    async def list_pages(
        self, resource: Resource, namespace: str | None = None, *, limit: int, **query: Any
    ) -> AsyncIterator[JSON]:
        """A list in pages of at most ``limit`` items, following the continue tokens."""
        continue_token: str | None = None
        while True:
            page = await self.list(
                resource, namespace, limit=limit, **{"continue": continue_token}, **query
            )
            yield page
            continue_token = page.get("metadata", {}).get("continue") or None
            if not continue_token:
                return

    async def create(
        self, resource: Resource, body: JSON, namespace: str | None = None, *, timeout: float = 60.0
    ) -> JSON:
        return await self.request("POST", resource.path(namespace), body=body, timeout=timeout)

    async def replace(
        self, resource: Resource, body: JSON, namespace: str | None = None, subresource: str = ""
    ) -> JSON:
        name = body["metadata"]["name"]
        return await self.request("PUT", resource.path(namespace, name, subresource), body=body)

    async def patch(
        self,
        resource: Resource,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str = "",
        patch_type: str = "application/merge-patch+json",
        timeout: float = 60.0,
    ) -> JSON:
        return await self.request(
            "PATCH",
            resource.path(namespace, name, subresource),
            body=patch,
            content_type=patch_type,
            timeout=timeout,
        )

    async def update_configmap_data(
        self,
        namespace: str,
        name: str,
        change: Callable[[dict[str, str]], dict[str, str]],
        attempts: int = 5,
    ) -> dict[str, str]:
        """Read-modify-write of a ConfigMap's data, made on first use: ``change`` gets the
        data read and returns what to write (or raises to give up); the same data is not
        written. A write that lost a race (409) is made again on what won, up to
        ``attempts`` times."""
        for attempt in range(1, attempts + 1):
            try:
                current = await self.get(CONFIGMAPS, name, namespace)
            except ApiError as error:
                if not is_not_found(error):
                    raise
                current = {"metadata": {}}
            before = dict(current.get("data") or {})
            data = change(dict(before))
            if data == before and "resourceVersion" in current["metadata"]:
                return data  # nothing to write
            body = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace, **current["metadata"]},
                "data": data,
            }
            try:
                if "resourceVersion" in current["metadata"]:
                    await self.replace(CONFIGMAPS, body, namespace)
                else:
                    await self.create(CONFIGMAPS, body, namespace)
                return data
            except ApiError as error:
                if not is_conflict(error) or attempt == attempts:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def delete(
        self,
        resource: Resource,
        name: str,
        namespace: str | None = None,
        *,
        grace_period_seconds: int | None = None,
        uid: str | None = None,
        resource_version: str | None = None,
    ) -> JSON:
        options: JSON = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        preconditions = {"uid": uid, "resourceVersion": resource_version}
        if any(preconditions.values()):
            options["preconditions"] = {k: v for k, v in preconditions.items() if v}
        return await self.request("DELETE", resource.path(namespace, name), body=options)

    async def delete_exact(
        self, resource: Resource, obj: Mapping[str, Any], *, grace_period_seconds: int | None = None
    ) -> None:
        """Deletes this very object: a UID precondition spares a newer one of the same name,
        and an object already gone (404) or replaced (409) counts as deleted."""
        metadata = obj["metadata"]
        try:
            await self.delete(
                resource,
                metadata["name"],
                metadata.get("namespace"),
                grace_period_seconds=grace_period_seconds,
                uid=metadata["uid"],
            )
        except ApiError as error:
            if error.status not in (404, 409):
                raise

    async def watch(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        read_timeout: float = 90.0,
        **query: Any,
    ) -> AsyncIterator[JSON]:
        """Yields the watch events of one watch request, until the server ends it.
        An ERROR event is raised as ``ApiError`` with its Status."""
        query = {**query, "watch": "true"}
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=STREAM_CONNECT_SECONDS, sock_read=read_timeout
        )
        response = await self._open("GET", resource.path(namespace), query=query, timeout=timeout)
        # Lines are split here rather than by aiohttp, whose line reader refuses lines
        # over 64 KiB: one event carries a whole object, up to the 1.5 MiB etcd limit.
        lines = LineSplitter()
        try:
            async for chunk in response.content.iter_any():
                for line in lines.feed(chunk):
                    event: JSON = orjson.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        raise ApiError(
                            int(status.get("code", 500)), status, "WATCH", resource.path(namespace)
                        )
                    yield event
        except aiohttp.SocketTimeoutError as error:
            raise WatchSilent(
                f"{resource.path(namespace)}: nothing for {read_timeout:g} s"
            ) from error
        finally:
            response.release()


# Where a refused WebSocket handshake's body goes: aiohttp raises without it and closes
# the response, but the apiserver says why there (forbidden, no such container).
_REFUSAL: contextvars.ContextVar[dict[str, bytes] | None] = contextvars.ContextVar(
    "websocket_refusal", default=None
)


async def _keep_refusal(
    _session: aiohttp.ClientSession, _context: Any, params: aiohttp.TraceRequestEndParams
) -> None:
    kept = _REFUSAL.get()
    if kept is not None and params.response.status >= 300:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            kept["body"] = await params.response.read()


def _status_body(body: bytes | None) -> JSON | str:
    """A refusal's Status, or its text when it is not one; "" without a body."""
    if not body:
        return ""
    try:
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode(errors="replace").strip()
    return decoded if isinstance(decoded, dict) else body.decode(errors="replace").strip()


class LineSplitter:
    """Splits a byte stream into newline-terminated lines, whatever the chunking."""

    def __init__(self) -> None:
        self._pending = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        self._pending += chunk
        if b"\n" not in chunk:
            return []
        *complete, rest = bytes(self._pending).split(b"\n")
        self._pending = bytearray(rest)
        return [line for line in complete if line.strip()]


TLS_READ_BUFFER_BYTES = 32 * 1024
# asyncio's own size, for a connection carrying a stream (logs, exec, port-forward): a
# read per 32 KiB cut port-forward through a virtual node from 61 to 54 MiB/s.
STREAM_TLS_READ_BUFFER_BYTES = 256 * 1024


def shrink_tls_read_buffers() -> None:
    """Makes every TLS connection the process opens from now on read into 32 KiB
    instead of asyncio's 256 KiB. That buffer is zero-filled, so resident from the
    start, and a virtual node keeps a connection per worker to each apiserver: at 64
    workers the default buffers alone are over 30 MiB. A TLS record carries at most
    16 KiB, so a read of 32 KiB still takes whole records."""
    asyncio.sslproto.SSLProtocol.max_size = TLS_READ_BUFFER_BYTES


def _read_in_bulk(transport: asyncio.BaseTransport | None) -> None:
    """Gives a streaming connection its large TLS read buffer back (asyncio keeps the
    protocol private: without it, nothing changes)."""
    protocol = getattr(transport, "_ssl_protocol", None)
    if isinstance(protocol, asyncio.sslproto.SSLProtocol):
        protocol.max_size = STREAM_TLS_READ_BUFFER_BYTES  # type: ignore[misc]


# TCP keepalive of the streams' connections (a followed log that says nothing for
# minutes, an idle exec shell or port-forwarded connection): a load balancer that drops
# silent flows
# (Azure's after 4 minutes) left `kubectl logs -f` through the virtual node hanging for
# good; probed after 30 s of silence, a dropped connection ends within a minute more.
STREAM_KEEPALIVE_IDLE_SECONDS = 30
STREAM_KEEPALIVE_INTERVAL_SECONDS = 10
STREAM_KEEPALIVE_PROBES = 3


def _kept_alive(address: Any) -> socket.socket:
    """A socket for aiohttp's connector (``socket_factory``) with TCP keepalive on."""
    family, kind, protocol, _name, _address = address
    made = socket.socket(family=family, type=kind, proto=protocol)
    keep_alive(made)
    return made


def keep_alive(connection: Any) -> None:
    """TCP keepalive on, with the streams' timings, for a socket (or an asyncio
    transport's): accepted by a server too, whose peer may vanish without a word."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", STREAM_KEEPALIVE_IDLE_SECONDS),
        ("TCP_KEEPINTVL", STREAM_KEEPALIVE_INTERVAL_SECONDS),
        ("TCP_KEEPCNT", STREAM_KEEPALIVE_PROBES),
    ):
        if hasattr(socket, option):  # Linux's; others keep their system's timings
            connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _requests_session(context: ssl.SSLContext, connections: int) -> aiohttp.ClientSession:
    # The library's session trusts the environment, so aiohttp looks up proxies and
    # ~/.netrc in a worker thread on every request: most of a busy controller's CPU.
    # A kubeconfig's proxy-url is still honoured (the library passes it per request).
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, ssl=context),
        trust_env=False,
        read_bufsize=2**21,  # watch events of large objects (etcd allows 1.5 MiB)
    )


async def _close_later(session: aiohttp.ClientSession, delay: float) -> None:
    try:
        await asyncio.sleep(delay)
    finally:
        await session.close()


def _certificate_files(configuration: k8s_client.Configuration) -> tuple[Any, ...] | None:
    """What tells a client certificate from the next: its files' names and versions."""
    if not configuration.cert_file:
        return None
    files = (configuration.cert_file, configuration.key_file)
    return tuple((name, *file_version(name)) for name in files if name)


def _ssl_context(configuration: k8s_client.Configuration) -> ssl.SSLContext:
    """What the library's own session would use: the cluster CA and client certificate."""
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, keyfile=configuration.key_file)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if configuration.disable_strict_ssl_verification:
        context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
