import asyncio

import pytest

from kubekit.ratelimit import Backoff, ItemBackoff, TokenBucket
from kubekit.workqueue import ShutDown, WorkQueue


async def test_a_waiting_key_is_queued_once() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in ["a", "b", "a", "a", "c", "b"]:
        queue.add(key)
    assert len(queue) == 3
    assert [await queue.get() for _ in range(3)] == ["a", "b", "c"]


async def test_key_added_while_processing_comes_back_after_done() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    key = await queue.get()
    queue.add("a")
    assert len(queue) == 0, "never handed to a second worker while the first has it"
    queue.done(key)
    assert len(queue) == 1
    assert await queue.get() == "a"


async def test_done_without_re_add_drops_the_key() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    queue.done(await queue.get())
    assert len(queue) == 0


async def test_get_blocks_until_a_key_arrives() -> None:
    queue: WorkQueue[str] = WorkQueue()
    getter = asyncio.create_task(queue.get())
    await asyncio.sleep(0.01)
    assert not getter.done()
    queue.add("x")
    assert await asyncio.wait_for(getter, 1) == "x"


async def test_add_after_keeps_the_earliest_wakeup() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add_after("a", 10)
    queue.add_after("a", 0.01)
    queue.add_after("a", 5)
    assert await asyncio.wait_for(queue.get(), 1) == "a"


def test_item_backoff_doubles_up_to_the_cap_and_forgets() -> None:
    backoff = ItemBackoff(base=1, cap=5)
    assert [backoff.next_delay("k") for _ in range(5)] == [1, 2, 4, 5, 5]
    assert backoff.next_delay("other") == 1
    backoff.forget("k")
    assert backoff.next_delay("k") == 1


def test_backoffs_stay_at_their_cap_after_a_day_of_failures() -> None:
    """2.0**1024 overflows: the loop retrying would end with an OverflowError."""
    items = ItemBackoff(base=0.005, cap=300)
    assert [items.next_delay("k") for _ in range(2000)][-1] == 300
    loop = Backoff(initial=0.5, cap=30, jitter=0)
    assert [loop.next_delay() for _ in range(2000)][-1] == 30


async def test_a_cancelled_wait_gives_its_token_back() -> None:
    bucket = TokenBucket(qps=10, burst=1)
    assert bucket.reserve() == 0
    waiting = asyncio.create_task(bucket.acquire())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # The next caller waits for one token, not for the abandoned one's too.
    assert bucket.reserve() == pytest.approx(0.1, abs=0.02)


def test_token_bucket_allows_a_burst_then_paces() -> None:
    now = [0.0]
    bucket = TokenBucket(qps=10, burst=3, clock=lambda: now[0])
    assert [bucket.reserve() for _ in range(3)] == [0, 0, 0]
    assert bucket.reserve() == pytest.approx(0.1)
    assert bucket.reserve() == pytest.approx(0.2)
    now[0] = 10.0  # refills, but never beyond the burst
    assert [bucket.reserve() for _ in range(3)] == [0, 0, 0]
    assert bucket.reserve() > 0


def test_token_bucket_without_qps_is_unlimited() -> None:
    bucket = TokenBucket(qps=0, burst=1)
    assert all(bucket.reserve() == 0 for _ in range(1000))


async def test_shut_down_drains_then_stops_workers() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    queue.shut_down()
    queue.add("late")
    assert await queue.get() == "a"
    with pytest.raises(ShutDown):
        await queue.get()


async def test_workers_retry_failures_with_backoff_and_forget_on_success() -> None:
    queue: WorkQueue[str] = WorkQueue(backoff=ItemBackoff(base=0.001))
    attempts: dict[str, int] = {}
    finished = asyncio.Event()

    async def reconcile(key: str) -> None:
        attempts[key] = attempts.get(key, 0) + 1
        if key == "flaky" and attempts[key] < 3:
            raise RuntimeError("transient")
        if attempts.get("flaky") == 3 and "ok" in attempts:
            finished.set()

    queue.add("flaky")
    queue.add("ok")
    workers = asyncio.create_task(queue.run_workers(2, reconcile))
    await asyncio.wait_for(finished.wait(), 2)
    assert attempts == {"flaky": 3, "ok": 1}
    assert queue.retries("flaky") == 0, "success forgets the backoff"
    queue.shut_down()
    await asyncio.wait_for(workers, 1)


async def test_a_cancellation_of_what_a_reconcile_awaited_is_its_failure_not_the_worker_s() -> None:
    queue: WorkQueue[str] = WorkQueue(backoff=ItemBackoff(base=0.001))
    attempts = 0
    retried = asyncio.Event()

    async def reconcile(_key: str) -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            # As a gRPC call cancelled by its channel's close raises in its caller.
            cut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            cut.cancel()
            await cut
        retried.set()

    queue.add("key")
    workers = asyncio.create_task(queue.run_workers(1, reconcile))
    await asyncio.wait_for(retried.wait(), 2)
    assert attempts == 2
    assert not workers.done()
    # Cancelled itself, a worker still stops.
    workers.cancel()
    with pytest.raises(asyncio.CancelledError):
        await workers


async def test_workers_give_up_after_max_retries() -> None:
    queue: WorkQueue[str] = WorkQueue(backoff=ItemBackoff(base=0.001))
    attempts = 0

    async def always_fails(_key: str) -> None:
        nonlocal attempts
        attempts += 1
        raise RuntimeError("permanent")

    queue.add("bad")
    workers = asyncio.create_task(queue.run_workers(1, always_fails, max_retries=3))
    await asyncio.sleep(0.3)
    assert attempts == 4  # the first try and three retries
    queue.shut_down()
    await asyncio.wait_for(workers, 1)


async def test_one_key_is_never_reconciled_concurrently() -> None:
    queue: WorkQueue[str] = WorkQueue()
    running = 0
    peak = 0
    calls = 0

    async def reconcile(_key: str) -> None:
        nonlocal running, peak, calls
        running += 1
        calls += 1
        peak = max(peak, running)
        await asyncio.sleep(0.005)
        running -= 1

    workers = asyncio.create_task(queue.run_workers(8, reconcile))
    for _ in range(50):
        queue.add("same")
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.05)
    queue.shut_down()
    await asyncio.wait_for(workers, 1)
    assert peak == 1
    assert 1 < calls < 50, "adds during processing coalesce"


async def test_process_now_waits_for_the_worker_that_has_the_key() -> None:
    queue: WorkQueue[str] = WorkQueue()
    running: list[str] = []
    release = asyncio.Event()

    async def reconcile(key: str) -> None:
        running.append(f"start {key}")
        assert running.count(f"start {key}") - running.count(f"end {key}") == 1, "two at once"
        await release.wait()
        running.append(f"end {key}")

    queue.add("a")
    key = await queue.get()
    worker = asyncio.create_task(reconcile(key))
    await asyncio.sleep(0)
    now = asyncio.create_task(queue.process_now("a", reconcile))
    await asyncio.sleep(0.01)
    assert running == ["start a"], "process_now waits while a worker has the key"
    release.set()
    await worker
    queue.done(key)
    await now
    assert running == ["start a", "end a", "start a", "end a"]
    assert len(queue) == 0


async def test_process_now_serves_a_pending_add_and_leaves_errors_to_the_caller() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("b")

    async def fail(key: str) -> None:
        raise RuntimeError(key)

    with pytest.raises(RuntimeError, match="a"):
        await queue.process_now("a", fail)
    assert len(queue) == 1 and await queue.get() == "b"
    assert queue.retries("a") == 0, "nothing was pending: nothing to retry"


async def test_a_pending_add_that_process_now_took_and_failed_is_queued_again() -> None:
    """Served by nobody, the change it stood for was lost (a Secret changed above, its
    copy below stale until it changed again)."""
    queue: WorkQueue[str] = WorkQueue(backoff=ItemBackoff(base=0.001))
    queue.add("a")

    async def fail(key: str) -> None:
        raise RuntimeError(key)

    with pytest.raises(RuntimeError, match="a"):
        await queue.process_now("a", fail)
    assert queue.retries("a") == 1
    assert await asyncio.wait_for(queue.get(), 1) == "a"


async def test_a_key_whose_workers_are_stopped_half_way_is_there_when_they_run_again() -> None:
    """The multischeduler keeps one queue for its slices and runs its workers again on it
    once it leads again: a namespace being placed when it lost its Lease stayed half
    placed until someone changed it."""
    queue: WorkQueue[str] = WorkQueue()
    started, finished = asyncio.Event(), []

    async def slow(key: str) -> None:
        started.set()
        await asyncio.sleep(60)
        finished.append(key)

    queue.add("ns-a")
    workers = asyncio.create_task(queue.run_workers(1, slow))
    await asyncio.wait_for(started.wait(), 1)
    workers.cancel()
    with pytest.raises(asyncio.CancelledError):
        await workers
    assert len(queue) == 1 and await asyncio.wait_for(queue.get(), 1) == "ns-a"


async def test_a_worker_that_fails_ends_the_others_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    queue: WorkQueue[str] = WorkQueue("test")

    def broken(*_args: object) -> None:
        raise RuntimeError("the retry bookkeeping broke")

    monkeypatch.setattr(queue, "_failed", broken)

    async def reconcile(key: str) -> None:
        raise ValueError(key)

    queue.add("key")
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(queue.run_workers(4, reconcile), 2)
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    assert others == [], "the other workers were left running"
