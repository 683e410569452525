"""Upper volumes for claims waiting for their first consumer: the volume a claim gets
(pure), and the controller over informers fed by hand and a fake upper apiserver."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kubekit import keys
from kubekit.client import PERSISTENTVOLUMECLAIMS, PERSISTENTVOLUMES
from kubekit.informer import Informer, object_key
from kubekit.workqueue import WorkQueue
from tests.unit.fakeapi import FakeClient
from virtual_node.translate import Ownership
from virtual_node.volumes import (
    ClaimVolumes,
    outlived,
    provisioned_volume,
    unbound_class,
    volume_refusal,
)

OWNER = Ownership(origin="upper-uid", node_name="vk-lower-1", cluster_id="lower-1")
VOLUMES = "/api/v1/persistentvolumes"


def claim(
    uid: str = "c-1",
    node: str | None = "vk-lower-1",
    provisioner: str = keys.LOWER_CLUSTER_PROVISIONER,
    **spec: Any,
) -> dict[str, Any]:
    annotations = {keys.STORAGE_PROVISIONER_ANNOTATION: provisioner}
    if node is not None:
        annotations[keys.SELECTED_NODE_ANNOTATION] = node
    return {
        "metadata": {"name": "data", "namespace": "db", "uid": uid, "annotations": annotations},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "fast",
            "resources": {"requests": {"storage": "5Gi"}},
            **spec,
        },
    }


def test_a_claim_placed_on_this_virtual_node_gets_a_volume_bound_to_it_and_to_the_node() -> None:
    volume = provisioned_volume(claim(), OWNER)
    assert volume is not None
    assert volume["metadata"]["name"] == "pvc-c-1"
    assert volume["metadata"]["labels"] == OWNER.labels()
    spec = volume["spec"]
    assert spec["claimRef"] == {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "namespace": "db",
        "name": "data",
        "uid": "c-1",
    }
    assert (spec["capacity"], spec["accessModes"], spec["storageClassName"]) == (
        {"storage": "5Gi"},
        ["ReadWriteOnce"],
        "fast",
    )
    assert spec["volumeMode"] == "Filesystem"
    assert spec["csi"]["volumeHandle"] == "lower-1/db/data"
    # The API takes only a DNS subdomain for a CSI driver's name.
    assert re.fullmatch(
        r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", spec["csi"]["driver"]
    )
    # Later pods of the claim go back to this cluster, where its data is.
    (term,) = spec["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": keys.HOSTNAME_LABEL, "operator": "In", "values": ["vk-lower-1"]}
    ]


def test_a_volume_is_of_its_claims_attributes_class() -> None:
    """The PersistentVolume controller binds a claim only to a volume of its attributes
    class: without, a claim asking for one stayed Pending above, and its pod with it."""
    volume = provisioned_volume(claim(volumeAttributesClassName="gold"), OWNER)
    assert volume is not None and volume["spec"]["volumeAttributesClassName"] == "gold"
    plain = provisioned_volume(claim(), OWNER)
    assert plain is not None and "volumeAttributesClassName" not in plain["spec"]


def test_only_claims_of_our_provisioner_placed_here_and_unbound_get_one() -> None:
    assert provisioned_volume(claim(node="vk-lower-2"), OWNER) is None
    assert provisioned_volume(claim(node=None), OWNER) is None
    assert provisioned_volume(claim(provisioner="ebs.csi.aws.com"), OWNER) is None
    assert provisioned_volume(claim(volumeName="pv-9"), OWNER) is None
    going = claim()
    going["metadata"]["deletionTimestamp"] = "2026-11-26T00:00:00Z"
    assert provisioned_volume(going, OWNER) is None
    # Filled from a snapshot or a claim the lower cluster lacks: bound above, the pod
    # went below and waited there for ever.
    assert (
        provisioned_volume(claim(dataSource={"kind": "PersistentVolumeClaim", "name": "g"}), OWNER)
        is None
    )
    # For a volume made by hand: no provisioner serves it, and its copy is not made below.
    assert provisioned_volume(claim(storageClassName=""), OWNER) is None
    assert provisioned_volume(claim(selector={"matchLabels": {"disk": "a"}}), OWNER) is None


async def test_a_claim_whose_class_is_not_of_our_provisioner_gets_no_volume() -> None:
    """Its annotations are its creator's to write: a volume made on their word bound the
    claim to this cluster without any class of ours."""
    made, upper, claims, _, queue = controller(provisioner="nfs.csi.k8s.io")
    claims.apply({"type": "ADDED", "object": claim()})
    await drain(made, queue)
    assert upper.writes() == []
    assert ("GET", FAST) in [(r.method, r.path) for r in upper.requests]


def test_a_volume_outlives_its_claim_when_the_claim_is_gone_or_made_again() -> None:
    volume = provisioned_volume(claim(), OWNER)
    assert volume is not None
    assert not outlived(volume, claim())
    assert outlived(volume, None)
    assert outlived(volume, claim(uid="c-2"))


FAST = "/apis/storage.k8s.io/v1/storageclasses/fast"


def storage_class(provisioner: str) -> dict[str, Any]:
    return {"metadata": {"name": "fast"}, "provisioner": provisioner}


def controller(
    provisioner: str = keys.LOWER_CLUSTER_PROVISIONER,
) -> tuple[ClaimVolumes, FakeClient, Informer, Informer, WorkQueue[str]]:
    upper = FakeClient()
    upper.answer("GET", FAST, *[storage_class(provisioner)] * 5)
    claims = Informer(client=None, resource=PERSISTENTVOLUMECLAIMS)  # type: ignore[arg-type]
    volumes = Informer(client=None, resource=PERSISTENTVOLUMES)  # type: ignore[arg-type]
    queue: WorkQueue[str] = WorkQueue("volumes")
    return ClaimVolumes(upper, claims, volumes, OWNER, queue), upper, claims, volumes, queue


async def drain(volumes: ClaimVolumes, queue: WorkQueue[str]) -> None:
    while len(queue):
        key = await queue.get()
        try:
            await volumes.reconcile(key)
        finally:
            queue.done(key)


async def test_the_controller_makes_the_volume_once_and_removes_it_with_its_claim() -> None:
    made, upper, claims, volumes, queue = controller()
    claims.apply({"type": "ADDED", "object": claim(node=None)})
    await drain(made, queue)
    assert upper.writes() == []

    claims.apply({"type": "MODIFIED", "object": claim()})
    await drain(made, queue)
    assert upper.writes() == [("POST", VOLUMES)]
    (created,) = [r.body for r in upper.requests if r.method == "POST"]
    volumes.apply(
        {"type": "ADDED", "object": {**created, "metadata": {**created["metadata"], "uid": "v-1"}}}
    )
    bound = claim(volumeName="pvc-c-1")
    claims.apply({"type": "MODIFIED", "object": bound})
    await drain(made, queue)
    assert upper.writes() == [("POST", VOLUMES)]

    upper.requests.clear()
    claims.apply({"type": "DELETED", "object": bound})
    await drain(made, queue)
    assert upper.writes() == [("DELETE", f"{VOLUMES}/pvc-c-1")]


def test_a_claim_waits_for_its_class_until_bound() -> None:
    assert unbound_class(claim()) == "fast"
    assert unbound_class(claim(volumeName="pv-9")) is None
    assert unbound_class(claim(storageClassName="")) is None


def test_a_cluster_without_the_class_a_claim_waits_for_is_refused() -> None:
    pod = {
        "spec": {
            "volumes": [
                {"name": "scratch", "emptyDir": {}},
                {"name": "d", "persistentVolumeClaim": {"claimName": "data"}},
            ]
        }
    }
    waiting = {"db/data": "fast"}
    assert volume_refusal(pod, "db", waiting, {"fast"}, "lower-1") is None
    assert volume_refusal(pod, "db", waiting, {"slow"}, "lower-1") == (
        "lower cluster lower-1 has no storage class fast (claim data)"
    )
    # Another namespace's claim of that name, or a claim not waiting: nothing to refuse.
    assert volume_refusal(pod, "web", waiting, set(), "lower-1") is None
    assert volume_refusal(pod, "db", {}, set(), "lower-1") is None


def test_an_ephemeral_volume_of_a_class_the_cluster_lacks_is_refused() -> None:
    template = {"spec": {"storageClassName": "fast", "accessModes": ["ReadWriteOnce"]}}
    pod = {
        "spec": {"volumes": [{"name": "scratch", "ephemeral": {"volumeClaimTemplate": template}}]}
    }
    assert volume_refusal(pod, "db", {}, {"fast"}, "lower-1") is None
    assert volume_refusal(pod, "db", {}, {"slow"}, "lower-1") == (
        "lower cluster lower-1 has no storage class fast (ephemeral volume scratch)"
    )
    # No class named: the lower cluster's default class makes it.
    template["spec"].pop("storageClassName")
    assert volume_refusal(pod, "db", {}, set(), "lower-1") is None


def test_a_claim_or_ephemeral_volume_filled_from_a_data_source_is_refused() -> None:
    source = {"kind": "PersistentVolumeClaim", "name": "golden"}
    template = {"spec": {"accessModes": ["ReadWriteOnce"], "dataSource": source}}
    pod = {
        "spec": {
            "volumes": [
                {"name": "d", "persistentVolumeClaim": {"claimName": "data"}},
                {"name": "e", "ephemeral": {"volumeClaimTemplate": template}},
            ]
        }
    }
    waiting = {"db/data": "fast"}
    refusal = volume_refusal(pod, "db", waiting, {"fast"}, "lower-1", {"db/data"})
    assert refusal is not None and refusal.startswith(
        "lower cluster lower-1 cannot fill claim data"
    )
    refusal = volume_refusal(pod, "db", waiting, {"fast"}, "lower-1")
    assert refusal is not None and "ephemeral volume e" in refusal


async def test_a_claim_event_reads_only_the_volumes_made_for_that_claim() -> None:
    """Every claim of the upper cluster wakes the controller: a scan of all our volumes
    on each made claims x volumes decodes (minutes of CPU at 20,000 claims and 5,000
    volumes, on the loop that renews the Lease)."""
    made, upper, claims, volumes, queue = controller()
    claims.apply({"type": "ADDED", "object": claim()})
    await drain(made, queue)
    (created,) = [r.body for r in upper.requests if r.method == "POST"]
    created = {**created, "metadata": {**created["metadata"], "uid": "v-1"}}
    volumes.apply({"type": "ADDED", "object": created})
    await drain(made, queue)
    read: list[str] = []
    real_get = volumes.get

    def counted_get(key: str) -> Any:
        read.append(key)
        return real_get(key)

    def no_scan(_namespace: str | None = None) -> Any:
        raise AssertionError("every volume read")

    volumes.get = counted_get  # type: ignore[method-assign]
    volumes.items = no_scan  # type: ignore[method-assign,assignment]
    other = claim()
    other["metadata"] = {**other["metadata"], "namespace": "elsewhere", "uid": "c-9"}
    claims.apply({"type": "ADDED", "object": other})
    await made.reconcile("elsewhere/" + other["metadata"]["name"])
    assert read == []
    upper.requests.clear()
    bound = claim(volumeName=created["metadata"]["name"])
    claims.apply({"type": "DELETED", "object": bound})
    await made.reconcile(object_key(bound))
    assert read == [created["metadata"]["name"]]
    assert upper.writes() == [("DELETE", f"{VOLUMES}/{created['metadata']['name']}")]


def test_a_claim_for_a_volume_made_by_hand_without_a_copy_refuses_its_pods() -> None:
    pod = {"spec": {"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]}}
    assert volume_refusal(pod, "db", {}, set(), "lower-1", hand_made={"db/data"}) == (
        "claim data asks for a volume made by hand (no storage class, a selector, or a "
        "volume named): the lower cluster's volumes are not the upper cluster's, and its "
        "claim below would bind whichever of them it matched"
    )
    assert volume_refusal(pod, "web", {}, set(), "lower-1", hand_made={"db/data"}) is None


@pytest.mark.parametrize(
    "template", [{"storageClassName": ""}, {"selector": {"matchLabels": {"disk": "nfs"}}}]
)
def test_an_ephemeral_volume_asking_for_a_volume_made_by_hand_is_refused(
    template: dict[str, Any],
) -> None:
    """The lower ephemeral volume controller makes its claim below from the template."""
    ephemeral = {"volumeClaimTemplate": {"spec": template}}
    pod = {"spec": {"volumes": [{"name": "scratch", "ephemeral": ephemeral}]}}
    refusal = volume_refusal(pod, "db", {}, {"fast"}, "lower-1")
    assert refusal is not None
    assert refusal.startswith("ephemeral volume scratch asks for a volume made by hand")
