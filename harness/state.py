"""Where a local federation keeps its state and how to read it: light enough for the
commands that only read it (`kubestrata kubeconfig`, `status`) to start fast."""

from __future__ import annotations

import json
import os
from pathlib import Path

STATE_FILE = "federation.json"
UPPER = "upper"
# The pseudo-cluster the kubestrata components started beside the clusters appear as.
COMPONENTS = "components"


class ClusterError(RuntimeError):
    """A local cluster could not be started or did not become ready."""


def default_state_dir() -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
    return base / "kubestrata" / "federation"


def read_state(state_dir: Path) -> dict[str, dict[str, object]]:
    """The clusters of a state file; the kubestrata components started beside them
    appear as the pseudo-cluster COMPONENTS."""
    path = state_dir / STATE_FILE
    try:
        payload = json.loads(path.read_text())
        state: dict[str, dict[str, object]] = payload["clusters"]
        if payload.get("components"):
            state = {**state, COMPONENTS: {"processes": payload["components"]}}
    except FileNotFoundError:
        raise ClusterError(f"no federation in {state_dir} (no {STATE_FILE})") from None
    except (ValueError, KeyError) as error:
        raise ClusterError(f"{path} is not a kubestrata state file: {error}") from error
    return state


def kubeconfig_path(state_dir: Path, cluster: str = UPPER) -> Path:
    state = read_state(state_dir)
    state.pop(COMPONENTS, None)
    if cluster not in state:
        raise ClusterError(f"no cluster {cluster!r} in {state_dir}; clusters: {', '.join(state)}")
    return Path(str(state[cluster]["kubeconfig"]))
