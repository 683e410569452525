"""kubestrata webhook (entry point: `kubestrata webhook`)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    from webhook.server import main as serve

    return serve(argv)
