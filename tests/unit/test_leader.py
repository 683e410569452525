import asyncio
import contextlib
import copy
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kubekit.client import LEASES, ApiError, Resource
from kubekit.health import Health
from kubekit.leader import (
    ElectionSettings,
    LeaderElector,
    LeadershipLost,
    LeaseObserver,
    WorkCancelled,
    claim,
    keep_working,
    released,
    stand,
)
from kubekit.ratelimit import Backoff

NOW = "2026-11-25T03:00:00.000000Z"
LATER = "2026-11-25T03:00:02.000000Z"


def settings(identity: str, **timing: float) -> ElectionSettings:
    return ElectionSettings("kubestrata-system", "lock", identity, **timing)


class LeaseStore:
    """The Lease part of an apiserver: 404 for what is not there, 409 for a create of what
    is or a write carrying a resourceVersion that is not the current one."""

    def __init__(self) -> None:
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.version = 0
        self.down = False

    def _check(self, resource: Resource) -> None:
        assert resource == LEASES
        if self.down:
            raise ConnectionRefusedError("connection refused")

    def _stored(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(self.version)
        self.leases[namespace, body["metadata"]["name"]] = stored
        return copy.deepcopy(stored)

    async def get(self, resource: Resource, name: str, namespace: str) -> dict[str, Any]:
        self._check(resource)
        if (namespace, name) not in self.leases:
            raise ApiError(404, {"reason": "NotFound"})
        return copy.deepcopy(self.leases[namespace, name])

    async def create(
        self, resource: Resource, body: dict[str, Any], namespace: str
    ) -> dict[str, Any]:
        self._check(resource)
        if (namespace, body["metadata"]["name"]) in self.leases:
            raise ApiError(409, {"reason": "AlreadyExists"})
        return self._stored(namespace, body)

    async def replace(
        self, resource: Resource, body: dict[str, Any], namespace: str
    ) -> dict[str, Any]:
        self._check(resource)
        current = self.leases[namespace, body["metadata"]["name"]]
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise ApiError(409, {"reason": "Conflict"})
        return self._stored(namespace, body)

    def holder(self) -> str | None:
        holder: str | None = self.leases["kubestrata-system", "lock"]["spec"]["holderIdentity"]
        return holder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def elector(store: LeaseStore, identity: str, clock: Clock, **timing: float) -> LeaderElector:
    return LeaderElector(store, settings(identity, **timing), clock)  # type: ignore[arg-type]


def test_settings_refuse_timings_that_let_two_leaders_overlap() -> None:
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        settings("a", lease_duration=5, renew_deadline=5, retry_period=1)
    with pytest.raises(ValueError, match="retry period"):
        settings("a", retry_period=0)
    # The Lease holds whole seconds in an int32: infinity raised as it was written.
    with pytest.raises(ValueError, match="at most 2147483647s, not infs"):
        settings("a", lease_duration=float("inf"))
    with pytest.raises(ValueError, match="at most"):
        settings("a", lease_duration=2.0**31)
    with pytest.raises(ValueError, match="needs an identity"):
        settings("")


def test_the_first_claim_creates_the_lease() -> None:
    lease = claim(None, settings("a"), NOW)
    assert lease["metadata"] == {"name": "lock"}
    assert lease["spec"] == {
        "holderIdentity": "a",
        "leaseDurationSeconds": 10,
        "acquireTime": NOW,
        "renewTime": NOW,
        "leaseTransitions": 0,
    }


def test_a_renewal_keeps_the_acquire_time_and_a_takeover_counts_a_transition() -> None:
    mine = claim(None, settings("a"), NOW)
    mine["metadata"]["resourceVersion"] = "7"
    renewed = claim(mine, settings("a"), LATER)
    assert renewed["metadata"]["resourceVersion"] == "7"
    assert renewed["spec"]["acquireTime"] == NOW
    assert renewed["spec"]["renewTime"] == LATER
    assert renewed["spec"]["leaseTransitions"] == 0
    taken = claim(renewed, settings("b"), LATER)
    assert taken["spec"]["holderIdentity"] == "b"
    assert taken["spec"]["acquireTime"] == LATER
    assert taken["spec"]["leaseTransitions"] == 1
    assert mine["spec"]["holderIdentity"] == "a", "the lease read is left as it was"


def test_a_released_lease_has_no_holder() -> None:
    lease = released(claim(None, settings("a"), NOW), LATER)
    assert lease["spec"]["holderIdentity"] is None
    assert lease["spec"]["leaseDurationSeconds"] == 1


def test_another_holder_holds_until_its_lease_goes_unrenewed_for_its_duration() -> None:
    observer = LeaseObserver()
    theirs = claim(None, settings("b"), NOW)
    assert observer.held_by_other(theirs, "a", now=0.0)
    assert observer.held_by_other(theirs, "a", now=9.9)
    # A renewal seen at 9.9 gives the holder its whole duration again.
    renewed = claim(theirs, settings("b"), LATER)
    assert observer.held_by_other(renewed, "a", now=9.9)
    assert observer.held_by_other(renewed, "a", now=19.8)
    assert not observer.held_by_other(renewed, "a", now=19.9)
    assert not observer.held_by_other(renewed, "b", now=10.0), "its own lease"
    assert not observer.held_by_other(released(renewed, LATER), "a", now=20.0)


async def test_one_candidate_leads_and_the_other_takes_over_once_the_lease_expires() -> None:
    store, clock = LeaseStore(), Clock()
    first, second = elector(store, "a", clock), elector(store, "b", clock)
    assert await first.try_acquire_or_renew()
    assert not await second.try_acquire_or_renew()
    clock.now += 5
    assert await first.try_acquire_or_renew(), "the leader renews"
    assert not await second.try_acquire_or_renew(), "the follower sees the renewal"
    clock.now += 9
    assert not await second.try_acquire_or_renew(), "renewed 9 s ago: still held"
    # The leader is killed: nobody renews.
    clock.now += 1
    assert await second.try_acquire_or_renew()
    assert store.holder() == "b"
    assert store.leases["kubestrata-system", "lock"]["spec"]["leaseTransitions"] == 1
    assert not await first.try_acquire_or_renew(), "the old leader stands by"


async def test_of_two_candidates_writing_at_once_one_wins() -> None:
    store, clock = LeaseStore(), Clock()
    first, second = elector(store, "a", clock), elector(store, "b", clock)
    assert await first.try_acquire_or_renew()
    assert not await second.try_acquire_or_renew()
    clock.now += 11
    stale = await store.get(LEASES, "lock", "kubestrata-system")
    assert await second.try_acquire_or_renew()
    with pytest.raises(ApiError):
        await store.replace(LEASES, claim(stale, settings("a"), LATER), "kubestrata-system")
    assert store.holder() == "b"


async def test_an_unreachable_apiserver_is_a_failed_attempt_not_a_crash() -> None:
    store, clock = LeaseStore(), Clock()
    store.down = True
    assert not await elector(store, "a", clock).try_acquire_or_renew()


FAST = {"lease_duration": 1.0, "renew_deadline": 0.3, "retry_period": 0.05}


async def test_a_leader_that_cannot_renew_stops_its_work_before_the_lease_expires() -> None:
    store = LeaseStore()
    leader = LeaderElector(store, settings("a", **FAST))  # type: ignore[arg-type]
    working = asyncio.Event()
    cancelled = asyncio.Event()

    async def work() -> None:
        working.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    run = asyncio.create_task(leader.run(work))
    await asyncio.wait_for(working.wait(), 1)
    store.down = True
    started = asyncio.get_running_loop().time()
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(run, 2)
    assert cancelled.is_set()
    assert asyncio.get_running_loop().time() - started < FAST["lease_duration"]


async def test_a_leader_that_stops_releases_the_lease_and_the_follower_leads_at_once() -> None:
    store = LeaseStore()
    first = LeaderElector(store, settings("a", **FAST))  # type: ignore[arg-type]
    second = LeaderElector(store, settings("b", **FAST))  # type: ignore[arg-type]
    led = {"a": asyncio.Event(), "b": asyncio.Event()}

    async def work(name: str) -> None:
        led[name].set()
        await asyncio.Event().wait()

    leading = asyncio.create_task(first.run(lambda: work("a")))
    await asyncio.wait_for(led["a"].wait(), 1)
    standing_by = asyncio.create_task(second.run(lambda: work("b")))
    await asyncio.sleep(0.2)
    assert not led["b"].is_set()
    leading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leading
    assert store.holder() is None
    # Well before the 1 s lease would have expired.
    await asyncio.wait_for(led["b"].wait(), 0.3)
    standing_by.cancel()
    with pytest.raises(asyncio.CancelledError):
        await standing_by


async def test_work_that_ends_ends_the_leadership_with_its_result() -> None:
    store = LeaseStore()
    leader = LeaderElector(store, settings("a", **FAST))  # type: ignore[arg-type]

    async def failing() -> None:
        raise RuntimeError("the work failed")

    with pytest.raises(RuntimeError, match="the work failed"):
        await leader.run(failing)
    assert store.holder() is None


async def test_work_ended_by_a_cancellation_it_did_not_catch_is_a_failure() -> None:
    store = LeaseStore()
    leader = LeaderElector(store, settings("a", **FAST))  # type: ignore[arg-type]

    async def cut() -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.cancel()
        await future

    with pytest.raises(WorkCancelled):
        await leader.run(cut)
    assert store.holder() is None


async def test_a_leader_cut_off_its_apiserver_stops_working_and_leads_again_on_its_return() -> None:
    """The process never exits: the work is cancelled while the Lease cannot be renewed,
    and started again once this candidate holds it again."""
    store = LeaseStore()
    leader = LeaderElector(store, settings("a", **FAST))  # type: ignore[arg-type]
    runs: list[str] = []
    working, stopped = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        runs.append("started")
        working.set()
        try:
            await asyncio.Event().wait()
        finally:
            runs.append("stopped")
            stopped.set()

    kept = asyncio.create_task(keep_working(lambda: leader.run(work), Backoff(initial=0.01)))
    await asyncio.wait_for(working.wait(), 1)
    working.clear()
    store.down = True
    await asyncio.wait_for(stopped.wait(), 2)
    store.down = False
    await asyncio.wait_for(working.wait(), 2)
    assert runs == ["started", "stopped", "started"] and store.holder() == "a"
    assert not kept.done()
    kept.cancel()


async def test_work_failing_on_a_transient_api_error_starts_again_and_other_errors_end_it() -> None:
    answers: list[BaseException | None] = [
        ApiError(503, {"reason": "ServiceUnavailable"}),
        ConnectionResetError("reset"),
        None,
    ]

    async def work() -> None:
        answer = answers.pop(0)
        if answer is not None:
            raise answer

    await asyncio.wait_for(keep_working(work, Backoff(initial=0.01)), 2)
    assert answers == []

    async def forbidden() -> None:
        raise ApiError(403, {"reason": "Forbidden", "message": "no"})

    with pytest.raises(ApiError, match="Forbidden"):
        await keep_working(forbidden, Backoff(initial=0.01))


def test_the_lease_names_its_duration_rounded_up() -> None:
    """Rounded down (1.4 s to 1, 2.5 s to 2), the followers took over before the leader
    had stopped: two leaders at once."""
    for duration, written in ((1.4, 2), (2.5, 3), (10.0, 10)):
        timing = {"lease_duration": duration, "renew_deadline": 1.3, "retry_period": 0.5}
        assert claim(None, settings("a", **timing), NOW)["spec"]["leaseDurationSeconds"] == written


async def leading(leader: LeaderElector) -> asyncio.Task[None]:
    """The leader's run, once it works (until cancelled)."""
    working = asyncio.Event()

    async def work() -> None:
        working.set()
        await asyncio.Event().wait()

    run = asyncio.create_task(leader.run(work))
    await asyncio.wait_for(working.wait(), 1)
    return run


async def test_a_leader_whose_renewals_fail_fast_stops_at_its_renew_deadline() -> None:
    """After a renewal that failed at once it waited a whole retry period before looking
    at the deadline again, working up to that long past it."""
    store = LeaseStore()
    timing = {"lease_duration": 3.0, "renew_deadline": 1.0, "retry_period": 0.9}
    leader = LeaderElector(store, settings("a", **timing))  # type: ignore[arg-type]
    renewed: list[float] = []
    real = store.replace
    loop = asyncio.get_running_loop()

    async def replace(*args: Any, **kwargs: Any) -> dict[str, Any]:
        if store.down:
            raise ConnectionRefusedError("connection refused")
        answer = await real(*args, **kwargs)
        renewed.append(loop.time())
        return answer

    store.replace = replace  # type: ignore[method-assign]
    run = await leading(leader)
    await asyncio.sleep(1.0)  # a renewal or more
    store.down = True
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(run, 5)
    # Past it by less than the retry period it used to wait (0.9 s), slack for a busy CPU.
    assert loop.time() - renewed[-1] < timing["renew_deadline"] + 0.5


async def test_a_stop_that_comes_as_a_renewal_ends_is_not_lost() -> None:
    """On Python 3.11 asyncio.wait_for returned the renewal's answer and swallowed a
    cancellation (SIGTERM) that came with it: the leader went on renewing."""
    store = LeaseStore()
    leader = LeaderElector(store, settings("a", **FAST))  # type: ignore[arg-type]
    run = await leading(leader)
    real = store.replace

    async def replace(*args: Any, **kwargs: Any) -> dict[str, Any]:
        answer = await real(*args, **kwargs)
        asyncio.get_running_loop().call_soon(run.cancel)  # the signal lands now
        store.replace = real  # type: ignore[method-assign]
        return answer

    store.replace = replace  # type: ignore[method-assign]
    done, _ = await asyncio.wait({run}, timeout=2)
    assert done, "still leading after the stop"
    assert store.holder() is None, "released"


async def test_a_leader_that_finds_another_holder_stops_at_once() -> None:
    """Its work went on until the renew deadline, beside the new holder's."""
    store = LeaseStore()
    timing = {"lease_duration": 6.0, "renew_deadline": 4.0, "retry_period": 0.05}
    leader = LeaderElector(store, settings("a", **timing))  # type: ignore[arg-type]
    run = await leading(leader)
    lease = store.leases["kubestrata-system", "lock"]
    lease["spec"] = {**lease["spec"], "holderIdentity": "b", "renewTime": LATER}
    began = asyncio.get_running_loop().time()
    with pytest.raises(LeadershipLost, match="taken by another candidate"):
        await asyncio.wait_for(run, 5)
    assert asyncio.get_running_loop().time() - began < timing["renew_deadline"]
    assert store.holder() == "b", "not released: it is not ours"


async def test_a_lease_is_held_from_when_its_write_was_sent_not_answered() -> None:
    """A write that lands at once but whose answer takes 2 s: a follower counts the
    Lease's duration from the write, so the leader's deadline does too (counted from the
    answer, it worked on up to 2 s past a follower's takeover)."""
    store = LeaseStore()
    timing = {"lease_duration": 4.0, "renew_deadline": 2.5, "retry_period": 0.5}
    leader = LeaderElector(store, settings("a", **timing))  # type: ignore[arg-type]
    real_create, real_replace = store.create, store.replace
    answer_delay = 2.0

    async def slow(write: Any, *args: Any) -> dict[str, Any]:
        written = await write(*args)
        await asyncio.sleep(answer_delay)
        return written  # type: ignore[no-any-return]

    store.create = lambda *args: slow(real_create, *args)  # type: ignore[method-assign]
    store.replace = lambda *args: slow(real_replace, *args)  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    began = loop.time()
    working = asyncio.Event()
    stopped: list[float] = []

    async def work() -> None:
        working.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(loop.time())

    run = asyncio.create_task(leader.run(work))
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(run, 10)
    assert working.is_set()
    # Its first write was sent at once: held until 2.5 s from then, not from its answer
    # (4.5 s), every renewal's answer coming too late.
    assert stopped[0] - began < answer_delay + timing["renew_deadline"] - 0.5


async def test_a_renewal_that_meets_its_own_late_write_leads_on() -> None:
    """A renewal whose call timed out may land after all; the next one's write then meets
    a conflict with it (409), not with another candidate: leadership is not lost."""
    store = LeaseStore()
    timing = {"lease_duration": 6.0, "renew_deadline": 4.0, "retry_period": 0.05}
    leader = LeaderElector(store, settings("a", **timing))  # type: ignore[arg-type]
    real = store.replace
    conflicts = [ApiError(409, {"reason": "Conflict"})]

    async def replace(*args: Any, **kwargs: Any) -> dict[str, Any]:
        if conflicts:
            raise conflicts.pop()
        return await real(*args, **kwargs)

    store.replace = replace  # type: ignore[method-assign]
    run = await leading(leader)
    await asyncio.sleep(0.3)  # several renewals, the first one refused
    assert not run.done() and not conflicts
    assert store.holder() == "a"
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run


async def test_a_replica_whose_start_failed_stands_by_ready() -> None:
    """Its work said "starting" and then failed (an API error, a lost Lease): left not
    ready as a standby, it held its PodDisruptionBudget at no disruption allowed."""
    store = LeaseStore()
    first, second = (LeaderElector(store, settings(n, **FAST)) for n in "ab")  # type: ignore[arg-type]
    health = Health()
    started = asyncio.Event()

    async def failing_start() -> None:
        health.mark_not_ready("starting")
        started.set()
        raise ApiError(503, {"reason": "ServiceUnavailable"})

    async def work() -> None:
        await asyncio.Event().wait()

    backoff = Backoff(initial=0.05, jitter=0)
    standing = asyncio.create_task(
        keep_working(lambda: stand(first, health, failing_start), backoff)
    )
    await asyncio.wait_for(started.wait(), 1)
    leading = asyncio.create_task(second.run(work))
    async with TestClient(TestServer(health.app())) as client:
        for _ in range(50):
            await asyncio.sleep(0.02)
            if store.holder() == "b" and (await client.get("/readyz")).status == 200:
                break
        assert store.holder() == "b"
        assert (await client.get("/readyz")).status == 200
    for task in (standing, leading):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
