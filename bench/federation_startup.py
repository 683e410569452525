"""Time for a local federation to be ready (binaries already built) and its memory.

.venv/bin/python bench/federation_startup.py [--lower 2] [--nodes 3] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from harness.federation import Federation, FederationSpec
from harness.toolchain import Toolchain


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lower", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    toolchain = Toolchain.locate()
    spec = FederationSpec(lower=args.lower, nodes_per_lower=args.nodes)
    startups: list[float] = []
    memory_mib: list[float] = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kubestrata-bench-") as state:
            federation = Federation(Path(state), spec.clusters(), toolchain)
            began = time.monotonic()
            federation.start()
            startups.append(time.monotonic() - began)
            time.sleep(10)  # let controllers settle before reading memory
            total = sum(rss_kib(p.pid) for c in federation.clusters.values() for p in c.records())
            memory_mib.append(total / 1024)
            federation.stop()
        print(f"run {run + 1}: ready in {startups[-1]:.1f} s, RSS {memory_mib[-1]:.0f} MiB")
    clusters = 1 + args.lower
    print(
        f"{clusters} clusters ({args.lower} lower x {args.nodes} nodes): "
        f"ready median {statistics.median(startups):.1f} s "
        f"(min {min(startups):.1f}, max {max(startups):.1f}); "
        f"RSS median {statistics.median(memory_mib):.0f} MiB "
        f"({statistics.median(memory_mib) / clusters:.0f} MiB per cluster)"
    )


if __name__ == "__main__":
    main()
