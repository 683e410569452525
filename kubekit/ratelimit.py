"""Rate limiting: a token bucket for API clients, per-item exponential backoff for
work-queue retries (the client-go defaults), and a jittered backoff for one loop that
retries (a watch, a component's work)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Hashable

# Past this many doublings every delay is at its cap; counting on would overflow a float
# (2.0**1024) after a day of failures in a row, ending the loop that retries.
_DOUBLINGS = 64


class TokenBucket:
    """``qps`` tokens a second, at most ``burst`` saved up. ``qps <= 0`` means unlimited."""

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1:
            raise ValueError(f"burst must be at least 1, not {burst}")
        self.qps = qps
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()

    def reserve(self) -> float:
        """Takes one token, possibly borrowing from the future; returns how long the
        caller must wait before using it."""
        if self.qps <= 0:
            return 0.0
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
        self._last = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:
                # Its caller gave up (a deadline): the token goes back to those waiting.
                self._tokens = min(self.burst, self._tokens + 1.0)
                raise


class ItemBackoff:
    """Per-item exponential backoff: base * 2^failures, capped."""

    def __init__(self, base: float = 0.005, cap: float = 300.0) -> None:
        self.base = base
        self.cap = cap
        self._failures: dict[Hashable, int] = {}

    def next_delay(self, item: Hashable) -> float:
        failures = self._failures.get(item, 0)
        self._failures[item] = failures + 1
        return float(min(self.cap, self.base * 2.0 ** min(failures, _DOUBLINGS)))

    def failures(self, item: Hashable) -> int:
        return self._failures.get(item, 0)

    def forget(self, item: Hashable) -> None:
        self._failures.pop(item, None)


class Backoff:
    """Exponential backoff with jitter, reset after success."""

    def __init__(
        self,
        initial: float = 0.5,
        cap: float = 30.0,
        jitter: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        self.initial = initial
        self.cap = cap
        self.jitter = jitter
        self._rng = rng or random.Random()
        self._attempts = 0

    def next_delay(self) -> float:
        base = min(self.cap, self.initial * 2.0 ** min(self._attempts, _DOUBLINGS))
        self._attempts += 1
        return base * (1 + self.jitter * self._rng.random())

    def reset(self) -> None:
        self._attempts = 0
