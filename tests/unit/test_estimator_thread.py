"""The estimator's server on its own thread: it answers while the virtual node's loop
is busy."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import orjson

from kubekit.estimatorapi import estimator_pb2
from kubekit.estimatorapi.estimator_pb2_grpc import EstimatorStub
from tests.unit.test_estimator import Cluster, landed, served, upper_pod


async def ask(address: str, ca: bytes) -> estimator_pb2.EstimateResponse:
    credentials = grpc.ssl_channel_credentials(ca)
    async with grpc.aio.secure_channel(address, credentials) as channel:
        query = estimator_pb2.PodQuery(pod=orjson.dumps(upper_pod("web", "2")), replicas=10)
        response: estimator_pb2.EstimateResponse = await EstimatorStub(channel).Estimate(
            estimator_pb2.EstimateRequest(pods=[query]),
            metadata=(("authorization", "Bearer extender"),),
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
