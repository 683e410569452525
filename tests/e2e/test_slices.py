"""Quota slices end to end: a namespace's ResourceQuota cut into slices that the
multischeduler places over the lower clusters, promised in each lower cluster's ledger
and enforced there by a ResourceQuota.

Every lower cluster is first given another tenant's promise (a ledger entry written
here, as that tenant's virtual node would) so that exactly 6 CPU is left to promise in
each: the suite's other modules add nodes, and this leaves the arithmetic fixed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from fractions import Fraction
from functools import partial
from typing import Any

import pytest

from harness.federation import Federation
from harness.localcluster import LocalCluster
from kubekit import keys
from kubekit.slices import Amount, ClusterRoom, Headroom, LedgerEntry, amount
from virtual_node.capacity import node_counts

from .helpers import apply, federated_namespace, get_json, pods_by_name, wait_for

NAMESPACE = "sliced"
OTHER_TENANT = "e2e-other-tenant"
LEFT_TO_PROMISE = 6000  # millicores in each cluster
CLUSTERS = ("lower-1", "lower-2")
# The multischeduler's default headroom.
HEADROOM = Headroom(percent=Fraction(10))


# What the namespace holds before any pod: copied into every cluster holding its slices.
NAMESPACE_OBJECTS = [
    {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "settings", "namespace": NAMESPACE},
        "data": {"mode": "fast"},
    },
    {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "password", "namespace": NAMESPACE},
        "stringData": {"password": "sesame"},
    },
    {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "api", "namespace": NAMESPACE},
        "spec": {"selector": {"app": "api"}, "ports": [{"port": 80}]},
    },
]


def lower(federation: Federation, cluster: str) -> LocalCluster:
    found = federation.clusters[cluster]
    assert isinstance(found, LocalCluster)
    return found


def ledger(cluster: LocalCluster) -> dict[str, str]:
    found = cluster.kubectl(
        "get",
        "configmap",
        keys.SLICE_LEDGER_CONFIGMAP,
        f"--namespace={keys.SYSTEM_NAMESPACE}",
        "-o",
        "json",
        check=False,
    )
    return json.loads(found.stdout).get("data") or {} if found.returncode == 0 else {}


def other_tenant_takes_all_but(cluster: LocalCluster, left: int) -> None:
    """A ledger entry of another tenant promising all the cluster's room but ``left``."""
    nodes = get_json(cluster, "nodes")["items"]
    counted = tuple(
        amount(node["status"]["allocatable"], round_up=False) for node in nodes if node_counts(node)
    )
    limit = ClusterRoom("", counted, Amount(), HEADROOM).limit
    entry = LedgerEntry("other", OTHER_TENANT, 1, Amount(cpu=limit.cpu - left, memory=0))
    data = {**ledger(cluster), f"{OTHER_TENANT}-other": entry.encode()}
    apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": keys.SLICE_LEDGER_CONFIGMAP, "namespace": keys.SYSTEM_NAMESPACE},
            "data": data,
        },
    )


def quota(cpu: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "compute", "namespace": NAMESPACE},
        "spec": {"hard": {"requests.cpu": cpu}},
    }


def namespace_annotations(federation: Federation) -> dict[str, str]:
    found = get_json(federation.upper, "namespace", NAMESPACE)
    return found["metadata"].get("annotations") or {}


def slices_condition(federation: Federation) -> dict[str, str]:
    found = get_json(federation.upper, "namespace", NAMESPACE)
    [condition] = [
        c
        for c in found["status"].get("conditions") or []
        if c["type"] == keys.SLICES_PLACED_CONDITION
    ]
    return dict(condition)


def placed(federation: Federation) -> dict[str, int] | None:
    text = namespace_annotations(federation).get(keys.SLICE_PLACEMENT_ANNOTATION)
    # A cleared annotation ("") is a placement asked for and not yet made.
    return json.loads(text) if text else None


def wait_placed(federation: Federation, expected: dict[str, int]) -> None:
    wait_for(lambda: placed(federation) == expected, f"placement {expected}", timeout=60)


def lower_quota(cluster: LocalCluster) -> dict[str, str] | None:
    found = cluster.kubectl(
        "get",
        "resourcequota",
        keys.SLICE_QUOTA,
        f"--namespace={NAMESPACE}",
        "-o",
        "json",
        check=False,
    )
    if found.returncode != 0:
        return None
    hard: dict[str, str] = json.loads(found.stdout)["spec"]["hard"]
    return hard


def edit_placement(federation: Federation, text: str) -> None:
    federation.upper.kubectl(
        "annotate",
        "namespace",
        NAMESPACE,
        "--overwrite",
        f"{keys.SLICE_PLACEMENT_ANNOTATION}={text}",
    )


def copies(cluster: LocalCluster) -> set[str]:
    """The namespace's objects copied below, as kind/name."""
    found = get_json(cluster, "configmaps,secrets,services", f"--namespace={NAMESPACE}")
    return {
        f"{item['kind']}/{item['metadata']['name']}"
        for item in found["items"]
        if (item["metadata"].get("labels") or {}).get(keys.MANAGED_BY_LABEL)
        == keys.MANAGED_BY_VALUE
    }


COPIED = {"ConfigMap/settings", "Secret/password", "Service/api"}


def copies_are(cluster: LocalCluster, expected: set[str]) -> bool:
    return copies(cluster) == expected


def lower_quota_gone(cluster: LocalCluster) -> bool:
    return lower_quota(cluster) is None


def events(federation: Federation, reason: str) -> list[str]:
    found = get_json(
        federation.upper, "events", f"--namespace={NAMESPACE}", f"--field-selector=reason={reason}"
    )
    return [event["message"] for event in found["items"]]


@pytest.fixture(scope="module")
def pool(federation: Federation) -> Iterator[Federation]:
    for cluster in CLUSTERS:
        other_tenant_takes_all_but(lower(federation, cluster), LEFT_TO_PROMISE)
    apply(federation.upper, federated_namespace(NAMESPACE), *NAMESPACE_OBJECTS)
    try:
        yield federation
    finally:
        federation.upper.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        for cluster in CLUSTERS:
            lower(federation, cluster).kubectl(
                "delete",
                "configmap",
                keys.SLICE_LEDGER_CONFIGMAP,
                f"--namespace={keys.SYSTEM_NAMESPACE}",
                check=False,
            )


def test_ten_cpus_of_two_cpu_slices_over_two_clusters_of_six(pool: Federation) -> None:
    apply(pool.upper, quota("10"))
    wait_placed(pool, {"lower-1": 3, "lower-2": 2})
    # Promised in each lower cluster's ledger, and held there by a ResourceQuota.
    wait_for(
        lambda: (
            lower_quota(lower(pool, "lower-1")) == {"requests.cpu": "6"}
            and lower_quota(lower(pool, "lower-2")) == {"requests.cpu": "4"}
        ),
        "the lower quotas",
    )
    # The namespace's objects are below in both clusters before any pod.
    for cluster in CLUSTERS:
        wait_for(partial(copies_are, lower(pool, cluster), COPIED), f"copies in {cluster}")
    entry = json.loads(ledger(lower(pool, "lower-1"))[NAMESPACE])
    assert (entry["slices"], entry["size"]) == (3, {"cpu": 2000, "memory": 0})
    assert any("5 slices of cpu 2: lower-1 3, lower-2 2" in m for m in events(pool, "SlicesPlaced"))


def test_raising_and_lowering_the_quota(pool: Federation) -> None:
    apply(pool.upper, quota("12"))
    wait_placed(pool, {"lower-1": 3, "lower-2": 3})
    apply(pool.upper, quota("4"))
    # Taken back where most are unused (none are: ties by name, one at a time).
    wait_placed(pool, {"lower-1": 1, "lower-2": 1})
    wait_for(
        lambda: lower_quota(lower(pool, "lower-2")) == {"requests.cpu": "2"},
        "lower-2's quota lowered",
    )


def test_more_than_the_room_is_refused_and_the_placement_kept(pool: Federation) -> None:
    apply(pool.upper, quota("14"))  # 7 slices, room for 6
    wait_for(lambda: events(pool, "SlicesNotPlaced"), "a SlicesNotPlaced event")
    message = events(pool, "SlicesNotPlaced")[0]
    assert "7 slices of cpu 2 wanted, room for 6: 1 missing (cpu 2)" in message, message
    assert placed(pool) == {"lower-1": 1, "lower-2": 1}
    # And in the namespace's status, for `kubectl describe namespace`.
    condition = slices_condition(pool)
    assert (condition["status"], condition["reason"], condition["message"]) == (
        "False",
        "SlicesNotPlaced",
        message,
    )
    apply(pool.upper, quota("4"))
    wait_for(lambda: slices_condition(pool)["status"] == "True", "the condition placed again")


def test_an_edit_is_honoured_when_feasible_and_refused_when_not(pool: Federation) -> None:
    wait_placed(pool, {"lower-1": 1, "lower-2": 1})
    edit_placement(pool, '{"lower-2": 2}')
    wait_placed(pool, {"lower-2": 2})
    wait_for(lambda: lower_quota(lower(pool, "lower-1")) is None, "lower-1's quota removed")
    # The namespace left lower-1: so did its objects.
    wait_for(partial(copies_are, lower(pool, "lower-1"), set()), "no copies in lower-1")
    assert copies(lower(pool, "lower-2")) == COPIED
    edit_placement(pool, '{"lower-1": 1, "lower-3": 1}')
    wait_for(lambda: events(pool, "SlicePlacementRefused"), "a SlicePlacementRefused event")
    assert "no lower cluster lower-3 in the pool" in events(pool, "SlicePlacementRefused")[0]
    wait_placed(pool, {"lower-2": 2})
    # Cleared: placed afresh.
    edit_placement(pool, "")
    wait_placed(pool, {"lower-1": 1, "lower-2": 1})


def test_the_quota_removed_takes_every_promise_back(pool: Federation) -> None:
    pool.upper.kubectl("delete", "resourcequota", "compute", f"--namespace={NAMESPACE}")
    wait_for(lambda: placed(pool) is None, "the placement removed")
    for cluster in CLUSTERS:
        below = lower(pool, cluster)
        wait_for(partial(lower_quota_gone, below), f"{cluster}'s quota removed")
        assert NAMESPACE not in ledger(below)
        assert f"{OTHER_TENANT}-other" in ledger(below)
        wait_for(partial(copies_are, below, set()), f"no copies in {cluster}")


def sliced_pod(name: str, cpu: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": "sliced"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "app",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"requests": {"cpu": cpu}},
                }
            ],
        },
    }


def node_of(federation: Federation, name: str) -> str | None:
    pod = get_json(federation.upper, "pod", f"--namespace={NAMESPACE}", name)
    if pod["status"].get("phase") != "Running":
        return None
    return str(pod["spec"].get("nodeName") or "") or None


def failed_status(federation: Federation, name: str) -> dict[str, Any]:
    """The pod's status once Failed, else empty."""
    pod = get_json(federation.upper, "pod", f"--namespace={NAMESPACE}", name)
    status: dict[str, Any] = pod["status"]
    return status if status.get("phase") == "Failed" else {}


def failed_scheduling(federation: Federation, name: str) -> str:
    found = get_json(
        federation.upper,
        "events",
        f"--namespace={NAMESPACE}",
        f"--field-selector=involvedObject.name={name},reason=FailedScheduling",
    )["items"]
    return str(found[-1]["message"]) if found else ""


def below(federation: Federation) -> dict[str, list[str]]:
    return {
        cluster: sorted(pods_by_name(lower(federation, cluster), NAMESPACE, "app=sliced"))
        for cluster in CLUSTERS
    }


def test_pods_go_only_where_their_slices_are_and_stay_within_them(pool: Federation) -> None:
    apply(pool.upper, quota("4"))
    wait_placed(pool, {"lower-1": 1, "lower-2": 1})
    try:
        # Either cluster's nodes take both; each cluster's 2-CPU slice takes one.
        apply(pool.upper, sliced_pod("one", "1500m"))
        first = wait_for(lambda: node_of(pool, "one"), "pod one running")
        apply(pool.upper, sliced_pod("two", "1500m"))
        second = wait_for(lambda: node_of(pool, "two"), "pod two running")
        assert {first, second} == {"vk-lower-1", "vk-lower-2"}
        # Within the namespace's quota (4 CPU), beyond its slices in each cluster.
        apply(pool.upper, sliced_pod("three", "1"))
        message = wait_for(lambda: failed_scheduling(pool, "three"), "FailedScheduling")
        for cluster in CLUSTERS:
            assert (
                f"vk-{cluster}: namespace {NAMESPACE}'s quota slices here (1 of cpu 2) have "
                "cpu 500m left, the pod asks cpu 1"
            ) in message, message
        assert node_of(pool, "three") is None
        assert below(pool) == {
            "lower-1" if first == "vk-lower-1" else "lower-2": ["one"],
            "lower-2" if first == "vk-lower-1" else "lower-1": ["two"],
        }
        pool.upper.kubectl(
            "delete", "pods", f"--namespace={NAMESPACE}", "-l", "app=sliced", "--wait=true"
        )
        wait_for(lambda: below(pool) == {"lower-1": [], "lower-2": []}, "the pods gone below")

        # Only lower-2 holds slices now: the pods go nowhere else. Pod three, pending, may
        # have been judged again as one went, before its own deletion, and room held for
        # it in lower-1 until the extender gives it back: an edit taking that slice then
        # is refused, as a user would see it, and made again.
        def honoured() -> bool:
            edit_placement(pool, '{"lower-2": 2}')
            with contextlib.suppress(AssertionError):
                wait_for(lambda: placed(pool) == {"lower-2": 2}, "the edit", timeout=5)
            return placed(pool) == {"lower-2": 2}

        wait_for(honoured, "placement {'lower-2': 2}", timeout=60)
        for name in ("four", "five"):
            apply(pool.upper, sliced_pod(name, "1"))
        for name in ("four", "five"):
            assert wait_for(partial(node_of, pool, name), f"{name} running") == "vk-lower-2"
        # Bound to lower-1 by its creator, past the extender: lower-1 has promised its
        # room to others, and no slice quota there would stop the pod.
        bypassing = sliced_pod("six", "1")
        bypassing["spec"]["nodeName"] = "vk-lower-1"
        apply(pool.upper, bypassing)
        status = wait_for(partial(failed_status, pool, "six"), "six failed")
        assert status["reason"] == "OutsideQuotaSlices", status
        assert (
            f"namespace {NAMESPACE} holds no quota slices in lower-1 (its slices: lower-2 2)"
        ) in status["message"], status
        assert below(pool) == {"lower-1": [], "lower-2": ["five", "four"]}
    finally:
        pool.upper.kubectl(
            "delete", "pods", f"--namespace={NAMESPACE}", "-l", "app=sliced", "--wait=true"
        )


def test_a_quota_lowered_below_what_runs_keeps_the_slices_in_use_until_it_ends(
    pool: Federation,
) -> None:
    """A pod uses 2 slices' worth where it runs; the quota goes down to 1 slice: the
    2 slices under it stay promised (given back, another namespace would be promised
    that room while the pod runs on it), and go once it ends."""
    apply(pool.upper, quota("8"))
    wait_placed(pool, {"lower-1": 2, "lower-2": 2})
    try:
        apply(pool.upper, sliced_pod("big", "3500m"))
        cluster = str(wait_for(lambda: node_of(pool, "big"), "pod big running"))[3:]
        apply(pool.upper, quota("2"))
        wait_placed(pool, {cluster: 2})
        wait_for(
            lambda: slices_condition(pool)["reason"] == "SlicesKeptForPods",
            "the slices kept for the pod told",
        )
        assert "the quota asks 1" in slices_condition(pool)["message"]
        assert lower_quota(lower(pool, cluster)) == {"requests.cpu": "4"}
        pool.upper.kubectl("delete", "pod", f"--namespace={NAMESPACE}", "big", "--wait=true")
        wait_placed(pool, {cluster: 1})  # looked at again within 30 s
        wait_for(
            lambda: slices_condition(pool)["reason"] == "SlicesPlaced", "placed as the quota asks"
        )
    finally:
        pool.upper.kubectl(
            "delete", "pods", f"--namespace={NAMESPACE}", "-l", "app=sliced", "--wait=true"
        )


def test_a_namespace_deleted_while_the_multischeduler_is_away_is_taken_back(
    pool: Federation,
) -> None:
    gone = "sliced-gone"
    apply(
        pool.upper,
        federated_namespace(gone),
        {**quota("2"), "metadata": {"name": "compute", "namespace": gone}},
    )
    wait_for(
        lambda: any(gone in ledger(lower(pool, cluster)) for cluster in CLUSTERS),
        "the namespace's slice promised",
    )
    multischeduler = pool.components["multischeduler"]
    multischeduler.stop()
    try:
        pool.upper.kubectl("delete", "namespace", gone, "--wait=true")
    finally:
        multischeduler.start()
    # Its start sweeps the ledgers: the namespace is gone above, its slice is taken back.
    wait_for(
        lambda: not any(gone in ledger(lower(pool, cluster)) for cluster in CLUSTERS),
        "the slice taken back",
    )
