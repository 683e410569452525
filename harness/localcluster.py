"""Real Kubernetes control planes on loopback, for tests and ``kubestrata up``.

A cluster is etcd, kube-apiserver, kube-controller-manager and kube-scheduler,
built from the published Go modules; a lower cluster also runs kwok, which makes
the simulated Nodes we create Ready and their pods Running, and serves a kubelet
API whose logs and exec reach real local processes.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import itertools
import json
import re
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from harness.process import ManagedProcess, ProcessError, ProcessRecord
from harness.state import ClusterError as ClusterError
from harness.toolchain import Toolchain
from kubekit import fit, keys, pki

Role = Literal["upper", "lower"]

LOOPBACK = "127.0.0.1"
# Room for the thousand Services of a realistic namespace (bench/virtual_node_pods.py).
SERVICE_CIDR = "10.0.0.0/16"
# Pod addresses of the local lower clusters: each takes its own /16 of this range, so an
# address (in a reflected EndpointSlice, say) names one pod of the whole federation.
POD_CIDR = "10.240.0.0/12"
_POD_CIDR_PREFIX = 16
POD_CIDRS = 2 ** (_POD_CIDR_PREFIX - ipaddress.ip_network(POD_CIDR).prefixlen)
READY_TIMEOUT_SECONDS = 120.0


RESOURCE_METRICS_PATH_ANNOTATION = "metrics.k8s.io/resource-metrics-path"
# The usage kwok simulates for a pod's containers, each, unless the pod says otherwise.
USAGE_CPU_ANNOTATION = "kwok.x-k8s.io/usage-cpu"
USAGE_MEMORY_ANNOTATION = "kwok.x-k8s.io/usage-memory"
DEFAULT_USAGE = {"cpu": "1m", "memory": "1Mi"}


# kwok runs the Nodes that say so here.
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"


def kwok_resource_metrics_path(node: str) -> str:
    return f"/metrics/nodes/{node}/metrics/resource"


@dataclass(frozen=True)
class NodeSpec:
    """A Node simulated by kwok: of a lower cluster, or an ordinary Node of the upper one."""

    name: str
    cpu: str = "16"
    memory: str = "64Gi"
    pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict)
    extended_resources: Mapping[str, str] = field(default_factory=dict)
    unschedulable: bool = False
    taints: tuple[Mapping[str, str], ...] = ()

    def manifest(self) -> dict[str, Any]:
        resources = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.pods)}
        resources.update(self.extended_resources)
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            **self.labels,
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": {
                    KWOK_NODE_ANNOTATION: "fake",
                    # Where kwok serves this node's resource metrics; metrics-server reads it.
                    RESOURCE_METRICS_PATH_ANNOTATION: kwok_resource_metrics_path(self.name),
                },
            },
            "spec": {"unschedulable": self.unschedulable, "taints": [dict(t) for t in self.taints]},
            "status": {"capacity": resources, "allocatable": resources},
        }


def pod_cidr(index: int) -> str:
    """The pod CIDR of the ``index``-th (from 0) local cluster."""
    if not 0 <= index < POD_CIDRS:
        raise ValueError(f"{POD_CIDR} has room for the pods of {POD_CIDRS} clusters")
    subnets = ipaddress.ip_network(POD_CIDR).subnets(new_prefix=_POD_CIDR_PREFIX)
    return str(next(itertools.islice(subnets, index, None)))


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    role: Role
    nodes: tuple[NodeSpec, ...] = ()
    # "k3s": a K3s container through testcontainers (harness.k3s), lower clusters only.
    runtime: Literal["local", "k3s"] = "local"
    # A metrics-server serving metrics.k8s.io, scraping the cluster's nodes (kwok's
    # simulated usage below, the virtual nodes' kubelet API above).
    metrics_server: bool = False
    # Where kwok takes this cluster's pod IPs from.
    pod_cidr: str = POD_CIDR
    # How long the certificates its controller-manager signs for CSRs live ("": its
    # default, a year); short, it shows renewals within a test.
    signing_duration: str = ""


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A loopback port free now and never handed out before by this process: a port
    is only bound by the component that gets it later, so without the memory two
    components could be given the same one."""
    with _handed_out_lock:
        while True:
            with socket.socket() as sock:
                sock.bind((LOOPBACK, 0))
                port: int = sock.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def require_free_port(port: int, purpose: str) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError as error:
            raise ClusterError(
                f"port {LOOPBACK}:{port} for {purpose} is in use: {error}"
            ) from error


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int
    # Where kwok forwards every pod port of `kubectl port-forward`; whoever wants a pod
    # to serve something listens here.
    pod_ports: int
    metrics_server: int

    @classmethod
    def allocate(cls) -> Ports:
        return cls(*(free_port() for _ in range(8)))


class KubectlClient:
    """`kubectl()` for anything with a toolchain, a kubeconfig and a name: local
    clusters and K3s containers alike."""

    toolchain: Toolchain
    kubeconfig: Path

    @property
    def name(self) -> str:
        raise NotImplementedError

    def kubectl_argv(self, *args: str) -> list[str]:
        return [str(self.toolchain.kubectl), f"--kubeconfig={self.kubeconfig}", *args]

    def kubectl_process(self, *args: str, **popen: Any) -> subprocess.Popen[Any]:
        """The stock kubectl against this cluster, running on while the caller acts."""
        return subprocess.Popen(self.kubectl_argv(*args), **popen)

    def service_account_token(self, account: str, audience: str | None = None) -> str:
        """A year-long token of our ServiceAccount ``account``, from the TokenRequest API
        as a pod would get one, for ``audience`` (default: the apiserver)."""
        return self.kubectl(
            "create",
            "token",
            account,
            f"--namespace={keys.SYSTEM_NAMESPACE}",
            "--duration=8760h",
            *([f"--audience={audience}"] if audience else []),
        ).stdout.strip()

    def write_token_kubeconfig(self, path: Path, user: str, token: str) -> Path:
        """This cluster's kubeconfig with ``token`` as its only credential."""
        config = json.loads(
            self.kubectl("config", "view", "--raw", "--minify", "--flatten", "-o", "json").stdout
        )
        for context in config["contexts"]:
            context["context"]["user"] = user
        config["users"] = [{"name": user, "user": {"token": token}}]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Runs the stock kubectl against this cluster."""
        result = subprocess.run(
            self.kubectl_argv(*args),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} on {self.name} failed ({result.returncode}): "
                f"{result.stderr.strip()}"
            )
        return result


class LocalCluster(KubectlClient):
    """One control plane on loopback; all files live under ``directory``."""

    def __init__(
        self,
        spec: ClusterSpec,
        directory: Path,
        toolchain: Toolchain,
        *,
        die_with_parent: bool = True,
        ports: Ports | None = None,
        on_process_started: Callable[[], None] | None = None,
    ) -> None:
        self.spec = spec
        self.directory = directory
        self.toolchain = toolchain
        self.die_with_parent = die_with_parent
        self.ports = ports or Ports.allocate()
        self.processes: dict[str, ManagedProcess] = {}
        # Set by stop(): a start still on its way (or begun after) launches nothing more
        # and stops waiting. A stopped cluster is not started again.
        self._stopped = threading.Event()
        self._on_process_started = on_process_started
        self.kubeconfig = directory / "kubeconfig"
        self.pod_log_file = directory / "kwok" / "container.log"
        self.exec_dir = directory / "kwok" / "exec"
        self.scheduler_extenders: tuple[Mapping[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def server(self) -> str:
        return f"https://{LOOPBACK}:{self.ports.apiserver}"

    # -- start -----------------------------------------------------------------------------

    def start(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Starts every component and returns once the cluster serves requests and, for a
        lower cluster, its simulated Nodes are Ready."""
        try:
            self._write_certificates()
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            self._start_controllers(timeout)
            if self.spec.role == "lower":
                self._start_kwok(timeout)
                self.add_nodes(self.spec.nodes, timeout)
            self._wait_default_service_account(timeout)
            if self.spec.metrics_server:
                self._start_metrics_server(timeout)
        except BaseException:
            self.stop()
            raise

    def _write_certificates(self) -> None:
        pki_dir = self.directory / "pki"
        pki_dir.mkdir(parents=True, exist_ok=True)
        self.ca = pki.create_ca(pki_dir, "cluster")
        self.apiserver_cert = pki.issue(
            self.ca,
            pki_dir / "apiserver",
            "kube-apiserver",
            server_names=(
                LOOPBACK,
                "localhost",
                "10.0.0.1",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
        )
        self.admin_cert = pki.issue(
            self.ca,
            pki_dir / "admin",
            "kubestrata-admin",
            organizations=("system:masters",),
            client=True,
        )
        self.kubelet_client_cert = pki.issue(
            self.ca,
            pki_dir / "apiserver-kubelet-client",
            "kube-apiserver-kubelet-client",
            organizations=("system:masters",),
            client=True,
        )
        # The aggregation layer: how the apiserver proves itself to an extension apiserver
        # (metrics-server) it proxies to.
        self.front_proxy_ca = pki.create_ca(pki_dir, "front-proxy")
        self.front_proxy_client_cert = pki.issue(
            self.front_proxy_ca, pki_dir / "front-proxy-client", "front-proxy-client", client=True
        )
        self.service_account_key = pki.create_service_account_key(pki_dir / "service-account.key")
        pki.write_kubeconfig(
            self.kubeconfig,
            cluster=self.name,
            server=self.server,
            ca=self.ca.cert_path,
            user=self.admin_cert,
        )

    def _launch(
        self, name: str, argv: Sequence[str], purpose_ports: Iterable[int]
    ) -> ManagedProcess:
        self._check_not_stopped()
        for port in purpose_ports:
            require_free_port(port, f"{self.name}/{name}")
        process = ManagedProcess(
            name,
            argv,
            self.directory / "logs" / f"{name}.log",
            die_with_parent=self.die_with_parent,
        )
        process.start()
        self.processes[name] = process
        if self._on_process_started is not None:
            self._on_process_started()
        return process

    def _kube(self, component: str) -> list[str]:
        return [str(self.toolchain.kube), component]

    def _start_etcd(self, timeout: float) -> None:
        client_url = f"http://{LOOPBACK}:{self.ports.etcd_client}"
        peer_url = f"http://{LOOPBACK}:{self.ports.etcd_peer}"
        process = self._launch(
            "etcd",
            [
                *self._kube("etcd"),
                f"--name={self.name}",
                f"--data-dir={self.directory / 'etcd'}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster={self.name}={peer_url}",
                "--unsafe-no-fsync=true",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
            (self.ports.etcd_client, self.ports.etcd_peer),
        )
        self._wait(process, timeout, lambda: _http_ok(LOOPBACK, self.ports.etcd_client, "/health"))

    def _apiserver_argv(self) -> list[str]:
        pki_dir = self.directory / "pki"
        return [
            *self._kube("kube-apiserver"),
            f"--etcd-servers=http://{LOOPBACK}:{self.ports.etcd_client}",
            f"--bind-address={LOOPBACK}",
            f"--advertise-address={LOOPBACK}",
            f"--secure-port={self.ports.apiserver}",
            f"--tls-cert-file={self.apiserver_cert.cert_path}",
            f"--tls-private-key-file={self.apiserver_cert.key_path}",
            f"--client-ca-file={self.ca.cert_path}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.service_account_key}",
            f"--service-account-signing-key-file={self.service_account_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--allow-privileged=true",
            "--endpoint-reconciler-type=none",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--kubelet-client-certificate={self.kubelet_client_cert.cert_path}",
            f"--kubelet-client-key={self.kubelet_client_cert.key_path}",
            f"--cert-dir={pki_dir}",
            f"--requestheader-client-ca-file={self.front_proxy_ca.cert_path}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={self.front_proxy_client_cert.cert_path}",
            f"--proxy-client-key-file={self.front_proxy_client_cert.key_path}",
            "--profiling=false",
        ]

    def _start_apiserver(self, timeout: float) -> None:
        process = self._launch("kube-apiserver", self._apiserver_argv(), (self.ports.apiserver,))
        self._wait(process, timeout, self.apiserver_ready)

    def apiserver_ready(self) -> bool:
        return _https_ok(LOOPBACK, self.ports.apiserver, "/readyz", self._client_tls())

    def _client_tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca.cert_path))
        context.load_cert_chain(str(self.admin_cert.cert_path), str(self.admin_cert.key_path))
        return context

    def _start_controllers(self, timeout: float) -> None:
        pki_dir = self.directory / "pki"
        common = [
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            f"--bind-address={LOOPBACK}",
            "--leader-elect=false",
        ]
        manager = self._launch(
            "kube-controller-manager",
            [
                *self._kube("kube-controller-manager"),
                *common,
                f"--secure-port={self.ports.controller_manager}",
                f"--cert-dir={pki_dir / 'controller-manager'}",
                f"--service-account-private-key-file={self.service_account_key}",
                f"--root-ca-file={self.ca.cert_path}",
                f"--cluster-signing-cert-file={self.ca.cert_path}",
                f"--cluster-signing-key-file={self.ca.key_path}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                *(
                    [f"--cluster-signing-duration={self.spec.signing_duration}"]
                    if self.spec.signing_duration
                    else []
                ),
            ],
            (self.ports.controller_manager,),
        )
        scheduler = self._launch_scheduler()
        self._wait(manager, timeout, self._controller_manager_ready)
        self._wait_scheduler(scheduler, timeout)

    def _controller_manager_ready(self) -> bool:
        return _https_ok(LOOPBACK, self.ports.controller_manager, "/healthz", _UNVERIFIED)

    def scheduler_configuration(self) -> dict[str, Any]:
        """The kube-scheduler's KubeSchedulerConfiguration: stock, plus the extenders a
        federation names (the multischeduler)."""
        configuration: dict[str, Any] = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            # The default 50 bindings a second would be what every benchmark measures.
            "clientConnection": {
                "kubeconfig": str(self.kubeconfig),
                "qps": 500,
                "burst": 1000,
            },
            "leaderElection": {"leaderElect": False},
        }
        if self.scheduler_extenders:
            configuration["extenders"] = list(self.scheduler_extenders)
        return configuration

    def _launch_scheduler(self) -> ManagedProcess:
        pki_dir = self.directory / "pki"
        config_path = self.directory / "scheduler" / "config.yaml"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(yaml.safe_dump(self.scheduler_configuration()))
        return self._launch(
            "kube-scheduler",
            [
                *self._kube("kube-scheduler"),
                f"--config={config_path}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={self.ports.scheduler}",
                f"--cert-dir={pki_dir / 'scheduler'}",
            ],
            (self.ports.scheduler,),
        )

    def _wait_scheduler(self, scheduler: ManagedProcess, timeout: float) -> None:
        self._wait(
            scheduler,
            timeout,
            lambda: _https_ok(LOOPBACK, self.ports.scheduler, "/healthz", _UNVERIFIED),
        )

    def set_scheduler_extenders(
        self, extenders: Sequence[Mapping[str, Any]], timeout: float = READY_TIMEOUT_SECONDS
    ) -> None:
        """Starts the kube-scheduler again with these extenders in its configuration."""
        self.scheduler_extenders = tuple(extenders)
        self.processes.pop("kube-scheduler").stop()
        self._wait_scheduler(self._launch_scheduler(), timeout)

    def _start_kwok(self, timeout: float) -> None:
        self.exec_dir.mkdir(parents=True, exist_ok=True)
        if not self.pod_log_file.exists():
            self.append_pod_log(f"kwok container log of cluster {self.name}")
        config_path = self.directory / "kwok" / "kwok.yaml"
        config_path.write_text(self.kwok_config())
        process = self._launch(
            "kwok",
            [
                str(self.toolchain.kwok),
                f"--kubeconfig={self.kubeconfig}",
                f"--config={config_path}",
                # Above, the virtual nodes are not kwok's: only the Nodes made here are.
                *(
                    ["--manage-all-nodes=true"]
                    if self.spec.role == "lower"
                    else [f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake"]
                ),
                # Without it kwok renews no Lease, and the controller-manager finds the
                # simulated nodes silent after its grace period and marks their pods NotReady.
                "--node-lease-duration-seconds=40",
                f"--cidr={self.spec.pod_cidr}",
                f"--node-ip={LOOPBACK}",
                f"--node-port={self.ports.kwok}",
                f"--server-address={LOOPBACK}:{self.ports.kwok}",
            ],
            (self.ports.kwok,),
        )
        self._wait(process, timeout, self._kwok_ready)

    def _start_metrics_server(self, timeout: float) -> None:
        metrics_server = self.toolchain.metrics_server
        if metrics_server is None:
            raise ClusterError(
                "metrics-server is not built: run `hack/k8s/build.sh metrics-server`"
            )
        port = self.ports.metrics_server
        process = self._launch(
            "metrics-server",
            [
                str(metrics_server),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={port}",
                f"--cert-dir={self.directory / 'pki' / 'metrics-server'}",
                # Nodes here serve self-signed certificates (kwok's, a virtual node's own).
                "--kubelet-insecure-tls",
                "--kubelet-preferred-address-types=InternalIP",
                "--kubelet-use-node-status-port",
                f"--metric-resolution={METRIC_RESOLUTION_SECONDS}s",
                # Below the resolution, as metrics-server requires.
                f"--kubelet-request-timeout={METRIC_RESOLUTION_SECONDS // 2}s",
            ],
            (port,),
        )
        # Not /readyz: that waits for a first scrape, and the upper cluster may have no
        # node yet.
        self._wait(process, timeout, lambda: _https_ok(LOOPBACK, port, "/livez", _UNVERIFIED))
        self.register_metrics_api(timeout)

    def register_metrics_api(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Serves metrics.k8s.io from this cluster's metrics-server, once it is Available.
        The aggregator reaches it through an ExternalName Service: Endpoints may not name
        a loopback address."""
        port = self.ports.metrics_server
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "List",
                    "items": [
                        {
                            "apiVersion": "v1",
                            "kind": "Service",
                            "metadata": {"name": "metrics-server", "namespace": "kube-system"},
                            "spec": {
                                "type": "ExternalName",
                                "externalName": "localhost",
                                "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
                            },
                        },
                        {
                            "apiVersion": "apiregistration.k8s.io/v1",
                            "kind": "APIService",
                            "metadata": {"name": "v1beta1.metrics.k8s.io"},
                            "spec": {
                                "group": "metrics.k8s.io",
                                "version": "v1beta1",
                                "service": {
                                    "name": "metrics-server",
                                    "namespace": "kube-system",
                                    "port": port,
                                },
                                "insecureSkipTLSVerify": True,
                                "groupPriorityMinimum": 100,
                                "versionPriority": 100,
                            },
                        },
                    ],
                }
            ),
        )
        self.kubectl(
            "wait",
            "--for=condition=Available",
            "apiservice/v1beta1.metrics.k8s.io",
            f"--timeout={int(timeout)}s",
            timeout=timeout + 10,
        )

    def _kwok_ready(self) -> bool:
        return _http_ok(LOOPBACK, self.ports.kwok, "/healthz")

    def kwok_config(self) -> str:
        """kwok's configuration: the Stages that make Nodes Ready and pods Running, and
        logs/exec/attach/port-forward of every container served by local files, processes
        and one loopback port."""
        documents: list[dict[str, Any]] = [
            {
                "apiVersion": "kwok.x-k8s.io/v1alpha1",
                "kind": "ClusterLogs",
                "metadata": {"name": "local-file"},
                "spec": {"logs": [{"logsFile": str(self.pod_log_file), "follow": True}]},
            },
            {
                "apiVersion": "kwok.x-k8s.io/v1alpha1",
                "kind": "ClusterAttach",
                "metadata": {"name": "local-file"},
                "spec": {"attaches": [{"logsFile": str(self.pod_log_file)}]},
            },
            {
                "apiVersion": "kwok.x-k8s.io/v1alpha1",
                "kind": "ClusterPortForward",
                "metadata": {"name": "local-port"},
                "spec": {
                    "forwards": [{"target": {"address": LOOPBACK, "port": self.ports.pod_ports}}]
                },
            },
            {
                "apiVersion": "kwok.x-k8s.io/v1alpha1",
                "kind": "ClusterExec",
                "metadata": {"name": "local-process"},
                "spec": {"execs": [{"local": {"workDir": str(self.exec_dir)}}]},
            },
        ]
        documents += [
            _KWOK_EPHEMERAL_CONTAINERS_RUNNING,
            _KWOK_PODS_READY_AGAIN,
            _KWOK_CONTAINER_RESOURCES,
        ]
        if self.spec.metrics_server:
            documents += _kwok_resource_metrics()
        parts = [yaml.safe_dump(d) for d in documents]
        for path in sorted(self.toolchain.kwok_stages.glob("*.yaml")):
            stage = path.read_text()
            parts.append(_both_node_addresses(stage) if path.stem == "node-initialize" else stage)
        return "---\n".join(part if part.endswith("\n") else part + "\n" for part in parts)

    def add_nodes(self, nodes: Iterable[NodeSpec], timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Nodes simulated by kwok; an upper cluster starts its kwok with its first (an
        ordinary Node beside the virtual ones). Returns once they take pods."""
        manifests = [node.manifest() for node in nodes]
        if not manifests:
            return
        if "kwok" not in self.processes:
            self._start_kwok(timeout)
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests}),
        )
        # kwok may report Ready before the address (until it has one, the apiserver cannot
        # reach the node's kubelet API and says "no preferred addresses"), and the
        # controller-manager takes a new Node's not-ready taint off a moment after it is
        # Ready (a pod made before then goes elsewhere).
        added = {m["metadata"]["name"] for m in manifests}
        self._wait(self.processes["kwok"], timeout, lambda: self._nodes_take_pods(added))

    def _wait_default_service_account(self, timeout: float) -> None:
        # Pods are refused until the controller-manager has made the default account.
        self.kubectl(
            "wait",
            "--for=create",
            "serviceaccount/default",
            "-n",
            "default",
            f"--timeout={int(timeout)}s",
            timeout=timeout + 10,
        )

    def _wait(self, process: ManagedProcess, timeout: float, ready: Any) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_not_stopped()
            process.check_running()
            if ready():
                return
            time.sleep(0.25)
        raise ClusterError(
            f"{self.name}/{process.name} not ready after {timeout:.0f} s; "
            f"last lines of {process.log_path}:\n{process.log_tail()}"
        )

    # -- use ---------------------------------------------------------------------------------

    def append_pod_log(self, *lines: str, stream: Literal["stdout", "stderr"] = "stdout") -> None:
        """Appends lines to the log every simulated container of this cluster serves,
        in the CRI log format kwok reads (``<RFC3339Nano> <stream> F <text>``)."""
        self.pod_log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.pod_log_file.open("a") as log:
            for line in lines:
                stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                log.write(f"{stamp} {stream} F {line}\n")

    def records(self) -> list[ProcessRecord]:
        # Another cluster's start thread writes the state file while this one adds processes.
        return [p.record() for p in list(self.processes.values()) if p.running()]

    def restart(self, component: str, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Stops one component and starts it again on the same ports. An apiserver's return
        restarts what watches it too. Their watches back off while it is down, up to a
        minute with jitter, so a pod made just after its return waited that long for the
        lower scheduler (one CI run); and after an outage of a minute or more kwok v0.8.0
        keeps renewing node leases but never again moves a new pod to Running (its pod
        watch does not resume), where a real kubelet would carry on. kwok's return ends
        once every Node can take pods again, as a kubelet's return would."""
        process = self.processes[component]
        process.stop()
        if component == "kwok":
            self._release_node_leases(timeout)
        process.start()
        if self._on_process_started is not None:
            self._on_process_started()
        if component == "kube-apiserver":
            self._wait(process, timeout, self.apiserver_ready)
            for watcher in ("kube-controller-manager", "kube-scheduler", "kwok"):
                if watcher in self.processes:
                    self.restart(watcher, timeout)
        elif component == "kube-controller-manager":
            self._wait(process, timeout, self._controller_manager_ready)
        elif component == "kube-scheduler":
            self._wait_scheduler(process, timeout)
        elif component == "kwok":
            self._wait(process, timeout, self._kwok_ready)
            self._wait(process, timeout, self._nodes_take_pods)

    def _release_node_leases(self, timeout: float) -> None:
        # A new kwok holds under a new identity: it would wait out the leases of the one it
        # replaces (40 s), its Nodes NotReady and tainted meanwhile, and pods made then would
        # wait for the lower scheduler's next retry (a minute more in one CI run). Only its
        # own: above, the virtual nodes' leases are theirs.
        deadline = time.monotonic() + timeout
        while True:
            nodes = self._kwok_nodes()
            if nodes == []:
                return
            if nodes is None:
                why = "its Nodes could not be listed"
            else:
                names = [node["metadata"]["name"] for node in nodes]
                leases = ("leases", "-n", "kube-node-lease", *names)
                result = self.kubectl(
                    "delete", *leases, "--ignore-not-found", "--wait=false", check=False
                )
                if result.returncode == 0:
                    return
                why = result.stderr
            if time.monotonic() > deadline:
                raise ClusterError(f"node leases of {self.name} not released: {why}")
            time.sleep(0.5)

    def _kwok_nodes(self) -> list[dict[str, Any]] | None:
        """The Nodes kwok runs here (None: they could not be listed)."""
        result = self.kubectl("get", "nodes", "-o", "json", check=False)
        if result.returncode != 0:
            return None
        return [
            node
            for node in json.loads(result.stdout)["items"]
            if (node["metadata"].get("annotations") or {}).get(KWOK_NODE_ANNOTATION) == "fake"
        ]

    def _nodes_take_pods(self, names: Collection[str] | None = None) -> bool:
        """Every Node kwok runs here (of ``names``, when given) takes pods."""
        nodes = self._kwok_nodes()
        if nodes is None:
            return False
        if names is not None:
            nodes = [node for node in nodes if node["metadata"]["name"] in names]
            if len(nodes) != len(names):
                return False
        return all(_node_takes_pods(node) for node in nodes)

    def stop_component(self, component: str) -> None:
        self.processes[component].stop()

    def stop(self) -> None:
        self._stopped.set()
        # Reverse start order: dependants first, etcd last.
        for process in reversed(list(self.processes.values())):
            process.stop()

    def _check_not_stopped(self) -> None:
        if self._stopped.is_set():
            raise ClusterError(f"{self.name}: stopped while starting")


_LIFECYCLE_TAINT_KEYS = frozenset({fit.NOT_READY_TAINT_KEY, "node.kubernetes.io/unreachable"})


def _node_takes_pods(node: dict[str, Any]) -> bool:
    """Ready, no longer tainted for having been silent, and reachable at its address."""
    taints = {taint["key"] for taint in node["spec"].get("taints") or []}
    addresses = {a["address"] for a in node["status"].get("addresses") or []}
    return fit.node_is_ready(node) and not taints & _LIFECYCLE_TAINT_KEYS and LOOPBACK in addresses


# kwok v0.8.0's node-initialize Stage writes only the addresses a Node lacks, and none when
# it has both. Played again on a Node that went NotReady (its lower apiserver down for
# longer than the node lease), it left the Node with no addresses at all, and every
# `kubectl logs` or `exec` through that node failed with "no preferred addresses found"
# until the next outage put them back (one CI run in three). Both are written every time.
_CONDITIONAL_NODE_ADDRESSES = re.compile(
    r"( *)\{\{ \$hasInternalIP := false \}\}\n"
    r".*?type: Hostname\n *\{\{ end \}\}\n *\{\{ end \}\}\n",
    re.DOTALL,
)


def _both_node_addresses(stage: str) -> str:
    """kwok's node-initialize Stage with both addresses written unconditionally."""
    fixed, found = _CONDITIONAL_NODE_ADDRESSES.subn(
        lambda match: "".join(
            f"{match.group(1)}{line}\n"
            for line in (
                "addresses:",
                "- address: {{ NodeIP | Quote }}",
                "  type: InternalIP",
                "- address: {{ NodeName | Quote }}",
                "  type: Hostname",
            )
        ),
        stage,
    )
    if found != 1:
        raise ClusterError("kwok's node-initialize Stage does not write addresses as expected")
    return fixed


def _running_pod_stage(
    name: str, condition: Mapping[str, Any], status_template: str
) -> dict[str, Any]:
    """A kwok Stage for Running pods not being deleted that meet ``condition`` (one more
    selector expression), whose status it updates with ``status_template``."""
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {
                "matchExpressions": [
                    {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                    {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                    dict(condition),
                ]
            },
            "next": {"statusTemplate": status_template},
        },
    }


# kwok's stages run no ephemeral container (`kubectl debug`); this one reports each
# running, as a kubelet would once it started it.
_KWOK_EPHEMERAL_CONTAINERS_RUNNING = _running_pod_stage(
    "pod-ephemeral-containers-running",
    {
        "key": "(.spec.ephemeralContainers // [] | length)"
        " > (.status.ephemeralContainerStatuses // [] | length)",
        "operator": "In",
        "values": ["true"],
    },
    "{{ $now := Now }}\n"
    "ephemeralContainerStatuses:\n"
    "{{ range .spec.ephemeralContainers }}\n"
    "- image: {{ .image | Quote }}\n"
    "  name: {{ .name | Quote }}\n"
    "  ready: false\n"
    "  restartCount: 0\n"
    "  state:\n"
    "    running:\n"
    "      startedAt: {{ $now | Quote }}\n"
    "{{ end }}\n",
)

# A kubelet of Kubernetes 1.35 reports the resources each running container has (the
# apiserver refuses to resize a pod whose container statuses have none) and applies an
# in-place resize; kwok's stages do neither. This one reports a container's requests and
# limits as its spec has them, once they differ from what its status says. The list of
# statuses is replaced whole (it has no merge key), so each is written back as it was.
_KWOK_CONTAINER_RESOURCES = _running_pod_stage(
    "pod-container-resources",
    {
        "key": "[.spec.containers[] | .resources // {}]"
        " != [.status.containerStatuses // [] | .[] | .resources // {}]",
        "operator": "In",
        "values": ["true"],
    },
    "containerStatuses:\n"
    "{{ range $status := .status.containerStatuses }}\n"
    '{{ $entry := omit $status "resources" "allocatedResources" }}\n'
    "{{ range $.spec.containers }}{{ if eq .name $status.name }}{{ with .resources }}\n"
    '{{ $_ := set $entry "resources" . }}\n'
    '{{ with .requests }}{{ $_ := set $entry "allocatedResources" . }}{{ end }}\n'
    "{{ end }}{{ end }}{{ end }}\n"
    "- {{ toJson $entry }}\n"
    "{{ end }}\n",
)

# kwok makes a pod Ready once, when it starts it; a kubelet reports it again with its
# next status. When kwok was down (its apiserver restarted) the controller-manager marks
# the pods of its silent nodes not ready, and without this stage they would stay so.
_KWOK_PODS_READY_AGAIN = _running_pod_stage(
    "pod-ready-again",
    {
        "key": '.status.conditions.[] | select( .type == "Ready" ) | .status',
        "operator": "NotIn",
        "values": ["True"],
    },
    "{{ $now := Now }}\n"
    "conditions:\n"
    "{{ range .status.conditions }}\n"
    "- type: {{ .type | Quote }}\n"
    '{{ if or (eq .type "Ready") (eq .type "ContainersReady") }}\n'
    '  status: "True"\n'
    "  lastTransitionTime: {{ $now | Quote }}\n"
    "{{ else }}\n"
    "  status: {{ .status | Quote }}\n"
    "  lastTransitionTime: {{ .lastTransitionTime | Quote }}\n"
    "{{ end }}\n"
    "{{ end }}\n",
)


def _kwok_resource_metrics() -> list[dict[str, Any]]:
    """kwok's simulated resource usage (from the pod's usage annotations, else the default)
    and the /metrics/resource families metrics-server reads, per node."""

    def usage(resource: str, annotation: str) -> dict[str, str]:
        return {
            "expression": f'"{annotation}" in pod.metadata.annotations'
            f' ? Quantity(pod.metadata.annotations["{annotation}"])'
            f' : Quantity("{DEFAULT_USAGE[resource]}")'
        }

    container_labels = [
        {"name": "container", "value": "container.name"},
        {"name": "namespace", "value": "pod.metadata.namespace"},
        {"name": "pod", "value": "pod.metadata.name"},
    ]
    families = [
        ("node_cpu_usage_seconds_total", "counter", "node", [], 'node.CumulativeUsage("cpu")'),
        ("node_memory_working_set_bytes", "gauge", "node", [], 'node.Usage("memory")'),
        (
            "container_cpu_usage_seconds_total",
            "counter",
            "container",
            container_labels,
            'pod.CumulativeUsage("cpu", container.name)',
        ),
        (
            "container_memory_working_set_bytes",
            "gauge",
            "container",
            container_labels,
            'pod.Usage("memory", container.name)',
        ),
    ]
    return [
        {
            "apiVersion": "kwok.x-k8s.io/v1alpha1",
            "kind": "ClusterResourceUsage",
            "metadata": {"name": "usage-from-annotations"},
            "spec": {
                "usages": [
                    {
                        "usage": {
                            "cpu": usage("cpu", USAGE_CPU_ANNOTATION),
                            "memory": usage("memory", USAGE_MEMORY_ANNOTATION),
                        }
                    }
                ]
            },
        },
        {
            "apiVersion": "kwok.x-k8s.io/v1alpha1",
            "kind": "Metric",
            "metadata": {"name": "resource"},
            "spec": {
                "path": kwok_resource_metrics_path("{nodeName}"),
                "metrics": [
                    {
                        "name": name,
                        "help": name,
                        "kind": kind,
                        "dimension": dimension,
                        "labels": labels,
                        "value": value,
                    }
                    for name, kind, dimension, labels, value in families
                ],
            },
        },
    ]


def _unverified_context() -> ssl.SSLContext:
    # Health endpoints of controllers serve self-signed certificates made at their start.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


_UNVERIFIED = _unverified_context()
# metrics-server's smallest: each layer needs two scrapes before it has a CPU rate.
METRIC_RESOLUTION_SECONDS = 10


def _http_ok(host: str, port: int, path: str) -> bool:
    return _get_status(http.client.HTTPConnection(host, port, timeout=2), path) == 200


def _https_ok(host: str, port: int, path: str, context: ssl.SSLContext) -> bool:
    return (
        _get_status(http.client.HTTPSConnection(host, port, timeout=2, context=context), path)
        == 200
    )


def _get_status(connection: http.client.HTTPConnection, path: str) -> int | None:
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


__all__ = [
    "ClusterError",
    "ClusterSpec",
    "LocalCluster",
    "NodeSpec",
    "ProcessError",
    "Role",
]
