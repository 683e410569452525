"""/stats/summary and /metrics/resource from the lower cluster's metrics.k8s.io API.

The metrics API gives usage rates over a window; the kubelet's resource metrics give a
monotonic CPU counter (metrics-server derives the rate from two scrapes). ``CpuCounters``
integrates the rates into such counters; the rest are pure functions.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

from kubekit.quantity import parse_quantity

JSON = dict[str, Any]


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
    pod_metrics: Iterable[JSON], mirrored: Mapping[str, tuple[str, str]]
) -> list[tuple[str, str, JSON]]:
    """(upper namespace, upper name, PodMetrics) of the lower pods we mirror."""
    found = []
    for item in pod_metrics:
        metadata = item.get("metadata") or {}
        upper = mirrored.get(f"{metadata.get('namespace')}/{metadata.get('name')}")
        if upper is not None:
            found.append((upper[0], upper[1], item))
    return found


def summary(
    node_name: str,
    pod_metrics: Iterable[JSON],
    mirrored: Mapping[str, tuple[str, str]],
    timestamp: str,
) -> JSON:
    """A kubelet Summary: the node is what our mirrored pods use."""
    pods = []
    node_cores, node_memory = Fraction(0), 0
    for namespace, name, item in mirrored_pod_metrics(pod_metrics, mirrored):
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
                "podRef": {"name": name, "namespace": namespace},
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


def prometheus_text(
    pod_metrics: Iterable[JSON],
    mirrored: Mapping[str, tuple[str, str]],
    counters: CpuCounters,
    now: float | None = None,
) -> str:
    """The kubelet's /metrics/resource families for the node and our mirrored pods."""
    now = time.time() if now is None else now
    stamp = int(now * 1000)
    node_cores, node_memory = Fraction(0), 0
    cpu_lines, memory_lines = [], []
    keys = []
    for namespace, name, item in mirrored_pod_metrics(pod_metrics, mirrored):
        for container in item.get("containers") or []:
            usage = container.get("usage") or {}
            cores, memory = _cores(usage), _bytes(usage)
            node_cores += cores
            node_memory += memory
            key = f"{namespace}/{name}/{container.get('name', '')}"
            keys.append(key)
            labels = (
                f'container="{_label(container.get("name", ""))}",'
                f'namespace="{_label(namespace)}",pod="{_label(name)}"'
            )
            total = counters.advance(key, float(cores), now)
            cpu_lines.append(f"container_cpu_usage_seconds_total{{{labels}}} {total:.9f} {stamp}")
            memory_lines.append(f"container_memory_working_set_bytes{{{labels}}} {memory} {stamp}")
    keys.append("")
    node_total = counters.advance("", float(node_cores), now)
    counters.forget_except(keys)
    lines = [
        "# HELP container_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by "
        "the container in core-seconds",
        "# TYPE container_cpu_usage_seconds_total counter",
        *cpu_lines,
        "# HELP container_memory_working_set_bytes [STABLE] Current working set of the "
        "container in bytes",
        "# TYPE container_memory_working_set_bytes gauge",
        *memory_lines,
        "# HELP node_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the "
        "node in core-seconds",
        "# TYPE node_cpu_usage_seconds_total counter",
        f"node_cpu_usage_seconds_total {node_total:.9f} {stamp}",
        "# HELP node_memory_working_set_bytes [STABLE] Current working set of the node in bytes",
        "# TYPE node_memory_working_set_bytes gauge",
        f"node_memory_working_set_bytes {node_memory} {stamp}",
    ]
    return "\n".join(lines) + "\n"
