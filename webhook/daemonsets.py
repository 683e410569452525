"""Which DaemonSets are kept off virtual nodes, and the affinity that keeps them off (pure).

A DaemonSet makes a pod for every node its pods tolerate. Node agents tolerate every taint
(a toleration with no key), so the virtual nodes' too, where an agent has no node of its
own: its pod would run once somewhere in each lower cluster or, asking for the host as
most agents do, wait above for good, and the DaemonSet never be complete. Such a
DaemonSet gets a required node affinity on the key only virtual nodes carry. One that
tolerates the virtual nodes' taint by its key, or selects on that key or on the labels
only virtual nodes carry, means virtual nodes and is left as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubekit import keys
from kubekit.jsonvalue import json_copy
from kubekit.stash import tolerates_every_taint, tolerates_provider_taint

JSON = dict[str, Any]

OFF_VIRTUAL_NODES: JSON = {"key": keys.CLUSTER_ID_LABEL, "operator": "DoesNotExist"}
# Labels every virtual Node carries with these values: a DaemonSet asking for one means
# virtual nodes (an ordinary node may carry the first or the last too, set by its kubelet
# or admins; never the second).
VIRTUAL_NODE_LABELS = {
    keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
    keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
    keys.NODE_TYPE_LABEL: keys.NODE_TYPE_VIRTUAL,
}


def _means_virtual_nodes(expression: Mapping[str, Any]) -> bool:
    """Whether a required expression asks for virtual nodes: one on the cluster-id key
    (but ours keeping off them), or for a virtual nodes' label value."""
    key, operator = expression.get("key"), expression.get("operator")
    if key == keys.CLUSTER_ID_LABEL:
        return dict(expression) != OFF_VIRTUAL_NODES
    wanted = VIRTUAL_NODE_LABELS.get(str(key))
    return wanted is not None and (
        (operator == "In" and wanted in (expression.get("values") or []))
        or (operator == "Exists" and key != keys.NODE_TYPE_LABEL)
    )


def off_virtual_nodes(template_spec: Mapping[str, Any]) -> JSON | None:
    """The affinity of a DaemonSet's pod template with every required term kept off
    virtual nodes, or, for one that means them, without the expression it was given
    when it did not (edited since: kept, no node at all took its pods); None when the
    template is left as it is (it is already as it should be, or its pods never land on
    virtual nodes)."""
    tolerations = template_spec.get("tolerations") or []
    affinity: JSON = json_copy(dict(template_spec.get("affinity") or {}))
    # Each level may be null (the API drops it): set as a mapping, not read as one.
    node_affinity = affinity["nodeAffinity"] = dict(affinity.get("nodeAffinity") or {})
    required = node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = dict(
        node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    )
    terms = required.get("nodeSelectorTerms") or [{}]
    selector = template_spec.get("nodeSelector") or {}
    if (
        any(tolerates_provider_taint(t) for t in tolerations)
        or keys.CLUSTER_ID_LABEL in selector
        or any(selector.get(key) == value for key, value in VIRTUAL_NODE_LABELS.items())
        or any(
            _means_virtual_nodes(expression)
            for term in terms
            for expression in term.get("matchExpressions") or []
        )
    ):
        return _without_ours(affinity, node_affinity, required, terms)
    if not any(tolerates_every_taint(t) for t in tolerations):
        return None
    # Terms are ORed: each one must keep off virtual nodes.
    kept_off = [
        term
        if OFF_VIRTUAL_NODES in (term.get("matchExpressions") or [])
        else {
            **term,
            "matchExpressions": [*(term.get("matchExpressions") or []), dict(OFF_VIRTUAL_NODES)],
        }
        for term in terms
    ]
    if kept_off == terms:
        return None
    required["nodeSelectorTerms"] = kept_off
    return affinity


def _without_ours(
    affinity: JSON, node_affinity: JSON, required: JSON, terms: list[JSON]
) -> JSON | None:
    """The affinity without the expression ``off_virtual_nodes`` adds (None: it has
    none). A term left with no requirement goes (an empty term selects no node), and so
    does what is left empty above it."""
    if not any(OFF_VIRTUAL_NODES in (term.get("matchExpressions") or []) for term in terms):
        return None
    kept = []
    for term in terms:
        expressions = [e for e in term.get("matchExpressions") or [] if e != OFF_VIRTUAL_NODES]
        term = (
            {**term, "matchExpressions": expressions}
            if expressions
            else {k: v for k, v in term.items() if k != "matchExpressions"}
        )
        if term.get("matchExpressions") or term.get("matchFields"):
            kept.append(term)
    if kept:
        required["nodeSelectorTerms"] = kept
    else:
        del node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        if not node_affinity:
            del affinity["nodeAffinity"]
    return affinity
