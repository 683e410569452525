"""A lower cluster in a K3s container, through testcontainers: the optional path for
machines with a Docker engine (`kubestrata up --k3s`). The local binaries are the
default and what CI uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.localcluster import ClusterError, ClusterSpec, KubectlClient
from harness.process import ProcessRecord
from harness.toolchain import Toolchain

K3S_IMAGE = "rancher/k3s:v1.35.4-k3s1"


def _docker_engine() -> Any:
    try:
        import docker
    except ImportError as error:
        raise ClusterError(
            "K3s lower clusters need testcontainers: pip install -e '.[k3s]'"
        ) from error
    try:
        client = docker.from_env()
        client.ping()
    except Exception as error:  # docker raises several unrelated types for "no engine"
        raise ClusterError(f"K3s lower clusters need a running Docker engine: {error}") from error
    return client


class K3sCluster(KubectlClient):
    """The same surface as LocalCluster for what a federation needs of a lower cluster."""

    def __init__(self, spec: ClusterSpec, directory: Path, toolchain: Toolchain) -> None:
        self.spec = spec
        self.directory = directory
        self.toolchain = toolchain
        self.kubeconfig = directory / "kubeconfig"
        self._container: Any = None

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self) -> None:
        _docker_engine()
        from testcontainers.k3s import K3SContainer

        self.directory.mkdir(parents=True, exist_ok=True)
        self._container = K3SContainer(K3S_IMAGE).start()
        self.kubeconfig.write_text(self._container.config_yaml())
        self.kubeconfig.chmod(0o600)

    def records(self) -> list[ProcessRecord]:
        return []  # a container, not a process of ours: stopped by stop(), not by PID

    def stop(self) -> None:
        if self._container is not None:
            self._container.stop()
            self._container = None
