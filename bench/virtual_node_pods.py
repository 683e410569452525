"""Pods through a virtual node vs the same pods created directly in the lower cluster.

    .venv/bin/python bench/virtual_node_pods.py [--pods 1000]

One run, one federation (1 upper + 1 lower cluster): N pods created in the lower cluster
directly, then N pods created in the upper cluster bound to the virtual node (their
`spec.nodeName` set, as a scheduler or a user binding them would; `--upper-scheduler`
has the upper kube-scheduler place them instead, which adds its binding and event).
Prints time to all Running both ways and the ratio, per-pod start latency (p50/p99) both
ways and what the virtual node adds, the virtual node's RSS per mirrored pod, and the
time a restarted virtual node takes to list both sides again with N pods; then the CPU
each process used and the API requests each apiserver served per pod.

By default the machine's CPUs are split in two, as if upper and lower clusters ran on
machines of their own: the lower cluster's processes on one half, the upper cluster's,
the virtual node's and this client's on the other, in both runs. `--shared-cpus` lets
everything share all CPUs instead: then the via run also pays for the upper control
plane out of the lower cluster's CPU, and the ratio measures the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kubekit import keys
from kubekit.client import NAMESPACES, PODS, ClientSettings, KubeClient
from kubekit.federation import Federation, virtual_node_name
from kubekit.informer import FunctionHandler, Informer
from kubekit.localcluster import ClusterSpec, LocalCluster, NodeSpec
from kubekit.toolchain import Toolchain


def pod(name: str, federated: bool, node_name: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
        "terminationGracePeriodSeconds": 0,
    }
    if federated:
        spec["tolerations"] = [{"key": keys.PROVIDER_TAINT_KEY, "operator": "Exists"}]
    if node_name:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


async def run_pods(
    cluster: LocalCluster,
    namespace: str,
    count: int,
    federated: bool,
    node_name: str | None = None,
) -> tuple[float, list[float]]:
    """Creates ``count`` pods and returns (seconds to all Running, per-pod latencies)."""
    async with await KubeClient.connect(
        ClientSettings(str(cluster.kubeconfig), qps=0, burst=1)
    ) as client:
        await client.create(
            NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        )
        created: dict[str, float] = {}
        running: dict[str, float] = {}
        done = asyncio.Event()

        def observe(obj: dict[str, Any]) -> None:
            name = obj["metadata"]["name"]
            if obj.get("status", {}).get("phase") == "Running" and name not in running:
                running[name] = time.monotonic()
                if len(running) == count:
                    done.set()

        informer = Informer(client, PODS, namespace=namespace)
        informer.add_handler(FunctionHandler.on_any(observe))
        watcher = asyncio.create_task(informer.run())
        await informer.wait_synced()
        limit = asyncio.Semaphore(32)

        async def create(index: int) -> None:
            name = f"p-{index:05d}"
            async with limit:
                await client.create(PODS, pod(name, federated, node_name), namespace)
                created[name] = time.monotonic()

        began = time.monotonic()
        await asyncio.gather(*(create(i) for i in range(count)))
        await asyncio.wait_for(done.wait(), timeout=60 + count * 0.2)
        total = time.monotonic() - began
        watcher.cancel()
        latencies = sorted(running[n] - created[n] for n in created)
        return total, latencies


def percentile(sorted_values: list[float], fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+)", status)
    return int(match.group(1)) if match else 0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def federation_processes(federation: Federation) -> dict[str, int]:
    pids = {
        f"{cluster}/{name}": process.pid
        for cluster, local in federation.clusters.items()
        for name, process in local.processes.items()
    }
    pids.update({name: process.pid for name, process in federation.components.items()})
    pids["benchmark client (this process)"] = os.getpid()
    return pids


def pin(pids: Iterable[int], cpus: set[int]) -> None:
    """Every thread of each process onto ``cpus`` (threads made later inherit it)."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except ProcessLookupError:
                continue  # a thread that has just ended


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def print_cpu(title: str, wall: float, before: dict[str, float], after: dict[str, float]) -> None:
    used = {name: after[name] - before[name] for name in before}
    total = sum(used.values())
    print(
        f"CPU {title}: {total:.1f} s in {wall:.1f} s of wall time "
        f"({total / wall:.2f} of {os.cpu_count()} cores)"
    )
    for name, seconds in sorted(used.items(), key=lambda item: -item[1]):
        if seconds >= 0.05 * total:
            print(f"    {name:40} {seconds:6.1f} s")


REQUEST_SAMPLE = re.compile(r"^apiserver_request_total\{([^}]*)\} (\S+)$", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')


async def request_counts(cluster: LocalCluster) -> Counter[str]:
    """apiserver_request_total of one apiserver, summed by verb, resource and subresource."""
    async with await KubeClient.connect(ClientSettings(str(cluster.kubeconfig))) as client:
        response = await client.stream("/metrics", {})
        try:
            text = await response.text()
        finally:
            response.release()
    counts: Counter[str] = Counter()
    for labels, value in REQUEST_SAMPLE.findall(text):
        label = dict(LABEL.findall(labels))
        resource = "/".join(filter(None, (label.get("resource"), label.get("subresource"))))
        counts[f"{label.get('verb')} {resource}"] += int(float(value))
    return counts


def print_requests(title: str, count: int, before: Counter[str], after: Counter[str]) -> None:
    made = after - before
    print(f"API requests {title}: {sum(made.values()) / count:.1f} per pod")
    for request, number in made.most_common():
        if number >= count // 4:
            print(f"    {request:40} {number / count:6.2f} per pod")


def wait_log(path: Path, marker: str, after: int, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text()
        if marker in text[after:]:
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(f"{marker!r} not in {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument(
        "--shared-cpus",
        action="store_true",
        help="do not split the CPUs between the upper and the lower side",
    )
    parser.add_argument(
        "--upper-scheduler",
        action="store_true",
        help="have the upper kube-scheduler place the pods instead of binding them",
    )
    args = parser.parse_args()
    count = args.pods
    nodes = max(2, -(-count // 500))
    specs = [
        ClusterSpec("upper", "upper"),
        ClusterSpec(
            "lower-1",
            "lower",
            tuple(
                NodeSpec(
                    f"lower-1-node-{i}", cpu="64", memory="256Gi", pods=-(-count * 2 // nodes) + 10
                )
                for i in range(nodes)
            ),
        ),
    ]
    with tempfile.TemporaryDirectory(prefix="kubestrata-bench-") as state:
        federation = Federation(Path(state), specs, Toolchain.locate())
        federation.start()
        federation.start_virtual_nodes()
        try:
            lower = federation.clusters["lower-1"]
            component = federation.components[virtual_node_name("lower-1")]
            pids = federation_processes(federation)
            all_cpus = os.sched_getaffinity(0)
            if not args.shared_cpus and len(all_cpus) >= 2:
                ordered = sorted(all_cpus)
                lower_cpus = set(ordered[: len(ordered) // 2])
                pin([pid for name, pid in pids.items() if name.startswith("lower-1/")], lower_cpus)
                pin(
                    [pid for name, pid in pids.items() if not name.startswith("lower-1/")],
                    all_cpus - lower_cpus,
                )
                print(
                    f"CPUs: lower cluster on {sorted(lower_cpus)}, upper cluster, virtual node "
                    f"and client on {sorted(all_cpus - lower_cpus)}"
                )
            else:
                print(f"CPUs: every process on all of {sorted(all_cpus)}")
            time.sleep(5)

            apiservers = {"upper": federation.upper, "lower": lower}

            def requests_now() -> dict[str, Counter[str]]:
                return {name: asyncio.run(request_counts(c)) for name, c in apiservers.items()}

            requests_before = requests_now()
            before_direct = cpu_snapshot(pids)
            direct_total, direct_lat = asyncio.run(
                run_pods(lower, "direct", count, federated=False)
            )
            # After the direct run: the lower pods it made stay cached but are not mirrored.
            time.sleep(5)
            idle_rss = rss_kib(component.pid)
            before_via = cpu_snapshot(pids)
            requests_between = requests_now()
            via_total, via_lat = asyncio.run(
                run_pods(
                    federation.upper,
                    "bench",
                    count,
                    federated=True,
                    node_name=None if args.upper_scheduler else keys.default_node_name("lower-1"),
                )
            )
            after_via = cpu_snapshot(pids)
            requests_after = requests_now()
            time.sleep(5)
            loaded_rss = rss_kib(component.pid)
            pin(pids.values(), all_cpus)

            log = component.log_path
            offset = len(log.read_text())
            component.kill()
            restarted = time.monotonic()
            component.start()
            resync = wait_log(log, "caches synced", offset) - restarted

            d50, d99 = percentile(direct_lat, 0.5), percentile(direct_lat, 0.99)
            v50, v99 = percentile(via_lat, 0.5), percentile(via_lat, 0.99)
            per_pod = (loaded_rss - idle_rss) / count
            placed = "upper kube-scheduler" if args.upper_scheduler else "spec.nodeName"
            print(f"pods: {count} (lower cluster: {nodes} kwok nodes; upper pods: {placed})")
            print(
                f"direct in lower:  all Running in {direct_total:6.2f} s, "
                f"start latency p50 {d50:.3f} s, p99 {d99:.3f} s"
            )
            print(
                f"via virtual node: all Running in {via_total:6.2f} s, "
                f"start latency p50 {v50:.3f} s, p99 {v99:.3f} s"
            )
            print(f"ratio (direct time / virtual-node time): {direct_total / via_total:.2f}")
            print(f"added start latency: p50 {v50 - d50:+.3f} s, p99 {v99 - d99:+.3f} s")
            print(
                f"virtual-node RSS: before {idle_rss / 1024:.0f} MiB, after "
                f"{loaded_rss / 1024:.0f} MiB, {per_pod:.1f} KiB per mirrored pod"
            )
            print(f"restart resync (start to both sides listed, {count} pods): {resync:.2f} s")
            print(
                f"mean start latency: direct {statistics.mean(direct_lat):.3f} s, "
                f"virtual node {statistics.mean(via_lat):.3f} s"
            )
            print_cpu("direct (federation processes)", direct_total, before_direct, before_via)
            print_cpu("via virtual node", via_total, before_via, after_via)
            for name in apiservers:
                print_requests(
                    f"direct, {name} apiserver",
                    count,
                    requests_before[name],
                    requests_between[name],
                )
                print_requests(
                    f"via virtual node, {name} apiserver",
                    count,
                    requests_between[name],
                    requests_after[name],
                )
        finally:
            federation.stop()


if __name__ == "__main__":
    main()
