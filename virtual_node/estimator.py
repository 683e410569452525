"""The fit estimator of one lower cluster: would a pod fit on one of its real nodes?

The answer comes from the watch caches the virtual node keeps anyway (lower nodes and
pods, upper pods bound here), folded incrementally into a ``ClusterState``, so a query
costs one pass over the nodes and no API call. Pods that will take room soon count as
if they were already there, on the node they would take: room reserved by the extender
for a pod it is placing, and pods bound to this virtual node whose lower copy is not yet
on a lower node. Without that, a burst of pods decided before the first of them lands
below would all be told the same room is free (Karmada's estimator, its issue 1385).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import grpc
import orjson
from google.protobuf.message import DecodeError

from kubekit import keys, metrics, pki
from kubekit.certreload import CertificateFiles
from kubekit.client import API_ERRORS
from kubekit.clusterstate import ClusterState, Estimate
from kubekit.estimatorapi import (
    MAX_HOLD_SECONDS,
    RESERVATION_SECONDS,
    estimator_pb2,
    estimator_pb2_grpc,
    server_keepalive_options,
)
from kubekit.fit import PodFacts, counted_node, negative_quantity
from kubekit.informer import FunctionHandler, Informer, object_key
from kubekit.loops import on_loop
from kubekit.serving import host_port
from kubekit.slices import Amount, SliceError
from virtual_node.kubeletapi.auth import AuthError, Authorizer
from virtual_node.naming import NamespaceMapping, NamingError
from virtual_node.promises import PromiseRefused, SliceBudgets, SlicePromises, requested
from virtual_node.quotas import QuotaBook, quota_usage
from virtual_node.references import for_a_volume_made_by_hand, standing_for
from virtual_node.runtimes import (
    RuntimeClassFacts,
    runtime_class_facts,
    runtime_refusal,
    with_runtime_class,
)
from virtual_node.translate import (
    Ownership,
    desired_lower_pod,
    host_access,
    host_access_refusal,
    pinned_node,
)
from virtual_node.volumes import has_data_source, unbound_class, volume_refusal

log = logging.getLogger(__name__)

JSON = dict[str, Any]

_FINISHED = frozenset({"Succeeded", "Failed"})
# The longest the estimator's thread waits for the interpreter while the virtual node's
# loop is busy (Python's default is 5 ms, a whole answer's budget).
SWITCH_INTERVAL_SECONDS = 0.001

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def _exclusive(
    method: Callable[Concatenate[FitEstimator, P], R],
) -> Callable[Concatenate[FitEstimator, P], R]:
    """The estimator is fed by the virtual node's watches on its loop's thread and asked
    on its server's own: one of them at a time."""

    def exclusive(self: FitEstimator, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return method(self, *args, **kwargs)

    return exclusive


@dataclass(frozen=True)
class _Reservation:
    until: float
    # The pod as it would be made below: what it takes of a quota made meanwhile.
    lower: JSON


# The most replicas of a pod one answer places in turn: each is judged over every node
# under the lock the watches wait for, and a caller asking for 2^31 spread replicas held
# the estimator and the virtual node's own watches for minutes. (The pods of a FitInTurn
# are as many as the 4 MiB of a gRPC message holds.)
MAX_REPLICAS = 1000


class QueryError(ValueError):
    """A pod in a query that cannot be judged."""


@dataclass(frozen=True)
class Answer:
    estimate: Estimate
    reserved_node: str | None
    # Why this cluster takes no copy of the pod, whatever its nodes: the namespace's quota
    # slices here, the host access it asks for, a volume of the pod's it cannot make, or a
    # runtime class it lacks or conflicts with.
    refusal: str = ""


@dataclass(frozen=True)
class Plan:
    """A defragmentation plan, by upper pod UID."""

    node: str
    evicted: tuple[str, ...]
    homeless: tuple[str, ...]


class FitEstimator:
    """The estimator's bookkeeping over the virtual node's caches (no I/O)."""

    def __init__(
        self,
        state: ClusterState,
        mapping: NamespaceMapping,
        owner: Ownership,
        clock: Callable[[], float] = time.monotonic,
        budgets: SliceBudgets | None = None,
        host_access_namespaces: frozenset[str] = frozenset(),
        stash_unguarded: Callable[[Mapping[str, Any]], str | None] = lambda _pod: None,
    ) -> None:
        self.state = state
        # Why the webhook does not guard an upper pod's stash, or None when it does.
        self.stash_unguarded = stash_unguarded
        # A pod the virtual node would refuse to create below fits nowhere here.
        self.host_access_namespaces = host_access_namespaces
        self.budgets = budgets or SliceBudgets(owner.origin)
        self.mapping = mapping
        self.owner = owner
        self.clock = clock
        # UID -> the extender's reservation (or a hold); not yet bound here.
        self._reserved: dict[str, _Reservation] = {}
        # Bound to this virtual node, lower copy not yet on a lower node.
        self._in_flight: set[str] = set()
        # Lower copy bound to a lower node: the real pod counts, never an assumption.
        self._landed: set[str] = set()
        # Upper UID -> the key of its lower pod, and of itself in the upper cache.
        self._lower_keys: dict[str, str] = {}
        self._upper_keys: dict[str, str] = {}
        self._upper_pods: Informer | None = None
        self._lower_pods: Informer | None = None
        # {namespace/claim: class} of the upper claims still waiting for a volume, and the
        # lower cluster's StorageClasses (both empty until their caches are watched).
        self._waiting_claims: dict[str, str] = {}
        # ... of those, the ones to be filled from a snapshot or another claim.
        self._sourced_claims: set[str] = set()
        # Upper claims for a volume made by hand (key -> UID), the UID each copy below was
        # made from (a copy made before such claims were refused is kept, and its pods
        # mirrored; one going is not), and the first without a copy of their own, whose
        # pods would wait below for good.
        self._hand_made_claims: dict[str, str] = {}
        self._copied_claims: dict[str, str] = {}
        self._uncopied_hand_made: set[str] = set()
        self._storage_classes: set[str] = set()
        # The lower cluster's RuntimeClasses: a pod of a class it lacks fits nowhere here,
        # and takes its class's overhead and scheduling.
        self._runtime_classes: dict[str, RuntimeClassFacts] = {}
        # The lower namespaces' ResourceQuotas and the pods not yet in their usage.
        self.quotas = QuotaBook()
        self.lock = threading.RLock()

    def watch(self, lower_nodes: Informer, lower_pods: Informer, upper_pods: Informer) -> None:
        self._upper_pods = upper_pods
        self._lower_pods = lower_pods
        lower_nodes.add_handler(
            FunctionHandler(
                add=self._node_changed,
                update=self._node_changed,
                delete=self._node_deleted,
            )
        )
        lower_pods.add_handler(
            FunctionHandler(
                add=self._lower_pod_changed,
                update=self._lower_pod_changed,
                delete=self._lower_pod_deleted,
            )
        )
        upper_pods.add_handler(
            FunctionHandler(
                add=self._upper_pod_changed,
                update=self._upper_pod_changed,
                delete=self._upper_pod_deleted,
            )
        )

    def watch_volumes(
        self, upper_claims: Informer, lower_classes: Informer, claim_copies: Informer | None = None
    ) -> None:
        """``claim_copies``: our claims below (the reflector's copies)."""
        upper_claims.add_handler(
            FunctionHandler(
                add=self._claim_changed, update=self._claim_changed, delete=self._claim_deleted
            )
        )
        if claim_copies is not None:
            claim_copies.add_handler(
                FunctionHandler(
                    add=self._claim_copy_changed,
                    update=self._claim_copy_changed,
                    delete=self._claim_copy_deleted,
                )
            )
        lower_classes.add_handler(
            FunctionHandler(
                add=self._class_changed, update=self._class_changed, delete=self._class_deleted
            )
        )

    def watch_runtime_classes(self, lower_classes: Informer) -> None:
        lower_classes.add_handler(
            FunctionHandler(
                add=self._runtime_class_changed,
                update=self._runtime_class_changed,
                delete=self._runtime_class_deleted,
            )
        )

    def watch_quotas(self, lower_quotas: Informer) -> None:
        lower_quotas.add_handler(
            FunctionHandler(
                add=self._quota_changed,
                update=self._quota_changed,
                delete=self._quota_deleted,
            )
        )

    # -- what the caches say ---------------------------------------------------------------

    @_exclusive
    def _quota_changed(self, quota: JSON) -> None:
        if not self.quotas.quota_changed(quota):
            return
        # A namespace newly held to a quota: its pods not yet made below count from now,
        # those holding room first (bound, they count by their reservation).
        namespace = str(quota["metadata"].get("namespace", ""))
        for uid, held in self._reserved.items():
            if held.lower["metadata"]["namespace"] == namespace:
                self.quotas.count(uid, namespace, quota_usage(held.lower))
        upper_namespace = self.mapping.upper(namespace)
        if upper_namespace is None or self._upper_pods is None:
            return
        for pod in self._upper_pods.items(upper_namespace):
            uid = pod["metadata"]["uid"]
            if uid in self._in_flight and uid not in self._lower_keys:
                self._count_against_quota(uid, pod)

    @_exclusive
    def _quota_deleted(self, quota: JSON) -> None:
        self.quotas.quota_deleted(quota)

    def _count_against_quota(self, uid: str, upper: Mapping[str, Any]) -> None:
        try:
            lower = self._lower_form(upper)[0]
        except QueryError as error:
            log.debug("pod %s not counted against its quota: %s", object_key(upper), error)
            return
        self.quotas.count(uid, str(lower["metadata"]["namespace"]), quota_usage(lower))

    @_exclusive
    def _claim_changed(self, claim: JSON) -> None:
        key = object_key(claim)
        wanted = unbound_class(claim)
        if wanted is None:
            self._waiting_claims.pop(key, None)
        else:
            self._waiting_claims[key] = wanted
        if wanted is not None and has_data_source(claim.get("spec") or {}):
            self._sourced_claims.add(key)
        else:
            self._sourced_claims.discard(key)
        if for_a_volume_made_by_hand(claim):
            self._hand_made_claims[key] = str(claim["metadata"].get("uid", ""))
        else:
            self._hand_made_claims.pop(key, None)
        self._hand_made_changed(key)

    @_exclusive
    def _claim_deleted(self, claim: JSON) -> None:
        self._waiting_claims.pop(object_key(claim), None)
        self._sourced_claims.discard(object_key(claim))
        self._hand_made_claims.pop(object_key(claim), None)
        self._hand_made_changed(object_key(claim))

    @_exclusive
    def _claim_copy_changed(self, copy: JSON) -> None:
        if (key := _upper_claim_key(copy)) is None:
            return
        if made_from := standing_for(copy):
            self._copied_claims[key] = made_from
        else:
            self._copied_claims.pop(key, None)
        self._hand_made_changed(key)

    @_exclusive
    def _claim_copy_deleted(self, copy: JSON) -> None:
        if (key := _upper_claim_key(copy)) is not None:
            self._copied_claims.pop(key, None)
            self._hand_made_changed(key)

    def _hand_made_changed(self, key: str) -> None:
        uid = self._hand_made_claims.get(key)
        if uid is not None and self._copied_claims.get(key) != uid:
            self._uncopied_hand_made.add(key)
        else:
            self._uncopied_hand_made.discard(key)

    @_exclusive
    def _class_changed(self, storage_class: JSON) -> None:
        self._storage_classes.add(storage_class["metadata"]["name"])

    @_exclusive
    def _class_deleted(self, storage_class: JSON) -> None:
        self._storage_classes.discard(storage_class["metadata"]["name"])

    @_exclusive
    def _runtime_class_changed(self, runtime_class: JSON) -> None:
        self._runtime_classes[runtime_class["metadata"]["name"]] = runtime_class_facts(
            runtime_class
        )

    @_exclusive
    def _runtime_class_deleted(self, runtime_class: JSON) -> None:
        self._runtime_classes.pop(runtime_class["metadata"]["name"], None)

    def _refusal(self, lower: Mapping[str, Any]) -> str | None:
        """Why this cluster would not run the pod, whatever room it has: a namespace that
        is the lower cluster's own, or not allowed the host access it asks for, a volume,
        a runtime class."""
        namespace = lower["metadata"]["annotations"][keys.UPPER_NAMESPACE_ANNOTATION]
        return (
            self.mapping.refusal(namespace)
            or host_access_refusal(
                lower["spec"], namespace, self.host_access_namespaces, self.owner.cluster_id
            )
            or self._volume_refusal(lower)
            or runtime_refusal(lower, self._runtime_classes, self.owner.cluster_id)
        )

    def _volume_refusal(self, lower: Mapping[str, Any]) -> str | None:
        namespace = (lower["metadata"].get("annotations") or {}).get(
            keys.UPPER_NAMESPACE_ANNOTATION, ""
        )
        return volume_refusal(
            lower,
            namespace,
            self._waiting_claims,
            self._storage_classes,
            self.owner.cluster_id,
            self._sourced_claims,
            self._uncopied_hand_made,
        )

    @_exclusive
    def _node_changed(self, node: JSON) -> None:
        self.state.set_node(node)

    @_exclusive
    def _node_deleted(self, node: JSON) -> None:
        self.state.remove_node(node["metadata"]["name"])

    def _upper_uid(self, lower: Mapping[str, Any]) -> str | None:
        if not self.owner.owns(lower):
            return None
        return (lower["metadata"].get("annotations") or {}).get(keys.UPPER_UID_ANNOTATION)

    @_exclusive
    def _lower_pod_changed(self, pod: JSON) -> None:
        self.state.set_pod(pod)
        uid = self._upper_uid(pod)
        if uid is None:
            return
        self._lower_keys[uid] = object_key(pod)
        # Made below: its quota's usage has it now.
        self.quotas.uncount(uid)
        # Counted on a node below (bound, or nominated there): its assumption goes, or
        # the room would be counted twice. Finished below, it takes no room at all,
        # though its upper pod may not say so yet (its status copied up after a restart).
        if counted_node(pod) is not None or (pod.get("status") or {}).get("phase") in _FINISHED:
            self._landed.add(uid)
            self._drop_assumption(uid)
            return
        if pod["metadata"].get("deletionTimestamp"):
            return
        # Waiting below (a nomination withdrawn, or seen first after a restart, when its
        # upper pod was assumed on the node it would take now): counted where it is
        # pinned, as a pod bound here is until it lands.
        self._landed.discard(uid)
        pin = pinned_node(pod)
        assumed = self.state.assumed_node(uid)
        if uid in self._upper_keys and (assumed is None or (pin is not None and assumed != pin)):
            self._reserved.pop(uid, None)
            self._in_flight.add(uid)
            self.state.assume(uid, PodFacts.of(pod), pin)

    @_exclusive
    def _lower_pod_deleted(self, pod: JSON) -> None:
        self.state.remove_pod(object_key(pod))
        uid = self._upper_uid(pod)
        if uid is not None:
            self._landed.discard(uid)
            self._lower_keys.pop(uid, None)

    @_exclusive
    def _upper_pod_changed(self, pod: JSON) -> None:
        uid = pod["metadata"]["uid"]
        if (pod.get("status") or {}).get("phase") in _FINISHED:
            self._drop(uid)
            return
        self._upper_keys[uid] = object_key(pod)
        try:
            namespace = self.mapping.lower(pod["metadata"]["namespace"])
        except NamingError:
            pass
        else:
            # Most namespaces hold no slices: their pods' requests are not summed.
            if self.budgets.holds(namespace):
                self.budgets.count(uid, namespace, self._charged(pod))
        if uid in self._landed or uid in self._in_flight:
            return
        self._in_flight.add(uid)
        # A reservation becomes the in-flight assumption where it stands.
        if self._reserved.pop(uid, None) is None:
            try:
                lower, facts = self._lower_form(pod)
            except QueryError as error:
                log.debug("pod %s not assumed: %s", object_key(pod), error)
                return
            self.state.assume(uid, facts, self._lower_pin(uid))
            if uid not in self._lower_keys and self.quotas.holds(lower["metadata"]["namespace"]):
                self.quotas.count(uid, lower["metadata"]["namespace"], quota_usage(lower))

    def _lower_pin(self, uid: str) -> str | None:
        """The node the pod's lower copy waits pinned to, if it has one (a restart lists
        the upper pods after the lower ones, or before)."""
        key = self._lower_keys.get(uid)
        lower = self._lower_pods.get(key) if key and self._lower_pods is not None else None
        return pinned_node(lower) if lower is not None else None

    @_exclusive
    def ledger_changed(self, ledger: JSON) -> None:
        """The slices ledger changed: the pods holding room or bound here of a namespace
        newly held to slices count against them from now on."""
        for namespace in self.budgets.ledger_changed(ledger):
            for uid, held in self._reserved.items():
                if held.lower["metadata"]["namespace"] == namespace:
                    self.budgets.count(uid, namespace, requested(held.lower))
            upper_namespace = self.mapping.upper(namespace)
            if upper_namespace is None or self._upper_pods is None:
                continue
            for pod in self._upper_pods.items(upper_namespace):
                if (pod.get("status") or {}).get("phase") not in _FINISHED:
                    self.budgets.count(pod["metadata"]["uid"], namespace, self._charged(pod))

    @_exclusive
    def slice_use(self, namespace: str) -> Amount:
        """What the pods counted against a lower namespace's slices here request: bound
        to this virtual node or holding room, by UID, their lower copies made or not."""
        self.expire()
        return self.budgets.counted(namespace)

    @_exclusive
    def _upper_pod_deleted(self, pod: JSON) -> None:
        self._drop(pod["metadata"]["uid"])

    def _drop(self, uid: str) -> None:
        self.budgets.uncount(uid)
        self.quotas.uncount(uid)
        self._landed.discard(uid)
        self._upper_keys.pop(uid, None)
        self._drop_assumption(uid)

    def _drop_assumption(self, uid: str) -> None:
        self._in_flight.discard(uid)
        self._reserved.pop(uid, None)
        self.state.forget(uid)

    @_exclusive
    def held_node(self, uid: str) -> str | None:
        """The lower node room is held on for a pod bound here: the lower pod is pinned
        there, since room assumed on one node while the lower scheduler takes another
        would be counted twice and leave a later pod without the room it was promised.
        Checked again first: pinned to a node cordoned, gone or filled since, the copy
        would wait there for good."""
        return self.state.reassume(uid) if uid in self._in_flight else None

    @_exclusive
    def settle(self) -> None:
        """Assumes again, one after another in the order they were made, the pods in
        flight that have no lower copy: once the caches are whole. At a start each was
        assumed as it was listed, maybe before the lower nodes (on no node) or the pods
        filling a node (on that node)."""
        if self._upper_pods is None:
            return
        waiting: list[tuple[str, str, str, JSON]] = []
        for uid in self._in_flight:
            key = self._upper_keys.get(uid)
            if uid in self._lower_keys or key is None:
                continue
            self.state.forget(uid)
            pod = self._upper_pods.get(key)
            if pod is not None:
                waiting.append((pod["metadata"].get("creationTimestamp") or "", key, uid, pod))
        for _created, key, uid, pod in sorted(waiting, key=lambda w: w[:2]):
            try:
                _lower, facts = self._lower_form(pod)
            except QueryError as error:
                log.debug("pod %s not assumed: %s", key, error)
                continue
            self.state.assume(uid, facts)

    @_exclusive
    def largest_free_slot(
        self, counted_taint_keys: Collection[str] = ()
    ) -> tuple[str, dict[str, int]] | None:
        # The Node's status asks this when no query comes: a lapsed hold is not room.
        self.expire()
        return self.state.largest_free_slot(counted_taint_keys)

    def _lower_form(self, upper: Mapping[str, Any]) -> tuple[JSON, PodFacts]:
        """The lower pod the upper one becomes and what the fit reads of it: read here,
        so that no room is taken or given back for a pod that then cannot be judged (the
        apiserver validated what it sends; a caller may send anything)."""
        namespace = (upper.get("metadata") or {}).get("namespace")
        if not isinstance(namespace, str) or not namespace:
            # Mapped as it is under `same`, then looked up in sets (the refusals): a list
            # there was a TypeError, and the call ended UNKNOWN.
            raise QueryError(f"metadata.namespace must be a non-empty string, not {namespace!r}")
        try:
            lower = with_runtime_class(
                desired_lower_pod(upper, self.mapping, self.owner, self.stash_unguarded),
                self._runtime_classes,
            )
            return lower, PodFacts.of(lower)
        # TranslationError and NamingError are ValueErrors; the others, parts of the pod
        # that are not what they should be.
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise QueryError(str(error)) from error

    def _charged(self, upper: Mapping[str, Any]) -> Amount:
        """What a pod bound here takes of its namespace's slices: its lower form's
        requests, as a reservation counted them and the lower quota charges them (the
        lower RuntimeClass's overhead, not the upper one the upper pod carries)."""
        try:
            return requested(self._lower_form(upper)[0])
        except QueryError:
            return requested(upper)  # never made below; counted as it asks above

    # -- queries ---------------------------------------------------------------------------

    def _budgeted(self, lower: JSON) -> tuple[str, Amount | None]:
        """The pod's lower namespace, and its requests when that namespace is held to
        slices here (most are not: their queries sum nothing)."""
        namespace = str(lower["metadata"]["namespace"])
        return namespace, requested(lower) if self.budgets.holds(namespace) else None

    def _read(self, pod_json: bytes) -> tuple[str, JSON, PodFacts]:
        """The UID of an upper pod sent as JSON, its lower form and what the fit reads."""
        try:
            upper = orjson.loads(pod_json)
        except orjson.JSONDecodeError as error:
            raise QueryError(f"the pod is not JSON: {error}") from error
        if not isinstance(upper, dict) or not isinstance(upper.get("metadata"), dict):
            raise QueryError("the pod is not a JSON object with metadata")
        if not isinstance(upper.get("spec"), dict):
            raise QueryError("the pod has no spec")
        lower, facts = self._lower_form(upper)
        try:
            # The upper pod's: its lower form adds only the lower RuntimeClass's overhead.
            negative = negative_quantity(upper)
        except (TypeError, AttributeError) as error:
            raise QueryError(f"the pod's resources are not what they should be: {error}") from error
        if negative is not None:
            raise QueryError(negative)
        try:
            # Read again by the refusal of every answer: a shape it cannot read (a sysctl
            # that is not an object) ended the call with gRPC's UNKNOWN, not an answer.
            host_access(lower["spec"])
        except (TypeError, AttributeError) as error:
            raise QueryError(
                f"the pod's security context is not what it should be: {error}"
            ) from error
        uid = str(upper["metadata"].get("uid") or "")
        if "\0" in uid:
            # The state keys its simulations' assumptions so: a hold under such a UID
            # would be taken for one and its room never given back.
            raise QueryError("the pod's uid has a NUL character in it")
        return uid, lower, facts

    @_exclusive
    def answer(self, pod_json: bytes, replicas: int = 1, reserve: bool = False) -> Answer:
        """How the pod (the upper pod as JSON) would fare here; with ``reserve``, the
        room of one copy is held for it on the node it would take."""
        if replicas > MAX_REPLICAS:
            raise QueryError(f"{replicas} replicas asked for; at most {MAX_REPLICAS}")
        self.expire()
        uid, lower, facts = self._read(pod_json)
        namespace, amount = self._budgeted(lower)
        copies, over_budget = (
            self.budgets.room_for(namespace, uid, amount, max(1, replicas))
            if amount is not None
            else (max(1, replicas), "")
        )
        usage = quota_usage(lower) if self.quotas.holds(namespace) else None
        if usage is not None and not over_budget:
            copies, over_budget = self.quotas.room_for(
                namespace, uid, usage, copies, self.owner.cluster_id
            )
        refusal = over_budget or self._refusal(lower)
        if refusal:
            # Room held for it here is of no use now (nothing tells the extender to give
            # it back: this answer names no node).
            if self._reserved.pop(uid, None) is not None:
                self._unreserve(uid)
            nothing = Estimate(self.state.node_count(), (), {}, 0, 0.0, 0.0, 0)
            return Answer(nothing, None, refusal)
        # A pod asked about again is judged without the room it already holds.
        held_on = self.state.forget(uid) if uid in self._reserved else None
        estimate = self.state.estimate(facts, max(1, replicas))
        if copies < estimate.max_replicas:
            estimate = dataclasses.replace(estimate, max_replicas=copies)
        room = estimate.roomiest
        unbound = bool(uid) and uid not in self._in_flight and uid not in self._landed
        if reserve and unbound and room is not None:
            self.state.assume(uid, facts, room)
            self._reserved[uid] = _Reservation(self.clock() + RESERVATION_SECONDS, lower)
            if amount is not None:
                self.budgets.count(uid, namespace, amount)
            if usage is not None:
                self.quotas.count(uid, namespace, usage)
            return Answer(estimate, room)
        if held_on is not None:
            # Kept until it lapses: room held while evicted pods go fits the pod only
            # once they are gone.
            self.state.assume(uid, facts, held_on)
        return Answer(estimate, None)

    @_exclusive
    def hold(self, pod_json: bytes, node: str, seconds: float) -> None:
        """Holds the pod's room on ``node`` for ``seconds``, as a reservation: the
        pod's next query takes a node that fits it then, or keeps this one."""
        self.expire()
        uid, lower, facts = self._read(pod_json)
        if not uid:
            raise QueryError("the pod has no UID")
        if uid in self._in_flight or uid in self._landed:
            raise QueryError(f"pod {uid} is bound here already")
        if not self.state.has_node(node):
            raise QueryError(f"no lower node {node!r}")
        if not 0 < seconds <= MAX_HOLD_SECONDS:
            raise QueryError(f"{seconds} s is not above 0 and at most {MAX_HOLD_SECONDS:.0f} s")
        refusal = self._refusal(lower)
        if refusal:
            raise QueryError(refusal)
        namespace, amount = self._budgeted(lower)
        if amount is not None:
            _, over_budget = self.budgets.room_for(namespace, uid, amount)
            if over_budget:
                raise QueryError(over_budget)
        usage = quota_usage(lower) if self.quotas.holds(namespace) else None
        if usage is not None:
            _, over_quota = self.quotas.room_for(namespace, uid, usage, 1, self.owner.cluster_id)
            if over_quota:
                raise QueryError(over_quota)
        self.state.assume(uid, facts, node)
        self._reserved[uid] = _Reservation(self.clock() + seconds, lower)
        if amount is not None:
            self.budgets.count(uid, namespace, amount)
        if usage is not None:
            self.quotas.count(uid, namespace, usage)

    @_exclusive
    def fit_in_turn(self, pods_json: list[bytes]) -> list[str | None]:
        self.expire()
        return self.state.fit_in_turn([self._read(pod)[2] for pod in pods_json])

    @_exclusive
    def defragment(self, pod_json: bytes, movable_uids: list[str], most: int) -> list[Plan]:
        """Plans that make room for the pod by evicting some of the ``movable_uids``
        (upper pods bound here; those not on a lower node yet, or unknown, are left
        out), each judged as its controller's replacement would be; none for a pod this
        cluster would not run whatever room it had (evictions would be for nothing)."""
        self.expire()
        _, lower, facts = self._read(pod_json)
        if self._refusal(lower):
            return []
        uids_by_key: dict[str, str] = {}
        movable: dict[str, JSON] = {}
        for uid in movable_uids:
            key, upper_key = self._lower_keys.get(uid), self._upper_keys.get(uid)
            upper = (
                self._upper_pods.get(upper_key)
                if self._upper_pods is not None and upper_key is not None
                else None
            )
            if key is None or upper is None or uid not in self._landed:
                continue
            try:
                movable[key] = self._lower_form(upper)[0]
            except QueryError as error:
                log.debug("pod %s not movable: %s", upper_key, error)
                continue
            uids_by_key[key] = uid
        return [
            Plan(
                freeing.node,
                tuple(uids_by_key[key] for key in freeing.evicted),
                tuple(uids_by_key[key] for key in freeing.homeless),
            )
            for freeing in self.state.freeing(facts, movable, most)
        ]

    @_exclusive
    def release(self, uids: list[str]) -> int:
        """Gives back reservations (never the room of pods bound here)."""
        released = 0
        for uid in uids:
            if self._reserved.pop(uid, None) is not None:
                self._unreserve(uid)
                released += 1
        return released

    @_exclusive
    def expire(self) -> None:
        now = self.clock()
        for uid in [uid for uid, held in self._reserved.items() if held.until <= now]:
            del self._reserved[uid]
            self._unreserve(uid)

    def _unreserve(self, uid: str) -> None:
        self.state.forget(uid)
        self.budgets.uncount(uid)
        self.quotas.uncount(uid)


def _upper_claim_key(copy: Mapping[str, Any]) -> str | None:
    metadata = copy.get("metadata") or {}
    namespace = (metadata.get("annotations") or {}).get(keys.UPPER_NAMESPACE_ANNOTATION)
    return f"{namespace}/{metadata.get('name')}" if namespace else None


def to_message(answer: Answer, with_node_names: bool) -> estimator_pb2.PodEstimate:
    estimate = answer.estimate
    if answer.refusal:
        return estimator_pb2.PodEstimate(total_nodes=estimate.total_nodes, message=answer.refusal)
    return estimator_pb2.PodEstimate(
        total_nodes=estimate.total_nodes,
        fitting_count=len(estimate.fitting),
        fitting_nodes=list(estimate.fitting) if with_node_names else [],
        max_replicas=estimate.max_replicas,
        reasons=dict(estimate.reasons),
        message=estimate.message(),
        best_fit=estimate.best_fit,
        least_allocated=estimate.least_allocated,
        preferred=estimate.preferred,
        reserved_node=answer.reserved_node or "",
    )


_AUTH_CODES = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED}
_STREAMED = metrics.ESTIMATOR_REQUEST_DURATION.labels("EstimateStream")


class EstimatorService(estimator_pb2_grpc.EstimatorServicer):
    """The gRPC face of a FitEstimator. Callers authenticate with a bearer token for
    ``keys.ESTIMATOR_AUDIENCE`` (TokenReview) and need ``get`` on this node's
    ``nodes/estimator`` (a SubjectAccessReview): the kubelet API's checks, with their
    caches.

    ``home``: the loop the promises' lower client belongs to, when the service runs on
    another (``serve`` runs it on a thread of its own)."""

    def __init__(
        self,
        estimator: FitEstimator,
        authorizer: Authorizer,
        cluster_id: str,
        promises: SlicePromises | None = None,
        home: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.estimator = estimator
        self.authorizer = authorizer
        self.cluster_id = cluster_id
        self.promises = promises
        self.home = home

    async def _at_home(self, work: Coroutine[Any, Any, T]) -> T:
        return await on_loop(self.home, work)

    async def _check_caller(
        self, context: grpc.aio.ServicerContext[Any, Any], verb: str = "get"
    ) -> None:
        """The caller may ``verb`` this node's ``nodes/estimator``: ``get`` to ask,
        ``create`` to change what others are told (hold or give back room, promise
        slices), as a kubelet asks ``create`` for what acts on its pods. With ``get``
        alone, any reader could hold a cluster's room for an hour or give back the room
        held for other pods."""
        metadata = {key: value for key, value in context.invocation_metadata() or ()}
        authorization = metadata.get("authorization", "")
        try:
            user = await self.authorizer.authenticate(
                None,
                authorization if isinstance(authorization, str) else "",
                keys.ESTIMATOR_AUDIENCE,
            )
            await self.authorizer.authorize_node_access(user, verb, "estimator")
        except AuthError as error:
            await context.abort(
                _AUTH_CODES.get(error.status, grpc.StatusCode.UNAVAILABLE), error.message
            )

    @metrics.timed(metrics.ESTIMATOR_REQUEST_DURATION, "Estimate")
    async def Estimate(
        self,
        request: estimator_pb2.EstimateRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.EstimateResponse:
        await self._check_caller(context, _verb(request))
        return self._estimates(request)

    async def EstimateStream(
        self,
        requests: AsyncIterator[estimator_pb2.EstimateRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[estimator_pb2.EstimateResponse]:
        async for request in requests:
            with _STREAMED.time():
                # The token the call was opened with may have expired, or the caller lost
                # its permission, since the last request: both are cached for a while.
                await self._check_caller(context, _verb(request))
                response = self._estimates(request)
            yield response

    def _estimates(self, request: estimator_pb2.EstimateRequest) -> estimator_pb2.EstimateResponse:
        self.estimator.release(list(request.release_pod_uids))
        estimates = []
        for query in request.pods:
            try:
                answer = self.estimator.answer(query.pod, query.replicas, query.reserve)
            except QueryError as error:
                estimates.append(estimator_pb2.PodEstimate(error=str(error)))
                continue
            estimates.append(to_message(answer, query.with_node_names))
        return estimator_pb2.EstimateResponse(cluster_id=self.cluster_id, estimates=estimates)

    @metrics.timed(metrics.ESTIMATOR_REQUEST_DURATION, "Release")
    async def Release(
        self,
        request: estimator_pb2.ReleaseRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.ReleaseResponse:
        await self._check_caller(context, "create")
        return estimator_pb2.ReleaseResponse(
            released=self.estimator.release(list(request.pod_uids))
        )

    @metrics.timed(metrics.ESTIMATOR_REQUEST_DURATION, "Defragment")
    async def Defragment(
        self,
        request: estimator_pb2.DefragmentRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.DefragmentResponse:
        await self._check_caller(context)
        try:
            plans = self.estimator.defragment(
                request.pod, list(request.movable_pod_uids), request.max_evictions
            )
        except QueryError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return estimator_pb2.DefragmentResponse(
            cluster_id=self.cluster_id,
            plans=[
                estimator_pb2.Freeing(
                    node=plan.node,
                    evicted_pod_uids=plan.evicted,
                    homeless_pod_uids=plan.homeless,
                )
                for plan in plans
            ],
        )

    @metrics.timed(metrics.ESTIMATOR_REQUEST_DURATION, "FitInTurn")
    async def FitInTurn(
        self,
        request: estimator_pb2.FitInTurnRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.FitInTurnResponse:
        await self._check_caller(context)
        try:
            nodes = self.estimator.fit_in_turn(list(request.pods))
        except QueryError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return estimator_pb2.FitInTurnResponse(
            cluster_id=self.cluster_id, nodes=[node or "" for node in nodes]
        )

    @metrics.timed(metrics.ESTIMATOR_REQUEST_DURATION, "Hold")
    async def Hold(
        self,
        request: estimator_pb2.HoldRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.HoldResponse:
        await self._check_caller(context, "create")
        try:
            self.estimator.hold(request.pod, request.node, request.seconds)
        except QueryError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return estimator_pb2.HoldResponse()

    async def _slice_promises(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        namespace: str | None = None,
        verb: str = "get",
    ) -> SlicePromises:
        await self._check_caller(context, verb)
        if self.promises is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this virtual node keeps no slices")
        assert self.promises is not None  # abort raises
        if namespace is not None:
            try:
                self.promises.mapping.lower(namespace)
            except NamingError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return self.promises

    @metrics.timed(metrics.ESTIMATOR_REQUEST_DURATION, "SliceRoom")
    async def SliceRoom(
        self,
        request: estimator_pb2.SliceRoomRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.SliceRoomResponse:
        promises = await self._slice_promises(context, request.namespace)
        try:
            room = await self._at_home(promises.room(request.namespace))
        except SliceError as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except API_ERRORS as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the lower cluster: {error}")
        return estimator_pb2.SliceRoomResponse(
            cluster_id=self.cluster_id,
            nodes=[_resources(node) for node in room.nodes],
            promised_to_others=_resources(room.promised_to_others),
            held=room.held,
            held_slice=_resources(room.held_slice),
            used=_resources(room.used),
            held_unreadable=room.held_unreadable,
        )

    @metrics.timed(metrics.ESTIMATOR_REQUEST_DURATION, "PromiseSlices")
    async def PromiseSlices(
        self,
        request: estimator_pb2.PromiseSlicesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.PromiseSlicesResponse:
        promises = await self._slice_promises(context, request.namespace, "create")
        size = Amount(request.slice.cpu_millis, request.slice.memory_bytes)
        if request.slices < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "slices cannot be negative")
        if request.slices and (size.cpu < 0 or size.memory < 0 or size == Amount()):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the slice size must be positive")
        if request.slices and (why := promises.mapping.refusal(request.namespace)):
            # Its pods are refused here: its quota below would cap the lower cluster's own.
            return estimator_pb2.PromiseSlicesResponse(refused=why)
        try:
            await self._at_home(
                promises.promise(request.namespace, request.slices, size, request.headroom)
            )
        except (PromiseRefused, SliceError) as error:
            return estimator_pb2.PromiseSlicesResponse(refused=str(error))
        except API_ERRORS as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the lower cluster: {error}")
        return estimator_pb2.PromiseSlicesResponse()

    @metrics.timed(metrics.ESTIMATOR_REQUEST_DURATION, "SlicedNamespaces")
    async def SlicedNamespaces(
        self,
        request: estimator_pb2.SlicedNamespacesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.SlicedNamespacesResponse:
        promises = await self._slice_promises(context)
        try:
            namespaces = await self._at_home(promises.sliced_namespaces())
        except API_ERRORS as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the lower cluster: {error}")
        return estimator_pb2.SlicedNamespacesResponse(
            cluster_id=self.cluster_id, namespaces=sorted(namespaces)
        )


def _verb(request: estimator_pb2.EstimateRequest) -> str:
    """What an estimate asks of the caller: ``create`` when it holds or gives back room."""
    if request.release_pod_uids or any(query.reserve for query in request.pods):
        return "create"
    return "get"


def _resources(amount: Amount) -> estimator_pb2.Resources:
    return estimator_pb2.Resources(cpu_millis=amount.cpu, memory_bytes=amount.memory)


def reloading_credentials(pair: pki.KeyPair) -> grpc.ServerCredentials:
    """TLS credentials that take the pair's files again once they are renewed (a new
    kubelet-serving certificate): gRPC asks before each handshake."""
    files = CertificateFiles(pair.cert_path, pair.key_path)

    def fetch() -> Any:
        renewed = files.renewed()
        if renewed is None:
            return None
        cert, key = renewed
        return grpc.ssl_server_certificate_configuration([(key, cert)])

    first = grpc.ssl_server_certificate_configuration(
        [(pair.key_path.read_bytes(), pair.cert_path.read_bytes())]
    )
    return grpc.dynamic_ssl_server_credentials(first, fetch)


class ParsedByTheService(grpc.aio.ServerInterceptor):
    """Requests are parsed in the call rather than by gRPC, whose failure to parse one
    ends the call UNKNOWN and logs a traceback, for any caller, before the service has
    checked who it is; here it ends INVALID_ARGUMENT, quietly."""

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        async def parsed(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                return parse(request)
            except DecodeError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {error}")

        # The aio server's behaviours are coroutine functions and async generator
        # functions, which grpc's types miss.
        if handler.unary_unary is not None:
            behavior = cast(Callable[[Any, Any], Awaitable[Any]], handler.unary_unary)

            async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                return await behavior(await parsed(request, context), context)

            return grpc.unary_unary_rpc_method_handler(
                unary, response_serializer=handler.response_serializer
            )
        if handler.stream_stream is not None:
            streamed = cast(Callable[[Any, Any], AsyncIterator[Any]], handler.stream_stream)

            async def stream(
                requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                async def messages() -> AsyncIterator[Any]:
                    async for request in requests:
                        yield await parsed(request, context)

                async for response in streamed(messages(), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(
                stream, response_serializer=handler.response_serializer
            )
        return handler


async def _start(
    service: EstimatorService, address: str, port: int, pair: pki.KeyPair
) -> grpc.aio.Server:
    server = grpc.aio.server(
        interceptors=(ParsedByTheService(),), options=server_keepalive_options()
    )
    estimator_pb2_grpc.add_EstimatorServicer_to_server(service, server)
    target = host_port(address, port)
    try:
        bound = server.add_secure_port(target, reloading_credentials(pair))
    except RuntimeError:  # grpcio's way of saying it, where older versions returned 0
        bound = 0
    if bound == 0:
        raise OSError(f"the estimator cannot listen on {target}")
    await server.start()
    return server


def _run(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.run_forever()
    finally:
        try:
            _end_tasks(loop)
        finally:
            loop.close()


def _end_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Ends what the stopped server left on its loop, as ``asyncio.run`` does: a call the
    server cancelled, or the closing of a stream's generator, can still want a turn of the
    loop, and a task closed pending is destroyed with an error report."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())


class EstimatorServer:
    """The estimator's gRPC server on a thread and event loop of its own. On the virtual
    node's loop an answer would wait behind every callback a burst of pods queues there
    (the extender's decision waits for the slowest estimator it asks); here it waits for
    the interpreter at most ``SWITCH_INTERVAL_SECONDS``."""

    def __init__(
        self, thread: threading.Thread, loop: asyncio.AbstractEventLoop, server: grpc.aio.Server
    ) -> None:
        self._thread = thread
        self._loop = loop
        self._server = server

    async def stop(self, grace: float | None) -> None:
        await on_loop(self._loop, self._server.stop(grace))
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)


async def serve(
    service: EstimatorService, address: str, port: int, pair: pki.KeyPair
) -> EstimatorServer:
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=_run, args=(loop,), name="estimator", daemon=True)
    thread.start()
    try:
        server = await on_loop(loop, _start(service, address, port, pair))
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join)
        raise
    return EstimatorServer(thread, loop, server)
