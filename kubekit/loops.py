"""Work handed from one thread's event loop to another's (an API client's connections
belong to the loop that opened them, so a caller on another thread has its requests run
there), work a caller starts without awaiting it, and loops run together."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def on_loop(home: asyncio.AbstractEventLoop | None, work: Coroutine[Any, Any, T]) -> T:
    """Awaits ``work`` run on ``home`` (None: the caller's own loop)."""
    if home is None or home is asyncio.get_running_loop():
        return await work
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, home))


async def run_together(*work: Coroutine[Any, Any, Any]) -> None:
    """Runs every coroutine until all end. The first to fail ends the others, awaited,
    and its error is raised: ``asyncio.gather`` would leave them running for a caller
    that has moved on (closed its clients, started them all again)."""
    tasks = [asyncio.create_task(each) for each in work]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def being_cancelled() -> bool:
    """Whether the running task is being cancelled itself. A CancelledError raised in a
    task that is not (grpc.aio raises one in the caller of a call whose channel closed)
    is a failure of what it awaited, not a request to stop."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Background:
    """Tasks started and not awaited by whoever started them, kept so that none is
    collected mid-flight and all can be awaited, or ended, at shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.wait()
