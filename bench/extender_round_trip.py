"""The extender's filter decision without a cluster around it: what asking the virtual
nodes' estimators costs by itself, and with other processes wanting the same CPUs.

    .venv/bin/python bench/extender_round_trip.py [--decisions 1000] [--busy 4] [--rounds 3]

The estimators: ``--clusters`` processes, each the virtual node's own estimator service
(``virtual_node.estimator.serve``: its own thread and loop, TLS, the caller checked by an
authorizer that admits everyone, so no apiserver is asked) over one block of the nodes
``bench/placement.py`` uses (every ``--node-step``-th node of the openb trace's node list,
split in trace order), empty of pods. The caller: the multischeduler's ``Extender.filter``
with its ``EstimatorPool``, as the scheduler's filter call reaches it, minus HTTP. The
queries: the trace's pods (every ``--pod-step``-th of openb_pod_list_gpuspec33.csv) in
creation order as upper pods with their gpu_spec stashed, one decision at a time, each
pod's room released after its decision (as the scheduler choosing no virtual node would),
so the clusters stay empty. A pause of ``--gap`` ms between decisions, as the scheduler
leaves between pods.

Two ways per round: **quiet** (nothing else running on purpose), and **busy**: ``--busy``
processes spinning on the CPU meanwhile (on the two-core machine, 4 of them stand for the
dozen busy processes of bench/placement.py's burst).

Target: a filter decision p99 <= 5 ms (bench/placement.py's target), judged on the quiet
way: the decision's own cost. The busy way's figures are printed beside it, and for both
the CPU per decision of the caller (this process) and of the estimators together.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import cpu_snapshot, judge, spread
from estimator import lower_node, percentile, upper_pod
from placement import NODE_FILE, POD_FILE, TRACE_DIR, read_nodes, read_pods, split_blocks

from harness.localcluster import free_port
from kubekit import keys, pki
from kubekit.clusterstate import ClusterState
from multischeduler.estimators import CaFile, EstimatorPool
from multischeduler.extender import ExtenderArgs
from multischeduler.server import Extender
from virtual_node.estimator import EstimatorService, FitEstimator, serve
from virtual_node.kubeletapi.auth import Authorizer, User
from virtual_node.naming import NamespaceMapping
from virtual_node.translate import Ownership

P99_TARGET_SECONDS = 0.005


class Admitting(Authorizer):
    """Every caller is let in: the checks' cache hits are not what is measured."""

    def __init__(self) -> None:
        pass

    async def authenticate(
        self, peercert: dict[str, Any] | None, authorization: str, audience: str | None = None
    ) -> User:
        return User(name="extender")

    async def authorize_node_access(self, user: User, verb: str, subresource: str) -> None:
        return None


async def serve_block(args: argparse.Namespace) -> None:
    nodes = split_blocks(read_nodes(TRACE_DIR / NODE_FILE, args.node_step), args.clusters)
    owner = Ownership(origin="bench", node_name=f"vk-{args.serve}", cluster_id=args.serve)
    estimator = FitEstimator(ClusterState(), NamespaceMapping(), owner)
    for node in nodes[int(args.serve.removeprefix("lower-")) - 1]:
        estimator.state.set_node(lower_node(node))
    pair = pki.KeyPair(args.cert, args.key)
    service = EstimatorService(estimator, Admitting(), args.serve)
    server = await serve(service, "127.0.0.1", args.port, pair)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop(None)


def wait_listening(port: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def virtual_node_object(name: str, cluster_id: str, port: int) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {
                keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
                keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
                keys.CLUSTER_ID_LABEL: cluster_id,
            },
            "annotations": {keys.ESTIMATOR_ADDRESS_ANNOTATION: f"127.0.0.1:{port}"},
        }
    }


async def no_binding(_args: object) -> None:
    raise AssertionError("nothing is bound here")


async def no_lookup(_resource: object, _namespace: str | None, _name: str) -> None:
    raise AssertionError("no pod leaves a scheduler's queue here, no estimator fails")


async def decide(
    ca: Path, ports: dict[str, int], pods: list[dict[str, Any]], count: int, gap: float
) -> list[float]:
    pool = EstimatorPool(CaFile(ca))
    for cluster_id, port in ports.items():
        pool.put(virtual_node_object(f"vk-{cluster_id}", cluster_id, port))
    names = sorted(pool.nodes)
    extender = Extender(pool, no_binding, no_lookup)
    times: list[float] = []
    # The first calls open the channels: not a decision's cost.
    for index, pod in enumerate(itertools.islice(itertools.cycle(pods), count + 20)):
        pod = {**pod, "metadata": {**pod["metadata"], "uid": f"uid-{index}"}}
        began = time.perf_counter()
        await extender.filter(ExtenderArgs(pod=pod, uid=f"uid-{index}", node_names=names))
        if index >= 20:
            times.append(time.perf_counter() - began)
        pool.release(names, f"uid-{index}")
        await asyncio.sleep(gap)
    for name in names:
        pool.remove({"metadata": {"name": name}})
    await asyncio.sleep(0.1)
    return sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", type=int, default=4)
    parser.add_argument("--node-step", type=int, default=8)
    parser.add_argument("--pod-step", type=int, default=8)
    parser.add_argument("--decisions", type=int, default=1000, help="per way and round")
    parser.add_argument("--gap", type=float, default=10.0, help="ms between decisions")
    parser.add_argument("--busy", type=int, default=4, help="spinning processes, busy way")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cert", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--key", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve_block(args))
        return

    pods = [upper_pod(pod, i) for i, pod in enumerate(read_pods(TRACE_DIR / POD_FILE, 1))]
    pods = pods[:: args.pod_step]
    print(
        f"{args.clusters} estimators over every {args.node_step}th node of {NODE_FILE}, split "
        f"in trace order; queries: every {args.pod_step}th pod of {POD_FILE} ({len(pods)}), "
        f"{args.decisions} decisions per way and round, {args.gap:g} ms apart"
    )
    figures: dict[str, list[tuple[float, float]]] = {"quiet": [], "busy": []}
    # CPU per decision, ms: (the caller, the estimators together).
    cpu: dict[str, list[tuple[float, float]]] = {"quiet": [], "busy": []}
    with tempfile.TemporaryDirectory(prefix="kubestrata-round-trip-") as temporary:
        directory = Path(temporary)
        ca = pki.create_ca(directory, "estimators")
        ports: dict[str, int] = {}
        servers: list[subprocess.Popen[bytes]] = []
        try:
            for index in range(1, args.clusters + 1):
                cluster_id = f"lower-{index}"
                pair = pki.issue(
                    ca, directory / cluster_id, cluster_id, server_names=("127.0.0.1",)
                )
                ports[cluster_id] = free_port()
                servers.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            *("--serve", cluster_id, "--port", str(ports[cluster_id])),
                            *("--cert", str(pair.cert_path), "--key", str(pair.key_path)),
                            *("--clusters", str(args.clusters)),
                            *("--node-step", str(args.node_step)),
                        ]
                    )
                )
            for port in ports.values():
                wait_listening(port)
            for number in range(1, args.rounds + 1):
                for way in ("quiet", "busy"):
                    spinners = [
                        subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(args.busy if way == "busy" else 0)
                    ]
                    pids = {"caller": os.getpid()} | {
                        str(index): server.pid for index, server in enumerate(servers)
                    }
                    cpu_before = cpu_snapshot(pids)
                    try:
                        times = asyncio.run(
                            decide(ca.cert_path, ports, pods, args.decisions, args.gap / 1000)
                        )
                    finally:
                        for spinner in spinners:
                            spinner.kill()
                            spinner.wait()
                    cpu_after = cpu_snapshot(pids)
                    used = {name: cpu_after[name] - cpu_before[name] for name in pids}
                    caller = used.pop("caller")
                    p50, p99 = percentile(times, 0.5), percentile(times, 0.99)
                    figures[way].append((p50, p99))
                    # Per decision, the 20 that open the channels included.
                    decisions = len(times) + 20
                    cpu[way].append(
                        (caller / decisions * 1000, sum(used.values()) / decisions * 1000)
                    )
                    print(
                        f"round {number} {way:5}: filter decision p50 {p50 * 1000:.2f} ms, "
                        f"p99 {p99 * 1000:.2f} ms, "
                        f"{sum(t <= P99_TARGET_SECONDS for t in times) / len(times):.1%} "
                        f"within 5 ms; CPU per decision: caller {cpu[way][-1][0]:.2f} ms, "
                        f"estimators {cpu[way][-1][1]:.2f} ms"
                    )
        finally:
            for server in servers:
                server.kill()
                server.wait()
    print(f"over {args.rounds} rounds: median (min-max), ms")
    for way, label in (("quiet", "quiet"), ("busy", f"busy, {args.busy} spinning")):
        p50s = [p50 * 1000 for p50, _ in figures[way]]
        p99s = [p99 * 1000 for _, p99 in figures[way]]
        callers = [caller for caller, _ in cpu[way]]
        estimators = [together for _, together in cpu[way]]
        print(
            f"    {label}: p50 {spread(p50s, '.2f')}, p99 {spread(p99s, '.2f')}; CPU per "
            f"decision: caller {spread(callers, '.2f')}, estimators {spread(estimators, '.2f')}"
        )
    print("target (judged on the median, quiet way):")
    judge(
        "filter decision p99 <= 5 ms",
        [p99 * 1000 for _, p99 in figures["quiet"]],
        lambda v: v <= P99_TARGET_SECONDS * 1000,
        ".2f",
    )


if __name__ == "__main__":
    main()
