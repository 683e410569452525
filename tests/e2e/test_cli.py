"""`kubestrata up / down / kubeconfig` as a user runs them, and start-up failures."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.federation import running_processes
from harness.localcluster import ClusterError, ClusterSpec, LocalCluster, Ports
from harness.toolchain import Toolchain

KUBESTRATA = [sys.executable, "-m", "kubekit.cli"]


def kubestrata(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KUBESTRATA, *args], capture_output=True, text=True, timeout=timeout)


def ready_nodes(kubectl: Path, kubeconfig: str) -> list[str]:
    nodes = json.loads(
        subprocess.run(
            [str(kubectl), f"--kubeconfig={kubeconfig}", "get", "nodes", "-o", "json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )["items"]
    return [
        n["metadata"]["name"]
        for n in nodes
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
    ]


def test_up_detach_kubeconfig_down(state_dir: Path, toolchain: Toolchain) -> None:
    try:
        up = kubestrata(
            "up", "--detach", "--lower", "1", "--nodes", "2", "--state-dir", str(state_dir)
        )
        assert up.returncode == 0, up.stderr
        assert f"export KUBECONFIG={state_dir / 'upper' / 'kubeconfig'}" in up.stdout
        assert f"export KUBECONFIG={state_dir / 'lower-1' / 'kubeconfig'}" in up.stdout

        lower = kubestrata("kubeconfig", "--cluster", "lower-1", "--state-dir", str(state_dir))
        assert lower.returncode == 0, lower.stderr
        assert sorted(ready_nodes(toolchain.kubectl, lower.stdout.strip())) == [
            "lower-1-node-0",
            "lower-1-node-1",
        ]
        upper = kubestrata("kubeconfig", "--state-dir", str(state_dir)).stdout.strip()
        assert upper == str(state_dir / "upper" / "kubeconfig")

        again = kubestrata("up", "--detach", "--state-dir", str(state_dir))
        assert again.returncode == 1
        assert "already running" in again.stderr and "kubestrata down" in again.stderr

        unknown = kubestrata("kubeconfig", "--cluster", "nope", "--state-dir", str(state_dir))
        assert unknown.returncode == 1 and "no cluster 'nope'" in unknown.stderr
        processes = running_processes(state_dir)
        assert {p.name for p in processes} == {
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
            "metrics-server",
            "virtual-node-lower-1",
            "webhook",
            "multischeduler",
            "descheduler",
        }
    finally:
        down = kubestrata("down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr
    assert "stopped 15 processes" in down.stdout
    assert not state_dir.exists()
    assert not any(p.alive() for p in processes)


def foreground_up(
    state_dir: Path, preexec_fn: Callable[[], object] | None = None
) -> subprocess.Popen[str]:
    """A small `kubestrata up` in the foreground (no --detach), its output piped."""
    return subprocess.Popen(
        [
            *KUBESTRATA,
            "up",
            "--lower",
            "1",
            "--nodes",
            "1",
            "--no-multischeduler",
            "--no-descheduler",
            "--no-metrics-server",
            "--state-dir",
            str(state_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )


def ready(up: subprocess.Popen[str]) -> None:
    """Reads the foreground `up`'s output until it says it is ready."""
    assert up.stdout is not None
    for line in up.stdout:
        if "press Ctrl-C" in line:
            return
    pytest.fail(f"up ended before it was ready: {up.stderr.read() if up.stderr else ''}")


def test_foreground_up_restarts_what_exits_and_stops_everything_on_ctrl_c(
    state_dir: Path,
) -> None:
    # As a shell starts a background job: Ctrl-C must stop it all the same.
    up = foreground_up(state_dir, lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert up.stdout is not None
        ready(up)
        processes = running_processes(state_dir)
        # --no-multischeduler: no extender, and the scheduler's configuration names none.
        assert len(processes) == 11
        assert not {"multischeduler", "descheduler", "metrics-server"} & {p.name for p in processes}
        assert "extenders" not in (state_dir / "upper" / "scheduler" / "config.yaml").read_text()

        # A crash: the supervisor says so and starts it again.
        (webhook,) = [p for p in processes if p.name == "webhook"]
        os.kill(webhook.pid, signal.SIGKILL)
        said = []
        for line in up.stdout:
            said.append(line.strip())
            if line.strip() == "webhook started again":
                break
        assert said[0].startswith("webhook exited with code -9; starting it again in 0 s"), said
        (again,) = [p for p in running_processes(state_dir) if p.name == "webhook"]
        assert again.pid != webhook.pid and again.alive()

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert not any(p.alive() for p in [*processes, again])
    finally:
        if up.poll() is None:
            up.kill()


def test_down_stops_a_foreground_up_before_what_it_supervises(state_dir: Path) -> None:
    """Left running, the foreground `up` started again each process `down` stopped (and
    they ran on in a removed directory)."""
    up = foreground_up(state_dir)
    try:
        assert up.stdout is not None
        ready(up)
        processes = running_processes(state_dir)
        down = kubestrata("down", "--state-dir", str(state_dir))
        assert down.returncode == 0, down.stderr
        assert up.wait(60) == 0
        said = up.stdout.read()
        assert "started again" not in said, said
        assert not any(p.alive() for p in processes)
        assert not state_dir.exists()
    finally:
        if up.poll() is None:
            up.kill()


def test_port_in_use_is_a_clear_error(tmp_path: Path, toolchain: Toolchain) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        ports = dataclasses.replace(Ports.allocate(), apiserver=taken)
        cluster = LocalCluster(ClusterSpec("busy", "upper"), tmp_path, toolchain, ports=ports)
        with pytest.raises(
            ClusterError, match=f"port 127.0.0.1:{taken} for busy/kube-apiserver is in use"
        ):
            cluster.start()
    assert not cluster.processes["etcd"].running(), "what had started is stopped again"


def test_component_that_dies_at_start_is_reported_with_its_log(
    tmp_path: Path, toolchain: Toolchain
) -> None:
    cluster = LocalCluster(ClusterSpec("broken", "upper"), tmp_path, toolchain)
    # etcd refuses a data directory it cannot create.
    (tmp_path / "etcd").write_text("a file where etcd wants a directory")
    with pytest.raises(Exception, match=r"(?s)etcd exited with code \d+ while starting.*etcd\.log"):
        cluster.start(timeout=30)
