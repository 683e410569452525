"""/stats/summary and /metrics/resource from the lower cluster's metrics.k8s.io API.

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
    containers started (seconds since the epoch, as its status says)."""

    namespace: str
    name: str
    uid: str
    container_starts: tuple[tuple[str, float], ...] = ()


def _cores(usage: Mapping[str, Any]) -> Fraction:
    return parse_quantity(str(usage.get("cpu", "0")))


def _nanocores(cores: Fraction) -> int:
    return int(cores * 1_000_000_000)


def _bytes(usage: Mapping[str, Any]) -> int:
    return int(parse_quantity(str(usage.get("memory", "0"))))


class CpuCounters:
    """Cumulative CPU seconds per key, advanced by each observed rate."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, float]] = {}

    def advance(self, key: str, cores: float, now: float) -> float:
        last_time, total = self._seen.get(key, (now, 0.0))
        total += cores * max(0.0, now - last_time)
        self._seen[key] = (now, total)
        return total

    def forget_except(self, keys: Iterable[str]) -> None:
        keep = set(keys)
        for key in list(self._seen):
            if key not in keep:
                del self._seen[key]


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


def summary(
    node_name: str,
    pod_metrics: Iterable[JSON],
    mirrored: Mapping[str, UpperPod],
    timestamp: str,
) -> JSON:
    """A kubelet Summary: the node is what our mirrored pods use."""
    pods = []
    node_cores, node_memory = Fraction(0), 0
    for upper, item in mirrored_pod_metrics(pod_metrics, mirrored):
        containers = []
        pod_cores, pod_memory = Fraction(0), 0
        for container in item.get("containers") or []:
            usage = container.get("usage") or {}
            cores, memory = _cores(usage), _bytes(usage)
            pod_cores += cores
            pod_memory += memory
            containers.append(
                {
                    "name": container.get("name", ""),
                    "cpu": {"time": timestamp, "usageNanoCores": _nanocores(cores)},
                    "memory": {"time": timestamp, "workingSetBytes": memory},
                }
            )
        node_cores += pod_cores
        node_memory += pod_memory
        pods.append(
            {
                "podRef": {"name": upper.name, "namespace": upper.namespace, "uid": upper.uid},
                "containers": containers,
                "cpu": {"time": timestamp, "usageNanoCores": _nanocores(pod_cores)},
                "memory": {"time": timestamp, "workingSetBytes": pod_memory},
            }
        )
    return {
        "node": {
            "nodeName": node_name,
            "cpu": {"time": timestamp, "usageNanoCores": _nanocores(node_cores)},
            "memory": {"time": timestamp, "workingSetBytes": node_memory},
        },
        "pods": pods,
    }


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help_text: str, samples: list[str]) -> list[str]:
    return [f"# HELP {name} [STABLE] {help_text}", f"# TYPE {name} {kind}", *samples]


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
    node_cores, node_memory = Fraction(0), 0
    container_cpu, container_memory, container_start, pod_cpu, pod_memory = [], [], [], [], []
    keys = []
    for upper, item in mirrored_pod_metrics(pod_metrics, mirrored):
        pod_labels = f'namespace="{_label(upper.namespace)}",pod="{_label(upper.name)}"'
        pod_cores, pod_bytes = Fraction(0), 0
        starts = dict(upper.container_starts)
        for container in item.get("containers") or []:
            usage = container.get("usage") or {}
            cores, memory = _cores(usage), _bytes(usage)
            pod_cores += cores
            pod_bytes += memory
            key = f"{upper.namespace}/{upper.name}/{container.get('name', '')}"
            keys.append(key)
            labels = f'container="{_label(container.get("name", ""))}",{pod_labels}'
            total = counters.advance(key, float(cores), now)
            container_cpu.append(
                f"container_cpu_usage_seconds_total{{{labels}}} {total:.9f} {stamp}"
            )
            container_memory.append(
                f"container_memory_working_set_bytes{{{labels}}} {memory} {stamp}"
            )
            started = starts.get(container.get("name", ""))
            if started is not None:
                container_start.append(
                    f"container_start_time_seconds{{{labels}}} {started!r} {stamp}"
                )
        key = f"{upper.namespace}/{upper.name}"
        keys.append(key)
        pod_total = counters.advance(key, float(pod_cores), now)
        pod_cpu.append(f"pod_cpu_usage_seconds_total{{{pod_labels}}} {pod_total:.9f} {stamp}")
        pod_memory.append(f"pod_memory_working_set_bytes{{{pod_labels}}} {pod_bytes} {stamp}")
        node_cores += pod_cores
        node_memory += pod_bytes
    keys.append("")
    node_total = counters.advance("", float(node_cores), now)
    counters.forget_except(keys)
    lines = [
        *_family(
            "container_cpu_usage_seconds_total",
            "counter",
            "Cumulative cpu time consumed by the container in core-seconds",
            container_cpu,
        ),
        *_family(
            "container_memory_working_set_bytes",
            "gauge",
            "Current working set of the container in bytes",
            container_memory,
        ),
        *_family(
            "container_start_time_seconds",
            "gauge",
            "Start time of the container since unix epoch in seconds",
            container_start,
        ),
        *_family(
            "node_cpu_usage_seconds_total",
            "counter",
            "Cumulative cpu time consumed by the node in core-seconds",
            [f"node_cpu_usage_seconds_total {node_total:.9f} {stamp}"],
        ),
        *_family(
            "node_memory_working_set_bytes",
            "gauge",
            "Current working set of the node in bytes",
            [f"node_memory_working_set_bytes {node_memory} {stamp}"],
        ),
        *_family(
            "pod_cpu_usage_seconds_total",
            "counter",
            "Cumulative cpu time consumed by the pod in core-seconds",
            pod_cpu,
        ),
        *_family(
            "pod_memory_working_set_bytes",
            "gauge",
            "Current working set of the pod in bytes",
            pod_memory,
        ),
        *_family(
            "resource_scrape_error",
            "gauge",
            "1 if there was an error while getting container metrics, 0 otherwise",
            ["resource_scrape_error 0"],
        ),
    ]
    return "\n".join(lines) + "\n"
