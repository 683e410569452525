"""The multischeduler end to end: the stock upper kube-scheduler with the extender, the
estimators in the virtual nodes, kwok nodes whose free CPU is fragmented by pinned
foreign pods.

The fragmented nodes are tainted and labelled as a pool of their own, and the test pods
select that pool (a nodeSelector and toleration the webhook stashes and the virtual node
restores below), so the rest of the suite neither sees nor disturbs them:

    lower-1: frag-a 8 cpu, 2 taken -> 6 free    frag-b 8 cpu, 7 taken -> 1 free
    lower-2: frag-a 8 cpu, 4 taken -> 4 free    frag-b 8 cpu, 4 taken -> 4 free (disk=ssd)
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc
import pytest

from harness.federation import MULTISCHEDULER_ACCOUNT, Federation, virtual_node_name
from harness.localcluster import LocalCluster, NodeSpec
from kubekit import keys, stash
from kubekit.estimatorapi import estimator_pb2, estimator_pb2_grpc

from .helpers import (
    apply,
    bound_pod,
    federated_namespace,
    get_json,
    namespace,
    pods_by_name,
    refusing_policy,
    wait_for,
)

NAMESPACE = "frag"
POOL = {"kubestrata.io/e2e-pool": "frag"}
POOL_TAINT = {"key": "kubestrata.io/e2e-pool", "value": "frag", "effect": "NoSchedule"}
TAKEN = {"lower-1": {"a": "2", "b": "7"}, "lower-2": {"a": "4", "b": "4"}}


def frag_node(cluster: str, suffix: str) -> str:
    return f"{cluster}-frag-{suffix}"


def foreign_pod(name: str, node: str, cpu: str) -> dict[str, Any]:
    return bound_pod(
        name,
        "default",
        node,
        containers=[
            {
                "name": "app",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": cpu}},
            }
        ],
    )


def pins_running(lower: LocalCluster, count: int) -> bool:
    pods = pods_by_name(lower, "default", "!app.kubernetes.io/managed-by").values()
    pins = [p for p in pods if p["metadata"]["name"].startswith("pin-")]
    return len(pins) == count and all(p["status"].get("phase") == "Running" for p in pins)


@pytest.fixture(scope="module")
def fragmented(federation: Federation) -> Iterator[Federation]:
    # Cleaned up even when the set-up fails half way: later modules count the nodes.
    try:
        for cluster, taken in TAKEN.items():
            lower = federation.clusters[cluster]
            assert isinstance(lower, LocalCluster)
            lower.add_nodes(
                NodeSpec(
                    name=frag_node(cluster, suffix),
                    cpu="8",
                    memory="32Gi",
                    pods=110,
                    # The region every node of the cluster has, so the virtual node keeps it.
                    labels={
                        **POOL,
                        "topology.kubernetes.io/region": cluster,
                        **({"kubestrata.io/e2e-disk": "ssd"} if cluster == "lower-2" else {}),
                    },
                    taints=(POOL_TAINT,),
                )
                for suffix in taken
            )
            apply(
                lower,
                *(
                    foreign_pod(f"pin-{suffix}", frag_node(cluster, suffix), cpu)
                    for suffix, cpu in taken.items()
                ),
            )
            wait_for(
                partial(pins_running, lower, len(taken)), f"the pinned pods of {cluster} Running"
            )
        apply(federation.upper, federated_namespace(NAMESPACE))
        yield federation
    finally:
        federation.upper.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        for cluster, taken in TAKEN.items():
            lower = federation.clusters[cluster]
            lower.kubectl(
                "delete",
                "pod",
                "-n",
                "default",
                *(f"pin-{s}" for s in taken),
                "--force",
                "--ignore-not-found",
                "--wait=false",
            )
            lower.kubectl(
                "delete",
                "node",
                *(frag_node(cluster, s) for s in taken),
                "--ignore-not-found",
                "--wait=false",
            )


def frag_pod(
    name: str,
    cpu: str,
    labels: dict[str, str] | None = None,
    selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels or {"app": name}},
        "spec": {
            "nodeSelector": {**POOL, **(selector or {})},
            "tolerations": [{**POOL_TAINT, "operator": "Equal"}],
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


def upper_pod(federation: Federation, name: str) -> Any:
    return get_json(federation.upper, "pod", "-n", NAMESPACE, name)


def running_on(federation: Federation, name: str, node: str) -> bool:
    pod = upper_pod(federation, name)
    return bool(pod["spec"].get("nodeName") == node and pod["status"].get("phase") == "Running")


def lower_pods(federation: Federation, selector: str) -> dict[str, dict[str, Any]]:
    return {
        f"{cluster}/{name}": pod
        for cluster in TAKEN
        for name, pod in pods_by_name(federation.clusters[cluster], NAMESPACE, selector).items()
    }


def failed_scheduling(federation: Federation, name: str) -> str:
    events = get_json(
        federation.upper,
        "events",
        "-n",
        NAMESPACE,
        "--field-selector",
        f"involvedObject.name={name},reason=FailedScheduling",
    )["items"]
    return str(events[-1]["message"]) if events else ""


def delete_pods(federation: Federation, selector: str) -> None:
    """Deletes test pods above and waits until they are gone below, so their room is back."""
    federation.upper.kubectl(
        "delete", "pods", "-n", NAMESPACE, "-l", selector, "--grace-period=0", "--force"
    )
    wait_for(lambda: not lower_pods(federation, selector), f"pods {selector} gone below")


def test_a_pod_that_fits_one_node_of_one_cluster_lands_there_and_runs(
    fragmented: Federation,
) -> None:
    apply(fragmented.upper, frag_pod("five", "5"))
    try:
        wait_for(lambda: running_on(fragmented, "five", "vk-lower-1"), "five Running on vk-lower-1")
        below = lower_pods(fragmented, "app=five")
        assert list(below) == ["lower-1/five"]
        assert below["lower-1/five"]["spec"]["nodeName"] == frag_node("lower-1", "a")
    finally:
        delete_pods(fragmented, "app=five")


def test_a_pod_no_node_fits_stays_unbound_above_with_each_clusters_reason(
    fragmented: Federation,
) -> None:
    # lower-2's two nodes have 8 cpu free together: the sum takes it, no node does.
    apply(fragmented.upper, frag_pod("seven", "7"))
    try:
        message = wait_for(
            lambda: failed_scheduling(fragmented, "seven"), "a FailedScheduling event"
        )
        for cluster in TAKEN:
            assert f"vk-{cluster}: 0/" in message, message
        assert "Insufficient cpu" in message, message
        assert "vk-lower-2: 0/" in message and "2 Insufficient cpu" in message, message
        assert not upper_pod(fragmented, "seven")["spec"].get("nodeName")
        assert not lower_pods(fragmented, "app=seven")
    finally:
        delete_pods(fragmented, "app=seven")


def test_a_burst_onto_room_for_exactly_k_runs_k_and_leaves_the_rest_pending_above(
    fragmented: Federation,
) -> None:
    # 2-cpu pods: lower-1 takes 3 (frag-a) + 0, lower-2 takes 2 + 2.
    room, burst = 7, 20
    apply(fragmented.upper, *(frag_pod(f"burst-{i}", "2", {"burst": "yes"}) for i in range(burst)))
    try:

        def settled() -> tuple[int, int] | None:
            pods = pods_by_name(fragmented.upper, NAMESPACE, "burst=yes").values()
            running = sum(p["status"].get("phase") == "Running" for p in pods)
            unbound = sum(not p["spec"].get("nodeName") for p in pods)
            return (running, unbound) if running + unbound == burst else None

        wait_for(lambda: (settled() or (0, 0))[0] == room, f"{room} burst pods Running")
        # Settled, not passing through: nothing more is bound a while later.
        time.sleep(5)
        running, unbound = settled() or (0, 0)
        assert (running, unbound) == (room, burst - room)
        below = lower_pods(fragmented, "burst=yes")
        assert len(below) == room
        assert all(p["status"].get("phase") == "Running" for p in below.values())
        stranded = [name for name, p in below.items() if not p["spec"].get("nodeName")]
        assert stranded == []
    finally:
        delete_pods(fragmented, "burst=yes")


def test_a_stashed_node_selector_only_lower_2_matches_sends_the_pod_there(
    fragmented: Federation,
) -> None:
    apply(fragmented.upper, frag_pod("ssd", "1", selector={"kubestrata.io/e2e-disk": "ssd"}))
    try:
        wait_for(lambda: running_on(fragmented, "ssd", "vk-lower-2"), "ssd Running on vk-lower-2")
        above = upper_pod(fragmented, "ssd")
        # The upper scheduler never saw the pool selector: the webhook stashed it.
        assert "kubestrata.io/e2e-disk" not in (above["spec"].get("nodeSelector") or {})
        assert list(lower_pods(fragmented, "app=ssd")) == ["lower-2/ssd"]
    finally:
        delete_pods(fragmented, "app=ssd")


def runtime_class(name: str, overhead_cpu: str) -> dict[str, Any]:
    return {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": name},
        "handler": "runsc",
        "overhead": {"podFixed": {"cpu": overhead_cpu}},
    }


def class_pod(name: str, runtime_class_name: str) -> dict[str, Any]:
    pod = frag_pod(name, "1")
    pod["spec"]["runtimeClassName"] = runtime_class_name
    return pod


def test_a_runtime_class_only_lower_2_has_sends_the_pod_there_with_lower_2_s_overhead(
    fragmented: Federation,
) -> None:
    lower_2 = fragmented.clusters["lower-2"]
    apply(fragmented.upper, runtime_class("e2e-sandbox", "500m"), runtime_class("e2e-none", "1"))
    apply(lower_2, runtime_class("e2e-sandbox", "250m"))
    apply(
        fragmented.upper,
        class_pod("sandboxed", "e2e-sandbox"),
        class_pod("nowhere", "e2e-none"),
    )
    try:
        wait_for(
            lambda: running_on(fragmented, "sandboxed", "vk-lower-2"),
            "the pod of a class only lower-2 has Running there",
        )
        assert upper_pod(fragmented, "sandboxed")["spec"]["overhead"] == {"cpu": "500m"}
        below = lower_pods(fragmented, "app=sandboxed")
        assert below["lower-2/sandboxed"]["spec"]["overhead"] == {"cpu": "250m"}

        message = wait_for(
            lambda: failed_scheduling(fragmented, "nowhere"), "a FailedScheduling event"
        )
        for cluster in TAKEN:
            reason = f"vk-{cluster}: lower cluster {cluster} has no runtime class e2e-none"
            assert reason in message, message
        assert not upper_pod(fragmented, "nowhere")["spec"].get("nodeName")
    finally:
        delete_pods(fragmented, "app in (sandboxed, nowhere)")
        fragmented.upper.kubectl("delete", "runtimeclass", "e2e-sandbox", "e2e-none")
        lower_2.kubectl("delete", "runtimeclass", "e2e-sandbox")


def quotas_digest(federation: Federation, node: str) -> str:
    annotations = get_json(federation.upper, "node", node)["metadata"]["annotations"]
    return str(annotations.get(keys.LOWER_QUOTAS_ANNOTATION, ""))


def test_a_lower_quota_that_would_refuse_the_pod_counts_its_cluster_out(
    fragmented: Federation,
) -> None:
    """Only lower-1's node fits the pod, but lower-1's own quota lets no pod into the
    namespace there: the pod waits above with the quota named, never refused below; once
    the quota is gone, lower-1 takes it."""
    lower_1 = fragmented.clusters["lower-1"]
    apply(lower_1, namespace(NAMESPACE))
    without = quotas_digest(fragmented, "vk-lower-1")
    lower_1.kubectl("create", "quota", "e2e-no-pods", "-n", NAMESPACE, "--hard=pods=0")
    capped = wait_for(
        lambda: (digest := quotas_digest(fragmented, "vk-lower-1")) != without and digest,
        "the quota in the virtual Node's digest of what lower-1's quotas cap",
    )
    apply(fragmented.upper, frag_pod("over-quota", "5"))
    try:
        message = wait_for(
            lambda: failed_scheduling(fragmented, "over-quota"), "a FailedScheduling event"
        )
        assert (
            "vk-lower-1: lower cluster lower-1: quota e2e-no-pods of namespace frag has pods 0 "
            "left of 0, the pod asks 1" in message
        ), message
        assert "vk-lower-2: 0/" in message and "Insufficient cpu" in message, message
        assert not upper_pod(fragmented, "over-quota")["spec"].get("nodeName")
        assert not lower_pods(fragmented, "app=over-quota")
        # Removed below, the quota changes the Node's digest again, and lower-1 takes
        # the pod. (The upper scheduler tries a waiting pod again on that Node change
        # within seconds by hand, but not in every run of this test: the pod is made
        # again rather than waited for, see docs/multischeduler.md.)
        lower_1.kubectl("delete", "quota", "e2e-no-pods", "-n", NAMESPACE)
        wait_for(
            lambda: quotas_digest(fragmented, "vk-lower-1") not in (without, capped),
            "the Node's digest changed by the quota's removal",
        )
        delete_pods(fragmented, "app=over-quota")
        apply(fragmented.upper, frag_pod("over-quota", "5"))
        try:
            wait_for(
                lambda: running_on(fragmented, "over-quota", "vk-lower-1"),
                "the pod made again Running in lower-1 once the quota is gone",
            )
        except AssertionError as error:
            said = failed_scheduling(fragmented, "over-quota")
            raise AssertionError(f"{error}; the scheduler said last: {said}") from None
    finally:
        delete_pods(fragmented, "app=over-quota")
        lower_1.kubectl("delete", "quota", "e2e-no-pods", "-n", NAMESPACE, "--ignore-not-found")


def test_a_runtime_class_s_node_selector_decides_where_its_pods_fit(
    fragmented: Federation,
) -> None:
    """The lower apiserver merges its class's scheduling into the pod: a class whose
    runtime is only on ssd nodes runs its pods on one of those; where no node has the
    label, the pod fits nowhere (it used to be sent there and stay Pending below)."""
    lower_1, lower_2 = fragmented.clusters["lower-1"], fragmented.clusters["lower-2"]
    on_ssd = {
        **runtime_class("e2e-on-ssd", "0"),
        "scheduling": {"nodeSelector": {"kubestrata.io/e2e-disk": "ssd"}},
    }
    only_lower_1 = {**on_ssd, "metadata": {"name": "e2e-ssd-in-lower-1"}}
    apply(
        fragmented.upper,
        runtime_class("e2e-on-ssd", "0"),
        runtime_class("e2e-ssd-in-lower-1", "0"),
    )
    apply(lower_1, on_ssd, only_lower_1)
    apply(lower_2, on_ssd)
    apply(
        fragmented.upper,
        class_pod("on-ssd", "e2e-on-ssd"),
        class_pod("ssd-nowhere", "e2e-ssd-in-lower-1"),
    )
    try:
        wait_for(
            lambda: running_on(fragmented, "on-ssd", "vk-lower-2"),
            "the pod of the ssd-only class Running in lower-2",
        )
        below = lower_pods(fragmented, "app=on-ssd")["lower-2/on-ssd"]
        assert below["spec"]["nodeSelector"]["kubestrata.io/e2e-disk"] == "ssd"

        message = wait_for(
            lambda: failed_scheduling(fragmented, "ssd-nowhere"), "a FailedScheduling event"
        )
        assert "vk-lower-1: 0/" in message and "didn't match Pod's node affinity" in message
        assert "vk-lower-2: lower cluster lower-2 has no runtime class" in message, message
        assert not upper_pod(fragmented, "ssd-nowhere")["spec"].get("nodeName")
        assert not lower_pods(fragmented, "app=ssd-nowhere")
    finally:
        delete_pods(fragmented, "app in (on-ssd, ssd-nowhere)")
        fragmented.upper.kubectl("delete", "runtimeclass", "e2e-on-ssd", "e2e-ssd-in-lower-1")
        lower_1.kubectl("delete", "runtimeclass", "e2e-on-ssd", "e2e-ssd-in-lower-1")
        lower_2.kubectl("delete", "runtimeclass", "e2e-on-ssd")


def test_a_cluster_whose_estimator_is_down_is_skipped_and_the_others_still_used(
    fragmented: Federation,
) -> None:
    virtual_node = fragmented.components[virtual_node_name("lower-1")]
    virtual_node.kill()
    try:
        apply(fragmented.upper, frag_pod("only-lower-1", "5"), frag_pod("anywhere", "1"))
        wait_for(lambda: running_on(fragmented, "anywhere", "vk-lower-2"), "anywhere on vk-lower-2")
        message = wait_for(
            lambda: failed_scheduling(fragmented, "only-lower-1"),
            "a FailedScheduling event for the pod only lower-1 fits",
        )
        assert "vk-lower-1: estimator" in message, message
        assert not upper_pod(fragmented, "only-lower-1")["spec"].get("nodeName")
    finally:
        virtual_node.start()
    try:
        wait_for(
            lambda: running_on(fragmented, "only-lower-1", "vk-lower-1"),
            "the pod only lower-1 fits placed there once its estimator is back",
            timeout=180,
        )
    finally:
        delete_pods(fragmented, "app in (only-lower-1, anywhere)")


def estimator_address(federation: Federation, node: str) -> str:
    annotations = get_json(federation.upper, "node", node)["metadata"]["annotations"]
    return str(annotations[keys.ESTIMATOR_ADDRESS_ANNOTATION])


def multischeduler_token(
    federation: Federation, audience: str | None = keys.ESTIMATOR_AUDIENCE
) -> str:
    """A token of the multischeduler's ServiceAccount, by default one it sends."""
    return federation.upper.service_account_token(MULTISCHEDULER_ACCOUNT, audience)


async def estimate(
    federation: Federation, address: str, pod: dict[str, Any], token: str
) -> estimator_pb2.PodEstimate:
    """One Estimate call to a virtual node's estimator, holding nothing."""
    credentials = grpc.ssl_channel_credentials(federation.upper.ca.cert_path.read_bytes())
    async with grpc.aio.secure_channel(address, credentials) as channel:
        stub = estimator_pb2_grpc.EstimatorStub(channel)
        response = await stub.Estimate(
            estimator_pb2.EstimateRequest(
                pods=[estimator_pb2.PodQuery(pod=json.dumps(pod).encode())]
            ),
            metadata=[("authorization", f"Bearer {token}")] if token else [],
            timeout=10,
        )
    (answer,) = response.estimates
    return answer


def room_for_six(federation: Federation) -> int:
    """How many of lower-1's nodes its estimator finds room on for a 6-cpu pool pod (only
    frag-a has that much free), holding nothing."""
    probe = frag_pod("probe", "6")
    probe["metadata"]["uid"] = "probe"
    address = estimator_address(federation, "vk-lower-1")
    answer = asyncio.run(estimate(federation, address, probe, multischeduler_token(federation)))
    assert not answer.error, answer.error
    return int(answer.fitting_count)


@pytest.fixture
def ordinary_node(fragmented: Federation) -> Iterator[str]:
    """An ordinary upper Node beside the virtual ones, run by kwok, far larger than they
    look to the upper scheduler, whose own scores then prefer it."""
    name = "upper-big"
    upper = fragmented.upper
    assert isinstance(upper, LocalCluster)
    upper.add_nodes([NodeSpec(name=name, cpu="1000", memory="4Ti", pods=1000)])
    try:
        yield name
    finally:
        upper.kubectl("delete", "node", name, "--ignore-not-found")


def test_a_federated_pod_is_not_bound_to_an_ordinary_node_the_scheduler_prefers(
    fragmented: Federation, ordinary_node: str
) -> None:
    """The ordinary node looks far larger than the virtual nodes, so the scheduler's own
    scores prefer it; there the pod would run with none of its stashed fields judged (its
    pool selector, here). The webhook's selector of the virtual nodes' label keeps it off
    (until 2026-11-28 it ran there). Room the extender holds for a pod the scheduler puts
    on an ordinary node anyway (one not federated) is given back: unit-tested in
    test_multischeduler_server.py."""
    apply(fragmented.upper, frag_pod("elsewhere", "6"))
    try:
        wait_for(
            lambda: running_on(fragmented, "elsewhere", "vk-lower-1"),
            "elsewhere Running on vk-lower-1",
        )
        above = upper_pod(fragmented, "elsewhere")
        assert above["spec"]["nodeSelector"] == stash.VIRTUAL_NODE_SELECTOR
        (below,) = lower_pods(fragmented, "app=elsewhere").values()
        assert below["spec"]["nodeSelector"] == POOL
    finally:
        delete_pods(fragmented, "app=elsewhere")


REFUSED = "kubestrata-e2e-bindings-refused"


def bindings_refused(pod: str) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy refusing every binding of pods named ``pod`` (the
    scheduler's pods/binding and the older bindings resource): such a pod keeps waiting."""
    return refusing_policy(
        REFUSED,
        ["pods/binding", "bindings"],
        f"object.metadata.name != '{pod}'",
        "bindings refused by the test",
    )


def binding_refused(federation: Federation, pod: str) -> bool:
    """The policy is in force: a dry-run binding of ``pod`` is refused by it."""
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": pod, "namespace": NAMESPACE},
        "target": {"kind": "Node", "name": "vk-lower-1"},
    }
    result = federation.upper.kubectl(
        "create", "--dry-run=server", "-f", "-", input=json.dumps(binding), check=False
    )
    return "bindings refused by the test" in result.stderr


def test_room_kept_for_a_pod_deleted_while_it_waited_comes_back_at_once(
    fragmented: Federation,
) -> None:
    assert room_for_six(fragmented) == 1
    apply(fragmented.upper, *bindings_refused("waiting"))
    try:
        wait_for(partial(binding_refused, fragmented, "waiting"), "the policy in force")
        # Only lower-1's frag-a takes 6 cpu: each filter keeps that room for the pod, whose
        # binding is then refused, so it waits and is tried again.
        apply(fragmented.upper, frag_pod("waiting", "6"))
        message = wait_for(lambda: failed_scheduling(fragmented, "waiting"), "the binding refused")
        assert "bindings refused by the test" in message, message
        assert room_for_six(fragmented) == 0, "the room is kept for the waiting pod"
        fragmented.upper.kubectl("delete", "pod", "-n", NAMESPACE, "waiting", "--wait")
        # The estimators give such room back on their own 30 s after the last filter, at
        # most 10 s (the scheduler's longest backoff) before the delete; it is back well
        # before.
        wait_for(
            lambda: room_for_six(fragmented),
            "the room kept on lower-1 for the deleted pod back",
            timeout=15,
        )
        assert not lower_pods(fragmented, "app=waiting")
    finally:
        fragmented.upper.kubectl(
            "delete",
            "validatingadmissionpolicybinding,validatingadmissionpolicy",
            REFUSED,
            "--ignore-not-found",
        )
        delete_pods(fragmented, "app=waiting")


def test_the_estimator_answers_only_callers_allowed_to_get_nodes_estimator(
    fragmented: Federation,
) -> None:
    address = estimator_address(fragmented, "vk-lower-2")
    host, _, port = address.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0

    async def ask(token: str) -> grpc.StatusCode:
        try:
            await estimate(fragmented, address, frag_pod("x", "1"), token)
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    assert asyncio.run(ask("")) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(ask("not-a-token")) == grpc.StatusCode.UNAUTHENTICATED
    # A real identity without get on nodes/estimator.
    stranger = fragmented.upper.kubectl(
        "create", "token", "default", "-n", "default", f"--audience={keys.ESTIMATOR_AUDIENCE}"
    ).stdout
    assert asyncio.run(ask(stranger.strip())) == grpc.StatusCode.PERMISSION_DENIED
    # The multischeduler's own token (its ServiceAccount may get nodes/estimator).
    sent = multischeduler_token(fragmented)
    assert asyncio.run(ask(sent)) == grpc.StatusCode.OK
    # The token it sends every estimator is no good to the apiserver, and the one the
    # apiserver takes is no good to an estimator: an estimator cannot act as its caller.
    request = urllib.request.Request(
        f"{fragmented.upper.server}/api/v1/nodes", headers={"Authorization": f"Bearer {sent}"}
    )
    context = ssl.create_default_context(cafile=str(fragmented.upper.ca.cert_path))
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, context=context, timeout=10)
    assert refused.value.code == 401
    for_the_apiserver = multischeduler_token(fragmented, audience=None)
    assert asyncio.run(ask(for_the_apiserver)) == grpc.StatusCode.UNAUTHENTICATED


def test_the_extender_binds_for_the_upper_scheduler_alone(fragmented: Federation) -> None:
    """The scheduler shows its client certificate and binds (every test above); a caller
    without one is refused, and the pod it tried to bind, which fits nowhere, stays
    unbound (until 2026-11-28 anyone who reached the extender could bind any pod to any
    node with the multischeduler's rights)."""
    assert fragmented.multischeduler_url is not None
    apply(fragmented.upper, frag_pod("nowhere", "20"))
    try:
        wait_for(lambda: failed_scheduling(fragmented, "nowhere"), "nowhere turned away")
        binding = {
            "PodName": "nowhere",
            "PodNamespace": NAMESPACE,
            "PodUID": upper_pod(fragmented, "nowhere")["metadata"]["uid"],
            "Node": "vk-lower-1",
        }
        server_ca = fragmented.state_dir / "multischeduler" / "multischeduler-ca.crt"
        request = urllib.request.Request(
            fragmented.multischeduler_url + "/bind",
            data=json.dumps(binding).encode(),
            headers={"Content-Type": "application/json"},
        )
        context = ssl.create_default_context(cafile=str(server_ca))
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, context=context, timeout=10)
        assert refused.value.code == 403
        assert "no client certificate" in json.loads(refused.value.read())["Error"]
        assert "nodeName" not in upper_pod(fragmented, "nowhere")["spec"]
    finally:
        delete_pods(fragmented, "app=nowhere")
