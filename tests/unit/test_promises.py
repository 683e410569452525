"""The virtual node's side of quota slices: the lower cluster's ledger, shared by tenants."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import pytest

from kubekit import keys
from kubekit.client import CONFIGMAPS, NODES, PODS, ApiError
from kubekit.informer import Informer
from kubekit.slices import Amount, LedgerEntry, ledger_entry
from virtual_node.naming import NamespaceMapping
from virtual_node.promises import PromiseRefused, SliceBudgets, SlicePromises
from virtual_node.translate import Ownership

from .fakeapi import FakeClient, Request, not_found

GI = 2**30
SLICE = Amount(cpu=2000, memory=4 * GI)
LEDGER_PATH = CONFIGMAPS.path(keys.SYSTEM_NAMESPACE, keys.SLICE_LEDGER_CONFIGMAP)


class LowerApi(FakeClient):
    """The ledger ConfigMap kept as an apiserver keeps it: a write carrying an old
    resourceVersion is refused with 409. Every request yields, so concurrent promises
    interleave between their read and their write."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger: dict[str, Any] | None = None
        self.quotas: dict[str, dict[str, Any]] = {}
        self.conflicts = 0
        self.refuse_quota_deletes = 0

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 60.0,
        retry_when_told: bool = True,
    ) -> dict[str, Any]:
        await asyncio.sleep(0)
        self.requests.append(Request(method, path, body))
        if path.startswith(CONFIGMAPS.path(keys.SYSTEM_NAMESPACE)):
            return self._ledger(method, body)
        if "/resourcequotas" in path:
            namespace = path.split("/namespaces/")[1].split("/")[0]
            return self._quota(method, namespace, body)
        return await super().request(method, path, query=query, body=body)

    def _ledger(self, method: str, body: Any) -> dict[str, Any]:
        if method == "GET":
            if self.ledger is None:
                raise not_found("configmaps", keys.SLICE_LEDGER_CONFIGMAP)
            copied: dict[str, Any] = json.loads(json.dumps(self.ledger))
            return copied
        stored = None if self.ledger is None else self.ledger["metadata"]["resourceVersion"]
        sent = body["metadata"].get("resourceVersion")
        if (method == "POST" and self.ledger is not None) or (method == "PUT" and sent != stored):
            self.conflicts += 1
            raise ApiError(409, {"reason": "Conflict", "message": "the object has been modified"})
        version = str(int(stored or 0) + 1)
        self.ledger = {**body, "metadata": {**body["metadata"], "resourceVersion": version}}
        return self.ledger

    def _quota(self, method: str, namespace: str, body: Any) -> dict[str, Any]:
        if method == "GET":
            if namespace not in self.quotas:
                raise not_found("resourcequotas", keys.SLICE_QUOTA)
            return self.quotas[namespace]
        if method == "DELETE":
            if self.refuse_quota_deletes:
                self.refuse_quota_deletes -= 1
                raise ApiError(503, {"reason": "ServiceUnavailable", "message": "etcd is slow"})
            if self.quotas.pop(namespace, None) is None:
                raise not_found("resourcequotas", keys.SLICE_QUOTA)
            return {}
        metadata = {**body["metadata"], "resourceVersion": "1", "uid": f"uid-{namespace}"}
        self.quotas[namespace] = {**body, "metadata": metadata}
        return self.quotas[namespace]

    def promised(self) -> dict[str, LedgerEntry]:
        data = (self.ledger or {}).get("data") or {}
        return {key: ledger_entry(key, text) for key, text in data.items()}


def node(name: str, cpu: str, memory: str = "64Gi", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": spec,
        "status": {
            "allocatable": {"cpu": cpu, "memory": memory, "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def lower_pod(namespace: str, name: str, cpu: str, phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
        "status": {"phase": phase},
    }


def informer(resource: Any, *objects: dict[str, Any]) -> Informer:
    cache = Informer(client=None, resource=resource)  # type: ignore[arg-type]
    for obj in objects:
        cache.apply({"type": "ADDED", "object": obj})
    return cache


def tenant(
    api: LowerApi, origin: str, nodes: Informer, pods: Informer | None = None
) -> tuple[SlicePromises, list[str]]:
    made: list[str] = []

    async def ensure_namespace(namespace: str) -> None:
        made.append(namespace)

    promises = SlicePromises(
        api,
        nodes,
        pods or informer(PODS),
        NamespaceMapping("prefix", origin),
        Ownership(origin, f"vk-{origin}", "lower-1"),
        ensure_namespace,
    )
    return promises, made


def mapped_like_t1(api: LowerApi, nodes: Informer, owner: Ownership) -> SlicePromises:
    """A virtual node of ``owner`` whose namespace "team" is t1-team below."""
    return SlicePromises(
        api,
        nodes,
        informer(PODS),
        NamespaceMapping("prefix", "t1"),
        owner,
        tenant(api, owner.origin, nodes)[0].ensure_namespace,
    )


def same_lower_namespace_other_origin(api: LowerApi, nodes: Informer) -> SlicePromises:
    """A second tenant whose namespace "team" is t1-team below too (both without a
    prefix, say)."""
    return mapped_like_t1(api, nodes, Ownership("t2", "vk-t2", "lower-1"))


async def test_a_promise_is_recorded_and_the_lower_namespace_held_to_it() -> None:
    api = LowerApi()
    nodes = informer(NODES, node("n1", "8"), node("n2", "8"))
    promises, made = tenant(api, "t1", nodes)
    await promises.promise("team", 3, SLICE, "0")
    assert made == ["t1-team"]
    entry = api.promised()["t1-team"]
    assert (entry.namespace, entry.origin, entry.slices, entry.size) == ("team", "t1", 3, SLICE)
    quota = api.quotas["t1-team"]
    assert quota["spec"]["hard"] == {"requests.cpu": "6", "requests.memory": "12Gi"}
    assert quota["metadata"]["labels"][keys.ORIGIN_LABEL] == "t1"
    # Taken back: the entry and the quota go.
    await promises.promise("team", 0, SLICE, "0")
    assert api.promised() == {}
    assert api.quotas == {}
    writes = len(api.writes())
    await promises.promise("team", 0, SLICE, "0")  # nothing left to take back: no error
    assert [w for w in api.writes()[writes:] if "configmaps" in w[1]] == [], "no write"


async def test_a_look_makes_a_promised_namespace_gone_below_again_with_its_quota() -> None:
    """The lower namespace went with its upper one while the multischeduler was away and
    the upper one was made again: the ledger entry outlived it, and the next look at the
    namespace makes it and its quota again."""
    api = LowerApi()
    promises, made = tenant(api, "t1", informer(NODES, node("n1", "8")))
    await promises.promise("team", 2, SLICE, "0")
    made.clear()
    api.quotas.clear()
    room = await promises.room("team")
    assert room.held == 2 and made == ["t1-team"]
    assert api.quotas["t1-team"]["spec"]["hard"] == {"requests.cpu": "4", "requests.memory": "8Gi"}


async def test_growth_past_the_room_is_refused_and_shrinking_always_allowed() -> None:
    api = LowerApi()
    nodes = informer(
        NODES, node("n1", "8"), node("n2", "8"), node("cordoned", "8", unschedulable=True)
    )
    promises, _ = tenant(api, "t1", nodes)
    # 16 CPUs less 10%: 14.4, room for 7 slices of 2.
    with pytest.raises(PromiseRefused, match="room for 7 slices of cpu 2, memory 4Gi, not 8"):
        await promises.promise("team", 8, SLICE, "10%")
    await promises.promise("team", 7, SLICE, "10%")
    # The cluster shrinks: a promise made stays, and lowering it is never refused.
    nodes.apply({"type": "DELETED", "object": node("n2", "8")})
    await promises.promise("team", 6, SLICE, "10%")
    assert api.promised()["t1-team"].slices == 6


async def test_room_counts_other_tenants_promises_and_the_namespace_s_own_use() -> None:
    api = LowerApi()
    nodes = informer(NODES, node("n1", "8"), node("small", "1"))
    pods = informer(
        PODS,
        lower_pod("t1-team", "a", "1500m"),
        lower_pod("t1-team", "done", "4", phase="Succeeded"),
        lower_pod("other", "b", "3"),
    )
    first, _ = tenant(api, "t1", nodes, pods)
    second, _ = tenant(api, "t2", nodes)
    await second.promise("team", 2, SLICE, "0")
    await first.promise("team", 1, SLICE, "0")
    room = await first.room("team")
    assert room.nodes == (Amount(1000, 64 * GI), Amount(8000, 64 * GI))
    assert room.promised_to_others == SLICE.times(2)
    assert (room.held, room.used) == (1, Amount(cpu=1500))


async def test_room_tells_as_used_what_the_estimator_counts_where_that_is_more() -> None:
    """A pod bound here, its lower copy not made yet: told only the lower pods' 1500m,
    the multischeduler could take back the slice that pod waits to run in."""
    api = LowerApi()
    pods = informer(PODS, lower_pod("t1-team", "a", "1500m"))
    counted = {"t1-team": Amount(cpu=3000), "t1-small": Amount(cpu=500, memory=GI)}
    promises = SlicePromises(
        api,
        informer(NODES, node("n1", "8")),
        pods,
        NamespaceMapping("prefix", "t1"),
        Ownership("t1", "vk-t1", "lower-1"),
        tenant(api, "t1", informer(NODES))[0].ensure_namespace,
        counted=lambda namespace: counted.get(namespace, Amount()),
    )
    assert (await promises.room("team")).used == Amount(cpu=3000)
    # The larger of the two in each resource.
    pods.apply({"type": "ADDED", "object": lower_pod("t1-small", "b", "1")})
    assert (await promises.room("small")).used == Amount(cpu=1000, memory=GI)
    assert (await promises.room("none")).used == Amount()


def test_the_budgets_tell_what_is_counted_against_a_namespace() -> None:
    budgets = SliceBudgets("origin-a")
    budgets.ledger_changed({"data": {"ns": LedgerEntry("ns", "origin-a", 2, SLICE).encode()}})
    budgets.count("a", "ns", Amount(cpu=100))
    budgets.count("b", "ns", Amount(cpu=200, memory=GI))
    budgets.count("elsewhere", "unsliced", Amount(cpu=100))
    assert budgets.counted("ns") == Amount(cpu=300, memory=GI)
    assert budgets.counted("unsliced") == Amount()


async def test_two_tenants_promising_at_once_never_share_the_room() -> None:
    api = LowerApi()
    nodes = informer(NODES, node("n1", "8"), node("n2", "8"))
    tenants = [tenant(api, f"t{index}", nodes)[0] for index in range(4)]
    # Room for 8 slices; four tenants ask for 3 each at the same moment.
    outcomes = await asyncio.gather(
        *(promises.promise("team", 3, SLICE, "0") for promises in tenants),
        return_exceptions=True,
    )
    refused = [outcome for outcome in outcomes if isinstance(outcome, PromiseRefused)]
    assert len(refused) == 2 and api.conflicts > 0
    assert all(outcome is None or isinstance(outcome, PromiseRefused) for outcome in outcomes)
    total = sum((entry.promised for entry in api.promised().values()), Amount())
    assert total == SLICE.times(6) and total.within(Amount(16000, 128 * GI))


async def test_a_namespace_of_another_upper_cluster_is_not_ours_to_change() -> None:
    api = LowerApi()
    nodes = informer(NODES, node("n1", "8"))
    promises, _ = tenant(api, "t1", nodes)
    await promises.promise("team", 1, SLICE, "0")
    intruder = same_lower_namespace_other_origin(api, nodes)
    with pytest.raises(PromiseRefused, match="holds slices of another upper cluster"):
        await intruder.promise("team", 0, SLICE, "0")
    assert api.promised()["t1-team"].slices == 1


async def test_a_namespace_of_another_upper_cluster_is_offered_no_room() -> None:
    """Two tenants' namespaces share a lower name: every promise to the second is refused
    there, so the room offered it is none. Offered the free room, its multischeduler
    chose this cluster, was refused, and chose it again at every retry."""
    api = LowerApi()
    nodes = informer(NODES, node("n1", "8"))
    promises, _ = tenant(api, "t1", nodes)
    await promises.promise("team", 1, SLICE, "0")
    intruder = same_lower_namespace_other_origin(api, nodes)
    room = await intruder.room("team")
    assert (room.held, room.promised_to_others) == (0, Amount(cpu=8000, memory=64 * GI))
    # Its owner is told its own slices and the room beside them, as before.
    own = await promises.room("team")
    assert (own.held, own.promised_to_others) == (1, Amount())


async def test_an_unreadable_ledger_entry_refuses_growth_rather_than_count_it_as_nothing() -> None:
    api = LowerApi()
    nodes = informer(NODES, node("n1", "8"))
    promises, _ = tenant(api, "t1", nodes)
    await promises.promise("team", 1, SLICE, "0")
    assert api.ledger is not None
    api.ledger["data"]["someone-else"] = "{not json"
    with pytest.raises(PromiseRefused, match="someone-else cannot be read"):
        await promises.promise("other", 1, SLICE, "0")
    # The room is still told, for every namespace, all of it counted as promised: no
    # growth, but a namespace's own slices can be seen and given back.
    room = await promises.room("team")
    assert (room.held, room.promised_to_others) == (1, Amount(cpu=8000, memory=64 * GI))
    await promises.promise("team", 0, SLICE, "0")
    assert "t1-team" not in api.ledger["data"]
    # Its own entry unreadable: giving it back is still allowed.
    api.ledger["data"]["t1-mine"] = "{not json"
    await promises.promise("mine", 0, SLICE, "0")
    assert "t1-mine" not in api.ledger["data"]


async def test_the_namespace_s_own_unreadable_entry_is_told_as_nothing_and_written_again() -> None:
    """Its entry hand-edited ("cpu": "2000m"): the look raised, the estimator answered
    FAILED_PRECONDITION, the multischeduler counted the cluster silent and never took
    the entry back, and every other namespace saw the cluster's room as promised."""
    api = LowerApi()
    promises, _ = tenant(api, "t1", informer(NODES, node("n1", "8")))
    await promises.promise("other", 1, SLICE, "0")
    assert api.ledger is not None
    api.ledger["data"]["t1-team"] = (
        '{"namespace":"team","origin":"t1","slices":1,"size":{"cpu":"2000m","memory":0}}'
    )
    room = await promises.room("team")
    assert (room.held, room.held_unreadable, room.promised_to_others) == (0, True, SLICE)
    # Written again as the promise wanted, held to the room like any growth.
    with pytest.raises(PromiseRefused, match="room for 3 slices"):
        await promises.promise("team", 4, SLICE, "0")
    await promises.promise("team", 2, SLICE, "0")
    assert api.promised()["t1-team"].slices == 2
    assert api.quotas["t1-team"]["spec"]["hard"]["requests.cpu"] == "4"
    room = await promises.room("team")
    assert (room.held, room.held_unreadable) == (2, False)


async def test_another_tenants_unreadable_entry_is_neither_offered_nor_written_over() -> None:
    """Two tenants whose namespaces meet below, the other's entry hand-edited: taken for
    this tenant's own, it was written over or taken back, its quota with it, while the
    other tenant's pods ran on that room."""
    api = LowerApi()
    promises, _ = tenant(api, "t1", informer(NODES, node("n1", "8")))
    await promises.promise("other", 1, SLICE, "0")
    assert api.ledger is not None
    theirs = '{"namespace":"team","origin":"t2","slices":1,"size":{"cpu":"2000m","memory":0}}'
    api.ledger["data"]["t1-team"] = theirs
    room = await promises.room("team")
    assert (room.held, room.held_unreadable) == (0, False)
    assert room.promised_to_others == sum(room.nodes, Amount()), "no room offered"
    for slices in (0, 2):
        with pytest.raises(PromiseRefused, match=r"another upper cluster \(t2\)"):
            await promises.promise("team", slices, SLICE, "0")
    assert api.ledger["data"]["t1-team"] == theirs


async def test_a_quota_left_behind_its_ledger_entry_is_brought_in_step_by_the_next_look() -> None:
    """The ledger is written first; the quota's write may fail after it (a 409 from the
    quota's own status updates, a crash). The multischeduler reads the ledger and
    promises nothing more: the next look at the room writes the quota."""
    api = LowerApi()
    promises, _ = tenant(api, "t1", informer(NODES, node("n1", "16")))
    await promises.promise("team", 3, SLICE, "0")
    api.quotas["t1-team"]["spec"]["hard"] = {"requests.cpu": "2", "requests.memory": "4Gi"}
    room = await promises.room("team")
    assert room.held == 3
    assert api.quotas["t1-team"]["spec"]["hard"] == {"requests.cpu": "6", "requests.memory": "12Gi"}
    del api.quotas["t1-team"]
    await promises.room("team")
    assert "t1-team" in api.quotas


def test_a_pod_counting_nothing_is_uncounted_after_the_others() -> None:
    """A pod requesting 0 counted last in a namespace: uncounting it raised KeyError (its
    namespace's entry went when the use came back to 0), and the estimator kept the room
    of the pod it was dropping held for good."""
    budgets = SliceBudgets("origin-a")
    entry = LedgerEntry("ns", "origin-a", 2, SLICE)
    budgets.ledger_changed({"data": {"ns": entry.encode()}})
    budgets.count("a", "ns", Amount(cpu=100))
    budgets.count("zero", "ns", Amount())
    budgets.uncount("a")
    budgets.uncount("zero")
    assert budgets.room_for("ns", "new", SLICE.times(2)) == (1, "")


async def test_a_take_back_whose_quota_delete_fails_keeps_its_entry_to_be_tried_again() -> None:
    api = LowerApi()
    promises, _ = tenant(api, "t1", informer(NODES, node("n1", "8")))
    await promises.promise("team", 2, SLICE, "0")
    api.refuse_quota_deletes = 1
    with pytest.raises(ApiError):
        await promises.promise("team", 0, SLICE, "0")
    assert "t1-team" in api.quotas
    assert (await promises.room("team")).held == 2, "still held: the take-back is retried"
    await promises.promise("team", 0, SLICE, "0")
    assert api.promised() == {} and api.quotas == {}


async def test_a_take_back_deletes_a_quota_made_under_the_node_s_earlier_name() -> None:
    api = LowerApi()
    nodes = informer(NODES, node("n1", "8"))
    await tenant(api, "t1", nodes)[0].promise("team", 2, SLICE, "0")
    renamed = mapped_like_t1(api, nodes, Ownership("t1", "vk-renamed", "lower-1"))
    await renamed.promise("team", 0, SLICE, "0")
    assert api.quotas == {}


async def test_a_take_back_leaves_another_tenant_s_quota_alone() -> None:
    api = LowerApi()
    nodes = informer(NODES, node("n1", "8"))
    await tenant(api, "t1", nodes)[0].promise("team", 2, SLICE, "0")
    other = same_lower_namespace_other_origin(api, nodes)
    with pytest.raises(PromiseRefused):
        await other.promise("team", 0, SLICE, "0")
    assert "t1-team" in api.quotas and "t1-team" in api.promised()
