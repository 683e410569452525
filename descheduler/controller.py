"""The descheduler's loop: every ``interval``, the stuck pods of the watch caches, the
estimators of the other clusters asked about each, and the moves carried out (or, in a
dry run, printed); then the pods waiting above for a node no cluster has, and the plans
that make room for them. Level-triggered: a cycle judges the pods as they are, so a move
cut short by a crash or an error is taken up again by the next one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from descheduler.defrag import (
    MAX_PLANS,
    Plan,
    Waiting,
    admitting,
    budgets_allow,
    candidate_plans,
    defragmented_record,
    movable_pods,
    outside_slices,
    planned_again_at,
    taking_from_budgets,
    waiting_pods,
)
from descheduler.policy import Limits, Policy
from descheduler.rescue import (
    JOB,
    STATEFUL_SET,
    Move,
    Stay,
    Stuck,
    controller_kind,
    copy_alive,
    copy_landed,
    copy_name,
    copy_refused,
    copy_taken,
    destination,
    down_for,
    is_copy_of,
    job_lost_by_eviction,
    kept_for_its_controller,
    kept_off_for_nothing,
    kept_off_reasons,
    lapsed_keep_off,
    left_until_text,
    pod_copy,
    runs,
    stuck_pods,
    unfinished_moves,
    within_limits,
)
from kubekit import keys, metrics
from kubekit.client import (
    API_ERRORS,
    CONFIGMAPS,
    JOBS,
    PODS,
    ApiError,
    KubeClient,
    is_not_found,
)
from kubekit.estimatorapi.estimator_pb2 import (
    DefragmentRequest,
    DefragmentResponse,
    FitInTurnRequest,
    FitInTurnResponse,
    HoldRequest,
    PodEstimate,
    PodQuery,
)
from kubekit.informer import FunctionHandler, Informer, object_key
from kubekit.moves import controller_reference, controller_uid, parse_moves, record_move
from kubekit.podevents import record_pod_event
from multischeduler.estimators import EstimatorPool
from multischeduler.extender import EstimatorFailure

log = logging.getLogger("descheduler")

SOURCE = {"component": "kubestrata-descheduler"}
ESTIMATOR_TIMEOUT = 2.0
# After the Eviction API refused (a PodDisruptionBudget, 429), the pod is tried again
# after this long.
BLOCKED_RETRY_SECONDS = 30.0
# Writes of the moves ConfigMap lost to a concurrent one, before the move waits a cycle.
RECORD_ATTEMPTS = 5
# A pod no cluster can take is said so again after this long, not every cycle.
STAY_EVENT_SECONDS = 600.0

JSON = dict[str, Any]


class EvictionBlocked(Exception):
    """The Eviction API refused (429): a PodDisruptionBudget allows no disruption now."""


class PodChanged(Exception):
    """The pod was not evicted (409): it changed since it was judged, or another of the
    same name took its place; it still holds its room."""


# What stops a defragmentation plan half way: a refusal, a pod changed since the plan, or
# any other failed eviction.
_EVICTION_FAILURES: tuple[type[Exception], ...] = (EvictionBlocked, PodChanged, *API_ERRORS)


def receivers(
    virtual_nodes: Mapping[str, Mapping[str, Any]], now: datetime, leaving: str
) -> list[str]:
    """The virtual nodes a pod may move to: Ready, not cordoned, not the one it leaves."""
    return sorted(
        name
        for name, node in virtual_nodes.items()
        if name != leaving
        and down_for(node, now) is None
        and not (node.get("spec") or {}).get("unschedulable")
    )


class Descheduler:
    def __init__(
        self,
        client: KubeClient,
        pods: Informer,
        nodes: Informer,
        budgets: Informer,
        namespaces: Informer,
        pool: EstimatorPool,
        policy: Policy,
        dry_run: bool = False,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.pods = pods
        self.nodes = nodes
        self.budgets = budgets
        self.namespaces = namespaces
        self.pool = pool
        self.policy = policy
        self.dry_run = dry_run
        self.now = now
        self.clock = clock
        # UID -> when to try a blocked eviction again.
        self._blocked: dict[str, float] = {}
        # UID -> (what was said about a pod that stays, when).
        self._said: dict[str, tuple[str, float]] = {}
        # UID of a waiting pod -> until when the room made for it is held, and by which
        # virtual node (not planned for again meanwhile).
        self._holding: dict[str, tuple[float, str]] = {}
        # The pods evicted this cycle (planned, in a dry run): the cached budgets and pods
        # may not show them yet (``taking_from_budgets``), and a second plan judged on the
        # cache alone could ask a budget for more than it allows and be refused half way,
        # its first evictions made for nothing.
        self._evicted_now: list[Mapping[str, Any]] = []
        # Virtual node -> the pods sent there this cycle that its estimator does not
        # count yet: a controller's pods moved there (their replacements not made yet; a
        # bare pod's copy is bound there, which the estimator counts), and those a plan's
        # check counted on finding room there. The next check asks room for them first.
        self._landing_now: dict[str, list[Mapping[str, Any]]] = {}
        # The UIDs of the refused copies deleted, while the cache may show them yet: the
        # original is copied afresh, under the same name, at once.
        self._withdrawn: set[str] = set()
        pods.add_handler(FunctionHandler(update=self._pod_changed, delete=self._give_back))

    async def wait_synced(self) -> None:
        await asyncio.gather(
            self.pods.wait_synced(),
            self.nodes.wait_synced(),
            self.budgets.wait_synced(),
            self.namespaces.wait_synced(),
        )

    async def run(self) -> None:
        await self.wait_synced()
        while True:
            try:
                await self.cycle()
            except API_ERRORS as error:
                log.warning("cycle cut short: %s", error)
            await asyncio.sleep(self.policy.interval)

    def _virtual_nodes(self) -> dict[str, JSON]:
        return {node["metadata"]["name"]: node for node in self.nodes.items()}

    async def cycle(self) -> list[Move | Stay | Plan]:
        """One look at every pod; returns what was decided for each stuck one, and the
        plans carried out for waiting ones."""
        now, virtual_nodes = self.now(), self._virtual_nodes()
        moment = self.clock()
        self._evicted_now = []
        self._landing_now = {}
        # Read once: the cache decodes each pod on every read.
        pods = list(self.pods.items())
        all_stuck = stuck_pods(pods, virtual_nodes, now, self.policy)
        stuck = [s for s in all_stuck if self._blocked.get(s.uid, 0.0) <= moment]
        stuck = await self._withdraw_untaken_copies(stuck, pods)
        stuck = await self._withdraw_refused_copies(stuck)
        # A bare pod whose copy an earlier try made (cut short before the original went)
        # only has its original left to delete: asking the estimators again would find
        # the room taken, by that very copy.
        copied = {s.uid: copy for s in stuck if (copy := self._copy_made(s)) is not None}
        decisions: list[Move | Stay] = [
            Move(s, str(copied[s.uid]["spec"].get("nodeName", "")))
            for s in stuck
            if s.uid in copied
        ]
        # Pods their moves would lose, or leave with nothing made again for them.
        kept = await self._jobs_losing([s for s in stuck if s.uid not in copied])
        for case in stuck:
            if controller_kind(case.pod) == STATEFUL_SET and (why := kept_for_its_controller(case)):
                kept[case.uid] = why
        decisions += await asyncio.gather(
            *(
                self._destination(
                    s,
                    admitting(s.pod, virtual_nodes, receivers(virtual_nodes, now, s.node)),
                    virtual_nodes,
                    now,
                    kept.get(s.uid),
                )
                for s in stuck
                if s.uid not in copied
            )
        )
        moves = [d for d in decisions if isinstance(d, Move)]
        for stay in (d for d in decisions if isinstance(d, Stay)):
            await self._stay(stay)
        moves, crowded = await self._room_for_all(moves, set(copied))
        for move in crowded:
            log.info("%s: %s has no room for it too this cycle", move.stuck.key, move.to)
        limits = Limits(self.policy)
        allowed, deferred = within_limits(moves, limits)
        for move in deferred:
            log.info("%s: move to %s left for a later cycle (limits)", move.stuck.key, move.to)
        for move in allowed:
            try:
                await self._move(move)
            except API_ERRORS as error:
                await self._move_failed(move.stuck, error)
            else:
                if move.stuck.owned:
                    self._landing_now.setdefault(move.to, []).append(move.stuck.pod)
        # Stuck pods waiting out a failed try are still stuck: their copies are theirs. A
        # pod of a cluster down keeps the Running phase it had: not one that runs again.
        handled = {s.uid for s in all_stuck}
        ready_nodes = {n for n, node in virtual_nodes.items() if down_for(node, now) is None}
        for original, copy in unfinished_moves(pods):
            if str(original["metadata"]["uid"]) in handled:
                continue
            try:
                if copy_landed(copy):
                    await self._finish_move(original, copy)
                elif runs(original) and str(original["spec"].get("nodeName")) in ready_nodes:
                    await self._withdraw_copy_of_running(original, copy)
                # else both wait: the original stuck again moves on to its copy.
            except API_ERRORS as error:
                log.warning("%s: move not finished: %s", object_key(original), error)
        made_again = await self._let_go_of_lapsed_keep_offs(
            [p for p in pods if not self._room_being_made(p, now, moment)], now
        )
        waiting = [
            w
            for w in waiting_pods(pods, now, self.policy)
            if not self._held(w.uid, moment) and w.uid not in made_again
        ]
        plans: list[Plan] = []
        for each in waiting:
            # One plan a cycle in a cluster: its estimator does not know yet of the room
            # the first plan's evicted pods will take again on its other nodes, and would
            # give it to a second plan.
            planned = {p.cluster for p in plans}
            admitted = admitting(each.pod, virtual_nodes, receivers(virtual_nodes, now, ""))
            outside = self._outside_slices(each.pod, virtual_nodes, admitted)
            names = [name for name in admitted if name not in planned and name not in outside]
            if not names:
                continue  # next cycle
            plan = await self._defragment(each, names, limits, virtual_nodes, now)
            if plan is not None:
                plans.append(plan)
        # A pod waiting out a failed move is said about again only when that changes.
        live = {s.uid for s in stuck} | {w.uid for w in waiting} | set(self._blocked)
        self._said = {uid: said for uid, said in self._said.items() if uid in live}
        self._blocked = {uid: t for uid, t in self._blocked.items() if t > moment}
        cached = {str(pod["metadata"].get("uid")) for pod in pods}
        self._withdrawn &= cached
        self._holding = {uid: h for uid, h in self._holding.items() if h[0] > moment}
        return [*decisions, *plans]

    def _copy_made(self, stuck: Stuck) -> JSON | None:
        if stuck.owned:
            return None
        made = self.pods.get(f"{stuck.namespace}/{copy_name(stuck.pod)}")
        if made is None or str(made["metadata"].get("uid")) in self._withdrawn:
            return None
        return made if is_copy_of(made, stuck.pod) else None

    def _outside_slices(
        self,
        pod: Mapping[str, Any],
        virtual_nodes: Mapping[str, Mapping[str, Any]],
        names: list[str],
    ) -> dict[str, str]:
        namespace = self.namespaces.get(str(pod["metadata"].get("namespace", ""))) or {}
        annotations = namespace.get("metadata", {}).get("annotations") or {}
        return outside_slices(
            pod, virtual_nodes, names, annotations.get(keys.SLICE_APPLIED_ANNOTATION)
        )

    async def _destination(
        self,
        stuck: Stuck,
        names: list[str],
        virtual_nodes: Mapping[str, Mapping[str, Any]],
        now: datetime,
        lost: str | None,
    ) -> Move | Stay:
        """Where the pod goes among the virtual nodes ``names``: of those a bare pod's
        copies are not kept off and whose cluster holds some of its namespace's slices,
        the one the estimators rank first."""
        if lost is not None:
            return Stay(stuck, lost)
        found: dict[str, PodEstimate | str] = {
            **kept_off_reasons(stuck.pod, names, now),
            **self._outside_slices(stuck.pod, virtual_nodes, names),
        }
        names = [name for name in names if name not in found]
        if names:
            query = PodQuery(pod=orjson.dumps(stuck.pod))
            answers = await self.pool.estimate(names, query, ESTIMATOR_TIMEOUT)
            for name, answer in answers.items():
                found[name] = answer if isinstance(answer, PodEstimate) else answer_text(answer)
        return destination(stuck, found)

    async def _jobs_losing(self, stuck: list[Stuck]) -> dict[str, str]:
        """Of the stuck pods of Jobs, those whose eviction would lose them (the Job
        would fail, or the pod's index, rather than make the pod again) or leave nothing
        made again for them (``kept_for_its_controller``), by UID, and
        why. In key order, each pod let go counts as one failure more for the next pod of
        its Job. Jobs are read afresh: their failures change between cycles, and only
        their stuck pods need them."""
        losing: dict[str, str] = {}
        jobs: dict[tuple[str, str], JSON | str] = {}
        let_go: Counter[tuple[str, str]] = Counter()
        for each in stuck:
            if controller_kind(each.pod) != JOB:
                continue
            reference = controller_reference(each.pod) or {}
            key = (each.namespace, str(reference.get("name", "")))
            if key not in jobs:
                try:
                    jobs[key] = await self.client.get(JOBS, key[1], key[0])
                except API_ERRORS as error:
                    jobs[key] = f"its Job could not be read: {error}"
            job = jobs[key]
            if isinstance(job, str):
                losing[each.uid] = job
            elif (job.get("metadata") or {}).get("uid") != reference.get("uid"):
                losing[each.uid] = "its Job is gone"
            elif why := kept_for_its_controller(each, job) or job_lost_by_eviction(
                job, each.pod, let_go[key]
            ):
                losing[each.uid] = why
            else:
                let_go[key] += 1
        return losing

    async def _room_for_all(
        self, moves: list[Move], copied: set[str]
    ) -> tuple[list[Move], list[Move]]:
        """The moves whose cluster has room for every bare pod sent there this cycle, and
        those left for a later cycle. Each estimate counted the same free room, and a
        bare pod's copy is bound to the cluster by us, so two copies could be sent where
        one fits (the extra would wait there and be moved again). Next cycle the
        estimators count the copies made meanwhile. A controller's pods go through the
        scheduler, which places them one by one."""
        sent: dict[str, list[Move]] = {}
        for move in moves:
            if not move.stuck.owned and move.stuck.uid not in copied:
                sent.setdefault(move.to, []).append(move)
        crowded: list[Move] = []
        for name, group in sent.items():
            if len(group) < 2:
                continue
            request = FitInTurnRequest(pods=[orjson.dumps(move.stuck.pod) for move in group])
            answer = await self.pool.fit_in_turn(name, request, ESTIMATOR_TIMEOUT)
            if isinstance(answer, FitInTurnResponse) and len(answer.nodes) == len(group):
                crowded += [
                    move for move, node in zip(group, answer.nodes, strict=True) if not node
                ]
            else:
                crowded += group[1:]  # its estimate promised room for one
        left = {move.stuck.uid for move in crowded}
        return [move for move in moves if move.stuck.uid not in left], crowded

    async def _stay(self, stay: Stay) -> None:
        stuck = stay.stuck
        message = f"{stuck.describe()}; left where it is: {stay.message}"
        await self._say_once(
            stuck.pod, "NotRescheduled", message, f"{stuck.why} {stuck.node}: {stay.message}"
        )

    async def _say_once(
        self, pod: Mapping[str, Any], reason: str, message: str, gist: str | None = None
    ) -> None:
        """A warning about a pod left as it is, said again only when its ``gist`` (the
        message but for how long it has waited, which grows every cycle) changes or after
        a while, not every cycle."""
        uid = str(pod["metadata"]["uid"])
        said = self._said.get(uid)
        moment = self.clock()
        gist = message if gist is None else gist
        if said is not None and said[0] == gist and moment - said[1] < STAY_EVENT_SECONDS:
            return
        self._said[uid] = (gist, moment)
        log.info("%s: %s", object_key(pod), message)
        if not self.dry_run:
            await self._event(pod, reason, message, warning=True)

    async def _move(self, move: Move) -> None:
        stuck = move.stuck
        how = (
            f"evict (its controller replaces it; {move.to} can run it)"
            if stuck.owned
            else f"re-create as {copy_name(stuck.pod)} on {move.to}"
        )
        plan = f"{stuck.describe()}; {how}"
        if self.dry_run:
            print(f"dry run: {stuck.key}: {plan}", flush=True)
            return
        log.info("%s: %s", stuck.key, plan)
        if stuck.owned:
            await self._evict_stuck(move)
        else:
            await self._copy(move)

    async def _move_failed(self, stuck: Stuck, error: Exception) -> None:
        """One pod the apiserver will not let move (a quota full for its copy, a spec
        refused on create, a 5xx) waits and says why; the other pods of the cycle move."""
        self._blocked[stuck.uid] = self.clock() + BLOCKED_RETRY_SECONDS
        log.warning("%s: move failed, tried again later: %s", stuck.key, error)
        await self._say_once(
            stuck.pod,
            "NotRescheduled",
            f"stuck in {stuck.node}, and the move failed (tried again every "
            f"{BLOCKED_RETRY_SECONDS:.0f} s): {error}",
        )

    async def _evict(self, pod: Mapping[str, Any], reason: str) -> bool:
        """Evicts a pod through the Eviction API; False when it was gone. Raises PodChanged
        when it was replaced or changed meanwhile (409), EvictionBlocked on a 429.
        ``reason`` labels the metric."""
        metadata = pod["metadata"]
        # The pod as it was judged, or none: the cache may be seconds behind by the last
        # move of a look, and a pod placed below meanwhile (a node added there) was
        # evicted all the same. Changed, it is a 409, judged again at the next look.
        preconditions = {"uid": metadata["uid"]}
        if metadata.get("resourceVersion"):
            preconditions["resourceVersion"] = metadata["resourceVersion"]
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": metadata["name"], "namespace": metadata["namespace"]},
            "deleteOptions": {"preconditions": preconditions},
        }
        path = PODS.path(metadata["namespace"], metadata["name"], "eviction")
        try:
            # A refusal's 429 is tried again here, after BLOCKED_RETRY_SECONDS, not
            # waited out by the client while the cycle's other moves wait behind it.
            await self.client.request("POST", path, body=body, retry_when_told=False)
        except ApiError as error:
            metrics.EVICTIONS.labels(reason, error.reason or str(error.status)).inc()
            if error.status == 404:
                return False
            if error.status == 409:
                raise PodChanged(error.message) from error
            if error.status == 429:
                raise EvictionBlocked(error.message) from error
            raise
        metrics.EVICTIONS.labels(reason, "Evicted").inc()
        self._evicted_now.append(pod)
        return True

    def _held(self, uid: str, moment: float) -> bool:
        """Whether room made for the pod is held for it still."""
        return self._holding.get(uid, (0.0, ""))[0] > moment

    def _room_being_made(self, pod: Mapping[str, Any], now: datetime, moment: float) -> bool:
        """Whether a plan makes room for the pod: held here, or recorded on the pod by a
        plan (a former leader's, maybe) whose wait has not ended. Evicted, the plan's
        evictions were made for nothing."""
        if self._held(str(pod["metadata"]["uid"]), moment):
            return True
        again = planned_again_at(pod, self.policy)
        return again is not None and now < again

    async def _let_go_of_lapsed_keep_offs(self, pods: list[JSON], now: datetime) -> set[str]:
        """Evicts the waiting pods kept off virtual nodes by lapsed move records
        (``kept_off_for_nothing``) for their controllers to make them again; returns their
        UIDs. The moves are read only when some pod is kept off anywhere."""
        # Kept off by the webhook at all (no record read yet: every keep-off lapsed).
        candidates = [pod for pod, _ in kept_off_for_nothing(pods, {}, now, self.policy)]
        if not candidates:
            return set()
        try:
            stored = await self.client.get(CONFIGMAPS, keys.MOVES_CONFIGMAP, keys.SYSTEM_NAMESPACE)
            moves = parse_moves(stored.get("data") or {})
        except ApiError as error:
            if not is_not_found(error):
                log.warning("moves not read, no keep-off let go of this cycle: %s", error)
                return set()
            moves = {}
        except API_ERRORS as error:
            log.warning("moves not read, no keep-off let go of this cycle: %s", error)
            return set()
        made_again: set[str] = set()
        for pod in candidates:
            if not (nodes := lapsed_keep_off(pod, moves, now)):
                continue
            names = ", ".join(sorted(nodes))
            if self.dry_run:
                print(
                    f"dry run: {object_key(pod)}: evict, kept off {names} for nothing", flush=True
                )
                continue
            try:
                if not await self._evict(pod, "keep-off-lapsed"):
                    continue
            except (PodChanged, EvictionBlocked) as error:
                log.info("%s: not evicted, judged again next cycle: %s", object_key(pod), error)
                continue
            except API_ERRORS as error:
                log.warning("%s: not evicted: %s", object_key(pod), error)
                continue
            made_again.add(str(pod["metadata"]["uid"]))
            await self._event(
                pod,
                "Rescheduled",
                f"kept off {names} by a move whose record has lapsed, and no node found "
                "elsewhere: evicted for its controller to make it again without that",
            )
        return made_again

    async def _record_move(self, stuck: Stuck) -> None:
        """Records in the moves ConfigMap that the pod's controller's new pods stay off
        the virtual node it leaves (created on first use; a write that lost a race is
        made again on what won, a few times)."""
        owner = controller_uid(stuck.pod)
        assert owner is not None, "only a controller's pod is evicted"
        now = self.now()
        until = now + timedelta(seconds=self.policy.return_after)
        await self.client.update_configmap_data(
            keys.SYSTEM_NAMESPACE,
            keys.MOVES_CONFIGMAP,
            lambda data: record_move(parse_moves(data), owner, stuck.node, until, now),
            RECORD_ATTEMPTS,
        )

    async def _evict_stuck(self, move: Move) -> None:
        stuck = move.stuck
        try:
            await self._record_move(stuck)
        except API_ERRORS as error:
            # Evicted unrecorded, its replacement could be bound to the same cluster.
            log.warning("%s: move not recorded, not evicted this cycle: %s", stuck.key, error)
            return
        try:
            if not await self._evict(stuck.pod, "stuck"):
                return  # nothing left to move
        except PodChanged as changed:
            log.info("%s: changed since judged, judged again next cycle: %s", stuck.key, changed)
            return
        except EvictionBlocked as blocked:
            self._blocked[stuck.uid] = self.clock() + BLOCKED_RETRY_SECONDS
            log.info("%s: eviction refused, tried again later: %s", stuck.key, blocked)
            # Said once while it stays so: every 30 s for every pod a budget holds on a
            # cluster down was thousands of events a minute.
            refused = f"the eviction was refused, tried again in {BLOCKED_RETRY_SECONDS:.0f} s"
            await self._say_once(
                stuck.pod,
                "EvictionBlocked",
                f"{stuck.describe()}; {refused}: {blocked}",
                gist=f"{refused}: {blocked}",
            )
            return
        await self._event(
            stuck.pod,
            "Rescheduled",
            f"{stuck.describe()}; evicted from {stuck.node} for its controller to replace "
            f"({move.to} can run it)",
        )

    async def _withdraw_untaken_copies(self, stuck: list[Stuck], pods: list[JSON]) -> list[Stuck]:
        """Deletes the stuck copies their cluster never took whose original is still
        there, and returns the other stuck pods. Moved in turn, such a copy got a copy of
        its own, and its original, neither deleted (its copy never taken) nor copied
        again (that copy going), ran beside the copy's copy once its cluster was back.
        The original, stuck still, is copied afresh at a later look."""
        live = {
            str(pod["metadata"].get("uid")): pod
            for pod in pods
            if not pod["metadata"].get("deletionTimestamp")
        }
        left = []
        for case in stuck:
            annotations = case.pod["metadata"].get("annotations") or {}
            original = live.get(str(annotations.get(keys.COPY_OF_ANNOTATION)))
            if original is None or copy_taken(case.pod):
                left.append(case)
                continue
            if self.dry_run:
                print(f"dry run: {case.key}: delete, a copy {case.node} never took", flush=True)
                continue
            log.info("%s: a copy %s never took, %s; deleted", case.key, case.node, case.describe())
            try:
                await self._keep_off(original, case.node)
                # At once, as never taken: deleted gracefully from a cluster down, it
                # stayed Terminating until that cluster was back, and its name, the next
                # copy's, held every new copy back meanwhile.
                await self.client.delete_exact(PODS, case.pod, grace_period_seconds=0)
            except API_ERRORS as error:
                log.warning("%s: untaken copy not deleted: %s", case.key, error)
        return left

    async def _withdraw_refused_copies(self, stuck: list[Stuck]) -> list[Stuck]:
        """Deletes the copies their virtual node refused (``copy_refused``), each
        original first kept off that cluster for ``returnAfter``; returns the stuck pods,
        those originals as patched, to be copied elsewhere in this cycle. Until 2026-11-29
        such a copy stopped the move for good, while another cluster could run the pod;
        and a pod of a cluster down, moved just before the taint manager deletes it, has
        no later cycle to wait for."""
        left = []
        for case in stuck:
            copy = self._copy_made(case)
            if copy is None or not copy_refused(copy):
                left.append(case)
                continue
            node, name = str(copy["spec"].get("nodeName", "")), copy["metadata"]["name"]
            why = f"its copy {name} was refused by {node}{_said_why(copy)}"
            if self.dry_run:
                print(f"dry run: {case.key}: delete {name}; {why}", flush=True)
                continue
            try:
                original = await self._keep_off(case.pod, node)
                await self.client.delete_exact(PODS, copy)
            except API_ERRORS as error:
                log.warning("%s: refused copy not withdrawn: %s", case.key, error)
                continue
            self._withdrawn.add(str(copy["metadata"]["uid"]))
            log.info("%s: %s; deleted", case.key, why)
            await self._event(
                original,
                "NotRescheduled",
                f"{case.describe()}; {why}: deleted; the pod is copied to another cluster "
                f"that can run it, not to {node} for {self.policy.return_after:.0f} s",
                warning=True,
            )
            left.append(replace(case, pod=original))
        return left

    async def _keep_off(self, original: Mapping[str, Any], node: str) -> JSON:
        """Keeps the original's next copy off the virtual node that never took this one
        for ``returnAfter``: a cluster refusing it (a policy below the estimators do not
        model) ranked first again, and it was copied there at every other look."""
        metadata = original["metadata"]
        text = left_until_text(original, node, self.now(), self.policy.return_after)
        # The uid makes the patch fail on a namesake made since (it is immutable); the
        # resourceVersion on a pod the cache shows behind an earlier keep-off, which the
        # whole annotation written from it would take back.
        written: JSON = {"uid": metadata["uid"], "annotations": {keys.LEFT_UNTIL_ANNOTATION: text}}
        if metadata.get("resourceVersion"):
            written["resourceVersion"] = metadata["resourceVersion"]
        patch = {"metadata": written}
        return await self.client.patch(PODS, metadata["name"], patch, metadata["namespace"])

    async def _withdraw_copy_of_running(self, original: JSON, copy: JSON) -> None:
        """Deletes the copy of a bare pod that runs again where it is (its cluster back,
        room freed) while no node below has admitted the copy (its lower scheduler found
        none): until 2026-11-29 the running original was deleted for it, and the pod ran
        nowhere until the copy found room."""
        name, node = copy["metadata"]["name"], copy["spec"].get("nodeName")
        why = f"it runs again; its copy {name} found no node in {node} yet"
        if self.dry_run:
            print(f"dry run: {object_key(original)}: delete {name}; {why}", flush=True)
            return
        log.info("%s: %s; the copy is deleted", object_key(original), why)
        await self.client.delete_exact(PODS, copy, grace_period_seconds=0)
        self._withdrawn.add(str(copy["metadata"]["uid"]))
        await self._event(original, "NotRescheduled", f"{why}: deleted, the pod stays here")

    async def _finish_move(self, original: JSON, copy: JSON) -> None:
        where = f"pod {copy['metadata']['name']} on {copy['spec'].get('nodeName')}"
        if self.dry_run:
            print(f"dry run: {object_key(original)}: delete, its copy is {where}", flush=True)
            return
        log.info("%s: its copy is %s; deleting the original", object_key(original), where)
        if await self._delete_original(original):
            await self._event(
                original, "Rescheduled", f"re-created as {where}, which its cluster has taken"
            )

    async def _delete_original(self, original: Mapping[str, Any]) -> bool:
        """Deletes a bare pod whose copy has been taken, as the cache shows it; False when
        it changed since (409: it may run now, and is judged again at the next look)."""
        metadata = original["metadata"]
        try:
            await self.client.delete(
                PODS,
                metadata["name"],
                metadata["namespace"],
                uid=metadata["uid"],
                resource_version=metadata.get("resourceVersion"),
            )
        except ApiError as error:
            if error.status == 409:
                log.info("%s: changed since judged, not deleted", object_key(original))
                return False
            if error.status != 404:
                raise
        return True

    async def _copy(self, move: Move) -> None:
        stuck = move.stuck
        copy = pod_copy(stuck.pod, move.to, self.now(), self.policy.return_after)
        name, namespace = copy["metadata"]["name"], stuck.namespace
        made = self._copy_made(stuck)
        if made is None:
            try:
                made = await self.client.create(PODS, copy, namespace)
            except ApiError as error:
                if error.status != 409:
                    raise
                # A copy made by an earlier try, not yet in the cache.
                made = await self.client.get(PODS, name, namespace)
            else:
                await self._event(
                    made,
                    "Rescheduled",
                    f"copy of pod {stuck.key} ({stuck.describe()}); the original goes once "
                    f"{move.to} has taken it",
                )
        why = (
            f"pod {name} exists and is not its copy"
            if not is_copy_of(made, stuck.pod)
            else None
            if copy_alive(made)
            else f"its copy {name} has failed or is being deleted{_said_why(made)}"
        )
        if why is not None:
            # Said once while it stays so; the original is the one left running.
            self._blocked[stuck.uid] = self.clock() + BLOCKED_RETRY_SECONDS
            await self._say_once(
                stuck.pod, "NotRescheduled", f"stuck in {stuck.node}; not re-created: {why}"
            )
            return
        if not copy_taken(made):
            log.info("%s: its copy %s not yet taken by %s", stuck.key, name, move.to)
            return
        if await self._delete_original(stuck.pod):
            await self._event(
                stuck.pod,
                "Rescheduled",
                f"{stuck.describe()}; re-created as pod {name} on {made['spec'].get('nodeName')}",
            )

    # -- defragmentation ---------------------------------------------------------------------

    async def _defragment(
        self,
        waiting: Waiting,
        names: list[str],
        limits: Limits,
        virtual_nodes: Mapping[str, Mapping[str, Any]],
        now: datetime,
    ) -> Plan | None:
        """Makes room for a waiting pod if a complete plan exists; returns it."""
        pod_json = orjson.dumps(waiting.pod)
        answers = await self.pool.estimate(names, PodQuery(pod=pod_json), ESTIMATOR_TIMEOUT)
        if any(isinstance(a, PodEstimate) and a.max_replicas > 0 for a in answers.values()):
            return None  # a node fits it now: the scheduler's next try places it
        budgets = list(self.budgets.items())
        evicted = {p["metadata"]["uid"] for p in self._evicted_now}
        movable = movable_pods(
            (p for p in self.pods.items() if p["metadata"]["uid"] not in evicted),
            waiting,
            names,
            budgets,
        )
        most = min(self.policy.max_evictions_per_node, self.policy.max_evictions_per_cycle)
        asked = sorted(movable)
        responses = await asyncio.gather(
            *(
                self.pool.defragment(
                    name,
                    DefragmentRequest(
                        pod=pod_json,
                        movable_pod_uids=[str(p["metadata"]["uid"]) for p in movable[name]],
                        max_evictions=most,
                    ),
                    ESTIMATOR_TIMEOUT,
                )
                for name in asked
            )
        )
        plans = candidate_plans(
            waiting,
            {
                name: response
                for name, response in zip(asked, responses, strict=True)
                if isinstance(response, DefragmentResponse)
            },
            movable,
        )
        refusals = []
        for plan in plans:
            why = await self._incomplete(plan, budgets, limits, virtual_nodes, now)
            if why is None:
                await self._carry_out(plan)
                return plan
            refusals.append(f"{plan.cluster}/{plan.node}: {why}")
        failures = [
            f"{name}: {answer.message}"
            for name, answer in zip(asked, responses, strict=True)
            if isinstance(answer, EstimatorFailure)
        ]
        found = "; ".join(refusals + failures) or "no movable pods make room on any node"
        await self._say_once(
            waiting.pod,
            "NotDefragmented",
            f"no cluster has a node that fits it ({waiting.seconds:.0f} s), and no complete "
            f"plan makes room: {found}",
            found,
        )
        return None

    async def _incomplete(
        self,
        plan: Plan,
        budgets: list[JSON],
        limits: Limits,
        virtual_nodes: Mapping[str, Mapping[str, Any]],
        now: datetime,
    ) -> str | None:
        """Why a plan cannot be carried out in full now; None when it can (then its
        evictions are counted against this cycle's limits, and its homeless pods as
        landing where they found room)."""
        if not budgets_allow([*taking_from_budgets(self._evicted_now), *plan.evicted], budgets):
            return "its PodDisruptionBudgets do not allow all its evictions at once"
        # Each homeless pod by the clusters its own rules admit (not the waiting pod's).
        admitted = []
        for pod in plan.homeless:
            names = admitting(pod, virtual_nodes, receivers(virtual_nodes, now, plan.cluster))
            outside = self._outside_slices(pod, virtual_nodes, names)
            admitted.append((pod, [name for name in names if name not in outside]))
        left, landing = await self._rehome(admitted)
        if left:
            return f"no other cluster has room for {', '.join(left)}"
        evictions = [(str(pod["metadata"]["namespace"]), plan.cluster) for pod in plan.evicted]
        if not limits.take(evictions):
            return f"{len(evictions)} evictions are beyond this cycle's limits"
        for name, pods in landing.items():
            self._landing_now.setdefault(name, []).extend(pods)
        return None

    async def _rehome(
        self, admitted: list[tuple[Mapping[str, Any], list[str]]]
    ) -> tuple[list[str], dict[str, list[Mapping[str, Any]]]]:
        """Which of the pods the clusters their own rules admit cannot all take between
        them, each cluster asked in turn for what is left of the pods it admits, after
        the pods already landing there this cycle; and where the others land."""
        left = list(admitted)
        landing: dict[str, list[Mapping[str, Any]]] = {}
        for name in sorted({name for _, names in admitted for name in names}):
            asked = [pod for pod, names in left if name in names]
            if not asked:
                continue
            before = self._landing_now.get(name, [])
            request = FitInTurnRequest(pods=[orjson.dumps(pod) for pod in [*before, *asked]])
            answer = await self.pool.fit_in_turn(name, request, ESTIMATOR_TIMEOUT)
            if not isinstance(answer, FitInTurnResponse) or len(answer.nodes) != len(request.pods):
                continue
            if not all(answer.nodes[: len(before)]):
                continue  # the room it has is already promised
            placed = [
                pod for pod, node in zip(asked, answer.nodes[len(before) :], strict=True) if node
            ]
            landing[name] = placed
            left = [(pod, names) for pod, names in left if not any(pod is p for p in placed)]
        return [object_key(pod) for pod, _ in left], landing

    async def _carry_out(self, plan: Plan) -> None:
        waiting = plan.waiting
        if self.dry_run:
            print(f"dry run: {plan.describe()}", flush=True)
            self._evicted_now += plan.evicted
            return
        log.info("%s", plan.describe())
        hold = HoldRequest(
            pod=orjson.dumps(waiting.pod), node=plan.node, seconds=self.policy.hold_timeout
        )
        failure = await self.pool.hold(plan.cluster, hold, ESTIMATOR_TIMEOUT)
        if failure is not None:
            log.warning("%s: room not held, nothing evicted: %s", waiting.key, failure.message)
            return
        self._holding[waiting.uid] = (self.clock() + self.policy.hold_timeout, plan.cluster)
        # Recorded on the pod before any eviction, so that no plan for it comes again
        # too soon, from this process or the next leader.
        record = defragmented_record(waiting.pod, self.now())
        try:
            await self._record_plan(waiting, record)
        except API_ERRORS as error:
            log.warning("%s: plan not recorded, nothing evicted: %s", waiting.key, error)
            self._give_back(waiting.pod)
            return
        evicted = 0
        plans = json.loads(record)["plans"]
        await self._event(
            waiting.pod,
            "Defragmenting",
            f"no cluster has a node that fits it; {plan.describe()} (held for it "
            f"{self.policy.hold_timeout:.0f} s; plan {plans} of at most {MAX_PLANS} for it)",
        )
        for pod in plan.evicted:
            try:
                if not await self._evict(pod, "defragment"):
                    continue  # gone or replaced meanwhile: nobody was evicted
            except _EVICTION_FAILURES as error:
                what = (
                    "was refused"
                    if isinstance(error, EvictionBlocked)
                    else "was not made, the pod changed since the plan (it holds its room)"
                    if isinstance(error, PodChanged)
                    else "failed"
                )
                await self._event(
                    waiting.pod,
                    "DefragmentationIncomplete",
                    f"the eviction of {object_key(pod)} {what}: {error}",
                    warning=True,
                )
                # The waiting pod fits there no sooner for it; the pods evicted so far
                # may take their room again. (It is not planned for again until the
                # hold would have lapsed.)
                self.pool.release([plan.cluster], waiting.uid)
                if not evicted:
                    # Nobody evicted: no plan carried out, to count against its four.
                    previous = (waiting.pod["metadata"].get("annotations") or {}).get(
                        keys.DEFRAGMENTED_ANNOTATION
                    )
                    with contextlib.suppress(*API_ERRORS):
                        await self._record_plan(waiting, previous)
                return
            evicted += 1
            await self._event(
                pod,
                "Descheduled",
                f"evicted from {plan.cluster} (lower node {plan.node}) to make room for pod "
                f"{waiting.key}, which no node of any cluster fits; its controller replaces it",
            )

    async def _record_plan(self, waiting: Waiting, record: str | None) -> None:
        """Writes the waiting pod's record of the plans made for it (None: none)."""
        await self.client.patch(
            PODS,
            waiting.pod["metadata"]["name"],
            {"metadata": {"annotations": {keys.DEFRAGMENTED_ANNOTATION: record}}},
            waiting.namespace,
        )

    def _pod_changed(self, pod: JSON) -> None:
        node = pod["spec"].get("nodeName")
        uid = str(pod["metadata"].get("uid", ""))
        held = self._holding.get(uid)
        if not node or held is None:
            return
        if node == held[1]:
            del self._holding[uid]  # its room turns into the pod on its way down
        else:
            self._give_back(pod)

    def _give_back(self, pod: Mapping[str, Any]) -> None:
        """The room held for a waiting pod deleted, or bound to another node: nothing else
        would give it back before the hold lapsed (the estimator sees only the pods bound
        to its own node), and a lapse is no event for the scheduler."""
        uid = str(pod["metadata"].get("uid", ""))
        held = self._holding.pop(uid, None)
        if held is not None:
            self.pool.release([held[1]], uid)

    async def _event(
        self, pod: Mapping[str, Any], reason: str, message: str, warning: bool = False
    ) -> None:
        event_type = "Warning" if warning else "Normal"
        await record_pod_event(self.client, pod, event_type, reason, message, SOURCE)


def _said_why(pod: Mapping[str, Any]) -> str:
    """What a failed pod's status says of its end, in parentheses; "" when nothing."""
    status = pod.get("status") or {}
    words = ": ".join(str(status[k]) for k in ("reason", "message") if status.get(k))
    return f" ({words})" if words else ""


def answer_text(failure: EstimatorFailure) -> str:
    return f"estimator unavailable: {failure.message}"
