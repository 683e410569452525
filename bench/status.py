"""How long `kubestrata status` takes to show a federation's virtual nodes (target: under a
second), against the stock `kubectl get nodes` of the same Nodes in the same run.

.venv/bin/python bench/status.py [--state-dir DIR] [--rounds 7]

Without --state-dir it starts a federation of its own (2 lower clusters of 3 nodes, their
virtual nodes) and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.federation import Federation, FederationSpec
from harness.state import kubeconfig_path
from harness.toolchain import Toolchain
from kubekit import keys, status

TARGET_SECONDS = 1.0


@contextmanager
def upper_kubeconfig(state_dir: Path | None) -> Iterator[Path]:
    if state_dir is not None:
        yield kubeconfig_path(state_dir)
        return
    with tempfile.TemporaryDirectory(prefix="kubestrata-bench-") as state:
        spec = FederationSpec(lower=2, nodes_per_lower=3)
        federation = Federation(Path(state), spec.clusters(), Toolchain.locate())
        try:
            federation.start()
            federation.start_virtual_nodes()
            yield federation.upper.kubeconfig
        finally:
            federation.stop()


def timed(action: Callable[[], object], rounds: int) -> list[float]:
    seconds = []
    for _ in range(rounds):
        began = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - began)
    return seconds


def summary(name: str, seconds: list[float]) -> str:
    return (
        f"{name:<44} median {statistics.median(seconds) * 1000:7.0f} ms "
        f"(min {min(seconds) * 1000:.0f}, max {max(seconds) * 1000:.0f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state-dir", type=Path, help="a running federation's (kubestrata up)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    kubectl = Toolchain.locate().kubectl
    with upper_kubeconfig(args.state_dir) as kubeconfig:

        def run(argv: list[str]) -> None:
            subprocess.run(argv, check=True, capture_output=True, timeout=60)

        command = timed(
            lambda: run(
                [sys.executable, "-m", "kubekit.cli", "status", f"--kubeconfig={kubeconfig}"]
            ),
            args.rounds,
        )
        reading = timed(lambda: asyncio.run(status.collect(str(kubeconfig))), args.rounds)
        direct = timed(
            lambda: run(
                [
                    str(kubectl),
                    f"--kubeconfig={kubeconfig}",
                    "get",
                    "nodes",
                    "-l",
                    f"{keys.VIRTUAL_NODE_LABEL}={keys.VIRTUAL_NODE_LABEL_VALUE}",
                ]
            ),
            args.rounds,
        )
        rows = asyncio.run(status.collect(str(kubeconfig)))
    print(f"{len(rows)} virtual nodes, {args.rounds} rounds each")
    print(summary("kubestrata status (the whole command)", command))
    print(summary("  its reads of the upper cluster, in-process", reading))
    print(summary("kubectl get nodes (the direct path)", direct))
    median = statistics.median(command)
    print(f"kubestrata status / kubectl get nodes: {median / statistics.median(direct):.1f}x")
    verdict = "met" if median < TARGET_SECONDS else "MISSED"
    print(f"target: status shown in under {TARGET_SECONDS:.0f} s: {median:.2f} s  {verdict}")


if __name__ == "__main__":
    main()
