"""The estimator's bookkeeping: lower nodes and pods from the watch, upper pods bound to
the virtual node in flight until their lower copy is on a node, the extender's
reservations until bound, released or lapsed. Fed through real informers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import grpc
import orjson
import pytest

from harness.localcluster import free_port
from kubekit import keys, pki
from kubekit.client import (
    NODES,
    PERSISTENTVOLUMECLAIMS,
    PODS,
    RESOURCEQUOTAS,
    RUNTIMECLASSES,
    STORAGECLASSES,
)
from kubekit.clusterstate import ClusterState
from kubekit.estimatorapi import RESERVATION_SECONDS
from kubekit.estimatorapi.estimator_pb2 import (
    DefragmentRequest,
    EstimateRequest,
    FitInTurnRequest,
    HoldRequest,
    PodQuery,
    PromiseSlicesRequest,
    ReleaseRequest,
    Resources,
    SliceRoomRequest,
)
from kubekit.informer import Informer
from kubekit.slices import Amount, LedgerEntry
from virtual_node.estimator import (
    MAX_REPLICAS,
    EstimatorService,
    FitEstimator,
    QueryError,
    serve,
    to_message,
)
from virtual_node.kubeletapi.auth import AuthError, Authorizer, User
from virtual_node.naming import NamespaceMapping
from virtual_node.promises import SlicePromises, SliceRoom
from virtual_node.translate import Ownership, desired_lower_pod, pinned_to

OWNER = Ownership(origin="upper-uid", node_name="vk-lower-1", cluster_id="lower-1")


def node(name: str, cpu: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {},
        "status": {
            "allocatable": {"cpu": cpu, "memory": "64Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def upper_pod(name: str, cpu: str, uid: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": uid or f"uid-{name}"},
        "spec": {
            "nodeName": "vk-lower-1",
            "containers": [{"name": "app", "resources": {"requests": {"cpu": cpu}}}],
        },
        "status": {"phase": "Pending"},
    }


def lower_copy(upper: dict[str, Any], node_name: str | None) -> dict[str, Any]:
    lower = desired_lower_pod(upper, NamespaceMapping(), OWNER)
    if node_name:
        lower["spec"]["nodeName"] = node_name
    lower["status"] = {"phase": "Running" if node_name else "Pending"}
    return lower


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Cluster:
    """A lower cluster of two nodes, 4 and 2 cpu, with the estimator's informers."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.estimator = FitEstimator(ClusterState(), NamespaceMapping(), OWNER, self.clock)
        self.lower_nodes = Informer(client=None, resource=NODES)  # type: ignore[arg-type]
        self.lower_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
        self.upper_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
        self.estimator.watch(self.lower_nodes, self.lower_pods, self.upper_pods)
        for name, cpu in (("big", "4"), ("small", "2")):
            self.lower_nodes.apply({"type": "ADDED", "object": node(name, cpu)})

    def listed(self, upper: dict[str, Any], lower: dict[str, Any], upper_first: bool) -> None:
        """The pod and its lower copy listed in either order, as after a restart."""
        caches = [(self.upper_pods, upper), (self.lower_pods, lower)]
        for cache, pod in caches if upper_first else caches[::-1]:
            cache.apply({"type": "ADDED", "object": pod})

    def fits(self, cpu: str, replicas: int = 1) -> int:
        pod = upper_pod("query", cpu)
        return self.estimator.answer(orjson.dumps(pod), replicas).estimate.max_replicas


def test_replicas_past_the_limit_are_refused_not_placed_one_by_one() -> None:
    """Each replica is judged over every node under the lock the watches wait for: 2^31
    of them held the estimator and the virtual node's watches for minutes."""
    cluster = Cluster()
    assert cluster.fits("1m", replicas=MAX_REPLICAS) == 220, "110 pods a node"
    with pytest.raises(QueryError, match="at most 1000"):
        cluster.fits("1m", replicas=2**31 - 1)


def test_answers_count_real_lower_pods_per_node() -> None:
    cluster = Cluster()
    assert cluster.fits("4") == 1
    assert cluster.fits("1", replicas=10) == 6
    foreign = {
        "metadata": {"name": "foreign", "namespace": "default"},
        "spec": {
            "nodeName": "big",
            "containers": [{"name": "c", "resources": {"requests": {"cpu": "3"}}}],
        },
        "status": {"phase": "Running"},
    }
    cluster.lower_pods.apply({"type": "ADDED", "object": foreign})
    assert cluster.fits("3") == 0, "1 + 2 cpu free on two nodes: 3 fit no node"
    assert cluster.fits("2") == 1
    cluster.lower_pods.apply({"type": "DELETED", "object": foreign})
    assert cluster.fits("3") == 1


def test_a_lower_pod_s_resize_counts_as_its_status_says() -> None:
    """A resize up the kubelet finds infeasible holds only what the pod has: its status
    alone changes, and is read again (until 2026-11-29 the spec's 16 cpu filled the node)."""
    cluster = Cluster()
    growing = {
        "metadata": {"name": "growing", "namespace": "default", "uid": "g"},
        "spec": {
            "nodeName": "big",
            "containers": [{"name": "c", "resources": {"requests": {"cpu": "16"}}}],
        },
        "status": {"phase": "Running"},
    }
    cluster.lower_pods.apply({"type": "ADDED", "object": growing})
    assert cluster.fits("3") == 0
    infeasible = {
        "phase": "Running",
        "conditions": [{"type": "PodResizePending", "status": "True", "reason": "Infeasible"}],
        "containerStatuses": [
            {
                "name": "c",
                "allocatedResources": {"cpu": "1"},
                "resources": {"requests": {"cpu": "1"}},
            }
        ],
    }
    cluster.lower_pods.apply({"type": "MODIFIED", "object": {**growing, "status": infeasible}})
    assert cluster.fits("3") == 1, "3 of big's 4 cpu free"


def test_a_pod_bound_here_holds_its_room_until_its_lower_copy_is_on_a_node() -> None:
    cluster = Cluster()
    pod = upper_pod("web", "3")
    cluster.upper_pods.apply({"type": "ADDED", "object": pod})
    assert cluster.fits("3") == 0, "the in-flight pod is assumed on the 4-cpu node"
    # Mirrored below but not yet scheduled there: still in flight, counted once.
    cluster.lower_pods.apply({"type": "ADDED", "object": lower_copy(pod, None)})
    assert cluster.fits("3") == 0
    assert cluster.fits("1") == 1
    # Bound below: the real pod counts, not the assumption as well.
    cluster.lower_pods.apply({"type": "MODIFIED", "object": lower_copy(pod, "big")})
    assert cluster.fits("1", replicas=10) == 3
    # Gone above and below: the room is back.
    cluster.upper_pods.apply({"type": "DELETED", "object": pod})
    cluster.lower_pods.apply({"type": "DELETED", "object": lower_copy(pod, "big")})
    assert cluster.fits("1", replicas=10) == 6


def nominated_to_big() -> tuple[Cluster, dict[str, Any]]:
    """A 3-cpu pod bound here whose lower copy waits nominated to the node big."""
    cluster = Cluster()
    pod = upper_pod("web", "3")
    cluster.upper_pods.apply({"type": "ADDED", "object": pod})
    nominated = lower_copy(pod, None)
    nominated["status"]["nominatedNodeName"] = "big"
    cluster.lower_pods.apply({"type": "ADDED", "object": nominated})
    return cluster, pod


def test_a_lower_copy_nominated_to_a_node_is_counted_there_once() -> None:
    """Nominated after preempting below, it counts on that node: its assumption goes."""
    cluster, _ = nominated_to_big()
    assert cluster.fits("1", replicas=10) == 3


def test_a_withdrawn_nomination_puts_the_room_back_on_hold() -> None:
    """The lower scheduler clears a nomination (a pod of higher priority took it): the
    pod bound here waits below again and holds room, as before it was nominated."""
    cluster, pod = nominated_to_big()
    cluster.lower_pods.apply({"type": "MODIFIED", "object": lower_copy(pod, None)})
    assert cluster.fits("3") == 0
    cluster.upper_pods.apply({"type": "MODIFIED", "object": pod})
    assert cluster.fits("3") == 0, "counted once, still"
    assert cluster.fits("1", replicas=10) == 3


@pytest.mark.parametrize("upper_first", [True, False])
def test_a_waiting_lower_copy_is_counted_on_the_node_it_is_pinned_to(upper_first: bool) -> None:
    """After a restart the caches are listed afresh: a pod whose lower copy waits pinned
    to a node is counted there, not on the node it would take now."""
    cluster = Cluster()
    pod = upper_pod("web", "1")
    waiting = pinned_to(lower_copy(pod, None), "small")
    cluster.listed(pod, waiting, upper_first)
    assert cluster.estimator.held_node("uid-web") == "small"
    assert cluster.fits("4") == 1, "the 4-cpu node is free"
    assert cluster.fits("2") == 1, "one cpu left on the pinned node: only the big one"
    assert cluster.fits("1", replicas=10) == 5


def test_a_finished_upper_pod_holds_nothing() -> None:
    cluster = Cluster()
    pod = upper_pod("job", "4")
    cluster.upper_pods.apply({"type": "ADDED", "object": pod})
    assert cluster.fits("4") == 0
    cluster.upper_pods.apply(
        {"type": "MODIFIED", "object": {**pod, "status": {"phase": "Succeeded"}}}
    )
    assert cluster.fits("4") == 1


@pytest.mark.parametrize("upper_first", [True, False])
def test_a_pod_finished_below_holds_nothing_though_its_upper_pod_says_running(
    upper_first: bool,
) -> None:
    """After a restart, before its final status is copied up."""
    cluster = Cluster()
    pod = {**upper_pod("job", "3"), "status": {"phase": "Running"}}
    finished = {**pinned_to(lower_copy(pod, "big"), "big"), "status": {"phase": "Succeeded"}}
    cluster.listed(pod, finished, upper_first)
    assert cluster.fits("4") == 1
    assert cluster.estimator.held_node("uid-job") is None


def test_reservations_never_oversubscribe_a_burst() -> None:
    cluster = Cluster()
    placed = [
        cluster.estimator.answer(orjson.dumps(upper_pod(f"p{i}", "1")), reserve=True)
        for i in range(20)
    ]
    reserved = [a.reserved_node for a in placed if a.reserved_node]
    assert len(reserved) == 6, "4 + 2 one-cpu pods, and not one more"
    assert sorted(reserved) == ["big"] * 4 + ["small"] * 2
    assert all(a.estimate.max_replicas == 0 for a in placed[6:])


def test_the_largest_free_slot_has_no_lapsed_reservation_in_it() -> None:
    cluster = Cluster()
    cluster.estimator.answer(orjson.dumps(upper_pod("web", "4")), reserve=True)
    slot = cluster.estimator.largest_free_slot()
    assert slot is not None and slot[0] == "small"
    cluster.clock.now += RESERVATION_SECONDS + 1
    slot = cluster.estimator.largest_free_slot()
    assert slot is not None and slot[0] == "big" and slot[1]["cpu"] == 4000


def test_asking_again_for_a_reserved_pod_does_not_count_it_twice() -> None:
    cluster = Cluster()
    pod = orjson.dumps(upper_pod("web", "4"))
    first = cluster.estimator.answer(pod, reserve=True)
    again = cluster.estimator.answer(pod, reserve=True)
    assert first.reserved_node == again.reserved_node == "big"
    assert cluster.estimator.answer(pod).estimate.max_replicas == 1
    assert cluster.fits("4") == 0, "the reservation still holds for other pods"


def test_a_reservation_is_released_lapses_or_becomes_the_in_flight_pod() -> None:
    cluster = Cluster()
    web = upper_pod("web", "4")
    cluster.estimator.answer(orjson.dumps(web), reserve=True)
    assert cluster.fits("4") == 0
    assert cluster.estimator.release(["uid-web", "uid-unknown"]) == 1
    assert cluster.fits("4") == 1

    cluster.estimator.answer(orjson.dumps(web), reserve=True)
    cluster.clock.now += RESERVATION_SECONDS + 1
    assert cluster.fits("4") == 1, "a reservation nobody confirmed lapses"

    cluster.estimator.answer(orjson.dumps(web), reserve=True)
    cluster.upper_pods.apply({"type": "ADDED", "object": web})
    cluster.clock.now += RESERVATION_SECONDS + 1
    assert cluster.estimator.release(["uid-web"]) == 0, "bound here: no longer releasable"
    assert cluster.fits("4") == 0, "the pod bound here keeps its room past the timeout"


def test_the_stash_is_restored_before_the_pod_is_judged() -> None:
    cluster = Cluster()
    pod = upper_pod("pinned", "1")
    pod["metadata"]["annotations"] = {
        keys.STASH_ANNOTATION: '{"originals":{"nodeSelector":{"kubernetes.io/hostname":"small"}},'
        '"version":1}'
    }
    answer = cluster.estimator.answer(orjson.dumps(pod), replicas=10)
    assert answer.estimate.max_replicas == 2
    assert answer.estimate.fitting == ("small",)


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"{not json", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"metadata": {"name": "x"}}', "no spec"),
        (
            orjson.dumps(
                {
                    **upper_pod("x", "1"),
                    "metadata": {
                        "name": "x",
                        "namespace": "ns",
                        "uid": "u",
                        "annotations": {keys.STASH_ANNOTATION: "{bad"},
                    },
                }
            ),
            "scheduling-stash",
        ),
        (orjson.dumps(upper_pod("x", "-100")), "container app requests: cpu -100 is below zero"),
        (
            orjson.dumps(
                {
                    **upper_pod("x", "1"),
                    "spec": {
                        **upper_pod("x", "1")["spec"],
                        "overhead": {"example.com/gpu": "-1"},
                    },
                }
            ),
            "overhead: example.com/gpu -1 is below zero",
        ),
        (
            orjson.dumps(
                {
                    **upper_pod("x", "1"),
                    "spec": {**upper_pod("x", "1")["spec"], "overhead": "8"},
                }
            ),
            "resources are not what they should be",
        ),
        (
            orjson.dumps(upper_pod("x", "1", uid="\u00000")),
            "NUL character",
        ),
        (
            orjson.dumps(
                {
                    **upper_pod("x", "1"),
                    "spec": {**upper_pod("x", "1")["spec"], "securityContext": {"sysctls": [1]}},
                }
            ),
            "security context is not what it should be",
        ),
    ],
)
def test_a_pod_that_cannot_be_read_is_a_clear_error(body: bytes, complaint: str) -> None:
    cluster = Cluster()
    with pytest.raises(QueryError, match=complaint):
        cluster.estimator.answer(body, reserve=True)
    with pytest.raises(QueryError, match=complaint):
        cluster.estimator.hold(body, "big", 60)
    assert cluster.fits("4") == 1
    assert cluster.fits("5") == 0, "no room was made"


def test_a_pod_bound_here_is_pinned_to_the_node_its_room_is_held_on() -> None:
    cluster = Cluster()
    web = upper_pod("web", "3")
    assert cluster.estimator.held_node("uid-web") is None
    cluster.estimator.answer(orjson.dumps(web), reserve=True)
    assert cluster.estimator.held_node("uid-web") is None, "reserved, not bound here yet"
    cluster.upper_pods.apply({"type": "ADDED", "object": web})
    assert cluster.estimator.held_node("uid-web") == "big"
    cluster.lower_pods.apply({"type": "ADDED", "object": lower_copy(web, "small")})
    assert cluster.estimator.held_node("uid-web") is None, "landed: the real pod counts"


class Admitting(Authorizer):
    """Lets every caller in: these tests are about the answers, not the checks."""

    def __init__(self) -> None:
        pass

    async def authenticate(
        self, peercert: dict[str, Any] | None, authorization: str, audience: str | None = None
    ) -> User:
        # Every caller's token must be for the estimators alone.
        assert audience == keys.ESTIMATOR_AUDIENCE
        return User(name="extender")

    async def authorize_node_access(self, user: User, verb: str, subresource: str) -> None:
        return None


@asynccontextmanager
async def served(
    tmp_path: Path,
    cluster: Cluster,
    authorizer: Authorizer | None = None,
    grace: float | None = None,
) -> AsyncIterator[tuple[str, bytes]]:
    """The cluster's estimator served as a virtual node serves it (own thread, TLS): its
    address and the CA that signed its certificate; stopped with ``grace``."""
    ca = pki.create_ca(tmp_path, "estimator-ca")
    pair = pki.issue(ca, tmp_path / "estimator", "estimator", server_names=("127.0.0.1",))
    port = free_port()
    service = EstimatorService(cluster.estimator, authorizer or Admitting(), "lower-1")
    server = await serve(service, "127.0.0.1", port, pair)
    try:
        yield f"127.0.0.1:{port}", ca.cert_path.read_bytes()
    finally:
        await server.stop(grace)


class Context:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", "Bearer t"),)


def filler(node_name: str, cpu: str) -> dict[str, Any]:
    return {
        "metadata": {"name": f"filler-{node_name}", "namespace": "default"},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}],
        },
        "status": {"phase": "Running"},
    }


def test_a_pin_is_checked_again_when_the_lower_copy_is_made() -> None:
    """Pinned to a node cordoned, gone or filled since its room was assumed, the copy
    waited there for good."""
    cluster = Cluster()
    cluster.upper_pods.apply({"type": "ADDED", "object": upper_pod("web", "1")})
    assert cluster.estimator.held_node("uid-web") == "big"
    cordoned = node("big", "4")
    cordoned["spec"]["unschedulable"] = True
    cluster.lower_nodes.apply({"type": "MODIFIED", "object": cordoned})
    assert cluster.estimator.held_node("uid-web") == "small"
    cluster.lower_nodes.apply({"type": "MODIFIED", "object": node("big", "4")})
    assert cluster.estimator.held_node("uid-web") == "small", "kept where it still fits"
    cluster.lower_pods.apply({"type": "ADDED", "object": filler("small", "2")})
    assert cluster.estimator.held_node("uid-web") == "big"
    cluster.lower_nodes.apply({"type": "DELETED", "object": node("big", "4")})
    assert cluster.estimator.held_node("uid-web") is None, "no node takes it: not pinned"
    assert cluster.fits("1") == 0


@pytest.mark.parametrize("upper_before_nodes", [True, False])
def test_a_start_assumes_the_pods_in_flight_once_the_lower_cluster_is_known(
    upper_before_nodes: bool,
) -> None:
    """A restart lists the upper pods before the lower nodes (nothing assumed) or before
    the pods filling a node (assumed there)."""
    estimator = FitEstimator(ClusterState(), NamespaceMapping(), OWNER, Clock())
    lower_nodes = Informer(client=None, resource=NODES)  # type: ignore[arg-type]
    lower_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    upper_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    estimator.watch(lower_nodes, lower_pods, upper_pods)

    def list_nodes() -> None:
        for name, cpu in (("big", "4"), ("small", "2")):
            lower_nodes.apply({"type": "ADDED", "object": node(name, cpu)})

    if not upper_before_nodes:
        list_nodes()
    for i in range(2):
        pod = upper_pod(f"p{i}", "1")
        pod["metadata"]["creationTimestamp"] = f"2026-11-28T10:00:0{i}Z"
        upper_pods.apply({"type": "ADDED", "object": pod})
    if upper_before_nodes:
        list_nodes()
    lower_pods.apply({"type": "ADDED", "object": filler("big", "3")})
    estimator.settle()
    assert [estimator.held_node(f"uid-p{i}") for i in range(2)] == ["small", "big"]
    query = orjson.dumps(upper_pod("query", "1"))
    assert estimator.answer(query, 10).estimate.max_replicas == 1


async def test_releases_sent_with_a_call_are_given_back_before_its_pods_are_judged() -> None:
    cluster = Cluster()
    service = EstimatorService(cluster.estimator, Admitting(), "lower-1")
    cluster.estimator.answer(orjson.dumps(upper_pod("web", "4")), reserve=True)
    request = EstimateRequest(
        pods=[PodQuery(pod=orjson.dumps(upper_pod("api", "4")), reserve=True)],
        release_pod_uids=["uid-web"],
    )
    response = await service.Estimate(request, Context())  # type: ignore[arg-type]
    assert response.cluster_id == "lower-1"
    assert response.estimates[0].reserved_node == "big", "web's room, given back first"
    assert cluster.estimator.release(["uid-web"]) == 0


def landed(cluster: Cluster, name: str, cpu: str, node_name: str) -> dict[str, Any]:
    """An upper pod bound here whose lower copy runs on ``node_name``."""
    pod = {**upper_pod(name, cpu), "status": {"phase": "Running"}}
    cluster.upper_pods.apply({"type": "ADDED", "object": pod})
    cluster.lower_pods.apply({"type": "ADDED", "object": lower_copy(pod, node_name)})
    return pod


def test_defragment_plans_by_upper_uid_and_leaves_out_what_may_not_move() -> None:
    cluster = Cluster()
    for name in ("a", "b", "c"):
        landed(cluster, name, "1", "big")
    in_flight = upper_pod("new", "1")
    cluster.upper_pods.apply({"type": "ADDED", "object": in_flight})
    wanted = orjson.dumps(upper_pod("wanted", "4"))
    movable = ["uid-a", "uid-b", "uid-c", "uid-new", "uid-unknown"]
    (plan,) = cluster.estimator.defragment(wanted, movable, 5)
    # The in-flight pod holds the small node's room and is not on a lower node to evict.
    assert plan.node == "big"
    assert plan.evicted == ("uid-a", "uid-b", "uid-c")
    assert plan.homeless == ("uid-b", "uid-c"), "the small node has room for one more"
    assert cluster.estimator.defragment(wanted, ["uid-a", "uid-b"], 5) == []
    assert cluster.estimator.defragment(wanted, movable, 2) == []


def test_a_hold_keeps_the_room_freed_for_a_pod_until_it_lapses() -> None:
    cluster = Cluster()
    for name in ("a", "b", "c"):
        landed(cluster, name, "1", "big")
    wanted = upper_pod("wanted", "4")
    cluster.estimator.hold(orjson.dumps(wanted), "big", 60)
    # The evicted pods go: their room is the held pod's, not theirs to come back to.
    for name in ("a", "b", "c"):
        gone = lower_copy(upper_pod(name, "1"), "big")
        cluster.lower_pods.apply({"type": "DELETED", "object": gone})
    assert cluster.fits("1") == 1 and cluster.fits("2") == 1 and cluster.fits("3") == 0
    # Asked while it does not fit (other room went meanwhile), the pod keeps its hold.
    answer = cluster.estimator.answer(orjson.dumps(wanted), reserve=True)
    assert answer.reserved_node == "big"
    cluster.clock.now += RESERVATION_SECONDS + 1
    assert cluster.fits("4") == 1, "a reservation taken from the hold lapses as any does"


def test_a_hold_asked_again_before_the_room_is_free_stays_where_it_is() -> None:
    cluster = Cluster()
    landed(cluster, "a", "1", "big")
    wanted = upper_pod("wanted", "4")
    cluster.estimator.hold(orjson.dumps(wanted), "big", 60)
    answer = cluster.estimator.answer(orjson.dumps(wanted), reserve=True)
    assert answer.reserved_node is None and answer.estimate.max_replicas == 0
    assert cluster.fits("2") == 1 and cluster.fits("3") == 0, "big still held"
    cluster.clock.now += 61
    assert cluster.fits("3") == 1, "the hold lapsed"


@pytest.mark.parametrize(
    ("node_name", "seconds", "complaint"),
    [("nowhere", 60, "no lower node"), ("big", 0, "not above 0"), ("big", 1e9, "at most")],
)
def test_a_hold_that_cannot_be_kept_is_a_clear_error(
    node_name: str, seconds: float, complaint: str
) -> None:
    cluster = Cluster()
    with pytest.raises(QueryError, match=complaint):
        cluster.estimator.hold(orjson.dumps(upper_pod("wanted", "1")), node_name, seconds)
    assert cluster.fits("4") == 1


def test_a_pod_bound_here_cannot_be_held() -> None:
    cluster = Cluster()
    pod = landed(cluster, "a", "1", "big")
    with pytest.raises(QueryError, match="bound here already"):
        cluster.estimator.hold(orjson.dumps(pod), "small", 60)


def test_fit_in_turn_answers_by_lower_node() -> None:
    cluster = Cluster()
    pods = [orjson.dumps(upper_pod(name, "2")) for name in ("a", "b", "c", "d")]
    assert cluster.estimator.fit_in_turn(pods) == ["big", "big", "small", None]
    assert cluster.fits("4") == 1


async def test_the_service_answers_plans_in_turn_and_holds() -> None:
    cluster = Cluster()
    service = EstimatorService(cluster.estimator, Admitting(), "lower-1")
    landed(cluster, "a", "3", "big")
    wanted = orjson.dumps(upper_pod("wanted", "4"))
    context: Any = Context()
    plans = await service.Defragment(
        DefragmentRequest(pod=wanted, movable_pod_uids=["uid-a"], max_evictions=3), context
    )
    assert plans.cluster_id == "lower-1"
    assert [(p.node, list(p.evicted_pod_uids), list(p.homeless_pod_uids)) for p in plans.plans] == [
        ("big", ["uid-a"], ["uid-a"])
    ]
    fitted = await service.FitInTurn(FitInTurnRequest(pods=[wanted]), context)
    assert list(fitted.nodes) == [""]
    assert cluster.fits("1", replicas=10) == 3
    await service.Hold(HoldRequest(pod=wanted, node="big", seconds=30), context)
    assert cluster.fits("1", replicas=10) == 2, "big is held: only the small node's 2 cpu"


class Reader(Admitting):
    """A caller that may get nodes/estimator, and not create."""

    async def authorize_node_access(self, user: User, verb: str, subresource: str) -> None:
        if (verb, subresource) != ("get", "estimator"):
            raise AuthError(403, f"Forbidden (user={user.name}, verb={verb})")


class Aborted(Exception):
    pass


class CheckedContext(Context):
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


async def test_a_caller_that_may_only_read_may_ask_and_change_nothing() -> None:
    """With get alone, anyone reading could hold a cluster's room for an hour, give back
    the room held for other pods or a namespace's slices: those need create."""
    cluster = Cluster()
    service = EstimatorService(cluster.estimator, Reader(), "lower-1")
    wanted = orjson.dumps(upper_pod("wanted", "1"))
    reading: Any = CheckedContext()
    asked = await service.Estimate(EstimateRequest(pods=[PodQuery(pod=wanted)]), reading)
    assert asked.estimates[0].max_replicas == 1
    await service.FitInTurn(FitInTurnRequest(pods=[wanted]), reading)
    for call in (
        lambda c: service.Estimate(EstimateRequest(pods=[PodQuery(pod=wanted, reserve=True)]), c),
        lambda c: service.Estimate(EstimateRequest(release_pod_uids=["uid-x"]), c),
        lambda c: service.Hold(HoldRequest(pod=wanted, node="big", seconds=3600), c),
        lambda c: service.Release(ReleaseRequest(pod_uids=["uid-x"]), c),
        lambda c: service.PromiseSlices(PromiseSlicesRequest(namespace="ns", slices=0), c),
    ):
        context = CheckedContext()
        with pytest.raises(Aborted, match="verb=create"):
            await call(context)
        assert context.code is grpc.StatusCode.PERMISSION_DENIED
    assert cluster.fits("1", replicas=10) == 6, "nothing held"


class UnreadableEntries:
    """Stands for the slice promises of a cluster whose ledger entry for each namespace
    cannot be read."""

    mapping = NamespaceMapping()

    async def room(self, upper_namespace: str) -> SliceRoom:
        return SliceRoom((), Amount(), 0, Amount(), Amount(), held_unreadable=True)


async def test_slice_room_tells_the_namespace_s_own_entry_cannot_be_read() -> None:
    """So the multischeduler writes it again: told nothing of it, it left it for good."""
    promises = cast(SlicePromises, UnreadableEntries())
    service = EstimatorService(Cluster().estimator, Admitting(), "lower-1", promises)
    context: Any = Context()
    room = await service.SliceRoom(SliceRoomRequest(namespace="team"), context)
    assert (room.cluster_id, room.held, room.held_unreadable) == ("lower-1", 0, True)


class Promising(UnreadableEntries):
    def __init__(self) -> None:
        self.promised: list[tuple[str, int]] = []

    async def promise(self, upper_namespace: str, slices: int, size: Amount, headroom: str) -> None:
        self.promised.append((upper_namespace, slices))


async def test_no_slice_is_promised_in_the_lower_clusters_own_namespaces() -> None:
    """Its quota below would cap the lower cluster's own pods there (and refuse those
    asking no cpu), for a namespace whose pods are refused here anyway."""
    promises = Promising()
    service = EstimatorService(
        Cluster().estimator, Admitting(), "lower-1", cast(SlicePromises, promises)
    )
    context: Any = Context()
    one = Resources(cpu_millis=1000)
    answer = await service.PromiseSlices(
        PromiseSlicesRequest(namespace="kube-system", slices=2, slice=one), context
    )
    assert "namespace kube-system is the lower cluster's own" in answer.refused
    # One an earlier version promised is still taken back.
    assert not (
        await service.PromiseSlices(PromiseSlicesRequest(namespace="kube-system"), context)
    ).refused
    await service.PromiseSlices(
        PromiseSlicesRequest(namespace="team", slices=2, slice=one), context
    )
    assert promises.promised == [("kube-system", 0), ("team", 2)]


def ledger_map(*entries: tuple[str, int, Amount]) -> dict[str, Any]:
    data = {
        namespace: LedgerEntry(namespace, OWNER.origin, slices, size).encode()
        for namespace, slices, size in entries
    }
    return {"metadata": {"name": keys.SLICE_LEDGER_CONFIGMAP}, "data": data}


def test_a_sliced_namespace_s_pods_stay_within_its_slices_here() -> None:
    cluster = Cluster()
    # 2 slices of 1 cpu (memory not capped) for namespace ns.
    cluster.estimator.ledger_changed(ledger_map(("ns", 2, Amount(cpu=1000))))
    bound = upper_pod("bound", "500m")
    cluster.upper_pods.apply({"type": "ADDED", "object": bound})
    assert cluster.fits("1", replicas=5) == 1, "1.5 cpu left of the slices, nodes take more"
    answer = cluster.estimator.answer(orjson.dumps(upper_pod("big", "2")))
    assert answer.estimate.max_replicas == 0 and answer.refusal == (
        "namespace ns's quota slices here (2 of cpu 1) have cpu 1500m left, the pod asks cpu 2"
    )
    # A reservation counts against the slices at once: a burst cannot overspend them.
    reserved = cluster.estimator.answer(orjson.dumps(upper_pod("r", "1")), reserve=True)
    assert reserved.reserved_node is not None
    assert cluster.fits("1") == 0
    # Once bound, the same pod counts once; released or finished, not at all.
    cluster.upper_pods.apply({"type": "ADDED", "object": upper_pod("r", "1")})
    assert cluster.fits("500m") == 1
    cluster.upper_pods.apply({"type": "DELETED", "object": bound})
    assert cluster.fits("1") == 1
    message = to_message(cluster.estimator.answer(orjson.dumps(upper_pod("x", "2"))), False)
    assert (message.max_replicas, message.total_nodes) == (0, 2)
    assert message.message.startswith("namespace ns's quota slices here")


def test_the_slice_use_counts_pods_bound_or_holding_room_before_their_lower_copy() -> None:
    """What SliceRoom tells as used: a pod bound here, or holding room, whose lower copy
    is not made yet, uses its slice all the same."""
    cluster = Cluster()
    cluster.estimator.ledger_changed(ledger_map(("ns", 2, Amount(cpu=1000))))
    cluster.upper_pods.apply({"type": "ADDED", "object": upper_pod("bound", "500m")})
    cluster.estimator.answer(orjson.dumps(upper_pod("held", "1")), reserve=True)
    assert cluster.estimator.slice_use("ns") == Amount(cpu=1500)
    assert cluster.estimator.slice_use("other") == Amount()
    # Room held past its time (its release lost with the extender) is no use, though
    # no pod has been judged since: the multischeduler would keep the slice for it.
    cluster.clock.now += RESERVATION_SECONDS + 1
    assert cluster.estimator.slice_use("ns") == Amount(cpu=500)


def test_a_namespace_without_slices_here_and_a_lost_ledger_are_not_held() -> None:
    cluster = Cluster()
    cluster.estimator.ledger_changed(ledger_map(("other", 1, Amount(cpu=1000))))
    assert cluster.fits("4") == 1
    cluster.estimator.ledger_changed(ledger_map(("ns", 1, Amount(cpu=1000))))
    assert cluster.fits("4") == 0
    cluster.estimator.ledger_changed({})
    assert cluster.fits("4") == 1


def test_pods_bound_before_the_ledger_names_their_namespace_count_once_it_does() -> None:
    cluster = Cluster()
    cluster.upper_pods.apply({"type": "ADDED", "object": upper_pod("early", "1500m")})
    done = {**upper_pod("done", "4"), "status": {"phase": "Succeeded"}}
    cluster.upper_pods.apply({"type": "ADDED", "object": done})
    cluster.estimator.ledger_changed(ledger_map(("ns", 2, Amount(cpu=1000))))
    assert cluster.fits("500m") == 1
    assert cluster.fits("1") == 0
    # Its slices gone from here, nothing is counted or held.
    cluster.estimator.ledger_changed(ledger_map())
    assert cluster.fits("2") == 1


def test_pods_holding_room_when_the_ledger_names_their_namespace_count_at_once() -> None:
    """Until they were bound, their namespace went past its slices here."""
    cluster = Cluster()
    cluster.estimator.answer(orjson.dumps(upper_pod("held", "1")), reserve=True)
    cluster.estimator.ledger_changed(ledger_map(("ns", 2, Amount(cpu=1000))))
    assert (cluster.fits("1"), cluster.fits("1500m")) == (1, 0)
    cluster.upper_pods.apply({"type": "ADDED", "object": upper_pod("held", "1")})
    assert (cluster.fits("1"), cluster.fits("1500m")) == (1, 0), "bound, counted once"


def test_a_hold_past_the_namespace_s_slices_is_refused() -> None:
    cluster = Cluster()
    cluster.estimator.ledger_changed(ledger_map(("ns", 1, Amount(cpu=1000))))
    with pytest.raises(QueryError, match="quota slices here"):
        cluster.estimator.hold(orjson.dumps(upper_pod("p", "2")), "big", 30)
    cluster.estimator.hold(orjson.dumps(upper_pod("p", "1")), "big", 30)
    assert cluster.fits("1") == 0
    cluster.clock.now += 31
    cluster.estimator.expire()
    assert cluster.fits("1") == 1


def lower_quota(hard: dict[str, str], used: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": "compute", "namespace": "ns"},
        "spec": {"hard": hard},
        "status": {"hard": hard, "used": used},
    }


def quota_watched(cluster: Cluster, quota: dict[str, Any]) -> Informer:
    quotas = Informer(client=None, resource=RESOURCEQUOTAS)  # type: ignore[arg-type]
    cluster.estimator.watch_quotas(quotas)
    quotas.apply({"type": "ADDED", "object": quota})
    return quotas


def test_a_lower_quota_holds_its_namespace_and_a_burst_cannot_pass_it() -> None:
    cluster = Cluster()
    quotas = quota_watched(cluster, lower_quota({"requests.cpu": "3"}, {"requests.cpu": "1"}))
    assert cluster.fits("1", replicas=10) == 2, "the nodes take 6, the quota 2 more"
    answer = cluster.estimator.answer(orjson.dumps(upper_pod("big", "3")))
    assert (answer.estimate.max_replicas, answer.refusal) == (
        0,
        "lower cluster lower-1: quota compute of namespace ns has requests.cpu 2 left of 3, "
        "the pod asks 3",
    )
    # Reserved, then bound: counted once until the lower copy is made.
    assert cluster.estimator.answer(orjson.dumps(upper_pod("r", "1")), reserve=True).reserved_node
    assert cluster.fits("1") == 1
    bound = upper_pod("r", "1")
    cluster.upper_pods.apply({"type": "ADDED", "object": bound})
    assert cluster.fits("1") == 1
    cluster.upper_pods.apply({"type": "ADDED", "object": upper_pod("b", "1")})
    assert cluster.fits("1") == 0
    # Made below: the quota's usage has it from then on, and no longer the estimator.
    cluster.lower_pods.apply({"type": "ADDED", "object": lower_copy(bound, None)})
    assert cluster.fits("1") == 1
    quotas.apply(
        {"type": "MODIFIED", "object": lower_quota({"requests.cpu": "3"}, {"requests.cpu": "2"})}
    )
    assert cluster.fits("1") == 0
    with pytest.raises(QueryError, match="quota compute of namespace ns"):
        cluster.estimator.hold(orjson.dumps(upper_pod("h", "1")), "big", 30)
    quotas.apply({"type": "DELETED", "object": lower_quota({}, {})})
    assert cluster.fits("1", replicas=10) == 4, "the nodes' 6 alone, less the two bound here"


def test_a_pod_holding_room_then_refused_gives_the_room_back() -> None:
    cluster = Cluster()
    quotas = quota_watched(cluster, lower_quota({"requests.cpu": "8"}, {}))
    held = orjson.dumps(upper_pod("held", "4"))
    assert cluster.estimator.answer(held, reserve=True).reserved_node == "big"
    quotas.apply({"type": "MODIFIED", "object": lower_quota({"requests.cpu": "2"}, {})})
    assert "quota compute of namespace ns" in cluster.estimator.answer(held, reserve=True).refusal
    quotas.apply({"type": "DELETED", "object": lower_quota({}, {})})
    assert cluster.fits("4") == 1, "big is free again before the reservation would lapse"


def test_a_quota_that_appears_while_a_pod_holds_room_counts_it_through_its_binding() -> None:
    cluster = Cluster()
    held = upper_pod("held", "1")
    assert cluster.estimator.answer(orjson.dumps(held), reserve=True).reserved_node
    quota_watched(cluster, lower_quota({"pods": "2"}, {}))
    assert cluster.fits("100m", replicas=10) == 1, "2 less the one holding room"
    cluster.upper_pods.apply({"type": "ADDED", "object": held})
    assert cluster.fits("100m", replicas=10) == 1, "bound, still counted once"


def test_pods_bound_before_their_namespace_s_quota_is_seen_count_once_it_is() -> None:
    cluster = Cluster()
    cluster.upper_pods.apply({"type": "ADDED", "object": upper_pod("early", "1")})
    made = upper_pod("made", "1")
    cluster.upper_pods.apply({"type": "ADDED", "object": made})
    cluster.lower_pods.apply({"type": "ADDED", "object": lower_copy(made, None)})
    quota_watched(cluster, lower_quota({"pods": "3"}, {"pods": "1"}))
    assert cluster.fits("100m", replicas=10) == 1, "3 less the one made, less the one not yet"


def test_an_unreadable_ledger_entry_holds_its_namespace_to_nothing() -> None:
    cluster = Cluster()
    ledger = ledger_map(("other", 1, Amount(cpu=1000)))
    ledger["data"]["ns"] = "{not json"
    cluster.estimator.ledger_changed(ledger)
    answer = cluster.estimator.answer(orjson.dumps(upper_pod("p", "1")))
    assert answer.estimate.max_replicas == 0
    assert answer.refusal == "the slice ledger's entry for ns here cannot be read"


def test_a_pod_whose_claim_is_filled_from_a_snapshot_fits_nowhere_here() -> None:
    """Below, the claim's copy would wait for ever for a source the lower cluster lacks."""
    cluster = Cluster()
    claims = Informer(client=None, resource=PERSISTENTVOLUMECLAIMS)  # type: ignore[arg-type]
    classes = Informer(client=None, resource=STORAGECLASSES)  # type: ignore[arg-type]
    cluster.estimator.watch_volumes(claims, classes)
    classes.apply({"type": "ADDED", "object": {"metadata": {"name": "fast"}}})
    source = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "s"}
    claim: dict[str, Any] = {
        "metadata": {"name": "data", "namespace": "ns"},
        "spec": {"storageClassName": "fast", "dataSourceRef": source},
    }
    claims.apply({"type": "ADDED", "object": claim})
    pod = upper_pod("restored", "1")
    pod["spec"]["volumes"] = [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]
    answer = cluster.estimator.answer(orjson.dumps(pod))
    assert answer.estimate.max_replicas == 0
    assert answer.refusal is not None and "claim data from its data source" in answer.refusal
    claims.apply({"type": "DELETED", "object": claim})
    assert cluster.estimator.answer(orjson.dumps(pod)).estimate.max_replicas == 1


def test_a_pod_whose_claim_waits_for_a_class_the_cluster_lacks_fits_nowhere_here() -> None:
    cluster = Cluster()
    claims = Informer(client=None, resource=PERSISTENTVOLUMECLAIMS)  # type: ignore[arg-type]
    classes = Informer(client=None, resource=STORAGECLASSES)  # type: ignore[arg-type]
    cluster.estimator.watch_volumes(claims, classes)
    claim: dict[str, Any] = {
        "metadata": {"name": "data", "namespace": "ns"},
        "spec": {"storageClassName": "fast", "accessModes": ["ReadWriteOnce"]},
    }
    claims.apply({"type": "ADDED", "object": claim})
    pod = upper_pod("stateful", "1")
    pod["spec"]["volumes"] = [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]
    answer = cluster.estimator.answer(orjson.dumps(pod), reserve=True)
    assert (answer.estimate.max_replicas, answer.reserved_node) == (0, None)
    assert answer.refusal == "lower cluster lower-1 has no storage class fast (claim data)"
    assert to_message(answer, False).message == answer.refusal

    classes.apply({"type": "ADDED", "object": {"metadata": {"name": "fast"}}})
    assert cluster.estimator.answer(orjson.dumps(pod)).estimate.max_replicas == 1
    classes.apply({"type": "DELETED", "object": {"metadata": {"name": "fast"}}})
    # Bound above, the claim decides nothing here: its volume says where the pod goes.
    bound = {
        "metadata": {**claim["metadata"], "annotations": {keys.BOUND_BY_CONTROLLER: "yes"}},
        "spec": {**claim["spec"], "volumeName": "v"},
    }
    claims.apply({"type": "MODIFIED", "object": bound})
    assert cluster.estimator.answer(orjson.dumps(pod)).estimate.max_replicas == 1


@pytest.mark.parametrize(
    "spec",
    [
        {"storageClassName": "", "volumeName": "nfs-share"},
        {"storageClassName": "fast", "selector": {"matchLabels": {"disk": "ssd"}}},
    ],
)
def test_a_pod_whose_claim_asks_for_a_volume_made_by_hand_fits_only_where_it_was_copied(
    spec: dict[str, Any],
) -> None:
    """No copy of such a claim is made below: bound here, the pod would wait with
    ClaimNotMirrored. One made before that rule is kept, and its pods mirrored."""
    cluster = Cluster()
    claims = Informer(client=None, resource=PERSISTENTVOLUMECLAIMS)  # type: ignore[arg-type]
    classes = Informer(client=None, resource=STORAGECLASSES)  # type: ignore[arg-type]
    copies = Informer(client=None, resource=PERSISTENTVOLUMECLAIMS)  # type: ignore[arg-type]
    cluster.estimator.watch_volumes(claims, classes, copies)
    classes.apply({"type": "ADDED", "object": {"metadata": {"name": "fast"}}})
    claim: dict[str, Any] = {
        "metadata": {"name": "data", "namespace": "ns", "uid": "u1"},
        "spec": spec,
    }
    claims.apply({"type": "ADDED", "object": claim})
    pod = upper_pod("static", "1")
    pod["spec"]["volumes"] = [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]
    answer = cluster.estimator.answer(orjson.dumps(pod), reserve=True)
    assert (answer.estimate.max_replicas, answer.reserved_node) == (0, None)
    assert answer.refusal.startswith("claim data asks for a volume made by hand")

    def copy_of(uid: str, **metadata: str) -> dict[str, Any]:
        annotations = {keys.UPPER_NAMESPACE_ANNOTATION: "ns", keys.UPPER_UID_ANNOTATION: uid}
        return {
            "metadata": {"name": "data", "namespace": "ns", "annotations": annotations, **metadata}
        }

    copies.apply({"type": "ADDED", "object": copy_of("u1")})
    assert cluster.estimator.answer(orjson.dumps(pod)).estimate.max_replicas == 1
    # Going (its pods hold it), or made from an earlier claim of that name: no copy for a
    # new pod, which would wait below for a claim then gone.
    going = copy_of("u1", deletionTimestamp="2026-11-29T07:00:00Z")
    for copy in (going, copy_of("u0")):
        copies.apply({"type": "MODIFIED", "object": copy})
        assert cluster.estimator.answer(orjson.dumps(pod)).estimate.max_replicas == 0
    copies.apply({"type": "MODIFIED", "object": copy_of("u1")})
    copies.apply({"type": "DELETED", "object": copy_of("u1")})
    assert cluster.estimator.answer(orjson.dumps(pod)).estimate.max_replicas == 0
    claims.apply({"type": "DELETED", "object": claim})
    assert cluster.estimator.answer(orjson.dumps(pod)).estimate.max_replicas == 1


def test_a_runtime_class_the_cluster_lacks_fits_nowhere_one_it_has_brings_its_overhead() -> None:
    cluster = Cluster()
    classes = Informer(client=None, resource=RUNTIMECLASSES)  # type: ignore[arg-type]
    cluster.estimator.watch_runtime_classes(classes)
    # As the upper apiserver admits it: the upper class's overhead written into the pod.
    pod = upper_pod("sandboxed", "3")
    pod["spec"]["runtimeClassName"] = "gvisor"
    pod["spec"]["overhead"] = {"cpu": "2"}
    answer = cluster.estimator.answer(orjson.dumps(pod), reserve=True)
    assert (answer.estimate.max_replicas, answer.reserved_node) == (0, None)
    assert answer.refusal == "lower cluster lower-1 has no runtime class gvisor"

    # The lower class has no overhead: 3 cpu fit the 4-cpu node, the upper overhead aside.
    classes.apply({"type": "ADDED", "object": {"metadata": {"name": "gvisor"}, "handler": "runsc"}})
    assert cluster.estimator.answer(orjson.dumps(pod)).estimate.max_replicas == 1
    # Its own overhead of 1.5 cpu makes 4.5: more than any node here.
    classes.apply(
        {
            "type": "MODIFIED",
            "object": {
                "metadata": {"name": "gvisor"},
                "handler": "runsc",
                "overhead": {"podFixed": {"cpu": "1500m"}},
            },
        }
    )
    answer = cluster.estimator.answer(orjson.dumps(pod))
    assert (answer.estimate.max_replicas, answer.refusal) == (0, "")
    classes.apply({"type": "DELETED", "object": {"metadata": {"name": "gvisor"}}})
    assert cluster.estimator.answer(orjson.dumps(pod)).refusal.endswith("runtime class gvisor")


def test_a_bound_pod_takes_of_its_slices_what_the_lower_quota_charges() -> None:
    """Its lower RuntimeClass's overhead, as its reservation counted it, not the upper
    one's: counted by the upper pod, the slices would let in a pod the lower quota
    refuses."""
    cluster = Cluster()
    classes = Informer(client=None, resource=RUNTIMECLASSES)  # type: ignore[arg-type]
    cluster.estimator.watch_runtime_classes(classes)
    lower_class = {
        "metadata": {"name": "kata"},
        "handler": "kata",
        "overhead": {"podFixed": {"cpu": "250m"}},
    }
    classes.apply({"type": "ADDED", "object": lower_class})
    cluster.estimator.ledger_changed(ledger_map(("ns", 2, Amount(cpu=1000))))

    def sandboxed(name: str) -> dict[str, Any]:
        pod = upper_pod(name, "500m")
        pod["spec"]["runtimeClassName"] = "kata"  # no overhead in the upper class
        return pod

    for name in ("a", "b"):
        cluster.upper_pods.apply({"type": "ADDED", "object": sandboxed(name)})
    # 2 x 750m of the 2 cpu: 500m left, not 1 cpu.
    assert cluster.estimator.answer(orjson.dumps(sandboxed("c"))).estimate.max_replicas == 0


def test_a_pod_the_virtual_node_would_not_create_below_fits_nowhere_here() -> None:
    """Refused here, it stays unbound above with the reason, rather than bound and failed
    (a DaemonSet would make it again and again)."""
    cluster = Cluster()
    pod = upper_pod("agent", "1")
    pod["spec"]["hostNetwork"] = True
    answer = cluster.estimator.answer(orjson.dumps(pod), reserve=True)
    assert (answer.estimate.max_replicas, answer.reserved_node) == (0, None)
    assert answer.refusal.startswith("lower cluster lower-1 runs no pod that uses its nodes' host")
    assert "(spec.hostNetwork)" in answer.refusal
    assert "namespace ns " in answer.refusal
    allowed = FitEstimator(
        ClusterState(), NamespaceMapping(), OWNER, host_access_namespaces=frozenset({"ns"})
    )
    allowed.state.set_node(node("big", "4"))
    assert allowed.answer(orjson.dumps(pod)).estimate.max_replicas == 1


def test_a_runtime_class_s_scheduling_limits_the_nodes_its_pods_fit() -> None:
    """The lower apiserver merges the class's node selector into the pod: only the small
    node carries its runtime here, so 3 cpu fit nowhere, though the big node has room."""
    cluster = Cluster()
    classes = Informer(client=None, resource=RUNTIMECLASSES)  # type: ignore[arg-type]
    cluster.estimator.watch_runtime_classes(classes)
    small = node("small", "2")
    small["metadata"]["labels"]["sandbox"] = "gvisor"
    cluster.lower_nodes.apply({"type": "MODIFIED", "object": small})
    scheduling = {"nodeSelector": {"sandbox": "gvisor"}}
    classes.apply(
        {
            "type": "ADDED",
            "object": {
                "metadata": {"name": "gvisor"},
                "handler": "runsc",
                "scheduling": scheduling,
            },
        }
    )
    pod = upper_pod("sandboxed", "3")
    pod["spec"]["runtimeClassName"] = "gvisor"
    answer = cluster.estimator.answer(orjson.dumps(pod))
    assert (answer.estimate.max_replicas, answer.refusal) == (0, "")
    pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "1"
    assert cluster.estimator.answer(orjson.dumps(pod), replicas=5).estimate.max_replicas == 2
    pod["spec"]["nodeSelector"] = {"sandbox": "kata"}
    assert cluster.estimator.answer(orjson.dumps(pod)).refusal == (
        "lower cluster lower-1's runtime class gvisor runs on sandbox=gvisor, "
        "the pod asks for sandbox=kata"
    )


def test_no_room_is_made_or_held_for_a_pod_the_cluster_would_not_run() -> None:
    """Its runtime class is not here: evicting pods for it would be for nothing, and the
    freed room taken back by them meanwhile (until 2026-11-28 the descheduler evicted
    up to 5 pods every hold timeout while it waited)."""
    cluster = Cluster()
    for name in ("a", "b", "c"):
        landed(cluster, name, "1", "big")
    wanted = upper_pod("wanted", "4")
    wanted["spec"]["runtimeClassName"] = "gvisor"
    query = orjson.dumps(wanted)
    assert "no runtime class gvisor" in cluster.estimator.answer(query).refusal
    assert cluster.estimator.defragment(query, ["uid-a", "uid-b", "uid-c"], 5) == []
    with pytest.raises(QueryError, match="no runtime class gvisor"):
        cluster.estimator.hold(query, "big", 60)
    wanted["spec"].pop("runtimeClassName")
    (plan,) = cluster.estimator.defragment(orjson.dumps(wanted), ["uid-a", "uid-b", "uid-c"], 5)
    assert plan.node == "big"
