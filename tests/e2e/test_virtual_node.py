"""A lower cluster as one Node of the upper cluster: registration, capacity, pods both
ways, conflicts, drain and faults, all through the stock kubectl against real clusters."""

from __future__ import annotations

import base64
import ipaddress
import json
import subprocess
import threading
import time
from functools import partial
from typing import Any

from harness.federation import Federation, virtual_node_name
from harness.localcluster import LocalCluster
from kubekit import keys
from kubekit.quantity import parse_quantity

from .helpers import (
    apply,
    bound_pod,
    cluster_pod,
    federated_deployment,
    get_json,
    namespace,
    node_ready,
    pods_by_name,
    rollout,
    wait_for,
    wait_for_default_account,
)


def allocatable(federation: Federation, name: str) -> dict[str, Any]:
    return dict(get_json(federation.upper, "node", name)["status"]["allocatable"])


def test_virtual_nodes_are_registered_with_labels_taint_and_lease(federation: Federation) -> None:
    nodes = {n["metadata"]["name"]: n for n in get_json(federation.upper, "nodes")["items"]}
    assert set(nodes) == {"vk-lower-1", "vk-lower-2"}
    node = nodes["vk-lower-1"]
    labels = node["metadata"]["labels"]
    assert labels[keys.NODE_TYPE_LABEL] == "virtual-kubelet"
    assert labels[keys.VIRTUAL_NODE_LABEL] == keys.VIRTUAL_NODE_LABEL_VALUE
    assert labels[keys.PROVEN_VIRTUAL_NODE_LABEL] == keys.VIRTUAL_NODE_LABEL_VALUE
    assert labels[keys.HOSTNAME_LABEL] == "vk-lower-1"
    assert labels[keys.CLUSTER_ID_LABEL] == "lower-1"
    assert (labels["kubernetes.io/os"], labels["kubernetes.io/arch"]) == ("linux", "amd64")
    assert labels["topology.kubernetes.io/region"] == "lower-1", "same on every lower node"
    assert "topology.kubernetes.io/zone" not in labels, "differs between lower nodes"
    assert node["spec"]["taints"] == [
        {"key": "virtual-kubelet.io/provider", "value": "kubestrata", "effect": "NoSchedule"}
    ]
    status = node["status"]
    assert status["nodeInfo"]["kubeletVersion"] == "v1.35.4"
    assert {"type": "InternalIP", "address": "127.0.0.1"} in status["addresses"]
    assert status["daemonEndpoints"]["kubeletEndpoint"]["Port"] > 0
    assert node_ready(federation, "vk-lower-1") == "True"
    lease = get_json(federation.upper, "lease", "-n", "kube-node-lease", "vk-lower-1")
    assert lease["spec"]["holderIdentity"] == "vk-lower-1"
    assert lease["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]


def lower_free(federation: Federation, cluster: str) -> tuple[Any, int]:
    """Free cpu and pod slots of a lower cluster computed from kubectl's view of it,
    counting every pod that is not mirrored by kubestrata."""
    lower = federation.clusters[cluster]
    nodes = get_json(lower, "nodes")["items"]
    cpu = sum(parse_quantity(n["status"]["allocatable"]["cpu"]) for n in nodes)
    slots = sum(int(n["status"]["allocatable"]["pods"]) for n in nodes)
    for pod in get_json(lower, "pods", "-A")["items"]:
        if pod["metadata"].get("labels", {}).get(keys.MANAGED_BY_LABEL) == keys.MANAGED_BY_VALUE:
            continue
        if not pod["spec"].get("nodeName") or pod["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        slots -= 1
        for container in pod["spec"]["containers"]:
            cpu -= parse_quantity(
                container.get("resources", {}).get("requests", {}).get("cpu", "0")
            )
    return cpu, slots


def test_capacity_is_free_allocatable_and_drops_with_foreign_pods(federation: Federation) -> None:
    lower = federation.clusters["lower-2"]

    def matches() -> bool:
        have = allocatable(federation, "vk-lower-2")
        cpu, slots = lower_free(federation, "lower-2")
        return parse_quantity(have["cpu"]) == cpu and int(have["pods"]) == slots

    wait_for(matches, "vk-lower-2 capacity to equal lower-2's free allocatable")
    before = allocatable(federation, "vk-lower-2")
    lower.kubectl(
        "run",
        "foreign",
        "-n",
        "default",
        "--image=registry.k8s.io/pause:3.10",
        "--overrides",
        '{"spec":{"containers":[{"name":"foreign","image":"pause",'
        '"resources":{"requests":{"cpu":"3","memory":"1Gi"}}}]}}',
    )
    wait_for(
        lambda: (
            parse_quantity(allocatable(federation, "vk-lower-2")["cpu"])
            == parse_quantity(before["cpu"]) - 3
        ),
        "cpu to drop by 3",
    )
    after = allocatable(federation, "vk-lower-2")
    assert int(after["pods"]) == int(before["pods"]) - 1
    assert parse_quantity(after["memory"]) == parse_quantity(before["memory"]) - 2**30
    lower.kubectl("delete", "pod", "foreign", "-n", "default", "--grace-period=0", "--force")
    wait_for(lambda: allocatable(federation, "vk-lower-2") == before, "capacity to come back")


def test_capacity_goes_when_every_lower_node_is_cordoned(federation: Federation) -> None:
    """The Node's status is a strategic merge patch, which merges resource maps key by
    key: a resource gone from the report must be written as null to leave the Node."""
    lower = federation.clusters["lower-2"]
    nodes = [n["metadata"]["name"] for n in get_json(lower, "nodes")["items"]]

    def offered() -> dict[str, Any]:
        node = get_json(federation.upper, "node", "vk-lower-2")
        return dict(node["status"].get("allocatable") or {})

    before = offered()
    try:
        for node in nodes:
            lower.kubectl("cordon", node)
        wait_for(lambda: not offered(), "vk-lower-2 to offer nothing with every node cordoned")
    finally:
        for node in nodes:
            lower.kubectl("uncordon", node)
    wait_for(lambda: offered() == before, "capacity to come back")


def test_deployment_spreads_over_both_virtual_nodes_and_deletes_cleanly(
    federation: Federation,
) -> None:
    upper = federation.upper
    apply(upper, namespace("spread"), federated_deployment("web", "spread", 4, cpu="6"))
    # 16 cpu per virtual node: at most two of these fit on each.
    rollout(upper, "web", "spread")
    pods = pods_by_name(upper, "spread", "app=web")
    assert len({p["status"]["podIP"] for p in pods.values()}) == 4
    assert sorted(p["spec"]["nodeName"] for p in pods.values()) == [
        "vk-lower-1",
        "vk-lower-1",
        "vk-lower-2",
        "vk-lower-2",
    ]
    for name, pod in pods.items():
        cluster = federation.clusters[pod["spec"]["nodeName"].removeprefix("vk-")]
        lower = get_json(cluster, "pod", "-n", "spread", name)
        assert lower["status"]["phase"] == pod["status"]["phase"] == "Running"
        assert pod["status"]["podIP"] == lower["status"]["podIP"]
        # Each lower cluster hands out addresses of its own: one names one pod above.
        address = ipaddress.ip_address(pod["status"]["podIP"])
        assert address in ipaddress.ip_network(cluster.spec.pod_cidr)
        assert lower["metadata"]["annotations"][keys.UPPER_UID_ANNOTATION] == pod["metadata"]["uid"]
        assert lower["metadata"]["labels"][keys.MANAGED_BY_LABEL] == keys.MANAGED_BY_VALUE
        assert lower["spec"]["nodeName"].startswith(cluster.name + "-node-")
        assert not any(
            v["name"].startswith("kube-api-access-")
            and v.get("projected", {}).get("sources")
            and "upper" in str(v)
            for v in lower["spec"].get("volumes", [])
        )

    # What happened below is told above: the lower scheduler's event on each upper pod.
    for name, pod in pods.items():
        lower_node = f"{pod['spec']['nodeName'].removeprefix('vk-')}-node-"
        wait_for(
            lambda n=name, ln=lower_node: any(  # type: ignore[misc]
                e["reason"] == "Scheduled" and ln in e.get("message", "")
                for e in get_json(
                    upper, "events", "-n", "spread", "--field-selector", f"involvedObject.name={n}"
                )["items"]
            ),
            f"the lower Scheduled event on {name}",
        )

    upper.kubectl("delete", "deployment", "web", "-n", "spread")
    for lower_name in ("lower-1", "lower-2"):
        cluster = federation.clusters[lower_name]
        wait_for(
            lambda c=cluster: not pods_by_name(c, "spread", "app=web"),  # type: ignore[misc]
            f"lower pods in {lower_name} to go",
        )
    wait_for(lambda: not pods_by_name(upper, "spread", "app=web"), "upper pods to go")


def running_pod(upper: LocalCluster, namespace_name: str, name: str) -> dict[str, Any]:
    """The upper pod once it runs."""
    pod: dict[str, Any] = wait_for(
        lambda: (
            (p := get_json(upper, "pod", "-n", namespace_name, name))["status"].get("phase")
            == "Running"
            and p
        ),
        f"pod {namespace_name}/{name} to run",
    )
    return pod


def test_pod_bound_by_node_name_runs_with_the_conditions_a_kubelet_reports(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-2"]
    apply(
        upper,
        namespace("bound"),
        bound_pod("direct", "bound", "vk-lower-2"),
    )
    pod = running_pod(upper, "bound", "direct")
    conditions = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert conditions["PodScheduled"] == conditions["Ready"] == "True"
    assert pod["status"]["hostIP"] == "127.0.0.1"
    below = get_json(lower, "pod", "-n", "bound", "direct")
    assert below["spec"]["nodeName"].startswith("lower-2-node-")
    assert pod["status"]["podIP"] == below["status"]["podIP"]
    upper.kubectl("delete", "namespace", "bound", "--wait=false")


def test_a_tolerations_seconds_changed_above_change_below(federation: Federation) -> None:
    """Raised above, an `unreachable` toleration's seconds are raised below in place: kept
    beside the new one, the old 300 s would still have the lower pod evicted first."""
    upper, lower = federation.upper, federation.clusters["lower-2"]
    unreachable = {"key": "node.kubernetes.io/unreachable", "operator": "Exists"}
    apply(
        upper,
        namespace("tolerant"),
        bound_pod(
            "patient",
            "tolerant",
            "vk-lower-2",
            tolerations=[{**unreachable, "effect": "NoExecute", "tolerationSeconds": 300}],
        ),
    )
    wait_for(
        lambda: (
            get_json(upper, "pod", "-n", "tolerant", "patient")["status"].get("phase") == "Running"
        ),
        "the pod Running",
    )
    tolerations = get_json(upper, "pod", "-n", "tolerant", "patient")["spec"]["tolerations"]
    raised = [
        {**t, "tolerationSeconds": 3600} if t.get("key") == unreachable["key"] else t
        for t in tolerations
    ]
    upper.kubectl(
        "patch", "pod", "patient", "-n", "tolerant", "-p",
        json.dumps({"spec": {"tolerations": raised}}),
    )  # fmt: skip

    def seconds_below() -> list[int]:
        below = get_json(lower, "pod", "-n", "tolerant", "patient")["spec"]["tolerations"]
        return [t.get("tolerationSeconds") for t in below if t.get("key") == unreachable["key"]]

    wait_for(lambda: seconds_below() == [3600], "the toleration's new seconds below")
    upper.kubectl("delete", "namespace", "tolerant", "--wait=false")


def test_a_readiness_gate_is_judged_above_where_its_controller_sets_it(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-2"]
    gate = "example.com/load-balancer"
    apply(
        upper,
        namespace("gated"),
        bound_pod("web", "gated", "vk-lower-2", readinessGates=[{"conditionType": gate}]),
    )

    def conditions() -> dict[str, dict[str, Any]]:
        pod = get_json(upper, "pod", "-n", "gated", "web")
        return {c["type"]: c for c in pod["status"].get("conditions") or []}

    def held_by_its_gate() -> dict[str, dict[str, Any]]:
        now = conditions()
        return now if now.get("Ready", {}).get("reason") == "ReadinessGatesNotReady" else {}

    held = wait_for(held_by_its_gate, "the pod to run above, not ready for want of its gate")
    assert held["Ready"]["status"] == "False"
    assert held["ContainersReady"]["status"] == "True"
    below = get_json(lower, "pod", "-n", "gated", "web")
    assert "readinessGates" not in below["spec"], "nobody below would ever set it"
    assert {c["type"]: c["status"] for c in below["status"]["conditions"]}["Ready"] == "True"

    # What a load-balancer controller above does once the pod takes traffic.
    upper.kubectl(
        "patch",
        "pod",
        "web",
        "-n",
        "gated",
        "--subresource=status",
        "-p",
        json.dumps({"status": {"conditions": [{"type": gate, "status": "True"}]}}),
    )
    wait_for(lambda: conditions()["Ready"]["status"] == "True", "the pod to be ready with its gate")
    # A later sync (a label pushed down) keeps the controller's condition.
    upper.kubectl("label", "pod", "web", "-n", "gated", "synced=again")
    wait_for(
        lambda: get_json(lower, "pod", "-n", "gated", "web")["metadata"]["labels"].get("synced"),
        "the label to reach the lower pod",
    )
    after = conditions()
    assert after[gate]["status"] == after["Ready"]["status"] == "True"
    upper.kubectl("delete", "namespace", "gated", "--wait=false")


def test_lower_pod_deleted_behind_our_back_is_replaced(federation: Federation) -> None:
    upper, lower = federation.upper, federation.clusters["lower-1"]
    apply(
        upper,
        namespace("lost"),
        federated_deployment("victim", "lost", 1, node_selector={keys.CLUSTER_ID_LABEL: "lower-1"}),
    )
    rollout(upper, "victim", "lost")
    (first,) = pods_by_name(upper, "lost", "app=victim")
    lower.kubectl("delete", "pod", first, "-n", "lost", "--grace-period=0", "--force")

    def replaced() -> list[str]:
        pods = pods_by_name(upper, "lost", "app=victim")
        return [n for n, p in pods.items() if n != first and p["status"].get("phase") == "Running"]

    (second,) = wait_for(replaced, "a replacement pod Running")
    events = get_json(
        upper, "events", "-n", "lost", "--field-selector", f"involvedObject.name={first}"
    )
    assert any(e["reason"] == "LowerPodDeleted" for e in events["items"])
    assert second in pods_by_name(lower, "lost", "app=victim")
    upper.kubectl("delete", "namespace", "lost", "--wait=false")


HOLD = "kubestrata.io/e2e-hold"


def test_lower_pod_held_terminating_below_is_replaced_at_once(federation: Federation) -> None:
    """A lower pod that stays Terminating (a finalizer here; the taint manager's pods of a
    lower node that went away, in life): its owner above replaces it without waiting."""
    upper, lower = federation.upper, federation.clusters["lower-1"]
    apply(
        upper,
        namespace("held"),
        federated_deployment("victim", "held", 1, node_selector={keys.CLUSTER_ID_LABEL: "lower-1"}),
    )
    rollout(upper, "victim", "held")
    (first,) = pods_by_name(upper, "held", "app=victim")
    finalizers = json.dumps({"metadata": {"finalizers": [HOLD]}})
    lower.kubectl("patch", "pod", first, "-n", "held", "--type=merge", "-p", finalizers)
    lower.kubectl("delete", "pod", first, "-n", "held", "--wait=false")

    def replaced() -> list[str]:
        pods = pods_by_name(upper, "held", "app=victim")
        return [n for n, p in pods.items() if n != first and p["status"].get("phase") == "Running"]

    (second,) = wait_for(replaced, "a replacement pod Running while the first ends below")
    assert pods_by_name(lower, "held", "app=victim")[first]["metadata"]["deletionTimestamp"]
    # Terminating above with the lower pod's grace, which kwok cuts to 0 (so gone at once).
    ending = pods_by_name(upper, "held", "app=victim").get(first)
    assert ending is None or ending["metadata"].get("deletionTimestamp")
    lower.kubectl(
        "patch",
        "pod",
        first,
        "-n",
        "held",
        "--type=merge",
        "-p",
        '{"metadata":{"finalizers":null}}',
    )
    wait_for(
        lambda: first not in pods_by_name(upper, "held", "app=victim"),
        "the first pod gone above once it is gone below",
    )
    assert second in pods_by_name(lower, "held", "app=victim")
    upper.kubectl("delete", "namespace", "held", "--wait=false")


def watched_pods(watch_output: str) -> list[dict[str, Any]]:
    """The pods ``kubectl get -w -o json`` printed, in order: the listed ones first, then
    one per watch event."""
    decoder = json.JSONDecoder()
    pods = []
    position = 0
    while position < len(watch_output):
        if watch_output[position].isspace():
            position += 1
            continue
        try:
            pod, position = decoder.raw_decode(watch_output, position)
        except json.JSONDecodeError:
            break  # the rest is still being written
        pods.append(pod)
    return pods


def deletion_graces(pods: list[dict[str, Any]]) -> dict[str, int | None]:
    """The grace of each pod's first state marked for deletion: kwok deletes again with
    grace 0 right after, so only the first is ours."""
    graces: dict[str, int | None] = {}
    for pod in pods:
        metadata = pod["metadata"]
        if metadata.get("deletionTimestamp") and metadata["name"] not in graces:
            graces[metadata["name"]] = metadata.get("deletionGracePeriodSeconds")
    return graces


def test_force_deleted_upper_pods_are_force_deleted_below(federation: Federation) -> None:
    upper, lower = federation.upper, federation.clusters["lower-2"]
    assert isinstance(lower, LocalCluster)
    names = [f"forced-{n}" for n in range(8)]
    apply(upper, namespace("forced"), *(bound_pod(n, "forced", "vk-lower-2") for n in names))
    wait_for(
        lambda: (
            sum(
                p["status"].get("phase") == "Running"
                for p in get_json(lower, "pods", "-n", "forced")["items"]
            )
            == len(names)
        ),
        "the eight lower pods Running",
    )

    def set_finalizers(finalizers: list[str] | None) -> None:
        for name in names:
            lower.kubectl(
                "patch",
                "pod",
                name,
                "-n",
                "forced",
                "--type=merge",
                "-p",
                json.dumps({"metadata": {"finalizers": finalizers}}),
                check=finalizers is not None,
            )

    # The finalizer keeps each lower pod, marked, to be read.
    set_finalizers([HOLD])
    # Listed first, then watched from the list's resourceVersion: no change is missed
    # however late the watch connects.
    watch = lower.kubectl_process(
        "get", "pods", "-n", "forced", "--watch", "-o", "json", stdout=subprocess.PIPE, text=True
    )
    stream = watch.stdout
    assert stream is not None
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(stream.readline, "")))
    reader.start()
    try:
        wait_for(lambda: len(watched_pods("".join(output))) >= len(names), "the pods listed")
        upper.kubectl("delete", "pods", "--all", "-n", "forced", "--force", "--grace-period=0")
        wait_for(
            lambda: all(
                p["metadata"].get("deletionTimestamp")
                for p in get_json(lower, "pods", "-n", "forced")["items"]
            ),
            "every lower pod marked for deletion",
        )
        wait_for(
            lambda: len(deletion_graces(watched_pods("".join(output)))) == len(names),
            "every marking watched",
        )
    finally:
        watch.terminate()
        watch.wait(timeout=10)
        reader.join(timeout=10)
        set_finalizers(None)
        upper.kubectl("delete", "namespace", "forced", "--wait=false")
    assert deletion_graces(watched_pods("".join(output))) == dict.fromkeys(names, 0)


def test_a_jobs_pod_deleted_above_ends_failed_and_the_job_replaces_it(
    federation: Federation,
) -> None:
    """A Job with a pod failure policy lets a deleted pod go (its finalizer) and replaces
    it only once the pod's phase is terminal, which a kubelet writes before the pod goes:
    without it the pod stayed Terminating, Running, and the Job waited for ever."""
    upper = federation.upper
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "finisher", "namespace": "jobs"},
        "spec": {
            "backoffLimit": 3,
            "podFailurePolicy": {
                "rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}]
            },
            "template": {
                "spec": {
                    "nodeName": "vk-lower-1",
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
                }
            },
        },
    }
    apply(upper, namespace("jobs"), job)
    try:

        def running() -> list[str]:
            pods = pods_by_name(upper, "jobs", "job-name=finisher")
            return [
                name
                for name, pod in pods.items()
                if pod["status"].get("phase") == "Running"
                and not pod["metadata"].get("deletionTimestamp")
            ]

        (first,) = wait_for(running, "the Job's pod Running")
        upper.kubectl("delete", "pod", first, "-n", "jobs", "--wait=false")
        wait_for(
            lambda: first not in pods_by_name(upper, "jobs", "job-name=finisher"),
            f"the deleted pod {first} gone above",
        )
        (second,) = wait_for(running, "the Job's next pod Running")
        assert second != first
        status = get_json(upper, "job", "finisher", "-n", "jobs")["status"]
        assert status.get("failed") == 1, status
    finally:
        upper.kubectl("delete", "namespace", "jobs", "--wait=false")


def test_name_taken_below_by_someone_else_fails_the_pod_and_leaves_theirs(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-1"]
    lower.kubectl("create", "namespace", "clash")
    lower.kubectl(
        "run",
        "taken",
        "-n",
        "clash",
        "--image=registry.k8s.io/pause:3.10",
        "--labels=owner=someone",
    )
    theirs = get_json(lower, "pod", "-n", "clash", "taken")
    apply(
        upper,
        namespace("clash"),
        bound_pod(
            "taken",
            "clash",
            "vk-lower-1",
            tolerations=[{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
        ),
    )
    pod = wait_for(
        lambda: (
            (p := get_json(upper, "pod", "-n", "clash", "taken"))["status"].get("phase") == "Failed"
            and p
        ),
        "the upper pod to fail",
    )
    assert pod["status"]["reason"] == "NameConflict"
    assert "not created by this virtual node" in pod["status"]["message"]
    events = get_json(
        upper, "events", "-n", "clash", "--field-selector", "involvedObject.name=taken"
    )
    assert any(e["reason"] == "NameConflict" for e in events["items"])
    still = get_json(lower, "pod", "-n", "clash", "taken")
    assert still["metadata"]["uid"] == theirs["metadata"]["uid"]
    assert still["metadata"]["labels"] == theirs["metadata"]["labels"]


def test_kill_9_during_a_burst_loses_and_duplicates_nothing(federation: Federation) -> None:
    upper, lower = federation.upper, federation.clusters["lower-2"]
    replicas = 500
    apply(
        upper,
        namespace("burst"),
        federated_deployment(
            "burst", "burst", replicas, node_selector={keys.CLUSTER_ID_LABEL: "lower-2"}
        ),
    )
    virtual_node = federation.components[virtual_node_name("lower-2")]
    wait_for(
        lambda: len(pods_by_name(lower, "burst", "app=burst")) >= 100,
        "the burst to be under way",
        interval=0.2,
    )
    virtual_node.kill()
    created_before_restart = len(pods_by_name(lower, "burst", "app=burst"))
    assert created_before_restart < replicas, "killed in the middle of the burst"
    virtual_node.start()

    def all_running() -> bool:
        pods = pods_by_name(lower, "burst", "app=burst")
        return len(pods) == replicas and all(
            p["status"].get("phase") == "Running" for p in pods.values()
        )

    wait_for(all_running, f"{replicas} lower pods Running", timeout=240, interval=2)
    upper_pods = pods_by_name(upper, "burst", "app=burst")
    lower_pods = pods_by_name(lower, "burst", "app=burst")
    assert len(upper_pods) == replicas
    assert {n: p["metadata"]["uid"] for n, p in upper_pods.items()} == {
        n: p["metadata"]["annotations"][keys.UPPER_UID_ANNOTATION] for n, p in lower_pods.items()
    }
    wait_for(
        lambda: all(
            p["status"].get("phase") == "Running"
            for p in pods_by_name(upper, "burst", "app=burst").values()
        ),
        "upper statuses Running",
        timeout=120,
        interval=2,
    )
    upper.kubectl("delete", "namespace", "burst", "--wait=false")
    wait_for(
        lambda: not pods_by_name(lower, "burst", "app=burst"),
        "the burst to be removed below",
        timeout=240,
        interval=2,
    )


def test_a_restart_under_another_namespace_mapping_runs_no_pod_twice(
    federation: Federation,
) -> None:
    """Restarted with a namespace prefix while a pod made without one runs: looked for
    under the prefix, it would be taken for lost and made again beside itself."""
    upper, lower = federation.upper, federation.clusters["lower-1"]
    apply(upper, namespace("remapped"), bound_pod("web", "remapped", "vk-lower-1"))
    wait_for(
        lambda: get_json(upper, "pod", "-n", "remapped", "web")["status"].get("phase") == "Running",
        "the pod to run",
    )
    virtual_node = federation.components[virtual_node_name("lower-1")]
    same = list(virtual_node.argv)
    virtual_node.kill()
    virtual_node.argv = [*same, "--namespace-strategy=prefix", "--namespace-prefix=moved"]
    try:
        virtual_node.start()
        wait_for(
            lambda: (
                "were made by this virtual node under another namespace mapping"
                in virtual_node.log_path.read_text()
            ),
            "the virtual node to say why it does not start",
        )
        time.sleep(5)  # what a start would have done by now
        below = get_json(lower, "pods", "-n", "remapped")["items"]
        assert [pod["metadata"]["name"] for pod in below] == ["web"]
        assert lower.kubectl("get", "namespace", "moved-remapped", check=False).returncode != 0
        assert get_json(upper, "pod", "-n", "remapped", "web")["status"]["phase"] == "Running"
    finally:
        virtual_node.kill()
        virtual_node.argv = same
        virtual_node.start()
    upper.kubectl("delete", "namespace", "remapped", "--timeout=120s")


def copies_of_scheduled_event(upper: LocalCluster, namespace: str, pod: str) -> int:
    events = get_json(
        upper, "events", "-n", namespace, "--field-selector", f"involvedObject.name={pod}"
    )["items"]
    return sum(e["reason"] == "Scheduled" for e in events)


def refused_event_creates(upper: LocalCluster) -> float:
    """Event creates the upper apiserver answered with 409: what sending a copy that
    exists costs."""
    metrics = upper.kubectl("get", "--raw", "/metrics").stdout.splitlines()
    return sum(
        float(line.rpartition(" ")[2])
        for line in metrics
        if line.startswith("apiserver_request_total{")
        and 'code="409"' in line
        and 'resource="events"' in line
        and 'verb="POST"' in line
    )


def test_a_restarted_virtual_node_does_not_copy_events_up_again(federation: Federation) -> None:
    upper = federation.upper
    apply(upper, namespace("copied"), bound_pod("before", "copied", "vk-lower-1"))
    wait_for(lambda: copies_of_scheduled_event(upper, "copied", "before"), "the first copy")
    refused = refused_event_creates(upper)
    virtual_node = federation.components[virtual_node_name("lower-1")]
    virtual_node.kill()
    virtual_node.start()
    # Made after the restart, so copied after every event the restart found below.
    apply(upper, bound_pod("after", "copied", "vk-lower-1"))
    wait_for(lambda: copies_of_scheduled_event(upper, "copied", "after"), "the new pod's copy")
    assert refused_event_creates(upper) == refused
    assert copies_of_scheduled_event(upper, "copied", "before") == 1
    # Bare pods left on vk-lower-1 would stop the drain test.
    upper.kubectl("delete", "namespace", "copied", "--timeout=120s")


def test_a_hostname_address_an_older_version_left_goes_at_restart(federation: Federation) -> None:
    """Addresses merge by type: without replacing the list, a Hostname address written by
    an older version would stay, and the apiserver (preferring it) would dial it for
    every log and exec."""
    upper = federation.upper
    virtual_node = federation.components[virtual_node_name("lower-1")]
    virtual_node.kill()
    hostname = {"type": "Hostname", "address": "vk-lower-1"}
    patch = json.dumps({"status": {"addresses": [hostname]}})
    upper.kubectl("patch", "node", "vk-lower-1", "--subresource=status", "-p", patch)
    assert hostname in get_json(upper, "node", "vk-lower-1")["status"]["addresses"]
    virtual_node.start()
    wait_for(
        lambda: (
            get_json(upper, "node", "vk-lower-1")["status"]["addresses"]
            == [{"type": "InternalIP", "address": "127.0.0.1"}]
        ),
        "the Hostname address to go",
    )


def test_a_virtual_node_deleted_by_a_user_is_back_before_the_pod_gc_looks(
    federation: Federation,
) -> None:
    """The upper pod GC deletes the pods bound to a Node missing for 40 s: the Node is
    registered again well within that (the next Lease renewal finds its Lease gone with
    it), and its pod runs on, the same pod."""
    upper = federation.upper
    apply(upper, namespace("node-deleted"), bound_pod("stays", "node-deleted", "vk-lower-2"))
    pod = running_pod(upper, "node-deleted", "stays")
    old_uid = get_json(upper, "node", "vk-lower-2")["metadata"]["uid"]
    upper.kubectl("delete", "node", "vk-lower-2", "--wait=true")

    def registered_again() -> bool:
        found = upper.kubectl("get", "node", "vk-lower-2", "-o", "json", check=False)
        return found.returncode == 0 and json.loads(found.stdout)["metadata"]["uid"] != old_uid

    wait_for(registered_again, "the Node registered again", timeout=30)
    after = get_json(upper, "pod", "-n", "node-deleted", "stays")
    assert after["metadata"]["uid"] == pod["metadata"]["uid"]
    assert after["status"]["phase"] == "Running"
    upper.kubectl("delete", "namespace", "node-deleted", "--wait=false")


def test_a_pod_deleted_above_while_the_virtual_node_was_down_goes_below_on_restart(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-1"]
    apply(upper, namespace("orphans"), bound_pod("left", "orphans", "vk-lower-1"))
    wait_for(lambda: get_json(lower, "pods", "-n", "orphans")["items"], "the lower pod to be made")
    apply(lower, bound_pod("theirs", "orphans", "lower-1-node-0"))
    virtual_node = federation.components[virtual_node_name("lower-1")]
    virtual_node.kill()
    upper.kubectl("delete", "pod", "left", "-n", "orphans", "--grace-period=0", "--force")
    virtual_node.start()
    wait_for(
        lambda: (
            [p["metadata"]["name"] for p in get_json(lower, "pods", "-n", "orphans")["items"]]
            == ["theirs"]
        ),
        "the orphan to be removed below, and only it",
    )
    upper.kubectl("delete", "namespace", "orphans", "--timeout=120s")
    lower.kubectl("delete", "namespace", "orphans", "--wait=false")


def test_cordon_and_drain_move_every_replica_to_the_other_cluster(federation: Federation) -> None:
    upper = federation.upper
    apply(upper, namespace("drain"), federated_deployment("app", "drain", 6))
    rollout(upper, "app", "drain")
    try:
        upper.kubectl("cordon", "vk-lower-1")
        upper.kubectl("drain", "vk-lower-1", "--ignore-daemonsets", "--timeout=120s", timeout=130)

        def all_on_lower_2() -> bool:
            pods = pods_by_name(upper, "drain", "app=app").values()
            return len(pods) == 6 and all(
                p["spec"].get("nodeName") == "vk-lower-2" and p["status"].get("phase") == "Running"
                for p in pods
            )

        wait_for(all_on_lower_2, "all six replicas Running on vk-lower-2")
        wait_for(
            lambda: not pods_by_name(federation.clusters["lower-1"], "drain", "app=app"),
            "the evicted pods removed from lower-1",
        )
        assert len(pods_by_name(federation.clusters["lower-2"], "drain", "app=app")) == 6
        assert get_json(upper, "node", "vk-lower-1")["spec"]["unschedulable"] is True
    finally:
        upper.kubectl("uncordon", "vk-lower-1")
        upper.kubectl("delete", "namespace", "drain", "--wait=false")


def test_a_pod_whose_secret_name_is_taken_below_waits_until_it_is_free(
    federation: Federation,
) -> None:
    """The lower namespace has a Secret of that name of its own: never overwritten, and the
    pod, which would get it instead of its own, waits, saying why."""
    upper, lower = federation.upper, federation.clusters["lower-2"]
    apply(lower, namespace("taken"))
    lower.kubectl("create", "secret", "generic", "creds", "-n", "taken", "--from-literal=a=theirs")
    apply(upper, namespace("taken"))
    upper.kubectl("create", "secret", "generic", "creds", "-n", "taken", "--from-literal=a=ours")
    volume = {"name": "creds", "secret": {"secretName": "creds"}}
    apply(upper, bound_pod("uses-creds", "taken", "vk-lower-2", volumes=[volume]))

    def waiting_reason() -> str | None:
        pod = get_json(upper, "pod", "-n", "taken", "uses-creds")
        for condition in pod["status"].get("conditions") or []:
            if condition["type"] == "PodScheduled" and condition.get("reason"):
                return str(condition["reason"])
        return None

    wait_for(lambda: waiting_reason() == "LowerNameTaken", "the pod to say the name is taken")
    assert lower.kubectl("get", "pod", "-n", "taken", "uses-creds", check=False).returncode != 0
    theirs = get_json(lower, "secret", "-n", "taken", "creds")
    assert keys.MANAGED_BY_LABEL not in (theirs["metadata"].get("labels") or {})

    lower.kubectl("delete", "secret", "creds", "-n", "taken")
    wait_for(
        lambda: (
            get_json(upper, "pod", "-n", "taken", "uses-creds")["status"].get("phase") == "Running"
        ),
        "the pod to run once the name is free",
    )
    ours = get_json(lower, "secret", "-n", "taken", "creds")
    assert ours["data"] == get_json(upper, "secret", "-n", "taken", "creds")["data"]
    upper.kubectl("delete", "namespace", "taken", "--wait=false")


def test_config_maps_and_secrets_follow_their_pods_down_and_away(federation: Federation) -> None:
    upper, lower = federation.upper, federation.clusters["lower-2"]
    deployment = federated_deployment(
        "configured", "config", 1, node_selector={keys.CLUSTER_ID_LABEL: "lower-2"}
    )
    pod_spec = deployment["spec"]["template"]["spec"]
    pod_spec["volumes"] = [{"name": "settings", "configMap": {"name": "settings"}}]
    pod_spec["containers"][0]["env"] = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "token", "key": "value"}}}
    ]
    apply(upper, namespace("config"))
    upper.kubectl("create", "configmap", "settings", "-n", "config", "--from-literal=mode=v1")
    upper.kubectl(
        "create", "secret", "generic", "token", "-n", "config", "--from-literal=value=s3cret"
    )
    upper.kubectl("create", "configmap", "unused", "-n", "config", "--from-literal=x=y")
    apply(upper, deployment)
    rollout(upper, "configured", "config")

    copy = get_json(lower, "configmap", "-n", "config", "settings")
    assert copy["data"] == {"mode": "v1"}
    assert copy["metadata"]["labels"][keys.MANAGED_BY_LABEL] == keys.MANAGED_BY_VALUE
    secret = get_json(lower, "secret", "-n", "config", "token")
    assert secret["data"] == get_json(upper, "secret", "-n", "config", "token")["data"]
    assert lower.kubectl("get", "configmap", "-n", "config", "unused", check=False).returncode != 0

    upper.kubectl("patch", "configmap", "settings", "-n", "config", "-p", '{"data":{"mode":"v2"}}')
    wait_for(
        lambda: get_json(lower, "configmap", "-n", "config", "settings")["data"] == {"mode": "v2"},
        "the update to reach the lower copy",
    )

    upper.kubectl("delete", "deployment", "configured", "-n", "config")

    def copies_gone() -> bool:
        names = lower.kubectl(
            "get", "configmaps,secrets", "-n", "config", "-o", "name"
        ).stdout.split()
        return "configmap/settings" not in names and "secret/token" not in names

    wait_for(copies_gone, "copies no longer referenced to be removed")
    upper.kubectl("delete", "namespace", "config", "--wait=false")


def test_a_pod_naming_kube_root_ca_runs_below_with_the_lower_clusters_own(
    federation: Federation,
) -> None:
    """A hand-made copy of the token volume names kube-root-ca.crt: every lower namespace
    has its own, the CA of the apiserver the pod talks to (until 2026-11-27 the pod waited
    for good, its copy refused as a name taken)."""
    upper, lower = federation.upper, federation.clusters["lower-2"]
    deployment = federated_deployment(
        "own-token", "ca", 1, node_selector={keys.CLUSTER_ID_LABEL: "lower-2"}
    )
    pod_spec = deployment["spec"]["template"]["spec"]
    pod_spec["automountServiceAccountToken"] = False
    pod_spec["volumes"] = [
        {
            "name": "token",
            "projected": {
                "sources": [
                    {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
                    {"configMap": {"name": "kube-root-ca.crt"}},
                ]
            },
        }
    ]
    apply(upper, namespace("ca"), deployment)
    rollout(upper, "own-token", "ca")
    ca = get_json(lower, "configmap", "-n", "ca", "kube-root-ca.crt")
    assert keys.MANAGED_BY_LABEL not in (ca["metadata"].get("labels") or {})
    assert ca["data"] != get_json(upper, "configmap", "-n", "ca", "kube-root-ca.crt")["data"]
    upper.kubectl("delete", "namespace", "ca", "--wait=false")


def test_a_namespace_deleted_above_goes_below_unless_made_by_someone_else(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-2"]
    # The lower cluster's own namespace of that name, there before any pod of ours.
    apply(lower, namespace("theirs"))
    for name in ("emptied", "theirs"):
        apply(upper, namespace(name))
        apply(
            upper,
            federated_deployment("app", name, 1, node_selector={keys.CLUSTER_ID_LABEL: "lower-2"}),
        )
        rollout(upper, "app", name)
    made = get_json(lower, "namespace", "emptied")["metadata"]["labels"]
    assert made[keys.MANAGED_BY_LABEL] == keys.MANAGED_BY_VALUE
    assert keys.MANAGED_BY_LABEL not in (
        get_json(lower, "namespace", "theirs")["metadata"].get("labels") or {}
    )

    upper.kubectl("delete", "namespace", "emptied", "theirs", "--timeout=120s")

    def lower_namespaces() -> set[str]:
        return set(lower.kubectl("get", "namespaces", "-o", "name").stdout.split())

    wait_for(
        lambda: "namespace/emptied" not in lower_namespaces(),
        "the lower namespace made for the deleted upper one to go",
    )
    assert "namespace/theirs" in lower_namespaces()
    assert lower.kubectl("get", "pods", "-n", "theirs", "-o", "name").stdout.strip() == ""


def test_a_pod_of_an_account_that_mounts_no_token_above_gets_none_below(
    federation: Federation,
) -> None:
    """The upper `default` account hardened (no token mounted) is never copied: the lower
    cluster's own `default` would give the pod a token below."""
    upper, lower = federation.upper, federation.clusters["lower-1"]
    apply(upper, namespace("hardened"))
    wait_for_default_account(upper, "hardened")
    upper.kubectl(
        "patch", "serviceaccount", "default", "-n", "hardened",
        "-p", '{"automountServiceAccountToken":false}',
    )  # fmt: skip
    apply(upper, bound_pod("quiet", "hardened", "vk-lower-1"))
    wait_for(
        lambda: (
            get_json(upper, "pod", "-n", "hardened", "quiet")["status"].get("phase") == "Running"
        ),
        "the pod to run below",
    )
    below = get_json(lower, "pod", "-n", "hardened", "quiet")
    volumes = [v["name"] for v in below["spec"].get("volumes") or []]
    assert not any(name.startswith("kube-api-access-") for name in volumes), volumes
    assert below["spec"]["automountServiceAccountToken"] is False
    upper.kubectl("delete", "namespace", "hardened", "--wait=false")


def jwt_claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


def test_a_token_secret_a_pod_mounts_holds_a_token_of_the_lower_clusters_account(
    federation: Federation,
) -> None:
    """A long-lived token Secret (the way to one since 1.24): the upper token would not
    authenticate below; the copy is filled by the lower tokens controller, for the lower
    copy of the account, which goes down first."""
    upper, lower = federation.upper, federation.clusters["lower-1"]
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "robot", "namespace": "robots"},
    }
    token = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/service-account-token",
        "metadata": {
            "name": "robot-token",
            "namespace": "robots",
            "annotations": {"kubernetes.io/service-account.name": "robot"},
        },
    }
    apply(upper, namespace("robots"))
    wait_for_default_account(upper, "robots")
    apply(upper, account, token)
    wait_for(
        lambda: (
            "token" in (get_json(upper, "secret", "-n", "robots", "robot-token").get("data") or {})
        ),
        "the upper tokens controller to fill the Secret",
    )
    pod = bound_pod(
        "robot", "robots", "vk-lower-1",
        volumes=[{"name": "token", "secret": {"secretName": "robot-token"}}],
    )  # fmt: skip
    apply(upper, pod)
    wait_for(
        lambda: get_json(upper, "pod", "-n", "robots", "robot")["status"].get("phase") == "Running",
        "the pod mounting the token Secret to run below",
    )

    def filled_below() -> dict[str, Any]:
        secret = get_json(lower, "secret", "-n", "robots", "robot-token")
        return secret if "token" in (secret.get("data") or {}) else {}

    below = wait_for(filled_below, "the lower tokens controller to fill the copy")
    lower_account = get_json(lower, "serviceaccount", "-n", "robots", "robot")
    claims = jwt_claims(base64.b64decode(below["data"]["token"]).decode())
    assert (
        claims["kubernetes.io/serviceaccount/service-account.uid"]
        == (lower_account["metadata"]["uid"])
    ), "a token of the lower copy of the account, not the upper one's"
    upper.kubectl("delete", "pod", "robot", "-n", "robots")

    def copies_gone() -> bool:
        names = lower.kubectl("get", "secrets,serviceaccounts", "-n", "robots", "-o", "name")
        left = set(names.stdout.split())
        return not left & {"secret/robot-token", "serviceaccount/robot"}

    wait_for(copies_gone, "the copies no pod needs any more to be removed")
    upper.kubectl("delete", "namespace", "robots", "--wait=false")


def test_a_pods_service_account_and_priority_class_follow_it_down_and_away(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-2"]
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "builder", "namespace": "ranked"},
        "automountServiceAccountToken": False,
    }
    priority_class = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": "kubestrata-e2e-high"},
        "value": 1000,
        "globalDefault": False,
    }
    apply(upper, namespace("ranked"), account, priority_class)
    pod = bound_pod(
        "ranked",
        "ranked",
        "vk-lower-2",
        serviceAccountName="builder",
        priorityClassName="kubestrata-e2e-high",
    )
    apply(upper, pod)
    wait_for(
        lambda: (
            get_json(upper, "pod", "-n", "ranked", "ranked")["status"].get("phase") == "Running"
        ),
        "the pod with its own service account and priority class to run below",
    )
    below = get_json(lower, "pod", "-n", "ranked", "ranked")
    assert (below["spec"]["priority"], below["spec"]["serviceAccountName"]) == (1000, "builder")
    copied_account = get_json(lower, "serviceaccount", "-n", "ranked", "builder")
    assert copied_account["automountServiceAccountToken"] is False
    copied_class = get_json(lower, "priorityclass", "kubestrata-e2e-high")
    assert copied_class["metadata"]["labels"][keys.MANAGED_BY_LABEL] == keys.MANAGED_BY_VALUE
    assert (copied_class["value"], copied_class.get("globalDefault", False)) == (1000, False)

    upper.kubectl(
        "patch", "serviceaccount", "builder", "-n", "ranked",
        "-p", '{"imagePullSecrets":[{"name":"registry"}]}',
    )  # fmt: skip
    wait_for(
        lambda: (
            get_json(lower, "serviceaccount", "-n", "ranked", "builder").get("imagePullSecrets")
            == [{"name": "registry"}]
        ),
        "the service account's change to reach its copy",
    )

    upper.kubectl("delete", "pod", "ranked", "-n", "ranked")

    def copies_gone() -> bool:
        accounts = lower.kubectl("get", "serviceaccounts", "-n", "ranked", "-o", "name").stdout
        classes = lower.kubectl("get", "priorityclasses", "-o", "name").stdout
        return "builder" not in accounts and "kubestrata-e2e-high" not in classes

    wait_for(copies_gone, "the copies no pod needs any more to be removed")
    upper.kubectl("delete", "namespace", "ranked", "--wait=false")
    upper.kubectl("delete", "priorityclass", "kubestrata-e2e-high")


def test_an_in_place_resize_above_resizes_the_pod_below(federation: Federation) -> None:
    upper, lower = federation.upper, federation.clusters["lower-2"]
    apply(upper, namespace("resized"))
    wait_for_default_account(upper, "resized")
    before = {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "200m"}}
    pod = bound_pod("resized", "resized", "vk-lower-2")
    pod["spec"]["containers"][0]["resources"] = before

    def reported(cluster: LocalCluster) -> Any:
        statuses = get_json(cluster, "pod", "-n", "resized", "resized")["status"]
        return [c.get("resources") for c in statuses.get("containerStatuses") or []]

    apply(upper, pod)
    # The upper apiserver resizes only a pod whose statuses report resources: those of
    # the lower kubelet, mirrored up.
    wait_for(lambda: reported(upper) == [before], "the pod's resources to be reported above")
    after = {"requests": {"cpu": "150m", "memory": "64Mi"}, "limits": {"cpu": "300m"}}
    upper.kubectl(
        "patch", "pod", "resized", "-n", "resized", "--subresource", "resize",
        "-p", json.dumps({"spec": {"containers": [{"name": "app", "resources": after}]}}),
    )  # fmt: skip
    wait_for(
        lambda: (
            get_json(lower, "pod", "-n", "resized", "resized")["spec"]["containers"][0]["resources"]
            == after
        ),
        "the resize to reach the lower pod",
    )
    wait_for(lambda: reported(upper) == [after], "the resize to be reported above")
    # Recorded once made: the next sync does not resize again what a lower webhook might
    # have changed, and the next resize above goes down as well.
    annotations = get_json(lower, "pod", "-n", "resized", "resized")["metadata"]["annotations"]
    assert json.loads(annotations[keys.UPPER_RESOURCES_ANNOTATION]) == {"app": after}
    again = {"requests": {"cpu": "120m", "memory": "64Mi"}, "limits": {"cpu": "300m"}}
    upper.kubectl(
        "patch", "pod", "resized", "-n", "resized", "--subresource", "resize",
        "-p", json.dumps({"spec": {"containers": [{"name": "app", "resources": again}]}}),
    )  # fmt: skip
    wait_for(lambda: reported(upper) == [again], "the second resize to be reported above")
    upper.kubectl("delete", "namespace", "resized", "--wait=false")


def manual_volume(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "storageClassName": "kubestrata-e2e-manual",
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "hostPath": {"path": f"/tmp/{name}"},
        },
    }


def data_claim(namespace_name: str, storage_class_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data", "namespace": namespace_name},
        "spec": {
            "storageClassName": storage_class_name,
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }


def test_a_claim_bound_above_is_bound_below_to_a_lower_volume_and_stays(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-2"]
    claim = data_claim("claims", "kubestrata-e2e-manual")
    apply(upper, namespace("claims"), manual_volume("kubestrata-e2e-upper"), claim)
    apply(lower, manual_volume("kubestrata-e2e-lower"))
    wait_for(
        lambda: get_json(upper, "pvc", "-n", "claims", "data")["status"].get("phase") == "Bound",
        "the claim to be bound above",
    )
    wait_for_default_account(upper, "claims")
    volumes = [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]

    def run_stateful_pod(description: str) -> None:
        apply(upper, bound_pod("stateful", "claims", "vk-lower-2", volumes=volumes))
        wait_for(
            lambda: (
                get_json(upper, "pod", "-n", "claims", "stateful")["status"].get("phase")
                == "Running"
            ),
            description,
        )

    run_stateful_pod("the pod with a claim to run below")
    copy = get_json(lower, "pvc", "-n", "claims", "data")
    assert (copy["status"]["phase"], copy["spec"]["volumeName"]) == (
        "Bound",
        "kubestrata-e2e-lower",
    )

    upper.kubectl("label", "pvc", "data", "-n", "claims", "tier=gold")
    wait_for(
        lambda: (
            get_json(lower, "pvc", "-n", "claims", "data")["metadata"]["labels"].get("tier")
            == "gold"
        ),
        "the claim's new label to reach its copy",
    )
    relabelled = get_json(lower, "pvc", "-n", "claims", "data")
    assert relabelled["metadata"]["uid"] == copy["metadata"]["uid"]
    assert "deletionTimestamp" not in relabelled["metadata"]
    assert (relabelled["status"]["phase"], relabelled["spec"]["volumeName"]) == (
        "Bound",
        "kubestrata-e2e-lower",
    )

    # A StatefulSet deletes and makes its pods again: the copy, and its volume, outlive them.
    upper.kubectl("delete", "pod", "stateful", "-n", "claims")
    run_stateful_pod("the pod made again to run below")
    kept = get_json(lower, "pvc", "-n", "claims", "data")
    assert kept["metadata"]["uid"] == copy["metadata"]["uid"]
    assert "deletionTimestamp" not in kept["metadata"]

    upper.kubectl("delete", "namespace", "claims", "--wait=false")
    upper.kubectl("delete", "pv", "kubestrata-e2e-upper", "--wait=false")
    wait_for(
        lambda: lower.kubectl("get", "pvc", "-n", "claims", "data", check=False).returncode != 0,
        "the copy to go with its upper claim",
    )
    lower.kubectl("delete", "pv", "kubestrata-e2e-lower", "--wait=false")


def test_a_pod_of_a_claim_for_a_volume_made_by_hand_is_placed_nowhere(
    federation: Federation,
) -> None:
    """Bound above to a volume made there by hand: below, a copy of its claim would bind
    whichever lower volume matched, so none is made, and no estimator takes the pod."""
    upper = federation.upper
    volume = manual_volume("kubestrata-e2e-static")
    volume["spec"]["storageClassName"] = ""
    claim = data_claim("static", "")
    apply(upper, namespace("static"), volume, claim)
    wait_for(
        lambda: get_json(upper, "pvc", "-n", "static", "data")["status"].get("phase") == "Bound",
        "the claim to be bound above",
    )
    wait_for_default_account(upper, "static")
    try:
        pod = cluster_pod("static", "static", "")
        del pod["spec"]["nodeSelector"]
        pod["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]
        apply(upper, pod)

        def refused_everywhere() -> bool:
            events = get_json(
                upper,
                "events",
                "-n",
                "static",
                "--field-selector",
                "involvedObject.name=static,reason=FailedScheduling",
            )["items"]
            return any(
                all(
                    f"vk-{cluster}: claim data asks for a volume made by hand" in event["message"]
                    for cluster in ("lower-1", "lower-2")
                )
                for event in events
            )

        wait_for(refused_everywhere, "each cluster to refuse the pod for its claim")
        assert not get_json(upper, "pod", "-n", "static", "static")["spec"].get("nodeName")
    finally:
        upper.kubectl("delete", "namespace", "static", "--wait=false")
        upper.kubectl("delete", "pv", "kubestrata-e2e-static", "--wait=false")


def storage_class(name: str, provisioner: str) -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": name},
        "provisioner": provisioner,
        "volumeBindingMode": "WaitForFirstConsumer",
    }


def test_a_claim_waiting_for_its_first_consumer_binds_above_and_below_and_keeps_its_cluster(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-2"]
    wffc = "kubestrata-e2e-wffc"
    below = manual_volume("kubestrata-e2e-wffc-lower")
    below["spec"]["storageClassName"] = wffc
    apply(upper, storage_class(wffc, keys.LOWER_CLUSTER_PROVISIONER), namespace("wffc"))
    apply(lower, storage_class(wffc, "kubernetes.io/no-provisioner"), below)
    apply(upper, data_claim("wffc", wffc))
    wait_for_default_account(upper, "wffc")
    volumes = [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]

    def stateful(name: str = "stateful", cluster: str | None = None) -> dict[str, Any]:
        pod = cluster_pod(name, "wffc", cluster or "")
        if cluster is None:
            del pod["spec"]["nodeSelector"]
        pod["spec"]["volumes"] = volumes
        return pod

    def runs_on() -> str | None:
        pod = get_json(upper, "pod", "-n", "wffc", "stateful")
        return pod["spec"].get("nodeName") if pod["status"].get("phase") == "Running" else None

    def refused(name: str, words: str) -> bool:
        events = get_json(
            upper,
            "events",
            "-n",
            "wffc",
            "--field-selector",
            f"involvedObject.name={name},reason=FailedScheduling",
        )["items"]
        return any(words in str(event["message"]) for event in events)

    # Only lower-2 has the class: lower-1's estimator refuses the pod (the scheduler's
    # first try may come before its cache has the upper class, and say so instead).
    apply(upper, stateful("misplaced", "lower-1"))
    wait_for(
        lambda: refused(
            "misplaced", f"vk-lower-1: lower cluster lower-1 has no storage class {wffc}"
        ),
        "the pod held to lower-1 to be refused for the class lower-1 lacks",
    )
    upper.kubectl("delete", "pod", "misplaced", "-n", "wffc")

    apply(upper, stateful())
    wait_for(lambda: runs_on() == "vk-lower-2", "the pod of a waiting claim to run below")
    above = get_json(upper, "pvc", "-n", "wffc", "data")
    assert above["status"]["phase"] == "Bound"
    assert above["spec"]["volumeName"] == f"pvc-{above['metadata']['uid']}"
    copy = get_json(lower, "pvc", "-n", "wffc", "data")
    assert (copy["status"]["phase"], copy["spec"]["volumeName"]) == (
        "Bound",
        below["metadata"]["name"],
    )

    # Made again, with lower-1 now able to make such volumes too, the pod goes where its
    # claim's data is.
    other = federation.clusters["lower-1"]
    apply(other, storage_class(wffc, "kubernetes.io/no-provisioner"))
    upper.kubectl("delete", "pod", "stateful", "-n", "wffc")
    apply(upper, stateful())
    wait_for(lambda: runs_on() == "vk-lower-2", "the pod made again to run in the same cluster")
    assert (
        get_json(lower, "pvc", "-n", "wffc", "data")["metadata"]["uid"] == copy["metadata"]["uid"]
    )

    upper.kubectl("delete", "pod", "stateful", "-n", "wffc")
    upper.kubectl("delete", "pvc", "data", "-n", "wffc")
    volume = above["spec"]["volumeName"]
    wait_for(
        lambda: upper.kubectl("get", "pv", volume, check=False).returncode != 0,
        "the upper volume to go with its claim",
    )
    wait_for(
        lambda: lower.kubectl("get", "pvc", "-n", "wffc", "data", check=False).returncode != 0,
        "the copy to go with its upper claim",
    )
    upper.kubectl("delete", "namespace", "wffc", "--wait=false")
    upper.kubectl("delete", "storageclass", wffc)
    lower.kubectl("delete", "storageclass", wffc)
    other.kubectl("delete", "storageclass", wffc)
    lower.kubectl("delete", "pv", below["metadata"]["name"], "--wait=false")


def test_a_pod_using_the_lower_nodes_host_fails_above_and_is_not_created_below(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-1"]
    apply(upper, namespace("hostile"))
    wait_for_default_account(upper, "hostile")
    apply(upper, bound_pod("sniffer", "hostile", "vk-lower-1", hostNetwork=True))

    def failed_reason() -> str | None:
        status = get_json(upper, "pod", "-n", "hostile", "sniffer")["status"]
        return status.get("reason") if status.get("phase") == "Failed" else None

    wait_for(lambda: failed_reason() == "HostAccessRefused", "the pod to fail with the reason")
    events = get_json(
        upper, "events", "-n", "hostile", "--field-selector", "involvedObject.name=sniffer"
    )["items"]
    assert any(
        e["reason"] == "HostAccessRefused" and "spec.hostNetwork" in e["message"] for e in events
    )
    assert lower.kubectl("get", "pod", "-n", "hostile", "sniffer", check=False).returncode != 0
    upper.kubectl("delete", "namespace", "hostile", "--wait=false")


def test_a_pod_a_lower_quota_refuses_waits_saying_why_and_runs_once_it_is_let_in(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-1"]
    apply(upper, namespace("capped"))
    wait_for_default_account(upper, "capped")
    apply(lower, namespace("capped"))
    lower.kubectl("create", "quota", "full", "-n", "capped", "--hard=pods=0")
    apply(upper, bound_pod("refused", "capped", "vk-lower-1"))

    def scheduled() -> dict[str, Any]:
        status = get_json(upper, "pod", "-n", "capped", "refused")["status"]
        found = [c for c in status.get("conditions") or [] if c["type"] == "PodScheduled"]
        return {"phase": status.get("phase"), **(found[0] if found else {})}

    def refusal() -> dict[str, Any]:
        now = scheduled()
        return now if now.get("reason") == "LowerClusterRefused" else {}

    refused = wait_for(refusal, "the refusal below on the upper pod")
    assert (refused["phase"], refused["status"]) == ("Pending", "False")
    assert refused["message"].startswith("lower cluster lower-1 refused the pod: ")
    assert "exceeded quota: full" in refused["message"]

    lower.kubectl("delete", "quota", "full", "-n", "capped")
    wait_for(lambda: scheduled()["phase"] == "Running", "the pod to run once let in", timeout=120)
    assert (scheduled()["status"], scheduled().get("reason")) == ("True", None)
    upper.kubectl("delete", "namespace", "capped", "--wait=false")


# Last: after its lower apiserver restarts, kwok's simulated nodes miss heartbeats and the
# lower controller-manager marks new pods there NotReady, which the virtual node reports.
def reflected_endpoints(lower: LocalCluster) -> list[str] | None:
    """Addresses of the lower copy of Service svc/api, sorted (None: no copy, nor slices).
    A list: the simulated lower clusters hand out pod IPs from the same range."""
    found = lower.kubectl("get", "service", "-n", "svc", "api", "-o", "json", check=False)
    slices = get_json(lower, "endpointslices", "-n", "svc", "-l", "kubernetes.io/service-name=api")
    if found.returncode != 0 and not slices["items"]:
        return None
    return sorted(
        a for s in slices["items"] for e in s.get("endpoints") or [] for a in e["addresses"]
    )


def endpoints_are(lower: LocalCluster, expected: list[str] | None) -> bool:
    return reflected_endpoints(lower) == expected


def test_a_service_and_its_endpoints_reach_every_cluster_running_its_pods(
    federation: Federation,
) -> None:
    upper = federation.upper
    apply(
        upper,
        namespace("svc"),
        federated_deployment("api", "svc", 4, cpu="6"),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "api", "namespace": "svc"},
            "spec": {
                "type": "NodePort",
                "selector": {"app": "api"},
                "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}],
            },
        },
    )
    rollout(upper, "api", "svc")
    upper_ip = get_json(upper, "service", "-n", "svc", "api")["spec"]["clusterIP"]

    def upper_addresses() -> list[str]:
        slices = get_json(
            upper, "endpointslices", "-n", "svc", "-l", "kubernetes.io/service-name=api"
        )["items"]
        found = sorted(a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"])
        return found if len(found) == 4 else []

    everywhere = wait_for(upper_addresses, "4 endpoints")
    for name in ("lower-1", "lower-2"):
        lower = federation.clusters[name]
        # Every cluster sees the endpoints of all clusters, not only its own pods.
        wait_for(partial(endpoints_are, lower, everywhere), f"endpoints in {name}")
        service = get_json(lower, "service", "-n", "svc", "api")
        assert service["spec"]["type"] == "ClusterIP" and "selector" not in service["spec"]
        assert service["spec"]["clusterIP"] != upper_ip
        assert service["metadata"]["labels"][keys.MANAGED_BY_LABEL] == keys.MANAGED_BY_VALUE

    upper.kubectl("delete", "service", "-n", "svc", "api")
    for name in ("lower-1", "lower-2"):
        lower = federation.clusters[name]
        wait_for(partial(endpoints_are, lower, None), f"the copies in {name} removed")
    upper.kubectl("delete", "namespace", "svc", "--wait=false")


def test_lower_apiserver_down_makes_node_not_ready_then_recovers(federation: Federation) -> None:
    lower = federation.clusters["lower-1"]
    lower.stop_component("kube-apiserver")
    try:
        wait_for(
            lambda: node_ready(federation, "vk-lower-1") == "Unknown",
            "vk-lower-1 NotReady",
            timeout=120,
            interval=2,
        )
    finally:
        lower.restart("kube-apiserver")
    wait_for(
        lambda: node_ready(federation, "vk-lower-1") == "True",
        "vk-lower-1 Ready again",
        timeout=120,
        interval=2,
    )
    taints = get_json(federation.upper, "node", "vk-lower-1")["spec"].get("taints", [])
    wait_for(
        lambda: (
            [t["key"] for t in get_json(federation.upper, "node", "vk-lower-1")["spec"]["taints"]]
            == ["virtual-kubelet.io/provider"]
        ),
        f"unreachable taints cleared (now {taints})",
    )
