"""The quota slices a lower cluster promised: its answers to the multischeduler's slice
placement (``SliceRoom``, ``PromiseSlices`` over the estimator's gRPC service).

The promises are recorded in the lower cluster itself, so that every tenant sharing it
sees those of the others: one ledger ConfigMap (``keys.SLICE_LEDGER_CONFIGMAP`` in the
system namespace below) written with its resourceVersion, so the lower apiserver lets
one of two concurrent promises through and the other is judged again on what won; and a
ResourceQuota (``keys.SLICE_QUOTA``) in each sliced lower namespace, which the lower
apiserver enforces on the pods.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kubekit import keys
from kubekit.client import (
    API_ERRORS,
    CONFIGMAPS,
    RESOURCEQUOTAS,
    ApiError,
    KubeClient,
    is_not_found,
)
from kubekit.fit import pod_requests
from kubekit.informer import Informer
from kubekit.slices import (
    Amount,
    ClusterRoom,
    LedgerEntry,
    SliceError,
    amount,
    entry_origin,
    headroom,
    held_namespaces,
    ledger_entry,
    promised_to_others,
    quota_hard,
)
from virtual_node.capacity import node_counts
from virtual_node.naming import NamespaceMapping
from virtual_node.podcontroller import FINISHED
from virtual_node.translate import Ownership

log = logging.getLogger(__name__)


class PromiseRefused(Exception):
    """The promise would take room the cluster does not have, or is not ours to change."""


@dataclass(frozen=True)
class SliceRoom:
    nodes: tuple[Amount, ...]
    promised_to_others: Amount
    # The namespace's own entry in the ledger: its slices and their size.
    held: int
    held_slice: Amount
    used: Amount
    # The namespace's own entry cannot be read: it holds nothing here (held is 0) until
    # the next promise writes it again.
    held_unreadable: bool = False


def slice_room(node: dict[str, Any], counted_taint_keys: Collection[str]) -> Amount | None:
    """A lower node's allocatable if its room counts (as for the virtual Node's
    capacity: Ready, not cordoned, no taint federated pods do not tolerate)."""
    if not node_counts(node, counted_taint_keys):
        return None
    try:
        return amount((node.get("status") or {}).get("allocatable") or {}, round_up=False)
    except SliceError:
        return None


class SlicePromises:
    def __init__(
        self,
        client: KubeClient,
        nodes: Informer,
        pods: Informer,
        mapping: NamespaceMapping,
        owner: Ownership,
        ensure_namespace: Callable[[str], Awaitable[None]],
        counted_taint_keys: Collection[str] = (),
        counted: Callable[[str], Amount] = lambda _namespace: Amount(),
    ) -> None:
        self.client = client
        self.nodes = nodes
        self.pods = pods
        self.mapping = mapping
        self.owner = owner
        self.ensure_namespace = ensure_namespace
        self.counted_taint_keys = counted_taint_keys
        # What the estimator counts against a lower namespace's slices here: its pods
        # bound to this virtual node or holding room, lower copies made or not.
        self.counted = counted

    def _node_room(self) -> tuple[Amount, ...]:
        found = (slice_room(node, self.counted_taint_keys) for node in self.nodes.items())
        return tuple(sorted(room for room in found if room is not None))

    def _used(self, lower_namespace: str) -> Amount:
        """What the namespace's pods use here: its lower pods' requests, or what the
        estimator counts against its slices where that is more (a pod bound or holding
        room, its lower copy not made yet: its slice taken back, it would find none)."""
        below = sum(
            (
                requested(pod)
                for pod in self.pods.items(lower_namespace)
                if (pod.get("status") or {}).get("phase") not in FINISHED
            ),
            Amount(),
        )
        return below.most(self.counted(lower_namespace))

    async def _ledger(self) -> dict[str, str]:
        try:
            ledger = await self.client.get(
                CONFIGMAPS, keys.SLICE_LEDGER_CONFIGMAP, keys.SYSTEM_NAMESPACE
            )
        except ApiError as error:
            if is_not_found(error):
                return {}
            raise
        return dict(ledger.get("data") or {})

    async def sliced_namespaces(self) -> set[str]:
        """The upper namespaces of this virtual node's upper cluster holding slices here."""
        return held_namespaces(await self._ledger(), self.owner.origin)

    async def room(self, upper_namespace: str) -> SliceRoom:
        lower_namespace = self.mapping.lower(upper_namespace)
        ledger = await self._ledger()
        own = ledger.get(lower_namespace)
        unreadable = False
        try:
            entry = ledger_entry(lower_namespace, own) if own else None
        except SliceError as error:
            # Told as holding nothing, so the multischeduler writes it again: refused an
            # answer, it counted this cluster silent, never took the entry back, and
            # every namespace of every tenant saw the cluster's room as promised.
            log.warning("%s; told as holding nothing, to be written again", error)
            entry, unreadable = None, True
        foreign = _foreign_origin(own, self.owner.origin)
        unreadable = unreadable and not foreign
        if foreign:
            entry = None  # another upper cluster's: refused when promised
        if entry is not None:
            # The quota is written after the ledger: a write that failed (a 409, a crash
            # between the two) leaves it behind the ledger, and the multischeduler, which
            # reads the ledger, promises nothing more. Each look brings it in step, the
            # namespace first: deleted with its upper namespace while the multischeduler
            # was away, and that one made again, the ledger entry outlived it.
            try:
                if entry.slices:
                    await self.ensure_namespace(lower_namespace)
                    await self._hold_to(lower_namespace, entry)
                else:
                    await self._take_quota_back(lower_namespace)
            except API_ERRORS as error:
                log.warning("%s: quota not brought to its promise: %s", lower_namespace, error)
        nodes = self._node_room()
        try:
            others = promised_to_others(ledger, lower_namespace)
        except SliceError as error:
            # Counted as all the room: no growth here while it cannot be read, but the
            # namespace's own slices are still told, so they can be given back.
            log.warning("%s; no room offered beside it", error)
            others = sum(nodes, Amount())
        if foreign:
            # Every promise to it here is refused: room offered, this cluster would be
            # chosen for it, refused, and chosen again for ever.
            log.warning(
                "%s holds slices of another upper cluster: no room offered to %s",
                lower_namespace,
                upper_namespace,
            )
            others = sum(nodes, Amount())
        return SliceRoom(
            nodes=nodes,
            promised_to_others=others,
            held=entry.slices if entry is not None else 0,
            held_slice=entry.size if entry is not None else Amount(),
            used=self._used(lower_namespace),
            held_unreadable=unreadable,
        )

    async def promise(
        self, upper_namespace: str, slices: int, size: Amount, headroom_text: str
    ) -> None:
        """Records the promise (raises PromiseRefused), then holds the namespace to it."""
        lower_namespace = self.mapping.lower(upper_namespace)
        kept_out = headroom(headroom_text)
        entry = LedgerEntry(upper_namespace, self.owner.origin, slices, size)

        def record(ledger: dict[str, str]) -> dict[str, str]:
            text = ledger.get(lower_namespace)
            if text and _foreign_origin(text, self.owner.origin):
                # Another tenant's, broken or not: theirs to take back.
                raise PromiseRefused(
                    f"lower namespace {lower_namespace} holds slices of another upper cluster "
                    f"({entry_origin(text)}); give each tenant a namespace prefix"
                )
            if text and not _readable(lower_namespace, text):
                # Its own entry unreadable: nothing of it can be kept. Taken back, or
                # written again as a new promise (held to the room like any growth).
                ledger.pop(lower_namespace)
                text = None
            before = ledger_entry(lower_namespace, text) if text else None
            if not entry.promised.within(before.promised if before is not None else Amount()):
                cluster = ClusterRoom(
                    self.owner.cluster_id,
                    self._node_room(),
                    promised_to_others(ledger, lower_namespace),
                    kept_out,
                )
                room_for = cluster.slots(size)
                if slices > room_for:
                    raise PromiseRefused(
                        f"{self.owner.cluster_id} has room for {room_for} slices of "
                        f"{size.describe()}, not {slices}"
                    )
            if slices:
                ledger[lower_namespace] = entry.encode()
            else:
                ledger.pop(lower_namespace, None)
            return ledger

        if slices:
            # Before the ledger names it: the namespace-wide copies it sets off need it.
            await self.ensure_namespace(lower_namespace)
        else:
            # Before the ledger forgets it: the entry gone, nothing would look at the
            # namespace here again, and a quota left by a delete that failed would cap
            # its pods for good (and have every container declare cpu and memory).
            await self._take_quota_back(lower_namespace)
        try:
            await self.client.update_configmap_data(
                keys.SYSTEM_NAMESPACE, keys.SLICE_LEDGER_CONFIGMAP, record
            )
        except SliceError as error:
            raise PromiseRefused(str(error)) from None
        if slices:
            await self._hold_to(lower_namespace, entry)

    async def _take_quota_back(self, lower_namespace: str) -> None:
        """Deletes the namespace's slice quota if a virtual node of this upper cluster made
        it (under this node name or an earlier one): another tenant's, in a lower
        namespace both map to, is theirs."""
        try:
            quota = await self.client.get(RESOURCEQUOTAS, keys.SLICE_QUOTA, lower_namespace)
        except ApiError as error:
            if is_not_found(error):
                return
            raise
        if self.owner.upper_cluster_owns(quota):
            await self.client.delete_exact(RESOURCEQUOTAS, quota)

    async def _hold_to(self, lower_namespace: str, entry: LedgerEntry) -> None:
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {
                "name": keys.SLICE_QUOTA,
                "namespace": lower_namespace,
                "labels": self.owner.labels(),
                "annotations": {keys.UPPER_NAMESPACE_ANNOTATION: entry.namespace},
            },
            "spec": {"hard": quota_hard(entry)},
        }
        try:
            current = await self.client.get(RESOURCEQUOTAS, keys.SLICE_QUOTA, lower_namespace)
        except ApiError as error:
            if not is_not_found(error):
                raise
            await self.client.create(RESOURCEQUOTAS, body, lower_namespace)
        else:
            if current.get("spec", {}).get("hard") == body["spec"]["hard"]:
                return
            body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            await self.client.replace(RESOURCEQUOTAS, body, lower_namespace)
        log.info(
            "%s: %d slices of %s promised", lower_namespace, entry.slices, entry.size.describe()
        )


def _readable(key: str, text: str) -> bool:
    try:
        ledger_entry(key, text)
    except SliceError:
        return False
    return True


def requested(pod: Mapping[str, Any]) -> Amount:
    """A pod's cpu and memory requests, as the scheduler and quota count them."""
    requests = pod_requests(pod)
    return Amount(
        cpu=math.ceil(requests.get("cpu", 0) * 1000), memory=math.ceil(requests.get("memory", 0))
    )


class SliceBudgets:
    """What each sliced lower namespace may still take here, for the fit estimator: its
    promise (the ledger, from a watch of its ConfigMap) less the requests of the pods
    counted against it: bound to this virtual node and not finished, or holding a
    reservation of the estimator. Kept by pod UID, so a reserved pod that is then bound
    counts once, and so a burst judged before its first pod lands never overspends."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self._promised: dict[str, LedgerEntry] = {}
        # Entries that cannot be read: their namespaces take nothing more here.
        self._unreadable: set[str] = set()
        self._pods: dict[str, tuple[str, Amount]] = {}
        self._used: dict[str, Amount] = {}

    def ledger_changed(self, configmap: Mapping[str, Any]) -> set[str]:
        """Takes the ledger as it is now; returns the lower namespaces newly held to
        slices here, whose pods the caller counts (only pods of namespaces held are)."""
        promised, unreadable = {}, set()
        for key, text in (configmap.get("data") or {}).items():
            try:
                entry = ledger_entry(key, text)
            except SliceError as error:
                log.warning("slice ledger: %s", error)
                unreadable.add(key)
                continue
            if entry.origin == self.origin:
                promised[key] = entry
        newly = set(promised) - set(self._promised)
        self._promised, self._unreadable = promised, unreadable
        for uid in [uid for uid, (namespace, _) in self._pods.items() if namespace not in promised]:
            self.uncount(uid)
        return newly

    def counted(self, namespace: str) -> Amount:
        """What the pods counted against the namespace's slices here request."""
        return self._used.get(namespace, Amount())

    def holds(self, namespace: str) -> bool:
        """Whether the namespace is held to slices here (an entry that cannot be read
        holds it to none)."""
        return namespace in self._promised or namespace in self._unreadable

    def count(self, uid: str, namespace: str, amount: Amount) -> None:
        self.uncount(uid)
        if namespace not in self._promised:
            return
        self._pods[uid] = (namespace, amount)
        self._used[namespace] = self._used.get(namespace, Amount()) + amount

    def uncount(self, uid: str) -> None:
        counted = self._pods.pop(uid, None)
        if counted is not None:
            namespace, amount = counted
            # A pod that counts nothing (requests of 0) may be the last one counted,
            # after the entry went at zero.
            self._used[namespace] = self._used.get(namespace, Amount()) - amount
            if self._used[namespace] == Amount():
                del self._used[namespace]

    def room_for(
        self, namespace: str, uid: str, amount: Amount, copies: int = 1
    ) -> tuple[int, str]:
        """How many copies of the pod the namespace's slices here still take (``copies``
        when it holds none here, so is not held to any), and why not one when none."""
        if namespace in self._unreadable:
            return 0, f"the slice ledger's entry for {namespace} here cannot be read"
        entry = self._promised.get(namespace)
        if entry is None:
            return copies, ""
        used = self._used.get(namespace, Amount())
        if uid in self._pods:
            used = used - self._pods[uid][1]
        left = entry.promised - used
        fitting = [
            left.get(resource) // amount.get(resource)
            for resource in ("cpu", "memory")
            if entry.size.get(resource) and amount.get(resource)
        ]
        taken = max(0, min([copies, *fitting]))
        if taken:
            return taken, ""
        capped = Amount(max(0, left.cpu), max(0, left.memory)).only(entry.size)
        asked = amount.only(entry.size)
        return 0, (
            f"namespace {entry.namespace}'s quota slices here ({entry.slices} of "
            f"{entry.size.describe()}) have {capped.describe()} left, the pod asks "
            f"{asked.describe()}"
        )


def _foreign_origin(text: str | None, origin: str) -> bool:
    """Whether a ledger entry names another upper cluster (read however broken)."""
    named = entry_origin(text) if text else None
    return named is not None and named != origin
