"""Placement quality on a production trace: one flat cluster, the blind federation, the
multischeduler, and the multischeduler with the descheduler: four ways in one run.

    .venv/bin/python bench/placement.py [--node-step 8] [--pod-step 8] [--rounds 3]
                                        [--without-descheduler]

Workload (deterministic): every ``--node-step``-th node of the Alibaba openb trace's node
list and every ``--pod-step``-th pod of its gpuspec33 pod list (``--trace-dir``, default
/work/shared/data/alibaba-openb-2023; README there). Each node is a kwok node with the
trace's cpu, memory, ``nvidia.com/gpu`` (when it has GPUs), 110 pods and the label
``kubestrata.io/gpu-model`` = its GPU model. The nodes are split in trace order into
``--lowers`` contiguous blocks, one lower cluster each (the trace lists nodes grouped by
type, so the clusters differ). Pods keep creation_time order, request the trace's cpu,
memory and ``num_gpu`` whole GPUs (a pod that used a share of a GPU, gpu_milli < 1000,
asks one whole device: Kubernetes does not share a device), and a ``gpu_spec`` becomes a
required node affinity ``kubestrata.io/gpu-model In [models]``. The defaults (8 and 8:
191 nodes, 1,019 pods) keep the run within a two-core machine with GPU demand 1.24 times
supply, as in the whole trace (1.20): not every pod can run, so how they are packed counts.

The four ways, each round in this order, with the same pods:

- flat: the same nodes in ONE cluster, the stock kube-scheduler; the ideal;
- blind: a federation (upper + the lower clusters, one virtual node each, the webhook)
  whose upper kube-scheduler sees only each cluster's summed free capacity;
- multischeduler: the same federation with the multischeduler as the upper scheduler's
  extender: a virtual node passes only when the cluster's fit estimator finds one real
  node that fits the pod;
- multischeduler+descheduler: as the multischeduler way, but each trace pod is the one
  replica of a ReplicaSet (the descheduler moves only pods a controller replaces); once
  placement has settled, `kubestrata descheduler` (the policy's defaults, as
  manifests/descheduler deploys it) runs until no pod has changed for
  ``--descheduler-quiet`` seconds, then is stopped. Its room holds lapse before the next
  round's blind way starts.

The flat cluster and the federation are started once and reused by every round; each
way's pods are deleted, and gone below, before the next way starts. Pods are created as
a burst: all of them at once, in trace order, at most ``--concurrency`` creates in
flight; then the run waits until placement settles: no pod changes binding or phase,
above or below, for ``--quiet`` seconds (bounded by ``--settle-timeout``).

Figures per way: pods Running (below, for the federation); stranded: bound to a virtual
node above but not Running below (for flat: bound and not Running, 0 by definition);
Pending above (never bound); time to settle (first create to the last change); scheduling
throughput (pods bound / time from the first create to the last binding); for the
multischeduler, the extender's time per filter decision, p50 and p99, from its
``GET /metrics`` (``kubestrata_extender_filter_seconds``, differences between before and
after the way; from histogram buckets these quantiles are interpolated as Prometheus'
histogram_quantile does, and the 5 ms target is read exactly off the 5 ms bucket).
For multischeduler+descheduler also: Running when placement settled (before the
descheduler), evictions (upper pods deleted while it ran: nothing else deletes), evictions
per extra pod Running, and the time to quiet (descheduler start to the last change).
With ``--rounds N`` every figure is reported as median and min-max over the rounds, and
each target is judged on the median. Printed per round only, to show where a way's time
goes: when the creates were done and when half, 90 % and all bound pods were bound; the
CPU each process of the federation used during the way (settling included); the
extender's calls by verb (``kubestrata_extender_decisions_total``) and, where the scheduler
configuration names its bind, the bind p50 and p99 (``kubestrata_extender_bind_seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import re
import ssl
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    cpu_snapshot,
    delete_namespaces,
    federation_processes,
    judge,
    print_cpu,
    spread,
    wait_no_pods,
)

from descheduler.policy import Policy
from harness.federation import Federation
from harness.localcluster import ClusterSpec, KubectlClient, LocalCluster, NodeSpec
from harness.process import ManagedProcess
from harness.state import UPPER
from harness.toolchain import Toolchain
from kubekit import keys
from kubekit.client import NAMESPACES, PODS, ApiError, ClientSettings, KubeClient, Resource
from kubekit.informer import FunctionHandler, Informer

TRACE_DIR = Path("/work/shared/data/alibaba-openb-2023")
NODE_FILE = "openb_node_list_all_node.csv"
POD_FILE = "openb_pod_list_gpuspec33.csv"
GPU = "nvidia.com/gpu"
GPU_MODEL_LABEL = f"{keys.PREFIX}/gpu-model"
IMAGE = "registry.k8s.io/pause:3.10"
FLAT, BLIND, MULTI = "flat", "blind", "multischeduler"
DESCHEDULED = "multischeduler+descheduler"
WAYS = (FLAT, BLIND, MULTI, DESCHEDULED)
REPLICASETS = Resource("apps", "v1", "replicasets")
TRACE_POD_LABEL = "trace-pod"
FILTER_METRIC = "kubestrata_extender_filter_seconds"
BIND_METRIC = "kubestrata_extender_bind_seconds"
EXTENDER_P99_TARGET = 0.005
STRANDED_EXAMPLES = 3  # stranded pods printed with the lower scheduler's reason

# -- the trace -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str  # "" for a CPU node


@dataclass(frozen=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    gpu_milli: int
    gpu_models: tuple[str, ...]  # the gpu_spec: allowed models, none for any node
    creation_time: int


def read_nodes(path: Path, step: int) -> list[TraceNode]:
    """Every ``step``-th node of the trace's node list, from the first."""
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))[::step]
    return [
        TraceNode(
            name=row["sn"],
            cpu_milli=int(row["cpu_milli"]),
            memory_mib=int(row["memory_mib"]),
            gpus=int(row["gpu"]),
            model=row["model"].strip() if int(row["gpu"]) > 0 else "",
        )
        for row in rows
    ]


def read_pods(path: Path, step: int) -> list[TracePod]:
    """Every ``step``-th pod of the trace's pod list, from the first, in creation_time order
    (the file's order; a stable sort keeps it for equal times)."""
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))[::step]
    pods = [
        TracePod(
            name=row["name"],
            cpu_milli=int(row["cpu_milli"]),
            memory_mib=int(row["memory_mib"]),
            gpus=int(row["num_gpu"]),
            gpu_milli=int(row["gpu_milli"]),
            # Some specs name a model twice ("V100M16|V100M32|V100M32").
            gpu_models=tuple(dict.fromkeys(m for m in row["gpu_spec"].split("|") if m)),
            creation_time=int(row["creation_time"]),
        )
        for row in rows
    ]
    return sorted(pods, key=lambda pod: pod.creation_time)


def split_blocks(nodes: Sequence[TraceNode], parts: int) -> list[list[TraceNode]]:
    """``parts`` contiguous blocks of (nearly) equal size, the larger ones first."""
    size, extra = divmod(len(nodes), parts)
    blocks: list[list[TraceNode]] = []
    start = 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        blocks.append(list(nodes[start:end]))
        start = end
    return blocks


def node_spec(node: TraceNode) -> NodeSpec:
    return NodeSpec(
        name=node.name,
        cpu=f"{node.cpu_milli}m",
        memory=f"{node.memory_mib}Mi",
        pods=110,
        labels={GPU_MODEL_LABEL: node.model} if node.gpus > 0 and node.model else {},
        extended_resources={GPU: str(node.gpus)} if node.gpus > 0 else {},
    )


def pod_manifest(pod: TracePod) -> dict[str, Any]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if pod.cpu_milli > 0:
        requests["cpu"] = f"{pod.cpu_milli}m"
    if pod.memory_mib > 0:
        requests["memory"] = f"{pod.memory_mib}Mi"
    if pod.gpus > 0:
        # Whole devices: an extended resource is an integer, and its limit must equal it.
        requests[GPU] = limits[GPU] = str(pod.gpus)
    resources: dict[str, Any] = {"requests": requests}
    if limits:
        resources["limits"] = limits
    spec: dict[str, Any] = {
        "containers": [{"name": "app", "image": IMAGE, "resources": resources}],
        "terminationGracePeriodSeconds": 0,
    }
    if pod.gpu_models:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": GPU_MODEL_LABEL,
                                    "operator": "In",
                                    "values": list(pod.gpu_models),
                                }
                            ]
                        }
                    ]
                }
            }
        }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod.name}, "spec": spec}


def replica_set_manifest(pod: TracePod) -> dict[str, Any]:
    """The pod as the one replica of a ReplicaSet of its name."""
    labels = {TRACE_POD_LABEL: pod.name}
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": pod.name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_manifest(pod)["spec"]},
        },
    }


def ordinal(number: int) -> str:
    if number % 100 in (11, 12, 13):
        return f"{number}th"
    return f"{number}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(number % 10, 'th') }"


def node_mix(nodes: Sequence[TraceNode]) -> str:
    models = Counter(node.model or "CPU-only" for node in nodes)
    return ", ".join(f"{model} {count}" for model, count in models.most_common())


def print_subsample(
    args: argparse.Namespace,
    nodes: Sequence[TraceNode],
    blocks: Sequence[Sequence[TraceNode]],
    pods: Sequence[TracePod],
) -> None:
    cpu = sum(n.cpu_milli for n in nodes) / 1000
    memory = sum(n.memory_mib for n in nodes) / 1024
    gpus = sum(n.gpus for n in nodes)
    pod_cpu = sum(p.cpu_milli for p in pods) / 1000
    pod_memory = sum(p.memory_mib for p in pods) / 1024
    pod_gpus = sum(p.gpus for p in pods)
    shared = sum(1 for p in pods if p.gpus == 1 and p.gpu_milli < 1000)
    by_count = Counter(p.gpus for p in pods)
    print(
        f"nodes: {args.trace_dir / NODE_FILE}, every {ordinal(args.node_step)} row from the first: "
        f"{len(nodes)} nodes, {cpu:,.0f} CPUs, {memory:,.0f} GiB, {gpus} GPUs "
        f"({node_mix(nodes)})"
    )
    for index, block in enumerate(blocks, start=1):
        print(
            f"    lower-{index}: {len(block)} nodes, {sum(n.gpus for n in block)} GPUs "
            f"({node_mix(block)})"
        )
    print(
        f"pods: {args.trace_dir / POD_FILE}, every {ordinal(args.pod_step)} row from the first, in "
        f"creation_time order: {len(pods)} pods requesting {pod_cpu:,.0f} CPUs, "
        f"{pod_memory:,.0f} GiB, {pod_gpus} GPUs ("
        + ", ".join(f"{count} pods x {gpus}" for gpus, count in sorted(by_count.items()))
        + f"); {sum(1 for p in pods if p.gpu_models)} with a gpu_spec (required affinity on "
        f"{GPU_MODEL_LABEL})"
    )
    print(
        f"    GPUs are whole devices: the {shared} pods that used a share of one GPU in the "
        "trace (gpu_milli < 1000) ask a whole nvidia.com/gpu here, since Kubernetes does "
        "not share a device"
    )
    print(
        f"demand / supply: CPU {pod_cpu / cpu:.2f}, memory {pod_memory / memory:.2f}, "
        f"GPU {pod_gpus / gpus if gpus else math.inf:.2f}"
    )


# -- one way ---------------------------------------------------------------------------------


@dataclass
class Observed:
    """What the watches saw of one way's pods: (nodeName, phase) by pod, above and below."""

    upper: dict[str, tuple[str, str]] = field(default_factory=dict)
    lower: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    # Why a lower pod is not scheduled: its PodScheduled condition's message.
    lower_reason: dict[tuple[str, str], str] = field(default_factory=dict)
    bound_at: dict[str, float] = field(default_factory=dict)
    last_change: float = 0.0
    deleted: int = 0  # upper pods

    @staticmethod
    def state(obj: Mapping[str, Any]) -> tuple[str, str]:
        return (
            str((obj.get("spec") or {}).get("nodeName") or ""),
            str((obj.get("status") or {}).get("phase") or ""),
        )

    def on_upper(self, obj: Mapping[str, Any], deleted: bool = False) -> None:
        name = obj["metadata"]["name"]
        now = time.monotonic()
        if deleted:
            self.upper.pop(name, None)
            self.bound_at.pop(name, None)
            self.deleted += 1
            self.last_change = now
            return
        state = self.state(obj)
        if self.upper.get(name) != state:
            self.upper[name] = state
            self.last_change = now
        if state[0] and name not in self.bound_at:
            self.bound_at[name] = now

    def on_lower(self, cluster: str, obj: Mapping[str, Any], deleted: bool = False) -> None:
        key = (cluster, obj["metadata"]["name"])
        if deleted:
            self.lower.pop(key, None)
            self.last_change = time.monotonic()
            return
        state = self.state(obj)
        for condition in (obj.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                self.lower_reason[key] = str(condition.get("message") or condition.get("reason"))
        if self.lower.get(key) != state:
            self.lower[key] = state
            self.last_change = time.monotonic()


def handler(on: Callable[[Mapping[str, Any], bool], None]) -> FunctionHandler:
    return FunctionHandler(
        add=lambda obj: on(obj, False),
        update=lambda obj: on(obj, False),
        delete=lambda obj: on(obj, True),
    )


@dataclass
class ExtenderFigures:
    decisions: float
    p50: float | None
    p99: float | None
    source: str  # where the quantiles come from
    within_target: float | None  # share of decisions <= EXTENDER_P99_TARGET, exact
    mean: float | None
    estimator_errors: float | None
    bind_errors: float | None
    bind_p50: float | None = None
    bind_p99: float | None = None
    calls: dict[str, float] = field(default_factory=dict)  # by verb


@dataclass
class WayResult:
    way: str
    pods: int  # created
    running: int
    stranded: int
    pending: int  # never bound
    settle_seconds: float
    settled: bool
    bound: int
    throughput: float
    upper_running: int  # as the upper cluster reports it
    # Seconds from the first create: the last create returned; half, 90 % and all of the
    # bound pods bound (where a way's time goes: creating, deciding, or a late tail).
    created_seconds: float = 0.0
    bound_by: tuple[float, float, float] = (0.0, 0.0, 0.0)
    stranded_below: Counter[str] = field(default_factory=Counter)
    stranded_examples: list[str] = field(default_factory=list)  # with the lower reason
    create_errors: list[str] = field(default_factory=list)
    extender: ExtenderFigures | None = None
    descheduled: Descheduled | None = None


@dataclass
class Descheduled:
    """What the descheduler changed after placement had settled."""

    running_before: int
    evictions: int
    quiet_seconds: float  # from its start to the last pod change
    quieted: bool

    def extra(self, running: int) -> int:
        return running - self.running_before


def namespace_manifest(name: str, federated: bool) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if federated:
        metadata["labels"] = {keys.FEDERATION_LABEL: keys.FEDERATION_ENABLED}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata}


def connect(cluster: KubectlClient) -> ClientSettings:
    # No client-side limit: the apiserver and the scheduler are what is measured.
    return ClientSettings(str(cluster.kubeconfig), qps=0, burst=1)


async def place(
    way: str,
    cluster: KubectlClient,
    lowers: Sequence[KubectlClient],
    namespace: str,
    pods: Sequence[TracePod],
    args: argparse.Namespace,
    descheduler: Callable[[], ManagedProcess] | None = None,
) -> WayResult:
    """Creates the pods in ``cluster`` (the flat cluster, or the upper cluster with
    ``lowers`` below it), waits until placement settles and counts where they are. With
    ``descheduler`` (which starts one), each pod is a ReplicaSet's, and once placement has
    settled the descheduler runs until no pod changes, then they are counted again."""
    federated = bool(lowers)
    observed = Observed()
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(await KubeClient.connect(connect(cluster)))
        await client.create(NAMESPACES, namespace_manifest(namespace, federated))
        informers = [Informer(client, PODS, namespace=namespace)]
        informers[0].add_handler(handler(observed.on_upper))
        for lower in lowers:
            lower_client = await stack.enter_async_context(await KubeClient.connect(connect(lower)))
            informer = Informer(lower_client, PODS, namespace=namespace)

            def on_lower(obj: Mapping[str, Any], deleted: bool, name: str = lower.name) -> None:
                observed.on_lower(name, obj, deleted)

            informer.add_handler(handler(on_lower))
            informers.append(informer)
        tasks = [asyncio.create_task(i.run(), name=repr(i)) for i in informers]
        try:
            await asyncio.gather(*(i.wait_synced() for i in informers))
            limit = asyncio.Semaphore(args.concurrency)
            errors: list[str] = []

            async def create(pod: TracePod) -> None:
                async with limit:
                    try:
                        if descheduler is None:
                            await client.create(PODS, pod_manifest(pod), namespace)
                        else:
                            await client.create(REPLICASETS, replica_set_manifest(pod), namespace)
                    except ApiError as error:
                        errors.append(f"{pod.name}: {error}")

            began = time.monotonic()
            observed.last_change = began
            # Tasks start in list order and the semaphore is FIFO: creates go out in
            # trace order, at most `concurrency` at a time.
            await asyncio.gather(*(create(pod) for pod in pods))
            created = time.monotonic()
            settled = await quiet(observed, created, args.quiet, began + args.settle_timeout)
            result = count(way, observed, lowers, len(pods) - len(errors), began, settled, errors)
            result.created_seconds = created - began
            if descheduler is None:
                return result
            print_way(result, "when placement settled")
            deleted = observed.deleted
            process = descheduler()
            started = observed.last_change = time.monotonic()
            try:
                quieted = await quiet(
                    observed, started, args.descheduler_quiet, started + args.settle_timeout
                )
            finally:
                process.stop()
            descheduled = count(
                way, observed, lowers, len(pods) - len(errors), began, settled, errors
            )
            descheduled.created_seconds = result.created_seconds
            descheduled.descheduled = Descheduled(
                running_before=result.running,
                evictions=observed.deleted - deleted,
                quiet_seconds=observed.last_change - started,
                quieted=quieted,
            )
            return descheduled
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def quiet(observed: Observed, since: float, seconds: float, deadline: float) -> bool:
    """Waits until no pod has changed for ``seconds`` (counted from ``since`` at the
    earliest); False if still changing at ``deadline``."""
    while True:
        now = time.monotonic()
        if now - max(observed.last_change, since) >= seconds:
            return True
        if now >= deadline:
            return False
        await asyncio.sleep(0.5)


def count(
    way: str,
    observed: Observed,
    lowers: Sequence[KubectlClient],
    created: int,
    began: float,
    settled: bool,
    errors: list[str],
) -> WayResult:
    cluster_of = {keys.default_node_name(lower.name): lower.name for lower in lowers}
    running = stranded = pending = upper_running = 0
    stranded_below: Counter[str] = Counter()
    examples: list[str] = []
    for name, (node, phase) in observed.upper.items():
        upper_running += phase == "Running"
        if not node:
            pending += 1
            continue
        if not lowers:
            if phase == "Running":
                running += 1
            else:
                stranded += 1
                stranded_below[phase or "no phase"] += 1
            continue
        below = observed.lower.get((cluster_of.get(node, ""), name))
        if below is not None and below[1] == "Running":
            running += 1
            continue
        stranded += 1
        if below is None:
            stranded_below["no lower pod" if node in cluster_of else f"on {node}"] += 1
        else:
            stranded_below[f"{below[1] or 'no phase'}{'' if below[0] else ', unbound'}"] += 1
        reason = observed.lower_reason.get((cluster_of.get(node, ""), name))
        if reason and len(examples) < STRANDED_EXAMPLES:
            examples.append(f"{name} on {node}: {reason}")
    bound_times = sorted(observed.bound_at.values())
    last_bind = max(bound_times, default=began)
    bound_by = (0.0, 0.0, 0.0)
    if bound_times:
        bound_by = (
            bound_times[(len(bound_times) - 1) // 2] - began,
            bound_times[math.ceil(len(bound_times) * 0.9) - 1] - began,
            last_bind - began,
        )
    return WayResult(
        way=way,
        pods=created,
        running=running,
        stranded=stranded,
        pending=pending,
        settle_seconds=observed.last_change - began,
        settled=settled,
        bound=len(bound_times),
        throughput=len(bound_times) / (last_bind - began) if last_bind > began else 0.0,
        bound_by=bound_by,
        upper_running=upper_running,
        stranded_below=stranded_below,
        stranded_examples=examples,
        create_errors=errors,
    )


def remove(cluster: KubectlClient, lowers: Sequence[KubectlClient], namespace: str) -> float:
    """Deletes a way's namespace and waits until its pods are gone below too."""
    began = time.monotonic()
    asyncio.run(delete_namespaces(cluster, [namespace]))
    for lower in lowers:
        asyncio.run(wait_no_pods(lower, [namespace]))
    return time.monotonic() - began


# -- the extender's metrics ------------------------------------------------------------------

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition as {name{labels}: value}, labels sorted."""
    samples: dict[str, float] = {}
    for name, labels, value in SAMPLE.findall(text):
        pairs = sorted(LABEL.findall(labels))
        key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}" if pairs else "")
        try:
            samples[key] = float(value)
        except ValueError:
            continue
    return samples


def read_metrics(url: str, ca_file: str) -> dict[str, float]:
    context = ssl.create_default_context(cafile=ca_file)
    with urllib.request.urlopen(f"{url}/metrics", context=context, timeout=10) as answer:
        return parse_metrics(answer.read().decode())


def label_value(key: str, label: str) -> str | None:
    found = dict(LABEL.findall(key))
    return found.get(label)


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """histogram_quantile: linear interpolation inside the bucket holding the rank; a rank
    in the +Inf bucket gives the highest finite bound."""
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower_bound
            if cumulative == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                cumulative - lower_count
            )
        lower_bound, lower_count = bound, cumulative
    return lower_bound


def extender_figures(before: Mapping[str, float], after: Mapping[str, float]) -> ExtenderFigures:
    """The filter decisions and binds made between two scrapes: counters and buckets
    differenced; a summary's quantiles (if the server exposes one) are taken as they are."""
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
    figures = filter_figures(delta, after)
    binds = histogram_buckets(delta, BIND_METRIC)
    if binds and binds[-1][1] > 0:
        figures.bind_p50 = bucket_quantile(binds, 0.5)
        figures.bind_p99 = bucket_quantile(binds, 0.99)
    figures.calls = {
        label_value(key, "verb") or "": value
        for key, value in delta.items()
        if key.startswith("kubestrata_extender_decisions_total{")
    }
    return figures


def histogram_buckets(delta: Mapping[str, float], metric: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets (upper bound, count), lowest first."""
    buckets = sorted(
        (float(label_value(key, "le") or "nan"), value)
        for key, value in delta.items()
        if key.startswith(f"{metric}_bucket{{")
    )
    return [(bound, value) for bound, value in buckets if not math.isnan(bound)]


def filter_figures(delta: Mapping[str, float], after: Mapping[str, float]) -> ExtenderFigures:
    buckets = histogram_buckets(delta, FILTER_METRIC)
    count_ = delta.get(f"{FILTER_METRIC}_count", buckets[-1][1] if buckets else 0.0)
    total = delta.get(f"{FILTER_METRIC}_sum")
    mean = total / count_ if total is not None and count_ > 0 else None
    errors = delta.get("kubestrata_extender_estimator_errors_total")
    bind_errors = delta.get("kubestrata_extender_bind_errors_total")
    quantiles = {
        float(label_value(key, "quantile") or "nan"): value
        for key, value in after.items()
        if key.startswith(f"{FILTER_METRIC}{{") and label_value(key, "quantile")
    }
    if buckets and buckets[-1][1] > 0:
        bounds = ", ".join(f"{b * 1000:g}" for b, _ in buckets if not math.isinf(b))
        target = dict(buckets).get(EXTENDER_P99_TARGET)
        return ExtenderFigures(
            decisions=count_,
            p50=bucket_quantile(buckets, 0.5),
            p99=bucket_quantile(buckets, 0.99),
            source=f"interpolated in buckets bounded at {bounds} ms",
            within_target=None if target is None else target / buckets[-1][1],
            mean=mean,
            estimator_errors=errors,
            bind_errors=bind_errors,
        )
    if 0.5 in quantiles or 0.99 in quantiles:
        return ExtenderFigures(
            decisions=count_,
            p50=quantiles.get(0.5),
            p99=quantiles.get(0.99),
            source="the server's summary quantiles (its own window, not this way's alone)",
            within_target=None,
            mean=mean,
            estimator_errors=errors,
            bind_errors=bind_errors,
        )
    return ExtenderFigures(
        decisions=count_,
        p50=None,
        p99=None,
        source=f"no {FILTER_METRIC} observations in /metrics",
        within_target=None,
        mean=mean,
        estimator_errors=errors,
        bind_errors=bind_errors,
    )


# -- reporting -------------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.2f} ms"


def count_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def print_way(result: WayResult, when: str = "") -> None:
    stranded = f"stranded {result.stranded}"
    if result.stranded_below:
        stranded += " (below: " + ", ".join(
            f"{what} {n}" for what, n in result.stranded_below.most_common()
        )
        stranded += ")"
    settle = f"settled in {result.settle_seconds:.1f} s"
    if not result.settled:
        settle = (
            "NOT settled (still changing at the timeout, last change at "
            f"{result.settle_seconds:.1f} s)"
        )
    print(
        f"    {result.way + (f' ({when})' if when else '') + ':':16} Running "
        f"{result.running}/{result.pods}, {stranded}, Pending above {result.pending}, "
        f"{settle}, {result.bound} bound at {result.throughput:.1f} pods/s"
    )
    descheduled = result.descheduled
    if descheduled is not None:
        quieted = "quiet" if descheduled.quieted else "NOT quiet (still changing at the timeout)"
        print(
            f"        descheduler: {descheduled.evictions} evictions, Running "
            f"{descheduled.running_before} -> {result.running} "
            f"({descheduled.extra(result.running):+d}), {quieted} "
            f"{descheduled.quiet_seconds:.0f} s after its start"
        )
    half, most, last = result.bound_by
    print(
        f"        creates done at {result.created_seconds:.1f} s; bound: half by {half:.1f} s, "
        f"90 % by {most:.1f} s, the last at {last:.1f} s"
    )
    if result.way != FLAT and result.upper_running != result.running:
        print(f"        (the upper cluster reports {result.upper_running} Running)")
    for example in result.stranded_examples:
        print(f"        stranded {example}")
    if result.create_errors:
        print(
            f"        {len(result.create_errors)} creates refused, first: {result.create_errors[0]}"
        )
    figures = result.extender
    if figures is not None:
        within = (
            ""
            if figures.within_target is None
            else f", {figures.within_target:.1%} within {EXTENDER_P99_TARGET * 1000:g} ms"
        )
        print(
            f"        extender filter: {figures.decisions:.0f} decisions, p50 {ms(figures.p50)}, "
            f"p99 {ms(figures.p99)}, mean {ms(figures.mean)}{within} ({figures.source}); "
            f"estimator errors {count_text(figures.estimator_errors)}, "
            f"bind errors {count_text(figures.bind_errors)}; bind p50 {ms(figures.bind_p50)}, "
            f"p99 {ms(figures.bind_p99)}; calls "
            + ", ".join(f"{verb} {count:.0f}" for verb, count in sorted(figures.calls.items()))
        )


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def round_ratios(results: Mapping[str, WayResult]) -> dict[str, float]:
    flat, blind, multi = results[FLAT], results[BLIND], results[MULTI]
    ratios = {
        "Running multischeduler / flat": ratio(multi.running, flat.running),
        "Running blind / flat": ratio(blind.running, flat.running),
        "throughput multischeduler / blind": ratio(multi.throughput, blind.throughput),
    }
    if DESCHEDULED not in results:
        return ratios
    descheduled = results[DESCHEDULED]
    moved = descheduled.descheduled
    assert moved is not None
    extra = moved.extra(descheduled.running)
    return {
        **ratios,
        "Running multischeduler+descheduler / flat": ratio(descheduled.running, flat.running),
        "evictions per extra pod Running": (
            ratio(moved.evictions, extra) if extra > 0 else math.nan
        ),
    }


def print_summary(rounds: Sequence[Mapping[str, WayResult]]) -> None:
    n = len(rounds)
    print(f"over {n} round{'s' if n > 1 else ''}: median (min-max)")
    figures: list[tuple[str, Callable[[WayResult], float], str]] = [
        ("Running", lambda r: r.running, ".0f"),
        ("stranded", lambda r: r.stranded, ".0f"),
        ("Pending above", lambda r: r.pending, ".0f"),
        ("settle s", lambda r: r.settle_seconds, ".1f"),
        ("bound pods/s", lambda r: r.throughput, ".1f"),
    ]
    with_descheduler = DESCHEDULED in rounds[0]
    for way in WAYS if with_descheduler else WAYS[:-1]:
        parts = [
            f"{title} {spread([get(r[way]) for r in rounds], fmt)}" for title, get, fmt in figures
        ]
        print(f"    {way + ':':16} " + ", ".join(parts))
    extenders = [r[MULTI].extender for r in rounds if r[MULTI].extender is not None]
    p50s = [e.p50 * 1000 for e in extenders if e is not None and e.p50 is not None]
    p99s = [e.p99 * 1000 for e in extenders if e is not None and e.p99 is not None]
    print(f"    extender filter ms: p50 {spread(p50s, '.2f')}, p99 {spread(p99s, '.2f')}")
    ratios = [round_ratios(r) for r in rounds]
    if with_descheduler:
        moves = [(r[DESCHEDULED], r[DESCHEDULED].descheduled) for r in rounds]
        print(
            "    descheduler: Running when placement settled "
            + spread([m.running_before for _, m in moves if m], ".0f")
            + ", evictions "
            + spread([m.evictions for _, m in moves if m], ".0f")
            + ", extra pods Running "
            + spread([m.extra(r.running) for r, m in moves if m], ".0f")
            + ", time to quiet s "
            + spread([m.quiet_seconds for _, m in moves if m], ".0f")
        )
        per_extra = [r["evictions per extra pod Running"] for r in ratios]
        print(
            "    evictions per extra pod Running: "
            + (spread([v for v in per_extra if not math.isnan(v)], ".2f") or "n/a")
            + f" ({sum(math.isnan(v) for v in per_extra)} rounds with no extra pod)"
        )

    print("targets (judged on the median):")
    judge(
        "Running with multischeduler >= 0.98 x flat",
        [r["Running multischeduler / flat"] for r in ratios],
        lambda v: v >= 0.98,
        ".3f",
    )
    judge(
        "0 stranded with multischeduler",
        [float(r[MULTI].stranded) for r in rounds],
        lambda v: v == 0,
        ".0f",
    )
    # With a 5 ms bucket the share of decisions within 5 ms decides exactly; otherwise the
    # interpolated p99.
    within = [e.within_target for e in extenders if e is not None]
    if within and all(w is not None for w in within):
        judge(
            "extender p99 <= 5 ms (share of filter decisions within 5 ms >= 0.99)",
            within,
            lambda v: v >= 0.99,
            ".3f",
        )
    else:
        judge(
            "extender p99 <= 5 ms (ms)",
            p99s,
            lambda v: v <= EXTENDER_P99_TARGET * 1000,
            ".2f",
        )
    judge(
        "multischeduler throughput >= 0.8 x blind throughput",
        [r["throughput multischeduler / blind"] for r in ratios],
        lambda v: v >= 0.8,
        ".3f",
    )
    if with_descheduler:
        judge(
            "Running with multischeduler+descheduler >= 0.99 x flat",
            [r["Running multischeduler+descheduler / flat"] for r in ratios],
            lambda v: v >= 0.99,
            ".3f",
        )
    else:
        print("    Running with multischeduler+descheduler: not judged (--without-descheduler)")


# -- the run ---------------------------------------------------------------------------------


def federation_specs(blocks: Sequence[Sequence[TraceNode]]) -> list[ClusterSpec]:
    return [
        ClusterSpec(UPPER, "upper"),
        *(
            ClusterSpec(f"lower-{index}", "lower", tuple(node_spec(n) for n in block))
            for index, block in enumerate(blocks, start=1)
        ),
    ]


def run_way(
    way: str,
    cluster: KubectlClient,
    lowers: Sequence[KubectlClient],
    namespace: str,
    pods: Sequence[TracePod],
    args: argparse.Namespace,
    descheduler: Callable[[], ManagedProcess] | None = None,
    federation: Federation | None = None,
    extender_metrics: tuple[str, str] | None = None,
) -> WayResult:
    """One way, counted and printed; with the ``federation`` it ran on, also the CPU its
    processes used meanwhile (settling included); with ``extender_metrics`` (the
    multischeduler's metrics URL and CA file), the extender's figures."""
    pids = federation_processes(federation) if federation is not None else {}
    before = read_metrics(*extender_metrics) if extender_metrics is not None else None
    cpu_before, began = cpu_snapshot(pids), time.monotonic()
    result = asyncio.run(place(way, cluster, lowers, namespace, pods, args, descheduler))
    cpu_after, wall = cpu_snapshot(pids), time.monotonic() - began
    if extender_metrics is not None and before is not None:
        result.extender = extender_figures(before, read_metrics(*extender_metrics))
    print_way(result)
    if pids:
        used = {name: cpu_after[name] - cpu_before[name] for name in pids}
        print_cpu(f"of the federation's processes during {way}", wall, used, least=0.01)
    removed = remove(cluster, lowers, namespace)
    print(f"        pods deleted{' and gone below' if lowers else ''} in {removed:.0f} s")
    return result


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    parser.add_argument(
        "--node-step", type=positive, default=8, help="every k-th node (default %(default)s)"
    )
    parser.add_argument(
        "--pod-step", type=positive, default=8, help="every k-th pod (default %(default)s)"
    )
    parser.add_argument(
        "--lowers", type=positive, default=4, help="lower clusters (default %(default)s)"
    )
    parser.add_argument(
        "--rounds", type=positive, default=3, help="repeat all four ways (default %(default)s)"
    )
    parser.add_argument(
        "--concurrency",
        type=positive,
        default=32,
        help="pod creates in flight during the burst (default %(default)s)",
    )
    parser.add_argument(
        "--quiet",
        type=float,
        default=15.0,
        help="settled: no pod changed binding or phase for this many seconds (default %(default)s)",
    )
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=900.0,
        help="give up waiting for a way to settle after this many seconds (default %(default)s)",
    )
    parser.add_argument(
        "--descheduler-quiet",
        type=float,
        default=90.0,
        help="the descheduler has done its work when no pod changed for this many seconds "
        "(default %(default)s: more than its defragAfter and interval together)",
    )
    parser.add_argument(
        "--without-descheduler",
        action="store_true",
        help="leave out the fourth way (multischeduler+descheduler); its target is not judged",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="keep the clusters' files and logs here (a new directory) instead of a temporary one",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    nodes = read_nodes(args.trace_dir / NODE_FILE, args.node_step)
    pods = read_pods(args.trace_dir / POD_FILE, args.pod_step)
    blocks = split_blocks(nodes, args.lowers)
    print_subsample(args, nodes, blocks, pods)
    print(
        f"pods created as a burst in trace order, at most {args.concurrency} creates in "
        f"flight; settled after {args.quiet:g} s without a change (timeout "
        f"{args.settle_timeout:g} s)"
    )
    toolchain = Toolchain.locate()
    with tempfile.TemporaryDirectory(prefix="kubestrata-placement-") as temporary:
        state = args.state_dir or Path(temporary)
        if args.state_dir is not None and args.state_dir.exists() and any(args.state_dir.iterdir()):
            raise SystemExit(f"--state-dir {args.state_dir} is not empty")
        flat = LocalCluster(
            ClusterSpec(FLAT, "lower", tuple(node_spec(n) for n in nodes)),
            state / FLAT,
            toolchain,
        )
        federation = Federation(state / "federation", federation_specs(blocks), toolchain)
        try:
            began = time.monotonic()
            flat.start()
            print(f"flat cluster ({len(nodes)} nodes) ready in {time.monotonic() - began:.0f} s")
            began = time.monotonic()
            federation.start()
            federation.start_virtual_nodes()
            federation.start_webhook()
            print(
                f"federation (upper + {args.lowers} lower clusters) ready in "
                f"{time.monotonic() - began:.0f} s"
            )
            upper = federation.upper
            lowers: list[KubectlClient] = list(federation.lowers)
            extenders: list[Mapping[str, Any]] | None = None
            rounds: list[dict[str, WayResult]] = []
            holds_lapse = 0.0
            for number in range(1, args.rounds + 1):
                print(f"round {number}/{args.rounds}:")
                results: dict[str, WayResult] = {}
                results[FLAT] = run_way(FLAT, flat, [], f"{FLAT}-{number}", pods, args)
                if extenders is not None:
                    upper.set_scheduler_extenders([])
                wait = holds_lapse - time.monotonic()
                if wait > 0:
                    print(f"    waiting {wait:.0f} s for the descheduler's room holds to lapse")
                    time.sleep(wait)
                results[BLIND] = run_way(
                    BLIND, upper, lowers, f"{BLIND}-{number}", pods, args, federation=federation
                )
                if extenders is None:
                    federation.start_multischeduler()
                    extenders = list(upper.scheduler_extenders)
                else:
                    upper.set_scheduler_extenders(extenders)
                url = federation.multischeduler_url
                assert url is not None
                ca_file = str(extenders[0]["tlsConfig"]["caFile"])
                results[MULTI] = run_way(
                    MULTI,
                    upper,
                    lowers,
                    f"{MULTI}-{number}",
                    pods,
                    args,
                    federation=federation,
                    extender_metrics=(url, ca_file),
                )
                if not args.without_descheduler:
                    results[DESCHEDULED] = run_way(
                        DESCHEDULED,
                        upper,
                        lowers,
                        f"descheduled-{number}",
                        pods,
                        args,
                        federation.start_descheduler,
                        federation,
                    )
                    holds_lapse = time.monotonic() + Policy().hold_timeout
                rounds.append(results)
                print(
                    "    ratios: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in round_ratios(results).items())
                )
            print_summary(rounds)
        finally:
            federation.stop()
            flat.stop()


if __name__ == "__main__":
    main()
