"""The descheduler's loop: every ``interval``, the stuck pods of the watch caches, the
estimators of the other clusters asked about each, and the moves carried out (or, in a
dry run, printed). Level-triggered: a cycle judges the pods as they are, so a move cut
short by a crash or an error is taken up again by the next one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import orjson

from descheduler.policy import Policy
from descheduler.rescue import (
    Move,
    Stay,
    Stuck,
    copy_name,
    destination,
    down_for,
    is_copy_of,
    pod_copy,
    stuck_pods,
    within_limits,
)
from kubekit.client import PODS, ApiError, KubeClient
from kubekit.estimatorapi.estimator_pb2 import PodEstimate, PodQuery
from kubekit.informer import Informer
from kubekit.podevents import record_pod_event
from multischeduler.estimators import EstimatorPool
from multischeduler.extender import EstimatorFailure

log = logging.getLogger("descheduler")

SOURCE = {"component": "kubestrata-descheduler"}
ESTIMATOR_TIMEOUT = 2.0
# After the Eviction API refused (a PodDisruptionBudget, 429), the pod is tried again
# after this long.
BLOCKED_RETRY_SECONDS = 30.0
# A pod no cluster can take is said so again after this long, not every cycle.
STAY_EVENT_SECONDS = 600.0

JSON = dict[str, Any]


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
        pool: EstimatorPool,
        policy: Policy,
        dry_run: bool = False,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.pods = pods
        self.nodes = nodes
        self.pool = pool
        self.policy = policy
        self.dry_run = dry_run
        self.now = now
        self.clock = clock
        # UID -> when to try a blocked eviction again.
        self._blocked: dict[str, float] = {}
        # UID -> (what was said about a pod that stays, when).
        self._said: dict[str, tuple[str, float]] = {}

    async def run(self) -> None:
        await asyncio.gather(self.pods.wait_synced(), self.nodes.wait_synced())
        while True:
            try:
                await self.cycle()
            except (ApiError, OSError) as error:
                log.warning("cycle cut short: %s", error)
            await asyncio.sleep(self.policy.interval)

    def _virtual_nodes(self) -> dict[str, JSON]:
        return {node["metadata"]["name"]: node for node in self.nodes.items()}

    async def cycle(self) -> list[Move | Stay]:
        """One look at every pod; returns what was decided for each stuck one."""
        now, virtual_nodes = self.now(), self._virtual_nodes()
        moment = self.clock()
        stuck = [
            s
            for s in stuck_pods(self.pods.items(), virtual_nodes, now, self.policy)
            if self._blocked.get(s.uid, 0.0) <= moment
        ]
        decisions = list(
            await asyncio.gather(
                *(self._destination(s, receivers(virtual_nodes, now, s.node)) for s in stuck)
            )
        )
        moves = [d for d in decisions if isinstance(d, Move)]
        for stay in (d for d in decisions if isinstance(d, Stay)):
            await self._stay(stay)
        allowed, deferred = within_limits(moves, self.policy)
        for move in deferred:
            log.info("%s: move to %s left for a later cycle (limits)", move.stuck.key, move.to)
        for move in allowed:
            await self._move(move)
        live = {s.uid for s in stuck}
        self._said = {uid: said for uid, said in self._said.items() if uid in live}
        self._blocked = {uid: t for uid, t in self._blocked.items() if t > moment}
        return decisions

    async def _destination(self, stuck: Stuck, names: list[str]) -> Move | Stay:
        if not names:
            return destination(stuck, {})
        query = PodQuery(pod=orjson.dumps(stuck.pod))
        answers = await self.pool.estimate(names, query, ESTIMATOR_TIMEOUT)
        return destination(
            stuck,
            {
                name: answer if isinstance(answer, PodEstimate) else answer_text(answer)
                for name, answer in answers.items()
            },
        )

    async def _stay(self, stay: Stay) -> None:
        said = self._said.get(stay.stuck.uid)
        moment = self.clock()
        if said is not None and said[0] == stay.message and moment - said[1] < STAY_EVENT_SECONDS:
            return
        self._said[stay.stuck.uid] = (stay.message, moment)
        message = f"{stay.stuck.describe()}; left where it is: {stay.message}"
        log.info("%s: %s", stay.stuck.key, message)
        if not self.dry_run:
            await self._event(stay.stuck.pod, "NotRescheduled", message, warning=True)

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
            await self._evict(move)
        else:
            await self._copy(move)

    async def _evict(self, move: Move) -> None:
        stuck = move.stuck
        metadata = stuck.pod["metadata"]
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": metadata["name"], "namespace": metadata["namespace"]},
            "deleteOptions": {"preconditions": {"uid": metadata["uid"]}},
        }
        path = PODS.path(metadata["namespace"], metadata["name"], "eviction")
        try:
            await self.client.request("POST", path, body=body)
        except ApiError as error:
            if error.status in (404, 409):
                return  # gone or replaced meanwhile: nothing left to move
            if error.status == 429:
                self._blocked[stuck.uid] = self.clock() + BLOCKED_RETRY_SECONDS
                log.info("%s: eviction refused, tried again later: %s", stuck.key, error.message)
                await self._event(
                    stuck.pod,
                    "EvictionBlocked",
                    f"{stuck.describe()}; the eviction was refused, tried again in "
                    f"{BLOCKED_RETRY_SECONDS:.0f} s: {error.message}",
                    warning=True,
                )
                return
            raise
        await self._event(
            stuck.pod,
            "Rescheduled",
            f"{stuck.describe()}; evicted from {stuck.node} for its controller to replace "
            f"({move.to} can run it)",
        )

    async def _copy(self, move: Move) -> None:
        stuck = move.stuck
        copy = pod_copy(stuck.pod, move.to)
        name, namespace = copy["metadata"]["name"], stuck.namespace
        try:
            made = await self.client.create(PODS, copy, namespace)
        except ApiError as error:
            if error.status != 409:
                raise
            # A copy made by an earlier try (cut short before the original went).
            made = await self.client.get(PODS, name, namespace)
            if not is_copy_of(made, stuck.pod):
                await self._event(
                    stuck.pod,
                    "NotRescheduled",
                    f"{stuck.describe()}; cannot re-create it: pod {name} exists and is not "
                    "its copy",
                    warning=True,
                )
                return
        await self.client.delete_exact(PODS, stuck.pod)
        await self._event(
            stuck.pod,
            "Rescheduled",
            f"{stuck.describe()}; re-created as pod {name} on {made['spec'].get('nodeName')}",
        )
        await self._event(made, "Rescheduled", f"copy of pod {stuck.key} ({stuck.describe()})")

    async def _event(
        self, pod: Mapping[str, Any], reason: str, message: str, warning: bool = False
    ) -> None:
        event_type = "Warning" if warning else "Normal"
        await record_pod_event(self.client, pod, event_type, reason, message, SOURCE)


def answer_text(failure: EstimatorFailure) -> str:
    return f"estimator unavailable: {failure.message}"
