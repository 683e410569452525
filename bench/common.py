"""Helpers the benchmarks share: deleting a run's namespaces and waiting until their pods
are gone, in the upper cluster and below it; figures over rounds and their verdicts."""

from __future__ import annotations

import asyncio
import math
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.federation import Federation
from harness.localcluster import ClusterSpec, KubectlClient, NodeSpec
from kubekit.client import NAMESPACES, PODS, ApiError, ClientSettings, KubeClient, is_not_found


def upper_and_one_lower(nodes: int, pods_per_node: int) -> list[ClusterSpec]:
    """A federation of one upper and one lower cluster, `lower-1`, of large kwok nodes."""
    lower_nodes = tuple(
        NodeSpec(f"lower-1-node-{i}", cpu="64", memory="256Gi", pods=pods_per_node)
        for i in range(nodes)
    )
    return [ClusterSpec("upper", "upper"), ClusterSpec("lower-1", "lower", lower_nodes)]


async def delete_namespaces(cluster: KubectlClient, names: Iterable[str]) -> None:
    """Deletes namespaces and waits until they, their pods and events are gone."""
    names = list(names)
    async with await KubeClient.connect(ClientSettings(str(cluster.kubeconfig))) as client:
        for name in names:
            await client.delete(NAMESPACES, name)
        for name in names:
            async with asyncio.timeout(900):
                while True:
                    try:
                        await client.get(NAMESPACES, name)
                    except ApiError as error:
                        if is_not_found(error):
                            break
                        raise
                    await asyncio.sleep(1)


async def wait_no_pods(cluster: KubectlClient, names: Iterable[str]) -> None:
    """Waits until the namespaces ``names`` of ``cluster`` hold no pod."""
    async with await KubeClient.connect(ClientSettings(str(cluster.kubeconfig))) as client:
        for name in names:
            async with asyncio.timeout(900):
                # Another cluster's pods: no event here to wait on, polling is the point.
                while (await client.list(PODS, name, limit=1))["items"]:  # noqa: ASYNC110
                    await asyncio.sleep(1)


def spread(values: Sequence[float], fmt: str) -> str:
    """Median and min-max."""
    if not values:
        return "n/a"
    median = statistics.median(values)
    if len(values) == 1:
        return format(median, fmt)
    return f"{median:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def judge(
    title: str,
    values: Sequence[float | None],
    met: Callable[[float], bool],
    fmt: str,
    *,
    every_round: bool = False,
) -> bool:
    """Prints a target's `met` / `MISSED` line, judged on the median of the rounds (or on
    every round: a pod lost once is lost), with how many rounds met it; returns the verdict."""
    measured = [v for v in values if v is not None and not math.isnan(v)]
    if not measured:
        print(f"MISSED  {title}: not measured")
        return False
    rounds_met = sum(1 for v in measured if met(v))
    verdict = rounds_met == len(measured) if every_round else met(statistics.median(measured))
    rounds = f"{len(measured)} round{'s' if len(measured) > 1 else ''}"
    print(
        f"{'met   ' if verdict else 'MISSED'}  {title}: {spread(measured, fmt)} "
        f"(met in {rounds_met} of {rounds})"
    )
    return verdict


@dataclass(frozen=True)
class Target:
    """What a named figure of every round is held against."""

    title: str
    figure: str
    met: Callable[[float], bool]


def summarize(rounds: Sequence[Mapping[str, float]], targets: Iterable[Target], fmt: str) -> None:
    """Every figure's median and min-max over the rounds (a round whose measure failed has
    none), then a met/MISSED line per target, judged on the median."""
    n = len(rounds)
    print(f"over {n} round{'s' if n > 1 else ''}: median (min-max)")
    names = list(dict.fromkeys(name for figures in rounds for name in figures))
    width = max((len(name) for name in names), default=0)
    for name in names:
        values = [figures[name] for figures in rounds if name in figures]
        print(f"    {name.ljust(width)}  {spread(values, fmt)}  ({len(values)} of {n} rounds)")
    print("targets (judged on the median):")
    for target in targets:
        judge(target.title, [figures.get(target.figure) for figures in rounds], target.met, fmt)


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


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def print_cpu(title: str, wall: float, used: dict[str, float], least: float = 0.05) -> None:
    """The CPU used, in all and by each process that used at least ``least`` of it."""
    total = sum(used.values())
    print(
        f"CPU {title}: {total:.1f} s in {wall:.1f} s of wall time "
        f"({total / wall:.2f} of {os.cpu_count()} cores)"
    )
    for name, seconds in sorted(used.items(), key=lambda item: -item[1]):
        if seconds >= least * total:
            print(f"    {name:40} {seconds:6.1f} s")
