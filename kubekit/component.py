"""How every component process runs: its main coroutine until it ends or a signal stops
it, with an exit code."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Coroutine
from typing import Any

from kubekit.client import API_ERRORS, KubeconfigError
from kubekit.leader import LeadershipLost

# What ends a component with one log line and exit code 1 instead of a traceback.
_FAILURES: tuple[type[Exception], ...] = (*API_ERRORS, LeadershipLost, KubeconfigError)

# Net allocations between two young collections (Python's default: 700). A component's
# caches are decoded JSON, millions of containers without a cycle; at the default, every
# quarter they grow by sets off a collection of the whole heap, which at 10,000 mirrored
# pods walks every one of them for nothing (docs/benchmarks.md).
GC_YOUNG_THRESHOLD = 10_000


def run_component(main: Coroutine[Any, Any, None], log: logging.Logger) -> int:
    """Runs ``main`` until it returns or SIGINT/SIGTERM cancels it (its ``finally``
    blocks clean up); 1 when it failed on the network or the API, lost its leader Lease
    or found its kubeconfig unusable, said in one log line rather than a traceback."""

    async def until_signalled() -> None:
        task = asyncio.create_task(main)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    try:
        asyncio.run(until_signalled())
    except _FAILURES as error:
        log.error("%s", error)
        return 1
    return 0
