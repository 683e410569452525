"""/stats/summary, /metrics/resource and /metrics/cadvisor from the lower cluster's
metrics.k8s.io API.

The metrics API gives usage rates over a window; the kubelet's resource metrics give a
monotonic CPU counter (metrics-server derives the rate from two scrapes). ``CpuCounters``
integrates the rates into such counters; the rest are pure functions.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any, NamedTuple

from kubekit.quantity import parse_quantity

JSON = dict[str, Any]


class UpperPod(NamedTuple):
    """The upper pod a lower pod's metrics are reported as, with when each of its running
    containers started (seconds since the epoch, as its status says) and their images."""

    namespace: str
    name: str
    uid: str
    container_starts: tuple[tuple[str, float], ...] = ()
    # Each container's image, as its status reports it.
    container_images: tuple[tuple[str, str], ...] = ()


def _cores(usage: Mapping[str, Any]) -> Fraction:
    return parse_quantity(str(usage.get("cpu", "0")))


def _nanocores(cores: Fraction) -> int:
    return int(cores * 1_000_000_000)


def _bytes(usage: Mapping[str, Any]) -> int:
    return int(parse_quantity(str(usage.get("memory", "0"))))


# Where a counter starts: a nanosecond, as a cgroup's once a process ran in it.
# metrics-server drops a pod with any container whose counter reads 0, and an idle
# container's (usage "0" below) would stay 0 for good.
COUNTER_START_SECONDS = 1e-9
# The least working set the node reports. metrics-server drops a node whose working set
# reads 0 (``kubectl top node`` shows it <unknown>), which a virtual node's, the sum of
# its mirrored pods', is while none runs.
NODE_MEMORY_FLOOR_BYTES = 1


class CpuCounters:
    """Cumulative CPU seconds per key, advanced by each observed rate."""

    def __init__(self) -> None:
        # key -> (what it counts, when last advanced, total, when the counter began)
        self._seen: dict[str, tuple[object, float, float, float]] = {}
        # The first reading's time: a container that started before it counts from it.
        # Counted from its start at today's rate, it read a restarted virtual node's
        # whole history at that rate, and metrics-server, holding the last process's
        # sample, saw a container at 0.1 core for days and 1 core now use 50,000 cores.
        self._first_reading: float | None = None

    def advance(
        self,
        key: str,
        cores: float,
        now: float,
        counted: object = None,
        since: float | None = None,
    ) -> float:
        """The counter of ``key`` advanced to ``now`` at ``cores``. ``counted`` names what
        it counts (a container's pod UID and start): another under the same key (the
        container restarted, its pod made again under its name) starts a counter of its
        own, as a cgroup's, as if it had run at ``cores`` ``since`` it started (or
        since this counter set's first reading, when it started before). Carried
        on, it read as a CPU spike: metrics-server takes a container started lately
        to have counted from 0 at its start (a restart at 1 core scraped 20 s after read
        as 181 cores)."""
        if self._first_reading is None:
            self._first_reading = now
        seen = self._seen.get(key)
        if seen is not None and _goes_on(seen[0], counted, seen[3]):
            # The start not known now (the container not running in the upper status:
            # exited, restarting), or known at last: the same counter, under the known.
            counted = counted if _start_of(counted) is not None else seen[0]
            seen = (counted, *seen[1:])
        if seen is None or seen[0] != counted:
            ran = (
                cores * max(0.0, now - max(since, self._first_reading))
                if since is not None
                else 0.0
            )
            seen = (counted, now, COUNTER_START_SECONDS + ran, now)
        _, last_time, total, began = seen
        total += cores * max(0.0, now - last_time)
        self._seen[key] = (counted, now, total, began)
        return total

    def start(self, key: str) -> float | None:
        """The start of what the counter of ``key`` counts, when known: written with it
        while the upper status does not tell it (metrics-server skips a container whose
        start reads earlier than before, and one with none reads 0)."""
        seen = self._seen.get(key)
        return _start_of(seen[0]) if seen is not None else None

    @property
    def first_reading(self) -> float | None:
        return self._first_reading

    def forget_pods_except(self, pods: Iterable[str]) -> None:
        """Drops the counters of pods (``namespace/name``) other than ``pods``, and of
        their containers; the node's stays. A pod a listing of the lower metrics left out
        for once (a container restarting, a metrics-server replica restarting) keeps its
        own: started again at 0, it ran backwards, and the upper metrics-server skipped
        it ("unexpected decrease in cumulative CPU usage")."""
        keep = set(pods)
        for key in list(self._seen):
            if key and "/".join(key.split("/")[:2]) not in keep:
                del self._seen[key]


def _start_of(counted: object) -> float | None:
    return counted[1] if isinstance(counted, tuple) and len(counted) == 2 else None


def _goes_on(before: object, now: object, began: float) -> bool:
    """Whether a container counter named ``before`` goes on as ``now``, each a (pod UID,
    start) pair: the same pod, and the start unknown on one side. A start learned that
    is later than the counter's beginning is a restart since: carried on, the counter's
    whole history read as used since that start (a spike of dozens of cores)."""
    if not (isinstance(before, tuple) and isinstance(now, tuple)) or before[:1] != now[:1]:
        return before == now
    was, start = _start_of(before), _start_of(now)
    return was == start or start is None or (was is None and start <= began)


def mirrored_pod_metrics(
    pod_metrics: Iterable[JSON], mirrored: Mapping[str, UpperPod]
) -> list[tuple[UpperPod, JSON]]:
    """(upper pod, PodMetrics) of the lower pods we mirror."""
    found = []
    for item in pod_metrics:
        metadata = item.get("metadata") or {}
        upper = mirrored.get(f"{metadata.get('namespace')}/{metadata.get('name')}")
        if upper is not None:
            found.append((upper, item))
    return found


class ContainerUsage(NamedTuple):
    name: str
    cores: Fraction
    memory: int
    # Cumulative, when counters are kept.
    cpu_seconds: float = 0.0
    # When the container started, as the upper status says, else as its counter knows.
    started: float | None = None


class PodUsage(NamedTuple):
    upper: UpperPod
    containers: list[ContainerUsage]
    cores: Fraction
    memory: int
    cpu_seconds: float = 0.0


class NodeUsage(NamedTuple):
    pods: list[PodUsage]
    cores: Fraction
    memory: int
    cpu_seconds: float = 0.0


def node_usage(
    pod_metrics: Iterable[JSON],
    mirrored: Mapping[str, UpperPod],
    counters: CpuCounters | None = None,
    now: float = 0.0,
) -> NodeUsage:
    """Our mirrored pods' CPU and memory, their containers' and the node's (what our pods
    use). With ``counters``, each CPU counter is advanced to ``now`` (one set for every
    endpoint, as a kubelet reads one cgroup for each) and those of pods no longer
    mirrored dropped."""

    def advanced(
        key: str, cores: Fraction, counted: object = None, since: float | None = None
    ) -> float:
        if counters is None:
            return 0.0
        return counters.advance(key, float(cores), now, counted, since)

    pods = []
    node_cores, node_memory = Fraction(0), 0
    for upper, item in mirrored_pod_metrics(pod_metrics, mirrored):
        starts = dict(upper.container_starts)
        containers = []
        for container in item.get("containers") or []:
            usage = container.get("usage") or {}
            name = str(container.get("name", ""))
            cores = _cores(usage)
            key = f"{upper.namespace}/{upper.name}/{name}"
            started = starts.get(name)
            cpu_seconds = advanced(key, cores, (upper.uid, started), started)
            if started is None and counters is not None:
                started = counters.start(key)
            containers.append(ContainerUsage(name, cores, _bytes(usage), cpu_seconds, started))
        pod_cores = sum((c.cores for c in containers), Fraction(0))
        pod_memory = sum(c.memory for c in containers)
        pod_key = f"{upper.namespace}/{upper.name}"
        pods.append(
            PodUsage(
                upper, containers, pod_cores, pod_memory, advanced(pod_key, pod_cores, upper.uid)
            )
        )
        node_cores += pod_cores
        node_memory += pod_memory
    node = NodeUsage(pods, node_cores, node_memory, advanced("", node_cores))
    if counters is not None:
        counters.forget_pods_except(f"{u.namespace}/{u.name}" for u in mirrored.values())
    return node


def _rfc3339(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def summary(
    node_name: str,
    pod_metrics: Iterable[JSON],
    mirrored: Mapping[str, UpperPod],
    counters: CpuCounters,
    now: float | None = None,
) -> JSON:
    """A kubelet Summary: the node is what our mirrored pods use. The CPU counters are
    those the other endpoints advance, and every figure a Summary reader requires is
    there (without a counter or a start time, metrics-server up to v0.5 dropped them)."""
    now = time.time() if now is None else now
    timestamp = _rfc3339(now)
    usage = node_usage(pod_metrics, mirrored, counters, now)

    def figures(cores: Fraction, memory: int, cpu_seconds: float) -> JSON:
        return {
            "cpu": {
                "time": timestamp,
                "usageNanoCores": _nanocores(cores),
                "usageCoreNanoSeconds": int(cpu_seconds * 1_000_000_000),
            },
            "memory": {"time": timestamp, "workingSetBytes": memory},
        }

    pods = []
    for pod in usage.pods:
        starts = dict(pod.upper.container_starts)
        containers = []
        for c in pod.containers:
            start = {"startTime": _rfc3339(c.started)} if c.started is not None else {}
            containers.append(
                {"name": c.name, **start, **figures(c.cores, c.memory, c.cpu_seconds)}
            )
        first = min(starts.values(), default=None)
        pods.append(
            {
                "podRef": {
                    "name": pod.upper.name,
                    "namespace": pod.upper.namespace,
                    "uid": pod.upper.uid,
                },
                **({"startTime": _rfc3339(first)} if first is not None else {}),
                "containers": containers,
                **figures(pod.cores, pod.memory, pod.cpu_seconds),
            }
        )
    node_memory = max(usage.memory, NODE_MEMORY_FLOOR_BYTES)
    return {
        "node": {
            "nodeName": node_name,
            "startTime": _rfc3339(counters.first_reading or now),
            **figures(usage.cores, node_memory, usage.cpu_seconds),
        },
        "pods": pods,
    }


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return ",".join(f'{name}="{_label(value)}"' for name, value in sorted(labels.items()))


def _family(name: str, kind: str, help_text: str, samples: list[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def prometheus_text(
    pod_metrics: Iterable[JSON],
    mirrored: Mapping[str, UpperPod],
    counters: CpuCounters,
    now: float | None = None,
) -> str:
    """The kubelet's /metrics/resource families for the node and our mirrored pods, as a
    v1.35 kubelet writes them: families sorted by name, labels sorted by name."""
    now = time.time() if now is None else now
    stamp = int(now * 1000)
    usage = node_usage(pod_metrics, mirrored, counters, now)
    container_cpu, container_memory, container_start, pod_cpu, pod_memory = [], [], [], [], []
    for pod in usage.pods:
        upper = pod.upper
        pod_labels = _labels(namespace=upper.namespace, pod=upper.name)
        for container in pod.containers:
            labels = _labels(container=container.name, namespace=upper.namespace, pod=upper.name)
            container_cpu.append(
                f"container_cpu_usage_seconds_total{{{labels}}} {container.cpu_seconds:.9f} {stamp}"
            )
            container_memory.append(
                f"container_memory_working_set_bytes{{{labels}}} {container.memory} {stamp}"
            )
            if container.started is not None:
                container_start.append(
                    f"container_start_time_seconds{{{labels}}} {container.started!r} {stamp}"
                )
        pod_cpu.append(f"pod_cpu_usage_seconds_total{{{pod_labels}}} {pod.cpu_seconds:.9f} {stamp}")
        pod_memory.append(f"pod_memory_working_set_bytes{{{pod_labels}}} {pod.memory} {stamp}")
    lines = [
        *_family(
            "container_cpu_usage_seconds_total",
            "counter",
            "[STABLE] Cumulative cpu time consumed by the container in core-seconds",
            container_cpu,
        ),
        *_family(
            "container_memory_working_set_bytes",
            "gauge",
            "[STABLE] Current working set of the container in bytes",
            container_memory,
        ),
        *_family(
            "container_start_time_seconds",
            "gauge",
            "[STABLE] Start time of the container since unix epoch in seconds",
            container_start,
        ),
        *_family(
            "node_cpu_usage_seconds_total",
            "counter",
            "[STABLE] Cumulative cpu time consumed by the node in core-seconds",
            [f"node_cpu_usage_seconds_total {usage.cpu_seconds:.9f} {stamp}"],
        ),
        *_family(
            "node_memory_working_set_bytes",
            "gauge",
            "[STABLE] Current working set of the node in bytes",
            [f"node_memory_working_set_bytes {max(usage.memory, NODE_MEMORY_FLOOR_BYTES)} {stamp}"],
        ),
        *_family(
            "pod_cpu_usage_seconds_total",
            "counter",
            "[STABLE] Cumulative cpu time consumed by the pod in core-seconds",
            pod_cpu,
        ),
        *_family(
            "pod_memory_working_set_bytes",
            "gauge",
            "[STABLE] Current working set of the pod in bytes",
            pod_memory,
        ),
        *_family(
            "resource_scrape_error",
            "gauge",
            "[STABLE] 1 if there was an error while getting container metrics, 0 otherwise",
            ["resource_scrape_error 0"],
        ),
    ]
    return "\n".join(lines) + "\n"


def cadvisor_text(
    pod_metrics: Iterable[JSON],
    mirrored: Mapping[str, UpperPod],
    counters: CpuCounters,
    now: float | None = None,
) -> str:
    """The kubelet's /metrics/cadvisor families the lower metrics API can fill, for our
    mirrored pods' containers, with cAdvisor's labels that dashboards and recording rules
    select on (container, image, namespace, pod; cpu="total"). Not written: the labels
    naming the lower node's cgroup and runtime container (id, name), and the families the
    metrics API has no figures for (network, filesystem, throttling...)."""
    now = time.time() if now is None else now
    stamp = int(now * 1000)
    cpu, memory, start = [], [], []
    for pod in node_usage(pod_metrics, mirrored, counters, now).pods:
        upper = pod.upper
        images = dict(upper.container_images)
        for container in pod.containers:
            common = {
                "container": container.name,
                "image": images.get(container.name, ""),
                "namespace": upper.namespace,
                "pod": upper.name,
            }
            cpu.append(
                f"container_cpu_usage_seconds_total{{{_labels(cpu='total', **common)}}} "
                f"{container.cpu_seconds:.9f} {stamp}"
            )
            memory.append(
                f"container_memory_working_set_bytes{{{_labels(**common)}}} "
                f"{container.memory} {stamp}"
            )
            if container.started is not None:
                start.append(
                    f"container_start_time_seconds{{{_labels(**common)}}} "
                    f"{container.started!r} {stamp}"
                )
    lines = [
        *_family(
            "container_cpu_usage_seconds_total",
            "counter",
            "Cumulative cpu time consumed in seconds.",
            cpu,
        ),
        *_family(
            "container_memory_working_set_bytes",
            "gauge",
            "Current working set in bytes.",
            memory,
        ),
        *_family(
            "container_start_time_seconds",
            "gauge",
            "Start time of the container since unix epoch in seconds.",
            start,
        ),
    ]
    return "\n".join(lines) + "\n"
