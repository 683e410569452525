"""The namespace scheduler: places each quota-limited namespace's slices on the lower
clusters (kubekit.slices for the rules), level-triggered.

For a namespace, reconcile reads its ResourceQuotas and annotations, asks every virtual
node's estimator what its cluster can promise (``SliceRoom``), decides the placement,
makes the changed promises in the lower clusters (``PromiseSlices``: shrinking ones
first, so their room is free for the growing ones), and records on the namespace what
is promised: ``kubestrata.io/slice-placement`` for users and tools, and
``kubestrata.io/slice-applied`` for itself. A promise refused because another tenant
took the room meanwhile is judged again with the fresh room (a rate-limited retry).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubekit import keys
from kubekit.client import NAMESPACES, PODS, KubeClient
from kubekit.estimatorapi.estimator_pb2 import (
    PromiseSlicesRequest,
    PromiseSlicesResponse,
    Resources,
    SlicedNamespacesResponse,
    SliceRoomResponse,
)
from kubekit.informer import FunctionHandler, Informer
from kubekit.loops import run_together
from kubekit.podevents import record_pod_event
from kubekit.slices import (
    Amount,
    Applied,
    ClusterRoom,
    Policy,
    Shortfall,
    SliceError,
    applied,
    capped_size,
    decide,
    grows,
    headroom,
    namespace_quota,
    place,
    placement_json,
    size_changed,
    slice_count,
    slice_size,
    slices_of,
    without_room,
)
from kubekit.stash import is_federated
from kubekit.timestamps import now_rfc3339
from kubekit.workqueue import WorkQueue
from multischeduler.extender import EstimatorFailure, VirtualNode

log = logging.getLogger("multischeduler.slicing")

SOURCE = {"component": "kubestrata-multischeduler"}
# How often namespaces whose slices could not all be placed are tried again: the room
# of a lower cluster changes without any upper object changing.
SHORTFALL_RETRY_SECONDS = 30.0
# How often the lower clusters are asked which namespaces hold slices there: a namespace
# deleted while this process was away is taken back then.
SWEEP_SECONDS = 60.0
# How long a namespace's quota may be gone before its slices are taken back.
QUOTA_GONE_GRACE_SECONDS = 30.0


class SlicePool(Protocol):
    """What the controller asks of the virtual nodes' estimators (an EstimatorPool)."""

    nodes: dict[str, VirtualNode]

    async def slice_room(
        self, name: str, namespace: str, timeout: float
    ) -> SliceRoomResponse | EstimatorFailure: ...

    async def promise_slices(
        self, name: str, request: PromiseSlicesRequest, timeout: float
    ) -> PromiseSlicesResponse | EstimatorFailure: ...

    async def sliced_namespaces(
        self, name: str, timeout: float
    ) -> SlicedNamespacesResponse | EstimatorFailure: ...


class PromiseNotMade(Exception):
    """A lower cluster refused or could not be asked; the namespace is tried again."""


@dataclass
class PromiseRound:
    """What one round of promises left: each cluster's (slices, slice size) promised the
    namespace after it, and what was not made."""

    promised: dict[str, tuple[int, Amount]]
    # Cluster -> why it refused to grow the promise: it has no room for it now.
    refused: dict[str, str] = field(default_factory=dict)
    # The others: a shrink not made, a growth held back by one, no answer.
    failures: list[str] = field(default_factory=list)
    # The clusters whose promise was made.
    written: set[str] = field(default_factory=set)


@dataclass
class LedgerView:
    """The answers of the clusters' estimators about one namespace."""

    rooms: list[ClusterRoom] = field(default_factory=list)
    # Cluster -> (slices, slice size) its ledger promises the namespace.
    held: dict[str, tuple[int, Amount]] = field(default_factory=dict)
    used: dict[str, Amount] = field(default_factory=dict)
    silent: dict[str, str] = field(default_factory=dict)  # cluster -> why
    # Clusters whose entry for the namespace cannot be read: written again whatever the
    # placement (left, it has the cluster's room counted as promised, for every tenant).
    unreadable: set[str] = field(default_factory=set)

    def sizes(self) -> set[Amount]:
        return {size for _, size in self.held.values()}


@dataclass(frozen=True)
class Headrooms:
    """``--slice-headroom``: a default, and per cluster ``CLUSTER:VALUE``."""

    default: str = "10%"
    per_cluster: Mapping[str, str] = field(default_factory=dict)

    def of(self, cluster: str) -> str:
        return self.per_cluster.get(cluster, self.default)


def headrooms(values: list[str]) -> Headrooms:
    """Checked here so a bad flag stops the process at start, not a promise later."""
    default = "10%"
    per_cluster = {}
    for value in values:
        cluster, colon, text = value.rpartition(":")
        headroom(text)
        if colon:
            per_cluster[cluster] = text
        else:
            default = text
    return Headrooms(default, per_cluster)


class SliceController:
    def __init__(
        self,
        client: KubeClient,
        namespaces: Informer,
        quotas: Informer,
        pool: SlicePool,
        *,
        headroom: Headrooms,
        policy: Policy,
        timeout: float,
        retry_after: float = SHORTFALL_RETRY_SECONDS,
        sweep_every: float = SWEEP_SECONDS,
        quota_gone_grace: float = QUOTA_GONE_GRACE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.namespaces = namespaces
        self.quotas = quotas
        self.pool = pool
        self.headroom = headroom
        self.policy = policy
        self.timeout = timeout
        self.retry_after = retry_after
        self.sweep_every = sweep_every
        self.quota_gone_grace = quota_gone_grace
        self.clock = clock
        self.queue: WorkQueue[str] = WorkQueue("slices")
        # Namespace -> when its quota was first seen gone while it held slices.
        self._quota_gone: dict[str, float] = {}
        # Namespaces a ledger may still promise slices though they are gone or unsliced:
        # found by the sweep, or deleted with slices.
        self._suspects: set[str] = set()
        # The last event told of each namespace: a shortfall retried is not told again.
        self._told: dict[str, tuple[str, str]] = {}
        namespaces.add_handler(
            FunctionHandler(
                add=lambda ns: self.queue.add(ns["metadata"]["name"]),
                update=lambda ns: self.queue.add(ns["metadata"]["name"]),
                delete=self._namespace_deleted,
            )
        )
        quotas.add_handler(
            FunctionHandler.on_any(lambda quota: self.queue.add(quota["metadata"]["namespace"]))
        )

    def _namespace_deleted(self, namespace: dict[str, Any]) -> None:
        name = namespace["metadata"]["name"]
        record = applied(
            (namespace["metadata"].get("annotations") or {}).get(keys.SLICE_APPLIED_ANNOTATION)
        )
        if record is not None and record.slices:
            self._suspects.add(name)
        self.queue.add(name)

    def placement_of(self, namespace: str) -> dict[str, int] | None:
        """Where a namespace's pods may go: {cluster-id: slices} when its quota is sliced
        (empty until placed), None when it is not (no quota, or not federated) and its
        pods go anywhere."""
        found = self.namespaces.get(namespace)
        # Not seen yet (the cache behind the pod's creation): its quota holds it back.
        if not namespace_quota(self.quotas.items(namespace)) or (
            found is not None and not self._sliced(found)
        ):
            return None
        annotations = (found or {}).get("metadata", {}).get("annotations") or {}
        record = applied(annotations.get(keys.SLICE_APPLIED_ANNOTATION))
        return dict(record.slices) if record is not None else {}

    async def run(self, workers: int = 2) -> None:
        await run_together(self.queue.run_workers(workers, self.reconcile), self._sweeping())

    async def _sweeping(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:
                log.exception("sweep of the slice ledgers failed; tried again later")
            await asyncio.sleep(self.sweep_every)

    async def sweep(self) -> None:
        """Finds the namespaces the lower clusters hold slices for that no longer exist
        above or have no quota (deleted or unsliced while this process was away), or
        whose placement leaves that cluster out: their reconcile takes the slices back.
        And those placed in a cluster that left the pool: their reconcile places the
        slices it held where there is room."""
        clusters = self._nodes_by_cluster()
        for namespace in self.namespaces.items():
            annotations = namespace["metadata"].get("annotations") or {}
            record = applied(annotations.get(keys.SLICE_APPLIED_ANNOTATION))
            if record is not None and record.slices.keys() - clusters.keys():
                self.queue.add(namespace["metadata"]["name"])
        answers = await asyncio.gather(
            *(self.pool.sliced_namespaces(node, self.timeout) for node in clusters.values())
        )
        for cluster, answer in zip(clusters, answers, strict=True):
            if isinstance(answer, EstimatorFailure):
                continue
            for name in answer.namespaces:
                found = self.namespaces.get(name)
                if found is None or not self._sliced(found):
                    self._suspects.add(name)
                    self.queue.add(name)
                elif cluster not in (self.placement_of(name) or {}):
                    # Placed elsewhere while this cluster was away (its Node gone a
                    # while): what it still promises is taken back, not held for good.
                    self.queue.add(name)

    # -- one namespace ---------------------------------------------------------------------

    def _sliced(self, namespace: Mapping[str, Any]) -> bool:
        """Whether a namespace's quota is sliced: only a federated namespace's pods go to
        virtual nodes. Any other's slices would hold room its pods never use, and its
        Secrets be copied into lower clusters other tenants share."""
        metadata = namespace["metadata"]
        return is_federated(metadata["name"], metadata.get("labels") or {}) and bool(
            namespace_quota(self.quotas.items(metadata["name"]))
        )

    def _nodes_by_cluster(self) -> dict[str, str]:
        """Cluster id -> the name of its virtual node (one per cluster and tenant)."""
        return {
            node.cluster_id: name
            for name, node in sorted(self.pool.nodes.items())
            if node.cluster_id
        }

    async def reconcile(self, name: str) -> None:
        namespace = self.namespaces.get(name)
        clusters = self._nodes_by_cluster()
        annotations = (namespace or {}).get("metadata", {}).get("annotations") or {}
        before = applied(annotations.get(keys.SLICE_APPLIED_ANNOTATION))
        sliced = namespace is not None and self._sliced(namespace)
        quota = namespace_quota(self.quotas.items(name)) if sliced else {}
        if not quota:
            if namespace is not None and before is not None and before.slices:
                # A quota replaced (`kubectl replace --force`, a tool that deletes and
                # makes it again) is gone a moment: taken back at once, the room could be
                # promised to another tenant before it came back, its pods still running.
                gone_at = self._quota_gone.setdefault(name, self.clock())
                left = gone_at + self.quota_gone_grace - self.clock()
                if left > 0:
                    self.queue.add_after(name, left)
                    return
            self._quota_gone.pop(name, None)
            # Deleted, or no quota: whatever a ledger still promises it is taken back. Only
            # asked of the clusters when something may be promised: most namespaces are
            # never sliced.
            if before is not None or name in self._suspects:
                view = await self._view(name, clusters)
                outcome = await self._promise(
                    name, Amount(), dict.fromkeys({*view.held, *view.unreadable}, 0), view.held
                )
                if outcome.failures:
                    still = {c: n for c, (n, _) in outcome.promised.items()}
                    await self._not_made(
                        name, namespace, Applied(Amount(), still), outcome.failures
                    )
                self._suspects.discard(name)
            if namespace is None:
                self._told.pop(name, None)
            else:
                await self._annotate(namespace, None)
                await self._tell(namespace, None, "", "")
            return
        assert namespace is not None
        self._quota_gone.pop(name, None)
        try:
            size = capped_size(slice_size(annotations.get(keys.SLICE_SIZE_ANNOTATION)), quota)
            count = slice_count(quota, size)
        except SliceError as error:
            await self._tell(namespace, False, "InvalidSliceSize", str(error))
            return
        view = await self._view(name, clusters)
        # What is promised: the ledgers of the clusters that answer; the namespace's own
        # record for those that do not. A cluster gone from the pool is placed around:
        # what its ledger still holds is taken back once it is back.
        earlier = view.sizes() | ({before.size} if before is not None and before.slices else set())
        changed = next((old for old in earlier if size_changed(old, size)), None)
        if changed is not None and await self._has_pods(name):
            await self._tell(
                namespace,
                False,
                "SliceSizeChangeRefused",
                f"slices of {changed.describe()} cannot become {size.describe()} while "
                "the namespace has pods: set the size back, or delete its pods to re-slice",
            )
            # Its pods' end is told by no object this controller watches.
            self.queue.add_after(name, self.retry_after)
            return
        # A cap added or removed changes what a slice holds, not where slices are: they
        # stay where they were (placed afresh, the pods elsewhere would run unpromised).
        silent_held = (
            {c: n for c, n in before.slices.items() if c in view.silent}
            if before is not None and not size_changed(before.size, size)
            else {}
        )
        current = kept(view.held, size) | silent_held
        used = {c: slices_of(amount, size) for c, amount in view.used.items()}
        decision = decide(
            annotations.get(keys.SLICE_PLACEMENT_ANNOTATION),
            before,
            count,
            size,
            view.rooms,
            current,
            used,
            self.policy,
        )
        if decision.refused_edit is not None:
            await self._event(
                namespace,
                "Warning",
                "SlicePlacementRefused",
                f"{keys.SLICE_PLACEMENT_ANNOTATION} not honoured, the slices stay where they "
                f"were: {decision.refused_edit}",
            )
        target = decision.target
        if isinstance(target, Shortfall):
            # A silent cluster's reason (an estimator refusing the namespace's lower name
            # as too long, say) is why, not only "no lower clusters".
            unheard = "; ".join(f"{c} did not answer: {why}" for c, why in view.silent.items())
            message = f"{target.message}; {unheard}" if unheard else target.message
            if before is not None:
                await self._annotate(namespace, before)
            await self._tell(namespace, False, "SlicesNotPlaced", message)
            self.queue.add_after(name, self.retry_after)
            return
        rooms, promised, rewrite = view.rooms, view.held, set(view.unreadable)
        refused: dict[str, str] = {}
        shortfall = ""
        while True:
            changes = promise_changes(target, promised, size, view.silent, rewrite)
            outcome = await self._promise(name, size, changes, promised)
            promised = outcome.promised
            rewrite -= outcome.written
            # Bounded: each turn takes at least one more cluster's room away, or ends.
            again = not outcome.failures and bool(outcome.refused.keys() - refused.keys())
            refused |= outcome.refused
            if not again:
                break
            # Only growth refused: those clusters have no room left for the namespace
            # (another tenant took it first). Its slices go where there is room, now:
            # retried as they were, the same refusal would hold them all back for good.
            rooms = [without_room(room) if room.cluster in refused else room for room in rooms]
            target = place(
                count, size, rooms, kept(promised, size) | silent_held, used, self.policy
            )
            if isinstance(target, Shortfall):
                shortfall = f"no room elsewhere: {target.message}"
                break
        made = {c: n for c, (n, _) in promised.items()} | silent_held
        if outcome.failures or outcome.refused:
            refusals = [f"{c}: {why}" for c, why in sorted(refused.items())]
            await self._not_made(
                name, namespace, Applied(size, made), [*refusals, *outcome.failures, shortfall]
            )
        await self._annotate(namespace, Applied(size, made))
        placed = f"{sum(made.values())} slices of {size.describe()}: " + (
            ", ".join(f"{cluster} {held}" for cluster, held in sorted(made.items())) or "none"
        )
        if refused:
            # Placed around them: a placement the user wrote is not what was made.
            placed += "; not grown where refused: " + "; ".join(
                f"{cluster}: {why}" for cluster, why in sorted(refused.items())
            )
        if sum(made.values()) > count:
            # Given back as the pods using them finish, which no upper object tells.
            await self._tell(
                namespace,
                True,
                "SlicesKeptForPods",
                f"{placed}; the quota asks {count}, the rest is in use by the namespace's "
                "pods (or held by a cluster that does not answer) and given back once free",
            )
            self.queue.add_after(name, self.retry_after)
            return
        await self._tell(namespace, True, "SlicesPlaced", placed)

    async def _has_pods(self, namespace: str) -> bool:
        """Whether the namespace has a pod that has not finished."""
        listed = await self.client.list(
            PODS,
            namespace,
            limit=1,
            fieldSelector="status.phase!=Succeeded,status.phase!=Failed",
        )
        return bool(listed.get("items"))

    async def _view(self, namespace: str, clusters: Mapping[str, str]) -> LedgerView:
        """What every cluster whose estimator answers can promise the namespace, holds
        for it (its ledger, the record of what is promised) and what its pods there use.
        A cluster that does not answer is left out: it takes no new slices."""
        answers = await asyncio.gather(
            *(self.pool.slice_room(node, namespace, self.timeout) for node in clusters.values())
        )
        view = LedgerView()
        for cluster, answer in zip(clusters, answers, strict=True):
            if isinstance(answer, EstimatorFailure):
                log.warning("%s: slice room of %s unknown: %s", namespace, cluster, answer.message)
                view.silent[cluster] = answer.message
                continue
            view.rooms.append(
                ClusterRoom(
                    cluster,
                    tuple(_amount(node) for node in answer.nodes),
                    _amount(answer.promised_to_others),
                    headroom(self.headroom.of(cluster)),
                )
            )
            if answer.held:
                view.held[cluster] = (answer.held, _amount(answer.held_slice))
            if answer.held_unreadable:
                view.unreadable.add(cluster)
            view.used[cluster] = _amount(answer.used)
        return view

    async def _promise(
        self,
        name: str,
        size: Amount,
        changes: Mapping[str, int],
        promised: Mapping[str, tuple[int, Amount]],
    ) -> PromiseRound:
        """Makes the changed promises (``promised``: each cluster's slices and their size
        now), shrinking ones first, and none that grows once a shrink was not made (a
        failure part-way leaves the namespace promised less, never more)."""
        outcome = PromiseRound({cluster: held for cluster, held in promised.items() if held[0]})
        clusters = self._nodes_by_cluster()
        growing = {
            cluster: grows(promised.get(cluster, (0, size)), count, size)
            for cluster, count in changes.items()
        }
        shrink_failed = False
        for cluster in sorted(changes, key=lambda cluster: (growing[cluster], cluster)):
            if growing[cluster] and shrink_failed:
                # Growing now would promise the namespace more than its quota makes (both
                # clusters holding what moves between them).
                outcome.failures.append(f"{cluster}: not grown while a shrink is not made")
                continue
            node = clusters.get(cluster)
            answer: PromiseSlicesResponse | EstimatorFailure
            if node is None:
                answer = PromiseSlicesResponse(refused="no virtual node")
            else:
                request = PromiseSlicesRequest(
                    namespace=name,
                    slices=changes[cluster],
                    slice=Resources(cpu_millis=size.cpu, memory_bytes=size.memory),
                    headroom=self.headroom.of(cluster),
                )
                answer = await self.pool.promise_slices(node, request, self.timeout)
            if isinstance(answer, EstimatorFailure) or answer.refused:
                shrink_failed = shrink_failed or not growing[cluster]
                if isinstance(answer, EstimatorFailure):
                    # Made or not, unknown: placed again only from the ledgers.
                    outcome.failures.append(f"{cluster}: {answer.message}")
                elif growing[cluster]:
                    outcome.refused[cluster] = answer.refused
                else:
                    outcome.failures.append(f"{cluster}: {answer.refused}")
                continue
            outcome.written.add(cluster)
            if changes[cluster]:
                outcome.promised[cluster] = (changes[cluster], size)
            else:
                outcome.promised.pop(cluster, None)
        return outcome

    async def _not_made(
        self,
        name: str,
        namespace: Mapping[str, Any] | None,
        made: Applied,
        failures: list[str],
    ) -> None:
        """Records what was made and why the rest was not, and raises PromiseNotMade: the
        namespace is retried from the ledgers (a rate-limited retry)."""
        why = f"promises not made, tried again: {'; '.join(filter(None, failures))}"
        if namespace is not None:
            await self._annotate(namespace, made)
            await self._tell(namespace, False, "PromisesNotMade", why)
        raise PromiseNotMade(f"{name}: {why}")

    async def _annotate(self, namespace: Mapping[str, Any], result: Applied | None) -> None:
        if result is not None and not result.slices:
            # Nothing promised anywhere reads as never placed (no annotation), whichever
            # way it came about: a shortfall, or a promise another tenant got to first.
            result = None
        annotations = namespace["metadata"].get("annotations") or {}
        wanted = {
            keys.SLICE_PLACEMENT_ANNOTATION: placement_json(result.slices) if result else None,
            keys.SLICE_APPLIED_ANNOTATION: result.encode() if result else None,
        }
        if all(annotations.get(key) == value for key, value in wanted.items()):
            return
        # Of the namespace as this reconcile read it: a placement a user wrote meanwhile
        # (the promises take seconds) is not overwritten unseen but refused 409, and the
        # retry reads it.
        metadata = {"annotations": wanted}
        if version := namespace["metadata"].get("resourceVersion"):
            metadata["resourceVersion"] = version
        await self.client.patch(NAMESPACES, namespace["metadata"]["name"], {"metadata": metadata})

    async def _tell(
        self, namespace: Mapping[str, Any], placed: bool | None, reason: str, message: str
    ) -> None:
        """Records how the placement went in the namespace's condition and, when that is
        news, an event; ``placed`` None: the namespace is not sliced (no condition)."""
        name = namespace["metadata"]["name"]
        patch = condition_patch(namespace, placed, reason, message, now_rfc3339())
        if patch is not None:
            await self.client.patch(
                NAMESPACES,
                name,
                patch,
                subresource="status",
                patch_type="application/strategic-merge-patch+json",
            )
        if placed is None:
            self._told.pop(name, None)
            return
        if self._told.get(name) == (reason, message):
            return
        if placed and patch is None:
            return  # placed as it was: no news
        self._told[name] = (reason, message)
        log.info("%s: %s: %s", name, reason, message)
        await record_pod_event(
            self.client,
            namespace,
            "Normal" if placed else "Warning",
            reason,
            message,
            SOURCE,
            "Namespace",
        )

    async def _event(
        self, namespace: Mapping[str, Any], kind: str, reason: str, message: str
    ) -> None:
        """An event for a user's action (each one is news)."""
        log.info("%s: %s: %s", namespace["metadata"]["name"], reason, message)
        await record_pod_event(self.client, namespace, kind, reason, message, SOURCE, "Namespace")


def condition_patch(
    namespace: Mapping[str, Any], placed: bool | None, reason: str, message: str, now: str
) -> dict[str, Any] | None:
    """The strategic merge patch of the namespace's status that sets its slices
    condition (or removes it, ``placed`` None), or None when it already says so. Merged
    by type: the namespace's other conditions are left alone."""
    conditions = (namespace.get("status") or {}).get("conditions") or []
    current = next((c for c in conditions if c.get("type") == keys.SLICES_PLACED_CONDITION), None)
    if placed is None:
        if current is None:
            return None
        wanted: dict[str, Any] = {"type": keys.SLICES_PLACED_CONDITION, "$patch": "delete"}
    else:
        status = "True" if placed else "False"
        if current is not None and (
            current.get("status"),
            current.get("reason"),
            current.get("message"),
        ) == (status, reason, message):
            return None
        since = now
        if current is not None and current.get("status") == status:
            since = current.get("lastTransitionTime") or now
        wanted = {
            "type": keys.SLICES_PLACED_CONDITION,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
        }
    return {"status": {"conditions": [wanted]}}


def kept(promised: Mapping[str, tuple[int, Amount]], size: Amount) -> dict[str, int]:
    """The slices each cluster holds that stay where they are at ``size``: slices of
    another size in a resource both hold are placed afresh; a cap added or removed
    changes what a slice holds, not where it is."""
    return {
        cluster: held
        for cluster, (held, held_size) in promised.items()
        if not size_changed(held_size, size)
    }


def promise_changes(
    target: Mapping[str, int],
    promised: Mapping[str, tuple[int, Amount]],
    size: Amount,
    silent: Collection[str],
    rewrite: Collection[str] = (),
) -> dict[str, int]:
    """The promises to make for ``target`` in the clusters that answered: where its
    slices change, are held in another size (written again, or taken back), or are in
    ``rewrite`` (an entry that cannot be read: written again whatever it says)."""
    return {
        cluster: target.get(cluster, 0)
        for cluster in sorted({*target, *promised, *rewrite} - set(silent))
        if cluster in rewrite or promised.get(cluster, (0, size)) != (target.get(cluster, 0), size)
    }


def _amount(resources: Resources) -> Amount:
    return Amount(cpu=resources.cpu_millis, memory=resources.memory_bytes)
