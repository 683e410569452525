"""The extender's HTTP face: the scheduler's verbs over aiohttp, around the pure
decisions of multischeduler.extender and the estimators of multischeduler.estimators."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from kubekit.client import API_ERRORS, JSON, NODES, PODS, Resource
from kubekit.estimatorapi.estimator_pb2 import PodEstimate, PodQuery
from kubekit.loops import Background
from kubekit.serving import certificate_subject
from multischeduler.estimators import EstimatorPool
from multischeduler.extender import (
    Answer,
    BadRequest,
    BindingArgs,
    Decisions,
    EstimatorFailure,
    ExtenderArgs,
    Metrics,
    OnEstimatorError,
    Score,
    chosen_cluster,
    filter_result,
    outside_slices,
    parse_binding_args,
    parse_extender_args,
    reserved_nodes,
    room_to_give_back,
    scores,
)

log = logging.getLogger("multischeduler")

# Creates the Binding in the upper cluster; raises with a message for the scheduler.
Binder = Callable[[BindingArgs], Awaitable[None]]
# An object (resource, namespace, name) as the upper apiserver has it now; None when it
# is not found.
Lookup = Callable[[Resource, str | None, str], Awaitable[JSON | None]]

# A pod is a few KiB; 3 MiB covers the largest object etcd stores.
MAX_BODY = 3 * 1024 * 1024
# A read of a pod that left the scheduler's queue (past this the room kept for it is left
# to lapse), or of a virtual Node whose estimator failed.
LOOKUP_TIMEOUT = 2.0
# What a filter may take, within the scheduler's httpTimeout of 5 s for the whole call
# (past it the scheduler fails the pod's whole attempt, every node with it): the second
# round, for estimators restarted meanwhile, is asked only if it fits.
FILTER_BUDGET = 4.5
# The same for a bind, the hold of room before the binding included (the binding's own
# 4 s after a hold of up to 2 s ran past the scheduler's 5 s, which took the bind for
# failed while the Binding was still being made).
BIND_BUDGET = 4.5
# How often at most the Node of an estimator that keeps failing is read again, counted
# from the end of the last read; a second for a pod it failed before, tried again.
READ_AGAIN_INTERVAL = 5.0
READ_AGAIN_FOR_RETRY_INTERVAL = 1.0


@dataclass
class Extender:
    pool: EstimatorPool
    binder: Binder
    lookup: Lookup
    estimator_timeout: float = 0.5
    on_error: OnEstimatorError = OnEstimatorError.FAIL
    score: Score = Score.BEST_FIT
    # {cluster-id: slices} of a namespace whose quota is sliced, else None.
    slices_of: Callable[[str], Mapping[str, int] | None] = field(default=lambda _namespace: None)
    decisions: Decisions = field(default_factory=Decisions)
    metrics: Metrics = field(default_factory=Metrics)
    clock: Callable[[], float] = time.monotonic
    _giving_back: Background = field(default_factory=Background, init=False)
    # When a failed estimator's Node was last read again and told of no restart.
    _read_again_at: dict[str, float] = field(default_factory=dict, init=False)
    # The pods each such estimator failed: one tried again may follow the Node's change
    # that told of a restart, ahead of the watch.
    _failed_pods: dict[str, set[str]] = field(default_factory=dict, init=False)

    async def _estimate(
        self, names: list[str], pod: bytes, pod_key: str, reserve: bool
    ) -> dict[str, Answer]:
        query = PodQuery(pod=pod, reserve=reserve)
        answers = await self.pool.estimate(names, query, self.estimator_timeout)
        for name, answer in answers.items():
            if isinstance(answer, EstimatorFailure):
                self.metrics.estimator_errors.inc()
                log.warning("%s: pod %s: %s", name, pod_key, answer.message)
        return answers

    async def filter(self, args: ExtenderArgs) -> JSON:
        began = self.clock()
        answers: dict[str, Answer] = await self._read_unknown(args.node_names)
        virtual = [n for n in args.node_names if self.pool.is_virtual(n)]
        namespace = str(args.pod["metadata"].get("namespace", ""))
        slices = self.slices_of(namespace) if virtual else None
        if slices is not None:
            for name in virtual:
                outside = outside_slices(self.pool.nodes[name], namespace, slices)
                if outside is not None:
                    answers[name] = outside
            virtual = [n for n in virtual if n not in answers]
        chosen = None
        if virtual:
            pod = orjson.dumps(args.pod)
            asked = {name: self.pool.estimator_of(name) for name in virtual}
            answers |= await self._estimate(virtual, pod, args.pod_key, reserve=True)
            answers |= await self._ask_restarted(answers, asked, pod, args, began)
            chosen = chosen_cluster(answers, self.score)
            # Room held elsewhere until the binding would turn the next pods of a burst
            # away from clusters that still have it.
            surplus = reserved_nodes(answers) - {chosen}
            self.pool.release(surplus, args.uid)
            left = self.decisions.remember(
                args.uid, answers, self.clock(), released=surplus, pod=pod
            )
            if left:
                self._give_back_later(args.pod, left)
        result = filter_result(args.node_names, answers, self.on_error, chosen)
        self.metrics.filter_seconds.observe(self.clock() - began)
        self.metrics.decisions.labels("filter").inc()
        return result

    async def _read_unknown(self, names: Sequence[str]) -> dict[str, Answer]:
        """Reads the Nodes the cache has not shown yet (the scheduler's watch was ahead of
        ours): taken for ordinary ones, new virtual nodes would pass unchecked. Those that
        cannot be read are refused this time."""
        unknown = [name for name in names if not self.pool.is_known(name)]
        if not unknown:
            return {}
        refused: dict[str, Answer] = {}
        for name, node in zip(unknown, await self._read_nodes(unknown), strict=True):
            if isinstance(node, BaseException) or node is None:
                why = node or "not found"
                refused[name] = PodEstimate(message=f"Node not known yet ({why})")
        return refused

    async def _read_nodes(self, names: Sequence[str]) -> list[JSON | BaseException | None]:
        """The Nodes of ``names`` read afresh, all at once (the scheduler gives the whole
        call 5 s): each a Node, None when gone, or the API error its read met. The Nodes
        read go to the pool, unless its watch told of them meanwhile."""
        watched = [self.pool.watched(name) for name in names]
        reads = await asyncio.gather(
            *(self.lookup(NODES, None, name) for name in names), return_exceptions=True
        )
        for read, seen in zip(reads, watched, strict=True):
            if isinstance(read, BaseException) and not isinstance(read, API_ERRORS):
                raise read
            if isinstance(read, dict):
                self.pool.put_read(read, seen)
        return reads

    async def _ask_restarted(
        self,
        answers: Mapping[str, Answer],
        asked: Mapping[str, tuple[str, str] | None],
        pod: bytes,
        args: ExtenderArgs,
        began: float,
    ) -> dict[str, Answer]:
        """Asks again, once, the virtual nodes whose estimator failed but is not the one
        ``asked`` (restarted since the Node cache last heard, or since the call began:
        the watch's news of it closes the old channel under the call). The Node change
        that tells of a restart makes the scheduler try its waiting pods again, and may
        reach it before this process's watch: asked through the old channel, the new
        estimator would fail them, and no further change would bring them back for
        minutes."""
        now = self.clock()
        failed_here = [n for n, a in answers.items() if isinstance(a, EstimatorFailure)]
        # Heard of by the watch during the call: asked, no read needed.
        restarted = [n for n in failed_here if self._restarted(n, asked)]
        # A Node read again lately with nothing new is not read at every decision (with
        # one virtual node down, each pod's filter waited on a read of it): every 5 s, or
        # every second for a pod it failed before, which, tried again, may follow the
        # Node's change that told of a restart. A restart within a second of the last
        # read is found by a pod's try after that second, or once the watch tells of it.
        failed = [
            n
            for n in failed_here
            if n not in restarted
            and now - self._read_again_at.get(n, -READ_AGAIN_INTERVAL)
            >= (
                READ_AGAIN_FOR_RETRY_INTERVAL
                if args.uid in self._failed_pods.get(n, ())
                else READ_AGAIN_INTERVAL
            )
        ]
        for name in failed_here:
            self._failed_pods.setdefault(name, set()).add(args.uid)
        if not failed and not restarted:
            return {}
        if self.clock() - began + LOOKUP_TIMEOUT + self.estimator_timeout > FILTER_BUDGET:
            log.info("%s: no time left to ask again %s", args.pod_key, ", ".join(failed_here))
            return {}
        if failed:
            for name, node in zip(failed, await self._read_nodes(failed), strict=True):
                if isinstance(node, BaseException):
                    log.warning("%s: not read again (%s)", name, node)
                elif self._restarted(name, asked):
                    restarted.append(name)
                else:
                    # From the read's end: with the apiserver slow to answer, counted
                    # from its start, every pod tried again waited on a read.
                    self._read_again_at[name] = self.clock()
        for name in restarted:
            self._read_again_at.pop(name, None)
            self._failed_pods.pop(name, None)
        if not restarted:
            return {}
        return await self._estimate(restarted, pod, args.pod_key, reserve=True)

    def _restarted(self, name: str, asked: Mapping[str, tuple[str, str] | None]) -> bool:
        """Whether the pool names another estimator for ``name`` than the one asked."""
        current = self.pool.estimator_of(name)
        return current is not None and current != asked.get(name)

    async def prioritize(self, args: ExtenderArgs) -> list[JSON]:
        known = self.decisions.estimates(args.uid, self.clock())
        missing = [n for n in args.node_names if self.pool.is_virtual(n) and n not in known]
        if missing:
            # Filter's answers are gone (a restart, or too long ago): ask again, holding
            # nothing this time since the choice is about to be made.
            answers = await self._estimate(
                missing, orjson.dumps(args.pod), args.pod_key, reserve=False
            )
            known |= {n: a for n, a in answers.items() if isinstance(a, PodEstimate)}
        self.metrics.decisions.labels("prioritize").inc()
        ordinary = [n for n in args.node_names if not self.pool.is_virtual(n)]
        return scores(args.node_names, known, self.score, ordinary)

    async def bind(self, args: BindingArgs) -> JSON:
        self.metrics.decisions.labels("bind").inc()
        with self.metrics.bind_seconds.time():
            return await self._bind(args)

    async def _bind(self, args: BindingArgs) -> JSON:
        began = self.clock()
        pod = self.decisions.pod(args.pod_uid)
        reserved = self.decisions.take_reserved(args.pod_uid, self.clock())
        if pod and self.pool.is_virtual(args.node) and args.node not in reserved:
            # The scheduler chose a cluster filter kept no room on (one whose estimator
            # failed, let through by --on-estimator-error ignore): hold room there now, or
            # refuse, and the pod is tried again from filter. Bound without, it could take
            # room another pod was promised.
            refusal = await self._hold(args, pod)
            if refusal is not None:
                self.pool.release(reserved, args.pod_uid)
                return {"Error": refusal}
            reserved.add(args.node)
        try:
            async with asyncio.timeout(BIND_BUDGET - (self.clock() - began)):
                await self.binder(args)
        except Exception as error:
            # Whatever went wrong, the scheduler retries the pod from filter, which reserves
            # again: every room held now would only be in the way.
            self.metrics.bind_errors.inc()
            log.warning(
                "binding %s/%s to %s: %s", args.pod_namespace, args.pod_name, args.node, error
            )
            self.pool.release(reserved, args.pod_uid)
            return {
                "Error": f"binding pod {args.pod_namespace}/{args.pod_name} to {args.node}: {error}"
            }
        # The chosen estimator keeps its room until the lower pod lands.
        self.pool.release(reserved - {args.node}, args.pod_uid)
        return {"Error": ""}

    def stopped_waiting(self, pod: JSON) -> None:
        """The pod left the scheduler's queue: bound, or deleted. The scheduler binds, so
        nothing else tells the extender where a pod went; room filter kept on a virtual node
        for a pod the scheduler then put on an ordinary node (or one deleted while it
        waited) would otherwise turn the next pods away from that cluster until it lapses."""
        uid = str(pod["metadata"]["uid"])
        for failed in self._failed_pods.values():
            failed.discard(uid)
        reserved = self.decisions.left_queue(uid, self.clock())
        if reserved:
            self._give_back_later(pod, reserved)

    def _give_back_later(self, pod: JSON, reserved: set[str]) -> None:
        # The watch that said the pod left the queue sends it as it was while waiting:
        # where it went, or whether it is gone, takes a read.
        metadata = pod["metadata"]
        namespace, name = str(metadata.get("namespace", "")), str(metadata["name"])
        self._giving_back.spawn(self._give_back(namespace, name, str(metadata["uid"]), reserved))

    async def _give_back(self, namespace: str, name: str, uid: str, reserved: set[str]) -> None:
        try:
            now = await self.lookup(PODS, namespace, name)
        except API_ERRORS as error:
            log.warning(
                "pod %s/%s: not read (%s); the room kept for it lapses on its own",
                namespace,
                name,
                error,
            )
            return
        released = room_to_give_back(reserved, uid, now)
        if released:
            self.metrics.room_given_back.inc(len(released))
            self.pool.release(released, uid)

    async def stop(self) -> None:
        await self._giving_back.cancel()

    async def _hold(self, args: BindingArgs, pod: bytes) -> str | None:
        key = f"{args.pod_namespace}/{args.pod_name}"
        answer = (await self._estimate([args.node], pod, key, reserve=True))[args.node]
        if isinstance(answer, PodEstimate) and answer.reserved_node:
            return None
        if isinstance(answer, EstimatorFailure) and answer.maybe_reserved:
            self.pool.release([args.node], args.pod_uid)
        why = (
            answer.message
            if isinstance(answer, EstimatorFailure)
            else answer.error or (answer.message)
        )
        return f"no room left for pod {key} on {args.node}: {why}"


@dataclass(frozen=True)
class Callers:
    """Who may call the scheduler's verbs: /bind binds any pod to any node with this
    process's rights, and /filter holds room in the lower clusters. A caller shows a
    client certificate the --client-ca-file CA signed (the TLS handshake checks that
    much) naming, when ``names`` are given, one of them: a CA that signs for others too
    (the cluster's own) must not let all of them in."""

    names: frozenset[str] = frozenset()

    def refusal(self, peercert: Mapping[str, Any] | None) -> str | None:
        """Why a caller with this certificate (None: none shown) is refused; None when
        it is let in."""
        if not peercert:
            return (
                "no client certificate: the scheduler's verbs are for the upper "
                "kube-scheduler (its extender tlsConfig certFile and keyFile)"
            )
        name, _organizations = certificate_subject(peercert)
        if self.names and name not in self.names:
            return f"client certificate of {name or 'no common name'!r}: not a --client-name"
        return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(extender: Extender, callers: Callers) -> web.Application:
    def scheduler_verb(handler: Handler) -> Handler:
        async def checked(request: web.Request) -> web.StreamResponse:
            transport = request.transport
            refusal = callers.refusal(
                transport.get_extra_info("peercert") if transport is not None else None
            )
            if refusal is not None:
                # The scheduler logs the status alone: the reason is told here.
                log.warning("refused %s from %s: %s", request.path, request.remote, refusal)
                return web.json_response({"Error": refusal}, status=403)
            return await handler(request)

        return checked

    async def filter_(request: web.Request) -> web.Response:
        try:
            args = parse_extender_args(await request.read())
        except BadRequest as error:
            return _bad_request(error)
        return _json(await extender.filter(args))

    async def prioritize(request: web.Request) -> web.Response:
        try:
            args = parse_extender_args(await request.read())
        except BadRequest as error:
            return _bad_request(error)
        return _json(await extender.prioritize(args))

    async def bind(request: web.Request) -> web.Response:
        try:
            args = parse_binding_args(await request.read())
        except BadRequest as error:
            return _bad_request(error)
        return _json(await extender.bind(args))

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(
            text=extender.metrics.prometheus_text(),
            content_type="text/plain",
            charset="utf-8",
        )

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/filter", scheduler_verb(filter_))
    app.router.add_post("/prioritize", scheduler_verb(prioritize))
    app.router.add_post("/bind", scheduler_verb(bind))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


def _json(body: JSON | list[JSON]) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def _bad_request(error: BadRequest) -> web.Response:
    log.info("bad request: %s", error)
    return web.json_response({"Error": str(error)}, status=400)
