"""`kubestrata up --detach` timed from the call to its return, everything included, and
the memory of every process it started.

    .venv/bin/python bench/federation_startup.py [--lower 2] [--nodes 3] [--rounds 3]

Each round runs the stock command in a new state directory, `kubestrata up --detach
--lower L --nodes N` (control-plane binaries from the cache): it returns once the control
planes and a metrics-server per cluster are ready, one virtual node per lower cluster has
its Node Ready, the webhook has put its CA in its configuration, the multischeduler
serves (the upper scheduler restarted with it as extender) and the descheduler is
started. The time is taken from the call to its return. Then, 10 s later (controllers
settle), the resident memory (VmRSS) of every process recorded in the state directory
(detached, `kubestrata up` leaves no process of its own); then `kubestrata down`.
Figures per round and, over the rounds, median and min-max: the time, the RSS of all
processes, and the RSS per kind of process (the same program in several clusters summed).
No target is set for these: the script prints figures only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from common import spread

from harness.federation import running_processes

SETTLE_SECONDS = 10.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def kind(name: str) -> str:
    """A process's program: virtual nodes by their common prefix, the rest as named."""
    return "virtual-node" if name.startswith("virtual-node-") else name


def kubestrata(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kubekit.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lower", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    seconds: list[float] = []
    totals: list[float] = []
    by_kind: list[dict[str, float]] = []
    counts: Counter[str] = Counter()
    for number in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory(prefix="kubestrata-bench-") as temporary:
            state = Path(temporary) / "state"
            up = ["up", "--detach", f"--state-dir={state}"]
            up += [f"--lower={args.lower}", f"--nodes={args.nodes}"]
            began = time.monotonic()
            started = kubestrata(*up, timeout=600)
            took = time.monotonic() - began
            try:
                if started.returncode != 0:
                    sys.exit(f"kubestrata up failed ({started.returncode}):\n{started.stderr}")
                time.sleep(SETTLE_SECONDS)
                memory: defaultdict[str, float] = defaultdict(float)
                counts = Counter()
                for record in running_processes(state):
                    memory[kind(record.name)] += rss_mib(record.pid)
                    counts[kind(record.name)] += 1
            finally:
                down = kubestrata("down", f"--state-dir={state}", timeout=300)
                if down.returncode != 0:
                    print(f"kubestrata down failed ({down.returncode}): {down.stderr}")
        seconds.append(took)
        totals.append(sum(memory.values()))
        by_kind.append(memory)
        print(
            f"round {number}/{args.rounds}: up --detach returned in {took:.1f} s; "
            f"{sum(counts.values())} processes, RSS {totals[-1]:,.0f} MiB"
        )
    print(
        f"1 upper + {args.lower} lower x {args.nodes} nodes, over {args.rounds} rounds: "
        "median (min-max)"
    )
    print(f"    kubestrata up --detach, call to return: {spread(seconds, '.1f')} s")
    print(f"    RSS of every process it started: {spread(totals, ',.0f')} MiB")
    for name in sorted(counts, key=lambda n: -by_kind[-1][n]):
        values = [memory[name] for memory in by_kind]
        print(f"        {name} x{counts[name]}: {spread(values, ',.0f')} MiB")


if __name__ == "__main__":
    main()
