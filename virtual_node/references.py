"""What a pod needs below besides itself, and the lower copies of those objects (pure)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

from kubekit import keys
from virtual_node.naming import NamespaceMapping
from virtual_node.translate import Ownership, is_service_account_token_volume

JSON = dict[str, Any]
Kind = Literal["configmaps", "secrets", "persistentvolumeclaims"]

# Secrets whose content the lower cluster makes for itself.
_NOT_REFLECTED_SECRET_TYPES = frozenset({"kubernetes.io/service-account-token"})


def _containers(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(kind) or []


def referenced_objects(spec: Mapping[str, Any]) -> set[tuple[Kind, str]]:
    """ConfigMaps, Secrets and PersistentVolumeClaims a pod spec refers to: volumes,
    projected volumes, env, envFrom and imagePullSecrets."""
    refs: set[tuple[Kind, str]] = set()
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
    return {(kind, name) for kind, name in refs if name}


def reflectable(upper: Mapping[str, Any]) -> bool:
    return upper.get("type") not in _NOT_REFLECTED_SECRET_TYPES


def desired_copy(upper: Mapping[str, Any], mapping: NamespaceMapping, owner: Ownership) -> JSON:
    """The lower copy of an upper ConfigMap or Secret."""
    metadata = upper["metadata"]
    copy: JSON = {
        "apiVersion": "v1",
        "kind": upper.get("kind") or "ConfigMap",
        "metadata": {
            "name": metadata["name"],
            "namespace": mapping.lower(metadata["namespace"]),
            "labels": {**(metadata.get("labels") or {}), **owner.labels()},
            "annotations": {
                **(metadata.get("annotations") or {}),
                keys.UPPER_UID_ANNOTATION: metadata["uid"],
                keys.UPPER_NAMESPACE_ANNOTATION: metadata["namespace"],
            },
        },
    }
    for field in ("data", "binaryData", "stringData", "type", "immutable"):
        if field in upper:
            copy[field] = upper[field]
    if "spec" in upper:
        # A claim is bound below, to the lower cluster's own volumes.
        copy["spec"] = {k: v for k, v in upper["spec"].items() if k != "volumeName"}
    return copy


def copy_differs(lower: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    # A claim's spec is fixed once created (only a storage request may grow): what
    # differs there is not brought over.
    fields = ("data", "binaryData", "type", "immutable")
    if any(lower.get(f) != desired.get(f) for f in fields):
        return True
    return any(
        (lower["metadata"].get(part) or {}) != desired["metadata"][part]
        for part in ("labels", "annotations")
    )
