"""Lower namespaces deleted with their upper namespace: the controller over informers fed
by hand and fake apiservers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kubekit import keys
from kubekit.client import NAMESPACES, PERSISTENTVOLUMECLAIMS, PODS
from kubekit.informer import Informer
from kubekit.workqueue import WorkQueue
from tests.unit.fakeapi import FakeClient, not_found
from virtual_node import namespaces
from virtual_node.namespaces import LowerNamespaces, others_objects
from virtual_node.naming import NamespaceMapping
from virtual_node.translate import Ownership

OWNER = Ownership(origin="upper-uid", node_name="vk-lower-1", cluster_id="lower-1")
SAME = NamespaceMapping()
CLAIMS = "/api/v1/namespaces/shop/persistentvolumeclaims"


def namespace(name: str, **metadata: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"uid-{name}", **metadata}}


def pod(name: str, origin: str | None) -> dict[str, Any]:
    labels = {keys.ORIGIN_LABEL: origin} if origin else {}
    return {"metadata": {"name": name, "namespace": "shop", "uid": name, "labels": labels}}


class Harness:
    def __init__(self, mapping: NamespaceMapping = SAME) -> None:
        self.upper = FakeClient()
        self.lower = FakeClient()
        self.upper_namespaces = Informer(client=None, resource=NAMESPACES)  # type: ignore[arg-type]
        self.lower_namespaces = Informer(client=None, resource=NAMESPACES)  # type: ignore[arg-type]
        self.lower_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
        self.upper_claims = Informer(client=None, resource=PERSISTENTVOLUMECLAIMS)  # type: ignore[arg-type]
        self.forgotten: list[str] = []
        self.queue: WorkQueue[str] = WorkQueue("namespaces")
        self.controller = LowerNamespaces(
            self.upper,
            self.upper_namespaces,
            self.lower,
            self.lower_namespaces,
            self.lower_pods,
            self.upper_claims,
            mapping,
            OWNER,
            self.forgotten.append,
            self.queue,
        )

    def claims_below(self, *claims: dict[str, Any]) -> None:
        """What the lower apiserver lists of the namespace's claims, next time asked; and
        of the other kinds looked at before a deletion, nothing."""
        self.below("persistentvolumeclaims", *claims)
        for resource in namespaces.OTHER_TENANTS_KINDS:
            self.below(resource.plural)

    def below(self, plural: str, *objects: dict[str, Any], namespace: str = "shop") -> None:
        self.lower.answer(
            "GET", f"/api/v1/namespaces/{namespace}/{plural}", {"items": list(objects)}
        )

    async def drain(self) -> None:
        while len(self.queue):
            key = await self.queue.get()
            try:
                await self.controller.reconcile(key)
            finally:
                self.queue.done(key)


async def test_a_lower_namespace_goes_once_its_upper_namespace_is_gone() -> None:
    world = Harness()
    world.upper_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    assert world.lower.writes() == []

    # Terminating above: its pods are still being deleted below.
    terminating = namespace("shop", deletionTimestamp="2026-11-27T01:00:00Z")
    world.upper_namespaces.apply({"type": "MODIFIED", "object": terminating})
    await world.drain()
    assert world.lower.writes() == []

    world.upper.answer("GET", "/api/v1/namespaces/shop", not_found("namespaces", "shop"))
    world.claims_below()
    world.upper_namespaces.apply({"type": "DELETED", "object": terminating})
    await world.drain()
    assert world.lower.writes() == [("DELETE", "/api/v1/namespaces/shop")]
    (deleted,) = [r for r in world.lower.requests if r.method == "DELETE"]
    assert deleted.body["preconditions"] == {"uid": "uid-shop"}
    assert world.forgotten == ["shop"]


async def test_a_namespace_the_upper_cache_has_not_heard_of_yet_is_asked_for_and_kept() -> None:
    world = Harness()
    world.upper.answer("GET", "/api/v1/namespaces/shop", namespace("shop"))
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    assert [(r.method, r.path) for r in world.upper.requests] == [
        ("GET", "/api/v1/namespaces/shop")
    ]
    assert world.lower.writes() == []


async def test_one_gone_above_while_the_virtual_node_was_away_goes_at_start() -> None:
    world = Harness()
    world.claims_below()
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    assert world.lower.writes() == [("DELETE", "/api/v1/namespaces/shop")]


async def test_a_namespace_holding_pods_of_others_is_kept_and_looked_at_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(namespaces, "KEPT_NAMESPACE_RECHECK_SECONDS", 0.05)
    world = Harness()
    world.lower_pods.apply({"type": "ADDED", "object": pod("theirs", "another-upper")})
    ours = pod("ours", OWNER.origin)
    ours["metadata"]["deletionTimestamp"] = "2026-11-27T01:00:00Z"  # as its upper pod went
    world.lower_pods.apply({"type": "ADDED", "object": ours})
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    assert world.lower.writes() == []

    # Theirs goes: no event of the namespace's tells; it is looked at again anyway.
    world.lower_pods.apply({"type": "DELETED", "object": pod("theirs", "another-upper")})
    world.claims_below(pod("ours-claim", OWNER.origin))
    async with asyncio.timeout(5):
        key = await world.queue.get()
    await world.controller.reconcile(key)
    world.queue.done(key)
    assert world.lower.writes() == [("DELETE", "/api/v1/namespaces/shop")]


def test_others_objects_are_those_of_another_upper_cluster_or_of_none() -> None:
    pods = [pod("ours", OWNER.origin), pod("theirs", "another-upper"), pod("local", None)]
    assert others_objects(pods, OWNER) == ["shop/theirs", "shop/local"]


async def test_with_a_prefix_only_the_prefixed_namespace_is_ours_to_delete() -> None:
    world = Harness(NamespaceMapping("prefix", "t1"))
    world.upper_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("t1-shop")})
    # Labelled as ours, but no upper namespace maps to it.
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    assert world.lower.writes() == []

    world.upper.answer("GET", "/api/v1/namespaces/shop", not_found("namespaces", "shop"))
    world.below("persistentvolumeclaims", namespace="t1-shop")
    for resource in namespaces.OTHER_TENANTS_KINDS:
        world.below(resource.plural, namespace="t1-shop")
    world.upper_namespaces.apply({"type": "DELETED", "object": namespace("shop")})
    await world.drain()
    assert world.lower.writes() == [("DELETE", "/api/v1/namespaces/t1-shop")]


async def test_a_namespace_holding_claims_of_others_is_kept() -> None:
    """Another upper cluster's claim copies, its StatefulSet scaled to none: no pod of
    theirs is left, but deleting the namespace would take their volumes."""
    world = Harness()
    world.claims_below(pod("data-db-0", "another-upper"), pod("ours", OWNER.origin))
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    assert world.lower.writes() == []
    assert ("GET", CLAIMS) in [(r.method, r.path) for r in world.lower.requests]


def upper_claim(uid: str, namespace: str = "dev") -> dict[str, Any]:
    return {"metadata": {"name": "data-db-0", "namespace": namespace, "uid": uid}}


async def holding_a_claim_copy(*above: dict[str, Any], copied_from: str = "dev") -> Harness:
    """Lower namespace ``shop``, no upper namespace of that name, holding our copy of
    upper claim ``<copied_from>/data-db-0`` (UID ``uid-data``); ``above``, the upper
    claims."""
    copy = pod("data-db-0", OWNER.origin)
    copy["metadata"]["annotations"] = {
        keys.UPPER_NAMESPACE_ANNOTATION: copied_from,
        keys.UPPER_UID_ANNOTATION: "uid-data",
    }
    world = Harness()
    world.claims_below(copy)
    for claim in above:
        world.upper_claims.apply({"type": "ADDED", "object": claim})
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    return world


async def test_a_namespace_holding_copies_of_claims_still_above_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Made under ``--namespace-prefix acme``: under ``same``, lower ``acme-dev`` names an
    upper namespace of its own, which is gone, while ``dev``'s claim is copied there (its
    StatefulSet scaled to none, no pod left). Until 2026-11-29 the namespace was deleted,
    and the claim's volume, its data, with it."""
    monkeypatch.setattr(namespaces, "KEPT_NAMESPACE_RECHECK_SECONDS", 0.05)
    world = await holding_a_claim_copy(upper_claim("uid-data"))
    assert world.lower.writes() == []
    async with asyncio.timeout(5):
        assert await world.queue.get() == "shop", "looked at again"


async def test_a_namespace_whose_claim_copies_stand_for_claims_gone_above_goes() -> None:
    """The upper claim deleted, or made again since (another UID): its copy is no one's."""
    for above in ((), (upper_claim("uid-later"),)):
        world = await holding_a_claim_copy(*above)
        assert world.lower.writes() == [("DELETE", "/api/v1/namespaces/shop")], above
    # A copy of a claim of the namespace found gone: the cache has not heard of it yet.
    world = await holding_a_claim_copy(upper_claim("uid-data", "shop"), copied_from="shop")
    assert world.lower.writes() == [("DELETE", "/api/v1/namespaces/shop")]
    assert not [r for r in world.upper.requests if "persistentvolumeclaims" in r.path]


async def test_a_namespace_holding_pods_of_ours_not_being_deleted_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kubectl delete ns shop --wait && kubectl create ns shop && kubectl apply ...`: the
    pod mirror, which still knew the lower namespace, made the new pods in it, and the
    namespace's delete took them along."""
    monkeypatch.setattr(namespaces, "OWN_PODS_RECHECK_SECONDS", 0.05)
    world = Harness()
    world.lower_pods.apply({"type": "ADDED", "object": pod("new", OWNER.origin)})
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    assert world.lower.writes() == []
    async with asyncio.timeout(5):
        assert await world.queue.get() == "shop", "looked at again"


async def test_a_namespace_made_again_above_while_claims_are_listed_is_kept() -> None:
    world = Harness()
    gone = not_found("namespaces", "shop")
    world.upper.answer("GET", "/api/v1/namespaces/shop", gone, namespace("shop"))
    world.claims_below()
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    assert world.lower.writes() == []


def of(kind: str, name: str, origin: str | None = None, **fields: Any) -> dict[str, Any]:
    return {**pod(name, origin), "kind": kind, **fields}


@pytest.mark.parametrize(
    ("plural", "kept"),
    [
        ("secrets", of("Secret", "db-password", "another-upper")),
        ("services", of("Service", "reports-api", "another-upper")),
        ("resourcequotas", of("ResourceQuota", keys.SLICE_QUOTA, "another-upper")),
        ("configmaps", of("ConfigMap", "settings", "another-upper")),
    ],
)
async def test_a_namespace_holding_another_upper_clusters_copies_is_kept(
    plural: str, kept: dict[str, Any]
) -> None:
    """Another tenant sharing the namespace's name keeps its copies and its quota of
    slices there before any pod: deleted, the namespace took them along."""
    world = Harness()
    world.claims_below()
    world.lower.answers[("GET", f"/api/v1/namespaces/shop/{plural}")] = [{"items": [kept]}]
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    assert world.lower.writes() == []


async def test_what_the_lower_clusters_controllers_put_in_every_namespace_keeps_it_not() -> None:
    """A root CA ConfigMap, the default account and its legacy token, a mesh's CA, a
    platform's build accounts: all namespaces have them, none would ever go."""
    world = Harness()
    for plural in ("persistentvolumeclaims", "services", "resourcequotas"):
        world.below(plural)
    world.below(
        "configmaps", of("ConfigMap", "kube-root-ca.crt"), of("ConfigMap", "istio-ca-root-cert")
    )
    world.below("serviceaccounts", of("ServiceAccount", "default"), of("ServiceAccount", "builder"))
    world.below("secrets", of("Secret", "builder-dockercfg-x"), of("Secret", "ours", OWNER.origin))
    world.lower_namespaces.apply({"type": "ADDED", "object": namespace("shop")})
    await world.drain()
    assert world.lower.writes() == [("DELETE", "/api/v1/namespaces/shop")]
