"""Lower namespaces removed with their upper namespace.

The virtual node makes a lower namespace for the first pod (or quota slice) of an upper
namespace. Deleting the upper namespace deletes its pods, and each goes below first, but
the lower namespace stayed: every namespace ever used above left an empty one (its
ServiceAccount, root CA ConfigMap and events) in every lower cluster. It is deleted once
the upper namespace is gone, and only then: while the upper one terminates, its pods are
still being deleted below with their grace periods.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kubekit import keys
from kubekit.client import (
    CONFIGMAPS,
    NAMESPACES,
    PERSISTENTVOLUMECLAIMS,
    RESOURCEQUOTAS,
    SECRETS,
    SERVICEACCOUNTS,
    SERVICES,
    ApiError,
    KubeClient,
    is_not_found,
)
from kubekit.informer import FunctionHandler, Informer, object_key
from kubekit.workqueue import WorkQueue
from virtual_node.naming import NamespaceMapping, NamingError
from virtual_node.references import copied_from
from virtual_node.translate import Ownership

log = logging.getLogger(__name__)


def others_objects(objects: Iterable[Mapping[str, Any]], owner: Ownership) -> list[str]:
    """The objects of a lower namespace that are not this upper cluster's: another upper
    cluster's copies, or the lower cluster's own. A namespace holding pods or claims of
    others is left: deleting it would take their pods, or their claims' volumes."""
    return [
        object_key(obj)
        for obj in objects
        if (obj["metadata"].get("labels") or {}).get(keys.ORIGIN_LABEL) != owner.origin
    ]


def other_tenants_objects(objects: Iterable[Mapping[str, Any]], owner: Ownership) -> list[str]:
    """The objects another upper cluster made (its copies, its quota of slices), which
    share a lower namespace of the same name under the ``same`` strategy."""
    return [
        object_key(obj)
        for obj in objects
        if (origin := (obj["metadata"].get("labels") or {}).get(keys.ORIGIN_LABEL))
        and origin != owner.origin
    ]


# Besides claims, the kinds another upper cluster's copies may hold in a lower namespace
# we made, none of them in a cache here (the copies' caches hold ours only): listed once,
# when the namespace would go. Until 2026-11-29 they were not, and went with it. Objects
# of these kinds with no origin are not counted: the lower cluster's controllers put
# some in every namespace (a service mesh's root CA, a platform's build accounts).
OTHER_TENANTS_KINDS = (CONFIGMAPS, SECRETS, SERVICES, SERVICEACCOUNTS, RESOURCEQUOTAS)


KEPT_NAMESPACE_RECHECK_SECONDS = 300.0
# Looked at again this soon when our own pods there are not being deleted yet: most often
# their upper pods' deletion is on its way down.
OWN_PODS_RECHECK_SECONDS = 5.0


class LowerNamespaces:
    """Deletes the lower namespaces this upper cluster made whose upper namespace is gone;
    keyed by lower namespace."""

    def __init__(
        self,
        upper: KubeClient,
        upper_namespaces: Informer,
        lower: KubeClient,
        lower_namespaces: Informer,
        lower_pods: Informer,
        upper_claims: Informer,
        mapping: NamespaceMapping,
        owner: Ownership,
        forget: Callable[[str], None],
        queue: WorkQueue[str],
    ) -> None:
        self.upper = upper
        self.upper_namespaces = upper_namespaces
        self.lower = lower
        self.lower_namespaces = lower_namespaces  # ours only: selected by our labels
        self.lower_pods = lower_pods
        self.upper_claims = upper_claims
        self.mapping = mapping
        self.owner = owner
        # Tells the pod mirror that a namespace it made is gone, so it makes it again.
        self.forget = forget
        self.queue = queue
        lower_namespaces.add_handler(
            FunctionHandler(
                add=lambda namespace: queue.add(namespace["metadata"]["name"]),
                update=lambda namespace: queue.add(namespace["metadata"]["name"]),
            )
        )
        upper_namespaces.add_handler(FunctionHandler(delete=self._upper_deleted))

    def _upper_deleted(self, namespace: Mapping[str, Any]) -> None:
        # A name too long to map had no lower namespace made for it.
        with contextlib.suppress(NamingError):
            self.queue.add(self.mapping.lower(namespace["metadata"]["name"]))

    async def _upper_exists(self, name: str) -> bool:
        try:
            await self.upper.get(NAMESPACES, name)
        except ApiError as error:
            if not is_not_found(error):
                raise
            return False
        return True

    def _claims_still_above(
        self, claims: Iterable[Mapping[str, Any]], gone: str | None
    ) -> list[str]:
        """Of our claim copies, those whose upper claim (by the namespace and UID they
        were copied from) still exists; none of ``gone``, the upper namespace found gone.
        A lower namespace holding one was made under another namespace mapping: after
        ``prefix`` became ``same``, ``acme-dev`` names an upper namespace of its own, which
        is gone, while ``dev``'s claims are copied there. Until 2026-11-29 it was deleted,
        their volumes (the claims' data) with it."""
        held = []
        for claim in claims:
            metadata = claim["metadata"]
            upper_namespace = (metadata.get("annotations") or {}).get(
                keys.UPPER_NAMESPACE_ANNOTATION
            )
            if not upper_namespace or upper_namespace == gone:
                continue
            upper = self.upper_claims.get(f"{upper_namespace}/{metadata['name']}")
            if upper is not None and upper["metadata"].get("uid") == copied_from(claim):
                held.append(f"{upper_namespace}/{metadata['name']}")
        return held

    async def run(self, workers: int) -> None:
        await self.queue.run_workers(workers, self.reconcile)

    async def reconcile(self, name: str) -> None:
        namespace = self.lower_namespaces.get(name)
        if namespace is None or namespace["metadata"].get("deletionTimestamp"):
            return
        upper_name = self.mapping.upper(name)
        if upper_name is None or self.upper_namespaces.get(upper_name) is not None:
            return
        if await self._upper_exists(upper_name):
            return  # the cache has not heard of it yet
        pods = list(self.lower_pods.items(name))
        others = others_objects(pods, self.owner)
        staying = [
            p
            for p in pods
            if object_key(p) not in others and not p["metadata"].get("deletionTimestamp")
        ]
        if staying:
            # Our pods there not being deleted: the namespace was made again above (`kubectl
            # delete ns x --wait && kubectl create ns x`) and its pods mirrored into this
            # one, or their deletion is still to come. Deleted, it would take them along.
            self.queue.add_after(name, OWN_PODS_RECHECK_SECONDS)
            return
        if not others:
            # Claims of others are not in any cache here (the claims' copies are ours
            # only); asked for once, when the namespace would go.
            claims = (await self.lower.list(PERSISTENTVOLUMECLAIMS, name)).get("items") or []
            others = others_objects(claims, self.owner)
            if not others and (held := self._claims_still_above(claims, upper_name)):
                log.warning(
                    "namespace %s: no upper namespace %s, but kept below for the copies of "
                    "claims that still exist above (%s): made under another namespace "
                    "mapping; deleted, it would take their volumes along. Looked at again "
                    "in %.0f s",
                    name,
                    upper_name,
                    ", ".join(held[:3]),
                    KEPT_NAMESPACE_RECHECK_SECONDS,
                )
                self.queue.add_after(name, KEPT_NAMESPACE_RECHECK_SECONDS)
                return
        for resource in OTHER_TENANTS_KINDS:
            if others:
                break
            listed = await self.lower.list(resource, name)
            others = other_tenants_objects(listed.get("items") or [], self.owner)
        if others:
            log.warning(
                "namespace %s: gone above, kept below for objects not of this upper cluster "
                "(%s); looked at again in %.0f s",
                name,
                ", ".join(sorted(others)[:3]),
                KEPT_NAMESPACE_RECHECK_SECONDS,
            )
            # Nothing here hears of their objects going (claims are not watched): the
            # namespace would stay until the next restart.
            self.queue.add_after(name, KEPT_NAMESPACE_RECHECK_SECONDS)
            return
        if await self._upper_exists(upper_name):
            return  # made again above while the claims were listed
        await self.lower.delete_exact(NAMESPACES, namespace)
        self.forget(name)
        log.info("namespace %s: gone above, deleted below", name)
