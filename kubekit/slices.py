"""Namespace quota slices over a pool of lower clusters, as pure functions.

A namespace whose ResourceQuotas cap cpu and/or memory requests has a quota: per
resource, the strictest cap. It is cut into equal slices (the size is a namespace
annotation, 2 CPU and 4Gi by default); the number of slices is the largest over the
capped resources of ceil(quota / size). Only capped resources count in a slice: a quota
on cpu alone promises no memory.

Slices are placed on lower clusters so that what each cluster has promised, to every
namespace of every tenant sharing it, stays within the allocatable of its schedulable
Ready nodes less a headroom, and only where one node could take a whole slice. Promises
already made are kept even if the cluster has since shrunk (a node gone NotReady for a
minute must not move a namespace away); only growth is held to the room left.

Every amount is an integer: cpu in millicores, memory in bytes, quotas and slice sizes
rounded up to them and node capacity down (500m stays 500m; VirtualCluster's
``Quantity.Value()`` made it 1).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import orjson

from kubekit.quantity import QuantityError, format_quantity, parse_quantity

RESOURCES = ("cpu", "memory")
# The quota keys that cap a resource's requests: "cpu" is the older spelling.
_QUOTA_KEYS = {"cpu": ("requests.cpu", "cpu"), "memory": ("requests.memory", "memory")}
# A cpu amount's unit is the millicore.
_UNITS = {"cpu": 1000, "memory": 1}


class SliceError(ValueError):
    """An annotation or flag that cannot be read: the message says what to fix."""


class Policy(enum.StrEnum):
    # Each new slice to the cluster holding the fewest of the namespace's slices.
    SPREAD = "spread"
    # Each new slice to the cluster holding the most, so a namespace spans few clusters.
    PACK = "pack"


@dataclass(frozen=True, order=True)
class Amount:
    cpu: int = 0  # millicores
    memory: int = 0  # bytes

    def __add__(self, other: Amount) -> Amount:
        return Amount(self.cpu + other.cpu, self.memory + other.memory)

    def __sub__(self, other: Amount) -> Amount:
        return Amount(self.cpu - other.cpu, self.memory - other.memory)

    def times(self, count: int) -> Amount:
        return Amount(self.cpu * count, self.memory * count)

    def most(self, other: Amount) -> Amount:
        """The larger of the two in each resource."""
        return Amount(max(self.cpu, other.cpu), max(self.memory, other.memory))

    def within(self, limit: Amount) -> bool:
        return self.cpu <= limit.cpu and self.memory <= limit.memory

    def get(self, resource: str) -> int:
        return int(getattr(self, resource))

    def quantities(self) -> dict[str, str]:
        """The non-zero resources as Kubernetes quantities."""
        return {
            resource: format_quantity(Fraction(self.get(resource), _UNITS[resource]), resource)
            for resource in RESOURCES
            if self.get(resource)
        }

    def only(self, size: Amount) -> Amount:
        """This amount in the resources a slice of ``size`` holds; 0 in the others."""
        return Amount(**{r: self.get(r) if size.get(r) else 0 for r in RESOURCES})

    def describe(self) -> str:
        return ", ".join(f"{name} {value}" for name, value in self.quantities().items()) or "0"


def amount(resources: Mapping[str, Any], round_up: bool = True) -> Amount:
    """cpu and memory of a map of quantities (others ignored); absent means 0."""
    values = {}
    for resource in RESOURCES:
        value = resources.get(resource)
        if value is None:
            values[resource] = 0
            continue
        try:
            exact = parse_quantity(value) * _UNITS[resource]
        except (QuantityError, TypeError, ValueError) as error:
            raise SliceError(f"{resource}: {error}") from None
        values[resource] = math.ceil(exact) if round_up else math.floor(exact)
    return Amount(**values)


# -- a namespace's quota and slices ------------------------------------------------------


def namespace_quota(quotas: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The strictest cap on each resource's requests over a namespace's ResourceQuotas;
    a resource no quota caps is absent. Quotas with scopes cap only some pods and are
    left out."""
    caps: dict[str, int] = {}
    for quota in quotas:
        spec = quota.get("spec") or {}
        if spec.get("scopes") or spec.get("scopeSelector"):
            continue
        hard = spec.get("hard") or {}
        for resource, quota_keys in _QUOTA_KEYS.items():
            for key in quota_keys:
                if key in hard:
                    value = amount({resource: hard[key]}).get(resource)
                    caps[resource] = min(caps.get(resource, value), value)
    return caps


DEFAULT_SLICE_SIZE = Amount(cpu=2000, memory=4 * 2**30)
LARGEST_SLICE = 2**63 - 1


def slice_size(annotation: str | None, default: Amount = DEFAULT_SLICE_SIZE) -> Amount:
    """The slice size annotation (JSON ``{"cpu": "2", "memory": "4Gi"}``), either key
    falling back to the default."""
    if annotation is None:
        return default
    try:
        declared = orjson.loads(annotation)
    except orjson.JSONDecodeError as error:
        raise SliceError(f"the slice size is not JSON: {error}") from None
    if not isinstance(declared, dict):
        raise SliceError('the slice size must be a JSON object like {"cpu": "2", "memory": "4Gi"}')
    unknown = sorted(set(declared) - set(RESOURCES))
    if unknown:
        raise SliceError(f"the slice size has only cpu and memory, not {', '.join(unknown)}")
    for resource, value in declared.items():
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise SliceError(f"the slice size's {resource} must be a quantity, not {value!r}")
    size = amount(declared)
    for resource in declared:
        if size.get(resource) <= 0:
            raise SliceError(f"the slice size's {resource} must be above 0")
        if size.get(resource) > LARGEST_SLICE:
            # Past what a promise carries (an int64 of millicores or bytes).
            raise SliceError(f"the slice size's {resource} is too large: {declared[resource]}")
    return Amount(
        cpu=size.cpu if "cpu" in declared else default.cpu,
        memory=size.memory if "memory" in declared else default.memory,
    )


def capped_size(size: Amount, quota: Mapping[str, int]) -> Amount:
    """The part of a slice a quota caps: a resource the quota leaves free, or allows none
    of, is not promised."""
    return Amount(**{r: size.get(r) if quota.get(r, 0) > 0 else 0 for r in RESOURCES})


# Slices are placed one at a time on the multischeduler's loop, which also answers the
# scheduler: a slice size of 4 bytes of memory ("4" for "4Gi") over a 10Gi quota would
# be 2.7 billion slices, and that loop frozen for most of an hour.
MAX_SLICES = 10_000


def slice_count(quota: Mapping[str, int], size: Amount) -> int:
    """Slices of ``size`` that cover the quota in every resource a slice holds; more than
    ``MAX_SLICES`` is a SliceError."""
    count = max(
        (-(-quota[r] // size.get(r)) for r in quota if size.get(r) > 0),
        default=0,
    )
    if count > MAX_SLICES:
        raise SliceError(
            f"slices of {size.describe()} make {count} of the namespace's quota, more than "
            f"{MAX_SLICES:,}: set a larger slice size"
        )
    return count


def size_changed(before: Amount, after: Amount) -> bool:
    """Whether a slice's size changed in a resource both sizes hold: a cap added to or
    removed from the quota changes which resources a slice holds, not their size."""
    return any(before.get(r) != after.get(r) for r in RESOURCES if before.get(r) and after.get(r))


def grows(held: tuple[int, Amount], count: int, size: Amount) -> bool:
    """Whether ``count`` slices of ``size`` promise more, in any resource, than ``held``
    (slices, size) did: re-sliced, fewer slices can hold more."""
    slices, held_size = held
    return not size.times(count).within(held_size.times(slices))


# -- placements --------------------------------------------------------------------------


def placement(annotation: str | None) -> dict[str, int]:
    """The placement annotation, ``{cluster-id: slices}``; clusters with 0 left out."""
    if annotation is None or not annotation.strip():
        return {}
    try:
        declared = orjson.loads(annotation)
    except orjson.JSONDecodeError as error:
        raise SliceError(f"the placement is not JSON: {error}") from None
    if not isinstance(declared, dict):
        raise SliceError('the placement must be a JSON object like {"lower-1": 3}')
    result = {}
    for cluster, count in declared.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise SliceError(
                f"the placement's {cluster} must be a whole number of slices, not {count!r}"
            )
        if count:
            result[cluster] = count
    return result


def placement_json(slices: Mapping[str, int]) -> str:
    return orjson.dumps(
        {cluster: slices[cluster] for cluster in sorted(slices) if slices[cluster]}
    ).decode()


@dataclass(frozen=True)
class Headroom:
    """What a cluster keeps out of every promise: a share of its capacity, or an amount."""

    percent: Fraction = Fraction(0)
    amount: Amount = Amount()

    def of(self, capacity: Amount) -> Amount:
        return self.amount + Amount(
            cpu=math.ceil(capacity.cpu * self.percent / 100),
            memory=math.ceil(capacity.memory * self.percent / 100),
        )


def headroom(text: str) -> Headroom:
    """``10%``, ``0``, or ``cpu=2,memory=4Gi`` (a resource left out keeps none)."""
    text = text.strip()
    if text.endswith("%"):
        try:
            percent = Fraction(text[:-1])
        except ValueError:
            raise SliceError(f"not a percentage: {text!r}") from None
        if not 0 <= percent < 100:
            raise SliceError(f"a headroom percentage must be from 0 to below 100, not {text}")
        return Headroom(percent=percent)
    if text == "0":
        return Headroom()
    declared: dict[str, str] = {}
    for part in text.split(","):
        resource, equals, value = part.partition("=")
        resource = resource.strip()
        if not equals or resource not in RESOURCES or resource in declared:
            raise SliceError(f"a headroom is N% or cpu=QUANTITY,memory=QUANTITY, not {text!r}")
        declared[resource] = value.strip()
    held = amount(declared)
    if held.cpu < 0 or held.memory < 0:
        raise SliceError(f"a headroom cannot be negative: {text!r}")
    return Headroom(amount=held)


@dataclass(frozen=True)
class ClusterRoom:
    """What one lower cluster can promise a namespace."""

    cluster: str
    # Allocatable of each schedulable Ready node.
    nodes: tuple[Amount, ...]
    # Promised to every other namespace, of every tenant.
    promised_to_others: Amount
    headroom: Headroom = Headroom()

    @functools.cached_property
    def allocatable(self) -> Amount:
        return Amount(sum(node.cpu for node in self.nodes), sum(node.memory for node in self.nodes))

    @property
    def limit(self) -> Amount:
        """The most this cluster promises in all."""
        capacity = self.allocatable
        left = capacity - self.headroom.of(capacity)
        # A headroom larger than the cluster leaves nothing, never less.
        return Amount(max(0, left.cpu), max(0, left.memory))

    def slots(self, size: Amount) -> int:
        """How many slices of this size the namespace may hold here in all."""
        if not any(size.within(node) for node in self.nodes):
            return 0
        left = self.limit - self.promised_to_others
        counts = [
            left.get(resource) // size.get(resource) for resource in RESOURCES if size.get(resource)
        ]
        return max(0, min(counts)) if counts else 0


def without_room(room: ClusterRoom) -> ClusterRoom:
    """The cluster with no room left for the namespace: it refused to grow its promise
    (another tenant took the room first). What it holds stays; it takes no new slices."""
    return dataclasses.replace(room, promised_to_others=room.limit)


@dataclass(frozen=True)
class Shortfall:
    """The namespace's slices cannot all be placed: the placement stays as it was."""

    wanted: int
    placeable: int
    message: str


def _shortfall(
    count: int, size: Amount, rooms: Sequence[ClusterRoom], current: Mapping[str, int]
) -> Shortfall:
    slots = {room.cluster: room.slots(size) for room in rooms}
    placeable = sum(max(slots.get(name, 0), current.get(name, 0)) for name in {*slots, *current})
    missing = count - placeable
    where = "; ".join(
        f"{room.cluster}: room for {slots[room.cluster]} (can promise "
        f"{room.limit.only(size).describe()}, "
        f"{room.promised_to_others.only(size).describe()} promised to others"
        + ("" if any(size.within(node) for node in room.nodes) else ", no node takes a slice")
        + ")"
        for room in sorted(rooms, key=lambda room: room.cluster)
    )
    return Shortfall(
        wanted=count,
        placeable=placeable,
        message=(
            f"{count} slices of {size.describe()} wanted, room for {placeable}: "
            f"{missing} missing ({size.times(missing).describe()}). {where or 'no lower clusters'}"
        ),
    )


def place(
    count: int,
    size: Amount,
    rooms: Sequence[ClusterRoom],
    current: Mapping[str, int],
    used: Mapping[str, int] | None = None,
    policy: Policy = Policy.SPREAD,
) -> dict[str, int] | Shortfall:
    """Where a namespace's ``count`` slices go, starting from where they are and from
    where its pods run.

    ``current`` is kept (a cluster gone from the pool is for the caller to leave out),
    and each cluster that answered starts from at least what the namespace's pods use
    there (``used``: slices' worth of their requests, rounded up), as far as its room
    goes: its first slices placed elsewhere, the room its running pods use would be
    promised to others. Slices are then added by the policy (ties by the most room
    left, then the name) or taken back from the clusters where the most of them are
    unused, ties by name, never below what its pods use: given back, that room would be
    promised again while they run on it, so the result holds more than ``count`` until
    they finish. A cluster missing from ``rooms`` (its estimator did not answer) keeps
    its slices and takes no new ones."""
    used = used or {}
    slots = {room.cluster: room.slots(size) for room in rooms}
    result = {cluster: held for cluster, held in current.items() if held > 0}
    for cluster, room_for in slots.items():
        running = min(used.get(cluster, 0), room_for)
        if running > result.get(cluster, 0):
            result[cluster] = running
    surplus = sum(result.values()) - count
    while surplus > 0:
        # From clusters that answered: one that did not may be the busiest.
        unused = [name for name in result if name in slots and result[name] > used.get(name, 0)]
        if not unused:
            break
        cluster = min(unused, key=lambda name: (used.get(name, 0) - result[name], name))
        result[cluster] -= 1
        if not result[cluster]:
            del result[cluster]
        surplus -= 1
    held_order = 1 if policy is Policy.SPREAD else -1
    for _ in range(-surplus):
        open_clusters = [name for name in slots if result.get(name, 0) < slots[name]]
        if not open_clusters:
            return _shortfall(count, size, rooms, current)
        cluster = min(
            open_clusters,
            key=lambda name: (
                held_order * result.get(name, 0),
                result.get(name, 0) - slots[name],
                name,
            ),
        )
        result[cluster] = result.get(cluster, 0) + 1
    return result


def check_edit(
    edited: Mapping[str, int],
    count: int,
    size: Amount,
    rooms: Sequence[ClusterRoom],
    current: Mapping[str, int],
    used: Mapping[str, int] | None = None,
) -> str | None:
    """Why a placement a user wrote cannot be honoured, or None."""
    known = {room.cluster: room for room in rooms}
    unknown = sorted(set(edited) - set(known) - set(current))
    if unknown:
        pool = ", ".join(sorted(known)) or "none"
        return (
            f"no lower cluster {', '.join(unknown)} in the pool, or its estimator does not "
            f"answer (clusters answering: {pool})"
        )
    silent = sorted(
        cluster
        for cluster in set(current) - set(known)
        if edited.get(cluster, 0) != current[cluster]
    )
    if silent:
        # Its ledger cannot be written: the edit would be recorded as made, and taken
        # back at the next look.
        return f"the estimator of {', '.join(silent)} does not answer: its slices cannot move now"
    total = sum(edited.values())
    if total != count:
        return f"the placement holds {total} slices, the quota makes {count}"
    for cluster, held in sorted(edited.items()):
        room = known.get(cluster)
        allowed = max(current.get(cluster, 0), room.slots(size) if room else 0)
        if held > allowed:
            return f"{cluster} has room for {allowed} slices of {size.describe()}, not {held}"
    for cluster, held in sorted(current.items()):
        in_use = min(held, (used or {}).get(cluster, 0))
        if edited.get(cluster, 0) < in_use:
            return (
                f"the namespace's pods in {cluster} use {in_use} slices of "
                f"{size.describe()}, more than {edited.get(cluster, 0)}"
            )
    return None


# -- the lower cluster's record of its promises ------------------------------------------
# One ConfigMap in each lower cluster (keys.SLICE_LEDGER_CONFIGMAP): per lower namespace,
# the upper namespace and cluster (origin) it stands for and the slices promised to it.
# Every tenant's virtual node writes it with its resourceVersion, so the lower apiserver
# serializes two tenants' promises.


@dataclass(frozen=True)
class LedgerEntry:
    namespace: str
    origin: str
    slices: int
    size: Amount

    @property
    def promised(self) -> Amount:
        return self.size.times(self.slices)

    def encode(self) -> str:
        return orjson.dumps(
            {
                "namespace": self.namespace,
                "origin": self.origin,
                "slices": self.slices,
                "size": {"cpu": self.size.cpu, "memory": self.size.memory},
            }
        ).decode()


def entry_origin(text: str) -> str | None:
    """The upper cluster an entry names, read from it however broken the rest is (None:
    not even that): another tenant's entry is never taken for this one's."""
    try:
        entry = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    # As ledger_entry reads it.
    return str(entry["origin"]) if isinstance(entry, dict) and "origin" in entry else None


def ledger_entry(key: str, text: str) -> LedgerEntry:
    try:
        entry = orjson.loads(text)
        size = entry["size"]
        result = LedgerEntry(
            namespace=str(entry["namespace"]),
            origin=str(entry["origin"]),
            slices=int(entry["slices"]),
            size=Amount(cpu=int(size["cpu"]), memory=int(size["memory"])),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise SliceError(f"the ledger's entry {key} cannot be read: {error!r}") from None
    if result.slices < 0 or result.size.cpu < 0 or result.size.memory < 0:
        raise SliceError(f"the ledger's entry {key} is negative")
    return result


def promised_to_others(ledger: Mapping[str, str], excluded: str) -> Amount:
    """What the ledger promises every lower namespace but one. An entry that cannot be
    read is an error, not nothing: counting it as 0 could promise its room twice."""
    return sum(
        (ledger_entry(key, text).promised for key, text in ledger.items() if key != excluded),
        Amount(),
    )


def quota_hard(entry: LedgerEntry) -> dict[str, str]:
    """The lower ResourceQuota that holds a namespace to its promised slices."""
    promised = entry.promised
    hard = {}
    if entry.size.cpu:
        hard["requests.cpu"] = promised.quantities().get("cpu", "0")
    if entry.size.memory:
        hard["requests.memory"] = promised.quantities().get("memory", "0")
    return hard


@dataclass(frozen=True)
class Applied:
    """What the multischeduler last promised a namespace (its own annotation): an edit of
    the placement is told apart from it, and a changed slice size from its size."""

    size: Amount
    slices: Mapping[str, int]

    def encode(self) -> str:
        return orjson.dumps(
            {"size": {"cpu": self.size.cpu, "memory": self.size.memory}, "placement": self.slices}
        ).decode()


def applied(annotation: str | None) -> Applied | None:
    """The applied annotation, or None when absent or not ours to read (then nothing is
    known to be promised, and the namespace is placed afresh)."""
    if not annotation:
        return None
    try:
        decoded = orjson.loads(annotation)
        size = Amount(cpu=int(decoded["size"]["cpu"]), memory=int(decoded["size"]["memory"]))
        slices = placement(orjson.dumps(decoded["placement"]).decode())
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    return Applied(size, slices)


@dataclass(frozen=True)
class Decision:
    """Where a namespace's slices go now, and an edit of the placement refused (why)."""

    target: dict[str, int] | Shortfall
    refused_edit: str | None = None


def decide(
    written: str | None,
    before: Applied | None,
    count: int,
    size: Amount,
    rooms: Sequence[ClusterRoom],
    current: Mapping[str, int],
    used: Mapping[str, int],
    policy: Policy = Policy.SPREAD,
) -> Decision:
    """The placement from the annotation as written (``written``) and what was promised
    (``before``, ``current``): the multischeduler's own annotation is placed on from
    where it is; a user's edit is honoured if feasible, else refused and the slices
    stay where they were; a cleared (or removed) annotation places the namespace
    afresh."""
    ours = placement_json(before.slices) if before is not None else None
    if written is None and before is not None:
        written = ""  # the annotation removed: cleared
    if written is None or written == ours:
        return Decision(place(count, size, rooms, current, used, policy))
    try:
        edited = placement(written)
    except SliceError as error:
        return Decision(place(count, size, rooms, current, used, policy), str(error))
    if not edited:
        # Afresh, but from the slices its pods use: given back, that room would be
        # promised again while they run on it.
        in_use = {c: min(n, used.get(c, 0)) for c, n in current.items() if used.get(c, 0)}
        return Decision(place(count, size, rooms, in_use, used, policy))
    refusal = check_edit(edited, count, size, rooms, current, used)
    if refusal is not None:
        return Decision(place(count, size, rooms, current, used, policy), refusal)
    return Decision(dict(edited))


def slices_of(used: Amount, size: Amount) -> int:
    """Slices' worth of requests, rounded up."""
    return max(
        (
            -(-used.get(resource) // size.get(resource))
            for resource in RESOURCES
            if size.get(resource)
        ),
        default=0,
    )


def held_namespaces(ledger: Mapping[str, str], origin: str) -> set[str]:
    """The upper namespaces of one upper cluster (``origin``) holding slices here; an
    entry that cannot be read holds none."""
    held = set()
    for key, text in ledger.items():
        try:
            entry = ledger_entry(key, text)
        except SliceError:
            continue
        if entry.origin == origin and entry.slices > 0:
            held.add(entry.namespace)
    return held


def no_slices_here(namespace: str, cluster_id: str, slices: Mapping[str, int]) -> str | None:
    """Why a pod of a sliced namespace may not go to ``cluster_id``, which holds none of
    its slices (``slices``: {cluster-id: slices}), or None when it holds some."""
    if slices.get(cluster_id, 0) > 0:
        return None
    held = ", ".join(f"{cluster} {count}" for cluster, count in sorted(slices.items()) if count)
    return f"namespace {namespace} holds no quota slices in {cluster_id} " + (
        f"(its slices: {held})" if held else "(none placed)"
    )


def outside_applied_slices(
    namespace: str, applied_annotation: str | None, cluster_id: str
) -> str | None:
    """Why a pod of ``namespace`` may not go to ``cluster_id`` by the multischeduler's
    applied record of its slices (on the upper namespace), or None: the cluster holds
    some, or the record gives the namespace none anywhere (its quota is not sliced, or
    its slices are not placed yet, when the extender alone judges)."""
    record = applied(applied_annotation)
    if record is None or not any(record.slices.values()):
        return None
    return no_slices_here(namespace, cluster_id, record.slices)


def bound_outside_slices(
    namespace: str, applied_annotation: str | None, cluster_id: str, held_here: bool
) -> str | None:
    """Why a pod bound to this cluster's virtual node past the extender (its
    ``spec.nodeName`` set by its creator) is not made below: its namespace's quota is
    sliced (the multischeduler's applied record on the upper namespace) and neither that
    record nor this cluster's ledger (``held_here``) gives it slices here. Made, it would
    run outside its quota, on room promised to other namespaces; without a slice here there
    is no slice quota below to refuse it. Either record naming this cluster is enough: the
    ledger is written before the record, and the record is read above, so one may lag."""
    why = None if held_here else outside_applied_slices(namespace, applied_annotation, cluster_id)
    return None if why is None else f"{why}; a pod bound here by spec.nodeName would run outside it"
