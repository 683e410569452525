"""The estimator's server on its own thread: it answers while the virtual node's loop
is busy."""

from __future__ import annotations

import asyncio
import gc
import threading
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from harness.localcluster import free_port
from kubekit import pki
from kubekit.estimatorapi import estimator_pb2
from kubekit.estimatorapi.estimator_pb2_grpc import EstimatorStub
from tests.unit.test_estimator import Admitting, Cluster, landed, served, upper_pod
from virtual_node.estimator import EstimatorService, serve
from virtual_node.kubeletapi.auth import User

METADATA = (("authorization", "Bearer extender"),)


async def ask(address: str, ca: bytes) -> estimator_pb2.EstimateResponse:
    credentials = grpc.ssl_channel_credentials(ca)
    async with grpc.aio.secure_channel(address, credentials) as channel:
        query = estimator_pb2.PodQuery(pod=orjson.dumps(upper_pod("web", "2")), replicas=10)
        response: estimator_pb2.EstimateResponse = await EstimatorStub(channel).Estimate(
            estimator_pb2.EstimateRequest(pods=[query]),
            metadata=METADATA,
            timeout=20,
        )
        return response


async def test_the_estimator_answers_while_the_virtual_node_s_loop_is_blocked(
    tmp_path: Path,
) -> None:
    cluster = Cluster()
    landed(cluster, "a", "1", "big")
    answers: list[estimator_pb2.EstimateResponse] = []
    answered = threading.Event()
    async with served(tmp_path, cluster) as (address, ca):

        def caller() -> None:
            answers.append(asyncio.run(ask(address, ca)))
            answered.set()

        threading.Thread(target=caller).start()
        # This loop is held until the answer has come: were the server on it, no answer.
        assert answered.wait(timeout=30)
    [estimate] = answers[0].estimates
    assert estimate.max_replicas == 2, "big has 3 of its 4 cpu left, small 2"


class StallingFromTheSecondCall(Admitting):
    """Lets the first request of a stream in and holds every later one."""

    def __init__(self) -> None:
        self.asked = 0
        self.holding = threading.Event()  # set on the estimator's own thread

    async def authenticate(
        self, peercert: dict[str, Any] | None, authorization: str, audience: str | None = None
    ) -> User:
        self.asked += 1
        if self.asked > 1:
            self.holding.set()
            await asyncio.Event().wait()
        return User(name="extender")


async def test_a_server_stopped_during_a_stream_leaves_no_task_to_be_destroyed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ca = pki.create_ca(tmp_path, "estimator-ca")
    pair = pki.issue(ca, tmp_path / "estimator", "estimator", server_names=("127.0.0.1",))
    credentials = grpc.ssl_channel_credentials(ca.cert_path.read_bytes())
    query = estimator_pb2.PodQuery(pod=orjson.dumps(upper_pod("web", "2")))
    # Whether the stream's ending wants a turn of the loop after the server has stopped
    # is a race; each round runs it again.
    for _ in range(10):
        cluster = Cluster()
        landed(cluster, "a", "1", "big")
        port = free_port()
        authorizer = StallingFromTheSecondCall()
        service = EstimatorService(cluster.estimator, authorizer, "lower-1")
        server = await serve(service, "127.0.0.1", port, pair)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            call = EstimatorStub(channel).EstimateStream(metadata=METADATA, timeout=20)
            await call.write(estimator_pb2.EstimateRequest(pods=[query]))
            await call.read()
            await call.write(estimator_pb2.EstimateRequest(pods=[query]))
            assert await asyncio.to_thread(authorizer.holding.wait, 20)
            await server.stop(None)
    gc.collect()  # a task closed pending is reported when it is collected
    destroyed = [r.getMessage() for r in caplog.records if "destroyed" in r.getMessage()]
    assert destroyed == []
