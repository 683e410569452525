"""The ``kubestrata`` command: every component's entry point (what the image runs); the
local federation's commands (up, down, kubeconfig, status) come from the harness package
where it is installed."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# Each component is a package of its own with `main(argv) -> exit code`, imported only
# when called so one component does not load the others.
COMPONENTS = {
    "virtual-node": "virtual_node",
    "webhook": "webhook",
    "webhook-cert": "webhook.certjob",
    "descheduler": "descheduler",
    "multischeduler": "multischeduler",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMPONENTS:
        component: Callable[[Sequence[str]], int] = importlib.import_module(
            COMPONENTS[argv[0]]
        ).main
        return component(argv[1:])
    try:
        harness = importlib.import_module("harness.cli")
    except ModuleNotFoundError:
        print(
            f"usage: kubestrata {{{','.join(COMPONENTS)}}} ... (the local federation's "
            "commands are not installed here)",
            file=sys.stderr,
        )
        return 2
    run_harness: Callable[[Sequence[str]], int] = harness.main
    return run_harness(argv)


if __name__ == "__main__":
    sys.exit(main())
