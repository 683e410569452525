"""The extender over HTTP against real in-process gRPC estimators over TLS, one per
virtual node, with the upper Node cache fed through its informer."""

from __future__ import annotations

import asyncio
import os
import re
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import orjson
import pytest
from aiohttp import ClientConnectionError, TCPConnector, web
from aiohttp.test_utils import TestClient, TestServer

from kubekit import keys, pki
from kubekit.client import NODES, PODS, ApiError, Resource
from kubekit.estimatorapi import estimator_pb2, estimator_pb2_grpc
from kubekit.estimatorapi.estimator_pb2 import (
    EstimateRequest,
    EstimateResponse,
    PodEstimate,
    ReleaseRequest,
    ReleaseResponse,
)
from kubekit.informer import FunctionHandler, Informer
from multischeduler import server as extender_server
from multischeduler.estimators import (
    LATE_IN_A_ROW_TO_SKIP,
    CaFile,
    EstimatorPool,
    TokenFile,
)
from multischeduler.extender import BindingArgs, EstimatorFailure, OnEstimatorError
from multischeduler.server import READ_AGAIN_FOR_RETRY_INTERVAL, Callers, Extender, make_app

POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
    "spec": {"containers": [{"name": "c", "image": "i"}]},
}
NO_ROOM = PodEstimate(
    max_replicas=0, total_nodes=3, message="0/3 nodes are available: 3 Insufficient cpu"
)


def sample(federation: Federation, name: str) -> float | None:
    """A sample of the extender's own metrics."""
    return federation.extender.metrics.registry.get_sample_value(name)


def fits(best_fit: float, node: str = "lower-node-1") -> PodEstimate:
    return PodEstimate(
        max_replicas=1, fitting_count=1, total_nodes=3, best_fit=best_fit, reserved_node=node
    )


class FakeEstimator(estimator_pb2_grpc.EstimatorServicer):
    """Canned answers, with what it was asked."""

    def __init__(self, cluster_id: str, answer: PodEstimate, delay: float = 0.0) -> None:
        self.cluster_id = cluster_id
        self.answer = answer
        self.delay = delay
        self.estimates: list[EstimateRequest] = []
        # EstimateStream calls opened, and unary Estimate calls.
        self.streams = 0
        self.unary_estimates = 0
        # Answers after which it ends an EstimateStream call.
        self.answers_per_call: int | None = None
        # Requests on an EstimateStream after which it breaks the call (UNAVAILABLE).
        self.breaks_after_reading: int | None = None
        self.releases: list[list[str]] = []
        # How long a Release call takes, and those that ended.
        self.release_delay = 0.0
        self.releases_ended = 0
        # Release calls still to be refused (UNAVAILABLE), as a restarting estimator would.
        self.releases_refused = 0
        self.authorization: list[str] = []

    def _caller(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        metadata = dict(context.invocation_metadata() or ())
        self.authorization.append(str(metadata.get("authorization", "")))

    async def _estimate(
        self, request: EstimateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> EstimateResponse:
        self._caller(context)
        self.estimates.append(request)
        await asyncio.sleep(self.delay)
        return EstimateResponse(cluster_id=self.cluster_id, estimates=[self.answer])

    async def Estimate(
        self, request: EstimateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> EstimateResponse:
        self.unary_estimates += 1
        return await self._estimate(request, context)

    async def EstimateStream(
        self,
        requests: AsyncIterator[EstimateRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[EstimateResponse]:
        self.streams += 1
        answered = 0
        async for request in requests:
            if self.breaks_after_reading is not None:
                self.breaks_after_reading -= 1
                if self.breaks_after_reading < 0:
                    self.breaks_after_reading = None
                    self.estimates.append(request)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
            yield await self._estimate(request, context)
            answered += 1
            if answered == self.answers_per_call:
                return

    async def Release(
        self, request: ReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> ReleaseResponse:
        self._caller(context)
        self.releases.append(list(request.pod_uids))
        if self.releases_refused:
            self.releases_refused -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        await asyncio.sleep(self.release_delay)
        self.releases_ended += 1
        return ReleaseResponse(released=len(request.pod_uids))

    async def Defragment(
        self,
        request: estimator_pb2.DefragmentRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.DefragmentResponse:
        self._caller(context)
        plan = estimator_pb2.Freeing(node="n1", evicted_pod_uids=request.movable_pod_uids)
        return estimator_pb2.DefragmentResponse(cluster_id=self.cluster_id, plans=[plan])

    async def FitInTurn(
        self,
        request: estimator_pb2.FitInTurnRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.FitInTurnResponse:
        self._caller(context)
        return estimator_pb2.FitInTurnResponse(
            cluster_id=self.cluster_id, nodes=["n1"] + [""] * (len(request.pods) - 1)
        )

    async def Hold(
        self, request: estimator_pb2.HoldRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> estimator_pb2.HoldResponse:
        self._caller(context)
        if not request.node:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no lower node ''")
        return estimator_pb2.HoldResponse()

    async def SliceRoom(
        self,
        request: estimator_pb2.SliceRoomRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.SliceRoomResponse:
        self._caller(context)
        await asyncio.sleep(self.delay)
        node = estimator_pb2.Resources(cpu_millis=8000, memory_bytes=2**35)
        return estimator_pb2.SliceRoomResponse(
            cluster_id=self.cluster_id, nodes=[node], held=len(request.namespace)
        )

    async def PromiseSlices(
        self,
        request: estimator_pb2.PromiseSlicesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.PromiseSlicesResponse:
        self._caller(context)
        refused = "no room" if request.slices > 4 else ""
        return estimator_pb2.PromiseSlicesResponse(refused=refused)

    async def SlicedNamespaces(
        self,
        request: estimator_pb2.SlicedNamespacesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> estimator_pb2.SlicedNamespacesResponse:
        self._caller(context)
        return estimator_pb2.SlicedNamespacesResponse(
            cluster_id=self.cluster_id, namespaces=["gone", "team"]
        )


def cluster_of(node: str) -> str:
    return node.removeprefix("vk-")


@dataclass
class Federation:
    """The extender's world: estimators by virtual node, the upper Node cache, bindings."""

    tmp_path: Path
    extender: Extender
    nodes: Informer
    client: TestClient[Any, Any]
    # The upper pods waiting for a node, as the extender's informer of them.
    waiting: Informer
    estimators: dict[str, FakeEstimator] = field(default_factory=dict)
    servers: list[grpc.aio.Server] = field(default_factory=list)
    bindings: list[BindingArgs] = field(default_factory=list)
    bind_error: Exception | None = None
    bind_seconds: float = 0.0
    # The upper pods the extender reads (namespace, name), and the reads it made.
    upper_pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    lookup_error: Exception | None = None
    lookups: list[tuple[str, str]] = field(default_factory=list)
    # The virtual Nodes as the upper apiserver has them, ahead of the Node cache.
    upper_nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_reads: list[str] = field(default_factory=list)

    async def serve(self, servicer: FakeEstimator, older: bool = False) -> str:
        """Starts an estimator on a free port; returns its address."""
        server = grpc.aio.server()
        if older:
            server.add_generic_rpc_handlers((older_estimator(servicer),))
        else:
            estimator_pb2_grpc.add_EstimatorServicer_to_server(servicer, server)
        pair = serving_pair(self.tmp_path)
        credentials = grpc.ssl_server_credentials(
            [(pair.key_path.read_bytes(), pair.cert_path.read_bytes())]
        )
        port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        self.servers.append(server)
        return f"127.0.0.1:{port}"

    async def estimator(self, node: str, answer: PodEstimate, delay: float = 0.0) -> str:
        """Starts an estimator for ``node`` and puts its virtual Node in the cache."""
        servicer = FakeEstimator(cluster_of(node), answer, delay)
        self.estimators[node] = servicer
        address = await self.serve(servicer)
        self.virtual_node(node, address)
        return address

    def virtual_node(self, name: str, address: str | None, event: str = "ADDED") -> None:
        self.nodes.apply({"type": event, "object": virtual_node_object(name, address)})

    async def post(self, verb: str, body: Any, status: int = 200) -> Any:
        response = await self.client.post(f"/{verb}", data=orjson.dumps(body))
        assert response.status == status, await response.text()
        return await response.json()

    async def filter(self, *names: str, pod: dict[str, Any] = POD) -> dict[str, Any]:
        answer: dict[str, Any] = await self.post("filter", {"Pod": pod, "NodeNames": list(names)})
        return answer

    def scheduled(self, node: str | None) -> None:
        """The scheduler bound POD to ``node`` (None: it was deleted instead): it leaves the
        queue, whose watch sends the pod as it was while waiting."""
        if node is not None:
            spec = {"containers": [{"name": "c", "image": "i"}], "nodeName": node}
            self.upper_pods[("ns", "p")] = {**POD, "spec": spec}
        self.waiting.apply({"type": "ADDED", "object": POD})
        self.waiting.apply({"type": "DELETED", "object": POD})

    def estimate_calls(self) -> int:
        return sum(len(e.estimates) for e in self.estimators.values())


def virtual_node_object(name: str, address: str | None, started: str = "") -> dict[str, Any]:
    annotations = {keys.ESTIMATOR_ADDRESS_ANNOTATION: address} if address else {}
    if started:
        annotations[keys.ESTIMATOR_STARTED_ANNOTATION] = started
    labels = {
        keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
        keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
        keys.CLUSTER_ID_LABEL: cluster_of(name),
    }
    return {"metadata": {"name": name, "labels": labels, "annotations": annotations}}


def serving_pair(tmp_path: Path) -> pki.KeyPair:
    return pki.serving_pair(tmp_path / "estimators", "estimator", ("127.0.0.1",))


def callers_ca(tmp_path: Path) -> pki.KeyPair:
    """The CA the extender trusts for its callers (made once per test)."""
    ca = pki.KeyPair(tmp_path / "callers-ca.crt", tmp_path / "callers-ca.key")
    return ca if ca.cert_path.exists() else pki.create_ca(tmp_path, "callers")


def scheduler_pair(tmp_path: Path, name: str = "system:kube-scheduler") -> pki.KeyPair:
    """A client certificate of ``name`` signed by ``callers_ca``."""
    return pki.issue(callers_ca(tmp_path), tmp_path / name.replace(":", "-"), name, client=True)


async def https_client(
    app: web.Application, tmp_path: Path, caller: pki.KeyPair | None
) -> TestClient[Any, Any]:
    """A client of ``app`` served over HTTPS as the multischeduler serves it: a serving
    certificate, and ``callers_ca`` for callers; the client shows the
    certificate ``caller`` (None: none)."""
    serving = pki.serving_pair(tmp_path / "extender", "extender", ("127.0.0.1",))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server(
        ssl=pki.server_ssl_context(
            serving.cert_path, serving.key_path, callers_ca(tmp_path).cert_path
        )
    )
    context = ssl.create_default_context(cafile=str(pki.ca_path(serving)))
    if caller is not None:
        context.load_cert_chain(caller.cert_path, caller.key_path)
    client = TestClient(server, connector=TCPConnector(ssl=context))
    await client.start_server()
    return client


@pytest.fixture
async def federation(tmp_path: Path) -> AsyncIterator[Federation]:
    token = tmp_path / "token"
    token.write_text("sesame\n")
    ca = pki.ca_path(serving_pair(tmp_path))
    pool = EstimatorPool(CaFile(ca), TokenFile(token))
    nodes = Informer(client=None, resource=NODES)  # type: ignore[arg-type]
    nodes.add_handler(pool.handler())
    for ordinary in ("worker", "worker-1", "worker-2"):
        nodes.apply({"type": "ADDED", "object": {"metadata": {"name": ordinary}}})
    nodes.synced.set()
    world: Federation

    async def bind(args: BindingArgs) -> None:
        if world.bind_error is not None:
            raise world.bind_error
        await asyncio.sleep(world.bind_seconds)
        world.bindings.append(args)

    async def lookup(resource: Resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        if resource is NODES:
            world.node_reads.append(name)
            return world.upper_nodes.get(name)
        assert resource is PODS and namespace is not None
        world.lookups.append((namespace, name))
        if world.lookup_error is not None:
            raise world.lookup_error
        return world.upper_pods.get((namespace, name))

    extender = Extender(pool, bind, lookup, estimator_timeout=0.3)
    waiting = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    waiting.add_handler(FunctionHandler(delete=extender.stopped_waiting))
    waiting.synced.set()
    client = await https_client(make_app(extender, Callers()), tmp_path, scheduler_pair(tmp_path))
    world = Federation(tmp_path, extender, nodes, client, waiting)
    try:
        yield world
    finally:
        await extender.stop()
        await client.close()
        await pool.close()
        for server in world.servers:
            await server.stop(None)


async def eventually(condition: Callable[[], bool]) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


async def test_ordinary_nodes_alone_pass_at_once(federation: Federation) -> None:
    await federation.estimator("vk-a", NO_ROOM)
    result = await federation.filter("worker-1", "worker-2")
    assert result == {
        "NodeNames": ["worker-1", "worker-2"],
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": {},
        "Error": "",
    }
    assert federation.estimate_calls() == 0


async def test_filter_asks_each_cluster_and_says_why_one_does_not_fit(
    federation: Federation,
) -> None:
    await federation.estimator("vk-a", fits(0.8))
    await federation.estimator("vk-b", NO_ROOM)
    result = await federation.filter("worker", "vk-a", "vk-b")
    assert result["NodeNames"] == ["worker", "vk-a"]
    assert result["FailedNodes"] == {}
    assert result["FailedAndUnresolvableNodes"] == {
        "vk-b": "vk-b: 0/3 nodes are available: 3 Insufficient cpu"
    }
    assert result["Error"] == ""
    for name in ("vk-a", "vk-b"):
        (request,) = federation.estimators[name].estimates
        (query,) = request.pods
        assert orjson.loads(query.pod) == POD
        assert query.reserve
        assert federation.estimators[name].authorization == ["Bearer sesame"]


async def test_a_sliced_namespace_s_pods_go_only_where_it_holds_slices(
    federation: Federation,
) -> None:
    await federation.estimator("vk-a", fits(0.8))
    await federation.estimator("vk-b", fits(0.8))
    placements: dict[str, dict[str, int] | None] = {"ns": {"a": 2}}
    federation.extender.slices_of = placements.get
    result = await federation.filter("worker", "vk-a", "vk-b")
    assert result["NodeNames"] == ["worker", "vk-a"]
    assert result["FailedAndUnresolvableNodes"] == {
        "vk-b": "vk-b: namespace ns holds no quota slices in b (its slices: a 2)"
    }
    assert federation.estimators["vk-b"].estimates == []
    placements["ns"] = {}
    result = await federation.filter("vk-a", "vk-b")
    assert result["NodeNames"] == []
    assert result["FailedAndUnresolvableNodes"]["vk-a"] == (
        "vk-a: namespace ns holds no quota slices in a "
        "(none placed): see its kubestrata.io/SlicesPlaced condition"
    )
    assert len(federation.estimators["vk-a"].estimates) == 1


async def test_a_slow_estimator_fails_only_its_own_node(federation: Federation) -> None:
    await federation.estimator("vk-a", fits(0.8))
    await federation.estimator("vk-slow", fits(0.9), delay=2.0)
    began = asyncio.get_running_loop().time()
    result = await federation.filter("vk-a", "vk-slow")
    assert asyncio.get_running_loop().time() - began < 1.5
    assert result["NodeNames"] == ["vk-a"]
    message = result["FailedAndUnresolvableNodes"]["vk-slow"]
    assert message.startswith("vk-slow: estimator unavailable: ")
    assert "DEADLINE_EXCEEDED" in message
    assert result["Error"] == ""
    assert sample(federation, "kubestrata_extender_estimator_errors_total") == 1


async def test_an_estimator_late_calls_in_a_row_is_skipped_for_a_while(
    federation: Federation,
) -> None:
    federation.extender.pool.skip_late_seconds = 0.5
    await federation.estimator("vk-a", fits(0.8))
    await federation.estimator("vk-slow", fits(0.9), delay=0.6)
    slow = federation.estimators["vk-slow"]
    for _ in range(LATE_IN_A_ROW_TO_SKIP):
        result = await federation.filter("vk-a", "vk-slow")
        assert "DEADLINE_EXCEEDED" in result["FailedAndUnresolvableNodes"]["vk-slow"]
    assert len(slow.estimates) == LATE_IN_A_ROW_TO_SKIP
    # Skipped: its node fails at once, saying why, and the other cluster is still used.
    result = await federation.filter("vk-a", "vk-slow")
    assert result["NodeNames"] == ["vk-a"]
    assert re.fullmatch(
        r"vk-slow: estimator unavailable: 127\.0\.0\.1:\d+: not asked for 0\.\d s more: "
        rf"its last {LATE_IN_A_ROW_TO_SKIP} calls had no answer within their deadline",
        result["FailedAndUnresolvableNodes"]["vk-slow"],
    )
    assert len(slow.estimates) == LATE_IN_A_ROW_TO_SKIP
    # Once the while is over it is asked again; answering in time, it is asked every time.
    await asyncio.sleep(0.5)
    slow.delay = 0.0
    for _ in range(LATE_IN_A_ROW_TO_SKIP + 1):
        result = await federation.filter("vk-a", "vk-slow")
        assert "vk-slow" in result["NodeNames"]
    assert len(slow.estimates) == 2 * LATE_IN_A_ROW_TO_SKIP + 1
    # An answer in time starts the count again: one late call is no reason to skip it.
    slow.delay = 0.6
    await federation.filter("vk-a", "vk-slow")
    slow.delay = 0.0
    result = await federation.filter("vk-a", "vk-slow")
    assert "vk-slow" in result["NodeNames"]


async def test_one_late_answer_counts_once_whoever_waited_on_the_same_call(
    federation: Federation,
) -> None:
    """The requests waiting on a call one late request ended fail with it; each counted
    as late, one slow answer with three pods asked at once (the descheduler asks for all
    its stuck pods together) had the cluster skipped."""
    await federation.estimator("vk-slow", fits(0.9), delay=1.0)
    pool = federation.extender.pool
    query = estimator_pb2.PodQuery(pod=orjson.dumps(POD))
    first = asyncio.create_task(pool.estimate(["vk-slow"], query, 0.2))
    await asyncio.sleep(0.05)
    others = [asyncio.create_task(pool.estimate(["vk-slow"], query, 2.0)) for _ in range(3)]
    answers = [(await task)["vk-slow"] for task in (first, *others)]
    assert all(isinstance(answer, EstimatorFailure) for answer in answers)
    result = await federation.filter("vk-slow")
    assert "not asked for" not in result["FailedAndUnresolvableNodes"].get("vk-slow", "")


async def test_ignore_mode_lets_a_node_with_a_failed_estimator_pass(
    federation: Federation,
) -> None:
    federation.extender.on_error = OnEstimatorError.IGNORE
    await federation.estimator("vk-a", NO_ROOM)
    await federation.estimator("vk-slow", NO_ROOM, delay=2.0)
    result = await federation.filter("vk-a", "vk-slow")
    assert result["NodeNames"] == ["vk-slow"]
    assert list(result["FailedAndUnresolvableNodes"]) == ["vk-a"]


async def test_unreachable_and_unannounced_estimators_fail_their_nodes(
    federation: Federation,
) -> None:
    await federation.estimator("vk-a", fits(0.5))
    federation.virtual_node("vk-none", None)
    federation.virtual_node("vk-gone", "127.0.0.1:1")
    result = await federation.filter("vk-a", "vk-none", "vk-gone")
    assert result["NodeNames"] == ["vk-a"]
    failed = result["FailedAndUnresolvableNodes"]
    assert failed["vk-none"] == (
        f"vk-none: estimator unavailable: the node has no "
        f"{keys.ESTIMATOR_ADDRESS_ANNOTATION} annotation"
    )
    assert failed["vk-gone"].startswith("vk-gone: estimator unavailable: 127.0.0.1:1: ")


async def test_a_node_a_kubelet_could_have_labelled_virtual_is_not_sent_the_token(
    federation: Federation,
) -> None:
    """NodeRestriction lets a kubelet set our virtual-node label on its own Node, not one
    under node-restriction.kubernetes.io/: its "estimator" would get the token, which
    binds any pod."""
    await federation.estimator("vk-a", fits(0.5))
    address = await federation.estimator("vk-b", fits(0.9))
    claimed = virtual_node_object("vk-b", address, started="2")
    del claimed["metadata"]["labels"][keys.PROVEN_VIRTUAL_NODE_LABEL]
    federation.nodes.apply({"type": "MODIFIED", "object": claimed})
    result = await federation.filter("vk-a", "vk-b")
    assert result["NodeNames"] == ["vk-a"]
    assert "cannot set" in result["FailedAndUnresolvableNodes"]["vk-b"]
    assert federation.estimators["vk-b"].estimates == []


async def test_a_certificate_from_another_ca_fails_the_node(
    federation: Federation, tmp_path: Path
) -> None:
    address = await federation.estimator("vk-a", fits(0.5))
    other_ca = pki.ca_path(pki.serving_pair(tmp_path / "other", "other", ("127.0.0.1",)))
    federation.extender.pool.ca = CaFile(other_ca)
    federation.virtual_node("vk-a", None, "MODIFIED")
    federation.virtual_node("vk-a", address, "MODIFIED")
    result = await federation.filter("vk-a")
    assert "vk-a" in result["FailedAndUnresolvableNodes"]
    assert federation.estimate_calls() == 0


async def test_an_estimator_ca_rewritten_is_trusted_by_every_channel(
    federation: Federation, tmp_path: Path
) -> None:
    """The in-cluster ca.crt rotated: the channels open, made with the old CA, reconnect
    checking against it; each is made again."""
    address = await federation.estimator("vk-a", fits(0.5))
    other_ca = pki.ca_path(pki.serving_pair(tmp_path / "other", "other", ("127.0.0.1",)))
    trusted = tmp_path / "trusted.crt"
    trusted.write_bytes(other_ca.read_bytes())
    federation.extender.pool.ca = CaFile(trusted)
    federation.virtual_node("vk-a", None, "MODIFIED")
    federation.virtual_node("vk-a", address, "MODIFIED")
    result = await federation.filter("vk-a")
    assert "vk-a" in result["FailedAndUnresolvableNodes"]
    trusted.write_bytes(pki.ca_path(serving_pair(tmp_path)).read_bytes())
    result = await federation.filter("vk-a")
    assert result["NodeNames"] == ["vk-a"], result
    # Written again as it was (a kubelet writes a projected ca.crt anew with each token):
    # the channels stay.
    channel = federation.extender.pool._estimators["vk-a"].channel
    again = tmp_path / "trusted.new"
    again.write_bytes(trusted.read_bytes())
    again.replace(trusted)
    await federation.filter("vk-a")
    assert federation.extender.pool._estimators["vk-a"].channel is channel
    # Rotated while room waits to be given back: it goes through the new channel.
    federation.extender.pool.release(["vk-a"], "u9")
    trusted.write_bytes(trusted.read_bytes() + other_ca.read_bytes())
    await federation.filter("vk-a", pod=named("q", "u2"))
    assert federation.extender.pool._estimators["vk-a"].channel is not channel
    asked = federation.estimators["vk-a"].estimates
    assert list(asked[-1].release_pod_uids) == ["u9"], "given back with the next call"


async def test_nodes_that_change_or_go_are_followed(federation: Federation) -> None:
    await federation.estimator("vk-a", NO_ROOM)
    await federation.estimator("vk-b", NO_ROOM)
    # vk-a's estimator moves, and the new one has room.
    moved = FakeEstimator("a", fits(0.5))
    address = await federation.serve(moved)
    federation.virtual_node("vk-a", address, "MODIFIED")
    assert (await federation.filter("vk-a"))["NodeNames"] == ["vk-a"]
    assert len(moved.estimates) == 1
    assert len(federation.estimators["vk-a"].estimates) == 0
    # An address pointing at another cluster's estimator is refused.
    federation.virtual_node("vk-b", address, "MODIFIED")
    failed = (await federation.filter("vk-b"))["FailedAndUnresolvableNodes"]
    assert failed == {
        "vk-b": f"vk-b: estimator unavailable: {address} answers for cluster 'a', not 'b'"
    }
    federation.virtual_node("vk-a", address, "DELETED")
    assert not federation.extender.pool.is_virtual("vk-a")
    # A name the cache has not shown is read, not taken for an ordinary node.
    failed = (await federation.filter("vk-a"))["FailedAndUnresolvableNodes"]
    assert failed == {"vk-a": "vk-a: Node not known yet (not found)"}
    assert len(moved.estimates) == 2  # vk-b's only


async def test_a_virtual_node_the_cache_has_not_shown_yet_is_read_and_asked(
    federation: Federation,
) -> None:
    """The scheduler's watch can be ahead of the extender's: taken for an ordinary node,
    a new virtual node would pass with no question asked and no room held."""
    await federation.estimator("vk-new", NO_ROOM)
    federation.virtual_node("vk-new", None, "DELETED")
    address = await federation.serve(federation.estimators["vk-new"])
    federation.upper_nodes["vk-new"] = virtual_node_object("vk-new", address)
    result = await federation.filter("worker", "vk-new")
    assert result["NodeNames"] == ["worker"]
    assert "Insufficient cpu" in result["FailedAndUnresolvableNodes"]["vk-new"]
    assert federation.extender.pool.is_virtual("vk-new"), "and known from then on"
    refused = (await federation.filter("worker", "gone"))["FailedAndUnresolvableNodes"]
    assert refused == {"gone": "gone: Node not known yet (not found)"}


async def test_a_rotated_token_is_sent(federation: Federation) -> None:
    await federation.estimator("vk-a", fits(0.5))
    await federation.filter("vk-a")
    opened_with_the_old_token = federation.extender.pool._estimators["vk-a"].stream
    assert opened_with_the_old_token is not None
    replacement = federation.tmp_path / "token.new"
    replacement.write_text("rotated")
    os.replace(replacement, federation.tmp_path / "token")
    await federation.filter("vk-a")
    assert federation.estimators["vk-a"].authorization == ["Bearer sesame", "Bearer rotated"]
    # The call opened with the old token is closed, not left open beside the new one.
    await eventually(lambda: opened_with_the_old_token.ended)
    assert federation.estimators["vk-a"].streams == 2


@pytest.mark.parametrize(
    ("verb", "raw", "message"),
    [
        ("filter", b"{nope", "not JSON"),
        ("filter", b'{"NodeNames": ["a"]}', "Pod must be a Pod object"),
        ("prioritize", b'{"Pod": {"metadata": {"uid": "u"}}, "NodeNames": 3}', "NodeNames"),
        ("bind", b'{"PodName": "p"}', "PodNamespace"),
    ],
)
async def test_bad_requests_are_answered_400(
    federation: Federation, verb: str, raw: bytes, message: str
) -> None:
    response = await federation.client.post(f"/{verb}", data=raw)
    assert response.status == 400
    assert message in (await response.json())["Error"]


async def test_prioritize_scores_from_the_filters_answers(federation: Federation) -> None:
    await federation.estimator("vk-a", fits(0.9))
    await federation.estimator("vk-b", fits(0.4))
    await federation.filter("worker", "vk-a", "vk-b")
    scores = await federation.post(
        "prioritize", {"Pod": POD, "NodeNames": ["worker", "vk-a", "vk-b"]}
    )
    # The ordinary node as the cluster ranked first: the scheduler's own scores decide.
    assert scores == [
        {"Host": "worker", "Score": 9},
        {"Host": "vk-a", "Score": 9},
        {"Host": "vk-b", "Score": 4},
    ]
    assert federation.estimate_calls() == 2


async def test_prioritize_without_a_filter_asks_without_reserving(federation: Federation) -> None:
    await federation.estimator("vk-a", fits(0.7))
    scores = await federation.post("prioritize", {"Pod": POD, "NodeNames": ["vk-a"]})
    assert scores == [{"Host": "vk-a", "Score": 7}]
    (request,) = federation.estimators["vk-a"].estimates
    assert not request.pods[0].reserve


def binding(node: str) -> dict[str, str]:
    return {"PodName": "p", "PodNamespace": "ns", "PodUID": "u1", "Node": node}


async def test_filter_keeps_room_only_where_the_pod_is_likeliest_to_go(
    federation: Federation,
) -> None:
    await federation.estimator("vk-a", fits(0.9))
    for name in ("vk-b", "vk-c"):
        await federation.estimator(name, fits(0.5))
    await federation.estimator("vk-full", NO_ROOM)
    result = await federation.filter("worker", "vk-a", "vk-b", "vk-c", "vk-full")
    # One virtual node left: the scheduler binds it without scoring, and cannot send the
    # pod where no room is kept for it.
    assert result["NodeNames"] == ["worker", "vk-a"]
    assert result["FailedAndUnresolvableNodes"] == {
        "vk-b": "vk-b: the pod fits, but vk-a ranks first",
        "vk-c": "vk-c: the pod fits, but vk-a ranks first",
        "vk-full": "vk-full: 0/3 nodes are available: 3 Insufficient cpu",
    }
    estimators = federation.estimators
    # The others' room goes back at once, not at the binding: the next pods of a burst
    # must find it.
    await eventually(lambda: bool(estimators["vk-b"].releases and estimators["vk-c"].releases))
    assert estimators["vk-b"].releases == estimators["vk-c"].releases == [["u1"]]
    assert estimators["vk-a"].releases == estimators["vk-full"].releases == []
    assert estimators["vk-b"].authorization[-1] == "Bearer sesame"
    assert await federation.post("bind", binding("vk-a")) == {"Error": ""}
    assert federation.bindings == [BindingArgs("p", "ns", "u1", "vk-a")]
    assert sample(federation, "kubestrata_extender_bind_seconds_count") == 1
    await asyncio.sleep(0.1)
    assert estimators["vk-a"].releases == [], "the chosen cluster's room becomes the pod's"


def named(name: str, uid: str) -> dict[str, Any]:
    return {**POD, "metadata": {"name": name, "namespace": "ns", "uid": uid}}


async def surplus_on_vk_b(federation: Federation, release_delay: float) -> None:
    """Pod u1 decided between vk-a (ranked first) and vk-b, whose room goes back."""
    federation.extender.pool.release_delay = release_delay
    await federation.estimator("vk-a", fits(0.9))
    await federation.estimator("vk-b", fits(0.5))
    await federation.filter("vk-a", "vk-b")


async def test_releases_ride_on_the_next_call(federation: Federation) -> None:
    await surplus_on_vk_b(federation, release_delay=3600.0)
    await federation.filter("vk-a", "vk-b", pod=named("q", "u2"))
    estimators = federation.estimators
    assert [list(r.release_pod_uids) for r in estimators["vk-b"].estimates] == [[], ["u1"]]
    assert [list(r.release_pod_uids) for r in estimators["vk-a"].estimates] == [[], []]
    assert estimators["vk-b"].releases == [], "no call of their own"
    # u2's surplus waits for the next call.
    assert [list(r.release_pod_uids) for r in (await next_call(federation, "vk-b"))] == [["u2"]]


async def next_call(federation: Federation, node: str) -> list[EstimateRequest]:
    before = len(federation.estimators[node].estimates)
    await federation.filter(node, pod=named("r", "u3"))
    return federation.estimators[node].estimates[before:]


async def test_releases_with_no_call_to_ride_on_go_alone(federation: Federation) -> None:
    await surplus_on_vk_b(federation, release_delay=0.05)
    await federation.filter("vk-a", "vk-b", pod=named("q", "u2"))
    estimators = federation.estimators
    await eventually(lambda: bool(estimators["vk-b"].releases))
    # u1 rode on the second call if it came in time; u2 had none to ride on.
    carried = [uid for r in estimators["vk-b"].estimates for uid in r.release_pod_uids]
    alone = [uid for call in estimators["vk-b"].releases for uid in call]
    assert sorted(carried + alone) == ["u1", "u2"]
    assert estimators["vk-b"].releases[-1][-1] == "u2"


async def test_a_release_that_hangs_fails_its_node_only_within_the_deadline(
    federation: Federation,
) -> None:
    """The next call to an estimator waits for a Release on its way, so that the room is
    given back before the same pod could be judged again; an estimator that hangs must
    not hold every later decision for the Release's own timeout."""
    await surplus_on_vk_b(federation, release_delay=0.01)
    estimators = federation.estimators
    estimators["vk-b"].release_delay = 3.0
    await eventually(lambda: bool(estimators["vk-b"].releases))
    result = await federation.filter("vk-a", "vk-b", pod=named("q", "u2"))
    assert estimators["vk-b"].releases_ended == 0, "answered while the Release hung"
    assert result["NodeNames"] == ["vk-a"]
    assert "not confirmed yet" in result["FailedAndUnresolvableNodes"]["vk-b"]


async def test_releases_of_a_failed_call_are_sent_again(federation: Federation) -> None:
    await surplus_on_vk_b(federation, release_delay=3600.0)
    federation.estimators["vk-b"].delay = 1.0
    result = await federation.filter("vk-a", "vk-b", pod=named("q", "u2"))
    assert "vk-b" in result["FailedAndUnresolvableNodes"]
    federation.estimators["vk-b"].delay = 0.0
    (sent,) = await next_call(federation, "vk-b")
    # u2 too: the estimator may have held room for it before the deadline.
    assert list(sent.release_pod_uids) == ["u1", "u2"]
    # The late answer ended the call it was due on: answers behind it would be as late.
    assert federation.estimators["vk-b"].streams == 2


async def test_releases_of_a_failed_release_call_ride_on_the_next_call(
    federation: Federation,
) -> None:
    """Dropped, the room stayed held until it lapsed, keeping pods off the cluster."""
    estimators = federation.estimators
    await federation.estimator("vk-a", fits(0.9))
    await federation.estimator("vk-b", fits(0.5))
    estimators["vk-b"].releases_refused = 1
    federation.extender.pool.release_delay = 0.01
    await federation.filter("vk-a", "vk-b")
    await eventually(lambda: estimators["vk-b"].releases == [["u1"]])
    await asyncio.sleep(0.1)
    assert estimators["vk-b"].releases == [["u1"]], "not called again at once"
    (sent,) = await next_call(federation, "vk-b")
    assert list(sent.release_pod_uids) == ["u1"]


async def test_a_stream_broken_after_the_request_may_hold_room_for_the_pod(
    federation: Federation,
) -> None:
    """UNAVAILABLE says nothing of a request already sent: its room was never given back."""
    await federation.estimator("vk-a", fits(0.9))
    await federation.estimator("vk-b", fits(0.5))
    federation.estimators["vk-b"].breaks_after_reading = 0
    result = await federation.filter("vk-a", "vk-b")
    assert "UNAVAILABLE" in result["FailedAndUnresolvableNodes"]["vk-b"]
    (sent,) = await next_call(federation, "vk-b")
    assert list(sent.release_pod_uids) == ["u1"]


async def test_bind_elsewhere_releases_the_room_kept_for_the_pod(federation: Federation) -> None:
    await federation.estimator("vk-a", fits(0.9))
    await federation.estimator("vk-b", fits(0.5))
    await federation.filter("vk-a", "vk-b")
    assert await federation.post("bind", binding("vk-b")) == {"Error": ""}
    estimators = federation.estimators
    await eventually(lambda: bool(estimators["vk-a"].releases))
    assert estimators["vk-a"].releases == [["u1"]]
    # The pod is forgotten: a second binding releases nothing.
    assert await federation.post("bind", binding("vk-b")) == {"Error": ""}
    await asyncio.sleep(0.1)
    assert estimators["vk-a"].releases == [["u1"]]


async def test_an_estimator_restarted_before_the_node_cache_heard_is_asked_again(
    federation: Federation,
) -> None:
    # The Node cache still names an estimator that is gone (nothing listens there).
    gone = FakeEstimator("a", fits(0.9))
    old_address = await federation.serve(gone)
    await federation.servers.pop().stop(None)
    federation.virtual_node("vk-a", old_address)
    # The apiserver already has the restarted one, which the scheduler's retry followed.
    restarted = FakeEstimator("a", fits(0.9))
    federation.estimators["vk-a"] = restarted
    new_address = await federation.serve(restarted)
    federation.upper_nodes["vk-a"] = virtual_node_object("vk-a", new_address, started="2")
    result = await federation.filter("vk-a")
    assert result["NodeNames"] == ["vk-a"], result
    assert len(restarted.estimates) == 1
    # A failure with nothing newer above stays a failure.
    await federation.servers.pop().stop(None)
    result = await federation.filter("vk-a")
    assert result["NodeNames"] == []
    failed = {**result["FailedNodes"], **result["FailedAndUnresolvableNodes"]}
    # gRPC says UNAVAILABLE or, when the server goes with the stream open, INTERNAL.
    assert failed["vk-a"].startswith("vk-a: estimator unavailable: "), result
    # Read again and found unchanged, its Node is not read at the next decisions (each
    # pod's filter waited on that read while the virtual node was down), nor for a pod
    # tried again within a second of that read.
    reads = len(federation.node_reads)
    await federation.filter("vk-a", pod=named("q", "u2"))
    await federation.filter("vk-a", pod=named("q", "u2"))
    assert len(federation.node_reads) == reads
    # Restarted: the scheduler, told by the Node's change, tries the pods it turned away
    # again; a second after the last read, the Node is read for one of them.
    again = FakeEstimator("a", fits(0.9))
    federation.estimators["vk-a"] = again
    federation.upper_nodes["vk-a"] = virtual_node_object(
        "vk-a", await federation.serve(again), started="3"
    )
    clock = federation.extender.clock
    federation.extender.clock = lambda: clock() + READ_AGAIN_FOR_RETRY_INTERVAL
    result = await federation.filter("vk-a", pod=named("q", "u2"))
    assert result["NodeNames"] == ["vk-a"], result
    assert len(again.estimates) == 1


async def filtered_while_restarting(
    federation: Federation,
) -> tuple[dict[str, Any], FakeEstimator]:
    """A filter of vk-a during whose call vk-a's estimator restarts and the watch tells
    of it: the filter's result, and the restarted estimator."""
    await federation.estimator("vk-a", fits(0.9), delay=0.2)
    filtering = asyncio.create_task(federation.filter("vk-a"))
    await asyncio.sleep(0.1)
    restarted = FakeEstimator("a", fits(0.9))
    address = await federation.serve(restarted)
    federation.upper_nodes["vk-a"] = virtual_node_object("vk-a", address, started="2")
    federation.nodes.apply({"type": "MODIFIED", "object": federation.upper_nodes["vk-a"]})
    return await asyncio.wait_for(filtering, 5), restarted


async def test_an_estimator_restarted_while_its_node_is_being_asked_is_asked_again(
    federation: Federation,
) -> None:
    """The watch tells of the restart during the call, closing the old channel under
    it: the new estimator, already in the pool when the Node is read, is asked."""
    result, restarted = await filtered_while_restarting(federation)
    assert result["NodeNames"] == ["vk-a"], result
    assert len(restarted.estimates) == 1


async def test_a_restarted_estimator_is_not_asked_again_past_the_filters_budget(
    federation: Federation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler gives the whole call 5 s, past which it fails the pod's attempt on
    every node: no second round that would not end within the filter's budget."""
    monkeypatch.setattr(extender_server, "FILTER_BUDGET", 0.1)
    result, restarted = await filtered_while_restarting(federation)
    assert result["NodeNames"] == [], result
    assert restarted.estimates == []


async def test_a_pod_the_scheduler_put_on_an_ordinary_node_gives_its_room_back(
    federation: Federation,
) -> None:
    await federation.estimator("vk-a", fits(0.9))
    result = await federation.filter("worker", "vk-a")
    assert result["NodeNames"] == ["worker", "vk-a"]
    federation.scheduled("worker")
    estimators = federation.estimators
    await eventually(lambda: bool(estimators["vk-a"].releases))
    assert estimators["vk-a"].releases == [["u1"]]
    assert federation.lookups == [("ns", "p")]
    assert sample(federation, "kubestrata_extender_room_given_back_total") == 1
    assert len(federation.extender.decisions) == 0


async def test_a_pod_bound_where_its_room_is_keeps_it(federation: Federation) -> None:
    await federation.estimator("vk-a", fits(0.9))
    await federation.filter("worker", "vk-a")
    federation.scheduled("vk-a")
    await eventually(lambda: bool(federation.lookups))
    await asyncio.sleep(0.4)  # past the release delay
    assert federation.estimators["vk-a"].releases == []
    assert len(federation.extender.decisions) == 0, "the pod is forgotten once bound"


async def test_a_pod_deleted_while_waiting_gives_its_room_back(federation: Federation) -> None:
    await federation.estimator("vk-a", fits(0.9))
    await federation.filter("vk-a")
    federation.scheduled(None)
    await eventually(lambda: bool(federation.estimators["vk-a"].releases))
    assert federation.estimators["vk-a"].releases == [["u1"]]


async def test_a_pod_deleted_while_its_filter_waits_for_the_estimators_gives_its_room_back(
    federation: Federation,
) -> None:
    await federation.estimator("vk-a", fits(0.9), delay=0.15)
    filtering = asyncio.create_task(federation.filter("vk-a"))
    await eventually(lambda: bool(federation.estimators["vk-a"].estimates))
    federation.scheduled(None)
    result = await filtering
    assert result["NodeNames"] == ["vk-a"]
    await eventually(lambda: bool(federation.estimators["vk-a"].releases))
    assert federation.estimators["vk-a"].releases == [["u1"]]
    assert federation.lookups == [("ns", "p")]
    assert len(federation.extender.decisions) == 0


async def test_a_pod_deleted_before_its_filter_comes_gives_back_the_room_it_reserves(
    federation: Federation,
) -> None:
    # The scheduler's cycle goes on with the pod it took from its queue.
    await federation.estimator("vk-a", fits(0.9))
    federation.scheduled(None)
    result = await federation.filter("vk-a")
    assert result["NodeNames"] == ["vk-a"]
    await eventually(lambda: bool(federation.estimators["vk-a"].releases))
    assert federation.estimators["vk-a"].releases == [["u1"]]
    assert len(federation.extender.decisions) == 0


async def test_room_waiting_to_be_given_back_goes_when_the_pool_closes(
    federation: Federation,
) -> None:
    await federation.estimator("vk-a", fits(0.9))
    federation.extender.pool.release(["vk-a"], "u9")
    await federation.extender.pool.close()
    assert federation.estimators["vk-a"].releases == [["u9"]]


async def test_room_is_kept_when_where_the_pod_went_cannot_be_read(
    federation: Federation,
) -> None:
    await federation.estimator("vk-a", fits(0.9))
    await federation.filter("vk-a")
    federation.lookup_error = ApiError(503, {"message": "unavailable"}, "GET", "/p")
    federation.scheduled("worker")
    await eventually(lambda: bool(federation.lookups))
    await asyncio.sleep(0.4)
    assert federation.estimators["vk-a"].releases == [], "it lapses on its own"


async def test_a_pod_that_held_no_room_is_not_read(federation: Federation) -> None:
    await federation.estimator("vk-a", NO_ROOM)
    await federation.filter("worker", "vk-a")
    await federation.filter("worker")
    federation.scheduled("worker")
    await asyncio.sleep(0.1)
    assert federation.lookups == []
    assert len(federation.extender.decisions) == 0


async def test_bind_to_a_cluster_filled_since_filter_is_refused(federation: Federation) -> None:
    await federation.estimator("vk-a", fits(0.9))
    await federation.estimator("vk-b", fits(0.5))
    await federation.filter("vk-a", "vk-b")
    federation.estimators["vk-b"].answer = NO_ROOM
    answer = await federation.post("bind", binding("vk-b"))
    assert answer["Error"] == (
        "no room left for pod ns/p on vk-b: 0/3 nodes are available: 3 Insufficient cpu"
    )
    assert federation.bindings == [], "bound without room it could take another pod's"
    asked = federation.estimators["vk-b"].estimates[-1].pods[0]
    assert asked.reserve and asked.pod == orjson.dumps(POD)
    estimators = federation.estimators
    await eventually(lambda: bool(estimators["vk-a"].releases))
    assert estimators["vk-a"].releases == [["u1"]]


async def test_a_failed_binding_is_reported_and_releases_everything(
    federation: Federation,
) -> None:
    await federation.estimator("vk-a", fits(0.5))
    await federation.estimator("vk-b", fits(0.5))
    await federation.filter("vk-a", "vk-b")
    federation.bind_error = ApiError(409, {"message": "pod p is already assigned"}, "POST", "/b")
    answer = await federation.post("bind", binding("vk-a"))
    assert answer["Error"].startswith("binding pod ns/p to vk-a: ")
    assert "already assigned" in answer["Error"]
    estimators = federation.estimators
    await eventually(lambda: bool(estimators["vk-a"].releases and estimators["vk-b"].releases))
    assert sample(federation, "kubestrata_extender_bind_errors_total") == 1


async def test_a_bind_whose_hold_and_binding_outlast_the_budget_fails_in_time(
    federation: Federation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hold of room on a cluster filter kept none on counts toward the bind's
    budget: the binding's own timeout after it ran past the scheduler's 5 s."""
    monkeypatch.setattr(extender_server, "BIND_BUDGET", 0.5)
    await federation.estimator("vk-a", fits(0.9))
    await federation.estimator("vk-b", fits(0.5), delay=0.2)
    await federation.filter("vk-a", "vk-b")
    federation.bind_seconds = 0.4
    answer = await federation.post("bind", binding("vk-b"))
    assert answer["Error"].startswith("binding pod ns/p to vk-b: ")
    assert federation.bindings == []
    assert federation.estimators["vk-b"].estimates[-1].pods[0].reserve, "held at bind"


async def test_pods_for_ordinary_nodes_are_bound_too(federation: Federation) -> None:
    assert await federation.post("bind", binding("worker")) == {"Error": ""}
    assert federation.bindings == [BindingArgs("p", "ns", "u1", "worker")]


async def test_health_and_metrics(federation: Federation) -> None:
    await federation.estimator("vk-a", fits(0.5))
    await federation.filter("vk-a")
    await federation.filter("worker")
    health = await federation.client.get("/healthz")
    assert health.status == 200 and await health.text() == "ok"
    response = await federation.client.get("/metrics")
    assert response.status == 200
    assert response.content_type == "text/plain"
    text = await response.text()
    assert "kubestrata_extender_filter_seconds_count 2.0\n" in text
    assert 'kubestrata_extender_decisions_total{verb="filter"} 2.0\n' in text
    assert "kubestrata_extender_estimator_errors_total 0.0\n" in text


async def test_a_restarted_estimator_gets_a_fresh_channel(tmp_path: Path) -> None:
    pool = EstimatorPool(CaFile(pki.ca_path(serving_pair(tmp_path))))

    def put(started: str) -> object:
        annotations = {
            keys.ESTIMATOR_ADDRESS_ANNOTATION: "127.0.0.1:1",
            keys.ESTIMATOR_STARTED_ANNOTATION: started,
        }
        labels = {
            keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
            keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
        }
        pool.put({"metadata": {"name": "vk-a", "labels": labels, "annotations": annotations}})
        return pool._estimators["vk-a"].channel

    try:
        first = put("t1")
        assert put("t1") is first, "an unchanged Node keeps its channel"
        # A channel that failed waits out gRPC's reconnect backoff; a new one does not.
        assert put("t2") is not first
    finally:
        await pool.close()


async def test_a_node_read_while_the_watch_told_of_a_newer_one_is_not_taken(
    tmp_path: Path,
) -> None:
    """A read begun before the watch's news of a restarted estimator, answered after it,
    put the older Node back: the new estimator's channel closed, every pod failed there."""
    pool = EstimatorPool(CaFile(pki.ca_path(serving_pair(tmp_path))))
    informer = Informer(client=None, resource=NODES)  # type: ignore[arg-type]
    informer.add_handler(pool.handler())
    try:
        read_began = pool.watched("vk-a")
        informer.apply(
            {"type": "ADDED", "object": virtual_node_object("vk-a", "127.0.0.1:2", "t2")}
        )
        pool.put_read(virtual_node_object("vk-a", "127.0.0.1:1", "t1"), read_began)
        assert pool.estimator_of("vk-a") == ("127.0.0.1:2", "t2")
        # A read the watch said nothing during is taken.
        pool.put_read(virtual_node_object("vk-a", "127.0.0.1:3", "t3"), pool.watched("vk-a"))
        assert pool.estimator_of("vk-a") == ("127.0.0.1:3", "t3")
    finally:
        await pool.close()


async def test_the_pool_asks_for_plans_fits_and_holds_and_reports_failures(
    federation: Federation,
) -> None:
    pool = federation.extender.pool
    address = await federation.estimator("vk-a", NO_ROOM)
    plans = await pool.defragment(
        "vk-a", estimator_pb2.DefragmentRequest(movable_pod_uids=["u1"]), 2.0
    )
    assert isinstance(plans, estimator_pb2.DefragmentResponse)
    assert [list(p.evicted_pod_uids) for p in plans.plans] == [["u1"]]
    fitted = await pool.fit_in_turn("vk-a", estimator_pb2.FitInTurnRequest(pods=[b"{}"] * 2), 2.0)
    assert isinstance(fitted, estimator_pb2.FitInTurnResponse)
    assert list(fitted.nodes) == ["n1", ""]
    assert await pool.hold("vk-a", estimator_pb2.HoldRequest(node="n1", seconds=5), 2.0) is None
    refused = await pool.hold("vk-a", estimator_pb2.HoldRequest(seconds=5), 2.0)
    assert isinstance(refused, EstimatorFailure)
    assert refused.message == f"{address}: INVALID_ARGUMENT: no lower node ''"
    # Another cluster's estimator behind vk-b's address is not believed.
    federation.virtual_node("vk-b", address)
    wrong = await pool.defragment("vk-b", estimator_pb2.DefragmentRequest(), 2.0)
    assert (
        isinstance(wrong, EstimatorFailure) and "answers for cluster 'a', not 'b'" in wrong.message
    )
    unknown = await pool.fit_in_turn("vk-x", estimator_pb2.FitInTurnRequest(), 2.0)
    assert isinstance(unknown, EstimatorFailure)


async def test_the_pool_asks_for_slice_room_and_promises(federation: Federation) -> None:
    pool = federation.extender.pool
    address = await federation.estimator("vk-a", NO_ROOM)
    room = await pool.slice_room("vk-a", "team", 2.0)
    assert isinstance(room, estimator_pb2.SliceRoomResponse)
    assert (room.held, room.nodes[0].cpu_millis) == (4, 8000)
    made = await pool.promise_slices("vk-a", estimator_pb2.PromiseSlicesRequest(slices=4), 2.0)
    assert isinstance(made, estimator_pb2.PromiseSlicesResponse) and not made.refused
    refused = await pool.promise_slices("vk-a", estimator_pb2.PromiseSlicesRequest(slices=5), 2.0)
    assert isinstance(refused, estimator_pb2.PromiseSlicesResponse)
    assert refused.refused == "no room"
    held = await pool.sliced_namespaces("vk-a", 2.0)
    assert isinstance(held, estimator_pb2.SlicedNamespacesResponse)
    assert list(held.namespaces) == ["gone", "team"]
    assert federation.estimators["vk-a"].authorization == ["Bearer sesame"] * 4
    federation.virtual_node("vk-b", address)
    wrong = await pool.slice_room("vk-b", "team", 2.0)
    assert isinstance(wrong, EstimatorFailure) and "not 'b'" in wrong.message


async def test_a_call_cut_by_its_estimator_moving_is_a_failure_and_its_caller_goes_on(
    federation: Federation,
) -> None:
    pool = federation.extender.pool
    await federation.estimator("vk-slow", NO_ROOM, delay=2.0)
    asking = asyncio.create_task(pool.slice_room("vk-slow", "team", 5.0))
    await asyncio.sleep(0.3)
    # Its virtual node restarted elsewhere: the old channel closes with the call on it.
    federation.virtual_node("vk-slow", await federation.serve(FakeEstimator("slow", NO_ROOM)))
    answer = await asyncio.wait_for(asking, 5)
    assert isinstance(answer, EstimatorFailure)
    assert "CANCELLED: its channel closed during the call" in answer.message
    assert answer.maybe_reserved


async def test_a_channel_closed_before_its_call_is_made_is_that_estimators_failure(
    federation: Federation,
) -> None:
    """A decision that waited (for a Release in flight) while the estimator moved holds
    the old estimator, whose channel is closed: grpc refuses the call with UsageError,
    which is that one node's failure, not the whole decision's (an HTTP 500)."""
    await federation.estimator("vk-a", NO_ROOM)
    pool = federation.extender.pool
    await pool._estimators["vk-a"].channel.close()
    query = estimator_pb2.PodQuery(pod=orjson.dumps(named("p", "p")))
    answer = (await pool.estimate(["vk-a"], query, 2.0))["vk-a"]
    assert isinstance(answer, EstimatorFailure)
    assert "CANCELLED: its channel closed before the call" in answer.message
    room = await pool.slice_room("vk-a", "team", 2.0)
    assert isinstance(room, EstimatorFailure) and "before the call" in room.message


async def test_decisions_ask_each_estimator_over_one_long_lived_call(
    federation: Federation,
) -> None:
    await federation.estimator("vk-a", fits(0.8))
    for uid in ("u1", "u2", "u3"):
        await federation.filter("vk-a", pod=named(uid, uid))
    estimator = federation.estimators["vk-a"]
    assert len(estimator.estimates) == 3
    assert (estimator.streams, estimator.unary_estimates) == (1, 0)


class Echo(FakeEstimator):
    """Answers each pod with its own name, some slower than others."""

    async def _estimate(
        self, request: EstimateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> EstimateResponse:
        self.estimates.append(request)
        name = orjson.loads(request.pods[0].pod)["metadata"]["name"]
        await asyncio.sleep(self.delay if len(self.estimates) % 2 else 0.0)
        return EstimateResponse(cluster_id=self.cluster_id, estimates=[PodEstimate(message=name)])


async def estimated(pool: EstimatorPool, name: str, timeout: float = 5.0) -> str:
    query = estimator_pb2.PodQuery(pod=orjson.dumps(named(name, name)))
    answer = (await pool.estimate(["vk-a"], query, timeout))["vk-a"]
    assert isinstance(answer, PodEstimate), answer
    return answer.message


async def test_each_asker_gets_its_own_answer_on_a_shared_call(federation: Federation) -> None:
    echo = Echo("a", NO_ROOM, delay=0.01)
    federation.virtual_node("vk-a", await federation.serve(echo))
    pool = federation.extender.pool
    names = [f"p{index}" for index in range(20)]
    assert await asyncio.gather(*(estimated(pool, name) for name in names)) == names
    # An asker that goes away before its answer leaves no answer to the next one.
    echo.delay = 0.2
    gone = asyncio.create_task(estimated(pool, "gone"))
    await eventually(lambda: len(echo.estimates) == 21)
    gone.cancel()
    echo.delay = 0.0
    assert await estimated(pool, "next") == "next"
    assert echo.streams == 1


def older_estimator(servicer: FakeEstimator) -> grpc.GenericRpcHandler:
    """What a virtual node of the version before EstimateStream serves."""
    estimate = grpc.unary_unary_rpc_method_handler(
        servicer.Estimate,
        request_deserializer=EstimateRequest.FromString,
        response_serializer=EstimateResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(
        "kubestrata.estimator.v1.Estimator", {"Estimate": estimate}
    )


async def test_an_estimator_without_the_stream_is_asked_one_call_at_a_time(
    federation: Federation,
) -> None:
    older = FakeEstimator("a", fits(0.8))
    federation.virtual_node("vk-a", await federation.serve(older, older=True))
    for uid in ("u1", "u2"):
        assert (await federation.filter("vk-a", pod=named(uid, uid)))["NodeNames"] == ["vk-a"]
    assert (older.streams, older.unary_estimates) == (0, 2)


async def test_a_call_the_estimator_ends_is_opened_again(federation: Federation) -> None:
    estimator = FakeEstimator("a", fits(0.8))
    estimator.answers_per_call = 1
    federation.virtual_node("vk-a", await federation.serve(estimator))
    pool = federation.extender.pool

    async def answered_then_ended(uid: str) -> None:
        assert (await federation.filter("vk-a", pod=named(uid, uid)))["NodeNames"] == ["vk-a"]
        stream = pool._estimators["vk-a"].stream
        assert stream is not None
        await eventually(lambda: stream.ended)

    await answered_then_ended("u1")
    await answered_then_ended("u2")
    assert estimator.streams == 2
    # The estimator's server going away fails its node (a virtual node restarting).
    for server in federation.servers:
        await server.stop(None)
    failed = (await federation.filter("vk-a"))["FailedAndUnresolvableNodes"]
    assert "UNAVAILABLE" in failed["vk-a"]


# -- who may call -------------------------------------------------------------------------


def test_a_caller_is_let_in_by_its_certificate() -> None:
    scheduler = {"subject": ((("commonName", "system:kube-scheduler"),),)}
    anyone = Callers()
    assert anyone.refusal(scheduler) is None
    named = Callers(frozenset({"system:kube-scheduler"}))
    assert named.refusal(scheduler) is None
    other = {"subject": ((("organizationName", "system:masters"),), (("commonName", "me"),))}
    assert named.refusal(other) == "client certificate of 'me': not a --client-name"
    assert "no common name" in str(named.refusal({"subject": ()}))
    # getpeercert(): None without a certificate, {} for one not verified.
    assert "no client certificate" in str(anyone.refusal(None))
    assert "no client certificate" in str(anyone.refusal({}))


async def extender_over_https(
    tmp_path: Path, caller: pki.KeyPair | None, callers: Callers
) -> tuple[TestClient[Any, Any], list[BindingArgs]]:
    """The extender's app over HTTPS for ``caller``, with a binder that records."""
    bindings: list[BindingArgs] = []

    async def bind(args: BindingArgs) -> None:
        bindings.append(args)

    async def lookup(_resource: Resource, _namespace: str | None, _name: str) -> None:
        return None

    pool = EstimatorPool(CaFile(None), TokenFile(tmp_path / "token"))
    extender = Extender(pool, bind, lookup)
    return await https_client(make_app(extender, callers), tmp_path, caller), bindings


BINDING = {"PodName": "p", "PodNamespace": "ns", "PodUID": "u1", "Node": "worker-1"}
FILTER = {"Pod": POD, "NodeNames": ["worker-1"]}


async def test_a_caller_without_a_client_certificate_binds_nothing(tmp_path: Path) -> None:
    client, bindings = await extender_over_https(tmp_path, None, Callers())
    try:
        for verb, body in (("bind", BINDING), ("filter", FILTER), ("prioritize", FILTER)):
            response = await client.post(f"/{verb}", data=orjson.dumps(body))
            assert response.status == 403
            assert "no client certificate" in (await response.json())["Error"]
        assert bindings == []
        # Probes and scrapes show no certificate.
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/metrics")).status == 200
    finally:
        await client.close()


async def test_the_scheduler_s_certificate_binds(tmp_path: Path) -> None:
    callers = Callers(frozenset({"system:kube-scheduler"}))
    client, bindings = await extender_over_https(tmp_path, scheduler_pair(tmp_path), callers)
    try:
        response = await client.post("/bind", data=orjson.dumps(BINDING))
        assert response.status == 200
        assert await response.json() == {"Error": ""}
        assert [(b.pod_name, b.node) for b in bindings] == [("p", "worker-1")]
    finally:
        await client.close()


async def test_another_name_of_the_same_ca_is_refused_when_names_are_given(
    tmp_path: Path,
) -> None:
    callers = Callers(frozenset({"system:kube-scheduler"}))
    jane = scheduler_pair(tmp_path, "jane")
    client, bindings = await extender_over_https(tmp_path, jane, callers)
    try:
        response = await client.post("/bind", data=orjson.dumps(BINDING))
        assert response.status == 403
        assert "'jane'" in (await response.json())["Error"]
        assert bindings == []
    finally:
        await client.close()


async def test_a_certificate_of_another_ca_or_for_serving_only_gets_no_connection(
    tmp_path: Path,
) -> None:
    stranger = pki.issue(
        pki.create_ca(tmp_path, "stranger"),
        tmp_path / "stranger",
        "system:kube-scheduler",
        client=True,
    )
    serving_only = pki.issue(
        callers_ca(tmp_path), tmp_path / "server", "system:kube-scheduler", server_names=("x",)
    )
    for caller in (stranger, serving_only):
        client, bindings = await extender_over_https(tmp_path, caller, Callers())
        try:
            with pytest.raises(ClientConnectionError):
                await client.post("/bind", data=orjson.dumps(BINDING))
            assert bindings == []
        finally:
            await client.close()
