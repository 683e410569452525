"""A keyed, de-duplicating work queue with rate-limited retries and a worker pool.

The client-go contract: a key waiting in the queue is there once however often it is
added; a key being processed is never handed to a second worker at the same time, and
if it is added meanwhile it is processed again once the first worker is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from kubekit import metrics
from kubekit.client import ApiError
from kubekit.loops import being_cancelled, run_together
from kubekit.ratelimit import ItemBackoff, TokenBucket

Key = TypeVar("Key", bound=Hashable)

log = logging.getLogger(__name__)


class ShutDown(Exception):
    """The queue was shut down; no more keys will come."""


class WorkQueue(Generic[Key]):
    def __init__(
        self,
        name: str = "queue",
        *,
        backoff: ItemBackoff | None = None,
        overall_limit: TokenBucket | None = None,
    ) -> None:
        self.name = name
        self._queue: deque[Key] = deque()
        self._dirty: set[Key] = set()
        self._processing: set[Key] = set()
        self._delayed: dict[Key, asyncio.TimerHandle] = {}
        self._backoff = backoff or ItemBackoff()
        # client-go's default: 10 retries a second overall, bursts of 100.
        self._overall = overall_limit or TokenBucket(qps=10, burst=100)
        # Workers blocked in get(); add() wakes one without scheduling a task.
        self._waiters: deque[asyncio.Future[None]] = deque()
        # Callers of process_now waiting for a worker to be done with their key.
        self._idle: dict[Key, list[asyncio.Future[None]]] = {}
        self._shutting_down = False
        self._depth = metrics.WORKQUEUE_DEPTH.labels(name)
        self._adds = metrics.WORKQUEUE_ADDS.labels(name)
        self._retries = metrics.WORKQUEUE_RETRIES.labels(name)
        self._work_duration = metrics.WORKQUEUE_WORK_DURATION.labels(name)

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, key: Key) -> None:
        if self._shutting_down or key in self._dirty:
            return
        self._dirty.add(key)
        self._adds.inc()
        if key in self._processing:
            return  # done() queues it again
        self._queue.append(key)
        self._depth.set(len(self._queue))
        self._notify()

    def _notify(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def add_after(self, key: Key, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        if self._shutting_down:
            return
        loop = asyncio.get_running_loop()
        existing = self._delayed.get(key)
        when = loop.time() + delay
        if existing is not None:
            if existing.when() <= when:
                return  # the earlier wake-up wins
            existing.cancel()
        self._delayed[key] = loop.call_at(when, self._fire_delayed, key)

    def _fire_delayed(self, key: Key) -> None:
        self._delayed.pop(key, None)
        self.add(key)

    def add_rate_limited(self, key: Key) -> None:
        self._retries.inc()
        self.add_after(key, max(self._backoff.next_delay(key), self._overall.reserve()))

    def retries(self, key: Key) -> int:
        return self._backoff.failures(key)

    def forget(self, key: Key) -> None:
        self._backoff.forget(key)

    async def get(self) -> Key:
        while not self._queue:
            if self._shutting_down:
                raise ShutDown(self.name)
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                # Pass a wake-up we may have taken on to another worker.
                if waiter.done() and not waiter.cancelled() and self._queue:
                    self._notify()
                raise
        key = self._queue.popleft()
        self._depth.set(len(self._queue))
        self._processing.add(key)
        self._dirty.discard(key)
        return key

    def done(self, key: Key) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._queue.append(key)
            self._depth.set(len(self._queue))
            self._notify()
        for waiter in self._idle.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def process_now(self, key: Key, reconcile: Callable[[Key], Awaitable[None]]) -> None:
        """Reconciles ``key`` at once on the caller's task, under the queue's contract: never
        beside a worker busy with the same key (it waits for that one), and a pending add
        of the key is served by this run. An error is the caller's; the pending add it
        took is queued again with backoff (served by nobody, the change it stood for was
        lost: a Secret's copy below stayed stale when the pod that asked for it went)."""
        while key in self._processing:
            waiter = asyncio.get_running_loop().create_future()
            self._idle.setdefault(key, []).append(waiter)
            await waiter
        took_pending = key in self._dirty
        if took_pending:
            self._dirty.discard(key)
            self._queue.remove(key)
            self._depth.set(len(self._queue))
        self._processing.add(key)
        try:
            await reconcile(key)
        except BaseException:
            if took_pending:
                self.add_rate_limited(key)
            raise
        finally:
            self.done(key)

    def shut_down(self) -> None:
        self._shutting_down = True
        for handle in self._delayed.values():
            handle.cancel()
        self._delayed.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def run_workers(
        self,
        workers: int,
        reconcile: Callable[[Key], Awaitable[None]],
        *,
        max_retries: int | None = None,
    ) -> None:
        """Runs ``workers`` coroutines until the queue shuts down. A key whose reconcile
        raises is retried with backoff; one that succeeds has its backoff forgotten."""

        async def worker() -> None:
            while True:
                try:
                    key = await self.get()
                except ShutDown:
                    return
                started = time.perf_counter()
                try:
                    await reconcile(key)
                except asyncio.CancelledError as cancelled:
                    if being_cancelled():
                        # Stopped half-way (a leader that lost its Lease): the key goes
                        # back, for the workers run again on this queue.
                        self._dirty.add(key)
                        raise
                    # Something the reconcile awaited was cancelled, not this worker (a
                    # gRPC call whose channel closed raises so): a failure of this key.
                    self._failed(key, cancelled, max_retries)
                except Exception as error:
                    self._failed(key, error, max_retries)
                else:
                    self.forget(key)
                finally:
                    self._work_duration.observe(time.perf_counter() - started)
                    self.done(key)

        await run_together(*(worker() for _ in range(workers)))

    def _failed(self, key: Key, error: BaseException, max_retries: int | None) -> None:
        metrics.RECONCILE_ERRORS.labels(self.name, _reason(error)).inc()
        retries = self.retries(key)
        if max_retries is not None and retries >= max_retries:
            log.error(
                "%s: giving up on %s after %d retries",
                self.name,
                key,
                retries,
                exc_info=error,
            )
            self.forget(key)
        else:
            log.warning(
                "%s: reconcile of %s failed (retry %d)",
                self.name,
                key,
                retries + 1,
                exc_info=error,
            )
            self.add_rate_limited(key)


def _reason(error: BaseException) -> str:
    """An API refusal's reason (Conflict, NotFound, ...), else the error's type."""
    if isinstance(error, ApiError) and error.reason:
        return error.reason
    return type(error).__name__
