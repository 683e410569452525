"""Pods through a virtual node vs the same pods created directly in the lower cluster.

    .venv/bin/python bench/virtual_node_pods.py [--pods 1000] [--shared-cpus] [--rounds 3]
        [--realistic-namespace]

One federation (1 upper + 1 lower cluster); each round runs three ways in turn (directly
in the lower cluster, through the virtual node, directly again), each way's pods deleted
before the next, each way in two phases, as clusterloader2's density test does:

- saturation: N pods created as fast as the cluster takes them (as many creates at a
  time as the virtual node has workers, 64), timed to all Running: the throughput, and
  the ratio of the two ways;
- latency: then, with those N pods still there, M more pods created at a steady rate the
  lower cluster keeps up with, each timed from its create to Running: the start latency
  (p50/p99) each way, and what the virtual node adds. Under a burst a pod's latency is
  mostly queueing, and where the queue sits differs between the ways (in this client's
  semaphore directly, in the virtual node's work queue through it), so the saturation
  latencies are printed but the added latency is the latency phase's.

Directly means in the lower cluster; through the virtual node means in the upper cluster
bound to the virtual node (`spec.nodeName` set, as a scheduler or a user binding them
would; `--upper-scheduler` has the upper kube-scheduler place them instead, which adds
its binding and event). Also printed: the virtual node's RSS per mirrored pod, the time a
restarted virtual node takes to list both sides again, and for the saturation phases the
CPU each process used and the API requests each apiserver served per pod.

Per round: the ratio of the mean direct time to the via time; the burst's own start
latencies (every pod of the saturation phase, create to Running, the upper create through
the virtual node) and what the via way adds at p99 over both direct ways; the latency
phase's added p50/p99; the virtual node's RSS per mirrored pod (its growth from just
before the via pods, their namespaces and objects made, to after them), its CPU per pod
in the saturation phase, and its restart with the pods mirrored: from its start to both sides
listed, to every mirrored pod reconciled once (its pod queue, read at /metrics, has done
that many reconciles and is empty), and the writes it made by then besides its heartbeat.
Over ``--rounds``: median and min-max of each, and a met/MISSED line per target, judged
on the median (ratio >= 0.9 with the CPUs split, >= 0.5 shared; burst p99 added <= 2 s;
<= 20 KB per pod; resync <= 10 s and no write; with shared CPUs, <= 3 ms of
virtual-node CPU per pod).

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
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    Target,
    cpu_snapshot,
    delete_namespaces,
    federation_processes,
    print_cpu,
    summarize,
    upper_and_one_lower,
    wait_no_pods,
)
from prometheus_client.parser import text_string_to_metric_families

from harness.federation import Federation, virtual_node_name
from harness.localcluster import LocalCluster
from harness.toolchain import Toolchain
from kubekit import keys
from kubekit.client import (
    CONFIGMAPS,
    NAMESPACES,
    PODS,
    SECRETS,
    SERVICES,
    ClientSettings,
    KubeClient,
    Resource,
)
from kubekit.informer import FunctionHandler, Informer
from virtual_node.main import DEFAULT_WORKERS


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


@dataclass(frozen=True)
class NamespaceObjects:
    """What else a namespace holds besides the pods."""

    services: int = 0
    config_maps: int = 0
    secrets: int = 0


REALISTIC_NAMESPACE = NamespaceObjects(services=1000, config_maps=2000, secrets=2000)
# How long no apiserver may take a write (heartbeats aside) before a way is measured:
# the endpoints controllers write each Service's Endpoints one by one (at their client's
# 20 a second), made with the namespace or deleted with the previous way's.
QUIET_SECONDS = 5.0
# Requests that write nothing, and writes that go on whatever the benchmark does: nodes'
# and leaders' heartbeats (a restarted virtual node's among them).
READS = frozenset({"GET", "LIST", "WATCH", "CONNECT"})
HEARTBEAT_RESOURCES = frozenset({"leases", "nodes", "nodes/status"})


def is_write(verb: str, resource: str) -> bool:
    """A request that changed something, heartbeats aside."""
    return verb not in READS and resource not in HEARTBEAT_RESOURCES


def namespace_objects(objects: NamespaceObjects) -> list[tuple[Resource, dict[str, Any]]]:
    """Services with a selector and a port, ConfigMaps and Secrets of a few hundred
    bytes: none of them is used by the pods."""
    made: list[tuple[Resource, dict[str, Any]]] = []
    for index in range(objects.services):
        name = f"service-{index:05d}"
        spec = {"selector": {"app": name}, "ports": [{"name": "http", "port": 80}]}
        made.append((SERVICES, {"metadata": {"name": name}, "spec": spec}))
    settings = {f"setting-{i}": f"value-{i:04d}" * 4 for i in range(10)}
    for index in range(objects.config_maps):
        made.append((CONFIGMAPS, {"metadata": {"name": f"config-{index:05d}"}, "data": settings}))
    for index in range(objects.secrets):
        secret = {"metadata": {"name": f"secret-{index:05d}"}, "stringData": settings}
        made.append((SECRETS, secret))
    return made


async def make_namespace(
    cluster: LocalCluster, namespace: str, objects: NamespaceObjects = NamespaceObjects()
) -> None:
    async with await KubeClient.connect(
        ClientSettings(str(cluster.kubeconfig), qps=0, burst=1)
    ) as client:
        await client.create(
            NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        )
        limit = asyncio.Semaphore(DEFAULT_WORKERS)

        async def create(resource: Resource, body: dict[str, Any]) -> None:
            async with limit:
                await client.create(resource, body, namespace)

        await asyncio.gather(*(create(r, body) for r, body in namespace_objects(objects)))


async def run_pods(
    cluster: LocalCluster,
    namespace: str,
    count: int,
    federated: bool,
    node_name: str | None = None,
    rate: float | None = None,
) -> tuple[float, list[float]]:
    """Creates ``count`` pods in ``namespace``, as fast as the apiserver takes them or
    ``rate`` a second, and returns (seconds to all Running, per-pod latencies from create
    to Running)."""
    async with await KubeClient.connect(
        ClientSettings(str(cluster.kubeconfig), qps=0, burst=1)
    ) as client:
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
        # Directly, the same number of creates in flight as the virtual node's workers.
        limit = asyncio.Semaphore(DEFAULT_WORKERS)

        async def create(index: int) -> None:
            name = f"p-{index:05d}"
            if rate:
                await asyncio.sleep(began + index / rate - time.monotonic())
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


def pin(pids: Iterable[int], cpus: set[int]) -> None:
    """Every thread of each process onto ``cpus`` (threads made later inherit it)."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except ProcessLookupError:
                continue  # a thread that has just ended


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


def writes(requests: dict[str, Counter[str]]) -> int:
    """Writes the apiservers have taken, heartbeats aside."""
    return sum(
        number
        for counts in requests.values()
        for request, number in counts.items()
        if is_write(*request.split(" "))
    )


def wait_quiet(requests_now: Callable[[], dict[str, Counter[str]]], timeout: float = 600) -> float:
    """Waits until no apiserver has taken a write for QUIET_SECONDS; returns how long
    that took."""
    began = time.monotonic()
    last, quiet_since = writes(requests_now()), began
    while (now := time.monotonic()) - quiet_since < QUIET_SECONDS:
        if now - began > timeout:
            raise TimeoutError(f"the apiservers still take writes after {timeout:.0f} s")
        time.sleep(1)
        made = writes(requests_now())
        if made != last:
            last, quiet_since = made, time.monotonic()
    return time.monotonic() - began


def print_requests(title: str, count: int, made: Counter[str]) -> None:
    print(f"API requests {title}: {sum(made.values()) / count:.1f} per pod")
    for request, number in made.most_common():
        if number >= count // 4:
            print(f"    {request:40} {number / count:6.2f} per pod")


def delete_pods(cluster: LocalCluster, namespace: str, lower: LocalCluster) -> float:
    """Deletes a way's namespaces and waits until their pods are gone from the lower
    cluster too (and the lower namespaces, made by the virtual node or beforehand, with
    them); returns how long that took."""
    began = time.monotonic()
    names = (namespace, f"{namespace}-latency")
    asyncio.run(delete_namespaces(cluster, names))
    asyncio.run(wait_no_pods(lower, names))
    if cluster is not lower:
        asyncio.run(delete_namespaces(lower, names))
    return time.monotonic() - began


def wait_log(path: Path, marker: str, after: int, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text()
        if marker in text[after:]:
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(f"{marker!r} not in {path}")


def metric_samples(port: int) -> list[tuple[str, dict[str, str], float]]:
    """The samples a component serves at /metrics on its health port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def wait_resynced(port: int, pods: int, timeout: float = 600) -> tuple[float, Counter[str]]:
    """Waits until a restarted virtual node's pod queue has done as many reconciles as
    there are mirrored pods and is empty: every pod reconciled once. Returns when, and the
    writes it made meanwhile besides its heartbeat (a clean resync makes none)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            samples = metric_samples(port)
        except OSError:  # not serving yet
            time.sleep(0.05)
            continue
        pods_queue = {"name": "pods"}
        done = sum(
            value
            for name, labels, value in samples
            if name == "workqueue_work_duration_seconds_count" and labels == pods_queue
        )
        depth = sum(
            value
            for name, labels, value in samples
            if name == "workqueue_depth" and labels == pods_queue
        )
        if done >= pods and depth == 0:
            writes: Counter[str] = Counter()
            for name, labels, value in samples:
                if name == "rest_client_requests_total" and is_write(
                    labels["verb"], labels["resource"]
                ):
                    writes[f"{labels['verb']} {labels['resource']}"] += int(value)
            return time.monotonic(), +writes
        time.sleep(0.05)
    raise TimeoutError(f"the virtual node did not reconcile {pods} pods in {timeout:.0f} s")


def option(argv: Iterable[str], flag: str) -> str:
    (value,) = (arg.removeprefix(f"{flag}=") for arg in argv if arg.startswith(f"{flag}="))
    return value


def split_cpus(pids: dict[str, int], shared: bool) -> set[int]:
    """Pins the lower cluster to half the CPUs and everything else to the other half,
    unless ``shared``; returns all the CPUs, to undo it with."""
    all_cpus = os.sched_getaffinity(0)
    if shared or len(all_cpus) < 2:
        print(f"CPUs: every process on all of {sorted(all_cpus)}")
        return all_cpus
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
    return all_cpus


@dataclass
class Way:
    """One way of running pods, both phases, with what the saturation phase cost."""

    total: float = 0.0
    burst_latencies: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    requests: dict[str, Counter[str]] = field(default_factory=dict)
    # The virtual node's RSS once the namespaces and their objects are there, before
    # any pod: what it caches of the objects is not the pods' cost.
    ready_rss: int = 0


def run_way(
    cluster: LocalCluster,
    namespace: str,
    args: argparse.Namespace,
    pids: dict[str, int],
    apiservers: dict[str, LocalCluster],
    node_name: str | None,
) -> Way:
    federated = cluster.spec.role == "upper"

    def requests_now() -> dict[str, Counter[str]]:
        return {name: asyncio.run(request_counts(c)) for name, c in apiservers.items()}

    latency_namespace = f"{namespace}-latency"
    objects = REALISTIC_NAMESPACE if args.realistic_namespace else NamespaceObjects()
    # Made, in the lower cluster too through the virtual node (which takes an existing
    # namespace as it is), before anything is measured: the objects are there already.
    for made_in in (cluster, apiservers["lower"]) if federated else (cluster,):
        asyncio.run(make_namespace(made_in, namespace, objects))
        asyncio.run(make_namespace(made_in, latency_namespace))
    print(f"    apiservers quiet after {wait_quiet(requests_now):.0f} s")
    way = Way(ready_rss=rss_kib(pids[virtual_node_name("lower-1")]))
    cpu_before, requests_before = cpu_snapshot(pids), requests_now()
    way.total, way.burst_latencies = asyncio.run(
        run_pods(cluster, namespace, args.pods, federated, node_name)
    )
    cpu_after, requests_after = cpu_snapshot(pids), requests_now()
    way.cpu = {name: cpu_after[name] - cpu_before[name] for name in pids}
    way.requests = {name: requests_after[name] - requests_before[name] for name in apiservers}
    _, way.latencies = asyncio.run(
        run_pods(
            cluster,
            latency_namespace,
            args.latency_pods,
            federated,
            node_name,
            rate=args.latency_rate,
        )
    )
    return way


def targets(shared: bool) -> tuple[Target, ...]:
    """What each figure is held against: the ratio's target depends on the CPU split (with
    shared CPUs the via way also pays for the upper control plane)."""
    ratio = 0.5 if shared else 0.9
    return (
        Target(f"ratio (mean direct / via) >= {ratio}", "ratio", lambda v: v >= ratio),
        Target(
            "burst start latency added at p99 <= 2 s",
            "burst p99 added s",
            lambda v: v <= 2.0,
        ),
        Target(
            "virtual-node RSS per mirrored pod <= 20 KB",
            "RSS per mirrored pod KiB",
            lambda v: v * 1024 <= 20_000,
        ),
        Target(
            "restart resync (start to every mirrored pod reconciled once) <= 10 s",
            "restart to every pod reconciled s",
            lambda v: v <= 10.0,
        ),
        Target(
            "a clean restart resync writes nothing",
            "restart resync writes",
            lambda v: v == 0,
        ),
        *(
            (
                Target(
                    "virtual-node CPU per mirrored pod <= 3 ms (shared CPUs)",
                    "virtual-node CPU per pod ms",
                    lambda v: v <= 3.0,
                ),
            )
            if shared
            else ()
        ),
    )


def print_round(
    args: argparse.Namespace,
    ways: tuple[tuple[str, Way], ...],
    apiservers: Iterable[str],
) -> None:
    print("    saturation phase, all pods created at once:")
    for title, way in ways:
        print(
            f"        {title + ':':22} all Running in {way.total:6.2f} s, start latency "
            f"p50 {percentile(way.burst_latencies, 0.5):.3f} s, "
            f"p99 {percentile(way.burst_latencies, 0.99):.3f} s"
        )
    print(
        f"    latency phase, {args.latency_pods} pods at {args.latency_rate:g} a second "
        f"with the saturation pods still there:"
    )
    for title, way in ways:
        print(
            f"        {title + ':':22} start latency "
            f"p50 {percentile(way.latencies, 0.5):.3f} s, "
            f"p99 {percentile(way.latencies, 0.99):.3f} s, "
            f"mean {statistics.mean(way.latencies):.3f} s"
        )
    for title, way in ways:
        print_cpu(f"{title}, saturation", way.total, way.cpu)
    for name in apiservers:
        for title, way in ways:
            print_requests(f"{title}, saturation, {name} apiserver", args.pods, way.requests[name])


@dataclass
class Restart:
    """A virtual node killed and started again with its pods mirrored: from its start
    until both sides are listed, until every pod is reconciled once, and the writes."""

    listed: float
    reconciled: float
    writes: Counter[str]


def round_figures(
    ways: tuple[tuple[str, Way], ...], rss_per_pod_kib: float, restart: Restart, pods: int
) -> dict[str, float]:
    (_, direct), (_, via), (_, again) = ways
    direct_burst = sorted(direct.burst_latencies + again.burst_latencies)
    direct_latencies = sorted(direct.latencies + again.latencies)
    return {
        "all Running direct s": direct.total,
        "all Running via s": via.total,
        "all Running direct again s": again.total,
        "ratio": (direct.total + again.total) / 2 / via.total,
        "ratio against the first direct": direct.total / via.total,
        "burst p50 direct s": percentile(direct_burst, 0.5),
        "burst p99 direct s": percentile(direct_burst, 0.99),
        "burst p50 via s": percentile(via.burst_latencies, 0.5),
        "burst p99 via s": percentile(via.burst_latencies, 0.99),
        "burst p99 added s": percentile(via.burst_latencies, 0.99) - percentile(direct_burst, 0.99),
        "latency phase p50 added s": percentile(via.latencies, 0.5)
        - percentile(direct_latencies, 0.5),
        "latency phase p99 added s": percentile(via.latencies, 0.99)
        - percentile(direct_latencies, 0.99),
        "RSS per mirrored pod KiB": rss_per_pod_kib,
        "restart to both sides listed s": restart.listed,
        "restart to every pod reconciled s": restart.reconciled,
        "restart resync writes": restart.writes.total(),
        "virtual-node CPU per pod ms": via.cpu[virtual_node_name("lower-1")] / pods * 1000,
        "upper apiserver CPU s": via.cpu["upper/kube-apiserver"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=1000, help="pods of the saturation phase")
    parser.add_argument(
        "--latency-pods", type=int, default=300, help="pods of the latency phase (default 300)"
    )
    parser.add_argument(
        "--latency-rate",
        type=float,
        default=20,
        help="pods a second created in the latency phase (default 20)",
    )
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
    parser.add_argument(
        "--realistic-namespace",
        action="store_true",
        help=(
            "the pods' namespace also holds 1,000 Services, 2,000 ConfigMaps and 2,000 "
            "Secrets, made before the pods (through the virtual node: above and below)"
        ),
    )
    parser.add_argument("--rounds", type=int, default=3, help="default %(default)s")
    args = parser.parse_args()
    count = args.pods
    per_way = count + args.latency_pods
    nodes = max(2, -(-per_way // 500))
    node_pods = -(-per_way * 2 // nodes) + 10
    specs = upper_and_one_lower(nodes, node_pods)
    placed = "upper kube-scheduler" if args.upper_scheduler else "spec.nodeName"
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="kubestrata-bench-") as state:
        federation = Federation(Path(state), specs, Toolchain.locate())
        federation.start()
        federation.start_virtual_nodes()
        try:
            lower = federation.clusters["lower-1"]
            component = federation.components[virtual_node_name("lower-1")]
            apiservers = {"upper": federation.upper, "lower": lower}
            print(f"pods: {count} (lower cluster: {nodes} kwok nodes; upper pods: {placed})")
            for number in range(1, args.rounds + 1):
                print(f"round {number}/{args.rounds}:")
                if number > 1:
                    # The last round's restart listed its pods; a process that has held
                    # them keeps the memory, so each round's RSS starts from a new one.
                    offset = len(component.log_path.read_text())
                    component.kill()
                    component.start()
                    wait_log(component.log_path, "caches synced", offset)
                pids = federation_processes(federation)
                all_cpus = split_cpus(pids, args.shared_cpus)
                time.sleep(5)
                idle_rss = rss_kib(component.pid)
                direct = run_way(lower, f"direct-{number}", args, pids, apiservers, None)
                # No way may find the pods of another in the lower cluster (every part of
                # it slows with more pods): each way's pods go before the next way starts.
                removed = delete_pods(lower, f"direct-{number}", lower)
                print(f"    direct pods deleted in {removed:.0f} s")
                via = run_way(
                    federation.upper,
                    f"via-{number}",
                    args,
                    pids,
                    apiservers,
                    node_name=None if args.upper_scheduler else keys.default_node_name("lower-1"),
                )
                time.sleep(5)
                loaded_rss = rss_kib(component.pid)
                pin(pids.values(), all_cpus)

                log = component.log_path
                offset = len(log.read_text())
                component.kill()
                restarted = time.monotonic()
                component.start()
                listed = wait_log(log, "caches synced", offset) - restarted
                reconciled, writes = wait_resynced(
                    int(option(component.argv, "--health-port")), per_way
                )
                restart = Restart(listed, reconciled - restarted, writes)
                if writes:
                    print(f"    writes during the restart's resync: {dict(writes)}")
                removed = delete_pods(federation.upper, f"via-{number}", lower)
                print(f"    pods through the virtual node deleted in {removed:.0f} s")
                # The cluster slows down as it is used (20 % over a few rounds of pods): a
                # second direct run after the via run cancels the drift out of the ratio.
                pids = federation_processes(federation)
                split_cpus(pids, args.shared_cpus)
                again = run_way(lower, f"again-{number}", args, pids, apiservers, None)
                pin(pids.values(), all_cpus)
                removed = delete_pods(lower, f"again-{number}", lower)
                print(f"    direct pods deleted in {removed:.0f} s")

                ways = (
                    ("direct in lower", direct),
                    ("via virtual node", via),
                    ("direct in lower again", again),
                )
                print_round(args, ways, apiservers)
                print(
                    f"    virtual node RSS: {idle_rss / 1024:.1f} MiB idle, "
                    f"{via.ready_rss / 1024:.1f} MiB before the pods through it (the "
                    f"namespaces' objects, the direct pods seen), {loaded_rss / 1024:.1f} "
                    f"MiB with them"
                )
                figures = round_figures(
                    ways, (loaded_rss - via.ready_rss) / per_way, restart, args.pods
                )
                print("    " + ", ".join(f"{name} {value:.3f}" for name, value in figures.items()))
                rounds.append(figures)
        finally:
            federation.stop()
    summarize(rounds, targets(args.shared_cpus), ".3f")


if __name__ == "__main__":
    main()
