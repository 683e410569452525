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
    except FileNotFoundError:
        raise ClusterError(f"no federation in {state_dir} (no {STATE_FILE})") from None
    except ValueError as error:
        raise ClusterError(f"{path} is not a kubestrata state file: {error}") from error
    problem = _state_problem(payload)
    if problem:
        raise ClusterError(
            f"{path} is not a kubestrata state file ({problem}); stop what it started by "
            "hand and remove the directory"
        )
    state: dict[str, dict[str, object]] = payload["clusters"]
    if payload.get(COMPONENTS):
        state = {**state, COMPONENTS: {"processes": payload[COMPONENTS]}}
    return state


def _state_problem(payload: object) -> str:
    """What is wrong with a state file's content, or ""."""
    if not isinstance(payload, dict) or not isinstance(payload.get("clusters"), dict):
        return "no clusters"
    for name, cluster in payload["clusters"].items():
        if not isinstance(cluster, dict) or not isinstance(cluster.get("kubeconfig"), str):
            return f"cluster {name!r} has no kubeconfig"
        if problem := _processes_problem(cluster.get("processes", [])):
            return f"cluster {name!r}: {problem}"
    return _processes_problem(payload.get(COMPONENTS) or [])


def _processes_problem(processes: object) -> str:
    if not isinstance(processes, list) or not all(is_process_record(p) for p in processes):
        return "a process without its name, pid and start time"
    return ""


def is_process_record(raw: object) -> bool:
    """Whether ``raw`` is a recorded process: its name, pid and start time."""
    return (
        isinstance(raw, dict)
        and isinstance(raw.get("name"), str)
        and all(
            isinstance(raw.get(k), int) and not isinstance(raw.get(k), bool)
            for k in ("pid", "start_ticks")
        )
    )


def kubeconfig_path(state_dir: Path, cluster: str = UPPER) -> Path:
    state = read_state(state_dir)
    state.pop(COMPONENTS, None)
    if cluster not in state:
        raise ClusterError(f"no cluster {cluster!r} in {state_dir}; clusters: {', '.join(state)}")
    return Path(str(state[cluster]["kubeconfig"]))
