"""The lower pod an upper pod should have, and the upper status a lower pod reports
(pure functions: the pod controller only compares and converges)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubekit import keys
from kubekit.jsonvalue import json_copy
from kubekit.stash import StashError, restore_scheduling
from virtual_node.naming import NamespaceMapping

JSON = dict[str, Any]

# Set by the upper apiserver's admission from the PriorityClass; the lower apiserver
# computes its own and refuses a pod that brings a different one.
_ADMISSION_COMPUTED = ("priority", "preemptionPolicy")
# Never valid on create, or meaningful only to the upper cluster.
_UPPER_ONLY = ("nodeName", "ephemeralContainers", "schedulerName", "schedulingGates")
_STATUS_FIELDS = (
    "phase",
    "conditions",
    "message",
    "reason",
    "podIP",
    "podIPs",
    "startTime",
    "containerStatuses",
    "initContainerStatuses",
    "ephemeralContainerStatuses",
    "resize",
)


@dataclass(frozen=True)
class Ownership:
    """Who the lower objects belong to: this virtual node of this upper cluster."""

    origin: str  # UID of the upper cluster's kube-system namespace
    node_name: str

    def labels(self) -> dict[str, str]:
        return {
            keys.MANAGED_BY_LABEL: keys.MANAGED_BY_VALUE,
            keys.ORIGIN_LABEL: self.origin,
            keys.VIRTUAL_NODE_LABEL: self.node_name,
        }

    def selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.labels().items())

    def owns(self, lower: Mapping[str, Any]) -> bool:
        labels = lower.get("metadata", {}).get("labels") or {}
        return all(labels.get(k) == v for k, v in self.labels().items())


class TranslationError(ValueError):
    """The upper pod cannot be expressed in the lower cluster."""


def is_service_account_token_volume(volume: Mapping[str, Any]) -> bool:
    sources = (volume.get("projected") or {}).get("sources") or []
    return volume.get("name", "").startswith("kube-api-access-") and any(
        "serviceAccountToken" in s for s in sources
    )


def desired_lower_pod(
    upper: Mapping[str, Any], mapping: NamespaceMapping, owner: Ownership
) -> JSON:
    metadata = upper["metadata"]
    annotations = dict(metadata.get("annotations") or {})
    stash = annotations.pop(keys.STASH_ANNOTATION, None)
    try:
        spec = restore_scheduling(upper["spec"], stash)  # a copy of our own from here
    except StashError as error:
        raise TranslationError(f"annotation {keys.STASH_ANNOTATION}: {error}") from error
    for field in (*_UPPER_ONLY, *_ADMISSION_COMPUTED):
        spec.pop(field, None)

    # The upper cluster's token would not authenticate below; the lower apiserver mounts
    # a token of the reflected service account instead.
    token_volumes = {
        v["name"] for v in spec.get("volumes") or [] if is_service_account_token_volume(v)
    }
    if token_volumes:
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] not in token_volumes]
        for kind in ("containers", "initContainers"):
            for container in spec.get(kind) or []:
                mounts = [
                    m for m in container.get("volumeMounts") or [] if m["name"] not in token_volumes
                ]
                if mounts:
                    container["volumeMounts"] = mounts
                else:
                    container.pop("volumeMounts", None)

    spec = _without_virtual_node_terms(spec)

    upper_labels = metadata.get("labels") or {}
    annotations[keys.UPPER_KEYS_ANNOTATION] = json.dumps(
        {"labels": sorted(upper_labels), "annotations": sorted(annotations)},
        separators=(",", ":"),
    )
    annotations[keys.UPPER_UID_ANNOTATION] = metadata["uid"]
    annotations[keys.UPPER_NAMESPACE_ANNOTATION] = metadata["namespace"]
    labels = {**upper_labels, **owner.labels()}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": metadata["name"],
            "namespace": mapping.lower(metadata["namespace"]),
            "labels": labels,
            "annotations": annotations,
        },
        "spec": spec,
    }


def uses_unmodelled_filters(spec: Mapping[str, Any]) -> bool:
    """Volumes bound to zones and claimed devices are not in the fit estimator's model."""
    return bool(spec.get("resourceClaims")) or any(
        "persistentVolumeClaim" in volume or "ephemeral" in volume
        for volume in spec.get("volumes") or []
    )


def pinned_to(lower: JSON, node_name: str) -> JSON:
    """The lower pod required on ``node_name``, the node the estimator held room on: the
    lower scheduler decides by its own scores, and a preference, outweighed by them now
    and then, let it take room promised to a later pod (which then stranded). The field
    is added to every required term, since terms are ORed."""
    pin = {"key": "metadata.name", "operator": "In", "values": [node_name]}
    node_affinity = lower["spec"].setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchFields": [*(term.get("matchFields") or []), pin]} for term in terms
    ]
    return lower


def _without_virtual_node_terms(spec: JSON) -> JSON:
    """Drops what only the upper scheduler could satisfy: the toleration of the virtual
    node's taint and selectors on keys that only virtual nodes carry."""
    upper_only_keys = {keys.CLUSTER_ID_LABEL}
    tolerations = [
        t for t in spec.get("tolerations") or [] if t.get("key") != keys.PROVIDER_TAINT_KEY
    ]
    if tolerations:
        spec["tolerations"] = tolerations
    else:
        spec.pop("tolerations", None)
    selector = {
        k: v for k, v in (spec.get("nodeSelector") or {}).items() if k not in upper_only_keys
    }
    if selector:
        spec["nodeSelector"] = selector
    else:
        spec.pop("nodeSelector", None)
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required:
        terms = []
        for term in required.get("nodeSelectorTerms") or []:
            expressions = [
                e for e in term.get("matchExpressions") or [] if e.get("key") not in upper_only_keys
            ]
            kept = (
                {**term, "matchExpressions": expressions}
                if expressions
                else {k: v for k, v in term.items() if k != "matchExpressions"}
            )
            if kept:
                terms.append(kept)
        node_affinity = spec["affinity"]["nodeAffinity"]
        if terms:
            required["nodeSelectorTerms"] = terms
        else:
            node_affinity.pop("requiredDuringSchedulingIgnoredDuringExecution")
            if not node_affinity:
                spec["affinity"].pop("nodeAffinity")
                if not spec["affinity"]:
                    spec.pop("affinity")
    return spec


def _upper_keys(lower: Mapping[str, Any]) -> dict[str, list[str]]:
    """The label and annotation keys a lower pod got from its upper pod (none when the
    annotation is missing or unreadable: then nothing is removed)."""
    value = (lower["metadata"].get("annotations") or {}).get(keys.UPPER_KEYS_ANNOTATION)
    try:
        decoded = json.loads(value) if value else {}
    except ValueError:
        return {}
    if not isinstance(decoded, dict):
        return {}
    return {
        field: [k for k in decoded.get(field) or [] if isinstance(k, str)]
        for field in ("labels", "annotations")
        if isinstance(decoded.get(field), list)
    }


def ephemeral_containers_patch(upper: Mapping[str, Any], lower: Mapping[str, Any]) -> JSON | None:
    """A strategic merge patch for the lower pod's ephemeralcontainers subresource adding
    the upper pod's ephemeral containers (`kubectl debug`) it lacks, or None. They can only
    be added, never changed or removed, so those already below are left as they are."""
    below = {c["name"] for c in lower["spec"].get("ephemeralContainers") or []}
    missing = [
        dict(c) for c in upper["spec"].get("ephemeralContainers") or [] if c["name"] not in below
    ]
    return {"spec": {"ephemeralContainers": missing}} if missing else None


def lower_pod_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> JSON | None:
    """A strategic merge patch bringing the fields that may change on a running pod
    (labels, annotations, images, activeDeadlineSeconds, tolerations) to the desired
    values, or None when they already match."""
    patch: JSON = {}
    metadata: JSON = {}
    from_above = _upper_keys(current)
    for field in ("labels", "annotations"):
        have = current["metadata"].get(field) or {}
        want = desired["metadata"].get(field) or {}
        change: JSON = {k: v for k, v in want.items() if have.get(k) != v}
        change.update({k: None for k in from_above.get(field, ()) if k in have and k not in want})
        if change:
            metadata[field] = change
    if metadata:
        patch["metadata"] = metadata
    spec: JSON = {}
    for kind in ("containers", "initContainers"):
        have_images = {c["name"]: c.get("image") for c in current["spec"].get(kind) or []}
        changed = [
            {"name": c["name"], "image": c.get("image")}
            for c in desired["spec"].get(kind) or []
            if c["name"] in have_images and have_images[c["name"]] != c.get("image")
        ]
        if changed:
            spec[kind] = changed
    deadline = desired["spec"].get("activeDeadlineSeconds")
    if deadline is not None and deadline != current["spec"].get("activeDeadlineSeconds"):
        spec["activeDeadlineSeconds"] = deadline
    have_tolerations = current["spec"].get("tolerations") or []
    missing = [t for t in desired["spec"].get("tolerations") or [] if t not in have_tolerations]
    if missing:
        # Tolerations may only be added to a running pod; the list is replaced whole.
        spec["tolerations"] = have_tolerations + missing
    if spec:
        patch["spec"] = spec
    return patch or None


def upper_status(lower: Mapping[str, Any], upper: Mapping[str, Any], host_ip: str) -> JSON:
    """The upper pod's status as the lower pod reports it. The host is the virtual node,
    from when a node below has taken the pod (a kubelet sets hostIP when it admits one).
    PodScheduled belongs to the upper scheduler: the lower scheduler's success is no news
    above (and an upper write per pod saved), its failure tells why the pod waits. A pod
    bound by its nodeName has no PodScheduled above; a kubelet reports one with its first
    status, so the lower scheduler's success comes up with the lower kubelet's first
    status rather than in a write of its own."""
    upper_status = upper.get("status") or {}
    status: JSON = {k: json_copy(v) for k, v in upper_status.items() if k not in _STATUS_FIELDS}
    lower_status = lower.get("status") or {}
    for field in _STATUS_FIELDS:
        if field in lower_status:
            status[field] = json_copy(lower_status[field])
    conditions = _with_upper_scheduling(
        status.get("conditions") or [], upper_status.get("conditions") or []
    )
    if conditions:
        status["conditions"] = conditions
    else:
        status.pop("conditions", None)
    if lower_status.get("hostIP"):
        status["hostIP"] = host_ip
        status["hostIPs"] = [{"ip": host_ip}]
    return status


def _with_upper_scheduling(
    lower_conditions: list[JSON], upper_conditions: list[Mapping[str, Any]]
) -> list[JSON]:
    scheduled_above = next((c for c in upper_conditions if c.get("type") == "PodScheduled"), None)
    if scheduled_above is None:
        only_bound_below = all(
            c.get("type") == "PodScheduled" and c.get("status") == "True" for c in lower_conditions
        )
        return [] if only_bound_below else lower_conditions
    conditions = [c for c in lower_conditions if c.get("type") != "PodScheduled"]
    failed_below = [
        c for c in lower_conditions if c.get("type") == "PodScheduled" and c.get("status") != "True"
    ]
    return conditions + (failed_below or [json_copy(dict(scheduled_above))])


def failed_status(upper: Mapping[str, Any], reason: str, message: str) -> JSON:
    status: JSON = json_copy(upper.get("status") or {})
    status.update({"phase": "Failed", "reason": reason, "message": message})
    return status
