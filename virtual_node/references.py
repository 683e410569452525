"""What a pod needs below besides itself, and the lower copies of those objects (pure)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from fractions import Fraction
from typing import Any, Literal

from kubekit import keys
from kubekit.quantity import QuantityError, parse_quantity
from virtual_node.naming import NamespaceMapping
from virtual_node.translate import Ownership, is_service_account_token_volume

JSON = dict[str, Any]
Kind = Literal[
    "configmaps",
    "secrets",
    "persistentvolumeclaims",
    "serviceaccounts",
    "priorityclasses",
    "services",
    "endpointslices",
]
# Made by every cluster's apiserver or controllers, never copied: the service account
# `default` of each namespace and the PriorityClasses the names `system-` are reserved for.
DEFAULT_SERVICE_ACCOUNT = "default"
_RESERVED_PRIORITY_CLASS_PREFIX = "system-"

# What a namespace holding quota slices in a cluster has there whether pods refer to it or
# not; and what every namespace of every cluster has of its own (never copied).
NAMESPACE_WIDE: frozenset[Kind] = frozenset(
    {"configmaps", "secrets", "serviceaccounts", "services", "persistentvolumeclaims"}
)
_MADE_IN_EVERY_NAMESPACE = frozenset(
    {("serviceaccounts", DEFAULT_SERVICE_ACCOUNT), ("configmaps", "kube-root-ca.crt")}
)

# What the lower tokens controller puts in a token Secret's copy: its own.
_LOWER_TOKEN_FIELDS = ("data", "binaryData")


def _containers(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(kind) or []


# (volume source, its field naming a Secret of the pod's namespace: a reference object
# or, for azureFile, the name itself).
_VOLUME_SECRET_REFS = (
    ("csi", "nodePublishSecretRef"),
    ("cephfs", "secretRef"),
    ("rbd", "secretRef"),
    ("iscsi", "secretRef"),
    ("flexVolume", "secretRef"),
    ("scaleIO", "secretRef"),
    ("storageos", "secretRef"),
    ("azureFile", "secretName"),
)


def referenced_objects(spec: Mapping[str, Any]) -> set[tuple[Kind, str]]:
    """ConfigMaps, Secrets and PersistentVolumeClaims a pod spec refers to (volumes,
    projected volumes, volume drivers' Secrets, env, envFrom and imagePullSecrets), its
    ServiceAccount and its
    PriorityClass (cluster-wide), but for those every cluster makes itself."""
    refs: set[tuple[Kind, str]] = set()
    account = spec.get("serviceAccountName") or DEFAULT_SERVICE_ACCOUNT
    if account != DEFAULT_SERVICE_ACCOUNT:
        refs.add(("serviceaccounts", account))
    priority_class = spec.get("priorityClassName") or ""
    if priority_class and not priority_class.startswith(_RESERVED_PRIORITY_CLASS_PREFIX):
        refs.add(("priorityclasses", priority_class))
    for volume in spec.get("volumes") or []:
        if is_service_account_token_volume(volume):
            continue  # not mirrored: the lower cluster mounts its own token and CA
        if "persistentVolumeClaim" in volume:
            refs.add(("persistentvolumeclaims", volume["persistentVolumeClaim"]["claimName"]))
        if "configMap" in volume:
            refs.add(("configmaps", volume["configMap"]["name"]))
        if "secret" in volume:
            refs.add(("secrets", volume["secret"]["secretName"]))
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "configMap" in source:
                refs.add(("configmaps", source["configMap"]["name"]))
            if "secret" in source:
                refs.add(("secrets", source["secret"]["name"]))
        # The kubelet reads these Secrets for the volume's driver (a CSI inline volume's
        # mount credentials, the in-tree plugins' keys).
        for plugin, field in _VOLUME_SECRET_REFS:
            ref = (volume.get(plugin) or {}).get(field)
            name = ref.get("name") if isinstance(ref, dict) else ref
            if isinstance(name, str):
                refs.add(("secrets", name))
    for container in _containers(spec):
        for env in container.get("env") or []:
            source = env.get("valueFrom") or {}
            if "configMapKeyRef" in source:
                refs.add(("configmaps", source["configMapKeyRef"]["name"]))
            if "secretKeyRef" in source:
                refs.add(("secrets", source["secretKeyRef"]["name"]))
        for env_from in container.get("envFrom") or []:
            if "configMapRef" in env_from:
                refs.add(("configmaps", env_from["configMapRef"]["name"]))
            if "secretRef" in env_from:
                refs.add(("secrets", env_from["secretRef"]["name"]))
    for pull_secret in spec.get("imagePullSecrets") or []:
        if pull_secret.get("name"):
            refs.add(("secrets", pull_secret["name"]))
    # A pod may name the lower cluster's own kube-root-ca.crt (a hand-made copy of the
    # token volume): the lower one is the CA of the apiserver it will talk to.
    return {
        (kind, name) for kind, name in refs if name and (kind, name) not in _MADE_IN_EVERY_NAMESPACE
    }


def service_selector(service: Mapping[str, Any]) -> dict[str, str]:
    """The labels a Service's pods carry; empty for one that picks none (no selector, or
    of type ExternalName)."""
    spec = service.get("spec") or {}
    if spec.get("type") == "ExternalName":
        return {}
    return dict(spec.get("selector") or {})


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a Service selector picks a pod with these labels (an empty one picks none)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def service_of_slice(endpoint_slice: Mapping[str, Any]) -> str:
    return str((endpoint_slice["metadata"].get("labels") or {}).get(keys.SERVICE_NAME_LABEL, ""))


# The upper apiserver's own Service. Copied below into a pod's namespace, it would take
# the place of the lower apiserver's in the pods' KUBERNETES_SERVICE_HOST (the kubelet
# lets a pod's own namespace's `kubernetes` win), and send in-cluster clients, with the
# lower token and CA, to the upper apiserver.
APISERVER_SERVICE = ("services", "default", "kubernetes")


def synced_namespace_wide(kind: Kind, name: str) -> bool:
    """Whether an object is kept below for a namespace holding quota slices there."""
    return kind in NAMESPACE_WIDE and (kind, name) not in _MADE_IN_EVERY_NAMESPACE


def token_account(secret: Mapping[str, Any]) -> str | None:
    """The ServiceAccount a service-account token Secret names; None for other objects.
    Its copy below holds a token of the lower copy of that account, which the lower
    tokens controller puts there (the upper token would not authenticate below)."""
    if secret.get("type") != keys.SERVICE_ACCOUNT_TOKEN_TYPE:
        return None
    annotations = (secret.get("metadata") or {}).get("annotations") or {}
    account = annotations.get(keys.SERVICE_ACCOUNT_NAME_ANNOTATION)
    return account if isinstance(account, str) and account else None


def reflectable(upper: Mapping[str, Any]) -> bool:
    """Whether an object is copied below at all: not a claim a pod controls (a generic
    ephemeral volume's: the lower ephemeral volume controller makes the lower pod's own
    from its template, and a claim of that name it did not make keeps the pod Pending
    for good), nor a claim for a volume made by hand (``storageClassName: ""``, or a
    selector of volumes' labels): below it would bind whichever of the lower cluster's
    volumes it matched, another tenant's data or the lower cluster's own."""
    if not _is_claim(upper):
        return True
    owners = (upper.get("metadata") or {}).get("ownerReferences") or []
    return not (
        any(ref.get("controller") and ref.get("kind") == "Pod" for ref in owners)
        or for_a_volume_made_by_hand(upper)
    )


def for_a_volume_made_by_hand(claim: Mapping[str, Any]) -> bool:
    """Whether a claim asks for a volume someone made by hand, not for one to be made:
    ``storageClassName: ""``, a selector of volumes' labels, or a volume its creator named
    (``volumeName`` that the PersistentVolume controller did not set: it marks the claims
    it binds ``bound-by-controller``, ours included)."""
    spec = claim.get("spec") or {}
    annotations = (claim.get("metadata") or {}).get("annotations") or {}
    return (
        spec.get("storageClassName") == ""
        or bool(spec.get("selector"))
        or (bool(spec.get("volumeName")) and annotations.get(keys.BOUND_BY_CONTROLLER) != "yes")
    )


def copied_from(copy: Mapping[str, Any]) -> str | None:
    """The UID of the upper object a copy was made from."""
    return (copy["metadata"].get("annotations") or {}).get(keys.UPPER_UID_ANNOTATION)


def standing_for(copy: Mapping[str, Any]) -> str | None:
    """The UID of the upper object a copy below serves: the one it was made from, unless
    it is going (a claim's copy its pods still hold), when it serves no new pod."""
    return None if copy["metadata"].get("deletionTimestamp") else copied_from(copy)


def hand_made_refusal(what: str) -> str:
    """Why ``what`` (``claim data``, ``ephemeral volume scratch``) is not had below."""
    return (
        f"{what} asks for a volume made by hand (no storage class, a selector, or a volume "
        "named): the lower cluster's volumes are not the upper cluster's, and its claim "
        "below would bind whichever of them it matched"
    )


def _copy_metadata(
    upper: Mapping[str, Any], mapping: NamespaceMapping, owner: Ownership, **labels: str
) -> JSON:
    metadata = upper["metadata"]
    return {
        "name": metadata["name"],
        "namespace": mapping.lower(metadata["namespace"]),
        "labels": {**(metadata.get("labels") or {}), **labels, **owner.labels()},
        "annotations": {
            **(metadata.get("annotations") or {}),
            keys.UPPER_UID_ANNOTATION: metadata["uid"],
            keys.UPPER_NAMESPACE_ANNOTATION: metadata["namespace"],
        },
    }


# The Service fields that mean the same below; addresses, node ports and load balancers
# are the lower cluster's own. Not `internalTrafficPolicy: Local`: kube-proxy counts an
# endpoint as local by its nodeName, which the reflected endpoints do not carry, so every
# lower node would drop the traffic.
_SERVICE_FIELDS = (
    "sessionAffinity",
    "sessionAffinityConfig",
    "publishNotReadyAddresses",
)


# What desired_service may set, as the apiserver defaults it when it does not.
_SERVICE_DEFAULTS: Mapping[str, Any] = {
    "ports": None,
    "sessionAffinity": "None",
    "sessionAffinityConfig": None,
    "publishNotReadyAddresses": False,
}


def _set(value: Any) -> Any:
    """None for an empty list or object: the apiserver stores an EndpointSlice's empty
    ``endpoints`` as null, and compared as they are, every look at it wrote it again."""
    return None if value == [] or value == {} else value


def desired_service(upper: Mapping[str, Any], mapping: NamespaceMapping, owner: Ownership) -> JSON:
    """The lower Service: no cluster IP (the lower cluster allocates one; headless stays
    headless), type ClusterIP, no node ports, and no selector: its endpoints are the
    upper Service's, in every lower cluster, reflected as EndpointSlices. An
    ExternalName Service stays one: a DNS alias, the same name below."""
    spec = upper.get("spec") or {}
    if spec.get("type") == "ExternalName":
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _copy_metadata(upper, mapping, owner),
            "spec": {"type": "ExternalName", "externalName": spec.get("externalName", "")},
        }
    # Explicit, so that a copy made with Local before is set back.
    lower_spec: JSON = {"type": "ClusterIP", "internalTrafficPolicy": "Cluster"}
    if spec.get("clusterIP") == "None":
        lower_spec["clusterIP"] = "None"
    ports = [{k: v for k, v in port.items() if k != "nodePort"} for port in spec.get("ports") or []]
    if ports:
        lower_spec["ports"] = ports
    lower_spec.update({f: spec[f] for f in _SERVICE_FIELDS if f in spec})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _copy_metadata(upper, mapping, owner),
        "spec": lower_spec,
    }


def desired_endpoint_slice(
    upper: Mapping[str, Any], mapping: NamespaceMapping, owner: Ownership
) -> JSON:
    """The lower copy of an upper EndpointSlice: marked as ours so the lower
    controllers leave it alone, without upper node names and pod UIDs."""
    endpoints = []
    for endpoint in upper.get("endpoints") or []:
        copy = {k: v for k, v in endpoint.items() if k not in ("nodeName", "targetRef")}
        target = endpoint.get("targetRef")
        if target and target.get("kind") == "Pod" and target.get("namespace"):
            copy["targetRef"] = {
                "kind": "Pod",
                "name": target["name"],
                "namespace": mapping.lower(target["namespace"]),
            }
        endpoints.append(copy)
    reflected: JSON = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": _copy_metadata(
            upper, mapping, owner, **{keys.ENDPOINT_SLICE_MANAGED_BY_LABEL: keys.PREFIX}
        ),
        "addressType": upper.get("addressType", "IPv4"),
        "endpoints": endpoints,
    }
    if upper.get("ports") is not None:
        reflected["ports"] = upper["ports"]
    return reflected


def desired_copy(upper: Mapping[str, Any], mapping: NamespaceMapping, owner: Ownership) -> JSON:
    """The lower copy of an upper ConfigMap, Secret or PersistentVolumeClaim; of a token
    Secret, the account it names and nothing the upper tokens controller put there."""
    copy: JSON = {
        "apiVersion": "v1",
        "kind": upper.get("kind") or "ConfigMap",
        "metadata": _copy_metadata(upper, mapping, owner),
    }
    for field in ("data", "binaryData", "stringData", "type", "immutable"):
        if field in upper:
            copy[field] = upper[field]
    if token_account(upper) is not None:
        # Nor immutable: the lower tokens controller could not put its token in.
        for field in (*_LOWER_TOKEN_FIELDS, "stringData", "immutable"):
            copy.pop(field, None)
        metadata = copy["metadata"]
        metadata["annotations"].pop(keys.SERVICE_ACCOUNT_UID_ANNOTATION, None)
        # The upper apiserver's and cleaner's record of the upper token: nothing below.
        for label in (keys.LEGACY_TOKEN_LAST_USED_LABEL, keys.LEGACY_TOKEN_INVALID_SINCE_LABEL):
            metadata["labels"].pop(label, None)
    if "spec" in upper:
        # A claim is bound below, to the lower cluster's own volumes.
        copy["spec"] = {k: v for k, v in upper["spec"].items() if k != "volumeName"}
        copy["metadata"]["annotations"] = _without_binding(copy["metadata"]["annotations"])
    return copy


def _is_claim(obj: Mapping[str, Any]) -> bool:
    return obj.get("kind") == "PersistentVolumeClaim"


def _without_lower_token(annotations: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in annotations.items() if k != keys.SERVICE_ACCOUNT_UID_ANNOTATION}


def _without_binding(annotations: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in annotations.items() if k not in keys.CLAIM_BINDING_ANNOTATIONS}


def desired_service_account(
    upper: Mapping[str, Any], mapping: NamespaceMapping, owner: Ownership
) -> JSON:
    """The lower copy of a ServiceAccount: whether its token is mounted, its pull secrets
    (the lower admission adds them to pods that name none) and the names of its mountable
    Secrets (which `kubernetes.io/enforce-mountable-secrets` holds its pods to below as
    above); its token Secrets are the lower cluster's own."""
    copy: JSON = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _copy_metadata(upper, mapping, owner),
    }
    for field in ("automountServiceAccountToken", "imagePullSecrets"):
        if field in upper:
            copy[field] = upper[field]
    names = [s.get("name") for s in upper.get("secrets") or [] if isinstance(s, dict)]
    if any(names):
        copy["secrets"] = [{"name": name} for name in names if name]
    return copy


def desired_priority_class(
    upper: Mapping[str, Any], _mapping: NamespaceMapping, owner: Ownership
) -> JSON:
    """The lower copy of a PriorityClass, never the lower cluster's default (only pods
    that name it get its priority), and never preempting: the upper scheduler preempts
    above, among the upper cluster's pods, while below a tenant's class would have the
    lower scheduler evict other tenants' pods and the lower cluster's own."""
    metadata = upper["metadata"]
    copy: JSON = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {
            "name": metadata["name"],
            "labels": {**(metadata.get("labels") or {}), **owner.labels()},
            "annotations": {
                **(metadata.get("annotations") or {}),
                keys.UPPER_UID_ANNOTATION: metadata["uid"],
            },
        },
        "value": upper.get("value", 0),
        "preemptionPolicy": "Never",
    }
    if "description" in upper:
        copy["description"] = upper["description"]
    return copy


def _storage_request(claim: Mapping[str, Any]) -> Fraction | None:
    requested = (((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}).get(
        "storage"
    )
    try:
        return parse_quantity(requested) if requested is not None else None
    except QuantityError:
        return None


def _grown(lower: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether the upper claim asks for more storage than its copy (an expansion above)."""
    wanted, have = _storage_request(desired), _storage_request(lower)
    return wanted is not None and have is not None and wanted > have


def copy_differs(lower: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    # A claim's spec is fixed once created but for its storage request, which may grow
    # (an expansion above goes below, where the lower class's driver grows the volume).
    if _is_claim(desired) and _grown(lower, desired):
        return True
    fields: tuple[str, ...] = (
        "data",
        "binaryData",
        "type",
        "immutable",
        "addressType",
        "endpoints",
        "ports",
        "automountServiceAccountToken",
        "imagePullSecrets",
        "secrets",
        "value",
        "preemptionPolicy",
        "description",
    )
    if token_account(desired) is not None:
        fields = tuple(f for f in fields if f not in _LOWER_TOKEN_FIELDS)
    if any(_set(lower.get(f)) != _set(desired.get(f)) for f in fields):
        return True
    if desired.get("kind") == "Service":
        # The lower apiserver fills in defaults (cluster IP, families): only what we set
        # counts, and what we may set left at its default when we do not.
        lower_spec = lower.get("spec") or {}
        if any(lower_spec.get(k) != v for k, v in desired["spec"].items()):
            return True
        if any(
            _set(lower_spec.get(k)) not in (None, default)
            for k, default in _SERVICE_DEFAULTS.items()
            if k not in desired["spec"]
        ):
            return True
    labels: Mapping[str, str] = lower["metadata"].get("labels") or {}
    annotations: Mapping[str, str] = lower["metadata"].get("annotations") or {}
    if _is_claim(desired):
        annotations = _without_binding(annotations)
    if token_account(desired) is not None:
        annotations = _without_lower_token(annotations)
        labels = {k: v for k, v in labels.items() if k != keys.LEGACY_TOKEN_LAST_USED_LABEL}
    wanted = desired["metadata"]
    return bool(labels != wanted["labels"] or annotations != wanted["annotations"])


# What the apiserver refuses to change in an object, by kind (a Secret's type, an
# EndpointSlice's address type, a PriorityClass's value and preemption policy).
_IMMUTABLE_FIELDS = {
    "Secret": (("type", "Opaque"),),
    "EndpointSlice": (("addressType", None),),
    "PriorityClass": (("value", 0), ("preemptionPolicy", "PreemptLowerPriority")),
}


def made_again(lower: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether the copy must be deleted and made again rather than updated: a field the
    apiserver will not change differs, or the copy is an immutable ConfigMap or Secret
    whose data (or immutability) differs, or a Service is to become headless or stop
    being so (its cluster IP cannot change, and an update leaving it out keeps the old
    one: the apiserver fills it in from the stored Service). Any other update refused is
    retried, the copy kept: made again, it would be refused too, and gone meanwhile from
    the pods that use it."""
    kind = desired.get("kind")
    if any(
        lower.get(field, default) != desired.get(field, default)
        for field, default in _IMMUTABLE_FIELDS.get(str(kind), ())
    ):
        return True
    if kind in ("ConfigMap", "Secret") and lower.get("immutable"):
        return any(lower.get(f) != desired.get(f) for f in ("data", "binaryData", "immutable"))
    spec: Mapping[str, Any] = desired.get("spec") or {}
    if kind != "Service" or spec.get("type") == "ExternalName":
        return False
    headless = (lower.get("spec") or {}).get("clusterIP") == "None"
    return bool(headless != (spec.get("clusterIP") == "None"))


def replacement(lower: Mapping[str, Any], desired: Mapping[str, Any]) -> JSON:
    """The body that brings ``lower`` to ``desired`` in one update, keeping what the lower
    cluster owns: the version it is at, of a claim its spec (fixed once created; its
    volume is the lower cluster's) and the annotations that say how it was bound there,
    and of a token Secret the token in it. Replaced with the copy's own spec, a bound
    claim would be refused, and dropping its binding annotations would undo the
    binding's bookkeeping."""
    metadata = {**desired["metadata"], "resourceVersion": lower["metadata"]["resourceVersion"]}
    body = {**desired, "metadata": metadata}
    if token_account(desired) is not None:
        # The lower tokens controller's token, the account's UID it was made for, and
        # the day the lower apiserver last saw the token used (rewritten daily: compared
        # as ours, it would be taken away after every authenticated request). Not the
        # cleaner's mark of an unused token, which would stop one a pod now mounts.
        body.update({f: lower[f] for f in _LOWER_TOKEN_FIELDS if f in lower})
        given = (lower["metadata"].get("annotations") or {}).get(
            keys.SERVICE_ACCOUNT_UID_ANNOTATION
        )
        if given is not None:
            metadata["annotations"] = {
                **metadata["annotations"],
                keys.SERVICE_ACCOUNT_UID_ANNOTATION: given,
            }
        used = (lower["metadata"].get("labels") or {}).get(keys.LEGACY_TOKEN_LAST_USED_LABEL)
        if used is not None:
            metadata["labels"] = {**metadata["labels"], keys.LEGACY_TOKEN_LAST_USED_LABEL: used}
    if _is_claim(desired):
        bound_below = {
            k: v
            for k, v in (lower["metadata"].get("annotations") or {}).items()
            if k in keys.CLAIM_BINDING_ANNOTATIONS
        }
        metadata["annotations"] = {**metadata["annotations"], **bound_below}
        body["spec"] = lower.get("spec") or desired.get("spec") or {}
        if _grown(lower, desired):
            resources = body["spec"].get("resources") or {}
            requests = {**(resources.get("requests") or {})}
            requests["storage"] = desired["spec"]["resources"]["requests"]["storage"]
            body["spec"] = {**body["spec"], "resources": {**resources, "requests": requests}}
    return body
