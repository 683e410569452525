"""The namespace scheduler's controller, fed through its informers, with the estimators
answering from a table."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kubekit import keys
from kubekit.client import NAMESPACES, PODS, RESOURCEQUOTAS
from kubekit.estimatorapi.estimator_pb2 import (
    PromiseSlicesRequest,
    PromiseSlicesResponse,
    Resources,
    SlicedNamespacesResponse,
    SliceRoomResponse,
)
from kubekit.informer import Informer
from kubekit.slices import Amount, Applied, Policy, SliceError, applied, placement_json
from multischeduler.extender import EstimatorFailure, VirtualNode
from multischeduler.slicing import (
    Headrooms,
    PromiseNotMade,
    SliceController,
    condition_patch,
    headrooms,
    kept,
    promise_changes,
)

from .fakeapi import FakeClient

CPU = 1000
GI = 2**30


@dataclass
class Cluster:
    node_cpus: tuple[int, ...]
    promised_to_others: int = 0  # millicores
    used: int = 0
    refuse: str = ""
    down: bool = False
    # Answers its room, but not a promise (made or not, the caller cannot tell).
    promise_times_out: bool = False
    promises: list[PromiseSlicesRequest] = field(default_factory=list)
    # Its ledger: upper namespace -> (slices, slice size in millicores).
    ledger: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Namespaces whose entry in it cannot be read (until a promise writes it).
    unreadable: set[str] = field(default_factory=set)


class FakePool:
    def __init__(self, **clusters: Cluster) -> None:
        self.clusters = clusters
        self.nodes = {f"vk-{name}": VirtualNode(f"vk-{name}", name, "addr") for name in clusters}

    async def slice_room(
        self, name: str, namespace: str, timeout: float
    ) -> SliceRoomResponse | EstimatorFailure:
        cluster = self.clusters[name.removeprefix("vk-")]
        if cluster.down:
            return EstimatorFailure("UNAVAILABLE")
        return SliceRoomResponse(
            cluster_id=name.removeprefix("vk-"),
            nodes=[
                Resources(cpu_millis=cpu * CPU, memory_bytes=64 * GI) for cpu in cluster.node_cpus
            ],
            promised_to_others=Resources(cpu_millis=cluster.promised_to_others),
            used=Resources(cpu_millis=cluster.used),
            held=cluster.ledger.get(namespace, (0, 0))[0],
            held_slice=Resources(cpu_millis=cluster.ledger.get(namespace, (0, 0))[1]),
            held_unreadable=namespace in cluster.unreadable,
        )

    async def promise_slices(
        self, name: str, request: PromiseSlicesRequest, timeout: float
    ) -> PromiseSlicesResponse | EstimatorFailure:
        cluster = self.clusters[name.removeprefix("vk-")]
        if cluster.down:
            return EstimatorFailure("UNAVAILABLE")
        if cluster.promise_times_out:
            return EstimatorFailure("DEADLINE_EXCEEDED")
        cluster.promises.append(request)
        if not cluster.refuse:
            cluster.unreadable.discard(request.namespace)
            if request.slices:
                cluster.ledger[request.namespace] = (request.slices, request.slice.cpu_millis)
            else:
                cluster.ledger.pop(request.namespace, None)
        return PromiseSlicesResponse(refused=cluster.refuse)

    async def sliced_namespaces(
        self, name: str, timeout: float
    ) -> SlicedNamespacesResponse | EstimatorFailure:
        cluster = self.clusters[name.removeprefix("vk-")]
        if cluster.down:
            return EstimatorFailure("UNAVAILABLE")
        return SlicedNamespacesResponse(
            cluster_id=name.removeprefix("vk-"), namespaces=sorted(cluster.ledger)
        )

    def promised(self, cluster: str) -> list[int]:
        return [request.slices for request in self.clusters[cluster].promises]


def namespace(name: str = "team", **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {keys.FEDERATION_LABEL: keys.FEDERATION_ENABLED},
            "annotations": annotations,
        }
    }


def recorded(before: Applied, placement: str | None = None, **annotations: str) -> dict[str, Any]:
    """The namespace as the controller left it: its record of ``before``, and the
    placement annotation as written (the record's own by default)."""
    return namespace(
        **{
            keys.SLICE_APPLIED_ANNOTATION: before.encode(),
            keys.SLICE_PLACEMENT_ANNOTATION: placement or placement_json(before.slices),
            **annotations,
        }
    )


def quota(cpu: str, namespace: str = "team", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": f"q{cpu}", "namespace": namespace},
        "spec": {"hard": {"requests.cpu": cpu}, **spec},
    }


@dataclass
class World:
    client: FakeClient
    namespaces: Informer
    quotas: Informer
    pool: FakePool
    controller: SliceController

    def put(self, informer: Informer, obj: dict[str, Any], event: str = "ADDED") -> None:
        informer.apply({"type": event, "object": obj})

    def patched(self) -> dict[str, str | None]:
        """The annotations of the last patch of the namespace (applied to its cache)."""
        [*_, last] = [
            r for r in self.client.requests if r.method == "PATCH" and "/status" not in r.path
        ]
        annotations: dict[str, str | None] = last.body["metadata"]["annotations"]
        return annotations

    def condition(self) -> dict[str, Any]:
        """The slices condition the last status patch of the namespace set."""
        [*_, last] = [r for r in self.client.requests if r.path.endswith("/team/status")]
        [condition] = last.body["status"]["conditions"]
        assert condition["type"] == keys.SLICES_PLACED_CONDITION
        return dict(condition)

    def sync_namespace(self, name: str = "team") -> None:
        """Folds the controller's last patch into the namespace cache, as a watch would."""
        cached = self.namespaces.get(name)
        assert cached is not None
        current = dict(cached["metadata"].get("annotations") or {})
        for key, value in self.patched().items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
        updated = namespace(name, **current)
        statuses = [r for r in self.client.requests if r.path.endswith(f"/{name}/status")]
        if statuses:
            updated["status"] = statuses[-1].body["status"]
        self.put(self.namespaces, updated, "MODIFIED")

    async def drain(self) -> list[str]:
        """Reconciles every queued key once, as a worker would; returns them."""
        reconciled = []
        while len(self.controller.queue):
            key = await self.controller.queue.get()
            reconciled.append(key)
            try:
                await self.controller.reconcile(key)
            finally:
                self.controller.queue.done(key)
        return reconciled

    def events(self) -> list[tuple[str, str]]:
        return [
            (r.body["reason"], r.body["message"])
            for r in self.client.requests
            if r.method == "POST" and "/events" in r.path
        ]


def world(
    policy: Policy = Policy.SPREAD,
    quota_gone_grace: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    **clusters: Cluster,
) -> World:
    client = FakeClient()
    namespaces = Informer(client=None, resource=NAMESPACES)  # type: ignore[arg-type]
    quotas = Informer(client=None, resource=RESOURCEQUOTAS)  # type: ignore[arg-type]
    pool = FakePool(**clusters)
    controller = SliceController(
        client,
        namespaces,
        quotas,
        pool,
        headroom=Headrooms("0"),
        policy=policy,
        timeout=1.0,
        quota_gone_grace=quota_gone_grace,
        clock=clock,
    )
    return World(client, namespaces, quotas, pool, controller)


async def test_a_quota_is_placed_promised_and_recorded() -> None:
    w = world(a=Cluster((4, 4)), b=Cluster((4, 4), promised_to_others=4 * CPU))
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("10"))
    await w.controller.reconcile("team")
    # 5 slices: b has room for 2 beside its other promises; spread, ties to the roomiest.
    assert (w.pool.promised("a"), w.pool.promised("b")) == ([3], [2])
    request = w.pool.clusters["a"].promises[0]
    assert (request.namespace, request.slice.cpu_millis, request.slice.memory_bytes) == (
        "team",
        2 * CPU,
        0,
    )
    assert request.headroom == "0"
    patched = w.patched()
    assert json.loads(str(patched[keys.SLICE_PLACEMENT_ANNOTATION])) == {"a": 3, "b": 2}
    assert applied(patched[keys.SLICE_APPLIED_ANNOTATION]) == Applied(
        Amount(cpu=2 * CPU), {"a": 3, "b": 2}
    )
    assert w.events() == [("SlicesPlaced", "5 slices of cpu 2: a 3, b 2")]
    condition = w.condition()
    assert (condition["status"], condition["reason"]) == ("True", "SlicesPlaced")
    # Run again on its own annotation: nothing more to promise or write.
    w.sync_namespace()
    requests = len(w.client.requests)
    await w.controller.reconcile("team")
    assert (w.pool.promised("a"), w.pool.promised("b")) == ([3], [2])
    assert len(w.client.requests) == requests


async def test_a_quota_lowered_below_what_runs_keeps_the_slices_in_use_and_looks_again() -> None:
    """Pods use 3 slices' worth in a (5 cpu) and 2 in b; the quota goes from 10 cpu to 2:
    no slice they use is given back (another namespace would be promised that room while
    they run on it), and the namespace is looked at again for when they finish."""
    w = world(
        a=Cluster((8,), used=5 * CPU, ledger={"team": (3, 2 * CPU)}),
        b=Cluster((8,), used=3 * CPU, ledger={"team": (2, 2 * CPU)}),
    )
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("2"))
    await w.controller.reconcile("team")
    assert w.pool.clusters["a"].ledger == {"team": (3, 2 * CPU)}
    assert w.pool.clusters["b"].ledger == {"team": (2, 2 * CPU)}
    condition = w.condition()
    assert (condition["status"], condition["reason"]) == ("True", "SlicesKeptForPods")
    assert "the quota asks 1" in condition["message"]
    assert "team" in w.controller.queue._delayed
    # The pods in b finished: its slices go back, a's stay while its pods run.
    w.pool.clusters["b"].used = 0
    w.sync_namespace()
    await w.controller.reconcile("team")
    assert w.pool.clusters["a"].ledger == {"team": (3, 2 * CPU)}
    assert "team" not in w.pool.clusters["b"].ledger


async def test_a_quota_added_over_running_pods_is_placed_where_they_run() -> None:
    """The namespace runs 6 CPU of pods in a when its 8-CPU quota is added. Placed from
    nothing it was a 2, b 1, c 1: a's lower quota below what runs there, 2 CPU of its
    pods' room promised to others, and 4 CPU held in b and c it could hardly use."""
    w = world(a=Cluster((8,), used=6 * CPU), b=Cluster((8,)), c=Cluster((8,)))
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("8"))
    await w.controller.reconcile("team")
    ledgers = {name: c.ledger.get("team") for name, c in w.pool.clusters.items()}
    assert ledgers == {"a": (3, 2 * CPU), "b": (1, 2 * CPU), "c": None}
    assert w.events() == [("SlicesPlaced", "4 slices of cpu 2: a 3, b 1")]
    # A quota smaller than what runs: the slices its pods use are kept, and it says so.
    w2 = world(a=Cluster((8,), used=6 * CPU), b=Cluster((8,)))
    w2.put(w2.namespaces, namespace())
    w2.put(w2.quotas, quota("4"))
    await w2.controller.reconcile("team")
    assert w2.pool.clusters["a"].ledger == {"team": (3, 2 * CPU)}
    assert w2.condition()["reason"] == "SlicesKeptForPods"


async def test_a_cap_added_to_the_quota_rewrites_the_slices_where_they_are() -> None:
    """Packed as 3 + 2 when a was full; a has room for all 5 now. A memory cap added to the
    quota changes what a slice holds, not where: placed afresh, b's slices were taken
    back from under its pods."""
    w = world(
        Policy.PACK,
        a=Cluster((8, 8), ledger={"team": (3, 2 * CPU)}),
        b=Cluster((8,), used=3 * CPU, ledger={"team": (2, 2 * CPU)}),
    )
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("10", hard={"requests.cpu": "10", "requests.memory": "20Gi"}))
    await w.controller.reconcile("team")
    assert (w.pool.promised("a"), w.pool.promised("b")) == ([3], [2])
    assert {request.slice.memory_bytes for request in w.pool.clusters["b"].promises} == {4 * GI}
    assert json.loads(str(w.patched()[keys.SLICE_PLACEMENT_ANNOTATION])) == {"a": 3, "b": 2}


async def test_a_refused_promise_keeps_what_was_made_and_is_retried() -> None:
    # b refuses (another tenant took its room first) and a has no room for more.
    w = world(a=Cluster((4,)), b=Cluster((8,), refuse="b has room for 0 slices"))
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("8"))
    with pytest.raises(PromiseNotMade, match="b: b has room for 0 slices"):
        await w.controller.reconcile("team")
    assert json.loads(str(w.patched()[keys.SLICE_PLACEMENT_ANNOTATION])) == {"a": 2}
    # The other tenant's promise went; the retry places the rest.
    w.sync_namespace()
    w.pool.clusters["b"].refuse = ""
    await w.controller.reconcile("team")
    assert (w.pool.promised("a"), w.pool.promised("b")) == ([2], [2, 2])
    assert json.loads(str(w.patched()[keys.SLICE_PLACEMENT_ANNOTATION])) == {"a": 2, "b": 2}


async def test_a_refused_growth_places_its_slices_where_there_is_room() -> None:
    """a refuses every growth (its room went to another tenant, or its lower namespace is
    another's); b has room for all 4 slices. One refusal held back every other growth,
    and each retry placed the same slices on a again: b was never grown."""
    w = world(a=Cluster((8,), refuse="a has room for 0 slices"), b=Cluster((8,)))
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("8"))
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == [2], "tried once, then placed around"
    assert w.pool.clusters["b"].ledger == {"team": (4, 2 * CPU)}
    assert json.loads(str(w.patched()[keys.SLICE_PLACEMENT_ANNOTATION])) == {"b": 4}
    assert w.events() == [
        (
            "SlicesPlaced",
            "4 slices of cpu 2: b 4; not grown where refused: a: a has room for 0 slices",
        )
    ]


async def test_a_growth_not_answered_is_left_to_the_retry_and_others_still_grow() -> None:
    """a's growth times out (made or not, unknown: placed again only from the ledgers);
    b's is made all the same, no shrink having failed."""
    w = world(a=Cluster((8,), promise_times_out=True), b=Cluster((8,)))
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("8"))
    with pytest.raises(PromiseNotMade, match="a: DEADLINE_EXCEEDED"):
        await w.controller.reconcile("team")
    assert w.pool.clusters["b"].ledger == {"team": (2, 2 * CPU)}
    assert json.loads(str(w.patched()[keys.SLICE_PLACEMENT_ANNOTATION])) == {"b": 2}


async def test_a_namespace_that_lost_the_race_for_the_room_reads_as_not_placed() -> None:
    # Another tenant's promise took the room between this one's look and its promise.
    w = world(a=Cluster((4,), refuse="a has room for 0 slices"))
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("4"))
    with pytest.raises(PromiseNotMade):
        await w.controller.reconcile("team")
    # Nothing was promised: nothing to annotate.
    assert not [r for r in w.client.requests if r.method == "PATCH" and "/status" not in r.path]
    w.pool.clusters["a"].promised_to_others = 4 * CPU
    await w.controller.reconcile("team")
    assert [reason for reason, _ in w.events()] == ["PromisesNotMade", "SlicesNotPlaced"]
    cached = w.namespaces.get("team")
    assert cached is not None and not cached["metadata"].get("annotations")


def two_slices_moving_from_b_to_a() -> World:
    """a holds 1 slice and b 3; the placement written asks for a 3, b 1."""
    w = world(
        a=Cluster((8,), ledger={"team": (1, 2 * CPU)}),
        b=Cluster((8,), ledger={"team": (3, 2 * CPU)}),
    )
    before = Applied(Amount(cpu=2 * CPU), {"a": 1, "b": 3})
    w.put(w.namespaces, recorded(before, '{"a": 3, "b": 1}'))
    w.put(w.quotas, quota("8"))
    return w


async def test_shrinking_promises_are_made_before_growing_ones() -> None:
    # A part-way failure then leaves the namespace promised less, never more.
    w = two_slices_moving_from_b_to_a()
    order: list[str] = []
    real = w.pool.promise_slices

    async def recording(name: str, request: PromiseSlicesRequest, timeout: float) -> Any:
        order.append(f"{name}={request.slices}")
        return await real(name, request, timeout)

    w.pool.promise_slices = recording  # type: ignore[method-assign]
    await w.controller.reconcile("team")
    assert order == ["vk-b=1", "vk-a=3"]


async def test_no_promise_grows_while_a_shrink_is_not_made() -> None:
    """b does not answer its shrink from 3 to 1: growing a to 3 then would have the
    namespace promised 6 slices for a quota that makes 4."""
    w = two_slices_moving_from_b_to_a()
    w.pool.clusters["b"].promise_times_out = True
    with pytest.raises(PromiseNotMade, match="a: not grown while a shrink is not made"):
        await w.controller.reconcile("team")
    assert w.pool.promised("a") == []
    ledgers = {name: c.ledger["team"][0] for name, c in w.pool.clusters.items()}
    assert ledgers == {"a": 1, "b": 3}


async def test_the_ledgers_not_the_annotation_say_what_is_promised() -> None:
    # The record lost (a user removed it), or left behind by a promise whose annotation
    # patch failed: the ledgers are read, and nothing is promised twice.
    w = world(a=Cluster((8,), ledger={"team": (2, 2 * CPU)}), b=Cluster((8,)))
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("4"))
    await w.controller.reconcile("team")
    assert (w.pool.promised("a"), w.pool.promised("b")) == ([], [])
    assert json.loads(str(w.patched()[keys.SLICE_PLACEMENT_ANNOTATION])) == {"a": 2}
    # A cluster that left the pool and came back holding slices: the surplus goes back,
    # from where the most are unused.
    w.pool.clusters["b"].ledger["team"] = (1, 2 * CPU)
    w.sync_namespace()
    await w.controller.reconcile("team")
    assert (w.pool.promised("a"), w.pool.promised("b")) == ([1], [])
    assert json.loads(str(w.patched()[keys.SLICE_PLACEMENT_ANNOTATION])) == {"a": 1, "b": 1}


async def test_no_quota_takes_every_promise_back_and_clears_the_annotations() -> None:
    w = world(
        a=Cluster((8,), ledger={"team": (1, 2 * CPU)}),
        b=Cluster((8,), ledger={"team": (1, 2 * CPU)}),
    )
    before = Applied(Amount(cpu=2 * CPU), {"a": 1, "b": 1})
    w.put(w.namespaces, recorded(before))
    w.put(w.quotas, quota("1", scopes=["BestEffort"]))  # scoped: caps only some pods
    await w.controller.reconcile("team")
    assert (w.pool.promised("a"), w.pool.promised("b")) == ([0], [0])
    assert w.patched() == {
        keys.SLICE_PLACEMENT_ANNOTATION: None,
        keys.SLICE_APPLIED_ANNOTATION: None,
    }


async def test_a_quota_made_again_at_once_keeps_its_slices_one_gone_for_good_loses_them() -> None:
    """`kubectl replace --force` deletes the quota and makes it again: taken back at
    once, the room could be promised to another tenant meanwhile, the pods running."""
    now = [1000.0]
    held = (2, 2 * CPU)
    w = world(quota_gone_grace=30.0, clock=lambda: now[0], a=Cluster((8,), ledger={"team": held}))
    before = Applied(Amount(cpu=2 * CPU), {"a": 2})
    w.put(w.namespaces, recorded(before))
    replaced = quota("4")
    w.put(w.quotas, replaced)
    w.put(w.quotas, replaced, "DELETED")
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == [], "not yet"
    now[0] += 10
    w.put(w.quotas, replaced)
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == [] and w.pool.clusters["a"].ledger["team"] == held
    w.put(w.quotas, replaced, "DELETED")
    await w.controller.reconcile("team")
    now[0] += 29
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == [], "gone 29 s: still held"
    now[0] += 2
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == [0]


async def test_a_deleted_namespace_s_promises_are_taken_back() -> None:
    w = world(a=Cluster((8,), ledger={"team": (2, 2 * CPU)}))
    before = Applied(Amount(cpu=2 * CPU), {"a": 2})
    ns = namespace(**{keys.SLICE_APPLIED_ANNOTATION: before.encode()})
    w.put(w.namespaces, ns)
    w.put(w.namespaces, ns, "DELETED")
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == [0]
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == [0]


async def test_namespaces_deleted_or_unsliced_while_away_are_found_and_taken_back() -> None:
    held = (1, 2 * CPU)
    w = world(
        a=Cluster((8,), ledger={"gone": held, "unsliced": held, "team": held}),
        b=Cluster((8,), ledger={"gone": held}),
    )
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("2"))
    w.put(w.namespaces, namespace("unsliced"))
    await w.drain()  # the informers' adds
    w.sync_namespace()  # placed on a: the cluster whose ledger has it is in its placement
    await w.drain()
    w.pool.clusters["a"].promises.clear()
    await w.controller.sweep()
    assert sorted(await w.drain()) == ["gone", "unsliced"]
    taken_back = {(r.namespace, r.slices) for r in w.pool.clusters["a"].promises}
    assert taken_back == {("gone", 0), ("unsliced", 0)}
    assert w.pool.clusters["a"].ledger == {"team": held}
    assert w.pool.clusters["b"].ledger == {}


async def test_the_slices_of_a_cluster_that_left_the_pool_are_placed_elsewhere() -> None:
    w = world(
        a=Cluster((8,), ledger={"team": (1, 2 * CPU)}),
        b=Cluster((8,), ledger={"team": (1, 2 * CPU)}),
        c=Cluster((8,)),
    )
    w.put(w.namespaces, recorded(Applied(Amount(cpu=2 * CPU), {"a": 1, "b": 1})))
    w.put(w.quotas, quota("4"))
    await w.drain()
    assert w.pool.promised("c") == []
    del w.pool.nodes["vk-a"]  # its virtual node deleted: nothing above changes
    await w.controller.sweep()
    assert await w.drain() == ["team"]
    assert w.pool.promised("c") == [1], "what a held is placed again"
    w.sync_namespace()
    await w.drain()  # the watch's update
    await w.controller.sweep()
    assert await w.drain() == [], "placed around it: not looked at again"


async def test_a_cluster_back_after_the_namespace_was_placed_elsewhere_gives_its_slices_back() -> (
    None
):
    """Its Node was gone while a reconcile placed the namespace on b alone; back, a still
    promises its slice, which nothing else would queue the namespace to take back."""
    w = world(
        a=Cluster((8,), ledger={"team": (1, 2 * CPU)}),
        b=Cluster((8,), ledger={"team": (1, 2 * CPU)}),
    )
    away = w.pool.nodes.pop("vk-a")
    w.put(w.namespaces, recorded(Applied(Amount(cpu=2 * CPU), {"b": 1})))
    w.put(w.quotas, quota("2"))
    await w.drain()  # the informers' adds, a's Node gone
    assert w.pool.clusters["a"].ledger == {"team": (1, 2 * CPU)}
    w.pool.nodes["vk-a"] = away
    await w.controller.sweep()
    assert await w.drain() == ["team"]
    assert w.pool.clusters["a"].ledger == {}
    assert w.pool.clusters["b"].ledger == {"team": (1, 2 * CPU)}


async def test_a_slice_size_change_is_refused_while_pods_run_and_reslices_otherwise() -> None:
    w = world(
        a=Cluster((8,), ledger={"team": (1, 2 * CPU)}),
        b=Cluster((8,), ledger={"team": (1, 2 * CPU)}),
    )
    before = Applied(Amount(cpu=2 * CPU), {"a": 1, "b": 1})
    w.put(w.namespaces, recorded(before, **{keys.SLICE_SIZE_ANNOTATION: '{"cpu": "1"}'}))
    w.put(w.quotas, quota("4"))
    w.client.answer(
        "GET", PODS.path("team"), {"items": [{"metadata": {"name": "p"}}]}, {"items": []}
    )
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == [] and w.pool.promised("b") == []
    [(reason, message)] = w.events()
    assert reason == "SliceSizeChangeRefused" and "cpu 2 cannot become cpu 1" in message
    assert "team" in w.controller.queue._delayed, "looked at again: its pods' end is not told"
    # No pods: re-sliced into 4 slices of 1 CPU, every old promise rewritten.
    await w.controller.reconcile("team")
    assert (w.pool.promised("a"), w.pool.promised("b")) == ([2], [2])
    assert {r.slice.cpu_millis for c in "ab" for r in w.pool.clusters[c].promises} == {CPU}


async def test_a_reslice_into_fewer_larger_slices_is_not_grown_once_a_shrink_failed() -> None:
    """5 + 5 slices of 1 CPU become 3 + 2 of 2 CPU: a's 3 are fewer slices but more CPU
    (6 against 5). b's shrink not made, a's growth would promise 11 CPU for a quota of
    10: it waits for the retry."""
    w = world(
        a=Cluster((8,), ledger={"team": (5, CPU)}),
        b=Cluster((8,), ledger={"team": (5, CPU)}, refuse="b is busy"),
    )
    before = Applied(Amount(cpu=CPU), {"a": 5, "b": 5})
    w.put(w.namespaces, recorded(before, **{keys.SLICE_SIZE_ANNOTATION: '{"cpu": "2"}'}))
    w.put(w.quotas, quota("10"))
    w.client.answer("GET", PODS.path("team"), {"items": []}, {"items": []})
    with pytest.raises(PromiseNotMade, match="a: not grown while a shrink is not made"):
        await w.controller.reconcile("team")
    assert w.pool.clusters["a"].ledger == {"team": (5, CPU)}
    w.pool.clusters["b"].refuse = ""
    await w.controller.reconcile("team")
    assert w.pool.clusters["a"].ledger == {"team": (3, 2 * CPU)}
    assert w.pool.clusters["b"].ledger == {"team": (2, 2 * CPU)}


async def test_an_unreadable_entry_of_the_namespace_is_written_again() -> None:
    """a's entry for the namespace cannot be read: told as holding nothing, it is taken
    back where the placement has no slices, written with them where it has."""
    w = world(
        a=Cluster((8,), unreadable={"team"}),
        b=Cluster((8,), ledger={"team": (2, 2 * CPU)}),
        c=Cluster((8,), unreadable={"team"}, promised_to_others=8 * CPU),
    )
    w.put(w.namespaces, recorded(Applied(Amount(cpu=2 * CPU), {"b": 2})))
    w.put(w.quotas, quota("4"))
    await w.controller.reconcile("team")
    assert (w.pool.promised("a"), w.pool.promised("b"), w.pool.promised("c")) == ([0], [], [0])
    assert w.pool.clusters["a"].unreadable == w.pool.clusters["c"].unreadable == set()
    # Raised: a takes new slices over its entry, written as a promise.
    w.pool.clusters["a"].unreadable.add("team")
    w.put(w.quotas, quota("4"), "DELETED")
    w.put(w.quotas, quota("8"))
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == [0, 2]
    assert w.pool.clusters["a"].ledger == {"team": (2, 2 * CPU)}


async def test_a_silent_estimator_keeps_its_slices_and_takes_no_new_ones() -> None:
    w = world(a=Cluster((8,), ledger={"team": (1, 2 * CPU)}), b=Cluster((8,), down=True))
    before = Applied(Amount(cpu=2 * CPU), {"a": 1, "b": 1})
    w.put(w.namespaces, recorded(before))
    w.put(w.quotas, quota("8"))
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == [3]
    assert json.loads(str(w.patched()[keys.SLICE_PLACEMENT_ANNOTATION])) == {"a": 3, "b": 1}


async def test_a_shortfall_says_why_the_clusters_that_did_not_answer_were_silent() -> None:
    """Every estimator refused the namespace (its lower name too long, say): the reason
    is theirs, not only "no lower clusters"."""
    w = world(a=Cluster((8,), down=True))
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("4"))
    await w.controller.reconcile("team")
    [(reason, message)] = w.events()
    assert reason == "SlicesNotPlaced"
    assert message.endswith("no lower clusters; a did not answer: UNAVAILABLE")


async def test_a_shortfall_is_told_once_and_retried_later() -> None:
    w = world(a=Cluster((4,)))
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("8"))
    await w.controller.reconcile("team")
    await w.controller.reconcile("team")
    assert w.pool.promised("a") == []
    [(reason, message)] = w.events()
    assert reason == "SlicesNotPlaced"
    assert message.startswith("4 slices of cpu 2 wanted, room for 2: 2 missing (cpu 4)")
    condition = w.condition()
    assert (condition["status"], condition["reason"], condition["message"]) == (
        "False",
        "SlicesNotPlaced",
        message,
    )


@pytest.mark.parametrize(
    ("size", "hard", "complaint"),
    [
        ('{"cpu": "0"}', "8", "the slice size's cpu must be above 0"),
        # A typo of "1" for "1m" on a quota of 20 cpu: placed one at a time on the
        # scheduler's loop, 20,000 slices would block it.
        (
            '{"cpu": "1m"}',
            "20",
            "slices of cpu 1m make 20000 of the namespace's quota, more than 10,000: "
            "set a larger slice size",
        ),
    ],
)
async def test_a_bad_slice_size_is_told(size: str, hard: str, complaint: str) -> None:
    w = world(a=Cluster((4,)))
    w.put(w.namespaces, namespace(**{keys.SLICE_SIZE_ANNOTATION: size}))
    w.put(w.quotas, quota(hard))
    await w.controller.reconcile("team")
    assert w.events() == [("InvalidSliceSize", complaint)]


def test_the_promises_to_make_and_the_slices_that_stay() -> None:
    size, old_size = Amount(cpu=2 * CPU), Amount(cpu=CPU)
    promised = {"a": (2, size), "b": (3, size), "c": (4, old_size), "q": (1, size)}
    # a unchanged; b shrinks; c re-sliced in place; d new; q does not answer.
    target = {"a": 2, "b": 1, "c": 4, "d": 1, "q": 3}
    assert promise_changes(target, promised, size, {"q"}) == {"b": 1, "c": 4, "d": 1}
    assert promise_changes({}, promised, size, ()) == {"a": 0, "b": 0, "c": 0, "q": 0}
    assert kept(promised, size) == {"a": 2, "b": 3, "q": 1}
    # A cap added (memory) changes what a slice holds, not where: the slices stay.
    capped = Amount(2 * CPU, 4 * GI)
    assert kept(promised, capped) == {"a": 2, "b": 3, "q": 1}
    assert promise_changes({"a": 2}, {"a": (2, size)}, capped, ()) == {"a": 2}


def test_headroom_flags() -> None:
    assert headrooms([]) == Headrooms("10%", {})
    assert headrooms(["0", "lower-1:cpu=2,memory=4Gi", "lower-2:5%"]) == Headrooms(
        "0", {"lower-1": "cpu=2,memory=4Gi", "lower-2": "5%"}
    )
    assert headrooms(["lower-1:5%"]).of("lower-1") == "5%"
    assert headrooms(["lower-1:5%"]).of("lower-9") == "10%"
    with pytest.raises(SliceError):
        headrooms(["lower-1:lots"])


def changed_conditions(namespace: dict[str, Any], *args: Any) -> list[dict[str, Any]]:
    patch = condition_patch(namespace, *args)
    assert patch is not None
    conditions: list[dict[str, Any]] = patch["status"]["conditions"]
    return conditions


def test_the_condition_changes_only_when_its_news_does() -> None:
    fresh = namespace()
    placed = condition_patch(fresh, True, "SlicesPlaced", "2 slices", "t1")
    assert placed == {
        "status": {
            "conditions": [
                {
                    "type": keys.SLICES_PLACED_CONDITION,
                    "status": "True",
                    "reason": "SlicesPlaced",
                    "message": "2 slices",
                    "lastTransitionTime": "t1",
                }
            ]
        }
    }
    assert placed is not None
    holding = {**fresh, "status": placed["status"]}
    assert condition_patch(holding, True, "SlicesPlaced", "2 slices", "t2") is None
    # Same status, new message: the transition time stays; another status: it moves.
    [grown] = changed_conditions(holding, True, "SlicesPlaced", "3 slices", "t2")
    assert grown["lastTransitionTime"] == "t1"
    [short] = changed_conditions(holding, False, "SlicesNotPlaced", "x", "t3")
    assert (short["status"], short["lastTransitionTime"]) == ("False", "t3")
    assert condition_patch(holding, None, "", "", "t4") == {
        "status": {"conditions": [{"type": keys.SLICES_PLACED_CONDITION, "$patch": "delete"}]}
    }
    assert condition_patch(fresh, None, "", "", "t4") is None


async def test_where_a_namespace_s_pods_may_go() -> None:
    w = world(a=Cluster((8,)))
    w.put(w.namespaces, namespace("free"))
    assert w.controller.placement_of("free") is None
    w.put(w.namespaces, namespace())
    w.put(w.quotas, quota("4"))
    assert w.controller.placement_of("team") == {}, "sliced, not placed yet: nowhere"
    await w.controller.reconcile("team")
    w.sync_namespace()
    assert w.controller.placement_of("team") == {"a": 2}


async def test_a_namespace_not_federated_is_not_sliced_and_its_slices_are_taken_back() -> None:
    w = world(a=Cluster((8,), ledger={"team": (1, 2 * CPU)}), b=Cluster((8,)))
    unfederated = recorded(Applied(Amount(cpu=2 * CPU), {"a": 1}))
    del unfederated["metadata"]["labels"]
    w.put(w.namespaces, unfederated)
    w.put(w.quotas, quota("4"))
    w.put(w.quotas, quota("4", namespace="monitoring"))
    w.put(w.namespaces, {"metadata": {"name": "monitoring", "uid": "uid-monitoring"}})
    await w.drain()
    assert w.pool.clusters["a"].ledger == {} and w.pool.clusters["b"].ledger == {}
    assert w.controller.placement_of("team") is None
    assert w.controller.placement_of("monitoring") is None


async def test_the_placement_is_written_on_the_namespace_as_read() -> None:
    """A placement a user wrote while the promises were made is refused 409 (and read
    by the retry), not overwritten unseen."""
    w = world(a=Cluster((8,)))
    read = namespace()
    read["metadata"]["resourceVersion"] = "41"
    w.put(w.namespaces, read)
    w.put(w.quotas, quota("2"))
    await w.controller.reconcile("team")
    [patch] = [r for r in w.client.requests if r.method == "PATCH" and "/status" not in r.path]
    assert patch.body["metadata"]["resourceVersion"] == "41"
