"""kubestrata descheduler (entry point: `kubestrata descheduler`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    del argv
    print(
        "kubestrata descheduler: not available yet in this version of kubestrata", file=sys.stderr
    )
    return 2
