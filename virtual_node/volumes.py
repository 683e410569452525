"""Upper volumes for claims that wait for their first consumer.

A claim of a WaitForFirstConsumer class is bound above only once the upper scheduler has
chosen its pod's node: it names the node on the claim and waits, in the pod's binding,
for a volume. The lower cluster makes the real volume, but only once the pod is below,
which needs the binding first. So for a claim of a class whose provisioner is
`kubestrata.io/lower-cluster` and whose chosen node is this virtual node, the virtual
node acts as that provisioner above: it makes an upper PersistentVolume bound to the
claim, standing for the lower cluster's (whose claim, a copy of the upper one, binds
below with the pod). The volume's node affinity names this virtual node, so the upper
scheduler sends every later pod of the claim back to the cluster holding its data. The
volume goes when its claim does.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from kubekit import keys
from kubekit.client import PERSISTENTVOLUMES, STORAGECLASSES, ApiError, KubeClient, is_not_found
from kubekit.informer import FunctionHandler, Informer, object_key
from kubekit.workqueue import WorkQueue
from virtual_node.references import for_a_volume_made_by_hand, hand_made_refusal
from virtual_node.translate import Ownership

log = logging.getLogger(__name__)

JSON = dict[str, Any]


def volume_name(claim: Mapping[str, Any]) -> str:
    # An external provisioner's convention: one volume per claim UID.
    return f"pvc-{claim['metadata']['uid']}"


def provisioned_volume(claim: Mapping[str, Any], owner: Ownership) -> JSON | None:
    """The upper volume to make for ``claim`` (pure), or None when the claim is not this
    virtual node's to provision: not of our provisioner, placed on another node, already
    bound, or going away; or a claim for a volume made by hand (no class, a selector),
    which no provisioner serves and whose copy below is not made (``reflectable``). The
    claim's annotations are only its creator's word: the caller checks its class."""
    metadata = claim["metadata"]
    annotations = metadata.get("annotations") or {}
    spec = claim.get("spec") or {}
    if (
        annotations.get(keys.STORAGE_PROVISIONER_ANNOTATION) != keys.LOWER_CLUSTER_PROVISIONER
        or annotations.get(keys.SELECTED_NODE_ANNOTATION) != owner.node_name
        or spec.get("volumeName")
        or metadata.get("deletionTimestamp")
        or has_data_source(spec)
        or not spec.get("storageClassName")
        or spec.get("selector")
    ):
        return None
    storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
    if storage is None:
        return None
    namespace, name = metadata["namespace"], metadata["name"]
    # The PersistentVolume controller binds a claim only to a volume of its attributes
    # class (none: none), a volume made for it included; the lower copy asks for it.
    attributes = spec.get("volumeAttributesClassName")
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": volume_name(claim),
            "labels": owner.labels(),
            "annotations": {keys.PROVISIONED_BY_ANNOTATION: keys.LOWER_CLUSTER_PROVISIONER},
        },
        "spec": {
            "capacity": {"storage": storage},
            "accessModes": list(spec.get("accessModes") or []),
            "volumeMode": spec.get("volumeMode") or "Filesystem",
            "storageClassName": spec.get("storageClassName") or "",
            **({"volumeAttributesClassName": attributes} if attributes else {}),
            "persistentVolumeReclaimPolicy": "Delete",
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": namespace,
                "name": name,
                "uid": metadata["uid"],
            },
            # Nothing above reads it: the handle says where the volume is.
            "csi": {
                "driver": keys.LOWER_CLUSTER_CSI_DRIVER,
                "volumeHandle": f"{owner.cluster_id}/{namespace}/{name}",
            },
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": keys.HOSTNAME_LABEL,
                                    "operator": "In",
                                    "values": [owner.node_name],
                                }
                            ]
                        }
                    ]
                }
            },
        },
    }


def hand_made_template(volume: Mapping[str, Any]) -> str | None:
    """``ephemeral volume <name>`` when a pod volume is a generic ephemeral volume whose
    claim asks for a volume made by hand: the lower ephemeral volume controller makes that
    claim from the template, and it binds whichever lower volume it matches."""
    template = (volume.get("ephemeral") or {}).get("volumeClaimTemplate")
    if isinstance(template, Mapping) and for_a_volume_made_by_hand(template):
        return f"ephemeral volume {volume.get('name')}"
    return None


def has_data_source(claim_spec: Mapping[str, Any]) -> bool:
    """Whether a claim is to be filled from a snapshot or another claim: below, its copy
    would wait for ever for a source the lower cluster does not have."""
    return bool(claim_spec.get("dataSource") or claim_spec.get("dataSourceRef"))


def unbound_class(claim: Mapping[str, Any]) -> str | None:
    """The storage class a claim still waits for a volume of, or None: bound, or of no
    class (a claim for a volume made by hand)."""
    spec = claim.get("spec") or {}
    return None if spec.get("volumeName") else spec.get("storageClassName") or None


_SOURCE_REFUSAL = (
    "lower cluster {cluster_id} cannot fill {what} from its data source (a snapshot or "
    "another claim of the upper cluster, which the lower cluster does not have)"
)


def volume_refusal(
    pod: Mapping[str, Any],
    namespace: str,
    waiting_for: Mapping[str, str],
    classes: Collection[str],
    cluster_id: str,
    sourced: Collection[str] = (),
    hand_made: Collection[str] = (),
) -> str | None:
    """Why a lower cluster cannot make a volume the pod still waits for (pure), or None:
    a claim of the pod's (in ``namespace`` above) waits for a volume of a class the lower
    cluster has no StorageClass of, or to be filled from a data source (``sourced``:
    namespace/claim), or asks for a volume made by hand and has no copy below
    (``hand_made``: none is made, ``references.reflectable``).
    ``waiting_for``: {namespace/claim: class} of the unbound claims above. Another claim
    bound above decides nothing here: its volume, if it is one of ours, holds the pod to
    its cluster already."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        name = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if name and f"{namespace}/{name}" in hand_made:
            return hand_made_refusal(f"claim {name}")
        wanted = waiting_for.get(f"{namespace}/{name}") if name else None
        if wanted is not None and wanted not in classes:
            return f"lower cluster {cluster_id} has no storage class {wanted} (claim {name})"
        if name and f"{namespace}/{name}" in sourced:
            return _SOURCE_REFUSAL.format(cluster_id=cluster_id, what=f"claim {name}")
        # A generic ephemeral volume's claim is made below from the pod's template.
        if what := hand_made_template(volume):
            return hand_made_refusal(what)
        template = ((volume.get("ephemeral") or {}).get("volumeClaimTemplate") or {}).get("spec")
        if template and has_data_source(template):
            what = f"ephemeral volume {volume.get('name')}"
            return _SOURCE_REFUSAL.format(cluster_id=cluster_id, what=what)
        wanted = (template or {}).get("storageClassName")
        if wanted and wanted not in classes:
            return (
                f"lower cluster {cluster_id} has no storage class {wanted} "
                f"(ephemeral volume {volume.get('name')})"
            )
    return None


def claim_key(volume: Mapping[str, Any]) -> str | None:
    ref = (volume.get("spec") or {}).get("claimRef") or {}
    return f"{ref['namespace']}/{ref['name']}" if ref.get("namespace") and ref.get("name") else None


def outlived(volume: Mapping[str, Any], claim: Mapping[str, Any] | None) -> bool:
    """Whether one of our upper volumes stands for a claim that is gone (or was made
    again under its name: another UID)."""
    ref = (volume.get("spec") or {}).get("claimRef") or {}
    return claim is None or claim["metadata"].get("uid") != ref.get("uid")


class ClaimVolumes:
    """Makes and removes this virtual node's upper volumes, keyed by claim."""

    def __init__(
        self,
        upper: KubeClient,
        claims: Informer,
        volumes: Informer,
        owner: Ownership,
        queue: WorkQueue[str],
    ) -> None:
        self.upper = upper
        self.claims = claims
        self.volumes = volumes  # ours only: selected by our labels
        self.owner = owner
        self.queue = queue
        # Our volumes by the claim each is for: looked up on every claim event of the
        # cluster, where a scan of them all made claims x volumes decodes.
        self._claim_of: dict[str, str] = {}
        self._volumes_of: dict[str, set[str]] = {}
        claims.add_handler(FunctionHandler.on_any(lambda claim: queue.add(object_key(claim))))
        volumes.add_handler(
            FunctionHandler(
                add=self._volume_changed, update=self._volume_changed, delete=self._volume_gone
            )
        )

    def _volume_changed(self, volume: JSON) -> None:
        self._unindex(volume)
        key = claim_key(volume)
        if key is not None:
            name = str(volume["metadata"]["name"])
            self._claim_of[name] = key
            self._volumes_of.setdefault(key, set()).add(name)
            self.queue.add(key)

    def _volume_gone(self, volume: JSON) -> None:
        self._unindex(volume)
        key = claim_key(volume)
        if key is not None:
            self.queue.add(key)

    def _unindex(self, volume: JSON) -> None:
        name = str(volume["metadata"]["name"])
        before = self._claim_of.pop(name, None)
        if before is not None:
            names = self._volumes_of[before]
            names.discard(name)
            if not names:
                del self._volumes_of[before]

    async def run(self, workers: int) -> None:
        await self.queue.run_workers(workers, self.reconcile)

    async def reconcile(self, key: str) -> None:
        claim = self.claims.get(key)
        ours = [
            volume
            for name in sorted(self._volumes_of.get(key, ()))
            if (volume := self.volumes.get(name)) is not None and claim_key(volume) == key
        ]
        for volume in ours:
            if outlived(volume, claim):
                await self.upper.delete_exact(PERSISTENTVOLUMES, volume)
        desired = provisioned_volume(claim, self.owner) if claim is not None else None
        if desired is None or any(
            v["metadata"]["name"] == desired["metadata"]["name"] for v in ours
        ):
            return
        if not await self._of_our_provisioner(desired["spec"]["storageClassName"]):
            # Annotations anyone creating a claim may write: a volume made on their word
            # bound the claim to us, and its copy below to whatever the lower cluster had.
            log.warning("claim %s: its class is not of %s", key, keys.LOWER_CLUSTER_PROVISIONER)
            return
        try:
            await self.upper.create(PERSISTENTVOLUMES, desired)
        except ApiError as error:
            if error.status != 409:
                raise
            # Already there (the cache lags behind our own create), or someone else's.
            log.info("volume %s exists already", desired["metadata"]["name"])
            return
        log.info("claim %s: volume %s made for it", key, desired["metadata"]["name"])

    async def _of_our_provisioner(self, class_name: str) -> bool:
        try:
            storage_class = await self.upper.get(STORAGECLASSES, class_name)
        except ApiError as error:
            if is_not_found(error):
                return False
            raise
        return bool(storage_class.get("provisioner") == keys.LOWER_CLUSTER_PROVISIONER)
