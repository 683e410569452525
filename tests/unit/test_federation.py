import ipaddress
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness import cli as harness_cli
from harness.cli import build_parser
from harness.cli import main as cli_main
from harness.federation import (
    MAX_LOWER,
    Federation,
    FederationRunning,
    FederationSpec,
    stop_state_dir,
    supervisor_of,
)
from harness.localcluster import (
    RESOURCE_METRICS_PATH_ANNOTATION,
    ClusterError,
    LocalCluster,
    NodeSpec,
    pod_cidr,
)
from harness.process import ManagedProcess
from harness.state import STATE_FILE, kubeconfig_path
from harness.toolchain import Toolchain

FAKE_TOOLCHAIN = Toolchain(
    Path("/nonexistent/kube"), Path("/nonexistent/kwok"), Path("/nonexistent"), "v0"
)


def test_default_spec_is_one_upper_and_two_lower_clusters_with_zones() -> None:
    clusters = FederationSpec().clusters()
    assert [(c.name, c.role, len(c.nodes)) for c in clusters] == [
        ("upper", "upper", 0),
        ("lower-1", "lower", 3),
        ("lower-2", "lower", 3),
    ]
    labels = [n.labels for n in clusters[1].nodes]
    assert {lab["topology.kubernetes.io/region"] for lab in labels} == {"lower-1"}
    assert [lab["topology.kubernetes.io/zone"] for lab in labels] == [
        "lower-1-a",
        "lower-1-b",
        "lower-1-a",
    ]


def test_tenants_are_upper_clusters_the_first_named_upper() -> None:
    clusters = FederationSpec(tenants=3, lower=1).clusters()
    assert [(c.name, c.role) for c in clusters] == [
        ("upper", "upper"),
        ("tenant-2", "upper"),
        ("tenant-3", "upper"),
        ("lower-1", "lower"),
    ]


def test_spec_rejects_impossible_sizes() -> None:
    with pytest.raises(ValueError, match="at least one upper cluster"):
        FederationSpec(tenants=0).clusters()
    with pytest.raises(ValueError, match="at least one lower cluster"):
        FederationSpec(lower=0).clusters()
    with pytest.raises(ValueError, match="nodes per lower cluster"):
        FederationSpec(nodes_per_lower=-1).clusters()


def test_every_lower_cluster_gives_its_pods_addresses_of_its_own() -> None:
    lowers = FederationSpec(lower=MAX_LOWER).clusters()[1:]
    networks = [ipaddress.ip_network(c.pod_cidr) for c in lowers]
    assert [str(n) for n in networks[:2]] == ["10.241.0.0/16", "10.242.0.0/16"]
    assert str(networks[-1]) == "10.255.0.0/16"
    assert not any(a.overlaps(b) for a, b in itertools.combinations(networks, 2))
    with pytest.raises(ValueError, match=f"room for {MAX_LOWER} lower clusters, not 16"):
        FederationSpec(lower=MAX_LOWER + 1).clusters()
    with pytest.raises(ValueError, match="room for the pods of 16 clusters"):
        pod_cidr(16)


def test_node_manifest_has_capacity_labels_and_extended_resources() -> None:
    node = NodeSpec(
        "n1",
        cpu="4",
        memory="8Gi",
        pods=20,
        labels={"disk": "ssd"},
        extended_resources={"example.com/gpu": "2"},
    ).manifest()
    assert node["status"]["allocatable"] == {
        "cpu": "4",
        "memory": "8Gi",
        "pods": "20",
        "example.com/gpu": "2",
    }
    assert node["metadata"]["labels"]["disk"] == "ssd"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "n1"
    # Where kwok serves the node's resource metrics, for metrics-server.
    assert node["metadata"]["annotations"][RESOURCE_METRICS_PATH_ANNOTATION] == (
        "/metrics/nodes/n1/metrics/resource"
    )


def test_a_metrics_server_runs_in_every_cluster_when_asked_and_by_default_with_up() -> None:
    assert all(c.metrics_server for c in FederationSpec(metrics_server=True).clusters())
    assert not any(c.metrics_server for c in FederationSpec().clusters())
    parser = build_parser()
    assert parser.parse_args(["up"]).metrics_server is True
    assert parser.parse_args(["up", "--no-metrics-server"]).metrics_server is False


def test_kwok_simulates_usage_and_serves_resource_metrics_only_when_asked(
    tmp_path: Path,
) -> None:
    def kinds(metrics_server: bool) -> dict[str, dict[str, object]]:
        spec = FederationSpec(lower=1, metrics_server=metrics_server).clusters()[1]
        config = LocalCluster(spec, tmp_path, FAKE_TOOLCHAIN).kwok_config()
        return {d["kind"]: d for d in yaml.safe_load_all(config)}

    def stages() -> list[str]:
        spec = FederationSpec(lower=1).clusters()[1]
        config = LocalCluster(spec, tmp_path, FAKE_TOOLCHAIN).kwok_config()
        return [d["metadata"]["name"] for d in yaml.safe_load_all(config) if d["kind"] == "Stage"]

    plain = kinds(False)
    assert "Metric" not in plain and "ClusterResourceUsage" not in plain
    # Always: kwok runs no ephemeral container by itself, nor makes a pod Ready twice, nor
    # reports a container's resources.
    assert stages() == [
        "pod-ephemeral-containers-running",
        "pod-ready-again",
        "pod-container-resources",
    ]
    served = kinds(True)
    metric = served["Metric"]["spec"]
    assert isinstance(metric, dict)
    assert metric["path"] == "/metrics/nodes/{nodeName}/metrics/resource"
    assert {m["name"] for m in metric["metrics"]} == {
        "node_cpu_usage_seconds_total",
        "node_memory_working_set_bytes",
        "container_cpu_usage_seconds_total",
        "container_memory_working_set_bytes",
    }
    assert "ClusterResourceUsage" in served


def test_a_running_federation_is_not_started_over(tmp_path: Path) -> None:
    sleeper = ManagedProcess("etcd", ["sleep", "60"], tmp_path / "sleep.log")
    sleeper.start()
    try:
        record = sleeper.record()
        (tmp_path / STATE_FILE).write_text(
            json.dumps({"clusters": {"upper": {"kubeconfig": "k", "processes": [vars(record)]}}})
        )
        federation = Federation(tmp_path, FederationSpec().clusters(), FAKE_TOOLCHAIN)
        with pytest.raises(FederationRunning, match=f"already running .*PIDs {record.pid}"):
            federation.start()
    finally:
        sleeper.stop()


def test_a_directory_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("user data")
    federation = Federation(tmp_path, FederationSpec().clusters(), FAKE_TOOLCHAIN)
    with pytest.raises(ClusterError, match="not a kubestrata state directory"):
        federation.start()
    assert (tmp_path / "precious.txt").exists()


def test_a_stale_state_directory_is_cleared(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text(
        json.dumps(
            {
                "clusters": {
                    "upper": {
                        "kubeconfig": "k",
                        "processes": [{"name": "etcd", "pid": 999_999_999, "start_ticks": 1}],
                    }
                }
            }
        )
    )
    (tmp_path / "upper").mkdir()
    federation = Federation(tmp_path, FederationSpec().clusters(), FAKE_TOOLCHAIN)
    with pytest.raises(Exception, match="cannot start etcd"):  # the fake toolchain has no binaries
        federation.start()
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert all(c["processes"] == [] for c in state["clusters"].values())


def test_kubeconfig_of_unknown_cluster_names_the_known_ones(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text(
        json.dumps({"clusters": {"upper": {"kubeconfig": "/u"}, "lower-1": {"kubeconfig": "/l1"}}})
    )
    assert kubeconfig_path(tmp_path, "lower-1") == Path("/l1")
    with pytest.raises(ClusterError, match=r"no cluster 'lower-9'.*upper, lower-1"):
        kubeconfig_path(tmp_path, "lower-9")


def test_cli_rejects_bad_counts() -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--lower", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--tenants", "0"])
    assert parser.parse_args(["up", "--tenants", "2"]).tenants == 2
    args = parser.parse_args(["up", "--lower", "3", "--nodes", "0", "--detach"])
    assert (args.lower, args.nodes, args.detach) == (3, 0, True)
    for bad in (["--node-cpu", "abc"], ["--node-memory", "12Q"], ["--node-cpu", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["up", *bad])
    args = parser.parse_args(["up", "--node-cpu", "1500m", "--node-memory", "8Gi"])
    assert (args.node_cpu, args.node_memory) == ("1500m", "8Gi")


def test_k3s_lowers_are_containers_and_need_the_foreground() -> None:
    clusters = FederationSpec(lower=1, k3s=True).clusters()
    assert [(c.name, c.runtime) for c in clusters] == [("upper", "local"), ("lower-1", "k3s")]
    with pytest.raises(ClusterError, match="no --detach"):
        Federation(Path("/nonexistent"), clusters, FAKE_TOOLCHAIN, die_with_parent=False)


def test_k3s_without_docker_says_what_is_missing(tmp_path: Path) -> None:
    from harness.k3s import K3sCluster

    cluster = K3sCluster(FederationSpec(lower=1, k3s=True).clusters()[1], tmp_path, FAKE_TOOLCHAIN)
    try:
        import docker

        docker.from_env().ping()
    except Exception:
        with pytest.raises(ClusterError, match=r"testcontainers|Docker engine"):
            cluster.start()
    else:
        pytest.skip("a Docker engine is running here: the e2e path applies instead")


def test_down_refuses_a_directory_that_is_not_ours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`down` removes its state directory: never one `up` did not make (a mistyped path)."""
    (tmp_path / "precious.txt").write_text("user data")
    assert cli_main(["down", "--state-dir", str(tmp_path)]) != 0
    assert (tmp_path / "precious.txt").exists()
    assert "not a kubestrata state directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content",
    [
        [],
        {"clusters": {"upper": {}}},
        {"clusters": {"upper": {"kubeconfig": "k", "processes": {}}}},
        {"clusters": {"upper": {"kubeconfig": "k", "processes": [{"name": "etcd"}]}}},
        {"clusters": {"upper": {"kubeconfig": "k"}}, "components": [{"pid": "1"}]},
    ],
)
@pytest.mark.parametrize("command", ["down", "kubeconfig", "status"])
def test_a_state_file_of_another_shape_is_said_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, command: str
) -> None:
    (tmp_path / STATE_FILE).write_text(json.dumps(content))
    assert cli_main([command, "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kubestrata {command}: ") and "not a kubestrata state file" in err
    assert "Traceback" not in err


def test_a_supervisor_record_of_another_shape_is_no_supervisor(tmp_path: Path) -> None:
    state = {"clusters": {"upper": {"kubeconfig": "k"}}, "supervisor": {"name": "x"}}
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    assert supervisor_of(tmp_path) is None


def test_status_with_a_kubeconfig_that_is_not_yaml_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "broken.kubeconfig"
    kubeconfig.write_text("clusters: [")
    assert cli_main(["status", "--kubeconfig", str(kubeconfig)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kubestrata status: cannot read the virtual nodes with ")
    assert "Traceback" not in err


def test_status_with_a_kubeconfig_that_is_not_there_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the client's own words: a stray "Config not found", then "Invalid kube-config
    file. Expected key current-context"."""
    missing = tmp_path / "typo.kubeconfig"
    assert cli_main(["status", "--kubeconfig", str(missing)]) == 1
    assert capsys.readouterr().err == f"kubestrata status: no kubeconfig at {missing}\n"


def test_the_state_file_is_written_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write cut short (the process killed) leaves the state as it was: a file cut in
    the middle would leave a directory neither `up` nor `down` reads."""
    federation = Federation(tmp_path, FederationSpec().clusters(), FAKE_TOOLCHAIN)
    federation._write_state()
    before = (tmp_path / STATE_FILE).read_text()
    json.loads(before)

    def cut_short(self: Path, text: str) -> int:
        with self.open("w") as file:
            file.write(text[: len(text) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(KeyboardInterrupt):
        federation._write_state()
    assert (tmp_path / STATE_FILE).read_text() == before


def test_down_stops_the_supervisor_before_what_it_supervises(tmp_path: Path) -> None:
    """A foreground `up` started again each process `down` stopped: it goes first, and
    what it left running after it."""
    # Stands for `kubestrata up`: on SIGTERM it notes that the process it supervises was
    # still running, as the real one then stops it itself.
    supervisor = ManagedProcess(
        "kubestrata up",
        [
            sys.executable,
            "-c",
            "import os, signal, sys, time\n"
            "def stop(*_):\n"
            f"    open({str(tmp_path / 'order')!r}, 'a').write('supervisor\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "time.sleep(60)\n",
        ],
        tmp_path / "supervisor.log",
    )
    supervised = ManagedProcess("etcd", ["sleep", "60"], tmp_path / "etcd.log")
    supervisor.start()
    supervised.start()
    try:
        time.sleep(0.5)  # the handler set
        state = {
            "clusters": {"upper": {"kubeconfig": "k", "processes": [vars(supervised.record())]}},
            "supervisor": vars(supervisor.record()),
        }
        (tmp_path / STATE_FILE).write_text(json.dumps(state))
        assert supervisor_of(tmp_path) == supervisor.record()
        assert stop_state_dir(tmp_path) == 1
        stopped = (tmp_path / "order").read_text().split()
        assert stopped == ["supervisor"]
        assert not supervisor.running() and not supervised.running()
        assert supervisor_of(tmp_path) is None, "an ended supervisor is not one"
    finally:
        supervisor.stop()
        supervised.stop()


def test_a_start_that_fails_begins_no_queued_cluster_and_stops_those_on_their_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One cluster fails (or Ctrl-C): the start ends at once, the clusters queued behind
    are never begun, and one still on its way stops waiting (it waited for every start,
    queued ones too, and clusters began after the stop)."""
    federation = Federation(tmp_path, FederationSpec(lower=3).clusters(), FAKE_TOOLCHAIN)
    begun: list[str] = []
    failing = federation.upper

    def start(cluster: LocalCluster, timeout: float = 0.0) -> None:
        begun.append(cluster.name)
        if cluster is failing:
            time.sleep(0.2)
            raise ClusterError("upper: kube-apiserver exited")
        process = cluster._launch(
            "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], ()
        )
        cluster._wait(process, 60, lambda: False)

    monkeypatch.setattr(LocalCluster, "start", start)
    began = time.monotonic()
    with pytest.raises(ClusterError, match="kube-apiserver exited"):
        federation.start()
    assert time.monotonic() - began < 10
    assert begun[:2] == ["upper", "lower-1"] and "lower-3" not in begun, begun
    assert all(not p.running() for c in federation.clusters.values() for p in c.processes.values())


@pytest.mark.parametrize(
    "error",
    [
        subprocess.TimeoutExpired(["kubectl", "wait"], 120),
        OSError(39, "Directory not empty", "etcd"),
    ],
)
def test_a_command_timing_out_or_a_file_in_the_way_is_one_line(
    error: Exception, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(_args: object) -> int:
        raise error

    monkeypatch.setitem(harness_cli._HANDLERS, "down", fail)
    assert cli_main(["down"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kubestrata down: ") and err.count("\n") == 1


def test_a_restart_that_times_out_is_one_more_exit_not_the_supervisors_end(
    tmp_path: Path,
) -> None:
    federation = Federation(tmp_path, FederationSpec().clusters(), FAKE_TOOLCHAIN)
    reports: list[str] = []

    def start() -> None:
        raise subprocess.TimeoutExpired(["kubectl", "wait"], 120)

    federation._start_again("lower-1/kwok", start, reports.append)
    assert len(reports) == 1 and reports[0].startswith("lower-1/kwok did not start again: ")
