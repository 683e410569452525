"""The descheduler end to end: bare pods bound straight to vk-lower-1 (no scheduler, as
before the extender existed) whose lower copies cannot be scheduled there.

A pool of one kwok node per cluster, tainted and labelled for these tests only:

    lower-1: move node 4 cpu, 2 taken by a pinned foreign pod -> 2 free
    lower-2: move node 4 cpu, free
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from descheduler.rescue import left_until
from harness.federation import DESCHEDULER, MANIFESTS, Federation
from harness.localcluster import LocalCluster, NodeSpec
from kubekit import keys
from kubekit.moves import keep_off
from kubekit.slices import applied

from .helpers import (
    apply,
    bound_pod,
    federated_namespace,
    get_json,
    namespace,
    node_ready,
    pods_by_name,
    refusing_policy,
    wait_for,
)

NAMESPACE = "move"
POOL = {"kubestrata.io/e2e-pool": "move"}
POOL_TAINT = {"key": "kubestrata.io/e2e-pool", "value": "move", "effect": "NoSchedule"}
CLUSTERS = ("lower-1", "lower-2")


def move_node(cluster: str) -> str:
    return f"{cluster}-move"


@pytest.fixture(scope="module")
def descheduling(
    federation: Federation, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Federation]:
    lower_1 = federation.clusters["lower-1"]
    policy = Path(tmp_path_factory.mktemp("descheduler")) / "policy.yaml"
    policy.write_text("pendingTimeout: 2\nclusterDownTimeout: 2\ninterval: 1\n")
    process = None
    # Cleaned up even when the set-up fails half way: later modules count the nodes.
    try:
        for cluster in CLUSTERS:
            lower = federation.clusters[cluster]
            assert isinstance(lower, LocalCluster)
            lower.add_nodes(
                [
                    NodeSpec(
                        name=move_node(cluster),
                        cpu="4",
                        memory="16Gi",
                        pods=110,
                        labels={**POOL, "topology.kubernetes.io/region": cluster},
                        taints=(POOL_TAINT,),
                    )
                ]
            )
        apply(
            lower_1,
            bound_pod(
                "move-pin",
                "default",
                move_node("lower-1"),
                containers=[
                    {
                        "name": "app",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"requests": {"cpu": "2"}},
                    }
                ],
            ),
        )
        wait_for(
            lambda: (
                get_json(lower_1, "pod", "-n", "default", "move-pin")["status"].get("phase")
                == "Running"
            ),
            "the pinned pod Running",
        )
        apply(federation.upper, federated_namespace(NAMESPACE))
        process = federation.start_descheduler(policy)
        yield federation
    finally:
        if process is not None:
            process.stop()
        federation.upper.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        lower_1.kubectl(
            "delete",
            "pod",
            "-n",
            "default",
            "move-pin",
            "--force",
            "--ignore-not-found",
            "--wait=false",
        )
        for cluster in CLUSTERS:
            federation.clusters[cluster].kubectl(
                "delete", "node", move_node(cluster), "--ignore-not-found", "--wait=false"
            )


def stuck_pod(name: str, cpu: str, namespace: str = NAMESPACE) -> dict[str, Any]:
    pod = bound_pod(
        name,
        namespace,
        "vk-lower-1",
        nodeSelector=dict(POOL),  # each its own: a test may add to it
        tolerations=[{**POOL_TAINT, "operator": "Equal"}],
        terminationGracePeriodSeconds=0,
        containers=[
            {
                "name": "app",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": cpu}},
            }
        ],
    )
    pod["metadata"]["labels"] = {"app": name}
    return pod


def copies_of(federation: Federation, uid: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    pods = get_json(federation.upper, "pods", "-n", namespace)["items"]
    return [
        p
        for p in pods
        if (p["metadata"].get("annotations") or {}).get(keys.COPY_OF_ANNOTATION) == uid
    ]


def events(federation: Federation, name: str, reason: str, namespace: str = NAMESPACE) -> list[str]:
    found = get_json(
        federation.upper,
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.name={name},reason={reason}",
    )["items"]
    return [str(e["message"]) for e in found]


def running_copy(federation: Federation, uid: str) -> dict[str, Any] | None:
    copies = copies_of(federation, uid)
    if len(copies) == 1 and copies[0]["status"].get("phase") == "Running":
        return copies[0]
    return None


def test_a_descheduler_killed_mid_move_leaves_the_original_or_the_copy_never_neither(
    descheduling: Federation,
) -> None:
    """Killed between creating the copy and deleting the original (held there by taking
    its right to delete pods away), then started again: it finds its copy, deletes only
    the original, and exactly one copy runs."""
    upper = descheduling.upper
    descheduler = descheduling.components[DESCHEDULER]
    upper.kubectl(
        "patch", "clusterrole", "kubestrata-descheduler", "--type=json", "-p",
        '[{"op": "replace", "path": "/rules/1/verbs", '
        '"value": ["get", "list", "watch", "create"]}]',
    )  # fmt: skip
    try:
        apply(upper, stuck_pod("torn", "3"))
        uid = get_json(upper, "pod", "-n", NAMESPACE, "torn")["metadata"]["uid"]
        (copy,) = wait_for(partial(copies_of, descheduling, uid), "the copy made", timeout=120)
        wait_for(
            lambda: "forbidden" in descheduler.log_path.read_text().lower(),
            "the original's delete refused",
        )
        descheduler.kill()
    finally:
        upper.kubectl("apply", "-f", str(MANIFESTS / "descheduler" / "rbac.yaml"))
    assert get_json(upper, "pod", "-n", NAMESPACE, "torn")["metadata"]["uid"] == uid
    descheduler.start()

    kept = wait_for(partial(running_copy, descheduling, uid), "the copy Running", timeout=120)
    assert kept is not None and kept["metadata"]["uid"] == copy["metadata"]["uid"]
    wait_for(
        lambda: upper.kubectl("get", "pod", "-n", NAMESPACE, "torn", check=False).returncode != 0,
        "the original deleted once the descheduler is back",
    )
    assert set(pods_by_name(upper, NAMESPACE, "app=torn")) == {copy["metadata"]["name"]}
    upper.kubectl("delete", "pod", "-n", NAMESPACE, copy["metadata"]["name"])
    wait_for(
        lambda: not pods_by_name(descheduling.clusters["lower-2"], NAMESPACE, "app=torn"),
        "the copy gone below, its room free for the next tests",
    )


def clear_pods(federation: Federation) -> None:
    """The module's pods of earlier tests gone, above and below: their copies run on the
    move nodes a test counts room on."""
    federation.upper.kubectl("delete", "pods", "--all", "-n", NAMESPACE, "--wait=false")
    wait_for(
        lambda: (
            not any(
                get_json(federation.clusters[cluster], "pods", "-n", NAMESPACE)["items"]
                for cluster in CLUSTERS
            )
        ),
        "the pods of earlier tests gone below",
        timeout=120,
    )


def test_a_bare_pod_stuck_below_is_re_created_in_a_cluster_that_fits_it(
    descheduling: Federation,
) -> None:
    apply(descheduling.upper, stuck_pod("solo", "3"))
    uid = get_json(descheduling.upper, "pod", "-n", NAMESPACE, "solo")["metadata"]["uid"]
    copy = wait_for(partial(running_copy, descheduling, uid), "the copy Running", timeout=120)
    assert copy is not None
    assert copy["spec"]["nodeName"] == "vk-lower-2"
    assert copy["metadata"]["labels"]["app"] == "solo"
    # The original goes at the look after its copy was taken below.
    wait_for(
        lambda: (
            set(pods_by_name(descheduling.upper, NAMESPACE, "app=solo"))
            == {copy["metadata"]["name"]}
        ),
        "the original gone, one copy running",
    )
    wait_for(
        lambda: not pods_by_name(descheduling.clusters["lower-1"], NAMESPACE, "app=solo"),
        "the original's lower pod gone from lower-1",
    )
    below = pods_by_name(descheduling.clusters["lower-2"], NAMESPACE, "app=solo")
    assert [p["spec"]["nodeName"] for p in below.values()] == [move_node("lower-2")]
    (said,) = events(descheduling, "solo", "Rescheduled")
    assert "unschedulable in vk-lower-1" in said and copy["metadata"]["name"] in said


def test_a_bare_pod_its_lower_cluster_refuses_is_re_created_in_another(
    descheduling: Federation,
) -> None:
    """Room on lower-1's node, but a quota of lower-1's own refuses the pod there."""
    lower_1 = descheduling.clusters["lower-1"]
    apply(lower_1, namespace(NAMESPACE))
    lower_1.kubectl("create", "quota", "no-pods", "-n", NAMESPACE, "--hard=pods=0")
    try:
        apply(descheduling.upper, stuck_pod("capped", "1"))
        uid = get_json(descheduling.upper, "pod", "-n", NAMESPACE, "capped")["metadata"]["uid"]
        copy = wait_for(partial(running_copy, descheduling, uid), "the copy Running", timeout=120)
        assert copy is not None and copy["spec"]["nodeName"] == "vk-lower-2"
        (said,) = wait_for(
            lambda: events(descheduling, "capped", "Rescheduled"), "the original re-created"
        )
        assert "unschedulable in vk-lower-1" in said and "exceeded quota: no-pods" in said
    finally:
        lower_1.kubectl("delete", "quota", "no-pods", "-n", NAMESPACE)


REFUSED_BY_LOWER_2 = "kubestrata-e2e-refused-copies"


def test_a_copy_its_cluster_refuses_goes_and_the_pod_stays_kept_off_it(
    descheduling: Federation,
) -> None:
    """lower-2's own policy refuses the copy (422: its virtual node fails it,
    LowerClusterRejected). The copy is deleted, lower-2 kept off the pod, which stays in
    lower-1 and says why. Until 2026-11-29 the failed copy stayed, and the move stopped
    there for good."""
    clear_pods(descheduling)  # lower-2's move node runs earlier tests' copies
    lower_2 = descheduling.clusters["lower-2"]
    apply(
        lower_2,
        *refusing_policy(
            REFUSED_BY_LOWER_2,
            ["pods"],
            "!object.metadata.name.startsWith('refused-')",
            "refused by lower-2's policy",
        ),
    )
    try:
        probe = bound_pod("refused-probe", "default", move_node("lower-2"))
        wait_for(
            lambda: (
                "refused by lower-2's policy"
                in lower_2.kubectl(
                    "create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False
                ).stderr
            ),
            "the policy in force",
        )
        apply(descheduling.upper, stuck_pod("refused", "3"))
        upper = descheduling.upper
        uid = get_json(upper, "pod", "-n", NAMESPACE, "refused")["metadata"]["uid"]
        said = wait_for(
            lambda: [
                m
                for m in events(descheduling, "refused", "NotRescheduled")
                if "was refused by vk-lower-2" in m
            ],
            "the refused copy withdrawn",
            timeout=120,
        )
        assert "LowerClusterRejected" in said[0] and "refused by lower-2's policy" in said[0]
        wait_for(lambda: not copies_of(descheduling, uid), "the refused copy gone")
        original = get_json(upper, "pod", "-n", NAMESPACE, "refused")
        assert original["spec"]["nodeName"] == "vk-lower-1", "the original is the pod"
        assert "vk-lower-2" in left_until(original)
        stays = wait_for(
            lambda: [
                m
                for m in events(descheduling, "refused", "NotRescheduled")
                if "vk-lower-2: left out until" in m
            ],
            "the pod said to stay, lower-2 named",
        )
        assert "left where it is" in stays[0]
    finally:
        lower_2.kubectl(
            "delete",
            "validatingadmissionpolicybinding,validatingadmissionpolicy",
            REFUSED_BY_LOWER_2,
            "--ignore-not-found",
        )
        descheduling.upper.kubectl("delete", "pod", "-n", NAMESPACE, "refused", "--wait=false")


def test_a_pod_no_cluster_can_run_is_left_where_it_is_with_an_event(
    descheduling: Federation,
) -> None:
    apply(descheduling.upper, stuck_pod("huge", "6"))
    said = wait_for(
        lambda: events(descheduling, "huge", "NotRescheduled"), "a NotRescheduled event"
    )
    assert "no cluster can run it now" in said[0] and "vk-lower-2: 0/" in said[0], said
    pod = get_json(descheduling.upper, "pod", "-n", NAMESPACE, "huge")
    assert pod["spec"]["nodeName"] == "vk-lower-1"
    assert not copies_of(descheduling, pod["metadata"]["uid"])


def test_a_bare_pod_is_not_copied_where_its_namespace_holds_no_quota_slices(
    descheduling: Federation,
) -> None:
    """The pod asks for lower-2's node: only lower-2 can run it, but its namespace's
    quota slice is in lower-1. A copy bound to vk-lower-2 would run outside the quota, and
    lower-2's virtual node fails it (OutsideQuotaSlices). Until 2026-11-29 the copy was
    made there, failed, and the move stopped for good. (The quota above has room for the
    copy beside the original: the copy is made first.)"""
    sliced = "move-sliced"
    upper = descheduling.upper
    ns = federated_namespace(sliced)
    ns["metadata"]["annotations"] = {
        keys.SLICE_SIZE_ANNOTATION: '{"cpu": "3"}',
        keys.SLICE_PLACEMENT_ANNOTATION: '{"lower-1": 1}',
    }
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "compute", "namespace": sliced},
        "spec": {"hard": {"requests.cpu": "3"}},
    }
    apply(upper, ns, quota)
    try:

        def placed() -> dict[str, int] | None:
            annotations = get_json(upper, "namespace", sliced)["metadata"].get("annotations")
            record = applied((annotations or {}).get(keys.SLICE_APPLIED_ANNOTATION))
            return None if record is None else dict(record.slices)

        wait_for(lambda: placed() == {"lower-1": 1}, "the slice placed in lower-1")
        held = stuck_pod("held", "1", sliced)
        held["spec"]["nodeSelector"]["topology.kubernetes.io/region"] = "lower-2"
        apply(upper, held)
        said = wait_for(
            lambda: events(descheduling, "held", "NotRescheduled", sliced),
            "a NotRescheduled event",
            timeout=120,
        )
        assert (
            f"vk-lower-2: namespace {sliced} holds no quota slices in lower-2 "
            "(its slices: lower-1 1)" in said[0]
        ), said
        pod = get_json(upper, "pod", "-n", sliced, "held")
        assert pod["spec"]["nodeName"] == "vk-lower-1"
        assert pod["status"].get("phase") == "Pending", "made in lower-1, within its slice"
        assert not copies_of(descheduling, pod["metadata"]["uid"], sliced)
    finally:
        upper.kubectl("delete", "namespace", sliced, "--wait=false")


def test_a_job_s_pod_whose_eviction_would_fail_the_job_stays_and_says_why(
    descheduling: Federation,
) -> None:
    """A Job with no failure to spare (backoffLimit 0): evicted, its stuck pod would fail
    the Job rather than be made again. The descheduler reads the Job with the rights its
    manifests give it."""
    spec = {**stuck_pod("last-try", "3")["spec"], "restartPolicy": "Never"}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "last-try", "namespace": NAMESPACE},
        "spec": {"backoffLimit": 0, "template": {"spec": spec}},
    }
    apply(descheduling.upper, job)
    try:
        (pod,) = wait_for(
            lambda: list(pods_by_name(descheduling.upper, NAMESPACE, "job-name=last-try").values()),
            "the Job's pod",
        )
        said = wait_for(
            lambda: events(descheduling, pod["metadata"]["name"], "NotRescheduled"),
            "a NotRescheduled event",
        )
        assert "its Job has failed 0 times, its backoffLimit" in said[0], said
        again = get_json(descheduling.upper, "pod", "-n", NAMESPACE, pod["metadata"]["name"])
        assert again["metadata"]["uid"] == pod["metadata"]["uid"] and not again["metadata"].get(
            "deletionTimestamp"
        )
        job_status = get_json(descheduling.upper, "job", "-n", NAMESPACE, "last-try")["status"]
        assert not job_status.get("failed")
    finally:
        descheduling.upper.kubectl(
            "delete", "job", "-n", NAMESPACE, "last-try", "--cascade=foreground", "--wait=false"
        )


def stuck_deployment(name: str, cpu: str, prefer: str) -> dict[str, Any]:
    """One replica whose pods prefer the cluster ``prefer`` (a cluster-id term the upper
    scheduler sees) and need a move node below."""
    spec = stuck_pod(name, cpu)["spec"]
    del spec["nodeName"]
    spec["affinity"] = {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "preference": {
                        "matchExpressions": [
                            {"key": keys.CLUSTER_ID_LABEL, "operator": "In", "values": [prefer]}
                        ]
                    },
                }
            ]
        }
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


def test_a_controllers_pod_stuck_below_is_replaced_in_another_cluster_without_the_extender(
    descheduling: Federation,
) -> None:
    """The upper scheduler without the multischeduler (it sees summed capacity) prefers
    lower-1 for these pods; lower-1's move node lacks the cpu. The descheduler evicts the
    pod and the webhook keeps its replacement off vk-lower-1, so it runs in lower-2."""
    upper = descheduling.upper
    clear_pods(descheduling)
    extenders = upper.scheduler_extenders
    upper.set_scheduler_extenders([])
    try:
        apply(upper, stuck_deployment("crowded", "3", prefer="lower-1"))

        def pods() -> list[dict[str, Any]]:
            return list(pods_by_name(upper, NAMESPACE, "app=crowded").values())

        (original,) = wait_for(
            lambda: [p for p in pods() if p["spec"].get("nodeName") == "vk-lower-1"],
            "the first pod bound to vk-lower-1",
        )

        def replaced() -> dict[str, Any] | None:
            running = [
                p
                for p in pods()
                if p["spec"].get("nodeName") == "vk-lower-2"
                and p["status"].get("phase") == "Running"
            ]
            return running[0] if len(running) == 1 else None

        # The bound: pendingTimeout (2 s here) + 30 s.
        replacement = wait_for(replaced, "the replacement Running in lower-2", timeout=32)
        assert replacement is not None
        assert replacement["metadata"]["ownerReferences"] == original["metadata"]["ownerReferences"]
        (said,) = events(descheduling, original["metadata"]["name"], "Rescheduled")
        assert "unschedulable in vk-lower-1" in said and "evicted from vk-lower-1" in said, said
        (term,) = replacement["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        assert term == {
            "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["vk-lower-1"]}]
        }
        wait_for(
            lambda: [p["metadata"]["name"] for p in pods()] == [replacement["metadata"]["name"]],
            "the evicted pod gone: no duplicate",
        )
        (below,) = pods_by_name(descheduling.clusters["lower-2"], NAMESPACE, "app=crowded").values()
        assert below["spec"]["nodeName"] == move_node("lower-2")
        assert "vk-lower-1" not in str(below["spec"].get("affinity")), "kept off above only"
        assert not pods_by_name(descheduling.clusters["lower-1"], NAMESPACE, "app=crowded")
    finally:
        upper.set_scheduler_extenders(extenders)
        upper.kubectl("delete", "deployment", "-n", NAMESPACE, "crowded", "--wait=false")


def evacuee() -> dict[str, Any]:
    spec = stuck_pod("evacuee", "1")["spec"]
    del spec["nodeName"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "evacuee", "namespace": NAMESPACE},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "evacuee"}},
            "template": {"metadata": {"labels": {"app": "evacuee"}}, "spec": spec},
        },
    }


def test_a_controllers_pod_leaves_a_cluster_that_is_down(descheduling: Federation) -> None:
    upper = descheduling.upper
    apply(upper, evacuee())

    def placed() -> dict[str, Any] | None:
        pods = list(pods_by_name(upper, NAMESPACE, "app=evacuee").values())
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        return running[0] if len(pods) == 1 and running else None

    first = wait_for(placed, "the evacuee Running")
    assert first is not None
    left = first["spec"]["nodeName"]
    cluster = left.removeprefix("vk-")
    lower = descheduling.clusters[cluster]
    assert isinstance(lower, LocalCluster)
    lower.stop_component("kube-apiserver")
    try:
        wait_for(
            lambda: node_ready(descheduling, left) == "Unknown",
            f"{left} NotReady",
            timeout=120,
            interval=2,
        )

        def replaced() -> dict[str, Any] | None:
            pods = pods_by_name(upper, NAMESPACE, "app=evacuee").values()
            elsewhere = [
                p
                for p in pods
                if p["spec"].get("nodeName") not in (None, left)
                and p["status"].get("phase") == "Running"
            ]
            return elsewhere[0] if len(elsewhere) == 1 else None

        replacement = wait_for(replaced, "the replacement Running in the other cluster")
        assert replacement is not None
        (said,) = events(descheduling, first["metadata"]["name"], "Rescheduled")
        assert f"{left} NotReady for" in said and "evicted from" in said, said
        assert replacement["metadata"]["ownerReferences"] == first["metadata"]["ownerReferences"]
    finally:
        lower.restart("kube-apiserver")
    wait_for(lambda: node_ready(descheduling, left) == "True", f"{left} Ready again", timeout=120)
    # Back, the cluster lets the evicted pod go: one pod left, the replacement.
    wait_for(
        lambda: (
            set(pods_by_name(upper, NAMESPACE, "app=evacuee")) == {replacement["metadata"]["name"]}
        ),
        "the evicted pod gone",
        timeout=120,
    )
    assert not pods_by_name(lower, NAMESPACE, "app=evacuee")


def test_a_pod_kept_off_two_virtual_nodes_is_one_the_apiserver_takes(
    federation: Federation,
) -> None:
    """A controller whose pods left two virtual nodes: its next pods carry a requirement
    per node (the apiserver takes one value per field requirement)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "kept-off", "namespace": "default"},
        "spec": {
            "affinity": keep_off(None, ["vk-lower-1", "vk-lower-2"]),
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
        },
    }
    created = federation.upper.kubectl(
        "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod)
    )
    terms = json.loads(created.stdout)["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert [f["values"] for f in terms[0]["matchFields"]] == [["vk-lower-1"], ["vk-lower-2"]]
