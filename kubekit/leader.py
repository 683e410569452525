"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it:
of the replicas of a component, only the one holding the Lease does its work; the others
stand by and take the Lease over once its holder stops renewing it.

kubernetes_asyncio ships an elector, but it lets a connection error out of its loop (a
leader then dies on a blip of the apiserver), logs a traceback on every lost race and
writes local time marked as UTC into the Lease; this one is small and does none of that.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import logging
import math
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kubekit import keys
from kubekit.client import (
    API_ERRORS,
    CONNECTION_ERRORS,
    LEASES,
    ApiError,
    ClientSettings,
    KubeClient,
    is_conflict,
    is_not_found,
    is_transient,
)
from kubekit.health import Health
from kubekit.ratelimit import Backoff
from kubekit.timestamps import now_micro

JSON = dict[str, Any]
log = logging.getLogger("kubekit.leader")


# client-go's are 15, 10 and 2 s; a shorter lease makes a standby take over within 15 s
# of its leader's crash.
LEASE_DURATION = 10.0
MAX_LEASE_SECONDS = 2**31 - 1
RENEW_DEADLINE = 7.0
RETRY_PERIOD = 2.0


class LeadershipLost(Exception):
    """The Lease could not be renewed within the renew deadline: another replica may
    hold it now, so this one must stop writing."""


class WorkCancelled(RuntimeError):
    """The work ended with a cancellation nobody asked of it."""


def default_identity() -> str:
    """The host (a pod's name) and a random part, as client-go makes it: two processes on
    one host are two candidates."""
    return f"{socket.gethostname()}_{uuid.uuid4()}"


@dataclass(frozen=True)
class ElectionSettings:
    namespace: str
    name: str
    identity: str
    # A follower takes over lease_duration after it last saw the Lease change; a leader
    # that could not renew for renew_deadline has stopped before that.
    lease_duration: float = LEASE_DURATION
    renew_deadline: float = RENEW_DEADLINE
    retry_period: float = RETRY_PERIOD

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("a leader election candidate needs an identity")
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, "
                f"not {self.retry_period}s, {self.renew_deadline}s, {self.lease_duration}s"
            )
        # The Lease holds whole seconds in an int32 (infinity raised, uncaught, as the
        # Lease was written; past 2^31 the apiserver refused every claim).
        if not self.lease_duration <= MAX_LEASE_SECONDS:
            raise ValueError(
                f"the lease duration is at most {MAX_LEASE_SECONDS}s, not {self.lease_duration}s"
            )


def holder(lease: JSON | None) -> str:
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


def claim(lease: JSON | None, settings: ElectionSettings, now: str) -> JSON:
    """The Lease the candidate writes to take or keep the lock: ``lease`` (None: there is
    none yet) with the candidate as holder and ``now`` as renew time. Its resourceVersion is
    kept, so the write fails if another candidate wrote in between."""
    spec = dict((lease or {}).get("spec") or {})
    taken_over = holder(lease) != settings.identity
    if taken_over:
        spec["acquireTime"] = now
        if lease is not None:
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
    spec.update(
        holderIdentity=settings.identity,
        # Rounded up: rounded down (1.4 to 1, 2.5 to 2), followers took over before the
        # leader had stopped.
        leaseDurationSeconds=max(1, math.ceil(settings.lease_duration)),
        renewTime=now,
    )
    spec.setdefault("leaseTransitions", 0)
    metadata = dict((lease or {}).get("metadata") or {"name": settings.name})
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": spec,
    }


def released(lease: JSON, now: str) -> JSON:
    """The Lease a leader that stops writes: no holder, so a follower takes it at once
    (client-go's ReleaseOnCancel)."""
    spec = dict(lease.get("spec") or {})
    spec.update(holderIdentity=None, leaseDurationSeconds=1, renewTime=now, acquireTime=now)
    return {**lease, "spec": spec}


class Attempt(enum.Enum):
    HELD = "held"  # the Lease is ours, written
    TAKEN = "taken"  # another candidate holds it, as read
    FAILED = "failed"  # no answer, or an error: nothing learnt


class LeaseObserver:
    """When a candidate last saw the Lease change, by its own clock: the holder's renew
    times come from another machine's clock, so only a change seen here counts."""

    def __init__(self) -> None:
        self._record: tuple[object, ...] | None = None
        self._seen_at = 0.0

    def held_by_other(self, lease: JSON, identity: str, now: float) -> bool:
        """Whether another candidate holds ``lease`` and may still be renewing it."""
        spec = lease.get("spec") or {}
        record = (
            spec.get("holderIdentity"),
            spec.get("renewTime"),
            spec.get("leaseDurationSeconds"),
        )
        if record != self._record:
            self._record, self._seen_at = record, now
        owner = holder(lease)
        duration = float(spec.get("leaseDurationSeconds") or 0)
        return bool(owner) and owner != identity and now < self._seen_at + duration


class LeaderElector:
    def __init__(
        self,
        client: KubeClient,
        settings: ElectionSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.settings = settings
        self._clock = clock
        self._observer = LeaseObserver()
        self._lease: JSON | None = None  # as last written by this candidate
        self._reported_holder: str | None = None

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; False when another candidate holds the Lease or the API failed."""
        return await self._attempt() is Attempt.HELD

    async def _attempt(self) -> Attempt:
        settings = self.settings
        try:
            try:
                lease: JSON | None = await self.client.get(
                    LEASES, settings.name, settings.namespace
                )
            except ApiError as error:
                if not is_not_found(error):
                    raise
                lease = None
            if lease is not None:
                self._report_holder(holder(lease))
                if self._observer.held_by_other(lease, settings.identity, self._clock()):
                    return Attempt.TAKEN
            body = claim(lease, settings, now_micro())
            if lease is None:
                self._lease = await self.client.create(LEASES, body, settings.namespace)
            else:
                self._lease = await self.client.replace(LEASES, body, settings.namespace)
        except ApiError as error:
            # A conflict may be our own earlier write that landed after its call timed
            # out: the next attempt reads who holds it.
            if not is_conflict(error):
                log.warning("lease %s: %s", self._key(), error.message)
            return Attempt.FAILED
        except CONNECTION_ERRORS as error:
            log.warning("lease %s: %s", self._key(), error or type(error).__name__)
            return Attempt.FAILED
        self._report_holder(settings.identity)
        return Attempt.HELD

    async def _timed_attempt(self, limit: float) -> tuple[Attempt, float]:
        """An attempt given at most ``limit`` seconds, and when it began: the Lease is
        held from when the write was sent, not answered, since a follower counts the
        Lease's duration from when it sees the write (a reply that took 3 s had the
        leader work up to 3 s past the moment a follower took over)."""
        began = self._clock()
        try:
            async with asyncio.timeout(max(limit, 0.1)):
                return await self._attempt(), began
        except TimeoutError:
            return Attempt.FAILED, began

    async def run(self, work: Callable[[], Awaitable[None]]) -> None:
        """Waits for the Lease, then runs ``work`` while renewing it. Returns or raises
        as ``work`` does; raises LeadershipLost (after cancelling ``work``) when the Lease
        could not be renewed in time. A leader that stops releases the Lease."""
        settings = self.settings
        log.info("lease %s: candidate %s waiting to lead", self._key(), settings.identity)
        renewed_at = await self._acquire()
        log.info("lease %s: %s leads", self._key(), settings.identity)
        task = asyncio.ensure_future(work())
        lost = False
        try:
            while True:
                # Never past the renew deadline: after a renewal that failed fast, a full
                # retry period would keep a leader working beyond it.
                left = renewed_at + settings.renew_deadline - self._clock()
                await asyncio.wait({task}, timeout=max(0.0, min(settings.retry_period, left)))
                if task.done():
                    if task.cancelled():
                        # Not by us: a cancellation of something it awaited escaped it.
                        # Said as a failure; as a CancelledError it would end the
                        # component as a signal does, silently and with status 0.
                        raise WorkCancelled("the leader's work ended cancelled")
                    return task.result()
                left = renewed_at + settings.renew_deadline - self._clock()
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a
                # cancellation (SIGTERM) that comes as the renewal ends, and the leader
                # went on renewing, never released.
                attempt, began = await self._timed_attempt(left)
                if attempt is Attempt.HELD:
                    renewed_at = began
                elif attempt is Attempt.TAKEN:
                    # Another candidate holds it: it works already, so stop now, not at
                    # the deadline.
                    lost = True
                    raise LeadershipLost(f"lease {self._key()} taken by another candidate")
                elif self._clock() >= renewed_at + settings.renew_deadline:
                    lost = True
                    raise LeadershipLost(
                        f"lease {self._key()} not renewed for {settings.renew_deadline}s"
                    )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if not lost:
                await self._release()

    async def _acquire(self) -> float:
        """Waits for the Lease; when the attempt that took it began. One whose answer
        came past the renew deadline is no lead: the Lease may be another's by then."""
        settings = self.settings
        while True:
            attempt, began = await self._timed_attempt(settings.renew_deadline)
            if attempt is Attempt.HELD and self._clock() < began + settings.renew_deadline:
                return began
            if attempt is not Attempt.HELD:
                await asyncio.sleep(settings.retry_period)

    async def _release(self) -> None:
        if self._lease is None or holder(self._lease) != self.settings.identity:
            return
        try:
            async with asyncio.timeout(self.settings.retry_period):
                await self.client.replace(
                    LEASES, released(self._lease, now_micro()), self.settings.namespace
                )
            log.info("lease %s: released by %s", self._key(), self.settings.identity)
        except API_ERRORS as error:
            # The followers take over when the Lease expires instead.
            log.warning("lease %s: not released: %s", self._key(), error or type(error).__name__)

    def _report_holder(self, current: str) -> None:
        if current != self._reported_holder:
            self._reported_holder = current
            if current and current != self.settings.identity:
                log.info("lease %s: held by %s", self._key(), current)

    def _key(self) -> str:
        return f"{self.settings.namespace}/{self.settings.name}"


def add_arguments(parser: argparse.ArgumentParser, work: str, *, defaults: bool = True) -> None:
    """The --leader-elect flags of a component whose replicas must not all ``work``;
    without ``defaults`` they are None when not given (a configuration file may set them)."""

    def default(value: object) -> object:
        return value if defaults else None

    parser.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=default(True),
        help=f"of the replicas, only the holder of a Lease in the upper cluster {work}; the "
        "others stand by (default: on)",
    )
    parser.add_argument(
        "--leader-elect-namespace",
        default=default(keys.SYSTEM_NAMESPACE),
        help=f"the Lease's namespace (default {keys.SYSTEM_NAMESPACE})",
    )
    parser.add_argument(
        "--leader-elect-identity",
        default=default(""),
        help="this replica's name in the Lease (default: host_uuid)",
    )
    parser.add_argument(
        "--leader-elect-lease-duration",
        type=float,
        default=default(LEASE_DURATION),
        help="seconds a standby waits on a Lease nobody renews before it takes over "
        f"(default {LEASE_DURATION:g})",
    )
    parser.add_argument(
        "--leader-elect-renew-deadline",
        type=float,
        default=default(RENEW_DEADLINE),
        help=f"seconds a leader works on without renewing its Lease (default {RENEW_DEADLINE:g})",
    )
    parser.add_argument(
        "--leader-elect-retry-period",
        type=float,
        default=default(RETRY_PERIOD),
        help=f"seconds between attempts to take or renew the Lease (default {RETRY_PERIOD:g})",
    )


def election_settings(options: Any, name: str) -> ElectionSettings | None:
    """The settings of the --leader-elect flags (on parsed arguments or a configuration
    with the same ``leader_elect*`` attributes) for the Lease ``name``; None when off.
    Raises ValueError on timings that cannot work."""
    if not options.leader_elect:
        return None
    return ElectionSettings(
        options.leader_elect_namespace,
        name,
        options.leader_elect_identity or default_identity(),
        options.leader_elect_lease_duration,
        options.leader_elect_renew_deadline,
        options.leader_elect_retry_period,
    )


async def keep_working(run: Callable[[], Awaitable[None]], backoff: Backoff) -> None:
    """``run`` until it returns: run again when it lost its Lease (after a leader that
    could not renew it, its apiserver down say, stopped working it stands again), and
    after a backoff when it failed on a transient API error. Other errors end it."""
    while True:
        started = time.monotonic()
        try:
            await run()
            return
        except LeadershipLost as lost:
            log.warning("%s: stopped leading; standing again", lost)
        except API_ERRORS as error:
            if not is_transient(error):
                raise
            if time.monotonic() - started > backoff.cap:
                backoff.reset()  # it had been working: not a failure in a row
            delay = backoff.next_delay()
            log.warning(
                "stopped working on an API error, starting again in %.1f s: %s",
                delay,
                error or type(error).__name__,
            )
            await asyncio.sleep(delay)


async def run_leading(
    kubeconfig: str | None,
    settings: ElectionSettings | None,
    health: Health,
    work: Callable[[], Awaitable[None]],
) -> None:
    """``work`` while this replica holds the Lease of ``settings`` (None: at once, no
    election), kept working through what an apiserver does to it (``keep_working``). A
    standby is ready: it is doing its job, and a rollout of several replicas completes;
    ``work`` says when it is ready itself."""
    backoff = Backoff(initial=1.0, cap=30.0)
    if settings is None:
        await keep_working(work, backoff)
        return
    async with await KubeClient.connect(ClientSettings(kubeconfig)) as client:
        elector = LeaderElector(client, settings)
        await keep_working(lambda: stand(elector, health, work), backoff)


async def stand(
    elector: LeaderElector, health: Health, work: Callable[[], Awaitable[None]]
) -> None:
    """One stand for the Lease, and ``work`` while it is held. Ready again first,
    whatever the work last said (a start cut short by a lost Lease or an API error left
    "starting"): a standby left not ready for good held its PodDisruptionBudget at no
    disruption allowed, and drains of its node stopped."""
    health.mark_ready()
    await elector.run(work)
