"""Random requests to the estimator's gRPC service on 127.0.0.1, over TLS as it serves:
every call ends OK or INVALID_ARGUMENT (a pod Estimate cannot read is an error in its
answer, not a failed call), never UNKNOWN or INTERNAL, and the next valid call works."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kubekit import keys
from kubekit.estimatorapi import estimator_pb2, estimator_pb2_grpc
from tests.unit.jsonfuzz import edited, json_values
from tests.unit.test_estimator import Cluster, landed, served, upper_pod

# One server across all examples: a fixture shared by examples is the intent.
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
TIMEOUT = 5.0
METADATA = (("authorization", "Bearer extender"),)
FINE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}

int32s = st.one_of(st.integers(-3, 12), st.integers(-(2**31), 2**31 - 1))
uids = st.one_of(st.sampled_from(["uid-a", "uid-b", "uid-web", ""]), st.text(max_size=8))
nodes = st.one_of(st.sampled_from(["big", "small", ""]), st.text(max_size=8))
seconds = st.one_of(st.floats(), st.sampled_from([0.0, 30.0, math.nan, math.inf, -1.0, 1e300]))
stashed = {keys.STASH_ANNOTATION: '{"originals":{"nodeSelector":null},"version":1}'}
pods = st.one_of(
    edited(
        st.builds(
            lambda name, cpu, annotations: {
                **upper_pod(name, cpu),
                "metadata": {
                    "name": name,
                    "namespace": "ns",
                    "uid": f"uid-{name}",
                    "annotations": annotations,
                },
            },
            st.sampled_from(["web", "a", "x"]),
            st.sampled_from(["1", "100m", "4", "0"]),
            st.sampled_from([{}, stashed, {keys.STASH_ANNOTATION: "[" * 10_000}]),
        )
    ),
    json_values,
).map(lambda pod: json.dumps(pod).encode())
pod_bytes = st.one_of(pods, st.binary(max_size=32))
queries = st.builds(
    estimator_pb2.PodQuery,
    pod=pod_bytes,
    replicas=int32s,
    reserve=st.booleans(),
    with_node_names=st.booleans(),
)
calls = st.one_of(
    st.builds(
        lambda q, r: ("Estimate", estimator_pb2.EstimateRequest(pods=q, release_pod_uids=r)),
        st.lists(queries, max_size=3),
        st.lists(uids, max_size=3),
    ),
    st.builds(
        lambda u: ("Release", estimator_pb2.ReleaseRequest(pod_uids=u)), st.lists(uids, max_size=3)
    ),
    st.builds(
        lambda p, m, n: (
            "Defragment",
            estimator_pb2.DefragmentRequest(pod=p, movable_pod_uids=m, max_evictions=n),
        ),
        pod_bytes,
        st.lists(uids, max_size=4),
        int32s,
    ),
    st.builds(
        lambda p: ("FitInTurn", estimator_pb2.FitInTurnRequest(pods=p)),
        st.lists(pod_bytes, max_size=3),
    ),
    st.builds(
        lambda p, n, s: ("Hold", estimator_pb2.HoldRequest(pod=p, node=n, seconds=s)),
        pod_bytes,
        nodes,
        seconds,
    ),
)


class Estimator:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = estimator_pb2_grpc.EstimatorStub(channel)
        self.channel = channel

    async def call(self, method: str, request: Any) -> grpc.StatusCode:
        try:
            await getattr(self.stub, method)(request, metadata=METADATA, timeout=TIMEOUT)
        except grpc.aio.AioRpcError as error:
            code: grpc.StatusCode = error.code()
            return code
        return grpc.StatusCode.OK


@pytest.fixture
async def estimator(tmp_path: Path) -> AsyncIterator[Estimator]:
    cluster = Cluster()
    for name in ("a", "b"):
        landed(cluster, name, "1", "big")
    async with (
        served(tmp_path, cluster) as (address, ca),
        grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel,
    ):
        yield Estimator(channel)


async def still_answers(estimator: Estimator) -> None:
    query = estimator_pb2.PodQuery(pod=orjson.dumps(upper_pod("valid", "1")), replicas=2)
    response = await estimator.stub.Estimate(
        estimator_pb2.EstimateRequest(pods=[query]), metadata=METADATA, timeout=TIMEOUT
    )
    [answer] = response.estimates
    assert answer.error == "" and answer.total_nodes == 2


NOT_AN_OBJECT = b'{"metadata":{"uid":"u"},"spec":{"containers":[[]]}}'


@FUZZ
@given(call=calls)
@example(call=("Estimate", estimator_pb2.EstimateRequest(pods=[estimator_pb2.PodQuery(pod=b"[]")])))
@example(call=("FitInTurn", estimator_pb2.FitInTurnRequest(pods=[NOT_AN_OBJECT]))).via(
    "a container that is not an object ended the call UNKNOWN"
)
@example(
    call=(
        "Defragment",
        estimator_pb2.DefragmentRequest(
            pod=b'{"metadata": {"name": "web", "namespace": [], "uid": "u"}, '
            b'"spec": {"containers": [{"name": "app"}]}}'
        ),
    )
).via("a namespace that is a list ended the call UNKNOWN")
async def test_any_request_ends_ok_or_invalid_argument(
    estimator: Estimator, caplog: pytest.LogCaptureFixture, call: tuple[str, Any]
) -> None:
    caplog.clear()
    method, request = call
    assert await estimator.call(method, request) in FINE
    await still_answers(estimator)
    assert server_errors(caplog) == []


def server_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]


@FUZZ
@given(method=st.sampled_from(["Estimate", "Defragment", "FitInTurn", "Hold"]), body=st.binary())
@example(method="Estimate", body=b"\x00").via("an undecodable message ended UNKNOWN")
async def test_undecodable_messages_end_the_call_not_the_server(
    estimator: Estimator, caplog: pytest.LogCaptureFixture, method: str, body: bytes
) -> None:
    caplog.clear()
    # Raw bytes as the message: what protobuf cannot parse ends the call, not the server.
    call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = estimator.channel.unary_unary(
        f"/kubestrata.estimator.v1.Estimator/{method}",
        request_serializer=None,
        response_deserializer=None,
    )
    try:
        await call(body, metadata=METADATA, timeout=TIMEOUT)
    except grpc.aio.AioRpcError as error:
        assert error.code() in FINE, error
    await still_answers(estimator)
    assert server_errors(caplog) == []


@FUZZ
@given(body=st.binary())
@example(body=b"\x00").via("an undecodable message on a stream, like one of a call")
async def test_undecodable_messages_end_a_stream_not_the_server(
    estimator: Estimator, caplog: pytest.LogCaptureFixture, body: bytes
) -> None:
    caplog.clear()
    stream: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = estimator.channel.stream_stream(
        "/kubestrata.estimator.v1.Estimator/EstimateStream",
        request_serializer=None,
        response_deserializer=None,
    )
    call = stream(metadata=METADATA, timeout=TIMEOUT)
    try:
        await call.write(body)
        await call.read()
        await call.done_writing()
    except grpc.aio.AioRpcError as error:
        assert error.code() in FINE, error
    assert await call.code() in FINE
    await still_answers(estimator)
    assert server_errors(caplog) == []
