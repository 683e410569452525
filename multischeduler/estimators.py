"""The fit estimators of the virtual nodes: one gRPC channel each, kept in step with the
upper cluster's virtual Nodes.

TLS verifies the estimator's certificate against the host part of its address (gRPC's
default: the estimators' certificates carry their IP address); the caller authenticates
with a bearer token, read again whenever its file changes since service-account tokens
are rotated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc
import grpc.aio

from kubekit import keys
from kubekit.certreload import file_version
from kubekit.client import JSON
from kubekit.estimatorapi import client_keepalive_options
from kubekit.estimatorapi.estimator_pb2 import (
    DefragmentRequest,
    DefragmentResponse,
    EstimateRequest,
    EstimateResponse,
    FitInTurnRequest,
    FitInTurnResponse,
    HoldRequest,
    PodQuery,
    PromiseSlicesRequest,
    PromiseSlicesResponse,
    ReleaseRequest,
    SlicedNamespacesRequest,
    SlicedNamespacesResponse,
    SliceRoomRequest,
    SliceRoomResponse,
)
from kubekit.estimatorapi.estimator_pb2_grpc import EstimatorStub
from kubekit.informer import FunctionHandler
from kubekit.loops import Background, being_cancelled
from multischeduler.extender import Answer, EstimatorFailure, VirtualNode, virtual_node

if TYPE_CHECKING:
    from kubekit.estimatorapi.estimator_pb2_grpc import EstimatorAsyncStub

log = logging.getLogger("multischeduler.estimators")

Response = TypeVar("Response")


class _ClusterAnswer(Protocol):
    @property
    def cluster_id(self) -> str: ...


Clustered = TypeVar("Clustered", bound=_ClusterAnswer)
Metadata = tuple[tuple[str, str], ...]

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
IN_CLUSTER_CA = SERVICE_ACCOUNT_DIR / "ca.crt"
# Where the manifests project the ServiceAccount's token for keys.ESTIMATOR_AUDIENCE.
ESTIMATOR_TOKEN = Path("/var/run/secrets/kubestrata.io/estimator/token")

RELEASE_TIMEOUT = 5.0
# Releases ride on the next Estimate call to the same estimator (a decision's surplus
# then costs no call of its own); those that find no call to ride on within this long
# go in a Release call of their own.
RELEASE_DELAY = 0.25

# An estimator that leaves this many calls in a row unanswered within their deadline is
# not asked for the next SKIP_LATE_SECONDS: each decision would otherwise wait its whole
# deadline for it (a stopped or wedged virtual node), and the scheduler decides one pod
# at a time. Its node fails those decisions at once, saying why.
LATE_IN_A_ROW_TO_SKIP = 3
SKIP_LATE_SECONDS = 5.0

# Codes that mean the estimator did not act on the request, so holds no room for it (but
# see _EndedWithTheCall.reached).
_NOT_ACTED_ON = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class TokenFile:
    """A bearer token file, read again when it changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._token = ""

    def token(self) -> str:
        seen = file_version(self.path)
        if seen != self._seen:
            self._token = self.path.read_text().strip()
            self._seen = seen
        return self._token


class CaFile:
    """The CA bundle the estimators' certificates are checked against (None: the
    system's roots), read again when its file changes: read once, a rotated in-cluster
    CA failed every estimator re-issued by the new one until a restart."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._seen = file_version(path) if path is not None else None
        self._bundle = path.read_bytes() if path is not None else None
        self.credentials = grpc.ssl_channel_credentials(root_certificates=self._bundle)

    def renewed(self) -> bool:
        """Whether the bundle changed since it was last read, taking it then; a file that
        cannot be read (being replaced) is kept as it was, and looked at next time. The
        file is read only when it was written again, and counts as changed only if what
        it holds did: a kubelet writes every file of a projected service-account volume
        anew with each token (hourly), its CA the same."""
        if self.path is None:
            return False
        try:
            seen = file_version(self.path)
            if seen == self._seen:
                return False
            bundle = self.path.read_bytes()
        except OSError as error:
            log.warning("estimator CA %s not read again: %s", self.path, error)
            return False
        self._seen = seen
        if bundle == self._bundle:
            return False
        self._bundle = bundle
        self.credentials = grpc.ssl_channel_credentials(bundle)
        log.info("estimator CA %s read again", self.path)
        return True


# gRPC waits up to two minutes between attempts to reach an estimator that was down and
# fails every call meanwhile; a virtual node restarts in seconds.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class AnswerStream:
    """One EstimateStream call: requests written one at a time, answers read back in
    the order asked. A request not answered in time ends the call (the answers behind
    it would be as late), and so does any failure of the call; the requests then waiting
    fail with it, as calls of their own would."""

    def __init__(self, stub: EstimatorAsyncStub, metadata: Metadata) -> None:
        self.metadata = metadata
        self._call = stub.EstimateStream(metadata=metadata)
        self._waiting: deque[asyncio.Future[EstimateResponse]] = deque()
        # asyncio's lock is fair: the requests of whoever took this stream before finish()
        # was called are written before the call is half-closed.
        self._writing = asyncio.Lock()
        self._failure: grpc.aio.AioRpcError | None = None
        self._reader = asyncio.create_task(self._read())

    @property
    def ended(self) -> bool:
        return self._failure is not None or self._call.done()

    async def _read(self) -> None:
        try:
            while True:
                response = await self._call.read()
                if not isinstance(response, EstimateResponse):  # grpc.aio.EOF
                    self._end(_failure(grpc.StatusCode.UNAVAILABLE, "the estimator ended the call"))
                    return
                if not self._waiting:
                    self._end(_failure(grpc.StatusCode.INTERNAL, "an answer to no request"))
                    return
                # The answer of a request whose asker went away is dropped with it.
                waiting = self._waiting.popleft()
                if not waiting.done():
                    waiting.set_result(response)
        except grpc.aio.AioRpcError as error:
            self._end(error)
        except asyncio.CancelledError:
            self._end(_failure(grpc.StatusCode.CANCELLED, "the call was closed"))
            raise

    def _end(self, failure: grpc.aio.AioRpcError) -> None:
        if self._failure is None:
            self._failure = failure
        self._call.cancel()
        while self._waiting:
            waiting = self._waiting.popleft()
            if not waiting.done():
                waiting.set_exception(_EndedWithTheCall(self._failure, reached=True))

    async def ask(self, request: EstimateRequest, timeout: float) -> EstimateResponse:
        """The answer to ``request``; raises the call's failure as a unary call would."""
        answer: asyncio.Future[EstimateResponse] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                async with self._writing:
                    if self._failure is not None:
                        raise _EndedWithTheCall(self._failure, reached=False)
                    self._waiting.append(answer)
                    try:
                        await self._call.write(request)
                    except grpc.aio.AioRpcError as error:
                        self._end(error)
                    except asyncio.InvalidStateError:
                        self._end(_failure(grpc.StatusCode.UNAVAILABLE, "the call has ended"))
                return await answer
        except TimeoutError:
            late = _failure(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout:g} s")
            self._end(late)
            raise late from None
        finally:
            answer.cancel()

    async def finish(self) -> None:
        """No more requests: the answers still due are read, then the call ends."""
        async with self._writing:
            # A failure here is the call's, which the reader has.
            if not self.ended:
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await self._call.done_writing()

    def close(self) -> None:
        self._reader.cancel()


class _EndedWithTheCall(grpc.aio.AioRpcError):
    """The failure of a request that waited on a call another one ended: late only if
    that other one was (never counted as this estimator being late again). ``reached``:
    the request was going out or gone when the call ended, so the estimator may have
    acted on it whatever the call's code (a stream broken after it says UNAVAILABLE)."""

    def __init__(self, failure: grpc.aio.AioRpcError, reached: bool) -> None:
        super().__init__(
            failure.code(), grpc.aio.Metadata(), grpc.aio.Metadata(), failure.details()
        )
        self.reached = reached


def _failure(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def _unless_closed(make_call: Callable[[], Awaitable[Response]]) -> Response:
    """Makes and awaits a gRPC call. Closing its channel (its estimator moved or
    restarted: see ``EstimatorPool.put``) cancels it, and grpc.aio raises that as
    asyncio.CancelledError in whoever awaits it: unless that task is being cancelled
    itself, it is this call's failure. Raised as such, it had ended the slicing leader's
    work, and with it the whole multischeduler, silently (a CI run). A channel closed
    while its caller waited for something else refuses the call with UsageError, as
    much this call's failure: raised, it failed the whole decision (HTTP 500)."""
    try:
        return await make_call()
    except grpc.aio.UsageError:
        raise _failure(grpc.StatusCode.CANCELLED, "its channel closed before the call") from None
    except asyncio.CancelledError:
        if being_cancelled():
            raise
        raise _failure(grpc.StatusCode.CANCELLED, "its channel closed during the call") from None


@dataclass
class _Estimator:
    address: str
    started: str
    channel: grpc.aio.Channel
    stub: EstimatorAsyncStub
    stream: AnswerStream | None = None
    # The estimator has no EstimateStream (a virtual node of an older version).
    unary_only: bool = False
    # UIDs whose room is to be given back with the next call.
    releases: set[str] = field(default_factory=set)
    flush_timer: asyncio.TimerHandle | None = None
    # A Release call on its way: calls after it wait for it, or a release sent before a
    # new reservation of the same pod could arrive after it and drop it.
    flushing: asyncio.Task[None] | None = None
    # Calls in a row left unanswered within their deadline, and until when (event loop
    # time) it is not asked.
    late_in_a_row: int = 0
    skipped_until: float = 0.0


class EstimatorPool:
    """The virtual nodes known from the upper Node informer, and a channel to each one's
    estimator."""

    def __init__(
        self,
        ca: CaFile,
        token: TokenFile | None = None,
        release_delay: float = RELEASE_DELAY,
        skip_late_seconds: float = SKIP_LATE_SECONDS,
    ) -> None:
        self.ca = ca
        self.token = token
        self.release_delay = release_delay
        self.skip_late_seconds = skip_late_seconds
        self.nodes: dict[str, VirtualNode] = {}
        # Every Node the watch has shown, virtual or not: a name the scheduler sends that
        # is not here may be a virtual node the watch has not shown yet.
        self.known: set[str] = set()
        # How many times the watch told of each Node: a Node read afresh is taken only if
        # the watch told nothing of it during the read (a read's older version put after
        # the watch's newer one closed the new estimator's channel).
        self._watched: dict[str, int] = {}
        self._estimators: dict[str, _Estimator] = {}
        # Fire-and-forget calls and channel closes.
        self._background = Background()

    def handler(self) -> FunctionHandler:
        return FunctionHandler(add=self._told, update=self._told, delete=self.remove)

    def _told(self, obj: JSON) -> None:
        name = str(obj["metadata"]["name"])
        self._watched[name] = self._watched.get(name, 0) + 1
        self.put(obj)

    def watched(self, name: str) -> int:
        """A count that moves whenever the watch tells of Node ``name``."""
        return self._watched.get(name, 0)

    def put_read(self, obj: JSON, watched: int) -> None:
        """Takes a Node read afresh, unless the watch told of it since ``watched``."""
        if self.watched(str(obj["metadata"]["name"])) == watched:
            self.put(obj)

    def is_virtual(self, name: str) -> bool:
        return name in self.nodes

    def is_known(self, name: str) -> bool:
        return name in self.known

    def estimator_of(self, name: str) -> tuple[str, str] | None:
        """The address and start of the estimator ``name`` is asked at now."""
        estimator = self._estimators.get(name)
        return None if estimator is None else (estimator.address, estimator.started)

    def put(self, obj: JSON) -> bool:
        """Takes a Node (from the watch, or read afresh ahead of it); True when it is a
        virtual one that names another estimator than the one known (the virtual node
        restarted or moved)."""
        self.known.add(str(obj["metadata"]["name"]))
        node = virtual_node(obj)
        if node is None:
            self._forget(str(obj["metadata"]["name"]))
            return False
        self.nodes[node.name] = node
        current = self._estimators.get(node.name)
        if (
            current is not None
            and node.proven
            and (current.address, current.started) == (node.address, node.started)
        ):
            return False
        if current is not None:
            del self._estimators[node.name]
            self._close(current)
        if node.address is not None and node.proven:
            self._open(node.name, node.address, node.started)
            log.info("%s (cluster %s): estimator at %s", node.name, node.cluster_id, node.address)
            return True
        log.warning("%s: %s", node.name, self._no_estimator(node.name))
        return False

    def _no_estimator(self, name: str) -> str:
        node = self.nodes.get(name)
        if node is not None and not node.proven:
            return (
                f"the node is not labelled {keys.PROVEN_VIRTUAL_NODE_LABEL}="
                f"{keys.VIRTUAL_NODE_LABEL_VALUE}, which a kubelet cannot set on its Node: "
                "its estimator is not asked"
            )
        return f"the node has no {keys.ESTIMATOR_ADDRESS_ANNOTATION} annotation"

    def remove(self, obj: JSON) -> None:
        name = str(obj["metadata"]["name"])
        self._watched[name] = self._watched.get(name, 0) + 1
        self.known.discard(name)
        self._forget(name)

    def _forget(self, name: str) -> None:
        self.nodes.pop(name, None)
        estimator = self._estimators.pop(name, None)
        if estimator is not None:
            self._close(estimator)

    def _open(self, name: str, address: str, started: str) -> None:
        channel = grpc.aio.secure_channel(
            address, self.ca.credentials, (*CHANNEL_OPTIONS, *client_keepalive_options())
        )
        self._estimators[name] = _Estimator(address, started, channel, EstimatorStub(channel))

    def _follow_ca(self) -> None:
        """Opens every channel again when the CA changed: one open now reconnects, after
        any drop, checking against the CA it was made with. Room waiting to be given back
        goes through the new channel; a call under way on the old one ends with it (a
        Release among them lapses on its own, as when an estimator restarts)."""
        if not self.ca.renewed():
            return
        for name, estimator in list(self._estimators.items()):
            self._close(estimator)
            self._open(name, estimator.address, estimator.started)
            self._queue_releases(name, self._estimators[name], estimator.releases)

    def _close(self, estimator: _Estimator) -> None:
        if estimator.flush_timer is not None:
            estimator.flush_timer.cancel()
        if estimator.stream is not None:
            estimator.stream.close()
        self._background.spawn(estimator.channel.close())

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        if self.token is None:
            return ()
        return (("authorization", f"Bearer {self.token.token()}"),)

    async def estimate(
        self, names: Sequence[str], query: PodQuery, timeout: float
    ) -> dict[str, Answer]:
        """Asks the estimators of ``names`` at once; every call has the same deadline and
        fails on its own."""
        self._follow_ca()
        try:
            metadata = self._metadata()
        except OSError as error:
            failure = EstimatorFailure(f"cannot read the token: {error}")
            return dict.fromkeys(names, failure)
        answers = await asyncio.gather(
            *(self._estimate(name, query, metadata, timeout) for name in names)
        )
        return dict(zip(names, answers, strict=True))

    async def _estimate(
        self,
        name: str,
        query: PodQuery,
        metadata: tuple[tuple[str, str], ...],
        timeout: float,
    ) -> Answer:
        estimator = self._estimators.get(name)
        if estimator is None:
            return EstimatorFailure(self._no_estimator(name))
        loop = asyncio.get_running_loop()
        if (left := estimator.skipped_until - loop.time()) > 0:
            return EstimatorFailure(
                f"{estimator.address}: not asked for {left:.1f} s more: its last "
                f"{estimator.late_in_a_row} calls had no answer within their deadline"
            )
        if estimator.flushing is not None:
            # Within the call's own deadline: an estimator that hangs would hold every
            # later decision for the Release call's whole timeout.
            deadline = loop.time() + timeout
            done, _ = await asyncio.wait({estimator.flushing}, timeout=timeout)
            if not done:
                self._late(name, estimator)
                return EstimatorFailure(
                    f"{estimator.address}: room given back {timeout:g} s ago not confirmed yet"
                )
            timeout = max(0.0, deadline - loop.time())
        releases = sorted(estimator.releases)
        estimator.releases.clear()
        request = EstimateRequest(pods=[query], release_pod_uids=releases)
        try:
            response = await self._ask(name, estimator, request, metadata, timeout)
        except grpc.aio.AioRpcError as error:
            # Given back again with the next call: a release is idempotent.
            self._queue_releases(name, estimator, releases)
            code = error.code()
            if isinstance(error, _EndedWithTheCall):
                pass  # another request's lateness, counted once, with that request
            elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
                self._late(name, estimator)
            else:
                estimator.late_in_a_row = 0
            return EstimatorFailure(
                f"{estimator.address}: {code.name}: {error.details()}",
                maybe_reserved=code not in _NOT_ACTED_ON
                or (isinstance(error, _EndedWithTheCall) and error.reached),
            )
        estimator.late_in_a_row = 0
        if len(response.estimates) != 1:
            return EstimatorFailure(
                f"{estimator.address}: {len(response.estimates)} estimates for 1 pod",
                maybe_reserved=True,
            )
        return (
            self._other_cluster(name, estimator.address, response.cluster_id)
            or response.estimates[0]
        )

    def _late(self, name: str, estimator: _Estimator) -> None:
        estimator.late_in_a_row += 1
        if estimator.late_in_a_row >= LATE_IN_A_ROW_TO_SKIP:
            estimator.skipped_until = asyncio.get_running_loop().time() + self.skip_late_seconds
            log.warning(
                "%s: %d calls in a row unanswered within their deadline at %s: not asked for %g s",
                name,
                estimator.late_in_a_row,
                estimator.address,
                self.skip_late_seconds,
            )

    async def _ask(
        self,
        name: str,
        estimator: _Estimator,
        request: EstimateRequest,
        metadata: Metadata,
        timeout: float,
    ) -> EstimateResponse:
        if not estimator.unary_only:
            deadline = asyncio.get_running_loop().time() + timeout
            try:
                return await _unless_closed(
                    lambda: self._stream(estimator, metadata).ask(request, timeout)
                )
            except grpc.aio.AioRpcError as error:
                if error.code() is not grpc.StatusCode.UNIMPLEMENTED:
                    raise
            estimator.unary_only = True
            log.info("%s: the estimator has no EstimateStream: one call per request", name)
            timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        return await _unless_closed(
            lambda: estimator.stub.Estimate(request, timeout=timeout, metadata=metadata)
        )

    def _stream(self, estimator: _Estimator, metadata: Metadata) -> AnswerStream:
        stream = estimator.stream
        if stream is not None and not stream.ended and stream.metadata == metadata:
            return stream
        if stream is not None:
            # A rotated token: the answers still due on the old call are read first.
            self._background.spawn(stream.finish())
        estimator.stream = AnswerStream(estimator.stub, metadata)
        return estimator.stream

    def _other_cluster(self, name: str, address: str, cluster_id: str) -> EstimatorFailure | None:
        """An address annotation pointing at another cluster's estimator would place
        pods by the wrong cluster's room."""
        node = self.nodes.get(name)
        expected = node.cluster_id if node is not None else ""
        if expected and cluster_id != expected:
            return EstimatorFailure(
                f"{address} answers for cluster {cluster_id!r}, not {expected!r}",
                maybe_reserved=True,
            )
        return None

    async def _call(
        self, name: str, call: Callable[[EstimatorAsyncStub, Metadata], Awaitable[Response]]
    ) -> Response | EstimatorFailure:
        """One call to the estimator of ``name``, its failures as answers."""
        self._follow_ca()
        estimator = self._estimators.get(name)
        if estimator is None:
            return EstimatorFailure(self._no_estimator(name))
        try:
            metadata = self._metadata()
        except OSError as error:
            return EstimatorFailure(f"cannot read the token: {error}")
        try:
            return await _unless_closed(lambda: call(estimator.stub, metadata))
        except grpc.aio.AioRpcError as error:
            code = error.code()
            return EstimatorFailure(
                f"{estimator.address}: {code.name}: {error.details()}",
                maybe_reserved=code not in _NOT_ACTED_ON,
            )

    def _same_cluster(
        self, name: str, answer: Clustered | EstimatorFailure
    ) -> Clustered | EstimatorFailure:
        if isinstance(answer, EstimatorFailure):
            return answer
        return self._other_cluster(name, name, answer.cluster_id) or answer

    async def defragment(
        self, name: str, request: DefragmentRequest, timeout: float
    ) -> DefragmentResponse | EstimatorFailure:
        return self._same_cluster(
            name,
            await self._call(
                name,
                lambda stub, metadata: stub.Defragment(request, timeout=timeout, metadata=metadata),
            ),
        )

    async def fit_in_turn(
        self, name: str, request: FitInTurnRequest, timeout: float
    ) -> FitInTurnResponse | EstimatorFailure:
        return self._same_cluster(
            name,
            await self._call(
                name,
                lambda stub, metadata: stub.FitInTurn(request, timeout=timeout, metadata=metadata),
            ),
        )

    async def hold(
        self, name: str, request: HoldRequest, timeout: float
    ) -> EstimatorFailure | None:
        answer = await self._call(
            name, lambda stub, metadata: stub.Hold(request, timeout=timeout, metadata=metadata)
        )
        return answer if isinstance(answer, EstimatorFailure) else None

    async def slice_room(
        self, name: str, namespace: str, timeout: float
    ) -> SliceRoomResponse | EstimatorFailure:
        request = SliceRoomRequest(namespace=namespace)
        return self._same_cluster(
            name,
            await self._call(
                name,
                lambda stub, metadata: stub.SliceRoom(request, timeout=timeout, metadata=metadata),
            ),
        )

    async def promise_slices(
        self, name: str, request: PromiseSlicesRequest, timeout: float
    ) -> PromiseSlicesResponse | EstimatorFailure:
        return await self._call(
            name,
            lambda stub, metadata: stub.PromiseSlices(request, timeout=timeout, metadata=metadata),
        )

    async def sliced_namespaces(
        self, name: str, timeout: float
    ) -> SlicedNamespacesResponse | EstimatorFailure:
        request = SlicedNamespacesRequest()
        return self._same_cluster(
            name,
            await self._call(
                name,
                lambda stub, metadata: stub.SlicedNamespaces(
                    request, timeout=timeout, metadata=metadata
                ),
            ),
        )

    def release(self, names: Iterable[str], uid: str) -> None:
        """Gives back the room held for pod ``uid`` on these nodes with the next call to
        each (the estimators also let it go on their own after a while)."""
        for name in names:
            estimator = self._estimators.get(name)
            if estimator is not None:
                self._queue_releases(name, estimator, [uid])

    def _queue_releases(self, name: str, estimator: _Estimator, uids: Iterable[str]) -> None:
        estimator.releases.update(uids)
        if estimator.releases and estimator.flush_timer is None:
            estimator.flush_timer = asyncio.get_running_loop().call_later(
                self.release_delay, self._flush, name, estimator
            )

    def _flush(self, name: str, estimator: _Estimator) -> None:
        estimator.flush_timer = None
        if not estimator.releases or self._estimators.get(name) is not estimator:
            return
        if estimator.flushing is not None:
            # The call on its way ends by looking again.
            return
        uids = sorted(estimator.releases)
        estimator.releases.clear()
        estimator.flushing = self._background.spawn(self._release(name, estimator, uids))

    async def _release(self, name: str, estimator: _Estimator, uids: list[str]) -> None:
        try:
            await _unless_closed(
                lambda: estimator.stub.Release(
                    ReleaseRequest(pod_uids=uids),
                    timeout=RELEASE_TIMEOUT,
                    metadata=self._metadata(),
                )
            )
        except (grpc.aio.AioRpcError, OSError) as error:
            log.warning("%s: releasing the room of pods %s: %s", name, ", ".join(uids), error)
            # Given back with the next call, which is the one that would find the room
            # held (a release is idempotent); a call of their own again at once would
            # only fail the same way while the estimator is down.
            estimator.releases.update(uids)
            return
        finally:
            estimator.flushing = None
        if estimator.releases:
            self._flush(name, estimator)

    async def close(self) -> None:
        """Gives back the room still waiting for its call first: left held, it would lapse
        with no event for the scheduler (a `descheduler --once`, say, ends right after a
        plan stopped part-way gave its hold back)."""
        waiting = [(n, e) for n, e in self._estimators.items() if e.releases or e.flushing]
        for name, estimator in waiting:
            if estimator.flush_timer is not None:
                estimator.flush_timer.cancel()
                estimator.flush_timer = None
            if estimator.flushing is None:
                self._flush(name, estimator)
        await asyncio.gather(*(e.flushing for _, e in waiting if e.flushing is not None))
        for estimator in self._estimators.values():
            self._close(estimator)
        self._estimators.clear()
        await self._background.wait()


def add_estimator_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--estimator-ca-file",
        type=Path,
        help="CA that signed the estimators' certificates (default: the in-cluster CA when "
        "present, else the system's)",
    )
    parser.add_argument(
        "--estimator-token-file",
        type=Path,
        help="bearer token sent to the estimators, read again when it changes; they accept "
        f"only tokens for audience {keys.ESTIMATOR_AUDIENCE} (default: {ESTIMATOR_TOKEN} "
        "when present, where the manifests project one, else none)",
    )


@dataclass(frozen=True)
class EstimatorClient:
    """How to reach the estimators: whom to trust, what token to send."""

    ca_file: Path | None
    token_file: Path | None

    def pool(self) -> EstimatorPool:
        token = TokenFile(self.token_file) if self.token_file else None
        return EstimatorPool(CaFile(self.ca_file), token)


def estimator_client(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EstimatorClient:
    """The estimator flags, checked; the in-cluster CA and the projected token when not
    given."""
    for flag, path in (
        ("--estimator-ca-file", args.estimator_ca_file),
        ("--estimator-token-file", args.estimator_token_file),
    ):
        if path is not None and not path.is_file():
            parser.error(f"{flag}: no such file: {path}")
    return EstimatorClient(
        args.estimator_ca_file or _if_present(IN_CLUSTER_CA),
        args.estimator_token_file or _if_present(ESTIMATOR_TOKEN),
    )


def _if_present(path: Path) -> Path | None:
    return path if path.is_file() else None
