"""kubestrata descheduler (entry point: `kubestrata descheduler`)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    from descheduler.main import main as run

    return run(argv)
