"""A local federation: one upper cluster and N lower clusters, with a state directory
that lets ``kubestrata down`` (another process) find and stop everything by PID."""

from __future__ import annotations

import functools
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from harness.k3s import K3sCluster
from harness.localcluster import (
    LOOPBACK,
    POD_CIDRS,
    ClusterError,
    ClusterSpec,
    KubectlClient,
    LocalCluster,
    NodeSpec,
    free_port,
    pod_cidr,
)
from harness.process import ManagedProcess, ProcessError, ProcessRecord, start_time_ticks
from harness.state import (
    COMPONENTS,
    STATE_FILE,
    UPPER,
    is_process_record,
    read_state,
)
from harness.supervisor import RestartPolicy
from harness.toolchain import Toolchain
from kubekit import keys, pki
from webhook.configuration import CONFIGURATION_NAME as WEBHOOK_CONFIGURATION
from webhook.configuration import PATH as WEBHOOK_PATH
from webhook.configuration import url_configuration

MULTISCHEDULER = "multischeduler"
MULTISCHEDULER_ACCOUNT = "kubestrata-multischeduler"
# The common name of the upper kube-scheduler's client certificate, the one the
# multischeduler lets call it.
SCHEDULER_CLIENT_NAME = "system:kube-scheduler"
DESCHEDULER = "descheduler"
DESCHEDULER_ACCOUNT = "kubestrata-descheduler"
WEBHOOK = "webhook"
WEBHOOK_ACCOUNT = "kubestrata-webhook"
VIRTUAL_NODE_ACCOUNT = "kubestrata-virtual-node"
MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"
# Two apiservers starting at once already fill two cores.
_PARALLEL_STARTS = 2
# Lower cluster N takes the pod CIDR pod_cidr(N); 0 is left out, as the upper's.
MAX_LOWER = POD_CIDRS - 1


@dataclass(frozen=True)
class Identity:
    """What a component authenticates with in one cluster: a kubeconfig with the token of
    the ServiceAccount its manifests give it, and where to write that account's tokens
    for other audiences."""

    kubeconfig: Path
    account: str

    def token_file(self, cluster: KubectlClient, audience: str) -> Path:
        """The account's token for ``audience``, written beside the kubeconfig, as the
        manifests project it."""
        path = self.kubeconfig.with_suffix(f".{audience.replace('/', '-')}.token")
        path.write_text(cluster.service_account_token(self.account, audience))
        path.chmod(0o600)
        return path


def tenant_name(index: int) -> str:
    """The name of the ``index``-th upper (tenant) cluster, from 1: the first is the
    upper cluster every single-tenant federation has."""
    return UPPER if index == 1 else f"tenant-{index}"


@dataclass(frozen=True)
class FederationSpec:
    # Upper (tenant) control planes sharing the lower clusters.
    tenants: int = 1
    lower: int = 2
    nodes_per_lower: int = 3
    node_cpu: str = "16"
    node_memory: str = "64Gi"
    node_pods: int = 110
    k3s: bool = False  # lower clusters as K3s containers (needs a Docker engine)
    metrics_server: bool = False  # one per local cluster, for `kubectl top`

    def clusters(self) -> list[ClusterSpec]:
        if self.lower < 1:
            raise ValueError(f"a federation needs at least one lower cluster, not {self.lower}")
        if self.lower > MAX_LOWER:
            raise ValueError(
                f"a local federation has room for {MAX_LOWER} lower clusters, not {self.lower}"
            )
        if self.nodes_per_lower < 0:
            raise ValueError(f"nodes per lower cluster must be >= 0, not {self.nodes_per_lower}")
        if self.tenants < 1:
            raise ValueError(f"a federation needs at least one upper cluster, not {self.tenants}")
        specs = [
            ClusterSpec(tenant_name(index), "upper", metrics_server=self.metrics_server)
            for index in range(1, self.tenants + 1)
        ]
        for index in range(1, self.lower + 1):
            name = f"lower-{index}"
            nodes = tuple(
                NodeSpec(
                    name=f"{name}-node-{n}",
                    cpu=self.node_cpu,
                    memory=self.node_memory,
                    pods=self.node_pods,
                    labels={
                        "topology.kubernetes.io/region": name,
                        "topology.kubernetes.io/zone": f"{name}-{'ab'[n % 2]}",
                    },
                )
                for n in range(self.nodes_per_lower)
            )
            if self.k3s:
                specs.append(ClusterSpec(name, "lower", runtime="k3s"))
            else:
                specs.append(
                    ClusterSpec(
                        name,
                        "lower",
                        nodes,
                        metrics_server=self.metrics_server,
                        pod_cidr=pod_cidr(index),
                    )
                )
        return specs


def scheduler_extender(url: str, ca_file: Path, client: pki.KeyPair) -> dict[str, object]:
    """The upper kube-scheduler's `extenders` entry for the multischeduler (the same as
    manifests/multischeduler/scheduler-config.yaml): ``client`` the scheduler's client
    certificate, the extender's only caller. Not ignorable: a pod is never sent to a
    cluster nobody checked."""
    return {
        "urlPrefix": url,
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "weight": 5,
        "enableHTTPS": True,
        "nodeCacheCapable": True,
        "ignorable": False,
        "httpTimeout": "5s",
        "tlsConfig": {
            "caFile": str(ca_file),
            "certFile": str(client.cert_path),
            "keyFile": str(client.key_path),
        },
    }


def scheduler_client_pair(directory: Path) -> pki.KeyPair:
    """The upper kube-scheduler's client certificate for the multischeduler, signed by a
    CA of its own kept in ``directory`` (``pki.ca_path`` of the pair: the extender's
    --client-ca-file); made once, reused after."""
    prefix = directory / "scheduler-client"
    pair = pki.KeyPair(prefix.with_suffix(".crt"), prefix.with_suffix(".key"))
    ca_file = pki.ca_path(pair)
    if not (pair.cert_path.exists() and pair.key_path.exists() and ca_file.exists()):
        ca = pki.create_ca(directory, prefix.name)
        pair = pki.issue(ca, prefix, SCHEDULER_CLIENT_NAME, client=True)
    return pair


def _serves(url: str, context: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(url, context=context, timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def virtual_node_name(cluster: str) -> str:
    """The component name of the virtual node of a lower cluster."""
    return f"virtual-node-{cluster}"


class FederationRunning(ClusterError):
    """The state directory belongs to a federation whose processes still run."""


def supervising_process(name: str) -> ProcessRecord:
    """This process, as the supervisor of a federation."""
    pid = os.getpid()
    ticks = start_time_ticks(pid)
    assert ticks is not None, "a running process has a start time"
    return ProcessRecord(name, pid, ticks)


def _records(cluster_state: dict[str, object]) -> list[ProcessRecord]:
    raw = cluster_state.get("processes", [])
    assert isinstance(raw, list), "read_state checked it"
    return [ProcessRecord(r["name"], r["pid"], r["start_ticks"]) for r in raw]


def running_processes(state_dir: Path) -> list[ProcessRecord]:
    if not (state_dir / STATE_FILE).exists():
        return []
    return [r for c in read_state(state_dir).values() for r in _records(c) if r.alive()]


# How long `kubestrata down` lets a foreground `kubestrata up` stop its federation itself.
SUPERVISOR_STOP_SECONDS = 120.0


def supervisor_of(state_dir: Path) -> ProcessRecord | None:
    """The foreground `kubestrata up` supervising the federation of ``state_dir``, while
    it runs."""
    try:
        raw = json.loads((state_dir / STATE_FILE).read_text()).get("supervisor")
    except (OSError, ValueError, AttributeError):
        return None
    if not is_process_record(raw):
        return None
    assert isinstance(raw, dict)
    record = ProcessRecord(raw["name"], raw["pid"], raw["start_ticks"])
    return record if record.alive() else None


def stop_state_dir(state_dir: Path) -> int:
    """Stops every process recorded in the state directory; returns how many ran. A
    foreground `kubestrata up` supervising them is stopped first, and stops them itself:
    left running, it started again each process stopped here."""
    supervisor = supervisor_of(state_dir)
    if supervisor is not None:
        supervisor.stop(grace_seconds=SUPERVISOR_STOP_SECONDS)
    records = running_processes(state_dir)
    # Dependants before what they depend on: kubestrata's components, kwok and
    # controllers, apiservers, etcd.
    order = {
        "kwok": 1,
        "kube-scheduler": 1,
        "kube-controller-manager": 1,
        "kube-apiserver": 2,
        "etcd": 3,
    }
    for record in sorted(records, key=lambda r: order.get(r.name, 0)):
        record.stop()
    return len(records)


class Federation:
    def __init__(
        self,
        state_dir: Path,
        clusters: list[ClusterSpec],
        toolchain: Toolchain,
        *,
        die_with_parent: bool = True,
    ) -> None:
        self.state_dir = state_dir
        self.webhook_url: str | None = None
        self.multischeduler_url: str | None = None
        self.toolchain = toolchain
        self.die_with_parent = die_with_parent
        self.components: dict[str, ManagedProcess] = {}
        # The process that supervises the federation (a foreground `kubestrata up`), for
        # `kubestrata down` to stop first.
        self.supervisor: ProcessRecord | None = None
        self._state_lock = threading.Lock()
        # The state file is rewritten as each process starts, so `kubestrata down` finds
        # everything even if this process is killed half-way through `up`.
        self.clusters = {
            spec.name: LocalCluster(
                spec,
                state_dir / spec.name,
                toolchain,
                die_with_parent=die_with_parent,
                on_process_started=self._write_state,
            )
            for spec in clusters
            if spec.runtime == "local"
        }
        self.k3s_clusters = {
            spec.name: K3sCluster(spec, state_dir / spec.name, toolchain)
            for spec in clusters
            if spec.runtime == "k3s"
        }
        if self.k3s_clusters and not die_with_parent:
            raise ClusterError(
                "K3s lower clusters run only as long as `kubestrata up` does (no --detach)"
            )

    @property
    def upper(self) -> LocalCluster:
        return self.clusters[UPPER]

    @property
    def tenants(self) -> list[LocalCluster]:
        """The upper clusters, the first one ``upper``."""
        return [c for c in self.clusters.values() if c.spec.role == "upper"]

    def _component(self, tenant: LocalCluster, name: str) -> str:
        """A component's name, unique across the tenants' components."""
        return name if tenant.name == UPPER else f"{tenant.name}-{name}"

    @property
    def lowers(self) -> list[LocalCluster | K3sCluster]:
        local: list[LocalCluster | K3sCluster] = [
            c for c in self.clusters.values() if c.spec.role == "lower"
        ]
        return local + list(self.k3s_clusters.values())

    def _all_clusters(self) -> list[LocalCluster | K3sCluster]:
        return [*self.clusters.values(), *self.k3s_clusters.values()]

    def _claim_state_dir(self) -> None:
        if self.state_dir.exists() and any(self.state_dir.iterdir()):
            if not (self.state_dir / STATE_FILE).exists():
                raise ClusterError(
                    f"{self.state_dir} exists and is not a kubestrata state directory; "
                    "choose another --state-dir or remove it"
                )
            alive = running_processes(self.state_dir)
            if alive:
                raise FederationRunning(
                    f"a federation is already running from {self.state_dir} "
                    f"(PIDs {', '.join(str(r.pid) for r in alive)}): "
                    "stop it with `kubestrata down` or use another --state-dir"
                )
            # Left by a federation that was killed: nothing of it runs, so it is only files.
            shutil.rmtree(self.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self._claim_state_dir()
        self._write_state()
        pool = ThreadPoolExecutor(_PARALLEL_STARTS)
        try:
            for future in [pool.submit(c.start) for c in self._all_clusters()]:
                future.result()
        except BaseException:
            # At once (a Ctrl-C, a cluster that failed): the clusters not begun are not
            # begun, those on their way stop launching and waiting, and what was
            # launched meanwhile is stopped after them. Leaving the pool as a `with`
            # block waited for every start, queued ones too, for minutes.
            pool.shutdown(wait=False, cancel_futures=True)
            self.stop()
            pool.shutdown(wait=True)
            self.stop()
            raise
        pool.shutdown()

    def start_virtual_nodes(self, timeout: float = 120.0) -> None:
        """One `kubestrata virtual-node` per lower cluster and tenant, each with its
        kubelet-API port, with the identities the manifests give it above and below;
        returns once every virtual Node is Ready in its upper cluster."""
        for tenant in self.tenants:
            for lower in self.lowers:
                self.start_component(
                    self._component(tenant, virtual_node_name(lower.name)),
                    self.virtual_node_args(lower, tenant=tenant),
                )
        nodes = [f"node/{keys.default_node_name(lower.name)}" for lower in self.lowers]
        deadline = time.monotonic() + timeout
        for tenant in self.tenants:
            while True:
                for process in self.components.values():
                    process.check_running()
                found = tenant.kubectl("get", *nodes, "-o", "name", check=False)
                if found.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"virtual nodes not registered in {tenant.name} after {timeout:.0f} s: "
                        f"{found.stderr}"
                    )
                time.sleep(0.5)
            tenant.kubectl(
                "wait",
                "--for=condition=Ready",
                *nodes,
                f"--timeout={int(timeout)}s",
                timeout=timeout + 10,
            )

    def virtual_node_args(
        self, lower: KubectlClient, replica: str = "", tenant: LocalCluster | None = None
    ) -> list[str]:
        """The arguments of `kubestrata virtual-node` for ``lower`` (in ``tenant``, the
        upper cluster by default); ``replica`` names one more replica beside the first,
        with ports and a Lease identity of its own. With several tenants, each one's
        namespaces are prefixed below (t1-, t2-, ...) so theirs never meet."""
        tenant = tenant or self.upper
        name = self._component(tenant, virtual_node_name(lower.name))
        upper_identity = self.identity(
            tenant, name, VIRTUAL_NODE_ACCOUNT, MANIFESTS / "virtual-node" / "rbac"
        )
        lower_identity = self.identity(
            lower, name, VIRTUAL_NODE_ACCOUNT, MANIFESTS / "virtual-node-lower"
        )
        replica_name = f"{name}-{replica}" if replica else name
        tenants = self.tenants
        prefixed = (
            [
                "--namespace-strategy=prefix",
                f"--namespace-prefix=t{tenants.index(tenant) + 1}",
            ]
            if len(tenants) > 1
            else []
        )
        return [
            "virtual-node",
            f"--upper-kubeconfig={upper_identity.kubeconfig}",
            f"--lower-kubeconfig={lower_identity.kubeconfig}",
            f"--cluster-id={lower.name}",
            f"--kubelet-port={free_port()}",
            f"--estimator-port={free_port()}",
            f"--health-port={free_port()}",
            # Named after the replica, a restarted process holds the Lease again at once
            # instead of waiting for it to expire.
            f"--leader-elect-identity={replica_name}",
            f"--client-ca-file={tenant.ca.cert_path}",
            f"--cert-dir={self.state_dir / COMPONENTS / replica_name}",
            *prefixed,
        ]

    def start_webhook(self, timeout: float = 60.0, tenant: LocalCluster | None = None) -> str:
        """`kubestrata webhook` on a loopback port, for ``tenant`` (the upper cluster by
        default). As with the manifests, the MutatingWebhookConfiguration is applied for it
        (here with its URL) and the webhook, with its manifests' identity, puts its CA in;
        returns the URL once it has."""
        tenant = tenant or self.upper
        name = self._component(tenant, WEBHOOK)
        port = free_port()
        url = f"https://127.0.0.1:{port}{WEBHOOK_PATH}"
        tenant.kubectl("apply", "-f", "-", input=json.dumps(url_configuration(url)))
        identity = self.identity(tenant, name, WEBHOOK_ACCOUNT, MANIFESTS / WEBHOOK / "rbac.yaml")
        # The right to put its CA in, which the manifests' replicas do not have.
        tenant.kubectl("apply", "-f", str(MANIFESTS / WEBHOOK / "inject-ca-bundle" / "rbac.yaml"))
        self.start_component(
            name,
            [
                "webhook",
                f"--listen=127.0.0.1:{port}",
                f"--cert-dir={self.state_dir / name}",
                f"--kubeconfig={identity.kubeconfig}",
                f"--inject-ca-bundle={WEBHOOK_CONFIGURATION}",
                "--follow-moves",
            ],
        )
        deadline = time.monotonic() + timeout
        while True:
            self.components[name].check_running()
            found = tenant.kubectl(
                "get",
                "mutatingwebhookconfiguration",
                WEBHOOK_CONFIGURATION,
                "-o",
                "jsonpath={.webhooks[0].clientConfig.caBundle}",
                check=False,
            )
            if found.returncode == 0 and found.stdout.strip():
                if tenant is self.upper:
                    self.webhook_url = url
                return url
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} not registered after {timeout:.0f} s")
            time.sleep(0.3)

    def start_multischeduler(
        self, timeout: float = 60.0, tenant: LocalCluster | None = None
    ) -> str:
        """`kubestrata multischeduler` on a loopback port, for ``tenant`` (the upper
        cluster by default), with the identity its manifests give it (a ServiceAccount
        token), and that cluster's kube-scheduler started again with it as its extender;
        returns its URL once it serves."""
        tenant = tenant or self.upper
        name = self._component(tenant, MULTISCHEDULER)
        directory = self.state_dir / name
        serving = pki.serving_pair(directory, MULTISCHEDULER, (LOOPBACK,))
        ca_file = pki.ca_path(serving)
        scheduler = scheduler_client_pair(directory)
        identity = self.identity(
            tenant, name, MULTISCHEDULER_ACCOUNT, MANIFESTS / MULTISCHEDULER / "rbac.yaml"
        )
        tenant.kubectl("apply", "-f", str(MANIFESTS / MULTISCHEDULER / "flowschema.yaml"))
        port = free_port()
        url = f"https://{LOOPBACK}:{port}"
        process = self.start_component(
            name,
            [
                "multischeduler",
                f"--kubeconfig={identity.kubeconfig}",
                f"--listen={LOOPBACK}:{port}",
                f"--tls-cert-file={serving.cert_path}",
                f"--tls-key-file={serving.key_path}",
                f"--client-ca-file={pki.ca_path(scheduler)}",
                f"--client-name={SCHEDULER_CLIENT_NAME}",
                f"--estimator-ca-file={tenant.ca.cert_path}",
                f"--estimator-token-file={identity.token_file(tenant, keys.ESTIMATOR_AUDIENCE)}",
                # As the descheduler's: a restarted one holds the slices' Lease at once.
                f"--leader-elect-identity={name}",
            ],
        )
        context = ssl.create_default_context(cafile=str(ca_file))
        deadline = time.monotonic() + timeout
        while not _serves(url + "/healthz", context):
            process.check_running()
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} not serving after {timeout:.0f} s")
            time.sleep(0.3)
        tenant.set_scheduler_extenders([scheduler_extender(url, ca_file, scheduler)])
        if tenant is self.upper:
            self.multischeduler_url = url
        return url

    def start_descheduler(
        self, policy: Path | None = None, tenant: LocalCluster | None = None
    ) -> ManagedProcess:
        tenant = tenant or self.upper
        return self.start_component(
            self._component(tenant, DESCHEDULER), self.descheduler_args(policy, tenant)
        )

    def descheduler_args(
        self, policy: Path | None = None, tenant: LocalCluster | None = None
    ) -> list[str]:
        """The arguments of `kubestrata descheduler` for ``tenant`` (the upper cluster by
        default), calling the estimators with the identity its manifests give it."""
        tenant = tenant or self.upper
        name = self._component(tenant, DESCHEDULER)
        identity = self.identity(
            tenant, name, DESCHEDULER_ACCOUNT, MANIFESTS / DESCHEDULER / "rbac.yaml"
        )
        return [
            "descheduler",
            f"--kubeconfig={identity.kubeconfig}",
            f"--estimator-ca-file={tenant.ca.cert_path}",
            f"--estimator-token-file={identity.token_file(tenant, keys.ESTIMATOR_AUDIENCE)}",
            f"--health-address={LOOPBACK}",
            f"--health-port={free_port()}",
            # As the virtual nodes': a restarted descheduler holds its Lease at once.
            f"--leader-elect-identity={name}",
            *([f"--policy={policy}"] if policy is not None else []),
        ]

    def identity(
        self, cluster: KubectlClient, component: str, account: str, rbac: Path
    ) -> Identity:
        """Applies the component's RBAC from the manifests to ``cluster``; the component
        then runs with its ServiceAccount's token and nothing more, which proves the RBAC
        is enough."""
        cluster.kubectl("apply", "-k", str(MANIFESTS / "namespace"))
        cluster.kubectl("apply", "-k" if rbac.is_dir() else "-f", str(rbac))
        kubeconfig = cluster.write_token_kubeconfig(
            self.state_dir / component / f"{cluster.name}.kubeconfig",
            account,
            cluster.service_account_token(account),
        )
        return Identity(kubeconfig, account)

    def start_component(self, name: str, kubestrata_args: list[str]) -> ManagedProcess:
        process = ManagedProcess(
            name,
            [sys.executable, "-m", "kubekit.cli", *kubestrata_args],
            self.state_dir / COMPONENTS / f"{name}.log",
            die_with_parent=self.die_with_parent,
        )
        process.start()
        self.components[name] = process
        self._write_state()
        return process

    def _write_state(self) -> None:
        with self._state_lock:
            self._write_state_locked()

    def _write_state_locked(self) -> None:
        state = {
            "clusters": {
                name: {
                    "kubeconfig": str(cluster.kubeconfig),
                    "role": cluster.spec.role,
                    "processes": [vars(r) for r in cluster.records()],
                }
                for name, cluster in self.clusters.items()
            },
            COMPONENTS: [vars(p.record()) for p in self.components.values() if p.running()],
            "supervisor": vars(self.supervisor) if self.supervisor is not None else None,
        }
        # Whole or not at all: a file cut short by a kill would leave a directory that
        # neither `up` nor `down` reads.
        written = self.state_dir / f"{STATE_FILE}.new"
        written.write_text(json.dumps(state, indent=2))
        written.replace(self.state_dir / STATE_FILE)

    def supervise(
        self,
        stop: threading.Event,
        report: Callable[[str], None],
        policy: RestartPolicy | None = None,
        interval: float = 0.5,
    ) -> None:
        """Until ``stop`` is set, starts again every process of the federation that
        exits, after the policy's delay, and reports it; raises ProcessError once one
        keeps exiting."""
        policy = policy or RestartPolicy()
        for name in self._supervised():
            policy.started(name, time.monotonic())
        due: dict[str, float] = {}
        while not stop.wait(interval):
            for name, (process, start) in self._supervised().items():
                now = time.monotonic()
                if name in due:
                    if now >= due[name]:
                        del due[name]
                        self._start_again(name, start, report)
                        policy.started(name, time.monotonic())
                    continue
                code = process.exit_code()
                if code is None:
                    continue
                delay = policy.exited(name, now)
                if delay is None:
                    raise ProcessError(
                        f"{name} keeps exiting (last code {code}); last lines of "
                        f"{process.log_path}:\n{process.log_tail()}"
                    )
                report(
                    f"{name} exited with code {code}; starting it again in {delay:.0f} s "
                    f"(log: {process.log_path})"
                )
                due[name] = now + delay

    def _start_again(
        self, name: str, start: Callable[[], None], report: Callable[[str], None]
    ) -> None:
        try:
            start()
        except (ClusterError, ProcessError, OSError, subprocess.TimeoutExpired) as error:
            # Seen as one more exit on the next round (a kubectl of the restart timing
            # out ended the supervisor, and with it the federation).
            report(f"{name} did not start again: {error}")
            return
        self._write_state()
        report(f"{name} started again")

    def _supervised(self) -> dict[str, tuple[ManagedProcess, Callable[[], None]]]:
        """Every process of the federation by a name unique in it, with what starts it
        again: a component as it was, a cluster's process through its cluster (an
        apiserver takes kwok with it)."""
        supervised: dict[str, tuple[ManagedProcess, Callable[[], None]]] = {
            name: (process, process.start) for name, process in self.components.items()
        }
        for cluster in self.clusters.values():
            for name, process in cluster.processes.items():
                supervised[f"{cluster.name}/{name}"] = (
                    process,
                    functools.partial(cluster.restart, name),
                )
        return supervised

    def stop(self) -> None:
        for component in self.components.values():
            component.stop()
        for cluster in self._all_clusters():
            cluster.stop()
        if (self.state_dir / STATE_FILE).exists():
            self._write_state()
