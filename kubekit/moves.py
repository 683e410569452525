"""Which virtual nodes a controller's pods were moved off, and until when (pure).

The descheduler evicts a controller's pod stuck in a cluster and the controller makes a
replacement for the upper scheduler to place. With the multischeduler, the estimator of
the cluster left turns the replacement away; without it, the upper scheduler sees only
summed capacity and may well bind it to the same virtual node again. So before evicting,
the descheduler records the move in one ConfigMap (keys.MOVES_CONFIGMAP): per controller
UID, a JSON object {virtual node: until, RFC 3339}. The webhook adds to every new pod of
that controller, until then, a required node-affinity expression above (metadata.name
NotIn those nodes); the stash keeps the pod's own affinity for the lower cluster.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

from kubekit import keys
from kubekit.jsonvalue import json_copy
from kubekit.timestamps import parse_time, rfc3339

log = logging.getLogger("moves")

JSON = dict[str, Any]
# controller UID -> {virtual node -> until when its new pods stay off it}
Moves = dict[str, dict[str, datetime]]


def parse_moves(data: Mapping[str, Any]) -> Moves:
    """The records of a ConfigMap's data; an entry that cannot be read is left out with a
    warning (someone edited it by hand), the others still hold."""
    moves: Moves = {}
    for owner, text in data.items():
        try:
            entry = json.loads(text)
            if not isinstance(entry, dict):
                raise ValueError("not a JSON object")
            moves[owner] = {str(node): parse_time(str(until)) for node, until in entry.items()}
        except (TypeError, ValueError) as error:
            log.warning("ConfigMap %s: entry %s left out: %s", keys.MOVES_CONFIGMAP, owner, error)
    return moves


def record_move(moves: Moves, owner: str, node: str, until: datetime, now: datetime) -> JSON:
    """The ConfigMap data with the move recorded and the lapsed entries gone."""
    recorded = {uid: dict(nodes) for uid, nodes in moves.items()}
    recorded.setdefault(owner, {})[node] = until
    return {
        uid: json.dumps({name: rfc3339(when) for name, when in sorted(kept.items())})
        for uid, nodes in sorted(recorded.items())
        if (kept := {name: when for name, when in nodes.items() if when > now})
    }


def controller_reference(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The owner reference of the controller that replaces the pod when it goes, if any."""
    references = (pod.get("metadata") or {}).get("ownerReferences") or []
    return next((ref for ref in references if ref.get("controller")), None)


def is_daemon_pod(pod: Mapping[str, Any]) -> bool:
    """Whether a DaemonSet made the pod for one node, which it pins the pod to by name."""
    controller = controller_reference(pod)
    return controller is not None and controller.get("kind") == "DaemonSet"


def controller_uid(pod: Mapping[str, Any]) -> str | None:
    uid = (controller_reference(pod) or {}).get("uid")
    return str(uid) if uid else None


def kept_off(moves: Moves, pod: Mapping[str, Any], now: datetime) -> list[str]:
    """The virtual nodes a new pod stays off: those its controller's pods were moved off
    and whose record has not lapsed."""
    owner = controller_uid(pod)
    nodes = moves.get(owner, {}) if owner else {}
    return sorted(name for name, until in nodes.items() if until > now)


def kept_off_names(affinity: Mapping[str, Any] | None) -> set[str]:
    """The node names an affinity's required terms exclude one per requirement, as
    ``keep_off`` writes them (or a user, alike)."""
    node_affinity = (affinity or {}).get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    return {
        str(requirement["values"][0])
        for term in required.get("nodeSelectorTerms") or []
        for requirement in (term or {}).get("matchFields") or []
        if requirement.get("key") == "metadata.name"
        and requirement.get("operator") == "NotIn"
        and len(requirement.get("values") or []) == 1
    }


def keep_off(affinity: Mapping[str, Any] | None, nodes: Collection[str]) -> JSON:
    """``affinity`` with every required node-selector term also excluding ``nodes`` by
    name (the terms are ORed, so each gets the requirements; none: one term of them).
    The apiserver takes one value per field requirement, so one requirement per node
    (a term's requirements are ANDed)."""
    kept: JSON = json_copy(dict(affinity or {}))
    requirements = [
        {"key": "metadata.name", "operator": "NotIn", "values": [node]} for node in sorted(nodes)
    ]
    node_affinity = kept.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": []}
    )
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        terms = [{}]
    for term in terms:
        term["matchFields"] = [*(term.get("matchFields") or []), *map(dict, requirements)]
    required["nodeSelectorTerms"] = terms
    return kept
