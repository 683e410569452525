"""EstimateStream served as a virtual node serves it (own thread, TLS): answers in the
order asked, the caller checked at every request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from kubekit import estimatorapi
from kubekit.estimatorapi import estimator_pb2
from kubekit.estimatorapi.estimator_pb2_grpc import EstimatorStub
from tests.unit.test_estimator import Admitting, Cluster, landed, served, upper_pod
from virtual_node.kubeletapi.auth import AuthError, Authorizer, User

METADATA = (("authorization", "Bearer extender"),)


def query(name: str, cpu: str) -> estimator_pb2.EstimateRequest:
    pod = estimator_pb2.PodQuery(pod=orjson.dumps(upper_pod(name, cpu)), reserve=True)
    return estimator_pb2.EstimateRequest(pods=[pod])


async def answer(
    call: grpc.aio.StreamStreamCall[Any, Any], request: estimator_pb2.EstimateRequest
) -> estimator_pb2.EstimateResponse:
    await call.write(request)
    response = await call.read()
    assert isinstance(response, estimator_pb2.EstimateResponse), response
    return response


@asynccontextmanager
async def stream_to(
    tmp_path: Path, authorizer: Authorizer
) -> AsyncIterator[grpc.aio.StreamStreamCall[Any, Any]]:
    cluster = Cluster()
    landed(cluster, "a", "1", "big")
    async with (
        served(tmp_path, cluster, authorizer) as (address, ca),
        grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel,
    ):
        yield EstimatorStub(channel).EstimateStream(metadata=METADATA, timeout=20)


async def test_requests_on_one_call_are_answered_in_turn(tmp_path: Path) -> None:
    async with stream_to(tmp_path, Admitting()) as call:
        reserved = []
        # big has 3 cpu left, small 2: each answer counts the room the ones before held.
        for name in ("web", "api", "db"):
            response = await answer(call, query(name, "2"))
            assert response.cluster_id == "lower-1"
            reserved.append(response.estimates[0].reserved_node)
        assert reserved == ["big", "small", ""]
        # A release riding on a request is given back before its pod is judged.
        request = query("cache", "2")
        request.release_pod_uids.append("uid-web")
        assert (await answer(call, request)).estimates[0].reserved_node == "big"
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK


class Revoked(Admitting):
    """Lets the caller in until it is told not to."""

    allowed = True

    async def authorize_node_access(self, user: User, verb: str, subresource: str) -> None:
        if not self.allowed:
            raise AuthError(403, f"{user.name} may not {verb} nodes/{subresource}")


async def test_a_caller_that_loses_its_permission_is_refused_at_its_next_request(
    tmp_path: Path,
) -> None:
    authorizer = Revoked()
    async with stream_to(tmp_path, authorizer) as call:
        assert (await answer(call, query("web", "1"))).estimates[0].reserved_node == "big"
        authorizer.allowed = False
        await call.write(query("api", "1"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert refused.value.details() == "extender may not create nodes/estimator", "it reserves"


async def test_a_stopping_server_ends_the_calls_kept_open_within_its_grace(
    tmp_path: Path,
) -> None:
    cluster = Cluster()
    serving = served(tmp_path, cluster, grace=1)
    address, ca = await serving.__aenter__()
    async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel:
        call = EstimatorStub(channel).EstimateStream(metadata=METADATA, timeout=20)
        await answer(call, query("web", "1"))
        # The caller keeps its call open between requests: the server waits out its grace
        # (a virtual node's stop takes that long), then ends it.
        began = time.monotonic()
        await serving.__aexit__(None, None, None)
        assert time.monotonic() - began < 5
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call.read()
        assert ended.value.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


@pytest.fixture
def quick_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(estimatorapi, "KEEPALIVE_TIME_MS", 200)
    monkeypatch.setattr(estimatorapi, "KEEPALIVE_TIMEOUT_MS", 300)


async def test_a_connection_idle_between_calls_is_pinged_and_kept(
    tmp_path: Path, quick_keepalive: None
) -> None:
    """The multischeduler pings its estimator connections, with a call open or not; the
    estimator lets it (by default a gRPC server takes pings with no call open for abuse,
    and hangs up: GOAWAY too_many_pings, a new connection for the next call)."""
    cluster = Cluster()
    async with (
        served(tmp_path, cluster, Admitting()) as (address, ca),
        grpc.aio.secure_channel(
            address, grpc.ssl_channel_credentials(ca), estimatorapi.client_keepalive_options()
        ) as channel,
    ):
        call = EstimatorStub(channel).EstimateStream(metadata=METADATA, timeout=20)
        assert (await answer(call, query("web", "1"))).estimates[0].reserved_node
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        changed = asyncio.ensure_future(
            channel.wait_for_state_change(grpc.ChannelConnectivity.READY)
        )
        await asyncio.sleep(4.0)  # pings with no call open, a second apart at least
        assert not changed.done(), "the connection was dropped"
        changed.cancel()


class FreezingProxy:
    """Relays TCP both ways until frozen: then relays nothing, and closes nothing (a
    network that drops a connection silently)."""

    def __init__(self, target: str) -> None:
        self.host, _, port = target.rpartition(":")
        self.port = int(port)
        self.frozen = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            while data := await source.read(65536):
                if self.frozen.is_set():
                    await asyncio.Event().wait()
                sink.write(data)
                await sink.drain()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))


async def test_a_connection_dropped_silently_is_found_out_by_its_pings(
    tmp_path: Path, quick_keepalive: None
) -> None:
    """Without pings a call on it failed by its deadline, every one, until the kernel
    gave up on the connection (a quarter of an hour); the cluster was refused meanwhile."""
    cluster = Cluster()
    async with served(tmp_path, cluster, Admitting()) as (address, ca):
        proxy = FreezingProxy(address)
        through = await proxy.start()
        options = (
            *estimatorapi.client_keepalive_options(),
            ("grpc.ssl_target_name_override", "127.0.0.1"),
        )
        async with grpc.aio.secure_channel(
            through, grpc.ssl_channel_credentials(ca), options
        ) as channel:
            call = EstimatorStub(channel).EstimateStream(metadata=METADATA, timeout=20)
            assert (await answer(call, query("web", "1"))).estimates[0].reserved_node
            assert channel.get_state() == grpc.ChannelConnectivity.READY
            proxy.frozen.set()
            async with asyncio.timeout(5):
                await channel.wait_for_state_change(grpc.ChannelConnectivity.READY)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proxy.server is not None
        proxy.server.close()
