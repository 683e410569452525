"""The fit estimator's answer time on a 1,000-node lower cluster from a production trace.

    .venv/bin/python bench/estimator.py [--nodes 1000] [--queries 2000] [--rounds 3]

The lower cluster: the first ``--nodes`` nodes of the Alibaba openb trace's node list
(/work/shared/data/alibaba-openb-2023/openb_node_list_all_node.csv) with their cpu,
memory, ``nvidia.com/gpu`` and a GPU-model label, filled by the pods of
openb_pod_list_gpuspec33.csv in creation order, each bound to the first node that fits
it, until 20,000 pods (the trace has 8,152: the list is cycled, names made unique) or no
node takes the next one. Those pods are fed to the estimator as the lower Pod watch
would. The queries: the trace's pods in order, each as an upper pod bound to nothing, with
its gpu_spec as a required node affinity stashed by the webhook.

Two ways, measured in the same run on the same cluster and queries:

- incremental: what a virtual node does, ``FitEstimator.answer`` over the ClusterState
  kept by watch events: JSON decoding, the stash restored into the lower pod, the fit of
  every node, the message; no reservation.
- recomputed: the same answer from a ClusterState rebuilt from every node and pod for the
  query, as an estimator that keeps no per-node totals would (on 1/20th of the queries:
  it is slow).

Targets: incremental p99 <= 1 ms. Each round measures both ways; the figures are the
median and min-max over the rounds.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from placement import (
    NODE_FILE,
    POD_FILE,
    TRACE_DIR,
    TraceNode,
    TracePod,
    node_spec,
    pod_manifest,
    read_nodes,
    read_pods,
)

from kubekit import stash
from kubekit.clusterstate import ClusterState
from virtual_node.estimator import FitEstimator
from virtual_node.naming import NamespaceMapping
from virtual_node.translate import Ownership

P99_TARGET_SECONDS = 0.001
LOWER_PODS = 20_000


def lower_node(node: TraceNode) -> dict[str, Any]:
    manifest = node_spec(node).manifest()
    manifest["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    return manifest


def upper_pod(pod: TracePod, index: int) -> dict[str, Any]:
    manifest = pod_manifest(pod)
    spec, annotations = stash.stash_scheduling(manifest["spec"], {})
    manifest["metadata"] = {
        "name": f"{pod.name}-{index}",
        "namespace": "bench",
        "uid": f"uid-{index}",
        "annotations": annotations,
    }
    manifest["spec"] = spec
    return manifest


def fill(state: ClusterState, trace_pods: list[TracePod]) -> list[dict[str, Any]]:
    """Binds trace pods to the first node that fits each, as foreign lower pods."""
    placed: list[dict[str, Any]] = []
    for index, trace_pod in enumerate(itertools.islice(itertools.cycle(trace_pods), LOWER_PODS)):
        pod = pod_manifest(trace_pod)
        pod["metadata"] = {"name": f"lower-{index}", "namespace": "tenant"}
        pod["status"] = {"phase": "Running"}
        estimate = state.estimate(pod)
        if not estimate.fitting:
            continue
        pod["spec"]["nodeName"] = estimate.fitting[0]
        state.set_pod(pod)
        placed.append(pod)
    return placed


def timed(queries: Iterator[bytes], count: int, answer: Callable[[bytes], object]) -> list[float]:
    times = []
    for query in itertools.islice(queries, count):
        began = time.perf_counter()
        answer(query)
        times.append(time.perf_counter() - began)
    return sorted(times)


def percentile(values: list[float], fraction: float) -> float:
    return values[min(len(values) - 1, int(fraction * len(values)))]


def spread(values: list[float], scale: float = 1000.0) -> str:
    return (
        f"{statistics.median(values) * scale:.3f} ms "
        f"[{min(values) * scale:.3f}-{max(values) * scale:.3f}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    nodes = [lower_node(node) for node in read_nodes(TRACE_DIR / NODE_FILE, 1)[: args.nodes]]
    trace_pods = read_pods(TRACE_DIR / POD_FILE, 1)
    owner = Ownership(origin="bench", node_name="vk-bench", cluster_id="bench")
    estimator = FitEstimator(ClusterState(), NamespaceMapping(), owner)
    for node in nodes:
        estimator.state.set_node(node)
    lower_pods = fill(estimator.state, trace_pods)
    queries = [orjson.dumps(upper_pod(pod, i)) for i, pod in enumerate(trace_pods)]
    print(
        f"lower cluster: {len(nodes)} nodes of openb_node_list_all_node.csv (the first), "
        f"{len(lower_pods)} pods of openb_pod_list_gpuspec33.csv bound first-fit; "
        f"queries: its {len(queries)} pods in creation order, gpu_spec as stashed affinity"
    )

    def recomputed(query: bytes) -> object:
        state = ClusterState()
        for node in nodes:
            state.set_node(node)
        for pod in lower_pods:
            state.set_pod(pod)
        rebuilt = FitEstimator(state, NamespaceMapping(), owner)
        return rebuilt.answer(query)

    p50s: list[float] = []
    p99s: list[float] = []
    slow_p50s: list[float] = []
    for round_number in range(1, args.rounds + 1):
        cycle = itertools.cycle(queries)
        fast = timed(cycle, args.queries, estimator.answer)
        slow = timed(cycle, max(1, args.queries // 20), recomputed)
        p50s.append(percentile(fast, 0.5))
        p99s.append(percentile(fast, 0.99))
        slow_p50s.append(percentile(slow, 0.5))
        print(
            f"round {round_number}: incremental p50 {p50s[-1] * 1000:.3f} ms, "
            f"p99 {p99s[-1] * 1000:.3f} ms ({len(fast)} answers); recomputed p50 "
            f"{slow_p50s[-1] * 1000:.1f} ms ({len(slow)} answers); ratio "
            f"{slow_p50s[-1] / p50s[-1]:.0f}x"
        )
    print(f"over {args.rounds} rounds: median [min-max]")
    print(f"  incremental answer p50: {spread(p50s)}")
    print(f"  incremental answer p99: {spread(p99s)}")
    print(f"  recomputed answer p50:  {spread(slow_p50s)}")
    ratios = [slow / fast for slow, fast in zip(slow_p50s, p50s, strict=True)]
    print(
        f"  recomputed / incremental (p50): {statistics.median(ratios):.0f}x "
        f"[{min(ratios):.0f}-{max(ratios):.0f}]"
    )
    verdict = "met" if statistics.median(p99s) <= P99_TARGET_SECONDS else "MISSED"
    print(
        f"{verdict}: answer for a {len(nodes)}-node lower cluster p99 <= "
        f"{P99_TARGET_SECONDS * 1000:.0f} ms (median of rounds {spread(p99s)})"
    )


if __name__ == "__main__":
    main()
