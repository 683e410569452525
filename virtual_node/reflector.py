"""Keeps lower copies of the ConfigMaps, Secrets, PersistentVolumeClaims,
ServiceAccounts and PriorityClasses that mirrored pods refer to, and of the Services that
select them with their EndpointSlices; and of every ConfigMap, Secret, ServiceAccount,
Service and PersistentVolumeClaim of the namespaces holding quota slices in the lower
cluster, whether pods refer to them or not, before any pod arrives.

Level-triggered: for each (kind, upper namespace, name) the desired state is "a copy
equal to the upper object" while a pod on this node refers to it (a Service: selects
it; an EndpointSlice: belongs to such a Service) or its namespace holds slices here, and
"no copy" otherwise; every change on either side only enqueues that key.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from kubekit import keys
from kubekit.client import (
    CONFIGMAPS,
    ENDPOINTSLICES,
    PERSISTENTVOLUMECLAIMS,
    PRIORITYCLASSES,
    SECRETS,
    SERVICEACCOUNTS,
    SERVICES,
    ApiError,
    KubeClient,
    Resource,
    is_not_found,
)
from kubekit.informer import FunctionHandler, Informer, object_key
from kubekit.workqueue import WorkQueue
from virtual_node.lower import ClaimNotCopied, NameTaken
from virtual_node.naming import NamespaceMapping, NamingError
from virtual_node.references import (
    APISERVER_SERVICE,
    JSON,
    Kind,
    copied_from,
    copy_differs,
    desired_copy,
    desired_endpoint_slice,
    desired_priority_class,
    desired_service,
    desired_service_account,
    for_a_volume_made_by_hand,
    hand_made_refusal,
    made_again,
    referenced_objects,
    reflectable,
    replacement,
    selector_matches,
    service_of_slice,
    service_selector,
    standing_for,
    synced_namespace_wide,
    token_account,
)
from virtual_node.translate import Ownership

log = logging.getLogger(__name__)

Key = tuple[Kind, str, str]  # kind, upper namespace ("" for cluster-wide kinds), name
RESOURCES: dict[Kind, Resource] = {
    "configmaps": CONFIGMAPS,
    "secrets": SECRETS,
    "persistentvolumeclaims": PERSISTENTVOLUMECLAIMS,
    "serviceaccounts": SERVICEACCOUNTS,
    "priorityclasses": PRIORITYCLASSES,
    "services": SERVICES,
    "endpointslices": ENDPOINTSLICES,
}
DESIRED: dict[Kind, Callable[[Mapping[str, Any], NamespaceMapping, Ownership], JSON]] = {
    "configmaps": desired_copy,
    "secrets": desired_copy,
    "persistentvolumeclaims": desired_copy,
    "serviceaccounts": desired_service_account,
    "priorityclasses": desired_priority_class,
    "services": desired_service,
    "endpointslices": desired_endpoint_slice,
}


def reflected_key(kind: Kind, namespace: str, name: str) -> Key:
    return (kind, namespace if RESOURCES[kind].namespaced else "", name)


# How the apiserver's ResourceQuota admission words its refusal.
_QUOTA_REFUSAL = "exceeded quota"


class Reflector:
    def __init__(
        self,
        upper_pods: Informer,
        upper_objects: Mapping[Kind, Informer],
        lower: KubeClient,
        lower_copies: Mapping[Kind, Informer],
        mapping: NamespaceMapping,
        owner: Ownership,
        queue: WorkQueue[Key],
    ) -> None:
        self.upper_pods = upper_pods
        self.upper_objects = upper_objects
        self.lower = lower
        self.lower_copies = lower_copies
        self.mapping = mapping
        self.owner = owner
        self.queue = queue
        # Which upper pods refer to each object: the desired state, kept by the pod handler.
        self._users: dict[Key, set[str]] = {}
        self._refs_of_pod: dict[str, set[Key]] = {}
        # The labels of each pod that still needs its references, by namespace: a Service
        # change is matched against these, not against every pod decoded again.
        self._pod_labels: dict[str, dict[str, Mapping[str, str]]] = {}
        # Each Service's selector, and the Services of a namespace by each label pair their
        # selectors hold: a pod's Services are found from its own labels, not by decoding
        # every Service of its namespace on each of its events.
        self._selectors: dict[tuple[str, str], dict[str, str]] = {}
        self._services_by_label: dict[tuple[str, str, str], set[str]] = {}
        # Upper namespaces holding quota slices in this lower cluster.
        self._synced: frozenset[str] = frozenset()
        # Namespaced names held below by an object not ours (the lower cluster's own,
        # another upper cluster's): a pod using that name would get someone else's.
        self._taken: set[Key] = set()
        # The account each upper service-account token Secret names, by (namespace,
        # Secret): its copy is filled below only while a copy of that account is there.
        self._token_accounts: dict[tuple[str, str], str] = {}
        # Accounts made below whose copies the lower cache may not show yet: their token
        # Secrets need not wait for the watch (a pod is made right after them).
        self._accounts_made: set[Key] = set()
        # Copies deleted whose removal the lower cache may not show yet: the UID of each.
        # Taken for still there, a copy deleted as its last pod ended was not made again
        # for the next pod (a StatefulSet's replacement, a Job's next pod), which started
        # below without it.
        self._deleted: dict[Key, str] = {}
        upper_pods.add_handler(
            FunctionHandler(
                add=self._pod_changed,
                update=self._pod_changed,
                delete=self._pod_gone,
            )
        )
        for kind, informer in upper_objects.items():
            informer.add_handler(
                FunctionHandler.on_any(functools.partial(self._upper_changed, kind))
            )
        for kind, informer in lower_copies.items():
            informer.add_handler(
                FunctionHandler.on_any(functools.partial(self._lower_changed, kind))
            )

    def _pod_changed(self, pod: Mapping[str, Any]) -> None:
        key = object_key(pod)
        namespace = pod["metadata"]["namespace"]
        if (pod.get("status") or {}).get("phase") in {"Succeeded", "Failed"}:
            # Ended: it needs nothing more. A pod being deleted still does while its lower
            # copy shuts down (its token, its volumes); it ends, or goes, after that.
            self._pod_gone(pod)
            return
        labels = pod["metadata"].get("labels") or {}
        self._pod_labels.setdefault(namespace, {})[key] = labels
        refs = {
            reflected_key(kind, namespace, name)
            for kind, name in referenced_objects(pod.get("spec") or {})
        }
        refs |= {
            ("services", namespace, name) for name in self._services_selecting(namespace, labels)
        }
        self._set_refs(key, refs)

    def _services_selecting(self, namespace: str, labels: Mapping[str, str]) -> set[str]:
        candidates: set[str] = set()
        for pair in labels.items():
            candidates |= self._services_by_label.get((namespace, *pair), set())
        return {
            name
            for name in candidates
            if selector_matches(self._selectors[(namespace, name)], labels)
        }

    def _index_selector(
        self, namespace: str, name: str, service: Mapping[str, Any] | None
    ) -> dict[str, str]:
        """Indexes a Service's selector as it is now (none once it is gone); returns it."""
        before = self._selectors.pop((namespace, name), {})
        for pair in before.items():
            services = self._services_by_label[(namespace, *pair)]
            services.discard(name)
            if not services:
                del self._services_by_label[(namespace, *pair)]
        selector = service_selector(service) if service is not None else {}
        if selector:
            self._selectors[(namespace, name)] = selector
            for pair in selector.items():
                self._services_by_label.setdefault((namespace, *pair), set()).add(name)
        return selector

    def _pod_gone(self, pod: Mapping[str, Any]) -> None:
        key, namespace = object_key(pod), pod["metadata"]["namespace"]
        in_namespace = self._pod_labels.get(namespace, {})
        in_namespace.pop(key, None)
        if not in_namespace:
            self._pod_labels.pop(namespace, None)
        self._set_refs(key, set())

    def _service_changed(self, namespace: str, name: str) -> None:
        """A new, changed or deleted selector changes which pods need the Service."""
        ref: Key = ("services", namespace, name)
        service = self.upper_objects["services"].get(f"{namespace}/{name}")
        selector = self._index_selector(namespace, name, service)
        for pod_key, labels in self._pod_labels.get(namespace, {}).items():
            refs = self._refs_of_pod.get(pod_key, set())
            if selector_matches(selector, labels) != (ref in refs):
                self._set_refs(pod_key, refs ^ {ref})

    def _set_refs(self, pod_key: str, refs: set[Key]) -> None:
        before = self._refs_of_pod.get(pod_key, set())
        for ref in before - refs:
            users = self._users.get(ref, set())
            users.discard(pod_key)
            if not users:
                self._users.pop(ref, None)
                self._enqueue_dependents_of(ref)
            self.queue.add(ref)
        for ref in refs - before:
            if ref not in self._users:
                self._enqueue_dependents_of(ref)
            self._users.setdefault(ref, set()).add(pod_key)
            self.queue.add(ref)
        if refs:
            self._refs_of_pod[pod_key] = refs
        else:
            self._refs_of_pod.pop(pod_key, None)

    def _enqueue_dependents_of(self, ref: Key) -> None:
        """What is wanted below with a Service (its slices) or a token Secret (its
        account), now that the Service or Secret is wanted or not."""
        self._enqueue_slices_of(ref)
        account = self._account_of_token(ref)
        if account is not None:
            self.queue.add(account)

    def _enqueue_slices_of(self, ref: Key) -> None:
        for key in self._slices_of(ref):
            self.queue.add(key)

    def _slices_of(self, ref: Key) -> Iterator[Key]:
        kind, namespace, name = ref
        if kind != "services":
            return
        for endpoint_slice in self.upper_objects["endpointslices"].items(namespace):
            if service_of_slice(endpoint_slice) == name:
                yield ("endpointslices", namespace, endpoint_slice["metadata"]["name"])

    def _upper_changed(self, kind: Kind, obj: Mapping[str, Any]) -> None:
        metadata = obj["metadata"]
        key = reflected_key(kind, metadata.get("namespace") or "", metadata["name"])
        if kind == "services":
            self._service_changed(key[1], key[2])
        if kind == "secrets":
            self._token_changed(key, obj)
        # An object deleted above may no longer be wanted (a claim, an EndpointSlice, whose
        # wanting asks for the upper object): its copy goes with it.
        if self._wanted(key) or self._has_copy(key):
            self.queue.add(key)

    def _token_changed(self, key: Key, secret: Mapping[str, Any]) -> None:
        _, namespace, name = key
        before = self._account_of_token(key)
        there = self.upper_objects["secrets"].get(f"{namespace}/{name}") is not None
        account = token_account(secret) if there else None
        if account is None:
            self._token_accounts.pop((namespace, name), None)
        else:
            self._token_accounts[(namespace, name)] = account
        for changed in (before, self._account_of_token(key)):
            if changed is not None:
                self.queue.add(changed)

    def _copy(self, key: Key) -> JSON | None:
        kind, namespace, name = key
        try:
            lower_namespace = self.mapping.lower(namespace) if namespace else ""
        except NamingError:
            return None
        return self.lower_copies[kind].get(f"{lower_namespace}/{name}" if lower_namespace else name)

    def _has_copy(self, key: Key) -> bool:
        return self._copy(key) is not None

    def _has_copy_of(self, key: Key, upper: Mapping[str, Any]) -> bool:
        """Whether this very upper object has a copy below that stays."""
        copy = self._copy(key)
        return copy is not None and standing_for(copy) == upper["metadata"].get("uid")

    def sync_namespaces(self, namespaces: Iterable[str]) -> None:
        """Keeps every object of these upper namespaces below (they hold quota slices
        here), not only those pods refer to; a namespace left out is back to those."""
        synced = frozenset(namespaces)
        changed, self._synced = synced ^ self._synced, synced
        for namespace in changed:
            for key in self._upper_keys_of(namespace):
                self.queue.add(key)
            try:
                lower_namespace = self.mapping.lower(namespace)
            except NamingError:
                continue
            for kind, informer in self.lower_copies.items():
                for copy in informer.items(lower_namespace) if RESOURCES[kind].namespaced else ():
                    self._lower_changed(kind, copy)

    def _upper_keys_of(self, namespace: str) -> Iterator[Key]:
        for kind, informer in self.upper_objects.items():
            if RESOURCES[kind].namespaced:
                for obj in informer.items(namespace):
                    yield (kind, namespace, obj["metadata"]["name"])

    def resync(self) -> None:
        """Every copy wanted reconciled again now, its backoff forgotten: after the lower
        cluster was unreachable, one whose update failed meanwhile (a Secret rotated
        above) waited out its retry delay, up to 5 minutes, with nothing else to wake it."""
        wanted = {*self._users, *self._taken}
        for namespace in self._synced:
            wanted.update(self._upper_keys_of(namespace))
        # Every copy below (a kept claim, a slice, an account wanted for its token), and
        # what goes with a Service (its slices) or a token Secret (its account).
        for kind, informer in self.lower_copies.items():
            copies = (self._key_of_copy(kind, copy) for copy in informer.items())
            wanted.update(key for key in copies if key is not None)
        for key in list(wanted):
            wanted.update(self._slices_of(key))
            account = self._account_of_token(key)
            if account is not None:
                wanted.add(account)
        for key in wanted:
            self.queue.forget(key)
            self.queue.add(key)

    def _wanted(self, key: Key) -> bool:
        kind, namespace, name = key
        if kind == "persistentvolumeclaims" and self._claim_kept(namespace, name):
            return True
        if kind == "serviceaccounts" and self._named_by_needed_token(namespace, name):
            return True
        if kind == "secrets" and not self._account_copied(key):
            return False
        if kind != "endpointslices":
            return self._needed(key)
        upper = self.upper_objects[kind].get(f"{namespace}/{name}")
        if upper is None:
            return False
        # Only beside our own copy of its Service: kube-proxy and DNS group slices by the
        # Service name they carry, so a slice beside a Service of that name that is not
        # ours (the lower cluster's own, another upper cluster's) would send its traffic
        # to our pods.
        service: Key = ("services", namespace, service_of_slice(upper))
        return self._wanted(service) and self._has_copy(service)

    def _needed(self, key: Key) -> bool:
        """Referred to by a pod here, or of a namespace holding quota slices here (a claim
        only once the upper scheduler chose this node for it)."""
        kind, namespace, name = key
        if key == APISERVER_SERVICE:
            return False
        return key in self._users or (
            namespace in self._synced
            and synced_namespace_wide(kind, name)
            and (kind != "persistentvolumeclaims" or self._claim_may_bind_here(namespace, name))
        )

    def _claim_may_bind_here(self, namespace: str, name: str) -> bool:
        """Whether the upper scheduler chose this node for the claim's first pod. Another
        claim is copied only for a pod here that uses it: one copied before its node was
        chosen (a StatefulSet makes it before its pod), or bound above, is another
        cluster's as often as not, and its copy, kept with the claim, would have a disk
        of its own provisioned (Immediate binding) or bind a volume someone else needs."""
        upper = self.upper_objects["persistentvolumeclaims"].get(f"{namespace}/{name}")
        annotations = (upper or {}).get("metadata", {}).get("annotations") or {}
        return bool(annotations.get(keys.SELECTED_NODE_ANNOTATION) == self.owner.node_name)

    def _named_by_needed_token(self, namespace: str, account: str) -> bool:
        """Whether a token Secret needed below names this account (but `default`, which
        every namespace has of its own): the Secret's copy waits for the account's."""
        return synced_namespace_wide("serviceaccounts", account) and any(
            (secret_namespace, named) == (namespace, account)
            and self._needed(("secrets", namespace, secret))
            for (secret_namespace, secret), named in self._token_accounts.items()
        )

    def _account_copied(self, key: Key) -> bool:
        """Whether the account a token Secret names is ours below (or `default`): the
        lower tokens controller matches the account by name, and would fill the copy
        with a token of someone else's account of that name (the lower cluster's own,
        another upper cluster's). True for other Secrets."""
        account = self._account_of_token(key)
        return (
            account is None
            or not synced_namespace_wide("serviceaccounts", account[2])
            or account in self._accounts_made
            or self._has_copy(account)
        )

    def _enqueue_tokens_of(self, key: Key) -> None:
        """The token Secrets naming an account whose copy came or went."""
        kind, namespace, name = key
        if kind != "serviceaccounts":
            return
        for (secret_namespace, secret), account in self._token_accounts.items():
            if (secret_namespace, account) == (namespace, name):
                self.queue.add(("secrets", namespace, secret))

    def _account_of_token(self, key: Key) -> Key | None:
        kind, namespace, name = key
        account = self._token_accounts.get((namespace, name)) if kind == "secrets" else None
        return ("serviceaccounts", namespace, account) if account else None

    def _claim_kept(self, namespace: str, name: str) -> bool:
        """A claim's copy, once made, stays as long as its upper claim: gone with its last
        pod, it would take the volume's data along, and a StatefulSet deletes and makes
        its pods again on every update."""
        if self.upper_objects["persistentvolumeclaims"].get(f"{namespace}/{name}") is None:
            return False
        return self._has_copy(("persistentvolumeclaims", namespace, name))

    def _lower_changed(self, kind: Kind, obj: Mapping[str, Any]) -> None:
        key = self._key_of_copy(kind, obj)
        if key is not None:
            self._accounts_made.discard(key)  # the cache shows it, or its deletion
            self.queue.add(key)
            # Its slices, or its token Secrets, are wanted while the copy is there.
            self._enqueue_slices_of(key)
            self._enqueue_tokens_of(key)

    @staticmethod
    def _key_of_copy(kind: Kind, obj: Mapping[str, Any]) -> Key | None:
        metadata = obj["metadata"]
        if not RESOURCES[kind].namespaced:
            return (kind, "", metadata["name"])
        namespace = (metadata.get("annotations") or {}).get(keys.UPPER_NAMESPACE_ANNOTATION)
        return (kind, namespace, metadata["name"]) if namespace else None

    def orphan_keys(self) -> list[Key]:
        """Keys of lower copies that no pod needs any more (for the periodic sweep)."""
        found: list[Key] = []
        for kind, informer in self.lower_copies.items():
            for obj in informer.items():
                key = self._key_of_copy(kind, obj) or (kind, "", obj["metadata"]["name"])
                if not self._wanted(key):
                    found.append(key)
        return found

    def taken_keys(self) -> list[Key]:
        """Keys whose name below an object not ours holds (for the periodic sweep): the
        watch of our copies never sees that object go, and a Service, or what a
        namespace's quota slices bring, was copied only once its upper object changed."""
        return list(self._taken)

    async def ensure_for_pod(self, pod: Mapping[str, Any]) -> None:
        """Brings the copies a pod needs up to date now, before the pod is created below:
        through the queue, so no worker reconciles the same key meanwhile."""
        namespace = pod["metadata"]["namespace"]
        refs = [
            reflected_key(kind, namespace, name)
            for kind, name in sorted(referenced_objects(pod.get("spec") or {}))
        ]
        # The account a token Secret names first: the lower tokens controller deletes a
        # token Secret whose account is not there.
        accounts = {
            account
            for ref in refs
            if (account := self._account_of_token(ref))
            and synced_namespace_wide("serviceaccounts", account[2])  # not `default`
        }
        for key in [*sorted(accounts), *(ref for ref in refs if ref not in accounts)]:
            kind, _, name = key
            await self.queue.process_now(key, self.reconcile)
            claim = self.upper_objects[kind].get(f"{namespace}/{name}")
            if (
                RESOURCES[kind] is PERSISTENTVOLUMECLAIMS
                and claim is not None
                and for_a_volume_made_by_hand(claim)
                and not self._has_copy_of(key, claim)
            ):
                raise ClaimNotCopied(hand_made_refusal(f"claim {name}"))
            if key in self._taken:
                raise NameTaken(
                    f"{RESOURCES[kind].plural} {self.mapping.lower(namespace)}/{name} exists "
                    f"in the lower cluster and was not made by this upper cluster: the pod "
                    "would get it instead of its own (or of none, if it has none above)"
                )

    async def run(self, workers: int) -> None:
        await self.queue.run_workers(workers, self.reconcile)

    async def reconcile(self, key: Key) -> None:
        kind, namespace, name = key
        resource = RESOURCES[kind]
        try:
            lower_namespace = self.mapping.lower(namespace) if resource.namespaced else ""
        except NamingError:
            return
        upper = self.upper_objects[kind].get(f"{namespace}/{name}" if namespace else name)
        lower = self.lower_copies[kind].get(
            f"{lower_namespace}/{name}" if lower_namespace else name
        )
        if (gone := self._deleted.get(key)) is not None:
            if lower is not None and lower["metadata"].get("uid") == gone:
                lower = None
            else:
                del self._deleted[key]  # the cache has caught up
        self._taken.discard(key)
        if (
            resource is PERSISTENTVOLUMECLAIMS
            and upper is not None
            and lower is not None
            and copied_from(lower) not in (None, upper["metadata"]["uid"])
        ):
            # The copy of an earlier claim of that name (deleted and made again above
            # while this process was away, or between two reconciles): its volume is the
            # old claim's data. It goes; its removal brings the key back for a new copy.
            if not lower["metadata"].get("deletionTimestamp"):
                await self.lower.delete_exact(resource, lower)
            return
        if (
            resource is PERSISTENTVOLUMECLAIMS
            and upper is not None
            and lower is not None
            and not reflectable(upper)
        ):
            # Copied before it was refused, or before a pod came to control it (a
            # StatefulSet scaled down hands the claims of the pods it removes to them,
            # and back if scaled up again first): deleted, it could take its data along.
            return
        if self._wanted(key) and upper is not None and reflectable(upper):
            desired = DESIRED[kind](upper, self.mapping, self.owner)
            if lower is None:
                if namespace and self.mapping.refusal(namespace):
                    return  # its pod is refused too
                if not await self._create(resource, desired, lower_namespace) and namespace:
                    self._taken.add(key)
                elif resource is SERVICEACCOUNTS:
                    self._accounts_made.add(key)
            elif made_again(lower, desired):
                await self.lower.delete_exact(resource, lower)
                await self._create(resource, desired, lower_namespace)
            elif copy_differs(lower, desired):
                await self._replace(resource, lower, desired, lower_namespace)
        elif lower is not None:
            await self.lower.delete_exact(resource, lower)
            if resource is not PERSISTENTVOLUMECLAIMS:
                # Gone once deleted (a claim's protection holds it until its pods end).
                self._deleted[key] = lower["metadata"]["uid"]
        elif (
            upper is None
            and namespace
            and self._wanted(key)
            and await self._someone_elses(resource, name, lower_namespace)
        ):
            # Named by a pod and missing above (an optional reference, one not made yet):
            # a namesake below, the lower cluster's own or another tenant's copy, would be
            # what the pod gets instead of nothing.
            self._taken.add(key)

    async def _someone_elses(self, resource: Resource, name: str, namespace: str) -> bool:
        try:
            existing = await self.lower.get(resource, name, namespace)
        except ApiError as error:
            if is_not_found(error):
                return False
            raise
        return not self.owner.owns(existing)

    async def _create(self, resource: Resource, desired: dict[str, Any], namespace: str) -> bool:
        """False when the name is someone else's below (never overwritten)."""
        try:
            await self.lower.create(resource, desired, namespace)
        except ApiError as error:
            if error.status != 409:
                raise
            existing = await self.lower.get(resource, desired["metadata"]["name"], namespace)
            if not self.owner.owns(existing):
                log.warning(
                    "%s %s/%s exists below and is not ours; left alone",
                    resource.plural,
                    namespace,
                    desired["metadata"]["name"],
                )
                return False
        return True

    async def _replace(
        self, resource: Resource, lower: Mapping[str, Any], desired: dict[str, Any], namespace: str
    ) -> None:
        try:
            await self.lower.replace(resource, replacement(lower, desired), namespace)
        except ApiError as error:
            # Any other refusal (a lower admission policy's 422, say) is retried with
            # backoff, the copy kept: ``made_again`` knows what only a new copy takes.
            if resource is not PERSISTENTVOLUMECLAIMS or error.status not in (403, 422):
                raise
            # Never made again: a claim deleted below may take its volume's data along.
            # A growth its class does not allow (403) or an unbound claim's (422) is left
            # out; its labels and annotations still go.
            log.warning(
                "claim %s/%s: update refused below, left as it is: %s",
                namespace,
                desired["metadata"]["name"],
                error.message,
            )
            without_growth = replacement(lower, {**desired, "spec": lower.get("spec") or {}})
            if without_growth != replacement(lower, desired):
                with contextlib.suppress(ApiError):
                    await self.lower.replace(resource, without_growth, namespace)
            if error.status == 403 and _QUOTA_REFUSAL in error.message:
                # A lower quota's refusal lasts only until it is raised or room is freed:
                # tried again with backoff (nothing else brings the claim back).
                raise
