"""The reflector over informers fed by hand and a fake lower apiserver: ServiceAccounts and
PriorityClasses are copied before the pod, kept equal and removed when unused; a Service's
selector decides which pods need it."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kubekit import keys
from kubekit.client import PODS, ApiError
from kubekit.informer import Informer
from kubekit.workqueue import WorkQueue
from tests.unit.fakeapi import FakeClient, status_error
from virtual_node.lower import ClaimNotCopied, LowerCluster, NameTaken
from virtual_node.main import _sweep_orphans
from virtual_node.naming import NamespaceMapping
from virtual_node.references import Kind, desired_copy
from virtual_node.reflector import RESOURCES, Key, Reflector
from virtual_node.translate import Ownership

OWNER = Ownership(origin="upper-uid", node_name="vk-lower-1", cluster_id="lower-1")
ACCOUNTS = "/api/v1/namespaces/shop/serviceaccounts"
PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"


@dataclass
class Reflecting:
    reflector: Reflector
    lower: FakeClient
    upper_pods: Informer
    upper: dict[Kind, Informer]
    copies: dict[Kind, Informer]
    queue: WorkQueue[Key]

    def above(self, kind: Kind | None, obj: dict[str, Any], event: str = "ADDED") -> None:
        informer = self.upper_pods if kind is None else self.upper[kind]
        informer.apply({"type": event, "object": obj})

    def below(self, kind: Kind, obj: dict[str, Any]) -> None:
        self.copies[kind].apply({"type": "ADDED", "object": obj})

    async def drain(self) -> None:
        """Reconciles every queued key once, as a worker would."""
        while len(self.queue):
            key = await self.queue.get()
            try:
                await self.reflector.reconcile(key)
            finally:
                self.queue.done(key)

    def created(self, path: str) -> list[dict[str, Any]]:
        return [r.body for r in self.lower.requests if r.method == "POST" and r.path == path]


def reflecting() -> Reflecting:
    lower = FakeClient()
    upper = {kind: Informer(client=None, resource=r) for kind, r in RESOURCES.items()}  # type: ignore[arg-type]
    copies = {kind: Informer(client=None, resource=r) for kind, r in RESOURCES.items()}  # type: ignore[arg-type]
    upper_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    queue: WorkQueue[Key] = WorkQueue("reflected")
    reflector = Reflector(upper_pods, upper, lower, copies, NamespaceMapping(), OWNER, queue)
    return Reflecting(reflector, lower, upper_pods, upper, copies, queue)


def pod(name: str = "web", labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "shop",
            "uid": f"uid-{name}",
            "labels": labels or {},
        },
        "spec": {"containers": [{"name": "app", "image": "nginx"}], **spec},
        "status": {"phase": "Pending"},
    }


def account(**fields: Any) -> dict[str, Any]:
    metadata = {"name": "builder", "namespace": "shop", "uid": "sa-uid", "resourceVersion": "4"}
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata, **fields}


def priority_class(**fields: Any) -> dict[str, Any]:
    metadata = {"name": "high", "uid": "pc-uid", "resourceVersion": "2"}
    return {"kind": "PriorityClass", "metadata": metadata, "value": 1000, **fields}


async def test_a_pods_service_account_and_priority_class_are_copied_before_it() -> None:
    r = reflecting()
    r.above("serviceaccounts", account(automountServiceAccountToken=False))
    r.above(
        "priorityclasses",
        priority_class(globalDefault=True, preemptionPolicy="PreemptLowerPriority"),
    )
    web = pod(serviceAccountName="builder", priorityClassName="high")
    r.above(None, web)
    await r.reflector.ensure_for_pod(web)
    (copied_account,) = r.created(ACCOUNTS)
    assert copied_account["automountServiceAccountToken"] is False
    assert copied_account["metadata"]["labels"] == OWNER.labels()
    (copied_class,) = r.created(PRIORITY_CLASSES)
    assert (copied_class["value"], copied_class["preemptionPolicy"]) == (1000, "Never"), (
        "a tenant's pods never preempt below (other tenants', the lower cluster's own)"
    )
    assert "globalDefault" not in copied_class, "a tenant's class never becomes the lower default"
    assert copied_class["metadata"]["labels"] == OWNER.labels()


def token_secret(name: str, account_name: str) -> dict[str, Any]:
    secret = named("Secret", name, type=keys.SERVICE_ACCOUNT_TOKEN_TYPE, data={"token": "dXA="})
    secret["metadata"]["annotations"] = {keys.SERVICE_ACCOUNT_NAME_ANNOTATION: account_name}
    return secret


SECRETS = "/api/v1/namespaces/shop/secrets"


async def test_a_token_secret_goes_below_after_the_account_it_names_and_goes_with_it() -> None:
    """The lower tokens controller fills the copy with a token of the lower copy of the
    account, and deletes a token Secret whose account is not there."""
    r = reflecting()
    r.above("serviceaccounts", account())
    r.above("secrets", token_secret("builder-token", "builder"))
    web = pod(volumes=[{"name": "t", "secret": {"secretName": "builder-token"}}])
    r.above(None, web)
    await r.reflector.ensure_for_pod(web)
    # The account first; the Secret right after, though the cache does not show the
    # account's copy yet (the pod is made next).
    assert [path for _, path in r.lower.writes()] == [ACCOUNTS, SECRETS]
    (made_account,) = r.created(ACCOUNTS)
    assert made_account["metadata"]["name"] == "builder"
    (copy,) = r.created(SECRETS)
    assert "data" not in copy, "the lower tokens controller's to fill"
    r.below("serviceaccounts", made_account)
    r.below("secrets", {**copy, "metadata": {**copy["metadata"], "uid": "lower-secret"}})
    await r.drain()
    assert r.reflector.orphan_keys() == []
    r.above(None, web, "DELETED")
    assert sorted(r.reflector.orphan_keys()) == [
        ("secrets", "shop", "builder-token"),
        ("serviceaccounts", "shop", "builder"),
    ]


async def test_a_token_secret_naming_an_account_not_ours_below_is_not_copied() -> None:
    """The lower tokens controller matches the account by name: the copy would hold a
    token of the lower cluster's own account of that name."""
    r = reflecting()
    r.above("serviceaccounts", account())
    r.above("secrets", token_secret("builder-token", "builder"))
    theirs = {"metadata": {"name": "builder", "namespace": "shop", "labels": {}}}
    taken(ACCOUNTS, f"{ACCOUNTS}/builder", theirs, r)
    web = pod(volumes=[{"name": "t", "secret": {"secretName": "builder-token"}}])
    r.above(None, web)
    with pytest.raises(NameTaken, match="serviceaccounts shop/builder"):
        await r.reflector.ensure_for_pod(web)
    await r.drain()
    assert r.created(SECRETS) == []


async def test_a_token_secret_of_the_default_account_copies_no_account() -> None:
    r = reflecting()
    r.above("secrets", token_secret("default-token", "default"))
    web = pod(volumes=[{"name": "t", "secret": {"secretName": "default-token"}}])
    r.above(None, web)
    await r.reflector.ensure_for_pod(web)
    await r.drain()
    assert r.lower.writes() == [("POST", SECRETS)]


async def test_what_every_cluster_makes_itself_is_not_copied() -> None:
    r = reflecting()
    web = pod(serviceAccountName="default", priorityClassName="system-cluster-critical")
    r.above(None, web)
    await r.reflector.ensure_for_pod(web)
    await r.drain()
    assert r.lower.writes() == []


async def account_copied() -> Reflecting:
    """The service account a pod uses, copied below (resourceVersion 9 there)."""
    r = reflecting()
    r.above("serviceaccounts", account())
    r.above(None, pod(serviceAccountName="builder"))
    await r.drain()
    (copy,) = r.created(ACCOUNTS)
    lower_metadata = {**copy["metadata"], "uid": "lower-sa", "resourceVersion": "9"}
    r.below("serviceaccounts", {**copy, "metadata": lower_metadata})
    r.lower.requests.clear()
    return r


async def test_a_copy_follows_its_upper_object_and_goes_with_its_last_pod() -> None:
    r = await account_copied()

    r.above("serviceaccounts", account(imagePullSecrets=[{"name": "registry"}]), "MODIFIED")
    await r.drain()
    (replace,) = [q for q in r.lower.requests if q.method == "PUT"]
    assert replace.path == f"{ACCOUNTS}/builder"
    assert replace.body["imagePullSecrets"] == [{"name": "registry"}]
    assert replace.body["metadata"]["resourceVersion"] == "9"

    r.lower.requests.clear()
    r.above(None, pod(serviceAccountName="builder"), "DELETED")
    await r.drain()
    assert r.lower.writes() == [("DELETE", f"{ACCOUNTS}/builder")]


async def test_a_copy_whose_update_is_refused_below_is_kept_and_tried_again() -> None:
    """A lower admission policy refuses the update (422): made again, the copy would be
    refused too, and gone from the pods meanwhile."""
    r = await account_copied()
    r.lower.answer("PUT", f"{ACCOUNTS}/builder", status_error(422, "Invalid", "denied by policy"))
    r.above("serviceaccounts", account(imagePullSecrets=[{"name": "registry"}]), "MODIFIED")
    with pytest.raises(ApiError, match="denied by policy"):
        await r.reflector.reconcile(("serviceaccounts", "shop", "builder"))
    assert r.lower.writes() == [("PUT", f"{ACCOUNTS}/builder")]


async def test_a_priority_class_copy_is_cluster_wide_and_swept_when_unused() -> None:
    r = reflecting()
    r.above("priorityclasses", priority_class())
    r.above(None, pod(priorityClassName="high"))
    await r.drain()
    (copy,) = r.created(PRIORITY_CLASSES)
    r.below("priorityclasses", {**copy, "metadata": {**copy["metadata"], "uid": "lower-pc"}})
    assert r.reflector.orphan_keys() == []
    r.above(None, pod(priorityClassName="high"), "DELETED")
    assert r.reflector.orphan_keys() == [("priorityclasses", "", "high")]


async def test_a_services_selector_decides_which_pods_need_it() -> None:
    r = reflecting()
    r.above(None, pod("web-1", {"app": "web"}))
    r.above(None, pod("api-1", {"app": "api"}))
    service = {
        "metadata": {"name": "front", "namespace": "shop", "uid": "svc-uid"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
    }
    r.above("services", service)
    await r.drain()
    assert [body["metadata"]["name"] for body in r.created("/api/v1/namespaces/shop/services")] == [
        "front"
    ]
    copy = r.created("/api/v1/namespaces/shop/services")[0]
    r.below("services", {**copy, "metadata": {**copy["metadata"], "uid": "lower-svc"}})
    r.lower.requests.clear()

    r.above("services", {**service, "spec": {"selector": {"app": "none"}}}, "MODIFIED")
    await r.drain()
    assert r.lower.writes() == [("DELETE", "/api/v1/namespaces/shop/services/front")]

    r.above("services", {**service, "spec": {"selector": {"app": "api"}}}, "MODIFIED")
    assert ("services", "shop", "front") not in r.reflector.orphan_keys()
    r.above(None, pod("api-1", {"app": "api"}), "DELETED")
    assert ("services", "shop", "front") in r.reflector.orphan_keys()


async def test_a_pod_finds_the_services_whose_whole_selector_its_labels_match() -> None:
    r = reflecting()
    services = "/api/v1/namespaces/shop/services"

    def service(name: str, selector: dict[str, str], **spec: Any) -> dict[str, Any]:
        metadata = {"name": name, "namespace": "shop", "uid": f"uid-{name}"}
        return {"metadata": metadata, "spec": {"selector": selector, **spec}}

    async def copies_changed() -> tuple[list[str], list[str]]:
        """Names of the copies made and deleted below since the last call."""
        await r.drain()
        made = [body["metadata"]["name"] for body in r.created(services)]
        for body in r.created(services):
            r.below("services", {**body, "metadata": {**body["metadata"], "uid": "lower"}})
        deleted = [path.rsplit("/", 1)[1] for _, path in r.lower.writes("DELETE")]
        r.lower.requests.clear()
        return made, deleted

    r.above("services", service("front", {"app": "web"}))
    r.above("services", service("tier-1", {"app": "web", "tier": "1"}))
    r.above("services", service("api", {"app": "api"}))
    r.above("services", service("alias", {"app": "web"}, type="ExternalName"))
    r.above(None, pod("web-1", {"app": "web", "tier": "2"}))
    assert await copies_changed() == (["front"], [])

    r.above(None, pod("web-1", {"app": "web", "tier": "1"}), "MODIFIED")
    assert await copies_changed() == (["tier-1"], [])

    r.above("services", service("tier-1", {"app": "web", "tier": "1"}), "DELETED")
    r.above("services", service("api", {"tier": "1"}), "MODIFIED")
    r.above(None, pod("web-1", {"app": "web", "tier": "1"}), "MODIFIED")
    assert await copies_changed() == (["api"], ["tier-1"])


async def test_a_pod_that_finished_needs_nothing_more() -> None:
    r = reflecting()
    r.above("serviceaccounts", account())
    r.above(None, pod(serviceAccountName="builder"))
    done = pod(serviceAccountName="builder")
    done["status"]["phase"] = "Succeeded"
    r.above(None, done, "MODIFIED")
    await r.drain()
    assert r.created(ACCOUNTS) == []


async def test_a_pod_being_deleted_keeps_what_it_uses_until_it_ends() -> None:
    """Its lower copy still shuts down (its token, its volumes) until it is gone."""
    r = reflecting()
    r.above("serviceaccounts", account())
    r.above(None, pod(serviceAccountName="builder"))
    await r.drain()
    (copy,) = r.created(ACCOUNTS)
    r.below("serviceaccounts", {**copy, "metadata": {**copy["metadata"], "uid": "lower-sa"}})
    r.lower.requests.clear()
    ending = pod(serviceAccountName="builder")
    ending["metadata"]["deletionTimestamp"] = "2026-11-27T10:00:00Z"
    r.above(None, ending, "MODIFIED")
    await r.drain()
    assert r.lower.writes() == []
    ending["status"]["phase"] = "Failed"
    r.above(None, ending, "MODIFIED")
    await r.drain()
    assert r.lower.writes() == [("DELETE", f"{ACCOUNTS}/builder")]


async def test_a_copy_deleted_with_its_last_pod_is_made_again_before_the_watch_says() -> None:
    """A StatefulSet's replacement, a Job's next pod: the cache still showed the copy just
    deleted, nothing was made, and the pod started below without its ConfigMap."""
    r = reflecting()
    configmaps = "/api/v1/namespaces/shop/configmaps"
    r.above("configmaps", named("ConfigMap", "settings", data={"a": "1"}))
    uses: dict[str, Any] = {"volumes": [{"name": "s", "configMap": {"name": "settings"}}]}
    first = pod("web-0", **uses)
    r.above(None, first)
    await r.reflector.ensure_for_pod(first)
    (copy,) = r.created(configmaps)
    r.below("configmaps", {**copy, "metadata": {**copy["metadata"], "uid": "below-1"}})
    r.above(None, first, "DELETED")
    await r.drain()
    assert r.lower.writes() == [("POST", configmaps), ("DELETE", f"{configmaps}/settings")]
    r.lower.requests.clear()
    # The watch has not shown the deletion yet.
    second = pod("web-0-again", **uses)
    r.above(None, second)
    await r.reflector.ensure_for_pod(second)
    assert r.lower.writes() == [("POST", configmaps)]


async def test_nothing_is_copied_into_the_lower_kube_system_and_what_was_goes() -> None:
    """A Secret of type bootstrap token in the lower kube-system is a credential to join
    the lower cluster: an upper admin's pod there named one to have it copied."""
    secrets = "/api/v1/namespaces/kube-system/secrets"
    token = named("Secret", "bootstrap-token-abcdef", type="bootstrap.kubernetes.io/token")
    token["metadata"]["namespace"] = "kube-system"
    agent = pod(volumes=[{"name": "t", "secret": {"secretName": token["metadata"]["name"]}}])
    agent["metadata"]["namespace"] = "kube-system"
    r = reflecting()
    r.above("secrets", token)
    r.above(None, agent)
    await r.reflector.ensure_for_pod(agent)
    await r.drain()
    assert r.lower.writes() == []
    # One an earlier version made goes once no pod needs it.
    copy = desired_copy(token, NamespaceMapping(), OWNER)
    r.below("secrets", {**copy, "metadata": {**copy["metadata"], "uid": "below"}})
    r.above(None, agent, "DELETED")
    await r.drain()
    assert r.lower.writes() == [("DELETE", f"{secrets}/bootstrap-token-abcdef")]


def named(kind: str, name: str, **fields: Any) -> dict[str, Any]:
    metadata = {"name": name, "namespace": "shop", "uid": f"{name}-uid", "resourceVersion": "1"}
    return {"kind": kind, "metadata": metadata, **fields}


async def test_a_namespace_holding_slices_has_everything_copied_before_any_pod() -> None:
    r = reflecting()
    r.above("configmaps", named("ConfigMap", "settings", data={"a": "1"}))
    r.above("configmaps", named("ConfigMap", "kube-root-ca.crt", data={"ca.crt": "x"}))
    r.above("secrets", named("Secret", "token", type="Opaque"))
    r.above("serviceaccounts", named("ServiceAccount", "default"))
    r.above("services", named("Service", "api", spec={"selector": {"app": "api"}}))
    r.above(
        "configmaps",
        {
            **named("ConfigMap", "elsewhere"),
            "metadata": {
                "name": "elsewhere",
                "namespace": "other",
                "uid": "u",
                "resourceVersion": "1",
            },
        },
    )
    await r.drain()
    assert r.lower.writes() == [], "no pod refers to anything yet"
    r.reflector.sync_namespaces({"shop"})
    await r.drain()
    assert sorted(r.lower.writes()) == [
        ("POST", "/api/v1/namespaces/shop/configmaps"),
        ("POST", "/api/v1/namespaces/shop/secrets"),
        ("POST", "/api/v1/namespaces/shop/services"),
    ]
    # New objects of the namespace follow; its slices gone, the copies go.
    r.above("configmaps", named("ConfigMap", "later"))
    await r.drain()
    assert [b["metadata"]["name"] for b in r.created("/api/v1/namespaces/shop/configmaps")] == [
        "settings",
        "later",
    ]
    for request in [r for r in r.lower.requests if r.method == "POST"]:
        body = request.body
        kinds: dict[str, Kind] = {
            "ConfigMap": "configmaps",
            "Secret": "secrets",
            "Service": "services",
        }
        kind = kinds[body["kind"]]
        copy = {**body, "metadata": {**body["metadata"], "uid": "lower", "resourceVersion": "1"}}
        r.below(kind, copy)
    r.lower.requests.clear()
    r.reflector.sync_namespaces(())
    await r.drain()
    assert sorted(r.lower.writes()) == [
        ("DELETE", "/api/v1/namespaces/shop/configmaps/later"),
        ("DELETE", "/api/v1/namespaces/shop/configmaps/settings"),
        ("DELETE", "/api/v1/namespaces/shop/secrets/token"),
        ("DELETE", "/api/v1/namespaces/shop/services/api"),
    ]


async def test_a_sliced_default_namespace_gets_no_copy_of_the_upper_apiservers_service() -> None:
    """Copied below, `kubernetes` would win over the lower apiserver's in the pods'
    KUBERNETES_SERVICE_HOST, sending their in-cluster clients to the upper apiserver."""
    r = reflecting()
    for name in ("kubernetes", "web"):
        service = named("Service", name, spec={"ports": [{"port": 443}]})
        service["metadata"]["namespace"] = "default"
        r.above("services", service)
    r.reflector.sync_namespaces({"default"})
    await r.drain()
    assert r.lower.writes() == [("POST", "/api/v1/namespaces/default/services")]
    assert [b["metadata"]["name"] for b in r.created("/api/v1/namespaces/default/services")] == [
        "web"
    ]
    # Nor for a pod it would select, were it given a selector.
    selecting = named("Service", "kubernetes", spec={"selector": {"app": "web"}})
    selecting["metadata"]["namespace"] = "default"
    r.above("services", selecting, "MODIFIED")
    web = pod("web-1", {"app": "web"})
    web["metadata"]["namespace"] = "default"
    r.above(None, web)
    await r.drain()
    assert len(r.created("/api/v1/namespaces/default/services")) == 1


async def test_a_namespace_holding_slices_gets_no_copy_of_another_clusters_claims() -> None:
    """Bound above to a volume, waiting for another node, or not yet given one: unused
    here, its copy would have a disk of its own provisioned (and one copied while its node
    was not chosen yet stays with the claim). One waiting for this node is copied."""
    r = reflecting()
    spec = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    bound = named("PersistentVolumeClaim", "bound", spec={**spec, "volumeName": "pvc-1"})
    elsewhere = named("PersistentVolumeClaim", "elsewhere", spec=spec)
    elsewhere["metadata"]["annotations"] = {keys.SELECTED_NODE_ANNOTATION: "vk-other"}
    here = named("PersistentVolumeClaim", "here", spec=spec)
    here["metadata"]["annotations"] = {keys.SELECTED_NODE_ANNOTATION: OWNER.node_name}
    unbound = named("PersistentVolumeClaim", "unbound", spec=spec)
    for claim in (bound, elsewhere, here, unbound):
        r.above("persistentvolumeclaims", claim)
    r.reflector.sync_namespaces({"shop"})
    await r.drain()
    claims = r.created("/api/v1/namespaces/shop/persistentvolumeclaims")
    assert sorted(body["metadata"]["name"] for body in claims) == ["here"]


async def test_a_claim_the_lower_cluster_bound_is_updated_in_place_and_never_made_again() -> None:
    claims = "/api/v1/namespaces/shop/persistentvolumeclaims"
    claim: dict[str, Any] = {
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data", "namespace": "shop", "uid": "claim-uid", "labels": {}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    r = reflecting()
    r.above("persistentvolumeclaims", claim)
    r.above(None, pod(volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]))
    await r.drain()
    (copy,) = r.created(claims)
    bound = {
        **copy,
        "metadata": {
            **copy["metadata"],
            "resourceVersion": "9",
            "annotations": {
                **copy["metadata"]["annotations"],
                "pv.kubernetes.io/bind-completed": "yes",
            },
        },
        "spec": {**copy["spec"], "volumeName": "pv-below"},
    }
    r.below("persistentvolumeclaims", bound)
    r.lower.requests.clear()
    relabelled = {**claim, "metadata": {**claim["metadata"], "labels": {"tier": "gold"}}}
    r.lower.answer("PUT", f"{claims}/data", status_error(422, "Invalid", "refused"))
    r.above("persistentvolumeclaims", relabelled, "MODIFIED")
    await r.drain()
    (replace,) = [q for q in r.lower.requests if q.method == "PUT"]
    assert replace.body["spec"]["volumeName"] == "pv-below"
    assert replace.body["metadata"]["annotations"]["pv.kubernetes.io/bind-completed"] == "yes"
    assert r.lower.writes() == [("PUT", f"{claims}/data")]


CLAIMS = "/api/v1/namespaces/shop/persistentvolumeclaims"


async def claim_copied_below() -> tuple[Reflecting, dict[str, Any], dict[str, Any]]:
    """A reflector whose claim ``data`` a pod uses, with the claim's copy below; the
    claim and the pod."""
    claim: dict[str, Any] = {
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data", "namespace": "shop", "uid": "claim-uid"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    stateful = pod(volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}])
    r = reflecting()
    r.above("persistentvolumeclaims", claim)
    r.above(None, stateful)
    await r.drain()
    (copy,) = r.created(CLAIMS)
    r.below(
        "persistentvolumeclaims",
        {**copy, "metadata": {**copy["metadata"], "resourceVersion": "3", "uid": "below"}},
    )
    r.lower.requests.clear()
    return r, claim, stateful


async def test_a_claim_copy_outlives_its_pods_and_goes_with_its_upper_claim() -> None:
    # Deleted with the pod, the copy would take the volume's data along.
    r, claim, stateful = await claim_copied_below()

    r.above(None, stateful, "DELETED")
    await r.drain()
    assert r.lower.writes() == []
    assert r.reflector.orphan_keys() == []

    r.above("persistentvolumeclaims", claim, "DELETED")
    await r.drain()
    assert r.lower.writes() == [("DELETE", f"{CLAIMS}/data")]


@pytest.mark.parametrize(
    ("refusal", "tried_again"),
    [
        ('persistentvolumeclaims "data" is forbidden: exceeded quota: disks, requested: '
         "requests.storage=4Gi, used: requests.storage=9Gi, limited: requests.storage=10Gi",
         True),
        ("persistentvolumeclaims \"data\" is forbidden: only dynamically provisioned pvc can "
         "be resized and the storageclass that provisions the pvc must support resize", False),
    ],
    ids=["quota", "class"],
)  # fmt: skip
async def test_a_claims_growth_a_lower_quota_refused_is_tried_again(
    refusal: str, tried_again: bool
) -> None:
    """Refused for now (a quota, until it is raised or room is freed), the growth was
    never tried again: nothing else brings the claim back while its spec stays."""
    r, claim, _stateful = await claim_copied_below()
    grown = copy.deepcopy(claim)
    grown["spec"]["resources"]["requests"]["storage"] = "5Gi"
    grown["metadata"]["labels"] = {"tier": "gold"}
    r.lower.answer("PUT", f"{CLAIMS}/data", status_error(403, "Forbidden", refusal), {})
    r.upper["persistentvolumeclaims"].apply({"type": "MODIFIED", "object": grown})
    key: Key = ("persistentvolumeclaims", "shop", "data")
    if tried_again:
        with pytest.raises(ApiError, match="exceeded quota"):
            await r.reflector.reconcile(key)
    else:
        await r.reflector.reconcile(key)
    # Its labels went meanwhile.
    assert r.lower.writes() == [("PUT", f"{CLAIMS}/data")] * 2


async def test_a_claim_copy_stays_while_a_pod_controls_its_claim() -> None:
    """A StatefulSet scaled down with ``whenScaled: Delete`` makes each removed pod its
    claim's controller, and the StatefulSet again if scaled up before the pod went: the
    copy, deleted meanwhile, would have taken the data along at the pod's next start."""
    r, claim, stateful = await claim_copied_below()
    owner = {"kind": "Pod", "name": "web-2", "uid": "p", "controller": True}
    condemned = {**claim, "metadata": {**claim["metadata"], "ownerReferences": [owner]}}
    r.above("persistentvolumeclaims", condemned, "MODIFIED")
    await r.drain()
    assert r.lower.writes() == []
    # Its pod gone, the garbage collector deletes the claim above: the copy goes with it.
    r.above(None, stateful, "DELETED")
    r.above("persistentvolumeclaims", condemned, "DELETED")
    await r.drain()
    assert r.lower.writes() == [("DELETE", f"{CLAIMS}/data")]


@pytest.mark.parametrize(
    "asks",
    [
        {"storageClassName": ""},
        {"selector": {"matchLabels": {"disk": "nfs-finance"}}},
        {"storageClassName": "manual", "volumeName": "nfs-finance"},
    ],
    ids=["no class", "a selector", "a volume named"],
)
async def test_a_claim_for_a_volume_made_by_hand_is_not_copied_and_its_pod_waits(
    asks: dict[str, Any],
) -> None:
    """Below, the copy bound whichever lower volume it matched: another tenant's data,
    or the lower cluster's own share."""
    claims = "/api/v1/namespaces/shop/persistentvolumeclaims"
    spec = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    claim = named("PersistentVolumeClaim", "data", spec={**spec, **asks})
    user = pod(volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}])
    r = reflecting()
    r.above("persistentvolumeclaims", claim)
    r.above(None, user)
    with pytest.raises(ClaimNotCopied, match="claim data asks for a volume made by hand"):
        await r.reflector.ensure_for_pod(user)
    await r.drain()
    assert r.created(claims) == []
    # A copy made before is left as it is: deleted, it could take its data along.
    copy = desired_copy(claim, NamespaceMapping(), OWNER)
    r.below("persistentvolumeclaims", {**copy, "metadata": {**copy["metadata"], "uid": "below"}})
    await r.reflector.ensure_for_pod(user)
    await r.drain()
    assert r.lower.writes() == []
    # Going (its pods hold it), it is no copy for a new pod, which would wait below for
    # a claim that is then gone.
    going = {**copy["metadata"], "uid": "below", "deletionTimestamp": "2026-11-29T07:00:00Z"}
    r.below("persistentvolumeclaims", {**copy, "metadata": going})
    with pytest.raises(ClaimNotCopied):
        await r.reflector.ensure_for_pod(user)


async def test_a_claim_made_again_above_gets_a_new_copy_not_the_old_volume() -> None:
    """Deleted and made again above while the copy stayed (the virtual node away, or the
    two events merged in its queue): the old copy's volume is the old claim's data."""
    claims = "/api/v1/namespaces/shop/persistentvolumeclaims"
    old_claim: dict[str, Any] = {
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data", "namespace": "shop", "uid": "old-uid"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    stateful = pod(volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}])
    r = reflecting()
    r.above("persistentvolumeclaims", old_claim)
    r.above(None, stateful)
    await r.drain()
    (copy,) = r.created(claims)
    bound = {**copy["spec"], "volumeName": "pv-old"}
    old_copy = {
        **copy,
        "metadata": {**copy["metadata"], "resourceVersion": "3", "uid": "below"},
        "spec": bound,
    }
    r.below("persistentvolumeclaims", old_copy)
    await r.drain()
    r.lower.requests.clear()

    new_claim = {**old_claim, "metadata": {**old_claim["metadata"], "uid": "new-uid"}}
    r.above("persistentvolumeclaims", new_claim, "MODIFIED")
    await r.drain()
    assert r.lower.writes() == [("DELETE", f"{claims}/data")], "never a PUT keeping pv-old"
    r.copies["persistentvolumeclaims"].apply({"type": "DELETED", "object": old_copy})
    await r.drain()
    (fresh,) = r.created(claims)
    assert "volumeName" not in fresh["spec"]
    assert fresh["metadata"]["annotations"][keys.UPPER_UID_ANNOTATION] == "new-uid"


async def test_a_headless_copy_of_a_service_made_again_with_an_address_is_made_again() -> None:
    """Deleted and made again above while the virtual node was away: an update would keep
    the copy headless (its cluster IP cannot change)."""
    r = reflecting()
    r.above(None, pod("web-1", {"app": "web"}))
    service = named("Service", "front", spec={"selector": {"app": "web"}, "clusterIP": "None"})
    r.above("services", service)
    await r.drain()
    (copy,) = r.created("/api/v1/namespaces/shop/services")
    assert copy["spec"]["clusterIP"] == "None"
    r.below("services", {**copy, "metadata": {**copy["metadata"], "uid": "lower-svc"}})
    r.lower.requests.clear()
    r.above("services", named("Service", "front", spec={"selector": {"app": "web"}}), "MODIFIED")
    await r.drain()
    assert r.lower.writes() == [
        ("DELETE", "/api/v1/namespaces/shop/services/front"),
        ("POST", "/api/v1/namespaces/shop/services"),
    ]
    assert "clusterIP" not in r.created("/api/v1/namespaces/shop/services")[0]["spec"]


def taken(error_path: str, existing_path: str, existing: dict[str, Any], r: Reflecting) -> None:
    """The lower apiserver already has an object of that name, not made by us."""
    r.lower.answer("POST", error_path, status_error(409, "AlreadyExists", "exists"))
    r.lower.answer("GET", existing_path, existing)


async def test_a_namesake_below_that_is_not_ours_keeps_the_pod_from_being_made() -> None:
    """The lower cluster's own ServiceAccount (or another upper cluster's copy) of that
    name: the pod would run with someone else's, so it is not made while it is there."""
    r = reflecting()
    r.above("serviceaccounts", account())
    theirs = {"metadata": {"name": "builder", "namespace": "shop", "labels": {}}}
    taken(ACCOUNTS, f"{ACCOUNTS}/builder", theirs, r)
    web = pod(serviceAccountName="builder")
    r.above(None, web)
    with pytest.raises(NameTaken, match="serviceaccounts shop/builder exists in the lower"):
        await r.reflector.ensure_for_pod(web)
    assert r.lower.writes() == [("POST", ACCOUNTS)], "theirs is never overwritten"
    # Gone below: the copy is made, and the pod with it.
    await r.reflector.ensure_for_pod(web)
    (copy,) = r.created(ACCOUNTS)[1:]
    assert copy["metadata"]["labels"] == OWNER.labels()


async def test_a_namesake_below_of_an_object_missing_above_keeps_the_pod_from_being_made() -> None:
    """The pod names a Secret it does not have above (optional, say): below, the lower
    cluster's own or another tenant's copy of that name is what it would get."""
    r = reflecting()
    theirs = {"metadata": {"name": "db-password", "namespace": "shop", "labels": {}}}
    r.lower.answer("GET", f"{SECRETS}/db-password", theirs)
    optional = {"secretRef": {"name": "db-password", "optional": True}}
    web = pod(containers=[{"name": "app", "image": "app", "envFrom": [optional]}])
    r.above(None, web)
    with pytest.raises(NameTaken, match="secrets shop/db-password exists in the lower"):
        await r.reflector.ensure_for_pod(web)
    assert r.lower.writes() == []
    # Not there below either: the pod goes as it would above, without it.
    await r.reflector.ensure_for_pod(web)
    assert r.lower.writes() == []


async def test_a_cluster_wide_namesake_below_is_used_as_it_is() -> None:
    """A PriorityClass the lower cluster has of that name is the lower admin's to set."""
    r = reflecting()
    r.above("priorityclasses", priority_class())
    lower_class = {"metadata": {"name": "high", "labels": {}}, "value": 5}
    taken(PRIORITY_CLASSES, f"{PRIORITY_CLASSES}/high", lower_class, r)
    web = pod(priorityClassName="high")
    r.above(None, web)
    await r.reflector.ensure_for_pod(web)
    assert r.lower.writes() == [("POST", PRIORITY_CLASSES)]


def serving_front() -> Reflecting:
    """Pod web-1 above, selected by Service front, whose EndpointSlice is front-abc."""
    r = reflecting()
    r.above(None, pod("web-1", {"app": "web"}))
    r.above("services", named("Service", "front", spec={"selector": {"app": "web"}}))
    endpoint_slice = named("EndpointSlice", "front-abc", addressType="IPv4", endpoints=[])
    endpoint_slice["metadata"]["labels"] = {"kubernetes.io/service-name": "front"}
    r.above("endpointslices", endpoint_slice)
    return r


async def test_endpoint_slices_go_below_only_beside_our_own_copy_of_their_service() -> None:
    """kube-proxy and DNS group slices by the Service name they carry: beside the lower
    cluster's own Service of that name, they would send its clients to our pods."""
    r = serving_front()
    services, slices = (
        "/api/v1/namespaces/shop/services",
        ("/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices"),
    )
    theirs = {"metadata": {"name": "front", "namespace": "shop", "labels": {}}}
    taken(services, f"{services}/front", theirs, r)
    await r.drain()
    assert r.created(slices) == [], "no slice beside a Service not ours"
    assert ("endpointslices", "shop", "front-abc") not in r.reflector.orphan_keys()
    # Theirs gone, ours made: its slices follow.
    r.above("services", named("Service", "front", spec={"selector": {"app": "web"}}), "MODIFIED")
    await r.drain()
    (copy,) = r.created(services)[1:]
    assert r.created(slices) == [], "not before our Service is there"
    r.below("services", {**copy, "metadata": {**copy["metadata"], "uid": "lower-svc"}})
    await r.drain()
    assert [body["metadata"]["name"] for body in r.created(slices)] == ["front-abc"]


async def test_a_service_a_namesake_held_back_is_copied_once_the_name_is_free() -> None:
    """The lower cluster's own Service of that name goes: the sweep finds the key again
    (our copies' watch never saw theirs go, and nothing above changed)."""
    r = reflecting()
    r.above(None, pod("web-1", {"app": "web"}))
    r.above("services", named("Service", "front", spec={"selector": {"app": "web"}}))
    services = "/api/v1/namespaces/shop/services"
    theirs = {"metadata": {"name": "front", "namespace": "shop", "labels": {}}}
    taken(services, f"{services}/front", theirs, r)
    await r.drain()
    assert r.reflector.taken_keys() == [("services", "shop", "front")]
    no_pods = cast(LowerCluster, SimpleNamespace(orphan_keys=lambda upper_keys: []))
    sweeping = asyncio.create_task(_sweep_orphans(no_pods, list, WorkQueue(), r.reflector))
    await asyncio.sleep(0)
    sweeping.cancel()
    await r.drain()
    (copy,) = r.created(services)[1:]
    assert copy["metadata"]["labels"] == OWNER.labels()
    assert r.reflector.taken_keys() == []


async def test_a_copy_that_failed_while_the_lower_cluster_was_away_is_made_when_it_is_back() -> (
    None
):
    """Its retries backed off for minutes during the outage; the cluster back, every
    copy wanted is reconciled at once, its backoff forgotten."""
    r = reflecting()
    r.above("serviceaccounts", account())
    r.above(None, pod(serviceAccountName="builder"))
    key: Key = ("serviceaccounts", "shop", "builder")
    for _ in range(12):
        r.queue.add_rate_limited(key)
    assert r.queue.retries(key) == 12
    await r.drain()
    r.lower.requests.clear()
    r.reflector.resync()
    assert r.queue.retries(key) == 0
    await r.drain()
    assert r.lower.writes() == [("POST", ACCOUNTS)]


async def test_a_resync_reconciles_the_slices_of_the_services_copied_and_every_copy() -> None:
    """A slice's update failed while the lower cluster was away: not a pod's reference,
    it was left to its backoff, and clients below routed to dead pods for minutes."""
    r = serving_front()
    slice_key: Key = ("endpointslices", "shop", "front-abc")
    kept: Key = ("persistentvolumeclaims", "shop", "data")
    data = named("PersistentVolumeClaim", "data", spec={})
    copy = desired_copy(data, NamespaceMapping(), OWNER)
    r.below("persistentvolumeclaims", {**copy, "metadata": {**copy["metadata"], "uid": "lower"}})
    await r.drain()
    for key in (slice_key, kept):
        for _ in range(12):
            r.queue.add_rate_limited(key)
    r.reflector.resync()
    assert r.queue.retries(slice_key) == r.queue.retries(kept) == 0
    queued = set()
    while len(r.queue):
        key = await r.queue.get()
        queued.add(key)
        r.queue.done(key)
    assert {slice_key, kept} <= queued


async def test_an_endpoint_slice_deleted_above_goes_below_at_once() -> None:
    """Its wanting asks for the upper slice, gone with the delete: the copy is what
    queues it, not the 60 s orphan sweep (clients below would route to dead pods)."""
    r = reflecting()
    r.above(None, pod("web-1", {"app": "web"}))
    r.above("services", named("Service", "front", spec={"selector": {"app": "web"}}))
    labels = {"kubernetes.io/service-name": "front"}
    old_slice = named("EndpointSlice", "front-abc", addressType="IPv4", endpoints=[])
    old_slice["metadata"]["labels"] = labels
    r.above("endpointslices", old_slice)
    await r.drain()
    (service_copy,) = r.created("/api/v1/namespaces/shop/services")
    r.below("services", service_copy)
    await r.drain()
    (copy,) = r.created("/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices")
    r.below("endpointslices", {**copy, "metadata": {**copy["metadata"], "uid": "lower-slice"}})
    await r.drain()
    r.lower.requests.clear()
    r.above("endpointslices", old_slice, "DELETED")
    await r.drain()
    assert r.lower.writes() == [
        ("DELETE", "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices/front-abc")
    ]
