"""When `kubestrata up` starts again a process of the federation that exited: at once the
first time, then after a delay doubling with each exit that came soon after a start (a
crash loop, as the kubelet backs off CrashLoopBackOff), and never once it keeps dying."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    initial_delay: float = 1.0
    max_delay: float = 30.0
    # A process that ran this long before it exited was not crash-looping: its next
    # restart is a first one again.
    stable_after: float = 60.0
    # Quick exits in a row after which the process is given up on.
    max_quick_exits: int = 5
    _started_at: dict[str, float] = field(default_factory=dict)
    _quick_exits: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.initial_delay <= self.max_delay:
            raise ValueError("restart delays need 0 < initial <= max")
        if self.max_quick_exits < 1:
            raise ValueError("a process must be allowed at least one quick exit")

    def started(self, name: str, now: float) -> None:
        self._started_at[name] = now

    def exited(self, name: str, now: float) -> float | None:
        """The delay before ``name`` is started again, or None when it keeps dying."""
        ran = now - self._started_at.get(name, now)
        quick = 0 if ran >= self.stable_after else self._quick_exits.get(name, 0)
        if quick >= self.max_quick_exits:
            return None
        self._quick_exits[name] = quick + 1
        if quick == 0:
            return 0.0
        return float(min(self.max_delay, self.initial_delay * 2 ** (quick - 1)))
