"""`kubestrata descheduler`: flags, and the wiring of the upper cluster's caches, the
estimators and the loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from descheduler.controller import Descheduler
from descheduler.policy import Policy, PolicyError, parse_policy
from kubekit import keys, leader, logs
from kubekit.client import (
    NAMESPACES,
    NODES,
    PODDISRUPTIONBUDGETS,
    PODS,
    ClientSettings,
    KubeClient,
)
from kubekit.component import run_component
from kubekit.health import Health
from kubekit.informer import Informer
from kubekit.leader import ElectionSettings
from kubekit.serving import check_kubeconfig
from multischeduler.estimators import (
    EstimatorClient,
    add_estimator_client_arguments,
    estimator_client,
)

log = logging.getLogger("descheduler")


@dataclass(frozen=True)
class Config:
    kubeconfig: str | None
    policy: Policy
    dry_run: bool
    once: bool
    estimators: EstimatorClient
    health_address: str = "0.0.0.0"
    health_port: int = 10258  # 0: none
    election: ElectionSettings | None = None  # None: no leader election


def parse_args(argv: Sequence[str]) -> Config:
    parser = argparse.ArgumentParser(
        prog="kubestrata descheduler",
        description="Moves upper pods stuck in their lower cluster (unschedulable there, or "
        "the cluster down) to a cluster whose fit estimator says one real node fits them: "
        "a controller's pod through the Eviction API, a bare pod as a copy. Makes room for "
        "pods no node of any cluster fits by evicting the fewest movable pods from one.",
    )
    parser.add_argument("--kubeconfig", help="of the upper cluster (default: in-cluster)")
    parser.add_argument(
        "--policy",
        type=Path,
        help="YAML policy: pendingTimeout, clusterDownTimeout, interval, defragAfter, "
        "holdTimeout, returnAfter (seconds), maxEvictionsPerCycle, maxEvictionsPerNamespace, "
        "maxEvictionsPerNode (default: 60, 300, 10, 60, 120, 600, 10, 5, 5)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print every move and make none (with no leader election)",
    )
    parser.add_argument("--once", action="store_true", help="one cycle, then exit")
    parser.add_argument(
        "--health-port",
        type=int,
        default=10258,
        help="plain HTTP /healthz, /readyz (once the caches are synced) and /metrics, "
        "unauthenticated (default %(default)s; 0: none)",
    )
    parser.add_argument(
        "--health-address", default="0.0.0.0", help="where to serve them (default %(default)s)"
    )
    add_estimator_client_arguments(parser)
    logs.add_arguments(parser)
    leader.add_arguments(parser, "moves pods")
    args = parser.parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    check_kubeconfig(parser, args.kubeconfig)
    if not 0 <= args.health_port < 65536:
        parser.error(f"--health-port {args.health_port} is not a TCP port (0: none)")
    try:
        # A dry run changes nothing: it neither waits for the Lease nor takes it from the
        # replicas that move pods.
        election = None if args.dry_run else leader.election_settings(args, keys.DESCHEDULER_LEASE)
    except ValueError as error:
        parser.error(str(error))
    policy = Policy()
    if args.policy is not None:
        try:
            policy = parse_policy(args.policy.read_text())
        except (OSError, UnicodeDecodeError) as error:
            parser.error(f"--policy {args.policy}: {error}")
        except PolicyError as error:
            parser.error(f"--policy {args.policy}: {error}")
    return Config(
        kubeconfig=args.kubeconfig,
        policy=policy,
        dry_run=args.dry_run,
        once=args.once,
        estimators=estimator_client(parser, args),
        health_address=args.health_address,
        health_port=args.health_port,
        election=election,
    )


async def run(config: Config) -> None:
    health = Health()
    health_runner = (
        await health.serve(config.health_address, config.health_port)
        if config.health_port
        else None
    )
    try:
        await leader.run_leading(
            config.kubeconfig, config.election, health, lambda: deschedule(config, health)
        )
    finally:
        if health_runner is not None:
            await health_runner.cleanup()


async def deschedule(config: Config, health: Health) -> None:
    health.mark_not_ready("starting")
    async with await KubeClient.connect(ClientSettings(config.kubeconfig)) as client:
        pool = config.estimators.pool()
        nodes = Informer(
            client,
            NODES,
            label_selector=f"{keys.VIRTUAL_NODE_LABEL}={keys.VIRTUAL_NODE_LABEL_VALUE}",
        )
        nodes.add_handler(pool.handler())
        pods = Informer(client, PODS)
        budgets = Informer(client, PODDISRUPTIONBUDGETS)
        namespaces = Informer(client, NAMESPACES)
        watching = [
            asyncio.create_task(informer.run(), name=repr(informer))
            for informer in (nodes, pods, budgets, namespaces)
        ]
        descheduler = Descheduler(
            client, pods, nodes, budgets, namespaces, pool, config.policy, config.dry_run
        )
        try:
            await descheduler.wait_synced()
            health.mark_ready()
            if config.once:
                await descheduler.cycle()
                return
            log.info(
                "descheduling%s every %.0f s: pending %.0f s, cluster down %.0f s, "
                "defragmenting after %.0f s",
                " (dry run)" if config.dry_run else "",
                config.policy.interval,
                config.policy.pending_timeout,
                config.policy.cluster_down_timeout,
                config.policy.defrag_after,
            )
            await descheduler.run()
        finally:
            for task in watching:
                task.cancel()
            await asyncio.gather(*watching, return_exceptions=True)
            await pool.close()


def main(argv: Sequence[str]) -> int:
    return run_component(run(parse_args(argv)), log)
