"""Random AdmissionReview bodies POSTed to the webhook on 127.0.0.1: whatever arrives, the
answer is 200 with an AdmissionReview for the same uid or 400 with a Status, and the
next valid review is still answered."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kubekit import keys, stash
from tests.unit.jsonfuzz import edited, json_values
from tests.unit.test_stash import specs
from tests.unit.test_webhook import daemonset_review, pod, review
from webhook.server import MAX_BODY, MovesFollower, make_app

# One server across all examples: a fixture shared by examples is the intent.
FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
PATH = "/mutate"

stash_annotations = st.sampled_from(
    [
        None,
        {},
        {"a": "b"},
        {keys.STASH_ANNOTATION: '{"version":1}'},
        {keys.STASH_ANNOTATION: "[" * 100_000},
    ]
)
# A valid review of a pod creation with a few of its values replaced or removed.
mutated_reviews = edited(
    st.builds(lambda spec, notes: review(pod(spec, notes)), specs, stash_annotations)
)


def owned_pod_review(spec: dict[str, Any], kind: str) -> dict[str, Any]:
    made = pod(spec)
    made["metadata"]["ownerReferences"] = [{"uid": "o", "controller": True, "kind": kind}]
    return review(made)


# Pods a controller owns, DaemonSet creations and updates, each with a few values edited.
mutated_owned_reviews = edited(
    st.builds(owned_pod_review, specs, st.sampled_from(["DaemonSet", "ReplicaSet"]))
)
mutated_daemonset_reviews = edited(st.builds(daemonset_review, specs, st.one_of(st.none(), specs)))
raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"[" * 100_000 + b"]" * 100_000,
            b'{"a":' * 600 + b"1" + b"}" * 600,
            b"NaN",
            b'{"apiVersion": "admission.k8s.io/v1", "request": Infinity}',
            b"1" * 5000,
            b'"\\ud800"',
        ]
    ),
)


@pytest.fixture
async def webhook() -> AsyncIterator[TestClient[Any, Any]]:
    # Following a move of owner "o", so that reviews of its pods are kept off it too.
    follower = MovesFollower()
    follower.on_add({"data": {"o": '{"vk-1": "2999-01-01T00:00:00Z"}'}})
    async with TestClient(TestServer(make_app(stash.DEFAULT_KEEP_KEYS, follower))) as client:
        yield client


async def check_answer(client: TestClient[Any, Any], body: bytes) -> dict[str, Any] | None:
    """The response of a 200, after checking it is one; None for a 400."""
    response = await client.post(PATH, data=body, headers={"Content-Type": "application/json"})
    answer = await response.json()
    if response.status == 400:
        assert answer["kind"] == "Status" and answer["code"] == 400
        return None
    assert response.status == 200, answer
    assert (answer["apiVersion"], answer["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    result: dict[str, Any] = answer["response"]
    assert isinstance(result["allowed"], bool)
    if "patch" in result:
        assert result["patchType"] == "JSONPatch"
        assert isinstance(json.loads(base64.b64decode(result["patch"])), list)
    return result


async def still_answers(client: TestClient[Any, Any]) -> None:
    valid = review(pod({"nodeSelector": {"a": "b"}}))
    result = await check_answer(client, json.dumps(valid).encode())
    assert result is not None and result["uid"] == "d2c1" and "patch" in result


@FUZZ
@given(
    document=st.one_of(
        mutated_reviews, mutated_owned_reviews, mutated_daemonset_reviews, json_values
    )
)
@example(document=review(pod({"nodeSelector": ["disk"]}))).via("a list for a map was a 500")
@example(document=review(pod({"tolerations": [{"key": ["a"]}]}))).via("unhashable key: 500")
@example(document=review(pod({"nodeSelector": {"a": 2**70}}))).via("orjson cannot copy it")
@example(
    document=review(
        pod(
            {
                "affinity": {
                    "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [None]}
                }
            }
        )
    )
).via("a null term: 500")
@example(document=review(pod({}, {keys.STASH_ANNOTATION: "[" * 100_000}))).via("RecursionError")
@example(
    document=daemonset_review(
        {"tolerations": [{"operator": "Exists"}], "affinity": {"nodeAffinity": None}}
    )
).via("a null node affinity of a node agent: 500")
@example(
    document=daemonset_review(
        {
            "tolerations": [{"operator": "Exists"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": None}},
        }
    )
).via("a null required node affinity of a node agent: 500")
@example(
    document=review(
        {**pod({}), "metadata": {**pod({})["metadata"], "ownerReferences": [{"controller": True}]}}
    )
).via("a controller reference without a uid, moves followed: 500")
async def test_any_json_body_gets_a_review_or_a_400(
    webhook: TestClient[Any, Any], document: Any
) -> None:
    result = await check_answer(webhook, json.dumps(document).encode())
    if result is not None:
        assert result["uid"] == document["request"]["uid"]
    await still_answers(webhook)


@FUZZ
@given(body=raw_bodies)
async def test_any_bytes_get_a_review_or_a_400(webhook: TestClient[Any, Any], body: bytes) -> None:
    await check_answer(webhook, body)
    await still_answers(webhook)


async def test_a_body_over_the_limit_is_refused_unread(webhook: TestClient[Any, Any]) -> None:
    document = review(pod({}))
    document["request"]["padding"] = "x" * MAX_BODY
    response = await webhook.post(PATH, json=document)
    assert response.status == 413
    await still_answers(webhook)
