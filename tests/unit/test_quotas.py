"""The lower cluster's ResourceQuotas as the fit estimator reads them."""

from __future__ import annotations

from typing import Any

import pytest

from kubekit import keys
from virtual_node.quotas import Quota, QuotaBook, quota_usage, read_quota


def quota(
    name: str, hard: dict[str, str], used: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"hard": hard, **spec},
        "status": {"hard": hard, "used": used or {}},
    }


def pod(*containers: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "shop"}, "spec": {"containers": list(containers), **spec}}


def container(requests: dict[str, str], limits: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": "c",
        "resources": {"requests": requests, **({"limits": limits} if limits else {})},
    }


def test_quotas_capping_every_pod_are_read_in_thousandths() -> None:
    read = read_quota(
        quota("q", {"pods": "10", "requests.cpu": "2"}, {"pods": "3", "requests.cpu": "500m"})
    )
    assert read == Quota(
        "q", {"pods": 10_000, "requests.cpu": 2_000}, {"pods": 3_000, "requests.cpu": 500}
    )


@pytest.mark.parametrize(
    "ignored",
    [
        quota("q", {"pods": "1"}, scopes=["BestEffort"]),
        quota(
            "q",
            {"pods": "1"},
            scopeSelector={
                "matchExpressions": [{"operator": "Exists", "scopeName": "PriorityClass"}]
            },
        ),
        quota(keys.SLICE_QUOTA, {"requests.cpu": "2"}),
        quota("q", {}),
    ],
    ids=["scopes", "scope-selector", "the-slices-own", "caps-nothing"],
)
def test_quotas_capping_only_some_pods_or_the_slices_own_are_not_read(
    ignored: dict[str, Any],
) -> None:
    assert read_quota(ignored) is None


def test_a_pod_uses_what_quota_admission_counts() -> None:
    app = container(
        {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": "1", "hugepages-2Mi": "4Mi"},
        {"cpu": "1", "memory": "2Gi"},
    )
    init = {**container({"cpu": "2"}, {"cpu": "2"}), "name": "init"}
    usage = quota_usage(pod(app, initContainers=[init], overhead={"cpu": "100m"}))
    assert usage == {
        "pods": 1000,
        "count/pods": 1000,
        # The init container's peak, plus the overhead.
        "cpu": 2100,
        "requests.cpu": 2100,
        "memory": 2**30 * 1000,
        "requests.memory": 2**30 * 1000,
        "requests.nvidia.com/gpu": 1000,
        # Hugepages bare as well, as cpu and memory are (an extended resource is not).
        "hugepages-2Mi": 4 * 2**20 * 1000,
        "requests.hugepages-2Mi": 4 * 2**20 * 1000,
        "limits.cpu": 2100,
        "limits.memory": 2 * 2**30 * 1000,
    }
    # No limit, no limit counted (and the overhead does not make one).
    assert "limits.cpu" not in quota_usage(pod(container({"cpu": "1"}), overhead={"cpu": "1"}))


def book_with(*quotas: dict[str, Any]) -> QuotaBook:
    book = QuotaBook()
    for each in quotas:
        book.quota_changed(each)
    return book


def test_the_room_is_hard_less_used_less_pods_not_made_yet() -> None:
    book = book_with(
        quota("compute", {"requests.cpu": "4", "pods": "10"}, {"requests.cpu": "1", "pods": "1"})
    )
    one_cpu = quota_usage(pod(container({"cpu": "1"})))
    assert book.room_for("shop", "new", one_cpu, 10, "lower-1") == (3, "")
    book.count("a", "shop", one_cpu)
    book.count("b", "shop", one_cpu)
    assert book.room_for("shop", "new", one_cpu, 10, "lower-1") == (1, "")
    # Asked again about a pod it counts, the pod's own share is not held against it.
    assert book.room_for("shop", "b", one_cpu, 10, "lower-1") == (2, "")
    book.count("c", "shop", one_cpu)
    assert book.room_for("shop", "new", one_cpu, 1, "lower-1") == (
        0,
        "lower cluster lower-1: quota compute of namespace shop has requests.cpu 0 left of 4, "
        "the pod asks 1",
    )
    # Made below: the quota's used has it (the next status says so), no longer pending.
    book.uncount("c")
    book.quota_changed(
        quota("compute", {"requests.cpu": "4", "pods": "10"}, {"requests.cpu": "2", "pods": "2"})
    )
    assert book.room_for("shop", "new", one_cpu, 10, "lower-1")[0] == 0
    book.uncount("a")
    assert book.room_for("shop", "new", one_cpu, 10, "lower-1") == (1, "")


def test_every_quota_of_the_namespace_holds_and_others_are_not_touched() -> None:
    book = book_with(
        quota("pods", {"pods": "2"}, {"pods": "1"}),
        quota("memory", {"requests.memory": "1Gi"}),
    )
    small = quota_usage(pod(container({"memory": "256Mi"})))
    assert book.room_for("shop", "new", small, 10, "lower-1") == (1, "")
    big = quota_usage(pod(container({"memory": "2Gi"})))
    assert book.room_for("shop", "new", big, 1, "lower-1")[1] == (
        "lower cluster lower-1: quota memory of namespace shop has requests.memory 1Gi left of "
        "1Gi, the pod asks 2Gi"
    )
    assert book.room_for("other", "new", big, 5, "lower-1") == (5, "")
    book.count("x", "other", big)  # not held: not counted
    assert not book.holds("other")


def test_a_quota_deleted_or_scoped_later_stops_holding_its_namespace() -> None:
    book = book_with(quota("pods", {"pods": "1"}))
    one = quota_usage(pod(container({})))
    book.count("a", "shop", one)
    assert book.room_for("shop", "new", one, 1, "lower-1")[0] == 0
    book.quota_changed(quota("pods", {"pods": "1"}, scopes=["Terminating"]))
    assert not book.holds("shop")
    assert book.room_for("shop", "new", one, 1, "lower-1") == (1, "")
    assert book.quota_changed(quota("pods", {"pods": "1"})), "held again: its pods are counted anew"
    assert book.room_for("shop", "new", one, 1, "lower-1") == (1, ""), "the pending pod was let go"
    book.quota_deleted(quota("pods", {"pods": "1"}))
    assert not book.holds("shop")
