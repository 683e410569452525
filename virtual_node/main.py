"""`kubestrata virtual-node`: wires the controllers for one lower cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from kubekit import keys, leader, logs, pki
from kubekit.certreload import start_https_site
from kubekit.client import (
    CONFIGMAPS,
    EVENTS,
    NAMESPACES,
    NODES,
    PERSISTENTVOLUMECLAIMS,
    PERSISTENTVOLUMES,
    PODS,
    RESOURCEQUOTAS,
    RUNTIMECLASSES,
    STORAGECLASSES,
    ClientSettings,
    KubeClient,
    shrink_tls_read_buffers,
)
from kubekit.clusterstate import ClusterState
from kubekit.component import run_component
from kubekit.health import Health
from kubekit.informer import FunctionHandler, InformerFactory
from kubekit.leader import ElectionSettings
from kubekit.loops import run_together
from kubekit.serving import check_client_ca, check_kubeconfig, check_serving_pair
from kubekit.slices import bound_outside_slices, held_namespaces
from kubekit.stash import unguarded_reason
from kubekit.timestamps import now_micro
from kubekit.workqueue import WorkQueue
from virtual_node.estimator import EstimatorServer, EstimatorService, FitEstimator
from virtual_node.estimator import serve as serve_estimator
from virtual_node.events import EventReflector, event_queue
from virtual_node.kubeletapi.auth import Authorizer
from virtual_node.kubeletapi.certificates import Renewal, keep_renewed, serving_certificate
from virtual_node.kubeletapi.server import RUNNER_OPTIONS, STREAMING_IDLE_TIMEOUT, KubeletServer
from virtual_node.kubeletstreams import LowerKubelet
from virtual_node.lower import LowerCluster
from virtual_node.namespaces import LowerNamespaces
from virtual_node.naming import NamespaceMapping, Strategy
from virtual_node.node import NodeIdentity
from virtual_node.nodecontroller import NodeController
from virtual_node.podcontroller import FINISHED, PodController
from virtual_node.promises import SlicePromises
from virtual_node.reflector import RESOURCES as REFLECTED
from virtual_node.reflector import Reflector
from virtual_node.translate import Ownership
from virtual_node.volumes import ClaimVolumes

log = logging.getLogger("virtual_node")

ORPHAN_SWEEP_SECONDS = 60.0
# As many lower creates in flight as a client that keeps a lower apiserver busy: at 20
# a burst left the lower cluster idle a tenth of the time.
DEFAULT_WORKERS = 64
_CLUSTER_ID = re.compile(r"[a-z0-9]([-a-z0-9]{0,51}[a-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# The node name is also a label value (kubernetes.io/hostname, the virtual node label on
# every lower pod).
_NODE_NAME_MAX = 63


def is_node_name(name: str) -> bool:
    """A DNS-1123 subdomain, as the Node's and its Lease's names must be (``a..b`` or
    ``a.-b`` would pass as a label value, and the Lease be refused at every try while
    the replica said it was ready), short enough to be a label value."""
    return len(name) <= _NODE_NAME_MAX and all(
        _DNS_LABEL.fullmatch(part) for part in name.split(".")
    )


@dataclass(frozen=True)
class VirtualNodeConfig:
    lower_kubeconfig: str
    cluster_id: str
    upper_kubeconfig: str = ""  # "": in-cluster (the pod's ServiceAccount)
    node_name: str = ""
    taint: bool = True
    address: str = "127.0.0.1"
    kubelet_port: int = 10250
    estimator_port: int = 10352  # 0: no fit estimator
    health_port: int = 10248  # 0: no /healthz and /readyz
    workers: int = DEFAULT_WORKERS
    upper_qps: float = 200.0
    upper_burst: int = 400
    lower_qps: float = 200.0
    lower_burst: int = 400
    event_qps: float = 50.0
    event_burst: int = 100
    tls_cert_file: str = ""
    tls_key_file: str = ""
    client_ca_file: str = ""
    cert_dir: str = ""
    namespace_strategy: Strategy = "same"
    namespace_prefix: str = ""
    # Lower nodes tainted NoSchedule/NoExecute only with these keys count in the capacity.
    counted_taint_keys: tuple[str, ...] = ()
    # Upper namespaces whose pods may be privileged or use the lower nodes' host.
    host_access_namespaces: tuple[str, ...] = ()
    # Seconds an exec, attach or port-forward session may carry nothing before it is
    # closed (0: never); the kubelet's --streaming-connection-idle-timeout.
    streaming_connection_idle_timeout: float = STREAMING_IDLE_TIMEOUT
    log_level: str = "INFO"
    log_format: str = "text"
    # Of several replicas, only the one holding the Lease mirrors.
    leader_elect: bool = True
    leader_elect_namespace: str = keys.SYSTEM_NAMESPACE
    leader_elect_identity: str = ""  # "": the host name and a random part
    leader_elect_lease_duration: float = leader.LEASE_DURATION
    leader_elect_renew_deadline: float = leader.RENEW_DEADLINE
    leader_elect_retry_period: float = leader.RETRY_PERIOD

    def __post_init__(self) -> None:
        _check_types(self)
        if not _CLUSTER_ID.fullmatch(self.cluster_id):
            raise ValueError(
                f"cluster id {self.cluster_id!r} must be a DNS label of at most 53 characters "
                "(lowercase letters, digits, '-')"
            )
        if self.node_name and not is_node_name(self.node_name):
            # Every lower pod, labelled with it, would be refused.
            raise ValueError(
                f"node name {self.node_name!r} must be a DNS name of at most "
                f"{_NODE_NAME_MAX} characters (lowercase letters, digits, '-' between them, "
                "'.' between such parts): it is a label value too"
            )
        if self.streaming_connection_idle_timeout < 0:
            raise ValueError("the streaming connection idle timeout cannot be negative")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        for name in ("upper_burst", "lower_burst", "event_burst"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if not 0 < self.kubelet_port < 65536:
            raise ValueError(f"kubelet port {self.kubelet_port} is not a TCP port")
        if not 0 <= self.estimator_port < 65536:
            raise ValueError(f"estimator port {self.estimator_port} is not a TCP port (0: none)")
        if not 0 <= self.health_port < 65536:
            raise ValueError(f"health port {self.health_port} is not a TCP port (0: none)")
        ports = [p for p in (self.kubelet_port, self.estimator_port, self.health_port) if p]
        if len(set(ports)) != len(ports):
            # The second bind would fail at every restart of the work, for ever.
            raise ValueError(
                f"the kubelet ({self.kubelet_port}), estimator ({self.estimator_port}) and "
                f"health ({self.health_port}) ports must differ"
            )
        for name in ("upper_qps", "lower_qps", "event_qps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be above 0, not {getattr(self, name)}")
        NamespaceMapping(self.namespace_strategy, self.namespace_prefix)  # validates
        for name in ("counted_taint_keys", "host_access_namespaces"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, str) and v for v in value
            ):
                raise ValueError(f"{name} must be a list of non-empty strings, not {value!r}")
            object.__setattr__(self, name, tuple(value))  # a YAML list is a list
        if self.log_level not in logs.LEVELS or self.log_format not in logs.FORMATS:
            raise ValueError(
                f"log level {self.log_level!r} or format {self.log_format!r} unknown: levels "
                f"{', '.join(logs.LEVELS)}; formats {', '.join(logs.FORMATS)}"
            )
        self.election()  # validates
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if not self.client_ca_file:
            raise ValueError(
                "client_ca_file is required: the CA of the upper apiserver's kubelet client "
                "certificate (callers without a certificate need a bearer token)"
            )

    @property
    def name(self) -> str:
        return self.node_name or keys.default_node_name(self.cluster_id)

    def election(self) -> ElectionSettings | None:
        return leader.election_settings(self, keys.virtual_node_lease_name(self.name))


def _check_types(config: VirtualNodeConfig) -> None:
    """Each setting of the type of its default: a YAML file's `taint: "false"` is a true
    string, and a quoted number failed only at the first request."""
    for field in fields(config):
        value = getattr(config, field.name)
        expected = str if field.default is MISSING else type(field.default)
        if expected is tuple:
            continue  # checked with its items
        accepted: tuple[type, ...] = (int, float) if expected is float else (expected,)
        if isinstance(value, bool) is not (expected is bool) or not isinstance(value, accepted):
            raise ValueError(
                f"{field.name} must be {'a number' if expected is float else expected.__name__}"
                f", not {value!r}"
            )


def parse_args(argv: Sequence[str]) -> VirtualNodeConfig:
    parser = argparse.ArgumentParser(
        prog="kubestrata virtual-node",
        description="Make a lower cluster appear as one Node of an upper cluster.",
    )
    parser.add_argument(
        "--config", type=Path, help="YAML file with any of the options below (snake_case keys)"
    )
    parser.add_argument("--upper-kubeconfig", help="default: in-cluster")
    parser.add_argument("--lower-kubeconfig")
    parser.add_argument("--cluster-id")
    parser.add_argument("--node-name", help="default vk-<cluster-id>")
    parser.add_argument(
        "--no-taint",
        dest="taint",
        action="store_const",
        const=False,
        help="do not taint the Node with virtual-kubelet.io/provider",
    )
    parser.add_argument(
        "--address",
        help="address the upper apiserver reaches the kubelet API at (default 127.0.0.1; "
        "the apiserver proxies nodes/proxy to no loopback address: set the pod's IP)",
    )
    parser.add_argument("--kubelet-port", type=int)
    parser.add_argument(
        "--estimator-port", type=int, help="fit estimator's gRPC port (default 10352; 0: none)"
    )
    parser.add_argument(
        "--health-port",
        type=int,
        help="plain HTTP /healthz and /readyz for probes, unauthenticated (default 10248; 0: "
        "none); ready once the caches are synced",
    )
    parser.add_argument("--tls-cert-file", help="kubelet API serving certificate (PEM)")
    parser.add_argument("--tls-key-file", help="its key; without both: a CSR, else self-signed")
    parser.add_argument(
        "--client-ca-file", help="CA that signs client certificates (the apiserver's)"
    )
    parser.add_argument(
        "--cert-dir",
        help="where an obtained or generated certificate is kept (default: a "
        "directory under the system temporary directory)",
    )
    parser.add_argument(
        "--streaming-connection-idle-timeout",
        type=float,
        metavar="SECONDS",
        help="close an exec, attach or port-forward session that carried nothing either "
        "way this long (default 14400, the kubelet's 4h; 0: never)",
    )
    parser.add_argument("--workers", type=int)
    parser.add_argument("--upper-qps", type=float)
    parser.add_argument("--upper-burst", type=int)
    parser.add_argument("--lower-qps", type=float)
    parser.add_argument("--lower-burst", type=int)
    parser.add_argument("--event-qps", type=float, help="re-emitted events per second (default 50)")
    parser.add_argument("--event-burst", type=int)
    parser.add_argument("--namespace-strategy", choices=["same", "prefix"])
    parser.add_argument("--namespace-prefix")
    parser.add_argument(
        "--allow-host-access",
        dest="host_access_namespaces",
        metavar="NAMESPACE",
        action="append",
        help="upper namespace whose pods may be privileged or use the lower nodes' host "
        "network, PID or IPC namespace, hostPath volumes or host ports (repeatable). "
        "Default: none; such pods fail with reason HostAccessRefused",
    )
    parser.add_argument(
        "--count-tainted-nodes",
        dest="counted_taint_keys",
        metavar="TAINT_KEY",
        action="append",
        help="lower nodes tainted NoSchedule or NoExecute count in the Node's capacity only "
        "when every such taint has one of these keys (repeatable; federated pods must "
        "tolerate them). Default: tainted lower nodes do not count",
    )
    logs.add_arguments(parser, defaults=False)
    leader.add_arguments(parser, "mirrors this lower cluster", defaults=False)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if args.config:
        try:
            loaded = yaml.safe_load(args.config.read_text()) or {}
        # ValueError: bytes that are not UTF-8.
        except (OSError, ValueError, yaml.YAMLError) as error:
            parser.error(f"--config: {error}")
        if not isinstance(loaded, dict):
            parser.error(f"{args.config}: a mapping of settings, not {type(loaded).__name__}")
        known = {f.name for f in fields(VirtualNodeConfig)}
        unknown = set(loaded) - known
        if unknown:
            # A key YAML reads as a number or a boolean (`1:`, `yes:`) is unknown too.
            parser.error(f"{args.config}: unknown keys {', '.join(sorted(map(str, unknown)))}")
        values.update(loaded)
    values.update({k: v for k, v in vars(args).items() if k != "config" and v is not None})
    missing = [k for k in ("lower_kubeconfig", "cluster_id") if not values.get(k)]
    if missing:
        parser.error("missing " + ", ".join("--" + m.replace("_", "-") for m in missing))
    try:
        return VirtualNodeConfig(**values)
    except (TypeError, ValueError) as error:
        parser.error(str(error))


# How long a stopping virtual node lets open streams (`logs -f`, exec, port-forward) go
# on: aiohttp's own 60 s would outlast a pod's 30 s grace, and the process would be
# killed before it let go of its leader Lease, holding its standby back.
KUBELET_API_SHUTDOWN_SECONDS = 2.0
# How often a start held by pods made under another namespace mapping looks again.
MAPPING_RECHECK_SECONDS = 30.0


async def serve_kubelet_api(
    config: VirtualNodeConfig, provider: LowerKubelet, authorizer: Authorizer, pair: pki.KeyPair
) -> tuple[web.AppRunner, asyncio.Task[None]]:
    """The kubelet API's server, and the task that reloads its certificate files."""
    server = KubeletServer(provider, authorizer, config.streaming_connection_idle_timeout)
    runner = web.AppRunner(
        server.app(),
        access_log=None,
        shutdown_timeout=KUBELET_API_SHUTDOWN_SECONDS,
        **RUNNER_OPTIONS,
    )
    await runner.setup()
    reloading = await start_https_site(
        runner,
        config.address,
        config.kubelet_port,
        pair.cert_path,
        pair.key_path,
        Path(config.client_ca_file),
    )
    return runner, reloading


async def run(config: VirtualNodeConfig) -> None:
    health = Health()
    health_runner = (
        await health.serve(config.address, config.health_port) if config.health_port else None
    )
    try:
        await leader.run_leading(
            config.upper_kubeconfig or None,
            config.election(),
            health,
            lambda: mirror(config, health),
        )
    finally:
        if health_runner is not None:
            await health_runner.cleanup()


async def mirror(config: VirtualNodeConfig, health: Health) -> None:
    """Everything a virtual node does, from registering its Node on."""
    health.mark_not_ready("starting")
    upper = await KubeClient.connect(
        ClientSettings(
            config.upper_kubeconfig or None, qps=config.upper_qps, burst=config.upper_burst
        )
    )
    lower = await KubeClient.connect(
        ClientSettings(config.lower_kubeconfig, qps=config.lower_qps, burst=config.lower_burst)
    )
    # Re-emitted events get their own budget (the kubelet's --event-qps), so a burst of
    # them never slows pod creates and status updates.
    upper_events = await KubeClient.connect(
        ClientSettings(
            config.upper_kubeconfig or None, qps=config.event_qps, burst=config.event_burst
        )
    )
    # The kubelet's heartbeat client: the Lease, the Node's status and the lower
    # cluster's ping take no token of the pods' budget (behind a burst of pod writes, or
    # a flood of TokenReviews from whoever reaches the kubelet port, a renewal waited past
    # the 40 s Lease and the Node was taken for lost).
    upper_heartbeat = await KubeClient.connect(
        ClientSettings(config.upper_kubeconfig or None, qps=0, connections=4)
    )
    lower_heartbeat = await KubeClient.connect(
        ClientSettings(config.lower_kubeconfig, qps=0, connections=2)
    )
    # Who may call the kubelet API is asked on a budget of its own (the kubelet's 50 a
    # second): callers the pods' work does not wait for.
    upper_reviews = await KubeClient.connect(
        ClientSettings(config.upper_kubeconfig or None, qps=50, burst=100, connections=16)
    )
    upper_informers = InformerFactory(upper)
    lower_informers = InformerFactory(lower)
    # Events are listed once the rest is: copying them up needs no complete picture, and
    # with many pods their list would be a third of the work of a restart.
    lower_event_informers = InformerFactory(lower)
    runner: web.AppRunner | None = None
    reloading: asyncio.Task[None] | None = None
    estimator_server: EstimatorServer | None = None
    try:
        origin = (await upper.get(NAMESPACES, "kube-system"))["metadata"]["uid"]
        owner = Ownership(origin=origin, node_name=config.name, cluster_id=config.cluster_id)
        identity = NodeIdentity(
            config.name,
            config.cluster_id,
            config.address,
            config.kubelet_port,
            taint=config.taint,
            estimator_port=config.estimator_port,
            estimator_started=now_micro(),
        )
        queue: WorkQueue[str] = WorkQueue("pods")
        upper_pods = upper_informers.informer(PODS, field_selector=f"spec.nodeName={config.name}")
        mapping = NamespaceMapping(config.namespace_strategy, config.namespace_prefix)
        reflector = Reflector(
            upper_pods,
            {kind: upper_informers.informer(resource) for kind, resource in REFLECTED.items()},
            lower,
            {
                kind: lower_informers.informer(resource, label_selector=owner.selector())
                for kind, resource in REFLECTED.items()
            },
            mapping,
            owner,
            WorkQueue("reflected"),
        )
        upper_namespaces = upper_informers.informer(NAMESPACES)

        def stash_unguarded(pod: Mapping[str, Any]) -> str | None:
            metadata = pod.get("metadata") or {}
            namespace = str(metadata.get("namespace") or "")
            found = upper_namespaces.get(namespace)
            if found is None:
                return f"namespace {namespace} not seen yet"
            return unguarded_reason(
                namespace,
                found.get("metadata", {}).get("labels") or {},
                metadata.get("labels") or {},
            )

        estimator = FitEstimator(
            ClusterState(),
            mapping,
            owner,
            host_access_namespaces=frozenset(config.host_access_namespaces),
            stash_unguarded=stash_unguarded,
        )
        # Upper namespaces holding slices here, as the lower ledger says (kept below).
        held_here: set[str] = set()

        def outside_slices(namespace: str) -> str | None:
            found = upper_namespaces.get(namespace) or {}
            annotations = found.get("metadata", {}).get("annotations") or {}
            return bound_outside_slices(
                namespace,
                annotations.get(keys.SLICE_APPLIED_ANNOTATION),
                config.cluster_id,
                namespace in held_here,
            )

        backend = LowerCluster(
            lower,
            lower_informers.informer(PODS),
            lower_informers.informer(NODES),
            owner,
            mapping,
            config.address,
            reflector,
            estimator.held_node if config.estimator_port else None,
            estimator.largest_free_slot if config.estimator_port else None,
            frozenset(config.counted_taint_keys),
            estimator.host_access_namespaces,
            heartbeat=lower_heartbeat,
            outside_slices=outside_slices,
            stash_unguarded=stash_unguarded,
        )
        backend.watch_mirrored_pods(queue)
        events = EventReflector(
            upper_events,
            lower_event_informers.informer(EVENTS, field_selector="involvedObject.kind=Pod"),
            backend.pods,
            upper_pods,
            mapping,
            owner,
            config.cluster_id,
            event_queue(),
        )
        pods = PodController(upper, upper_pods, backend, config.name, queue)
        lower_namespaces = LowerNamespaces(
            upper,
            upper_namespaces,
            lower,
            lower_informers.informer(NAMESPACES, label_selector=owner.namespace_selector()),
            backend.pods,
            upper_informers.informer(PERSISTENTVOLUMECLAIMS),
            mapping,
            owner,
            backend.forget_namespace,
            WorkQueue("namespaces"),
        )
        volumes = ClaimVolumes(
            upper,
            upper_informers.informer(PERSISTENTVOLUMECLAIMS),
            upper_informers.informer(PERSISTENTVOLUMES, label_selector=owner.selector()),
            owner,
            WorkQueue("volumes"),
        )

        def lower_reachable_again() -> None:
            lower_informers.resume()
            lower_event_informers.resume()
            pods.resync()
            reflector.resync()

        nodes = NodeController(
            upper_heartbeat, identity, backend, on_reachable=lower_reachable_again
        )
        kubelet = LowerKubelet(config.name, upper_pods, backend.pods, lower, mapping)
        directory = Path(
            config.cert_dir or Path(tempfile.gettempdir()) / f"kubestrata-{config.name}"
        )
        files = (
            (Path(config.tls_cert_file), Path(config.tls_key_file))
            if config.tls_cert_file
            else None
        )
        # A standby taking over files a CSR (its certificate directory has none): the
        # Lease is kept meanwhile, however long the signer takes (the Node tainted
        # not-started once the start has taken too long).
        pair, renewal = await nodes.renewing_lease_while(
            serving_certificate(upper, config.name, [config.address], directory, files)
        )
        # One authorizer, so the kubelet API and the estimator share its caches.
        authorizer = Authorizer(upper_reviews, config.name, home=asyncio.get_running_loop())
        runner, reloading = await serve_kubelet_api(config, kubelet, authorizer, pair)
        ledger = lower_informers.informer(
            CONFIGMAPS,
            namespace=keys.SYSTEM_NAMESPACE,
            field_selector=f"metadata.name={keys.SLICE_LEDGER_CONFIGMAP}",
        )

        def ledger_changed(configmap: dict[str, Any]) -> None:
            held = held_namespaces(configmap.get("data") or {}, owner.origin)
            held_here.clear()
            held_here.update(held)
            reflector.sync_namespaces(held)

        ledger.add_handler(
            FunctionHandler(
                add=ledger_changed,
                update=ledger_changed,
                delete=lambda _configmap: ledger_changed({}),
            )
        )
        if config.estimator_port:
            estimator.watch(backend.nodes, backend.pods, upper_pods)
            estimator.watch_volumes(
                upper_informers.informer(PERSISTENTVOLUMECLAIMS),
                lower_informers.informer(STORAGECLASSES),
                lower_informers.informer(PERSISTENTVOLUMECLAIMS, label_selector=owner.selector()),
            )
            estimator.watch_runtime_classes(lower_informers.informer(RUNTIMECLASSES))
            lower_quotas = lower_informers.informer(RESOURCEQUOTAS)
            estimator.watch_quotas(lower_quotas)
            backend.watch_quotas(lower_quotas)
            ledger.add_handler(
                FunctionHandler(
                    add=estimator.ledger_changed,
                    update=estimator.ledger_changed,
                    delete=lambda _configmap: estimator.ledger_changed({}),
                )
            )

        upper_informers.start()
        lower_informers.start()
        # Nothing is created, deleted or reported before both sides are known: that is
        # what makes a restart free of duplicates and spurious deletes. The Node's Lease
        # is kept meanwhile.
        await nodes.renewing_lease_while(
            asyncio.gather(upper_informers.wait_synced(), lower_informers.wait_synced())
        )
        log.info(
            "virtual node %s for lower cluster %s: caches synced (%d upper pods, %d lower pods)",
            config.name,
            config.cluster_id,
            len(upper_pods),
            len(backend.pods),
        )
        await nodes.renewing_lease_while(
            until_made_under_this_mapping(
                backend,
                config,
                lambda key: (
                    (pod := upper_pods.get(key)) is not None
                    and (pod.get("status") or {}).get("phase") not in FINISHED
                ),
            )
        )
        health.mark_ready()
        if config.estimator_port:
            estimator.settle()
            # Served once the caches are whole: an empty cluster would refuse every pod.
            estimator_server = await serve_estimator(
                EstimatorService(
                    estimator,
                    authorizer,
                    config.cluster_id,
                    SlicePromises(
                        lower,
                        backend.nodes,
                        backend.pods,
                        mapping,
                        owner,
                        backend.ensure_namespace,
                        frozenset(config.counted_taint_keys),
                        counted=estimator.slice_use,
                    ),
                    home=asyncio.get_running_loop(),
                ),
                config.address,
                config.estimator_port,
                pair,
            )
        lower_event_informers.start()
        await run_together(
            nodes.run(),
            pods.run(config.workers),
            reflector.run(config.workers),
            volumes.run(1),
            lower_namespaces.run(1),
            events.run(max(1, config.workers // 4)),
            _sweep_orphans(backend, upper_pods.keys, queue, reflector),
            *(
                [
                    keep_renewed(
                        upper,
                        config.name,
                        [config.address],
                        pair,
                        provisional=renewal is Renewal.PROVISIONAL,
                    )
                ]
                if renewal is not Renewal.GIVEN
                else []
            ),
        )
    finally:
        if estimator_server is not None:
            await estimator_server.stop(grace=1)
        if reloading is not None:
            reloading.cancel()
        if runner is not None:
            await runner.cleanup()
        await upper_informers.stop()
        await lower_informers.stop()
        await lower_event_informers.stop()
        for client in (upper, upper_events, upper_heartbeat, upper_reviews, lower, lower_heartbeat):
            await client.close()


async def until_made_under_this_mapping(
    backend: LowerCluster, config: VirtualNodeConfig, running: Callable[[str], bool]
) -> None:
    """Holds the start while pods of ours below were made under another namespace
    mapping (``--namespace-strategy`` or ``--namespace-prefix`` changed since) for upper
    pods still ``running``: mirrored under this one, each would be taken for lost and made
    again beside the one still running. Nothing is mirrored meanwhile; the Lease is
    renewed, so no pod is evicted, and past the start's limit the Node is tainted
    not-started. Those whose upper pod is gone are the orphan sweep's, found where they
    are."""
    while stale := backend.made_under_another_mapping(running):
        lower_key, upper_key = stale[0]
        log.error(
            "%d pods below were made by this virtual node under another namespace mapping "
            "(e.g. %s, for upper pod %s); under --namespace-strategy %s%s each would run "
            "twice, so nothing is mirrored: start with the mapping they were made under, "
            "or delete them below (their upper pods then fail as lost)",
            len(stale),
            lower_key,
            upper_key,
            config.namespace_strategy,
            f" --namespace-prefix {config.namespace_prefix}" if config.namespace_prefix else "",
        )
        await asyncio.sleep(MAPPING_RECHECK_SECONDS)


async def _sweep_orphans(
    backend: LowerCluster,
    upper_keys: Callable[[], list[str]],
    queue: WorkQueue[str],
    reflector: Reflector,
) -> None:
    """Lower pods and copies nobody above wants any more: at start, then periodically,
    for whatever the event handlers could not see (deleted while we were down); and the
    copies a namesake below held back, whose name may be free now."""
    while True:
        for key in backend.orphan_keys(set(upper_keys())):
            queue.add(key)
        for copy_key in (*reflector.orphan_keys(), *reflector.taken_keys()):
            reflector.queue.add(copy_key)
        await asyncio.sleep(ORPHAN_SWEEP_SECONDS)


def check_files(config: VirtualNodeConfig) -> None:
    """The kubeconfigs given are files, and without an upper one the process runs in a
    cluster; the client CA and the serving certificate given are files too, the CA one
    that loads: said in one line, before anything starts, rather than a traceback later
    (or, for a file missing while mirroring starts, a failure tried again forever)."""
    parser = argparse.ArgumentParser(prog="kubestrata virtual-node")
    check_kubeconfig(parser, config.lower_kubeconfig, "--lower-kubeconfig")
    check_kubeconfig(parser, config.upper_kubeconfig or None, "--upper-kubeconfig")
    check_client_ca(parser, Path(config.client_ca_file), "--client-ca-file")
    check_serving_pair(parser, config.tls_cert_file, config.tls_key_file)
    if config.cert_dir and not config.tls_cert_file:
        try:
            Path(config.cert_dir).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--cert-dir {config.cert_dir}: {error}")
        if not os.access(config.cert_dir, os.W_OK):
            parser.error(f"--cert-dir {config.cert_dir}: not writable")


def main(argv: Sequence[str]) -> int:
    config = parse_args(argv)
    check_files(config)
    logs.configure(config.log_level, config.log_format)
    shrink_tls_read_buffers()
    return run_component(run(config), log)
