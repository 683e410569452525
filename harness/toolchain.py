"""Where the built control-plane binaries are.

The versions are pinned once, in ``hack/k8s/versions.env``; ``hack/k8s/build.sh``
builds them into a cache keyed by version, and this module finds them there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent
VERSIONS_FILE = _REPO_ROOT / "hack" / "k8s" / "versions.env"


class ToolchainError(RuntimeError):
    """The control-plane binaries are not where they should be."""


def cache_dir() -> Path:
    explicit = os.environ.get("KUBESTRATA_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kubestrata"


def pinned_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    if not path.is_file():
        raise ToolchainError(
            f"{path} not found: run kubestrata from its source checkout (pip install -e .)"
        )
    versions = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


@dataclass(frozen=True)
class Toolchain:
    kube: Path  # the multi-call binary: kube-apiserver, kube-controller-manager, ...
    kwok: Path
    kwok_stages: Path
    kubernetes_version: str
    # Built by `hack/k8s/build.sh metrics-server`; only federations that serve resource
    # metrics need it.
    metrics_server: Path | None = None

    @property
    def kubectl(self) -> Path:
        return self.kube.parent / "kubectl"

    @classmethod
    def locate(cls) -> Toolchain:
        versions = pinned_versions()
        kubernetes_version = versions["KUBERNETES_VERSION"]
        kube_dir = cache_dir() / f"kubernetes-{kubernetes_version}"
        kwok_dir = cache_dir() / f"kwok-{versions['KWOK_VERSION']}"
        metrics_server = (
            cache_dir() / f"metrics-server-{versions['METRICS_SERVER_VERSION']}" / "metrics-server"
        )
        toolchain = cls(
            kube=kube_dir / "kube",
            kwok=kwok_dir / "kwok",
            kwok_stages=kwok_dir / "stages",
            kubernetes_version=kubernetes_version,
            metrics_server=metrics_server if metrics_server.exists() else None,
        )
        missing = [
            p for p in (toolchain.kube, toolchain.kwok, toolchain.kwok_stages) if not p.exists()
        ]
        if missing:
            raise ToolchainError(
                "control-plane binaries not built: missing "
                + ", ".join(map(str, missing))
                + " (run `make build-k8s`, which needs the Go toolchain)"
            )
        return toolchain
