"""The lower pod an upper pod should have, and the upper status a lower pod reports
(pure functions: the pod controller only compares and converges)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from kubekit import keys
from kubekit.fit import NODE_OPERATORS, requirement
from kubekit.jsonvalue import json_copy
from kubekit.stash import (
    SELECTING_OPERATORS,
    StashError,
    restore_scheduling,
    tolerates_provider_taint,
)
from virtual_node.naming import NamespaceMapping

JSON = dict[str, Any]

# Set by the upper apiserver's admission from the PriorityClass and the RuntimeClass; the
# lower apiserver computes its own from its classes and refuses a pod that brings a
# different one.
_ADMISSION_COMPUTED = ("priority", "preemptionPolicy", "overhead")
# Never valid on create, or meaningful only to the upper cluster (a readiness gate's
# condition is set by a controller above: nobody below would set it).
_UPPER_ONLY = (
    "nodeName",
    "ephemeralContainers",
    "schedulerName",
    "schedulingGates",
    "readinessGates",
)
# The pod condition types a kubelet writes. Any other on the upper pod is a controller's
# above (a readiness gate's, DisruptionTarget) and is kept as it is.
_KUBELET_CONDITIONS = frozenset(
    {
        "PodScheduled",
        "Ready",
        "ContainersReady",
        "Initialized",
        "PodReadyToStartContainers",
        "PodResizePending",
        "PodResizeInProgress",
    }
)
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
    cluster_id: str  # the lower cluster's, which only its virtual node is labelled with

    def labels(self) -> dict[str, str]:
        return {**self.namespace_labels(), keys.VIRTUAL_NODE_LABEL: self.node_name}

    def selector(self) -> str:
        return _selector(self.labels())

    def namespace_labels(self) -> dict[str, str]:
        """A lower namespace is this upper cluster's, not any one virtual node's."""
        return {keys.MANAGED_BY_LABEL: keys.MANAGED_BY_VALUE, keys.ORIGIN_LABEL: self.origin}

    def namespace_selector(self) -> str:
        return _selector(self.namespace_labels())

    def owns(self, lower: Mapping[str, Any]) -> bool:
        return _labelled(lower, self.labels())

    def upper_cluster_owns(self, lower: Mapping[str, Any]) -> bool:
        """Made by a virtual node of this upper cluster, under this node name or an
        earlier one (a namespace, a slice quota: the upper cluster's, not one node's)."""
        return _labelled(lower, self.namespace_labels())


def made_from(lower: Mapping[str, Any], upper: Mapping[str, Any]) -> bool:
    """Whether the lower pod was made from this very upper pod, not from an earlier one
    of its name (nor is another's namesake)."""
    annotations = lower["metadata"].get("annotations") or {}
    return bool(annotations.get(keys.UPPER_UID_ANNOTATION) == upper["metadata"]["uid"])


def _labelled(obj: Mapping[str, Any], wanted: Mapping[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def _selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


class TranslationError(ValueError):
    """The upper pod cannot be expressed in the lower cluster."""


def is_service_account_token_volume(volume: Mapping[str, Any]) -> bool:
    sources = (volume.get("projected") or {}).get("sources") or []
    return volume.get("name", "").startswith("kube-api-access-") and any(
        "serviceAccountToken" in s for s in sources
    )


class StashNotGuarded(TranslationError):
    """A stash on a pod the webhook does not guard; for now, maybe (the namespace's
    labels not seen yet)."""


def desired_lower_pod(
    upper: Mapping[str, Any],
    mapping: NamespaceMapping,
    owner: Ownership,
    stash_unguarded: Callable[[Mapping[str, Any]], str | None] = lambda _pod: None,
) -> JSON:
    """The lower pod for ``upper``. Its stash is restored only when the webhook guards it
    (``stash_unguarded`` of the pod None, else why not: ``stash.unguarded_reason``; asked
    of pods with a stash only): another pod's is what its creator wrote, which would take
    it past what the upper admission held its spec to (a namespace's PodNodeSelector),
    and such a pod is StashNotGuarded, not one made without the fields it may mean (its
    namespace no longer federated)."""
    metadata = upper["metadata"]
    annotations = dict(metadata.get("annotations") or {})
    # Ours to write below, never the pod's: written above, it told of a refusal that
    # never was, and the upper scheduler counted the pod at what it has.
    annotations.pop(keys.RESIZE_REFUSED_ANNOTATION, None)
    stash = annotations.pop(keys.STASH_ANNOTATION, None)
    if stash is not None and (why := stash_unguarded(upper)) is not None:
        raise StashNotGuarded(
            f"annotation {keys.STASH_ANNOTATION} is not read: the webhook does not guard "
            f"this pod ({why}), and anyone may have written it"
        )
    try:
        spec = restore_scheduling(upper["spec"], stash)  # a copy of our own from here
    except StashError as error:
        raise TranslationError(f"annotation {keys.STASH_ANNOTATION}: {error}") from error
    if stash is not None:
        _without_decided_above(spec, upper["spec"])
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
    # Decided above, by the pod or its service account: left unset, the lower admission
    # would ask the lower copy of the account, or the lower cluster's own `default` (never
    # copied), which may decide the other way: a token below for a pod hardened above to
    # have none, or none for a pod whose clients need one.
    spec["automountServiceAccountToken"] = bool(token_volumes)

    spec = _without_virtual_node_terms(
        spec,
        {
            keys.CLUSTER_ID_LABEL: owner.cluster_id,
            keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
            keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
        },
        owner.node_name,
    )
    upper_labels = metadata.get("labels") or {}
    _drop_merged_label_keys(spec, upper_labels)
    _lower_term_namespaces(spec, mapping)
    _own_pods_only(spec, owner.origin)

    annotations[keys.UPPER_KEYS_ANNOTATION] = orjson.dumps(
        {"labels": sorted(upper_labels), "annotations": sorted(annotations)}
    ).decode()
    annotations[keys.UPPER_IMAGES_ANNOTATION] = orjson.dumps(
        _images(spec), option=orjson.OPT_SORT_KEYS
    ).decode()
    annotations[keys.UPPER_RESOURCES_ANNOTATION] = _resources_record(spec)
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


# The capabilities a container may add under the Pod Security Standards' baseline (the
# container runtime's defaults): any other (SYS_ADMIN, SYS_MODULE, ...) reaches the node.
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)


# The SELinux types and sysctls the baseline allows (Pod Security v1.35, that of the
# control planes built here): any other type (spc_t) turns confinement off, and any
# other sysctl is not isolated from the node's other pods.
BASELINE_SELINUX_TYPES = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
BASELINE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
        "net.ipv4.tcp_rmem",
        "net.ipv4.tcp_wmem",
    }
)


def _unconfined(context: Mapping[str, Any], owner: str) -> list[str]:
    """The confinement a pod's or container's securityContext switches off."""
    found = [
        f"{field} Unconfined of {owner}"
        for field in ("seccompProfile", "appArmorProfile")
        if (context.get(field) or {}).get("type") == "Unconfined"
    ]
    selinux = context.get("seLinuxOptions") or {}
    if str(selinux.get("type") or "") not in BASELINE_SELINUX_TYPES:
        found.append(f"SELinux type {selinux['type']} of {owner}")
    found += [f"SELinux {field} of {owner}" for field in ("user", "role") if selinux.get(field)]
    return found


def host_access(spec: Mapping[str, Any]) -> list[str]:
    """What of the lower node's host a pod spec asks for, as the Pod Security Standards'
    baseline sees it: privileged containers, the host's network, PID or IPC namespace,
    hostPath volumes, host ports, added capabilities beyond the baseline's, seccomp or
    AppArmor switched off, SELinux types, users or roles and sysctls beyond the
    baseline's, an unmasked /proc, Windows host processes (empty: none)."""
    found = [f"spec.{field}" for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    found += [
        f"hostPath volume {volume.get('name')!r}"
        for volume in spec.get("volumes") or []
        if "hostPath" in volume
    ]
    pod_context = spec.get("securityContext") or {}
    found += _unconfined(pod_context, "the pod")
    found += [
        f"sysctl {name}"
        for sysctl in pod_context.get("sysctls") or []
        # The API takes either separator: net/ipv4/tcp_syncookies is the same sysctl.
        if (name := str(sysctl.get("name", ""))).replace("/", ".") not in BASELINE_SYSCTLS
    ]
    if (pod_context.get("windowsOptions") or {}).get("hostProcess") is True:
        found.append("a Windows host process pod")
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(kind) or []:
            name = container.get("name")
            context = container.get("securityContext") or {}
            if context.get("privileged") is True:
                found.append(f"privileged container {name!r}")
            found += [
                f"host port {port['hostPort']} of container {name!r}"
                for port in container.get("ports") or []
                if port.get("hostPort")
            ]
            added = (context.get("capabilities") or {}).get("add") or []
            found += [
                f"capability {capability} of container {name!r}"
                for capability in added
                if str(capability).upper().removeprefix("CAP_") not in BASELINE_CAPABILITIES
            ]
            found += _unconfined(context, f"container {name!r}")
            if context.get("procMount") == "Unmasked":
                found.append(f"unmasked /proc of container {name!r}")
            if (context.get("windowsOptions") or {}).get("hostProcess") is True:
                found.append(f"Windows host process container {name!r}")
    return found


def host_access_refusal(
    spec: Mapping[str, Any], namespace: str, allowed: Collection[str], cluster_id: str
) -> str | None:
    """Why the lower cluster does not take a pod of upper ``namespace`` (None: it does). A
    lower cluster runs other tenants' pods too: a pod that would reach into its nodes is
    not created there unless its namespace is ``allowed`` to."""
    asked = host_access(spec)
    if not asked or namespace in allowed:
        return None
    return (
        f"lower cluster {cluster_id} runs no pod that uses its nodes' host "
        f"({'; '.join(asked)}) unless the virtual node allows namespace {namespace} "
        "(--allow-host-access)"
    )


def left_unpinned(spec: Mapping[str, Any]) -> bool:
    """Whether the lower pod goes without the pin to the node the estimator held room on:
    volumes bound to zones and claimed devices are not in the estimator's model, and a
    spread constraint with ``minDomains`` that honours node affinity would count only the
    pinned node's domain (too few: the lower scheduler refused the pod for good)."""
    return (
        bool(spec.get("resourceClaims"))
        or any(
            "persistentVolumeClaim" in volume or "ephemeral" in volume
            for volume in spec.get("volumes") or []
        )
        or any(
            constraint.get("whenUnsatisfiable") == "DoNotSchedule"
            and isinstance(constraint.get("minDomains"), int)
            and constraint["minDomains"] > 1
            and constraint.get("nodeAffinityPolicy", "Honor") != "Ignore"
            for constraint in spec.get("topologySpreadConstraints") or []
        )
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


def pinned_node(lower: Mapping[str, Any]) -> str | None:
    """The node ``pinned_to`` required the lower pod on, or None when it is not pinned."""
    affinity = ((lower.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    terms = (affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get(
        "nodeSelectorTerms"
    ) or []
    pins = {
        field["values"][0]
        for term in terms
        for field in term.get("matchFields") or []
        if field.get("key") == "metadata.name"
        and field.get("operator") == "In"
        and len(field.get("values") or []) == 1
    }
    return next(iter(pins)) if len(pins) == 1 else None


def _own_labels(node_name: str) -> dict[str, str]:
    """Labels of the virtual Node that its lower nodes have other values of, if at all:
    a requirement this virtual node meets on them (virtual-kubelet's usual targeting,
    ``type: virtual-kubelet``; a pin by hostname) is about it, and met. One it does not
    meet may be about lower nodes (``type: gpu``, a lower node's hostname) and is left for
    the lower cluster to judge."""
    return {keys.NODE_TYPE_LABEL: keys.NODE_TYPE_VIRTUAL, keys.HOSTNAME_LABEL: node_name}


def _without_virtual_node_terms(
    spec: JSON, cluster_labels: Mapping[str, str], node_name: str
) -> JSON:
    """Drops what only the upper scheduler could satisfy: the toleration of the virtual
    node's taint (one of another provider's, such as a lower cluster's own virtual nodes
    of a cloud, is the pod's and goes below), and every term about keys that only virtual
    nodes carry (their values on this virtual node are ``cluster_labels``), since no
    lower node has those keys: a spread constraint or a required pod affinity on one
    would never let the pod schedule below. A node term on them, or on this virtual
    node's name (``node_name``, as a DaemonSet pins its pods), is decided here, against
    this virtual node; a node selector or required node affinity it fails is a
    TranslationError, as a kubelet refuses a pod whose node selector its node does not
    match."""
    tolerations = [t for t in spec.get("tolerations") or [] if not tolerates_provider_taint(t)]
    _set_or_drop(spec, "tolerations", tolerations)
    selector = spec.get("nodeSelector") or {}
    mismatched = [k for k in selector if k in cluster_labels and cluster_labels[k] != selector[k]]
    if mismatched:
        raise TranslationError(
            f"nodeSelector {', '.join(f'{k}={selector[k]}' for k in mismatched)} does not"
            f" match this virtual node"
        )
    own = _own_labels(node_name)
    _set_or_drop(
        spec,
        "nodeSelector",
        {
            k: v
            for k, v in selector.items()
            if k not in cluster_labels and not (k in own and own[k] == v)
        },
    )
    spread = [
        c
        for c in spec.get("topologySpreadConstraints") or []
        if c.get("topologyKey") not in cluster_labels
    ]
    _set_or_drop(spec, "topologySpreadConstraints", spread)
    affinity = spec.get("affinity") or {}
    node_affinity = affinity.get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required:
        # An empty term matches no node (the scheduler's rule): left out, rather than taken
        # below for one that only spoke of this cluster and lets every node through.
        terms = [
            _lower_node_term(t, cluster_labels, node_name)
            for t in required.get("nodeSelectorTerms") or []
            if isinstance(t, Mapping) and (t.get("matchExpressions") or t.get("matchFields"))
        ]
        kept = [t for t in terms if t is not None]
        if not kept:
            raise TranslationError("no required node affinity term matches this virtual node")
        # Terms are ORed: one that only spoke of this cluster now lets every node through.
        required = None if any(not t for t in kept) else {**required, "nodeSelectorTerms": kept}
        _set_or_drop(node_affinity, "requiredDuringSchedulingIgnoredDuringExecution", required)
    preferred = []
    for entry in node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []:
        term = _lower_node_term(entry.get("preference") or {}, cluster_labels, node_name)
        if term:
            preferred.append({**entry, "preference": term})
    _set_or_drop(node_affinity, "preferredDuringSchedulingIgnoredDuringExecution", preferred)
    _set_or_drop(affinity, "nodeAffinity", node_affinity)
    for kind in ("podAffinity", "podAntiAffinity"):
        pod_affinity = affinity.get(kind) or {}
        _set_or_drop(
            pod_affinity,
            "requiredDuringSchedulingIgnoredDuringExecution",
            [
                t
                for t in pod_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or []
                if t.get("topologyKey") not in cluster_labels
            ],
        )
        _set_or_drop(
            pod_affinity,
            "preferredDuringSchedulingIgnoredDuringExecution",
            [
                t
                for t in pod_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
                if (t.get("podAffinityTerm") or {}).get("topologyKey") not in cluster_labels
            ],
        )
        _set_or_drop(affinity, kind, pod_affinity)
    _set_or_drop(spec, "affinity", affinity)
    return spec


def _without_decided_above(spec: JSON, upper_spec: Mapping[str, Any]) -> None:
    """Drops from a stashed pod's restored spec what the upper scheduler decided over the
    virtual nodes: its DoNotSchedule spread constraints and required pod affinity terms
    on the keys kept above (a region, a kept zone), which the upper pod still carries. A
    virtual node has such a label only when every node of its cluster shares the value,
    and a node without the label passes neither, so below there is one domain: the
    spread refused every pod past maxSkew when its minDomains was above 1 (fewer
    domains than that count the smallest as 0), and the affinity to a pod that runs in
    another cluster of the region was never met."""
    spread_keys = {
        c.get("topologyKey")
        for c in upper_spec.get("topologySpreadConstraints") or []
        if c.get("whenUnsatisfiable") == "DoNotSchedule"
    }
    kept = [
        c
        for c in spec.get("topologySpreadConstraints") or []
        if not (
            c.get("whenUnsatisfiable") == "DoNotSchedule" and c.get("topologyKey") in spread_keys
        )
    ]
    _set_or_drop(spec, "topologySpreadConstraints", kept)
    field = "requiredDuringSchedulingIgnoredDuringExecution"
    above = ((upper_spec.get("affinity") or {}).get("podAffinity") or {}).get(field) or []
    affinity_keys = {t.get("topologyKey") for t in above}
    pod_affinity = (spec.get("affinity") or {}).get("podAffinity")
    if affinity_keys and pod_affinity:
        terms = [
            t for t in pod_affinity.get(field) or [] if t.get("topologyKey") not in affinity_keys
        ]
        _set_or_drop(pod_affinity, field, terms)
        _set_or_drop(spec["affinity"], "podAffinity", pod_affinity)
        _set_or_drop(spec, "affinity", spec["affinity"])


def _pod_affinity_terms(spec: JSON) -> list[JSON]:
    """Every pod (anti-)affinity term of the spec, required and preferred, to edit."""
    terms: list[JSON] = []
    for kind in ("podAffinity", "podAntiAffinity"):
        pod_affinity = (spec.get("affinity") or {}).get(kind) or {}
        terms += pod_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or []
        terms += [
            t.get("podAffinityTerm") or {}
            for t in pod_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        ]
    return terms


def _lower_term_namespaces(spec: JSON, mapping: NamespaceMapping) -> None:
    """A pod (anti-)affinity term's namespaces named as they are below: under the
    ``prefix`` strategy the pods it means are in ``<prefix>-<namespace>``, and the upper
    names would select another tenant's pods, or the lower cluster's own."""
    for term in _pod_affinity_terms(spec):
        if term.get("namespaces"):
            term["namespaces"] = [mapping.lower(str(name)) for name in term["namespaces"]]


def _own_pods_only(spec: JSON, origin: str) -> None:
    """A pod (anti-)affinity term selects only this upper cluster's pods below, as it
    did above: a lower cluster also runs other tenants' pods and its own, which the
    upper cluster never sees. Left as written, a term over every namespace
    (``namespaceSelector: {}``) kept other tenants' pods off its node (a required
    anti-affinity repels both ways), and past an upper quota that forbids such terms,
    which never sees a stashed one."""
    own = {"key": keys.ORIGIN_LABEL, "operator": "In", "values": [origin]}
    for term in _pod_affinity_terms(spec):
        selector = term.get("labelSelector")
        if isinstance(selector, dict):  # none selects no pod, as it is
            selector["matchExpressions"] = [*(selector.get("matchExpressions") or []), own]


def _drop_merged_label_keys(spec: JSON, labels: Mapping[str, str]) -> None:
    """The upper apiserver merged each ``matchLabelKeys`` key of a spread constraint or pod
    (anti-)affinity term the webhook did not stash (on a cluster-level key) into its
    selector as ``key In [the pod's value]`` (``mismatchLabelKeys``: ``NotIn``) when it
    created the pod; the lower apiserver would merge it again, find the key in both and
    refuse the pod, and its controller would make it again without end. The key goes
    from the list: the selector already says it."""
    terms = [*(spec.get("topologySpreadConstraints") or []), *_pod_affinity_terms(spec)]
    for term in terms:
        expressions = (term.get("labelSelector") or {}).get("matchExpressions") or []
        for field, operator in (("matchLabelKeys", "In"), ("mismatchLabelKeys", "NotIn")):
            merged = {
                key
                for key in term.get(field) or []
                if key in labels
                and {"key": key, "operator": operator, "values": [labels[key]]} in expressions
            }
            if merged:
                _set_or_drop(term, field, [k for k in term[field] if k not in merged])


def _lower_node_term(
    term: Mapping[str, Any], cluster_labels: Mapping[str, str], node_name: str
) -> JSON | None:
    """A node selector term without its expressions on virtual-node-only keys and its
    field requirements naming this virtual node, or None when one of those does not hold
    for this virtual node, or would not parse (the term selects none of its lower nodes).
    Expressions on other keys, and names of other nodes (a lower node's, perhaps), are
    left as they are, for the lower apiserver to judge."""
    kept = []
    own = _own_labels(node_name)
    for expression in term.get("matchExpressions") or []:
        key = expression.get("key")
        if key in own:
            parsed = requirement(expression, NODE_OPERATORS)
            fits = parsed is not None and parsed.accepts(own[key])
            # Only one that picks this virtual node out is met here; one that keeps
            # nodes away and that it meets (``type NotIn [gpu]``) is about the lower
            # nodes too (until 2026-11-29 dropped, and the pod landed on a lower GPU
            # node it had excluded).
            if expression.get("operator") in SELECTING_OPERATORS and fits:
                continue  # about this virtual node, which it fits
            if expression.get("operator") not in SELECTING_OPERATORS and not fits:
                # Keeps this virtual node away (a hostname NotIn naming it, type
                # DoesNotExist; the upper scheduler sees it too): below every lower node
                # met it, and until 2026-11-29 the pod ran where it had excluded.
                return None
        if key not in cluster_labels:
            kept.append(expression)
            continue
        parsed = requirement(expression, NODE_OPERATORS)
        if parsed is None or not parsed.accepts(cluster_labels[key]):
            return None
    kept_fields = []
    for field in term.get("matchFields") or []:
        if field.get("key") != "metadata.name" or node_name not in (field.get("values") or []):
            kept_fields.append(field)
        elif field.get("operator") != "In":
            return None
    lowered = {k: v for k, v in term.items() if k not in ("matchExpressions", "matchFields")}
    if kept:
        lowered["matchExpressions"] = kept
    if kept_fields:
        lowered["matchFields"] = kept_fields
    return lowered


def _set_or_drop(parent: JSON, field: str, value: Any) -> None:
    """The field set to value, or absent when value is empty (as the API defaults it)."""
    if value:
        parent[field] = value
    else:
        parent.pop(field, None)


def _upper_keys(lower: Mapping[str, Any]) -> dict[str, list[str]]:
    """The label and annotation keys a lower pod got from its upper pod (none when the
    annotation is missing or unreadable: then nothing is removed)."""
    value = (lower["metadata"].get("annotations") or {}).get(keys.UPPER_KEYS_ANNOTATION)
    try:
        decoded = orjson.loads(value) if value else {}
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
        _with_lower_token(c, upper, lower)
        for c in upper["spec"].get("ephemeralContainers") or []
        if c["name"] not in below
    ]
    return {"spec": {"ephemeralContainers": missing}} if missing else None


def _with_lower_token(
    container: Mapping[str, Any], upper: Mapping[str, Any], lower: Mapping[str, Any]
) -> JSON:
    """An ephemeral container whose mounts of the upper pod's token volume (`kubectl
    debug --custom` keeping the API access of the pod) name the lower pod's own, made by
    the lower admission under another name (none: the mounts go). As it is, the lower
    apiserver refused it, naming a volume the lower pod lacks."""
    upper_tokens = {
        v["name"] for v in upper["spec"].get("volumes") or [] if is_service_account_token_volume(v)
    }
    lower_token = next(
        (
            v["name"]
            for v in lower["spec"].get("volumes") or []
            if is_service_account_token_volume(v)
        ),
        None,
    )
    copied = json_copy(dict(container))
    mounts = copied.get("volumeMounts") or []
    if not any(m.get("name") in upper_tokens for m in mounts):
        return copied
    kept = [
        m if m.get("name") not in upper_tokens else {**m, "name": lower_token}
        for m in mounts
        if m.get("name") not in upper_tokens or lower_token is not None
    ]
    if kept:
        copied["volumeMounts"] = kept
    else:
        copied.pop("volumeMounts", None)
    return copied


def lower_pod_patch(
    current: Mapping[str, Any], desired: Mapping[str, Any], *, resize_pending: bool = False
) -> JSON | None:
    """A strategic merge patch bringing the fields that may change on a running pod
    (labels, annotations, images, activeDeadlineSeconds, tolerations) to the desired
    values, or None when they already match. The record of the resources above is
    brought up to date too (its write failed after a resize, or a resize above went back
    to what the pod has), unless a resize is to be made first (``resize_patch``: then it
    is recorded once made, ``resources_record_patch``)."""
    spec: JSON = {}
    # An image changes below when it changed above, not when it differs from the one the
    # pod runs: a lower webhook may have rewritten that (to a registry mirror) at creation,
    # and setting it back would restart the container with an image the cluster may not
    # pull. Pods made before the images were recorded are compared as they run.
    recorded = (current["metadata"].get("annotations") or {}).get(keys.UPPER_IMAGES_ANNOTATION)
    # Most syncs find the images above as recorded: nothing to decode then.
    if recorded != desired["metadata"]["annotations"].get(keys.UPPER_IMAGES_ANNOTATION):
        given = _recorded(current, keys.UPPER_IMAGES_ANNOTATION) or _images(current["spec"])
        for kind in ("containers", "initContainers"):
            running = {c["name"] for c in current["spec"].get(kind) or []}
            changed = [
                {"name": c["name"], "image": c.get("image")}
                for c in desired["spec"].get(kind) or []
                if c["name"] in running and given.get(c["name"]) != c.get("image")
            ]
            if changed:
                spec[kind] = changed
    deadline = desired["spec"].get("activeDeadlineSeconds")
    if deadline is not None and deadline != current["spec"].get("activeDeadlineSeconds"):
        spec["activeDeadlineSeconds"] = deadline
    tolerations = updated_tolerations(
        current["spec"].get("tolerations") or [], desired["spec"].get("tolerations") or []
    )
    if tolerations is not None:
        spec["tolerations"] = tolerations
    patch: JSON = {}
    metadata: JSON = {}
    from_above = _upper_keys(current)
    refused = refused_resources(current)
    for field in ("labels", "annotations"):
        have = current["metadata"].get(field) or {}
        want = dict(desired["metadata"].get(field) or {})
        if field == "annotations" and not any(
            kind in spec for kind in ("containers", "initContainers")
        ):
            # Recorded with the images it records, not written to a pod on its own.
            want.pop(keys.UPPER_IMAGES_ANNOTATION, None)
        asked = want.get(keys.UPPER_RESOURCES_ANNOTATION)
        if field == "annotations" and (
            resize_pending or keys.UPPER_RESOURCES_ANNOTATION not in have or asked == refused
        ):
            # Made before resources were recorded: compared as it runs, nothing written.
            # Refused for good: the record keeps what the pod was last given.
            want.pop(keys.UPPER_RESOURCES_ANNOTATION, None)
        change: JSON = {k: v for k, v in want.items() if have.get(k) != v}
        change.update({k: None for k in from_above.get(field, ()) if k in have and k not in want})
        if field == "annotations" and keys.RESIZE_REFUSED_ANNOTATION in have and asked != refused:
            # The upper pod no longer asks for what was refused: asked again, it is tried.
            change[keys.RESIZE_REFUSED_ANNOTATION] = None
        if change:
            metadata[field] = change
    if metadata:
        patch["metadata"] = metadata
    if spec:
        patch["spec"] = spec
    return patch or None


def _images(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {
        c["name"]: c.get("image")
        for kind in ("initContainers", "containers")
        for c in spec.get(kind) or []
    }


def _resources_record(spec: Mapping[str, Any]) -> str:
    resources = {
        c["name"]: c.get("resources") or {}
        for kind in ("initContainers", "containers")
        for c in spec.get(kind) or []
    }
    return orjson.dumps(resources, option=orjson.OPT_SORT_KEYS).decode()


def resources_record_patch(desired: Mapping[str, Any], refusal: str | None) -> JSON:
    """The patch recording on the lower pod the resources the upper pod gives it now,
    once a resize asked for them was made; or, refused for good (``refusal``: why), the
    refusal with the resources it refused, the record kept as the pod was last given: a
    later resize compares with what the pod has, not with what it was refused."""
    record = desired["metadata"]["annotations"][keys.UPPER_RESOURCES_ANNOTATION]
    annotations: dict[str, str | None] = (
        {keys.UPPER_RESOURCES_ANNOTATION: record, keys.RESIZE_REFUSED_ANNOTATION: None}
        if refusal is None
        else {
            keys.RESIZE_REFUSED_ANNOTATION: orjson.dumps(
                {"message": refusal, "resources": record}
            ).decode()
        }
    )
    return {"metadata": {"annotations": annotations}}


def _refusal(lower: Mapping[str, Any]) -> tuple[str, str] | None:
    """The message and the resources record of the resize refused for good, if any."""
    refused = _recorded(lower, keys.RESIZE_REFUSED_ANNOTATION)
    if refused is None:
        return None
    message, resources = refused.get("message"), refused.get("resources")
    if not isinstance(message, str) or not isinstance(resources, str):
        return None
    return message, resources


def refused_resources(lower: Mapping[str, Any]) -> str | None:
    refusal = _refusal(lower)
    return None if refusal is None else refusal[1]


def with_resize_refusal(
    status: JSON,
    lower: Mapping[str, Any],
    desired: Mapping[str, Any],
    upper: Mapping[str, Any],
    deferred: str | None,
    now: str,
) -> JSON:
    """``status`` with the PodResizePending a kubelet writes for a resize it cannot make,
    where the lower apiserver refused the resize before any lower kubelet saw it:
    ``Deferred`` for one refused for now (``deferred``: why; a quota full today),
    ``Infeasible`` for one refused for good, while the upper pod still asks for those
    resources. Without it the upper pod waited with no word, and the upper scheduler
    counted the requests asked for rather than those the pod has."""
    refused = _refusal(lower)
    if deferred is not None:
        reason, message = "Deferred", deferred
    elif refused is not None and refused[1] == (
        desired["metadata"]["annotations"].get(keys.UPPER_RESOURCES_ANNOTATION)
    ):
        reason, message = "Infeasible", refused[0]
    else:
        return status
    before: Mapping[str, Any] = next(
        (
            c
            for c in (upper.get("status") or {}).get("conditions") or []
            if c.get("type") == "PodResizePending"
        ),
        {},
    )
    # The generation the rest of the status observes: the refusal is news of it.
    generation = status.get("observedGeneration")
    pending = {
        "type": "PodResizePending",
        "status": "True",
        "reason": reason,
        "message": message,
        **({"observedGeneration": generation} if isinstance(generation, int) else {}),
        "lastProbeTime": None,
        "lastTransitionTime": before.get("lastTransitionTime")
        if before.get("status") == "True" and before.get("reason") == reason
        else now,
    }
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodResizePending"]
    return {**status, "conditions": [*conditions, pending]}


def _but_seconds(toleration: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in toleration.items() if k != "tolerationSeconds"}


def updated_tolerations(
    have: Sequence[Mapping[str, Any]], want: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]] | None:
    """The running lower pod's tolerations brought to the upper pod's, as the API lets
    them change (the list is replaced whole): each one kept, with the ``tolerationSeconds``
    the upper pod now gives it, and the upper pod's new ones added; None when nothing
    changes. Those only below (added by a lower admission plugin) stay: none may go."""
    taken: set[int] = set()
    matched: dict[int, int] = {}
    for same in (lambda a, b: a == b, lambda a, b: _but_seconds(a) == _but_seconds(b)):
        for index, toleration in enumerate(have):
            if index in matched:
                continue
            found = next(
                (i for i, w in enumerate(want) if i not in taken and same(w, toleration)), None
            )
            if found is not None:
                matched[index] = found
                taken.add(found)
    result = [want[matched[i]] if i in matched else t for i, t in enumerate(have)]
    result += [w for i, w in enumerate(want) if i not in taken]
    return None if result == list(have) else result


def _recorded(lower: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    value = ((lower.get("metadata") or {}).get("annotations") or {}).get(key)
    try:
        recorded = orjson.loads(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return recorded if isinstance(recorded, dict) else None


def resize_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> JSON | None:
    """A strategic merge patch for the lower pod's resize subresource bringing the
    requests and limits of its containers and sidecars to the desired ones (an in-place
    resize above, `kubectl patch --subresource resize`), or None when they match. The
    upper apiserver has judged the resize already (QoS class kept, only what may change);
    the lower kubelet carries it out and reports it in the container statuses and
    conditions that come up with the lower pod's status. A container whose resources
    above are as recorded on the lower pod (``keys.UPPER_RESOURCES_ANNOTATION``) is not
    resized: a lower admission webhook may have changed them when the pod was made (a
    minimum, a ratio), and setting them back would undo its policy, or be refused on
    every sync. Pods made before the record are compared as they run."""
    # Most syncs find the resources above as recorded: nothing to decode or compare then.
    record = ((current.get("metadata") or {}).get("annotations") or {}).get(
        keys.UPPER_RESOURCES_ANNOTATION
    )
    wanted = ((desired.get("metadata") or {}).get("annotations") or {}).get(
        keys.UPPER_RESOURCES_ANNOTATION
    )
    if record is not None and record == wanted:
        return None
    if wanted is not None and wanted == refused_resources(current):
        return None  # refused for good: not asked again until the upper pod asks otherwise
    recorded = _recorded(current, keys.UPPER_RESOURCES_ANNOTATION)
    spec: JSON = {}
    for kind in ("containers", "initContainers"):
        have = {c["name"]: c.get("resources") or {} for c in current["spec"].get(kind) or []}
        changed = []
        for container in desired["spec"].get(kind) or []:
            if kind == "initContainers" and container.get("restartPolicy") != "Always":
                continue  # runs to completion before the others: nothing to resize
            name = container["name"]
            if name not in have:
                continue
            want = container.get("resources") or {}
            if recorded is not None and recorded.get(name) == want:
                continue
            parts: JSON = {}
            for part in ("requests", "limits"):
                below = have[name].get(part) or {}
                # Only values set above: a resize never removes one, and a default the
                # lower cluster's LimitRange added is its own.
                change = {k: v for k, v in (want.get(part) or {}).items() if below.get(k) != v}
                if change:
                    parts[part] = change
            if parts:
                changed.append({"name": name, "resources": parts})
        if changed:
            spec[kind] = changed
    return {"spec": spec} if spec else None


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
    _keep_terminal_phase(status, upper_status)
    _of_upper_containers(status, upper.get("spec") or {})
    upper_conditions = upper_status.get("conditions") or []
    gates = [g["conditionType"] for g in upper.get("spec", {}).get("readinessGates") or []]
    conditions = _with_upper_scheduling(status.get("conditions") or [], upper_conditions)
    conditions = _with_upper_owned(conditions, upper_conditions, gates)
    if conditions:
        status["conditions"] = conditions
    else:
        status.pop("conditions", None)
    if lower_status.get("hostIP"):
        status["hostIP"] = host_ip
        status["hostIPs"] = [{"ip": host_ip}]
    _observe_generation(status, lower, upper)
    return status


def _keep_terminal_phase(status: JSON, upper_status: Mapping[str, Any]) -> None:
    """A pod never leaves Succeeded or Failed, as a kubelet forces the phase the apiserver
    has (the apiserver does not refuse the change): the virtual node's Failed for a bare
    pod deleted below went back to Succeeded when the lower pod, still stopping, said so.
    Its reason and message go with it unless the lower pod, in that phase, has its own."""
    phase = upper_status.get("phase")
    if phase not in ("Succeeded", "Failed"):
        return
    if status.get("phase") == phase and status.get("reason"):
        return
    for field in ("phase", "reason", "message"):
        if field in upper_status:
            status[field] = upper_status[field]
        else:
            status.pop(field, None)


# Each kind of container, and its statuses' field.
_CONTAINER_STATUSES = (
    ("containers", "containerStatuses"),
    ("initContainers", "initContainerStatuses"),
    ("ephemeralContainers", "ephemeralContainerStatuses"),
)


def _of_upper_containers(status: JSON, upper_spec: Mapping[str, Any]) -> None:
    """The statuses of the upper pod's own containers only, each with the mounts of its
    container above: a lower mutating webhook (a service mesh's) adds containers below,
    whose statuses read as the pod's (READY 2/1, their restarts, exit codes a Job's
    failure policy matches), and the lower service-account token volume has a name of its
    own. A kubelet reports one status per container of the spec, its mounts the spec's.
    An empty list is left out, as the apiserver stores it: kept, the status written would
    never equal the status read back, and be written again at every reconcile."""
    for containers, field in _CONTAINER_STATUSES:
        if field not in status:
            continue
        declared = {c.get("name"): c for c in upper_spec.get(containers) or []}
        _set_or_drop(
            status,
            field,
            [
                _with_upper_mounts(container_status, declared[container_status.get("name")])
                for container_status in status[field] or []
                if container_status.get("name") in declared
            ],
        )


def _with_upper_mounts(container_status: JSON, container: Mapping[str, Any]) -> JSON:
    if "volumeMounts" not in container_status:
        return container_status
    above = {m.get("mountPath"): m for m in container.get("volumeMounts") or []}
    _set_or_drop(
        container_status,
        "volumeMounts",
        [
            {**mount, "name": above[mount.get("mountPath")].get("name")}
            for mount in container_status["volumeMounts"] or []
            if mount.get("mountPath") in above
        ],
    )
    return container_status


def _observe_generation(status: JSON, lower: Mapping[str, Any], upper: Mapping[str, Any]) -> None:
    """The upper pod's generation as observed, as a 1.35 kubelet reports it for the pod and
    its own conditions: once the lower kubelet has observed the lower pod's (the upper
    pod's changes are below by then), or at once below a kubelet that does not report it;
    until then the one observed before. The lower generations count the lower pod's
    changes: none of them goes up."""
    generation = (upper.get("metadata") or {}).get("generation")
    lower_generation = (lower.get("metadata") or {}).get("generation")
    seen_below = (lower.get("status") or {}).get("observedGeneration")
    caught_up = seen_below is None or (
        isinstance(seen_below, int)
        and isinstance(lower_generation, int)
        and seen_below >= lower_generation
    )
    before = (upper.get("status") or {}).get("observedGeneration")
    observed = generation if caught_up and isinstance(generation, int) else before
    if isinstance(observed, int) and isinstance(before, int):
        observed = max(observed, before)  # never goes back, as a kubelet's
    if observed is None:
        status.pop("observedGeneration", None)
    else:
        status["observedGeneration"] = observed
    for condition in status.get("conditions") or []:
        if condition.get("type") in _KUBELET_CONDITIONS and "observedGeneration" in condition:
            if observed is None:
                del condition["observedGeneration"]
            else:
                condition["observedGeneration"] = observed


def without_observed_generation(status: Mapping[str, Any]) -> JSON:
    """A status with its observed generations left out, its conditions' too (pure)."""
    stripped: JSON = {k: v for k, v in status.items() if k != "observedGeneration"}
    if "conditions" in stripped:
        stripped["conditions"] = [
            {k: v for k, v in c.items() if k != "observedGeneration"}
            for c in stripped["conditions"] or []
        ]
    return stripped


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
    scheduled_below = [c for c in lower_conditions if c.get("type") == "PodScheduled"]
    failed_below = [c for c in scheduled_below if c.get("status") != "True"]
    if failed_below:
        return conditions + failed_below
    if scheduled_above.get("status") != "True" and scheduled_below:
        # A bound pod's False above is ours (the binding made it True): a failure below or a
        # refusal, now over.
        return conditions + scheduled_below
    return [*conditions, json_copy(dict(scheduled_above))]


def _with_upper_owned(
    conditions: list[JSON], upper_conditions: list[Mapping[str, Any]], gates: list[str]
) -> list[JSON]:
    """The lower pod's conditions, with those of the upper pod that no kubelet writes (its
    readiness gates' above all) kept, and Ready as a kubelet judges it from the gates:
    containers ready below and every gate's condition True above."""
    owned_above = [
        json_copy(dict(c))
        for c in upper_conditions
        if c.get("type") not in _KUBELET_CONDITIONS
        and (c.get("type") in gates or not any(d.get("type") == c.get("type") for d in conditions))
    ]
    kept = {c["type"] for c in owned_above}
    merged = [c for c in conditions if c.get("type") not in kept and c.get("type") not in gates]
    merged += owned_above
    if gates:
        merged = [_gated_ready(c, gates, owned_above, upper_conditions) for c in merged]
    return merged


def _gated_ready(
    condition: JSON,
    gates: list[str],
    owned_above: list[JSON],
    upper_conditions: list[Mapping[str, Any]],
) -> JSON:
    if condition.get("type") != "Ready" or condition.get("status") != "True":
        return condition  # not ready below: the containers' reason stands, as a kubelet's
    by_type = {c["type"]: c for c in owned_above}
    unready = []
    # When the containers were ready below and each gate that is not ready above last
    # changed: the later is when the pod became not ready, if it was ready before.
    changed = [condition.get("lastTransitionTime") or ""]
    for gate in gates:
        gate_condition = by_type.get(gate)
        if gate_condition is None:
            unready.append(
                f'corresponding condition of pod readiness gate "{gate}" does not exist.'
            )
        elif gate_condition.get("status") != "True":
            unready.append(
                f'the status of pod readiness gate "{gate}" is not "True", but '
                f"{gate_condition.get('status')}"
            )
            changed.append(gate_condition.get("lastTransitionTime") or "")
    if not unready:
        # Ready since the last of the containers below and the gates above was.
        since = max(
            [condition.get("lastTransitionTime") or ""]
            + [by_type[g].get("lastTransitionTime") or "" for g in gates]
        )
        return {**condition, "lastTransitionTime": since} if since else condition
    was = next((c for c in upper_conditions if c.get("type") == "Ready"), None)
    since = (
        was.get("lastTransitionTime")
        if was is not None and was.get("status") == "False"
        else max(changed) or None
    )
    return {
        "type": "Ready",
        "status": "False",
        "lastProbeTime": None,
        "lastTransitionTime": since,
        "reason": "ReadinessGatesNotReady",
        "message": ", ".join(unready),
        **{k: condition[k] for k in ("observedGeneration",) if k in condition},
    }


def refused_status(upper: Mapping[str, Any], reason: str, message: str, now: str) -> JSON:
    """The upper pod's status while its lower cluster refuses it for now (a quota or an
    admission webhook below): PodScheduled False saying why, as the lower scheduler's
    failure is reported, so `kubectl describe` shows it and the descheduler moves a pod
    that waits so for long. Its transition time is kept while the pod stays refused."""
    status: JSON = json_copy(upper.get("status") or {})
    conditions = status.get("conditions") or []
    before = next((c for c in conditions if c.get("type") == "PodScheduled"), None)
    since = before.get("lastTransitionTime") if before and before.get("status") == "False" else None
    refused = {
        "type": "PodScheduled",
        "status": "False",
        "lastProbeTime": None,
        "lastTransitionTime": since or now,
        "reason": reason,
        "message": message,
    }
    status["conditions"] = [c for c in conditions if c.get("type") != "PodScheduled"] + [refused]
    return status


def deletion_due(lower: Mapping[str, Any], grace: int | None) -> bool:
    """Whether the lower pod is to be deleted (again) for an upper deletion with this
    grace: not being deleted yet, or with a longer grace than the upper pod has now (a
    second `kubectl delete --grace-period` shortens it, `--force` makes it 0, as a
    kubelet honours)."""
    metadata = lower["metadata"]
    if not metadata.get("deletionTimestamp"):
        return True
    current = metadata.get("deletionGracePeriodSeconds")
    return grace is not None and isinstance(current, int) and grace < current


_UNKNOWN_END = {
    "reason": "ContainerStatusUnknown",
    "message": "The container could not be located when the pod was terminated",
    "exitCode": 137,
}


def terminated_status(upper: Mapping[str, Any], now: str) -> JSON:
    """The upper pod's last status once its lower copy is gone for its deletion: what a
    kubelet writes before it lets a deleted pod go (its status manager's TerminatePod),
    which the Job controller waits for before it removes its finalizer. A container whose
    end was not seen is terminated with an unknown status (exit 137), and a pod not in a
    terminal phase yet is Failed, never Succeeded on a guess."""
    status: JSON = json_copy(upper.get("status") or {})
    if status.get("phase") in ("Succeeded", "Failed"):
        return status
    inits, regulars = (
        status.get("initContainerStatuses") or [],
        status.get("containerStatuses") or [],
    )
    # As the kubelet: init containers never started stay waiting, and so do the others
    # until the pod has initialized.
    ending = [c for c in inits if _started(c)]
    if _initialized(upper, inits, regulars):
        ending += regulars
    for container in ending:
        if "terminated" not in (container.get("state") or {}):
            container["state"] = {"terminated": {**_UNKNOWN_END, "finishedAt": now}}
            container["ready"] = False
            container["started"] = False
    status["phase"] = "Failed"
    conditions = []
    for condition in status.get("conditions") or []:
        if condition.get("type") in ("Ready", "ContainersReady"):
            changed = condition.get("status") != "False"
            condition = {
                **condition,
                "status": "False",
                "reason": "PodFailed",
                "lastTransitionTime": now if changed else condition.get("lastTransitionTime"),
            }
            condition.pop("message", None)
        conditions.append(condition)
    if conditions:
        status["conditions"] = conditions
    return status


def _started(container: Mapping[str, Any]) -> bool:
    return "waiting" not in (container.get("state") or {})


def _initialized(pod: Mapping[str, Any], inits: list[JSON], regulars: list[JSON]) -> bool:
    """The kubelet's hasPodInitialized: no init containers, a regular container started
    once, or the last init container with a status done, or, a sidecar
    (``restartPolicy: Always``), running and started."""
    specs = (pod.get("spec") or {}).get("initContainers") or []
    if not specs:
        return True
    if any(_started(c) or "terminated" in (c.get("lastState") or {}) for c in regulars):
        return True
    if not inits:
        return False
    state = inits[-1].get("state") or {}
    sidecar = len(inits) <= len(specs) and specs[len(inits) - 1].get("restartPolicy") == "Always"
    if sidecar and "running" in state and inits[-1].get("started") is True:
        return True
    last = state.get("terminated") or {}
    return bool(last) and last.get("exitCode") == 0


def failed_status(upper: Mapping[str, Any], reason: str, message: str, now: str) -> JSON:
    """Failed for ``reason``: its containers ended and the pod not ready, as a kubelet
    leaves a pod it fails (a pod lost below showed Ready, and counted as healthy)."""
    status = terminated_status(upper, now)
    status.update({"phase": "Failed", "reason": reason, "message": message})
    return status
