"""EstimateStream served as a virtual node serves it (own thread, TLS): answers in the
order asked, the caller checked at every request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

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
        assert refused.value.details() == "extender may not get nodes/estimator"


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
