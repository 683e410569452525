"""`kubestrata multischeduler`: flags, and the wiring of the upper cluster's Node cache,
the estimators and the HTTPS server."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from kubekit import keys, leader, logs
from kubekit.certreload import start_https_site
from kubekit.client import (
    JSON,
    NAMESPACES,
    NODES,
    PODS,
    RESOURCEQUOTAS,
    ApiError,
    ClientSettings,
    KubeClient,
    Resource,
    is_not_found,
)
from kubekit.component import run_component
from kubekit.health import Health
from kubekit.informer import FunctionHandler, Informer
from kubekit.leader import ElectionSettings
from kubekit.serving import (
    add_serving_arguments,
    check_client_ca,
    check_kubeconfig,
    check_serving_arguments,
    serving,
)
from kubekit.slices import Policy, SliceError
from multischeduler.estimators import (
    EstimatorClient,
    add_estimator_client_arguments,
    estimator_client,
)
from multischeduler.extender import BindingArgs, OnEstimatorError, Score, binding_body
from multischeduler.server import (
    FILTER_BUDGET,
    LOOKUP_TIMEOUT,
    Binder,
    Callers,
    Extender,
    Lookup,
    make_app,
)
from multischeduler.slicing import Headrooms, SliceController, headrooms

log = logging.getLogger("multischeduler")

# Within the scheduler's httpTimeout (5 s) for the whole bind call.
BIND_TIMEOUT = 4.0
# A round of estimator calls: with the read of Nodes the cache has not shown yet, within
# a filter's budget (longer, one estimator that hangs failed every pod's whole attempt).
MAX_ESTIMATOR_TIMEOUT = FILTER_BUDGET - LOOKUP_TIMEOUT - 0.5


@dataclass(frozen=True)
class Config:
    host: str
    port: int
    cert_file: Path
    key_file: Path
    client_ca_file: Path
    callers: Callers
    kubeconfig: str | None
    estimators: EstimatorClient
    estimator_timeout: float
    on_estimator_error: OnEstimatorError
    score: Score
    slice_headroom: Headrooms
    slice_policy: Policy
    slice_timeout: float
    election: ElectionSettings | None


def _seconds(text: str, most: float = 60.0) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= most:
        raise argparse.ArgumentTypeError(
            f"must be above 0 and at most {most:g} seconds, not {text}"
        )
    return value


def _estimator_seconds(text: str) -> float:
    return _seconds(text, MAX_ESTIMATOR_TIMEOUT)


def parse_args(argv: Sequence[str]) -> Config:
    parser = argparse.ArgumentParser(
        prog="kubestrata multischeduler",
        description="Scheduler extender of the upper cluster: lets a pod onto a virtual node "
        "only when one real node of that lower cluster fits it, as the cluster's fit "
        "estimator says; scores clusters and binds pods.",
    )
    parser.add_argument(
        "--kubeconfig", help="of the upper cluster, for Nodes and Bindings (default: in-cluster)"
    )
    add_serving_arguments(parser, "multischeduler-ca.crt, the scheduler's tlsConfig.caFile")
    parser.add_argument(
        "--client-ca-file",
        type=Path,
        required=True,
        help="CA that signed the upper kube-scheduler's client certificate (its extender "
        "tlsConfig certFile and keyFile): filter, prioritize and bind from anyone else are "
        "refused",
    )
    parser.add_argument(
        "--client-name",
        action="append",
        default=[],
        help="common name the scheduler's client certificate must have (repeatable; "
        "default: any certificate the CA signed); for a CA that signs for others too",
    )
    add_estimator_client_arguments(parser)
    parser.add_argument(
        "--estimator-timeout",
        type=_estimator_seconds,
        default=0.5,
        help="deadline of one round of estimator calls, in seconds; a filter makes a second "
        "round for estimators that restarted meanwhile (default %(default)s)",
    )
    parser.add_argument(
        "--on-estimator-error",
        choices=[choice.value for choice in OnEstimatorError],
        default=OnEstimatorError.FAIL.value,
        help="a virtual node whose estimator cannot answer fails or passes (default %(default)s)",
    )
    parser.add_argument(
        "--score",
        choices=[choice.value for choice in Score],
        default=Score.BEST_FIT.value,
        help="best-fit prefers the cluster whose tightest fitting node is left with the least "
        "stranded room; least-allocated the one with the emptiest (default %(default)s)",
    )
    parser.add_argument(
        "--slice-headroom",
        action="append",
        default=[],
        metavar="[CLUSTER:]HEADROOM",
        help="what a lower cluster keeps out of the quota slices it promises: N%%, 0, or "
        "cpu=Q,memory=Q; CLUSTER: for one cluster (repeatable; default 10%%)",
    )
    parser.add_argument(
        "--slice-policy",
        choices=[choice.value for choice in Policy],
        default=Policy.SPREAD.value,
        help="new slices go to the cluster holding the fewest of the namespace's (spread) "
        "or the most (pack) (default %(default)s)",
    )
    parser.add_argument(
        "--slice-timeout",
        type=_seconds,
        default=10.0,
        help="deadline of each call placing quota slices, in seconds: a promise writes to the "
        "lower cluster (default %(default)s)",
    )
    logs.add_arguments(parser)
    leader.add_arguments(parser, "places quota slices (every replica serves the extender)")
    args = parser.parse_args(argv)
    try:
        slice_headroom = headrooms(args.slice_headroom)
    except SliceError as error:
        parser.error(f"--slice-headroom: {error}")
    try:
        election = leader.election_settings(args, keys.SLICES_LEASE)
    except ValueError as error:
        parser.error(str(error))
    logs.configure(args.log_level, args.log_format)
    check_serving_arguments(parser, args)
    check_client_ca(parser, args.client_ca_file, "--client-ca-file")
    estimators = estimator_client(parser, args)
    check_kubeconfig(parser, args.kubeconfig)
    listening = serving(parser, args, "multischeduler")
    return Config(
        host=listening.host,
        port=listening.port,
        cert_file=listening.cert_file,
        key_file=listening.key_file,
        client_ca_file=args.client_ca_file,
        callers=Callers(frozenset(args.client_name)),
        kubeconfig=args.kubeconfig,
        estimators=estimators,
        estimator_timeout=args.estimator_timeout,
        on_estimator_error=OnEstimatorError(args.on_estimator_error),
        score=Score(args.score),
        slice_headroom=slice_headroom,
        slice_policy=Policy(args.slice_policy),
        slice_timeout=args.slice_timeout,
        election=election,
    )


def api_calls(client: KubeClient) -> tuple[Binder, Lookup]:
    """The extender's calls to the upper apiserver, each within its deadline from its
    start: the wait for the client's request budget counts (in a burst it alone outlasted
    the scheduler's 5 s for the call), and so does no wait the apiserver names."""

    async def bind(args: BindingArgs) -> None:
        path = PODS.path(args.pod_namespace, args.pod_name, "binding")
        async with asyncio.timeout(BIND_TIMEOUT):
            await client.request(
                "POST", path, body=binding_body(args), timeout=BIND_TIMEOUT, retry_when_told=False
            )

    async def lookup(resource: Resource, namespace: str | None, name: str) -> JSON | None:
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT):
                return await client.request(
                    "GET",
                    resource.path(namespace, name),
                    timeout=LOOKUP_TIMEOUT,
                    retry_when_told=False,
                )
        except ApiError as error:
            if is_not_found(error):
                return None
            raise

    return bind, lookup


async def run(config: Config) -> None:
    async with await KubeClient.connect(ClientSettings(config.kubeconfig)) as client:
        bind, lookup = api_calls(client)
        pool = config.estimators.pool()
        # Every Node, not only virtual ones: a name the scheduler sends that the cache
        # has not seen is then news, not taken for an ordinary node and let through.
        nodes = Informer(client, NODES)
        nodes.add_handler(pool.handler())
        namespaces = Informer(client, NAMESPACES)
        quotas = Informer(client, RESOURCEQUOTAS)
        slicing = SliceController(
            client,
            namespaces,
            quotas,
            pool,
            headroom=config.slice_headroom,
            policy=config.slice_policy,
            timeout=config.slice_timeout,
        )
        extender = Extender(
            pool,
            bind,
            lookup,
            estimator_timeout=config.estimator_timeout,
            on_error=config.on_estimator_error,
            score=config.score,
            slices_of=slicing.placement_of,
        )
        # The scheduler's queue: a pod leaves it when bound or deleted.
        waiting = Informer(client, PODS, field_selector="spec.nodeName=")
        waiting.add_handler(FunctionHandler(delete=extender.stopped_waiting))
        informers = (nodes, namespaces, quotas, waiting)
        watching = [
            asyncio.create_task(informer.run(), name=repr(informer)) for informer in informers
        ]
        runner = web.AppRunner(make_app(extender, config.callers), access_log=None)
        reloading: asyncio.Task[None] | None = None
        try:
            # Before the caches are filled every virtual node would look ordinary and pass,
            # and every namespace unsliced.
            await asyncio.gather(*(i.wait_synced() for i in informers))
            await runner.setup()
            reloading = await start_https_site(
                runner,
                config.host,
                config.port,
                config.cert_file,
                config.key_file,
                config.client_ca_file,
            )
            log.info(
                "serving the scheduler extender on https://%s:%d with %d virtual nodes",
                config.host,
                config.port,
                len(pool.nodes),
            )
            # Until a signal cancels the task, which the finally below cleans up after.
            await leader.run_leading(config.kubeconfig, config.election, Health(), slicing.run)
        finally:
            if reloading is not None:
                reloading.cancel()
            await runner.cleanup()
            await extender.stop()
            slicing.queue.shut_down()
            for task in watching:
                task.cancel()
            await asyncio.gather(*watching, return_exceptions=True)
            await pool.close()


def main(argv: Sequence[str]) -> int:
    return run_component(run(parse_args(argv)), log)
