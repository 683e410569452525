"""The virtual Node and its Lease as the upper cluster should see them (pure)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubekit import keys
from kubekit.serving import host_port
from kubekit.timestamps import now_micro, now_rfc3339
from virtual_node.capacity import node_counts, node_is_usable

JSON = dict[str, Any]

LEASE_DURATION_SECONDS = 40


@dataclass(frozen=True)
class NodeIdentity:
    name: str
    cluster_id: str
    address: str
    kubelet_port: int
    taint: bool = True
    estimator_port: int = 0  # 0: no estimator served
    estimator_started: str = ""

    def annotations(self) -> dict[str, str]:
        if not self.estimator_port:
            return {}
        return {
            keys.ESTIMATOR_ADDRESS_ANNOTATION: host_port(self.address, self.estimator_port),
            keys.ESTIMATOR_STARTED_ANNOTATION: self.estimator_started,
        }


@dataclass(frozen=True)
class NodeReport:
    """What the lower cluster says about itself, from which the Node status is built."""

    ready: bool
    allocatable: Mapping[str, str]
    labels: Mapping[str, str] = field(default_factory=dict)
    kubelet_version: str = ""
    message: str = ""
    nodes_digest: str = ""
    # What the lower quotas cap (quotas.quotas_digest); empty when they are not watched.
    quotas_digest: str = ""
    # The roomiest lower node's name and what it has left; empty without an estimator.
    largest_free_slot: Mapping[str, str] = field(default_factory=dict)


_NOT_SHARED = {keys.HOSTNAME_LABEL, keys.NODE_TYPE_LABEL}
# The kubernetes.io and k8s.io labels a kubelet may set on its own Node (the
# NodeRestriction admission plugin's list); the others there are the cluster admins'.
_KUBELET_LABELS = frozenset(
    {
        "kubernetes.io/hostname",
        "kubernetes.io/os",
        "kubernetes.io/arch",
        "beta.kubernetes.io/os",
        "beta.kubernetes.io/arch",
        "beta.kubernetes.io/instance-type",
        "node.kubernetes.io/instance-type",
        "topology.kubernetes.io/region",
        "topology.kubernetes.io/zone",
        "failure-domain.beta.kubernetes.io/region",
        "failure-domain.beta.kubernetes.io/zone",
    }
)


def _in_domain(prefix: str, domain: str) -> bool:
    return prefix == domain or prefix.endswith("." + domain)


def kubelet_may_set(key: str) -> bool:
    """Whether a kubelet may give its own Node this label. A lower node's label outside
    this (`node-role.kubernetes.io/control-plane`, `node-restriction.kubernetes.io/...`,
    which exists so that only the admins above place workloads by it) is the lower
    admins' word about their node, not the virtual node's to make above; nor is one of
    ours."""
    prefix, slash, _ = key.rpartition("/")
    if not slash:
        return True
    if _in_domain(prefix, "node-restriction.kubernetes.io") or _in_domain(prefix, keys.PREFIX):
        return False
    if key in _KUBELET_LABELS or any(
        _in_domain(prefix, d) for d in ("kubelet.kubernetes.io", "node.kubernetes.io")
    ):
        return True
    return not (_in_domain(prefix, "kubernetes.io") or _in_domain(prefix, "k8s.io"))


def shared_labels(
    lower_nodes: Iterable[Mapping[str, Any]], counted_taint_keys: Collection[str] = ()
) -> dict[str, str]:
    """Labels with one value on every lower node that counts in the capacity (region,
    zone, ...): they hold for the whole cluster, so the virtual node carries them too,
    those a kubelet may set on its Node."""
    shared: dict[str, str] | None = None
    for node in lower_nodes:
        if not node_counts(node, counted_taint_keys):
            continue
        labels = {
            k: v
            for k, v in (node["metadata"].get("labels") or {}).items()
            if k not in _NOT_SHARED and kubelet_may_set(k)
        }
        shared = (
            labels if shared is None else {k: v for k, v in shared.items() if labels.get(k) == v}
        )
    return shared or {}


def nodes_digest(lower_nodes: Iterable[Mapping[str, Any]]) -> str:
    """What the lower nodes offer a pod's node filters, in a few bytes: names, labels,
    taints, cordon and readiness (not usage, which the Node's allocatable shows)."""
    facts = sorted(
        (
            node["metadata"]["name"],
            sorted((node["metadata"].get("labels") or {}).items()),
            sorted(
                (t.get("key", ""), t.get("value", ""), t.get("effect", ""))
                for t in (node.get("spec") or {}).get("taints") or []
            ),
            node_is_usable(node),
        )
        for node in lower_nodes
    )
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


def report_annotations(report: NodeReport) -> dict[str, str | None]:
    """The Node annotations that follow the lower cluster: what its nodes offer the
    filters, what its quotas cap, and its largest free slot. One it no longer gives is
    None, to be written as null: a largest slot left standing would show room that is
    gone (every lower node cordoned, say)."""
    slot = report.largest_free_slot
    return {
        keys.LOWER_NODES_ANNOTATION: report.nodes_digest or None,
        keys.LOWER_QUOTAS_ANNOTATION: report.quotas_digest or None,
        keys.LARGEST_FREE_SLOT_ANNOTATION: (
            json.dumps(dict(slot), sort_keys=True, separators=(",", ":")) if slot else None
        ),
    }


# The labels node_labels always sets: ours whatever the Node holds (federated pods select
# the node-restriction one, the components find virtual Nodes by the virtual-node one;
# the scheduler reads the OS and the architecture).
_IDENTITY_LABELS = frozenset(
    {
        keys.NODE_TYPE_LABEL,
        keys.VIRTUAL_NODE_LABEL,
        keys.PROVEN_VIRTUAL_NODE_LABEL,
        keys.HOSTNAME_LABEL,
        keys.OS_LABEL,
        keys.ARCH_LABEL,
        keys.CLUSTER_ID_LABEL,
    }
)


def labels_of_others(
    wanted: Iterable[str], have: Mapping[str, str], ours: Collection[str]
) -> set[str]:
    """The keys among ``wanted`` that the Node holds and we did not set (a user's zone):
    left with their value. Taken over, the label would count as ours, and go once the
    lower nodes stop sharing it."""
    return {k for k in wanted if k in have and k not in ours and k not in _IDENTITY_LABELS}


def node_labels(identity: NodeIdentity, report: NodeReport) -> dict[str, str]:
    return {
        **report.labels,
        keys.NODE_TYPE_LABEL: keys.NODE_TYPE_VIRTUAL,
        keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
        keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
        keys.HOSTNAME_LABEL: identity.name,
        keys.OS_LABEL: report.labels.get(keys.OS_LABEL, "linux"),
        keys.ARCH_LABEL: report.labels.get(keys.ARCH_LABEL, "amd64"),
        keys.CLUSTER_ID_LABEL: identity.cluster_id,
    }


def provider_taint() -> JSON:
    return {
        "key": keys.PROVIDER_TAINT_KEY,
        "value": keys.PROVIDER_TAINT_VALUE,
        "effect": "NoSchedule",
    }


def not_started_taint() -> JSON:
    return {"key": keys.NOT_STARTED_TAINT_KEY, "effect": "NoSchedule"}


def with_not_started_taint(node: Mapping[str, Any]) -> JSON | None:
    """A merge patch putting the not-started taint on ``node``, or None if it has it;
    conditional on the version read (the taints are one list)."""
    taints = list((node.get("spec") or {}).get("taints") or [])
    if any(t.get("key") == keys.NOT_STARTED_TAINT_KEY for t in taints):
        return None
    return {
        "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
        "spec": {"taints": [*taints, not_started_taint()]},
    }


def keys_record(names: Iterable[str]) -> str:
    """A Node annotation's record of the keys we set (labels, resources)."""
    return json.dumps(sorted(names), separators=(",", ":"))


def _recorded_keys(node: Mapping[str, Any], annotation: str) -> set[str] | None:
    """The keys recorded in ``annotation``; None when there is no readable record."""
    text = (node["metadata"].get("annotations") or {}).get(annotation)
    try:
        recorded = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None
    return {k for k in recorded if isinstance(k, str)} if isinstance(recorded, list) else None


def recorded_label_keys(node: Mapping[str, Any]) -> set[str]:
    """The keys of the labels a former run set on the Node (none when not recorded)."""
    return _recorded_keys(node, keys.NODE_LABEL_KEYS_ANNOTATION) or set()


def labels_to_set(
    existing: Mapping[str, Any], identity: NodeIdentity, report: NodeReport
) -> dict[str, str]:
    """Our labels for an existing Node, less those it holds that a former run did not set
    (``labels_of_others``). A Node of a version that kept no record has its labels
    taken for ours, as that version took them."""
    wanted = node_labels(identity, report)
    have = existing["metadata"].get("labels") or {}
    recorded = _recorded_keys(existing, keys.NODE_LABEL_KEYS_ANNOTATION)
    others = labels_of_others(wanted, have, set(have) if recorded is None else recorded)
    return {k: v for k, v in wanted.items() if k not in others}


def recorded_resource_keys(node: Mapping[str, Any]) -> set[str]:
    """The resources a former run advertised on the Node. Without a record (a version
    that kept none) every resource there: that version took off all it did not report."""
    recorded = _recorded_keys(node, keys.NODE_RESOURCE_KEYS_ANNOTATION)
    if recorded is not None:
        return recorded
    status = node.get("status") or {}
    return set(status.get("capacity") or {}) | set(status.get("allocatable") or {})


def without_foreign_resources(status: Mapping[str, Any], ours: Collection[str]) -> JSON:
    """``status`` with only the resources in ``ours`` left in its capacity and
    allocatable: what we compare our next status with, and patch over. One someone else
    put on the Node (an extended resource an admin advertises) is theirs: compared, it
    would be written as null, or have every status count as a change."""
    return {
        **status,
        **{
            resources: {k: v for k, v in status[resources].items() if k in ours}
            for resources in ("capacity", "allocatable")
            if isinstance(status.get(resources), Mapping)
        },
    }


def registration(identity: NodeIdentity, report: NodeReport, cordoned: bool = False) -> JSON:
    """The Node to create when none exists; ``cordoned``, unschedulable."""
    labels = node_labels(identity, report)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": identity.name,
            "labels": labels,
            "annotations": {
                **identity.annotations(),
                keys.NODE_LABEL_KEYS_ANNOTATION: keys_record(labels),
                keys.NODE_RESOURCE_KEYS_ANNOTATION: keys_record(report.allocatable),
            },
        },
        "spec": {
            "taints": [provider_taint()] if identity.taint else [],
            **({"unschedulable": True} if cordoned else {}),
        },
        "status": node_status(identity, report),
    }


def registration_patch(
    existing: Mapping[str, Any], identity: NodeIdentity, report: NodeReport
) -> JSON | None:
    """A merge patch for an existing Node: our labels and our taint, leaving alone what
    others set (cordon, the node controller's taints, users' labels, even on a key the
    lower nodes share). A label a former run set that the lower nodes no longer share
    goes (they changed while no virtual node ran: left, it held the Node in a zone its
    cluster has left)."""
    want_labels = labels_to_set(existing, identity, report)
    have_labels = existing["metadata"].get("labels") or {}
    patch: JSON = {}
    # No lower node counting (all NotReady a moment, an upgrade) says nothing of the
    # labels: those set before stay, and so does their record; the OS and architecture
    # are defaulted only where the Node has none (an arm64 cluster's Node read amd64).
    keep_labels = not report.labels
    if keep_labels:
        want_labels = {
            k: v
            for k, v in want_labels.items()
            if k not in (keys.OS_LABEL, keys.ARCH_LABEL) or k not in have_labels
        }
    label_change: dict[str, str | None] = {
        k: v for k, v in want_labels.items() if have_labels.get(k) != v
    }
    if not keep_labels:
        label_change.update(
            dict.fromkeys((recorded_label_keys(existing) - set(want_labels)) & set(have_labels))
        )
    if label_change:
        patch["metadata"] = {"labels": label_change}
    have_annotations = existing["metadata"].get("annotations") or {}
    # With the estimator off, a former run's address goes: the multischeduler would
    # dial it (a pod IP maybe reused) and wait out each call instead of failing at once.
    wanted_annotations: dict[str, str | None] = {
        keys.ESTIMATOR_ADDRESS_ANNOTATION: None,
        keys.ESTIMATOR_STARTED_ANNOTATION: None,
        **identity.annotations(),
    }
    recorded = recorded_label_keys(existing) if keep_labels else set()
    wanted_annotations[keys.NODE_LABEL_KEYS_ANNOTATION] = keys_record(recorded | set(want_labels))
    annotation_change = {
        k: v for k, v in wanted_annotations.items() if have_annotations.get(k) != v
    }
    if annotation_change:
        patch.setdefault("metadata", {})["annotations"] = annotation_change
    taints = list((existing.get("spec") or {}).get("taints") or [])
    # Registered again, the process has started: a not-started taint goes.
    kept = [t for t in taints if t.get("key") != keys.NOT_STARTED_TAINT_KEY]
    ours = [t for t in kept if t.get("key") == keys.PROVIDER_TAINT_KEY]
    if identity.taint and ours != [provider_taint()]:
        kept = [t for t in kept if t.get("key") != keys.PROVIDER_TAINT_KEY] + [provider_taint()]
    elif not identity.taint and ours:
        kept = [t for t in kept if t.get("key") != keys.PROVIDER_TAINT_KEY]
    if kept != taints:
        patch["spec"] = {"taints": kept}
    if patch:
        # Optimistic concurrency: fail rather than overwrite a taint set meanwhile.
        patch.setdefault("metadata", {})["resourceVersion"] = existing["metadata"][
            "resourceVersion"
        ]
        return patch
    return None


def _condition(kind: str, healthy: bool, reason: str, message: str, now: str) -> JSON:
    status = "True" if (healthy if kind == "Ready" else not healthy) else "False"
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


def node_status(
    identity: NodeIdentity, report: NodeReport, previous: Mapping[str, Any] | None = None
) -> JSON:
    now = now_rfc3339()
    conditions = [
        _condition(
            "Ready",
            report.ready,
            "KubestrataReady" if report.ready else "LowerClusterUnreachable",
            report.message
            or ("lower cluster reachable" if report.ready else "lower cluster unreachable"),
            now,
        ),
        _condition("MemoryPressure", True, "KubestrataHasSufficientMemory", "", now),
        _condition("DiskPressure", True, "KubestrataHasNoDiskPressure", "", now),
        _condition("PIDPressure", True, "KubestrataHasSufficientPID", "", now),
        _condition("NetworkUnavailable", True, "KubestrataNetworkReady", "", now),
    ]
    # A transition time only moves when the status does.
    before = {c["type"]: c for c in ((previous or {}).get("conditions") or [])}
    for condition in conditions:
        old = before.get(condition["type"])
        if old and old.get("status") == condition["status"] and old.get("lastTransitionTime"):
            condition["lastTransitionTime"] = old["lastTransitionTime"]
    return {
        "capacity": dict(report.allocatable),
        "allocatable": dict(report.allocatable),
        "conditions": conditions,
        # No Hostname: the Node's name resolves nowhere, and an apiserver left with its
        # default --kubelet-preferred-address-types tries a Hostname address first.
        "addresses": [{"type": "InternalIP", "address": identity.address}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": identity.kubelet_port}},
        "nodeInfo": {
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
            "kernelVersion": "",
            "osImage": f"kubestrata lower cluster {identity.cluster_id}",
            "containerRuntimeVersion": "kubestrata://0.1.0",
            "kubeletVersion": report.kubelet_version,
            "kubeProxyVersion": "",
            "operatingSystem": report.labels.get(keys.OS_LABEL, "linux"),
            "architecture": report.labels.get(keys.ARCH_LABEL, "amd64"),
        },
    }


def status_patch(previous: Mapping[str, Any], current: Mapping[str, Any]) -> JSON:
    """``current`` as a strategic merge patch over ``previous``: the patch merges the
    resource maps key by key, so a resource gone from the report (every node cordoned,
    the GPU node removed) is written as null, as the kubelet's own patch writes it
    (``previous`` holds only our resources: ``without_foreign_resources``). The
    addresses merge by type, so changed ones replace the whole list (as the kubelet's
    patch does): a Node written by a version that also gave a ``Hostname`` address would
    keep it, and the apiserver, preferring that type, would dial a name that resolves
    nowhere for every log and exec."""
    patch = dict(current)
    for resources in ("capacity", "allocatable"):
        gone = set(previous.get(resources) or {}) - set(current.get(resources) or {})
        if gone:
            patch[resources] = {**dict.fromkeys(sorted(gone)), **(current.get(resources) or {})}
    addresses = current.get("addresses")
    if addresses is not None and previous.get("addresses", addresses) != addresses:
        patch["addresses"] = [*addresses, {"$patch": "replace"}]
    return patch


def status_changed(previous: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """Whether anything but heartbeat times differs. An empty map is the same as none: the
    apiserver leaves an empty capacity out (no lower node counting), and a status read
    back without it was taken for changed, and patched at every wake-up."""

    def essence(status: Mapping[str, Any]) -> Any:
        conditions = sorted(
            (c.get("type"), c.get("status"), c.get("reason"))
            for c in status.get("conditions") or []
        )
        return (
            status.get("allocatable") or {},
            status.get("capacity") or {},
            conditions,
            status.get("addresses"),
            status.get("daemonEndpoints"),
            status.get("nodeInfo"),
        )

    return bool(essence(previous) != essence(current))


def lease(identity: NodeIdentity, node_uid: str) -> JSON:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": identity.name,
            "namespace": keys.NODE_LEASE_NAMESPACE,
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": identity.name, "uid": node_uid}
            ],
        },
        "spec": {
            "holderIdentity": identity.name,
            "leaseDurationSeconds": LEASE_DURATION_SECONDS,
            "renewTime": now_micro(),
        },
    }
