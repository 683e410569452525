"""`kubectl logs`, `exec` and `port-forward` through a virtual node vs straight to the lower
cluster.

    .venv/bin/python bench/kubelet_api.py [--log-mib 64] [--forward-mib 64] [--rounds 3]

One federation (1 upper + 1 lower cluster with one kwok node). One pod is created
in the upper cluster, tolerating the virtual node's taint, so it lands on `vk-lower-1`
and is mirrored into the lower cluster under the same namespace and name. Every figure
is taken twice with the stock kubectl against that one pod: once with the upper
kubeconfig (kubectl -> upper apiserver -> virtual node's kubelet API -> lower apiserver
-> kwok) and once with the lower kubeconfig (kubectl -> lower apiserver -> kwok), so the
difference is what the upper apiserver plus the virtual node add.

- logs: kwok's pod log file is filled with N MiB of CRI lines; `kubectl logs` is run
  once each way into a file (byte counts and digests compared), then 3 times each way
  into /dev/null, interleaved; median MiB/s of the log text both ways and the ratio.
- exec: `kubectl exec <pod> -- true` 20 times each way, interleaved: median and p90 wall
  time and the median added. This counts kubectl's start and its connection setup, so
  a persistent session is measured as well: `kubectl exec -i <pod> -- cat` kept open,
  one line written and read back 200 times each way; median and p90 per round trip and
  the median added, which is what the virtual node adds to every message of a session.
- port-forward: a TCP server on the loopback port kwok forwards every pod port to sends
  M MiB on each connection; `kubectl port-forward pod/<pod> :80` runs each way and the
  payload is downloaded through each 1 + 3 times (the first a warm-up, each on a new
  connection, timed to its last byte); median MiB/s both ways and the ratio.

All four are one round, against the same federation and pod; ``--rounds`` of them (3 by
default), then every figure's median and min-max over the rounds and a met/MISSED line
per target, judged on the median: logs >= 0.80 x direct; an open session's round trip
+10 ms at most (p50); a new exec session +5 ms at most (p50); port-forward >= 0.8 x
direct.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import socket
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common import Target, summarize

from harness.federation import Federation, FederationSpec, virtual_node_name
from harness.localcluster import LocalCluster
from harness.process import ManagedProcess
from harness.toolchain import Toolchain
from kubekit import keys

NAMESPACE = "bench"
POD = "api"
MIB = 1 << 20
LOG_LINE_TEXT = 180  # characters of text per log line, then "\n"
EXEC_RUNS = 20
SESSION_ROUND_TRIPS = 200
REPEATS = 3


class BenchFailure(RuntimeError):
    """A kubectl command through one of the paths failed or hung."""


def pod_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": POD, "namespace": NAMESPACE},
                "spec": {
                    "tolerations": [{"key": keys.PROVIDER_TAINT_KEY, "operator": "Exists"}],
                    "terminationGracePeriodSeconds": 0,
                    "containers": [
                        {
                            "name": "app",
                            "image": "registry.k8s.io/pause:3.10",
                            "ports": [{"containerPort": 80}],
                        }
                    ],
                },
            },
        ],
    }


def kubectl_argv(cluster: LocalCluster, *args: str) -> list[str]:
    return [str(cluster.toolchain.kubectl), f"--kubeconfig={cluster.kubeconfig}", *args]


def wait_running(cluster: LocalCluster, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = cluster.kubectl("get", "pod", POD, "-n", NAMESPACE, "-o", "json", check=False)
        if found.returncode == 0:
            pod: dict[str, Any] = json.loads(found.stdout)
            if pod.get("status", {}).get("phase") == "Running":
                return pod
        if time.monotonic() > deadline:
            raise BenchFailure(f"pod {NAMESPACE}/{POD} not Running in {cluster.name}")
        time.sleep(0.3)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def run(argv: list[str], timeout: float, stdout: Any = subprocess.DEVNULL) -> float:
    """Runs a command to completion; returns its wall time in seconds."""
    began = time.perf_counter()
    try:
        result = subprocess.run(
            argv, stdout=stdout, stderr=subprocess.PIPE, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise BenchFailure(f"`{' '.join(argv[2:])}` hung (> {timeout:.0f} s)") from error
    elapsed = time.perf_counter() - began
    if result.returncode != 0:
        raise BenchFailure(
            f"`{' '.join(argv[2:])}` failed ({result.returncode}): "
            f"{result.stderr.decode(errors='replace').strip()}"
        )
    return elapsed


# -- logs ---------------------------------------------------------------------------------


def fill_log(lower: LocalCluster, mib: int) -> int:
    """Appends CRI lines until the log file holds ``mib`` MiB; returns the byte count of
    the log text kubectl should receive (each line's text and its newline)."""
    line = ("x" * 9 + " ") * (LOG_LINE_TEXT // 10)
    batch = [f"{i:08d} {line}"[:LOG_LINE_TEXT] for i in range(4096)]
    while lower.pod_log_file.stat().st_size < mib * MIB:
        lower.append_pod_log(*batch)
    expected = 0
    with lower.pod_log_file.open("rb") as log:
        for raw in log:
            expected += len(raw.split(b" ", 3)[3])
    return expected


def digest(path: Path) -> tuple[int, str]:
    hasher = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(MIB):
            hasher.update(chunk)
    return path.stat().st_size, hasher.hexdigest()[:12]


def bench_logs(
    paths: dict[str, LocalCluster], expected: int, workdir: Path
) -> dict[str, list[float]]:
    argv = {name: kubectl_argv(c, "logs", POD, "-n", NAMESPACE) for name, c in paths.items()}
    received = {}
    for name, command in argv.items():
        out = workdir / f"logs-{name}.txt"
        with out.open("wb") as file:
            run(command, 300, stdout=file)
        received[name] = digest(out)
        out.unlink()
    if len(set(received.values())) != 1 or received["virtual"][0] != expected:
        raise BenchFailure(f"log bytes differ: expected {expected}, received {received}")
    seconds: dict[str, list[float]] = {name: [] for name in argv}
    for _ in range(REPEATS):
        for name, command in argv.items():
            seconds[name].append(run(command, 300))
    return seconds


# -- exec ---------------------------------------------------------------------------------


def bench_exec_processes(paths: dict[str, LocalCluster]) -> dict[str, list[float]]:
    argv = {
        name: kubectl_argv(c, "exec", POD, "-n", NAMESPACE, "--", "true")
        for name, c in paths.items()
    }
    for command in argv.values():
        run(command, 60)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in argv}
    for _ in range(EXEC_RUNS):
        for name, command in argv.items():
            seconds[name].append(run(command, 60))
    return seconds


def read_exactly(fd: int, size: int, deadline: float) -> bytes:
    data = b""
    while len(data) < size:
        if time.monotonic() > deadline:
            raise BenchFailure(f"echo of a session line did not come back ({data!r} so far)")
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise BenchFailure(f"session ended after {data!r}")
        data += chunk
    return data


def bench_exec_session(cluster: LocalCluster) -> list[float]:
    """Round trips of one line through `kubectl exec -i <pod> -- cat`, in seconds."""
    argv = kubectl_argv(cluster, "exec", "-i", POD, "-n", NAMESPACE, "--", "cat")
    process = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
    )
    assert process.stdin is not None and process.stdout is not None
    stdout = process.stdout.fileno()
    # A watchdog instead of non-blocking reads: a hung session is killed and reported.
    watchdog = threading.Timer(120, process.kill)
    watchdog.start()
    try:
        seconds = []
        for index in range(SESSION_ROUND_TRIPS + 5):
            line = f"round trip {index:06d}\n".encode()
            began = time.perf_counter()
            process.stdin.write(line)
            echoed = read_exactly(stdout, len(line), time.monotonic() + 60)
            elapsed = time.perf_counter() - began
            if echoed != line:
                raise BenchFailure(f"`kubectl exec -i ... cat` echoed {echoed!r} for {line!r}")
            if index >= 5:  # the first few are warm-up
                seconds.append(elapsed)
        # Stdin EOF does not end `cat` under kwok, even directly: the session is killed.
        process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(2)
        return seconds
    except BenchFailure as failure:
        process.kill()
        process.wait()
        assert process.stderr is not None
        stderr = process.stderr.read().decode(errors="replace").strip()
        raise BenchFailure(f"{failure} (via {cluster.name}; kubectl stderr: {stderr!r})") from None
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()


# -- port-forward -------------------------------------------------------------------------


class PayloadServer(socketserver.ThreadingTCPServer):
    """On each connection: sends ``size`` bytes and discards whatever arrives."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, size: int) -> None:
        self.size = size
        self.block = os.urandom(MIB)
        super().__init__(("127.0.0.1", port), PayloadHandler)


class PayloadHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server = self.server
        assert isinstance(server, PayloadServer)
        connection: socket.socket = self.request

        def discard() -> None:
            with contextlib.suppress(OSError):
                while connection.recv(65536):
                    pass

        threading.Thread(target=discard, daemon=True).start()
        with contextlib.suppress(OSError):
            left = server.size
            block = memoryview(server.block)
            while left > 0:
                connection.sendall(block[: min(left, len(block))])
                left -= len(block)
            connection.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def port_forward(cluster: LocalCluster) -> Iterator[int]:
    argv = kubectl_argv(cluster, "port-forward", "-n", NAMESPACE, f"pod/{POD}", ":80")
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stderr is not None
    watchdog = threading.Timer(30, process.kill)
    watchdog.start()
    try:
        port = None
        for line in process.stdout:
            found = re.match(r"Forwarding from 127\.0\.0\.1:(\d+)", line)
            if found:
                port = int(found.group(1))
                break
        watchdog.cancel()
        if port is None:
            process.wait()
            raise BenchFailure(
                f"`kubectl port-forward` via {cluster.name} printed no port: "
                f"{process.stderr.read().strip()}"
            )
        stream = process.stdout
        threading.Thread(target=lambda: stream.read(), daemon=True).start()
        yield port
    finally:
        watchdog.cancel()
        process.terminate()
        process.wait(10)


def download(port: int, size: int, timeout: float = 60) -> float:
    """Downloads the payload through a forwarded port; seconds to its last byte. Counts
    bytes instead of waiting for the close: the close does not travel back through
    kubectl port-forward and kwok (neither way)."""
    buffer = bytearray(MIB)
    received = 0
    began = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        try:
            while received < size:
                n = connection.recv_into(buffer)
                if not n:
                    break
                received += n
        except TimeoutError:
            raise BenchFailure(
                f"port-forward on :{port} stalled after {received} of {size} bytes"
            ) from None
    elapsed = time.perf_counter() - began
    if received != size:
        raise BenchFailure(f"port-forward on :{port} delivered {received} of {size} bytes")
    return elapsed


def bench_port_forward(paths: dict[str, LocalCluster], size: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {}
    for name, cluster in paths.items():
        with port_forward(cluster) as port:
            try:
                download(port, size)  # warm-up
                seconds[name] = [download(port, size) for _ in range(REPEATS)]
            except (OSError, BenchFailure) as error:
                raise BenchFailure(f"port-forward via {cluster.name}: {error}") from error
    return seconds


# -- report -------------------------------------------------------------------------------

# One round's figures by name; a measure that failed in a round gives none that round.
Figures = dict[str, float]


TARGETS = (
    Target("logs through the virtual node >= 0.80 x direct", "logs ratio", lambda v: v >= 0.80),
    Target(
        "round trip added in an open exec session, p50 <= 10 ms",
        "exec session rtt added p50 ms",
        lambda v: v <= 10,
    ),
    Target("a new exec session added, p50 <= 5 ms", "exec -- true added p50 ms", lambda v: v <= 5),
    Target(
        "port-forward through the virtual node >= 0.8 x direct",
        "port-forward ratio",
        lambda v: v >= 0.8,
    ),
)


def attempt(label: str, virtual_node: ManagedProcess, measure: Callable[[], Figures]) -> Figures:
    try:
        return measure()
    except (BenchFailure, OSError, subprocess.SubprocessError) as error:
        print(f"    {label}: FAILED: {error}")
        print(f"      tail of {virtual_node.log_path}:")
        for line in virtual_node.log_tail(20).splitlines():
            print(f"        {line}")
        return {}


def latency_figures(label: str, ms: dict[str, list[float]]) -> Figures:
    d50, v50 = statistics.median(ms["direct"]), statistics.median(ms["virtual"])
    d90, v90 = percentile(ms["direct"], 0.9), percentile(ms["virtual"], 0.9)
    return {
        f"{label} direct p50 ms": d50,
        f"{label} virtual p50 ms": v50,
        f"{label} added p50 ms": v50 - d50,
        f"{label} added p90 ms": v90 - d90,
    }


def rate_figures(label: str, rate: dict[str, float]) -> Figures:
    return {
        f"{label} direct MiB/s": rate["direct"],
        f"{label} virtual MiB/s": rate["virtual"],
        f"{label} ratio": rate["virtual"] / rate["direct"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log-mib", type=int, default=64)
    parser.add_argument("--forward-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="default %(default)s")
    args = parser.parse_args()
    specs = FederationSpec(lower=1, nodes_per_lower=1).clusters()
    rounds: list[Figures] = []
    with tempfile.TemporaryDirectory(prefix="kubestrata-bench-") as state:
        began = time.monotonic()
        federation = Federation(Path(state), specs, Toolchain.locate())
        federation.start()
        server: PayloadServer | None = None
        try:
            federation.start_virtual_nodes()
            lower = federation.clusters["lower-1"]
            upper = federation.upper
            virtual_node = federation.components[virtual_node_name("lower-1")]
            upper.kubectl("apply", "-f", "-", input=json.dumps(pod_manifest()))
            upper_pod = wait_running(upper)
            lower_pod = wait_running(lower)
            assert upper_pod["spec"]["nodeName"] == "vk-lower-1", upper_pod["spec"]["nodeName"]
            print(
                f"federation up, pod {NAMESPACE}/{POD} Running on vk-lower-1 (upper) and "
                f"{lower_pod['spec']['nodeName']} (lower) after {time.monotonic() - began:.0f} s"
            )
            paths = {"virtual": upper, "direct": lower}
            expected = fill_log(lower, args.log_mib)
            size = args.forward_mib * MIB
            server = PayloadServer(lower.ports.pod_ports, size)
            threading.Thread(target=server.serve_forever, daemon=True).start()

            def logs() -> Figures:
                seconds = bench_logs(paths, expected, Path(state))
                rate = {n: expected / MIB / statistics.median(s) for n, s in seconds.items()}
                return rate_figures("logs", rate)

            def exec_processes() -> Figures:
                seconds = bench_exec_processes(paths)
                ms = {n: [s * 1000 for s in v] for n, v in seconds.items()}
                return latency_figures("exec -- true", ms)

            def exec_session() -> Figures:
                ms = {n: [s * 1000 for s in bench_exec_session(c)] for n, c in paths.items()}
                return latency_figures("exec session rtt", ms)

            def forward() -> Figures:
                seconds = bench_port_forward(paths, size)
                rate = {n: args.forward_mib / statistics.median(s) for n, s in seconds.items()}
                return rate_figures("port-forward", rate)

            print(
                f"each round: logs of {expected / MIB:.0f} MiB 1 + {REPEATS} times each way; "
                f"`kubectl exec -- true` {EXEC_RUNS} times each way; {SESSION_ROUND_TRIPS} "
                f"round trips in an open `kubectl exec -i -- cat`; a port-forward download of "
                f"{args.forward_mib} MiB 1 + {REPEATS} times each way"
            )
            for number in range(1, args.rounds + 1):
                figures: Figures = {}
                for label, measure in (
                    ("logs", logs),
                    ("exec", exec_processes),
                    ("exec session", exec_session),
                    ("port-forward", forward),
                ):
                    figures |= attempt(label, virtual_node, measure)
                print(
                    f"round {number}/{args.rounds}: "
                    + ", ".join(f"{name} {value:.2f}" for name, value in figures.items())
                )
                rounds.append(figures)
        finally:
            if server is not None:
                server.shutdown()
                server.server_close()
            federation.stop()
    summarize(rounds, TARGETS, ".2f")
    print(f"total {time.monotonic() - began:.0f} s")
    if not all(rounds):
        sys.exit("a round measured nothing")


if __name__ == "__main__":
    main()
