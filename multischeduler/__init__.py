"""kubestrata multischeduler (entry point: `kubestrata multischeduler`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    del argv
    print(
        "kubestrata multischeduler: not available yet in this version of kubestrata",
        file=sys.stderr,
    )
    return 2
