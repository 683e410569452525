"""Work handed from one thread's event loop to another's: an API client's connections
belong to the loop that opened them, so a caller on another thread has its requests run
there."""

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
