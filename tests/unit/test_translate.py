import copy
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubekit import keys
from kubekit.stash import stash_scheduling
from virtual_node.naming import NamespaceMapping, NamingError
from virtual_node.translate import (
    Ownership,
    StashNotGuarded,
    TranslationError,
    deletion_due,
    desired_lower_pod,
    ephemeral_containers_patch,
    host_access,
    host_access_refusal,
    left_unpinned,
    lower_pod_patch,
    pinned_node,
    pinned_to,
    refused_status,
    resize_patch,
    resources_record_patch,
    terminated_status,
    updated_tolerations,
    upper_status,
    with_resize_refusal,
)

OWNER = Ownership(origin="upper-uid-0", node_name="vk-lower-1", cluster_id="lower-1")


def upper_pod(**spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "web-1",
            "namespace": "shop",
            "uid": "u-1",
            "resourceVersion": "42",
            "labels": {"app": "web"},
            "annotations": {"note": "x"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "web", "uid": "rs"}],
        },
        "spec": {
            "nodeName": "vk-lower-1",
            "priority": 0,
            "schedulerName": "default-scheduler",
            "serviceAccountName": "default",
            "containers": [
                {
                    "name": "app",
                    "image": "nginx:1",
                    "volumeMounts": [
                        {
                            "name": "kube-api-access-abcde",
                            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                        },
                        {"name": "data", "mountPath": "/data"},
                    ],
                }
            ],
            "volumes": [
                {
                    "name": "kube-api-access-abcde",
                    "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]},
                },
                {"name": "data", "emptyDir": {}},
            ],
            **spec,
        },
        "status": {"phase": "Pending"},
    }


def test_lower_pod_is_stripped_and_owned() -> None:
    lower = desired_lower_pod(upper_pod(), NamespaceMapping(), OWNER)
    metadata = lower["metadata"]
    assert set(metadata) == {"name", "namespace", "labels", "annotations"}
    assert (metadata["name"], metadata["namespace"]) == ("web-1", "shop")
    assert metadata["labels"] == {"app": "web", **OWNER.labels()}
    assert metadata["annotations"] == {
        "note": "x",
        keys.UPPER_UID_ANNOTATION: "u-1",
        keys.UPPER_NAMESPACE_ANNOTATION: "shop",
        keys.UPPER_KEYS_ANNOTATION: '{"labels":["app"],"annotations":["note"]}',
        keys.UPPER_IMAGES_ANNOTATION: '{"app":"nginx:1"}',
        keys.UPPER_RESOURCES_ANNOTATION: '{"app":{}}',
    }
    spec = lower["spec"]
    for stripped in ("nodeName", "priority", "schedulerName"):
        assert stripped not in spec
    assert spec["volumes"] == [{"name": "data", "emptyDir": {}}]
    assert spec["containers"][0]["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
    assert "status" not in lower
    assert OWNER.owns(lower)


def test_whether_a_token_is_mounted_is_decided_above() -> None:
    """By the pod or its service account, above: left unset, the lower admission would
    ask the lower cluster's own `default` account, which may decide the other way."""
    with_token = desired_lower_pod(upper_pod(), NamespaceMapping(), OWNER)
    assert with_token["spec"]["automountServiceAccountToken"] is True
    hardened = upper_pod()
    hardened["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/d"}]
    hardened["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}]
    without = desired_lower_pod(hardened, NamespaceMapping(), OWNER)
    assert without["spec"]["automountServiceAccountToken"] is False
    hardened["spec"]["automountServiceAccountToken"] = False
    assert desired_lower_pod(hardened, NamespaceMapping(), OWNER) == without


def test_upper_pod_is_not_modified() -> None:
    pod = upper_pod()
    before = copy.deepcopy(pod)
    desired_lower_pod(pod, NamespaceMapping(), OWNER)
    assert pod == before


def test_only_the_toleration_of_the_virtual_nodes_taint_stays_above() -> None:
    """A pod meant for a lower cluster's own virtual nodes of a cloud provider (their
    taint has virtual-kubelet's key and the provider's name) keeps its toleration of
    them."""
    cloud = {"key": keys.PROVIDER_TAINT_KEY, "operator": "Equal", "value": "azure"}
    ours = {"key": keys.PROVIDER_TAINT_KEY, "operator": "Exists"}
    pod = upper_pod(tolerations=[cloud, ours, {**ours, "effect": "NoExecute"}])
    lower = desired_lower_pod(pod, NamespaceMapping(), OWNER)
    assert lower["spec"]["tolerations"] == [cloud, {**ours, "effect": "NoExecute"}]


def test_a_stash_the_webhook_does_not_guard_is_not_read() -> None:
    """Anyone may write it on a pod outside the webhook's reach: restored, it took the pod
    past what the upper admission held its spec to (a namespace's PodNodeSelector)."""
    pod = upper_pod(nodeSelector={"pool": "team-a"})
    forged = stash_scheduling({"nodeSelector": {"pool": "team-b"}}, {})[1]
    pod["metadata"]["annotations"] = {**pod["metadata"]["annotations"], **forged}
    why = "namespace shop is not labelled kubestrata.io/federation=enabled"
    with pytest.raises(StashNotGuarded, match=f"does not guard this pod \\({why}\\)"):
        desired_lower_pod(pod, NamespaceMapping(), OWNER, stash_unguarded=lambda _pod: why)
    assert desired_lower_pod(pod, NamespaceMapping(), OWNER)["spec"]["nodeSelector"] == {
        "pool": "team-b"
    }
    plain = upper_pod(nodeSelector={"pool": "team-a"})
    lower = desired_lower_pod(plain, NamespaceMapping(), OWNER, stash_unguarded=lambda _p: why)
    assert lower["spec"]["nodeSelector"] == {"pool": "team-a"}


def test_stashed_scheduling_fields_are_restored_below() -> None:
    original = {
        "nodeSelector": {"disk": "ssd", keys.CLUSTER_ID_LABEL: "lower-1"},
        "tolerations": [{"key": "dedicated", "operator": "Exists"}],
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app": "web"}},
            }
        ],
    }
    pod = upper_pod(**original)
    spec, annotations = stash_scheduling(pod["spec"], pod["metadata"]["annotations"])
    pod["spec"], pod["metadata"]["annotations"] = spec, annotations
    # Bound by its nodeName (upper_pod's): no virtual-node entry, no scheduler reads it.
    assert pod["spec"]["nodeSelector"] == {keys.CLUSTER_ID_LABEL: "lower-1"}
    lower = desired_lower_pod(pod, NamespaceMapping(), OWNER)
    assert lower["spec"]["nodeSelector"] == {"disk": "ssd"}, (
        "the cluster-id key means nothing below"
    )
    assert lower["spec"]["tolerations"] == original["tolerations"]
    assert lower["spec"]["topologySpreadConstraints"] == original["topologySpreadConstraints"]
    assert keys.STASH_ANNOTATION not in lower["metadata"]["annotations"]


def test_broken_stash_is_a_translation_error() -> None:
    pod = upper_pod()
    pod["metadata"]["annotations"][keys.STASH_ANNOTATION] = "{not json"
    with pytest.raises(TranslationError, match="scheduling-stash"):
        desired_lower_pod(pod, NamespaceMapping(), OWNER)
    # Readable JSON whose fields no pod could have: an error too, not a crash later on.
    pod["metadata"]["annotations"][keys.STASH_ANNOTATION] = (
        '{"version":1,"originals":{"tolerations":"x"}}'
    )
    with pytest.raises(TranslationError, match=r"originals\.tolerations must be a JSON array"):
        desired_lower_pod(pod, NamespaceMapping(), OWNER)


def test_prefix_namespace_strategy() -> None:
    mapping = NamespaceMapping("prefix", "east")
    assert desired_lower_pod(upper_pod(), mapping, OWNER)["metadata"]["namespace"] == "east-shop"
    assert mapping.upper("east-shop") == "shop"
    assert mapping.upper("other") is None
    with pytest.raises(NamingError, match="longer than 63"):
        mapping.lower("n" * 60)
    with pytest.raises(NamingError, match="needs a prefix"):
        NamespaceMapping("prefix", "")


@pytest.mark.parametrize(
    "namespace", ["kube-system", "kube-public", "kube-node-lease", "kubestrata-system"]
)
def test_nothing_is_made_in_the_lower_clusters_own_namespaces(namespace: str) -> None:
    refusal = NamespaceMapping().refusal(namespace)
    assert refusal is not None and f"namespace {namespace} is the lower cluster's own" in refusal
    # Still named, to find and remove what an earlier version made there.
    assert NamespaceMapping().lower(namespace) == namespace
    # With a prefix it has a namespace of its own below; a prefix ending one of theirs,
    # `kube` with upper `system`, has none.
    assert NamespaceMapping("prefix", "east").refusal(namespace) is None
    assert NamespaceMapping("prefix", "kube").refusal("system") is not None
    assert NamespaceMapping().refusal("shop") is None


def test_pod_affinity_terms_name_their_namespaces_as_they_are_below() -> None:
    term = {"labelSelector": {"matchLabels": {"app": "redis"}}, "topologyKey": "zone"}
    affinity = {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {**term, "namespaces": ["cache"]},
                term,
            ]
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "podAffinityTerm": {**term, "namespaces": ["shop", "web"]}}
            ]
        },
    }
    upper = upper_pod(affinity=affinity)
    lower = desired_lower_pod(upper, NamespaceMapping("prefix", "east"), OWNER)
    lowered = lower["spec"]["affinity"]
    required = lowered["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [t.get("namespaces") for t in required] == [["east-cache"], None]
    (preferred,) = lowered["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["podAffinityTerm"]["namespaces"] == ["east-shop", "east-web"]
    assert upper["spec"]["affinity"] == affinity, "the upper pod is left as it is"
    same = desired_lower_pod(upper, NamespaceMapping(), OWNER)
    same_terms = same["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert [t.get("namespaces") for t in same_terms] == [["cache"], None]


OWN_PODS = {"key": keys.ORIGIN_LABEL, "operator": "In", "values": [OWNER.origin]}


def test_pod_affinity_terms_select_only_this_upper_cluster_s_pods_below() -> None:
    """Other tenants' pods and the lower cluster's own are not in the upper cluster: a
    term over every namespace repelled them from its node (anti-affinity goes both ways)."""
    everywhere = {
        "labelSelector": {"matchExpressions": [{"key": "app", "operator": "Exists"}]},
        "namespaceSelector": {},
        "topologyKey": "kubernetes.io/hostname",
    }
    nothing = {"topologyKey": "kubernetes.io/hostname"}
    affinity = {
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [everywhere]},
        "podAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "podAffinityTerm": nothing}
            ]
        },
    }
    upper = upper_pod(affinity=affinity)
    lowered = desired_lower_pod(upper, NamespaceMapping(), OWNER)["spec"]["affinity"]
    (anti,) = lowered["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["labelSelector"]["matchExpressions"] == [
        {"key": "app", "operator": "Exists"},
        OWN_PODS,
    ]
    assert anti["namespaceSelector"] == {}
    (preferred,) = lowered["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert "labelSelector" not in preferred["podAffinityTerm"], "no selector selects no pod"
    assert upper["spec"]["affinity"] == affinity, "the upper pod is left as it is"
    assert OWNER.labels()[keys.ORIGIN_LABEL] == OWNER.origin, "which its lower pods carry"


def test_what_the_upper_scheduler_decided_on_a_kept_key_is_not_asked_again_below() -> None:
    """Below, a region is one domain: a spread with minDomains 3 let one pod per cluster
    run, and an affinity to a pod in another cluster of the region was never met."""
    region, host = "topology.kubernetes.io/region", "kubernetes.io/hostname"
    web = {"matchLabels": {"app": "web"}}
    spread = {"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule", "labelSelector": web}
    soft = {**spread, "whenUnsatisfiable": "ScheduleAnyway", "topologyKey": region}
    cache = {"labelSelector": {"matchLabels": {"app": "cache"}}}
    pod = upper_pod(
        topologySpreadConstraints=[
            {**spread, "topologyKey": region, "minDomains": 3},
            {**spread, "topologyKey": host},
            soft,
        ],
        affinity={
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {**cache, "topologyKey": region},
                    {**cache, "topologyKey": host},
                ]
            }
        },
    )
    pod["spec"], pod["metadata"]["annotations"] = stash_scheduling(
        pod["spec"], pod["metadata"]["annotations"]
    )
    assert [c["topologyKey"] for c in pod["spec"]["topologySpreadConstraints"]] == [region, region]
    lower = desired_lower_pod(pod, NamespaceMapping(), OWNER)["spec"]
    assert lower["topologySpreadConstraints"] == [{**spread, "topologyKey": host}, soft]
    (term,) = lower["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == host
    unstashed = desired_lower_pod(
        upper_pod(topologySpreadConstraints=[{**spread, "topologyKey": region, "minDomains": 3}]),
        NamespaceMapping(),
        OWNER,
    )
    assert unstashed["spec"]["topologySpreadConstraints"][0]["minDomains"] == 3, "not ours to judge"


def test_patch_pushes_down_mutable_fields_only() -> None:
    current = desired_lower_pod(upper_pod(), NamespaceMapping(), OWNER)
    assert lower_pod_patch(current, current) is None
    changed = upper_pod(activeDeadlineSeconds=30, tolerations=[{"key": "a", "operator": "Exists"}])
    changed["metadata"]["labels"] = {"app": "web", "tier": "front"}
    changed["metadata"]["annotations"] = {}
    changed["spec"]["containers"][0]["image"] = "nginx:2"
    patch = lower_pod_patch(current, desired_lower_pod(changed, NamespaceMapping(), OWNER))
    assert patch is not None
    assert patch["metadata"]["labels"] == {"tier": "front"}
    assert set(patch["metadata"]["annotations"]) == {
        "note",
        keys.UPPER_KEYS_ANNOTATION,
        keys.UPPER_IMAGES_ANNOTATION,
    }
    assert patch["metadata"]["annotations"][keys.UPPER_IMAGES_ANNOTATION] == '{"app":"nginx:2"}'
    assert patch["metadata"]["annotations"]["note"] is None
    assert json.loads(patch["metadata"]["annotations"][keys.UPPER_KEYS_ANNOTATION]) == {
        "labels": ["app", "tier"],
        "annotations": [],
    }
    assert patch == {
        "metadata": patch["metadata"],
        "spec": {
            "containers": [{"name": "app", "image": "nginx:2"}],
            "activeDeadlineSeconds": 30,
            "tolerations": [{"key": "a", "operator": "Exists"}],
        },
    }


UNREACHABLE = {"key": "node.kubernetes.io/unreachable", "operator": "Exists"}
NOT_READY = {"key": "node.kubernetes.io/not-ready", "operator": "Exists"}


@pytest.mark.parametrize(
    ("have", "want", "updated"),
    [
        ([UNREACHABLE], [UNREACHABLE], None),
        # A toleration's seconds change in place (the API lets them): appended beside the
        # old one, the shorter would still have evicted the pod.
        (
            [{**UNREACHABLE, "tolerationSeconds": 300}, NOT_READY],
            [{**UNREACHABLE, "tolerationSeconds": 3600}, NOT_READY],
            [{**UNREACHABLE, "tolerationSeconds": 3600}, NOT_READY],
        ),
        ([{**UNREACHABLE, "tolerationSeconds": 300}], [UNREACHABLE], [UNREACHABLE]),
        # Added above: added below; one only below (a lower admission plugin's) stays.
        ([NOT_READY], [NOT_READY, UNREACHABLE], [NOT_READY, UNREACHABLE]),
        ([NOT_READY, {"key": "lower-only"}], [NOT_READY], None),
        # An exact match is kept as it is before a seconds variant is changed.
        (
            [{**UNREACHABLE, "tolerationSeconds": 5}, {**UNREACHABLE, "tolerationSeconds": 9}],
            [{**UNREACHABLE, "tolerationSeconds": 9}, {**UNREACHABLE, "tolerationSeconds": 7}],
            [{**UNREACHABLE, "tolerationSeconds": 7}, {**UNREACHABLE, "tolerationSeconds": 9}],
        ),
    ],
)
def test_tolerations_below_follow_the_upper_pods_as_the_api_lets_them_change(
    have: list[dict[str, Any]], want: list[dict[str, Any]], updated: list[dict[str, Any]] | None
) -> None:
    assert updated_tolerations(have, want) == updated


def test_an_image_a_lower_webhook_rewrote_is_changed_only_when_it_changes_above() -> None:
    current = desired_lower_pod(upper_pod(), NamespaceMapping(), OWNER)
    current["spec"]["containers"][0]["image"] = "mirror.example/nginx:1"
    assert (
        lower_pod_patch(current, desired_lower_pod(upper_pod(), NamespaceMapping(), OWNER)) is None
    )
    changed = upper_pod()
    changed["spec"]["containers"][0]["image"] = "nginx:2"
    patch = lower_pod_patch(current, desired_lower_pod(changed, NamespaceMapping(), OWNER))
    assert patch is not None
    assert patch["spec"] == {"containers": [{"name": "app", "image": "nginx:2"}]}
    # Made before the images were recorded: compared as it runs, nothing written for it.
    older = copy.deepcopy(current)
    del older["metadata"]["annotations"][keys.UPPER_IMAGES_ANNOTATION]
    older["spec"]["containers"][0]["image"] = "nginx:1"
    assert lower_pod_patch(older, desired_lower_pod(upper_pod(), NamespaceMapping(), OWNER)) is None


def test_status_comes_up_with_the_virtual_node_as_host() -> None:
    lower = {
        "status": {
            "phase": "Running",
            "podIP": "10.240.0.7",
            "podIPs": [{"ip": "10.240.0.7"}],
            "hostIP": "192.168.1.5",
            "startTime": "2026-01-01T00:00:00Z",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "app", "ready": True}],
        }
    }
    status = upper_status(lower, upper_pod(), host_ip="127.0.0.2")
    assert status["phase"] == "Running"
    assert status["podIP"] == "10.240.0.7"
    assert status["hostIP"] == "127.0.0.2"
    assert status["containerStatuses"] == [{"name": "app", "ready": True}]


def test_only_the_upper_containers_statuses_come_up_with_their_mounts_above() -> None:
    """A lower mesh injects istio-init and istio-proxy: READY read 2/1 above."""
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    lower: dict[str, Any] = {
        "status": {
            "phase": "Running",
            "initContainerStatuses": [{"name": "istio-init", "ready": True}],
            "containerStatuses": [
                {
                    "name": "app",
                    "ready": True,
                    "volumeMounts": [
                        {"name": "kube-api-access-lower", "mountPath": token},
                        {"name": "data", "mountPath": "/data"},
                        {"name": "istio-envoy", "mountPath": "/etc/istio/proxy"},
                    ],
                },
                {"name": "istio-proxy", "ready": True, "restartCount": 3},
            ],
        }
    }
    status = upper_status(lower, upper_pod(), host_ip="127.0.0.2")
    assert "initContainerStatuses" not in status, "empty, it is left out as stored"
    [app] = status["containerStatuses"]
    assert app["volumeMounts"] == [
        {"name": "kube-api-access-abcde", "mountPath": token},
        {"name": "data", "mountPath": "/data"},
    ]
    only_injected = [{"name": "istio-envoy", "mountPath": "/etc/istio/proxy"}]
    lower["status"]["containerStatuses"][0]["volumeMounts"] = only_injected
    [app] = upper_status(lower, upper_pod(), host_ip="127.0.0.2")["containerStatuses"]
    assert "volumeMounts" not in app


@pytest.mark.parametrize("below", ["Succeeded", "Running"])
def test_a_pod_never_leaves_a_terminal_phase_above(below: str) -> None:
    """The virtual node said Failed (a bare pod deleted below); its lower pod, still
    stopping, says otherwise."""
    upper = upper_pod()
    upper["status"] = {"phase": "Failed", "reason": "LowerPodDeleted", "message": "gone"}
    status = upper_status({"status": {"phase": below}}, upper, host_ip="127.0.0.2")
    assert (status["phase"], status["reason"], status["message"]) == (
        "Failed",
        "LowerPodDeleted",
        "gone",
    )
    lower = {"status": {"phase": "Failed", "reason": "Evicted", "message": "disk"}}
    status = upper_status(lower, upper, host_ip="127.0.0.2")
    assert (status["reason"], status["message"]) == ("Evicted", "disk"), "its own stands"


def test_the_upper_generation_is_observed_once_the_lower_kubelet_caught_up() -> None:
    """A 1.35 kubelet reports status.observedGeneration and its conditions'; the lower
    pod's generations are its own (it starts at 1 whatever the upper pod's count)."""
    upper = upper_pod()
    upper["metadata"]["generation"] = 4
    upper["status"] = {"observedGeneration": 3}

    def lower(generation: int, observed: int | None) -> dict[str, Any]:
        status: dict[str, Any] = {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True", "observedGeneration": observed}],
        }
        if observed is None:
            del status["conditions"][0]["observedGeneration"]
        else:
            status["observedGeneration"] = observed
        return {"metadata": {"generation": generation}, "status": status}

    caught_up = upper_status(lower(2, 2), upper, host_ip="127.0.0.2")
    assert caught_up["observedGeneration"] == 4
    assert caught_up["conditions"][0]["observedGeneration"] == 4
    behind = upper_status(lower(2, 1), upper, host_ip="127.0.0.2")
    assert behind["observedGeneration"] == 3
    assert behind["conditions"][0]["observedGeneration"] == 3
    untracked = upper_status(lower(2, None), upper, host_ip="127.0.0.2")
    assert untracked["observedGeneration"] == 4
    assert "observedGeneration" not in untracked["conditions"][0]


SCHEDULED_ABOVE = {
    "type": "PodScheduled",
    "status": "True",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}


def bound_upper_pod() -> dict[str, Any]:
    return {**upper_pod(), "status": {"phase": "Pending", "conditions": [SCHEDULED_ABOVE]}}


def test_status_of_a_pod_scheduled_below_but_not_started_is_what_the_upper_pod_has() -> None:
    lower = {
        "status": {
            "phase": "Pending",
            "qosClass": "BestEffort",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "True",
                    "lastTransitionTime": "2026-01-01T00:00:09Z",
                }
            ],
        }
    }
    upper = bound_upper_pod()
    assert upper_status(lower, upper, host_ip="127.0.0.2") == upper["status"]


def test_status_of_a_pod_just_created_below_is_what_the_upper_pod_has() -> None:
    upper = bound_upper_pod()
    lower = {"status": {"phase": "Pending", "qosClass": "BestEffort"}}
    assert upper_status(lower, upper, host_ip="127.0.0.2") == upper["status"]


def test_upper_scheduling_condition_stays_when_the_pod_runs_below() -> None:
    ready = {"type": "Ready", "status": "True"}
    lower = {
        "status": {
            "phase": "Running",
            "hostIP": "192.168.1.5",
            "conditions": [ready, {"type": "PodScheduled", "status": "True"}],
        }
    }
    status = upper_status(lower, bound_upper_pod(), host_ip="127.0.0.2")
    assert status["conditions"] == [ready, SCHEDULED_ABOVE]
    assert status["hostIPs"] == [{"ip": "127.0.0.2"}]


def test_lower_scheduling_failure_comes_up() -> None:
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient cpu.",
    }
    lower = {"status": {"phase": "Pending", "conditions": [unschedulable]}}
    status = upper_status(lower, bound_upper_pod(), host_ip="127.0.0.2")
    assert status["conditions"] == [unschedulable]
    assert status["phase"] == "Pending"
    assert "hostIP" not in status


def test_a_pod_scheduled_below_at_last_is_scheduled_above_again() -> None:
    """A failure below, or a refusal, was written over the binding's PodScheduled True
    above; once the lower scheduler places the pod, it is True again."""
    ready = {"type": "Ready", "status": "True"}
    placed = {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-01-01T00:01Z"}
    running = {
        "status": {"phase": "Running", "hostIP": "192.168.1.5", "conditions": [ready, placed]}
    }
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    upper = {**upper_pod(), "status": {"phase": "Pending", "conditions": [unschedulable]}}
    assert upper_status(running, upper, host_ip="127.0.0.2")["conditions"] == [ready, placed]
    refused = refused_status(bound_upper_pod(), "LowerClusterRefused", "quota", "2026-01-01T00:00Z")
    upper["status"] = refused
    assert upper_status(running, upper, host_ip="127.0.0.2")["conditions"] == [ready, placed]
    # Created below but not placed yet: the refusal is what the pod still says.
    just_made = {"status": {"phase": "Pending", "qosClass": "BestEffort"}}
    assert (
        upper_status(just_made, upper, host_ip="127.0.0.2")["conditions"] == refused["conditions"]
    )


def test_a_refusal_below_is_scheduled_false_since_it_began() -> None:
    first = refused_status(bound_upper_pod(), "LowerClusterRefused", "quota q", "2026-01-01T00:05Z")
    assert first["phase"] == "Pending"
    assert first["conditions"] == [
        {
            "type": "PodScheduled",
            "status": "False",
            "lastProbeTime": None,
            "lastTransitionTime": "2026-01-01T00:05Z",
            "reason": "LowerClusterRefused",
            "message": "quota q",
        }
    ]
    pod = {**bound_upper_pod(), "status": first}
    again = refused_status(pod, "LowerClusterRefused", "quota q, used 2", "2026-01-01T00:09Z")
    (condition,) = again["conditions"]
    assert (condition["lastTransitionTime"], condition["message"]) == (
        "2026-01-01T00:05Z",
        "quota q, used 2",
    )
    assert refused_status(pod, "LowerClusterRefused", "quota q", "2026-01-01T00:09Z") == first


def test_pod_bound_by_node_name_shows_lower_scheduling_with_the_first_kubelet_status() -> None:
    upper = {**upper_pod(), "status": {"phase": "Pending", "qosClass": "BestEffort"}}
    scheduled_below = {"type": "PodScheduled", "status": "True"}
    bound_below = {
        "status": {"phase": "Pending", "qosClass": "BestEffort", "conditions": [scheduled_below]}
    }
    assert upper_status(bound_below, upper, host_ip="127.0.0.2") == upper["status"]
    ready = {"type": "Ready", "status": "True"}
    running = {
        "status": {
            "phase": "Running",
            "qosClass": "BestEffort",
            "hostIP": "192.168.1.5",
            "conditions": [ready, scheduled_below],
        }
    }
    status = upper_status(running, upper, host_ip="127.0.0.2")
    assert status["conditions"] == [ready, scheduled_below]
    assert status["phase"] == "Running"


def test_lower_scheduling_failure_of_a_pod_bound_by_node_name_comes_up() -> None:
    upper = {**upper_pod(), "status": {"phase": "Pending"}}
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    lower = {"status": {"phase": "Pending", "conditions": [unschedulable]}}
    assert upper_status(lower, upper, host_ip="127.0.0.2")["conditions"] == [unschedulable]


def test_the_overhead_is_left_to_the_lower_cluster_s_runtime_class() -> None:
    pod = upper_pod()
    pod["spec"].update({"runtimeClassName": "gvisor", "overhead": {"cpu": "250m"}})
    spec = desired_lower_pod(pod, NamespaceMapping(), OWNER)["spec"]
    assert spec["runtimeClassName"] == "gvisor"
    assert "overhead" not in spec


def gated_pod(*conditions: dict[str, Any]) -> dict[str, Any]:
    pod = bound_upper_pod()
    pod["spec"]["readinessGates"] = [{"conditionType": "example.com/lb"}]
    pod["status"]["conditions"] = [SCHEDULED_ABOVE, *conditions]
    return pod


RUNNING_BELOW = {
    "status": {
        "phase": "Running",
        "hostIP": "192.168.1.5",
        "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:05Z"},
            {"type": "PodScheduled", "status": "True"},
        ],
    }
}


def test_a_readiness_gate_stays_above_and_is_not_asked_of_the_lower_cluster() -> None:
    assert "readinessGates" not in desired_lower_pod(gated_pod(), NamespaceMapping(), OWNER)["spec"]


def test_the_ready_condition_a_gate_holds_back_observes_the_generation() -> None:
    upper = gated_pod()
    upper["metadata"]["generation"] = 3
    lower: dict[str, Any] = copy.deepcopy(RUNNING_BELOW)
    lower["status"]["conditions"][0]["observedGeneration"] = 1
    lower["metadata"] = {"generation": 1}
    lower["status"]["observedGeneration"] = 1
    status = upper_status(lower, upper, host_ip="127.0.0.2")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["reason"], ready["observedGeneration"]) == ("ReadinessGatesNotReady", 3)


def test_a_pod_ready_below_is_not_ready_above_until_its_gate_is_true() -> None:
    status = upper_status(RUNNING_BELOW, gated_pod(), host_ip="127.0.0.2")
    assert status["conditions"] == [
        {
            "type": "Ready",
            "status": "False",
            "lastProbeTime": None,
            "lastTransitionTime": "2026-01-01T00:00:05Z",
            "reason": "ReadinessGatesNotReady",
            "message": 'corresponding condition of pod readiness gate "example.com/lb" does '
            "not exist.",
        },
        SCHEDULED_ABOVE,
    ]

    gate_false = {"type": "example.com/lb", "status": "False"}
    status = upper_status(RUNNING_BELOW, gated_pod(gate_false), host_ip="127.0.0.2")
    ready, _, gate = status["conditions"]
    assert ready["message"] == (
        'the status of pod readiness gate "example.com/lb" is not "True", but False'
    )
    assert gate == gate_false, "the controller's condition above is kept"

    gate_true = {
        "type": "example.com/lb",
        "status": "True",
        "lastTransitionTime": "2026-01-01T00:00:09Z",
    }
    status = upper_status(RUNNING_BELOW, gated_pod(gate_true), host_ip="127.0.0.2")
    assert status["conditions"] == [
        {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:09Z"},
        SCHEDULED_ABOVE,
        gate_true,
    ]


def test_a_ready_pod_whose_gate_turns_false_is_not_ready_since_the_gate_turned() -> None:
    """Not since the containers became ready below, which would put the transition
    before the time the pod was last Ready."""
    ready_above = {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:10:00Z"}
    gate_false = {
        "type": "example.com/lb",
        "status": "False",
        "lastTransitionTime": "2026-01-01T01:00:00Z",
    }
    pod = gated_pod(gate_false)
    pod["status"]["conditions"].append(ready_above)
    ready = next(
        c
        for c in upper_status(RUNNING_BELOW, pod, host_ip="127.0.0.2")["conditions"]
        if c["type"] == "Ready"
    )
    assert (ready["status"], ready["lastTransitionTime"]) == ("False", "2026-01-01T01:00:00Z")


def test_a_gate_set_below_does_not_count_and_not_ready_below_keeps_its_reason() -> None:
    gate_below = {"type": "example.com/lb", "status": "True"}
    not_ready = {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}
    lower = {"status": {"phase": "Running", "conditions": [not_ready, gate_below]}}
    status = upper_status(lower, gated_pod(), host_ip="127.0.0.2")
    assert status["conditions"] == [not_ready, SCHEDULED_ABOVE]


def test_conditions_of_controllers_above_are_kept_and_the_lower_ones_win_for_the_rest() -> None:
    disruption = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
    custom_below = {"type": "example.com/checked", "status": "True"}
    upper = bound_upper_pod()
    upper["status"]["conditions"] = [
        SCHEDULED_ABOVE,
        disruption,
        {**custom_below, "status": "False"},
    ]
    lower = {"status": {"phase": "Running", "conditions": [custom_below]}}
    status = upper_status(lower, upper, host_ip="127.0.0.2")
    assert status["conditions"] == [custom_below, SCHEDULED_ABOVE, disruption]


def test_labels_and_annotations_added_below_are_left_alone() -> None:
    desired = desired_lower_pod(upper_pod(), NamespaceMapping(), OWNER)
    current = json.loads(json.dumps(desired))
    current["metadata"]["labels"]["topology.kubernetes.io/zone"] = "zone-b"
    current["metadata"]["annotations"]["sidecar.example.com/injected"] = "true"
    assert lower_pod_patch(current, desired) is None


def test_without_a_record_of_keys_from_above_nothing_is_removed() -> None:
    desired = desired_lower_pod(upper_pod(), NamespaceMapping(), OWNER)
    current = json.loads(json.dumps(desired))
    current["metadata"]["labels"]["old"] = "x"
    for record in (None, "not json", "[1]", '{"labels": "old"}'):
        if record is None:
            current["metadata"]["annotations"].pop(keys.UPPER_KEYS_ANNOTATION, None)
        else:
            current["metadata"]["annotations"][keys.UPPER_KEYS_ANNOTATION] = record
        patch = lower_pod_patch(current, desired)
        assert patch is not None
        assert "labels" not in patch["metadata"]


def test_a_pin_is_added_to_every_required_term_of_the_pod() -> None:
    ssd = {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}
    named = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}]}
    required = {"nodeSelectorTerms": [ssd, named]}
    lower = {
        "spec": {
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
            }
        }
    }
    pin = {"key": "metadata.name", "operator": "In", "values": ["node-7"]}
    terms = pinned_to(lower, "node-7")["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [{**ssd, "matchFields": [pin]}, {"matchFields": [*named["matchFields"], pin]}]
    assert pinned_node(lower) == "node-7"
    unpinned = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [ssd, named]}
        }
    }
    assert pinned_node({"spec": {"affinity": unpinned}}) is None
    assert pinned_node({"spec": {}}) is None
    bare = pinned_to({"spec": {}}, "node-1")["spec"]["affinity"]
    assert bare == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": ["node-1"]}
                        ]
                    }
                ]
            }
        }
    }


def spread(**fields: Any) -> dict[str, Any]:
    return {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"app": "w"}},
        **fields,
    }


@pytest.mark.parametrize(
    ("spec", "unmodelled"),
    [
        ({"volumes": [{"name": "v", "emptyDir": {}}]}, False),
        ({"volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "data"}}]}, True),
        ({"volumes": [{"name": "v", "ephemeral": {"volumeClaimTemplate": {}}}]}, True),
        ({"resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}]}, True),
        ({}, False),
        # Pinned, only the node's own domain would be eligible: fewer than minDomains,
        # and the lower scheduler refuses the pod for good.
        ({"topologySpreadConstraints": [spread(minDomains=3)]}, True),
        ({"topologySpreadConstraints": [spread(minDomains=3, nodeAffinityPolicy="Ignore")]}, False),
        ({"topologySpreadConstraints": [spread(minDomains=1)]}, False),
        ({"topologySpreadConstraints": [spread(whenUnsatisfiable="ScheduleAnyway")]}, False),
    ],
)
def test_pods_the_estimator_cannot_judge_pinned_are_not_pinned(
    spec: dict[str, Any], unmodelled: bool
) -> None:
    assert left_unpinned(spec) is unmodelled


def debugger(name: str, image: str = "busybox") -> dict[str, Any]:
    return {"name": name, "image": image, "targetContainerName": "app", "stdin": True}


def test_ephemeral_containers_added_above_are_added_below_and_only_those() -> None:
    upper = {"spec": {"containers": [{"name": "app"}], "ephemeralContainers": [debugger("d1")]}}
    lower: dict[str, Any] = {"spec": {"containers": [{"name": "app"}]}}
    assert ephemeral_containers_patch(upper, lower) == {
        "spec": {"ephemeralContainers": [debugger("d1")]}
    }
    lower["spec"]["ephemeralContainers"] = [debugger("d1")]
    assert ephemeral_containers_patch(upper, lower) is None
    upper["spec"]["ephemeralContainers"].append(debugger("d2"))
    assert ephemeral_containers_patch(upper, lower) == {
        "spec": {"ephemeralContainers": [debugger("d2")]}
    }


def test_an_ephemeral_container_already_below_is_never_changed() -> None:
    # The API refuses changes to an ephemeral container; the one below stays as it is.
    upper = {"spec": {"ephemeralContainers": [debugger("d1", image="alpine")]}}
    lower = {"spec": {"ephemeralContainers": [debugger("d1")]}}
    assert ephemeral_containers_patch(upper, lower) is None
    assert ephemeral_containers_patch({"spec": {}}, lower) is None


def token_volume(name: str) -> dict[str, Any]:
    return {"name": name, "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}


def test_an_ephemeral_container_mounting_the_token_mounts_the_lower_pod_s() -> None:
    """`kubectl debug --custom` keeping the pod's API access mounts the upper token
    volume, which the lower pod has under another name: the lower apiserver refused
    the container, and the debug session never started."""
    token_mount = {"name": "kube-api-access-upper", "mountPath": "/var/run/secrets/t"}
    data = {"name": "data", "mountPath": "/data"}
    upper = {
        "spec": {
            "volumes": [token_volume("kube-api-access-upper"), {"name": "data", "emptyDir": {}}],
            "ephemeralContainers": [{**debugger("d1"), "volumeMounts": [token_mount, data]}],
        }
    }
    lower: dict[str, Any] = {
        "spec": {"volumes": [{"name": "data", "emptyDir": {}}, token_volume("kube-api-access-low")]}
    }
    (added,) = ephemeral_containers_patch(upper, lower)["spec"]["ephemeralContainers"]  # type: ignore[index]
    assert added["volumeMounts"] == [{**token_mount, "name": "kube-api-access-low"}, data]
    # The lower pod has no token (its service account mounts none below): the mount goes.
    lower["spec"]["volumes"].pop()
    (added,) = ephemeral_containers_patch(upper, lower)["spec"]["ephemeralContainers"]  # type: ignore[index]
    assert added["volumeMounts"] == [data]
    assert upper["spec"]["ephemeralContainers"][0]["volumeMounts"] == [token_mount, data]


def sized(cpu: str, memory: str = "64Mi", **container: Any) -> dict[str, Any]:
    return {
        "name": "app",
        "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}},
        **container,
    }


def test_a_resize_above_is_a_resize_below() -> None:
    resized = upper_pod(containers=[sized("250m", "128Mi")])
    desired = desired_lower_pod(resized, NamespaceMapping(), OWNER)
    lower = desired_lower_pod(upper_pod(containers=[sized("100m")]), NamespaceMapping(), OWNER)
    assert resize_patch(lower, desired) == {
        "spec": {
            "containers": [
                {
                    "name": "app",
                    "resources": {
                        "requests": {"cpu": "250m", "memory": "128Mi"},
                        "limits": {"memory": "128Mi"},
                    },
                }
            ]
        }
    }
    assert resize_patch(desired, desired) is None
    # Resources are not among the fields a plain update may change; their record is
    # written once the resize is made.
    assert lower_pod_patch(lower, desired, resize_pending=True) is None
    # A record left behind (its write failed) is brought up to date with no resize due.
    record = resources_record_patch(desired, None)
    del record["metadata"]["annotations"][keys.RESIZE_REFUSED_ANNOTATION]  # none to clear
    assert lower_pod_patch(lower, desired) == record
    older = copy.deepcopy(lower)
    del older["metadata"]["annotations"][keys.UPPER_RESOURCES_ANNOTATION]
    assert lower_pod_patch(older, desired) is None, "made before the record: none written"


def test_a_resize_refusal_is_ours_below_and_observes_what_the_status_does() -> None:
    """Written on the upper pod, the refusal annotation never goes below (it told of a
    refusal that never was). The condition observes the generation the rest of the
    status does: a kubelet never reports one ahead of it."""
    upper = upper_pod(containers=[sized("100m")])
    upper["metadata"]["annotations"][keys.RESIZE_REFUSED_ANNOTATION] = "forged"
    lower = desired_lower_pod(upper, NamespaceMapping(), OWNER)
    assert keys.RESIZE_REFUSED_ANNOTATION not in lower["metadata"]["annotations"]
    bigger = upper_pod(containers=[sized("200m")])
    asked = desired_lower_pod(bigger, NamespaceMapping(), OWNER)
    lower["metadata"]["annotations"].update(
        resources_record_patch(asked, "refused")["metadata"]["annotations"]
    )
    assert resize_patch(lower, asked) is None, "refused for good: not asked again"
    bigger["metadata"]["generation"] = 5
    status = with_resize_refusal(
        {"observedGeneration": 4}, lower, asked, bigger, None, "2026-11-29T10:00:00Z"
    )
    (condition,) = status["conditions"]
    assert (condition["reason"], condition["message"]) == ("Infeasible", "refused")
    assert condition["observedGeneration"] == 4


def test_after_a_refusal_for_good_each_container_is_compared_with_what_it_was_given() -> None:
    """Both containers asked for 200m and refused for good: the record keeps what they
    were given (100m), so a later resize of one still brings the other to what it asks,
    and one a lower webhook changed when the pod was made is still left alone."""

    def desired(app: str, side: str) -> dict[str, Any]:
        containers = [sized(app), sized(side, name="side"), sized("100m", name="log")]
        return desired_lower_pod(upper_pod(containers=containers), NamespaceMapping(), OWNER)

    lower = desired("100m", "100m")
    lower["spec"]["containers"][2] = sized("250m", name="log")  # a lower webhook's minimum
    both = desired("200m", "200m")
    lower["metadata"]["annotations"].update(
        resources_record_patch(both, "refused")["metadata"]["annotations"]
    )
    assert resize_patch(lower, both) is None, "refused for good: not asked again"
    assert lower_pod_patch(lower, both) is None, "nor recorded as given"
    for app, resized in (("300m", ["app", "side"]), ("100m", ["side"])):
        one = desired(app, "200m")
        patch = resize_patch(lower, one)
        assert patch is not None
        assert [c["name"] for c in patch["spec"]["containers"]] == resized
        cleared = lower_pod_patch(lower, one, resize_pending=True)
        assert cleared is not None
        assert cleared["metadata"]["annotations"] == {keys.RESIZE_REFUSED_ANNOTATION: None}


def test_only_sidecars_among_init_containers_are_resized() -> None:
    def pod(cpu: str) -> dict[str, Any]:
        return {
            "spec": {
                "containers": [sized("100m")],
                "initContainers": [
                    sized(cpu, name="setup"),
                    sized(cpu, name="proxy", restartPolicy="Always"),
                ],
            }
        }

    assert resize_patch(pod("100m"), pod("200m")) == {
        "spec": {"initContainers": [{"name": "proxy", "resources": {"requests": {"cpu": "200m"}}}]}
    }


def test_resources_a_lower_webhook_changed_are_resized_only_when_they_change_above() -> None:
    """A minimum or a ratio a lower admission webhook imposed when the pod was made is its
    policy: set back on the first sync it would be undone, or refused on every sync."""
    upper = upper_pod(containers=[sized("100m")])
    lower = desired_lower_pod(upper, NamespaceMapping(), OWNER)
    lower["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "250m"  # the policy's
    desired = desired_lower_pod(upper, NamespaceMapping(), OWNER)
    assert resize_patch(lower, desired) is None
    assert lower_pod_patch(lower, desired) is None, "the record is not written on its own"
    resized = desired_lower_pod(upper_pod(containers=[sized("300m")]), NamespaceMapping(), OWNER)
    assert resize_patch(lower, resized) == {
        "spec": {"containers": [{"name": "app", "resources": {"requests": {"cpu": "300m"}}}]}
    }
    lower["metadata"]["annotations"].update(
        resources_record_patch(resized, None)["metadata"]["annotations"]
    )
    assert resize_patch(lower, resized) is None, "recorded once made"


def test_a_value_only_the_lower_cluster_set_is_left_alone() -> None:
    # A LimitRange below may have added a default the upper pod never asked for.
    lower = {"spec": {"containers": [sized("100m")]}}
    lower["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "1"
    upper = {"spec": {"containers": [sized("100m")]}}
    assert resize_patch(lower, upper) is None
    upper["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "300m"
    assert resize_patch(lower, upper) == {
        "spec": {"containers": [{"name": "app", "resources": {"requests": {"cpu": "300m"}}}]}
    }


CLUSTER = keys.CLUSTER_ID_LABEL
ZONE = "topology.kubernetes.io/zone"


def node_term(*expressions: tuple[str, str, list[str]]) -> dict[str, Any]:
    return {
        "matchExpressions": [
            {"key": key, "operator": operator, "values": values}
            for key, operator, values in expressions
        ]
    }


def required_terms(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


def lower_affinity(affinity: dict[str, Any]) -> Any:
    return desired_lower_pod(upper_pod(affinity=affinity), NamespaceMapping(), OWNER)["spec"].get(
        "affinity"
    )


def test_a_node_term_on_this_cluster_lets_every_lower_node_through() -> None:
    """Terms are ORed: a term that held only of the cluster holds of every node below."""
    affinity = required_terms(
        node_term((CLUSTER, "In", ["lower-1"])), node_term(("disk", "In", ["ssd"]))
    )
    assert lower_affinity(affinity) is None


def test_a_node_term_on_another_cluster_is_dropped_and_the_others_kept() -> None:
    affinity = required_terms(
        node_term((CLUSTER, "In", ["lower-2"])),
        node_term((CLUSTER, "NotIn", ["lower-2"]), ("disk", "In", ["ssd"])),
    )
    assert lower_affinity(affinity) == required_terms(node_term(("disk", "In", ["ssd"])))


def test_node_terms_no_lower_node_can_match_fail_the_pod() -> None:
    affinity = required_terms(node_term((CLUSTER, "In", ["lower-2"])))
    with pytest.raises(TranslationError, match="node affinity"):
        lower_affinity(affinity)
    with pytest.raises(TranslationError, match="nodeSelector"):
        desired_lower_pod(upper_pod(nodeSelector={CLUSTER: "lower-2"}), NamespaceMapping(), OWNER)


def test_a_requirement_this_virtual_node_meets_by_keeping_nodes_away_goes_below() -> None:
    """``type NotIn [gpu]`` holds of the virtual node (``type: virtual-kubelet``) and is
    about the lower nodes: until 2026-11-29 it was dropped, and the pod landed on a lower
    GPU node it had excluded. One that picks the virtual node out is met here."""
    keeping_away = required_terms(
        node_term((keys.NODE_TYPE_LABEL, "NotIn", ["gpu"])),
    )
    assert lower_affinity(keeping_away) == keeping_away
    by_hostname = required_terms(node_term((keys.HOSTNAME_LABEL, "NotIn", ["big"])))
    assert lower_affinity(by_hostname) == by_hostname
    picking = required_terms(
        node_term((keys.NODE_TYPE_LABEL, "In", [keys.NODE_TYPE_VIRTUAL]), ("disk", "In", ["ssd"]))
    )
    assert lower_affinity(picking) == required_terms(node_term(("disk", "In", ["ssd"])))


@pytest.mark.parametrize(
    "expression",
    [
        (keys.HOSTNAME_LABEL, "NotIn", ["vk-lower-1"]),
        (keys.NODE_TYPE_LABEL, "NotIn", [keys.NODE_TYPE_VIRTUAL]),
        (keys.NODE_TYPE_LABEL, "DoesNotExist", []),
    ],
)
def test_a_requirement_keeping_this_virtual_node_away_fails_its_term(
    expression: tuple[str, str, list[str]],
) -> None:
    """It went below, where every lower node met it, and the pod ran on the virtual node
    it had excluded (the webhook keeps it from the upper scheduler)."""
    with pytest.raises(TranslationError, match="node affinity"):
        lower_affinity(required_terms(node_term(expression)))
    either = required_terms(node_term(expression), node_term(("disk", "In", ["ssd"])))
    assert lower_affinity(either) == required_terms(node_term(("disk", "In", ["ssd"])))


def test_an_empty_node_term_matches_no_node_below_either() -> None:
    """The scheduler's rule: an empty term matches nothing. Until 2026-11-29 it was taken
    for a term that only spoke of this cluster, and every lower node let through."""
    gpu = node_term(("gpu", "In", ["true"]))
    assert lower_affinity(required_terms(gpu, {"matchExpressions": []})) == required_terms(gpu)
    with pytest.raises(TranslationError, match="node affinity"):
        lower_affinity(required_terms({}))


def name_term(operator: str, *names: str) -> dict[str, Any]:
    return {"matchFields": [{"key": "metadata.name", "operator": operator, "values": list(names)}]}


def test_a_pin_to_this_virtual_node_by_name_holds_of_every_lower_node() -> None:
    """A DaemonSet pins each pod to its node by name: on a virtual node, that name is
    the cluster, and no lower node carries it."""
    assert lower_affinity(required_terms(name_term("In", "vk-lower-1"))) is None
    assert lower_affinity(
        required_terms(
            {**name_term("In", "vk-lower-2", "vk-lower-1"), **node_term(("d", "In", ["s"]))}
        )
    ) == required_terms(node_term(("d", "In", ["s"])))


def test_other_names_go_down_and_keeping_off_this_virtual_node_fails_the_term() -> None:
    lower_node = required_terms(name_term("In", "lower-1-node-0"))
    assert lower_affinity(lower_node) == lower_node
    affinity = required_terms(name_term("NotIn", "vk-lower-1"), node_term(("d", "In", ["s"])))
    assert lower_affinity(affinity) == required_terms(node_term(("d", "In", ["s"])))
    with pytest.raises(TranslationError, match="node affinity"):
        lower_affinity(required_terms(name_term("NotIn", "vk-lower-1")))


def test_preferred_node_terms_on_the_cluster_are_decided_here() -> None:
    affinity = {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 5, "preference": node_term((CLUSTER, "In", ["lower-1"]))},
                {"weight": 3, "preference": node_term((CLUSTER, "In", ["lower-2"]))},
                {
                    "weight": 1,
                    "preference": node_term((CLUSTER, "Exists", []), ("disk", "In", ["ssd"])),
                },
            ]
        }
    }
    assert lower_affinity(affinity) == {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": node_term(("disk", "In", ["ssd"]))}
            ]
        }
    }


def test_pod_affinity_and_spread_across_clusters_stay_above() -> None:
    """The upper scheduler placed the pod by them; below no node has the key, and a
    required term or a DoNotSchedule constraint on it would never let the pod schedule."""
    across_clusters = {"topologyKey": CLUSTER, "labelSelector": {"matchLabels": {"app": "web"}}}
    across_zones = {"topologyKey": ZONE, "labelSelector": {"matchLabels": {"app": "web"}}}
    spread = {"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}
    pod = upper_pod(
        affinity={
            "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [across_clusters]},
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [across_clusters, across_zones],
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 1, "podAffinityTerm": across_clusters}
                ],
            },
        },
        topologySpreadConstraints=[
            {**spread, "topologyKey": CLUSTER},
            {**spread, "topologyKey": ZONE},
        ],
    )
    spec = desired_lower_pod(pod, NamespaceMapping(), OWNER)["spec"]
    own_across_zones = {
        **across_zones,
        "labelSelector": {"matchLabels": {"app": "web"}, "matchExpressions": [OWN_PODS]},
    }
    assert spec["affinity"] == {
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [own_across_zones]}
    }
    assert spec["topologySpreadConstraints"] == [{**spread, "topologyKey": ZONE}]


_keys = st.sampled_from([CLUSTER, ZONE, "disk"])
_values = st.lists(st.sampled_from(["lower-1", "lower-2", "ssd"]), min_size=1, max_size=2)
_expressions = st.lists(
    st.one_of(
        st.tuples(_keys, st.sampled_from(["In", "NotIn"]), _values),
        st.tuples(_keys, st.sampled_from(["Exists", "DoesNotExist"]), st.just([])),
    ),
    min_size=1,
    max_size=3,
)
_node_terms = _expressions.map(lambda expressions: node_term(*expressions))
_pod_terms = _keys.map(
    lambda key: {"topologyKey": key, "labelSelector": {"matchLabels": {"app": "web"}}}
)
_pod_affinities = st.fixed_dictionaries(
    {},
    optional={
        "requiredDuringSchedulingIgnoredDuringExecution": st.lists(_pod_terms, max_size=2),
        "preferredDuringSchedulingIgnoredDuringExecution": st.lists(
            _pod_terms.map(lambda term: {"weight": 1, "podAffinityTerm": term}), max_size=2
        ),
    },
)
_scheduling = st.fixed_dictionaries(
    {},
    optional={
        "nodeSelector": st.dictionaries(_keys, st.sampled_from(["lower-1", "lower-2", "ssd"])),
        "affinity": st.fixed_dictionaries(
            {},
            optional={
                "nodeAffinity": st.fixed_dictionaries(
                    {},
                    optional={
                        "requiredDuringSchedulingIgnoredDuringExecution": st.lists(
                            _node_terms, min_size=1, max_size=3
                        ).map(lambda terms: {"nodeSelectorTerms": terms}),
                        "preferredDuringSchedulingIgnoredDuringExecution": st.lists(
                            _node_terms.map(lambda term: {"weight": 1, "preference": term}),
                            max_size=2,
                        ),
                    },
                ),
                "podAffinity": _pod_affinities,
                "podAntiAffinity": _pod_affinities,
            },
        ),
        "topologySpreadConstraints": st.lists(
            _keys.map(
                lambda key: {"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "DoNotSchedule"}
            ),
            max_size=3,
        ),
    },
)


@given(scheduling=_scheduling)
def test_no_cluster_id_key_ever_reaches_a_lower_pod(scheduling: dict[str, Any]) -> None:
    """Through the webhook's stash and back, as a federated pod goes."""
    pod = upper_pod(**scheduling)
    pod["spec"], pod["metadata"]["annotations"] = stash_scheduling(
        pod["spec"], pod["metadata"]["annotations"]
    )
    try:
        lower = desired_lower_pod(pod, NamespaceMapping(), OWNER)
    except TranslationError:
        return  # a pod no lower node may take fails, as a kubelet refuses it
    assert CLUSTER not in json.dumps(lower["spec"])
    zone_spread = [
        c for c in scheduling.get("topologySpreadConstraints", []) if c["topologyKey"] != CLUSTER
    ]
    assert lower["spec"].get("topologySpreadConstraints", []) == zone_spread


def test_host_access_names_everything_that_reaches_into_the_node() -> None:
    spec = {
        "hostNetwork": True,
        "hostPID": True,
        "hostIPC": False,
        "volumes": [{"name": "root", "hostPath": {"path": "/"}}, {"name": "tmp", "emptyDir": {}}],
        "initContainers": [{"name": "setup", "securityContext": {"privileged": True}}],
        "containers": [
            {"name": "app", "ports": [{"containerPort": 80, "hostPort": 8080}]},
            {"name": "plain", "ports": [{"containerPort": 81}], "securityContext": {}},
        ],
    }
    assert host_access(spec) == [
        "spec.hostNetwork",
        "spec.hostPID",
        "hostPath volume 'root'",
        "privileged container 'setup'",
        "host port 8080 of container 'app'",
    ]
    assert host_access(upper_pod()["spec"]) == []


def test_host_access_names_the_ways_out_of_the_baseline_too() -> None:
    """Added capabilities beyond the baseline's, seccomp or AppArmor off and an unmasked
    /proc are a known way out of a container (cgroup release_agent, module loading)."""
    spec = {
        "securityContext": {"seccompProfile": {"type": "Unconfined"}},
        "containers": [
            {
                "name": "escape",
                "securityContext": {
                    "capabilities": {"add": ["NET_BIND_SERVICE", "SYS_ADMIN", "CAP_SYS_MODULE"]},
                    "appArmorProfile": {"type": "Unconfined"},
                    "procMount": "Unmasked",
                },
            },
            {
                "name": "fine",
                "securityContext": {
                    "capabilities": {"add": ["CHOWN"], "drop": ["ALL"]},
                    "seccompProfile": {"type": "RuntimeDefault"},
                    "procMount": "Default",
                },
            },
        ],
    }
    assert host_access(spec) == [
        "seccompProfile Unconfined of the pod",
        "capability SYS_ADMIN of container 'escape'",
        "capability CAP_SYS_MODULE of container 'escape'",
        "appArmorProfile Unconfined of container 'escape'",
        "unmasked /proc of container 'escape'",
    ]


def test_host_access_names_selinux_and_sysctls_beyond_the_baseline() -> None:
    """spc_t turns SELinux confinement off on an enforcing node; a sysctl outside the
    baseline's safe set is not isolated from the node's other pods."""
    spec = {
        "securityContext": {
            "seLinuxOptions": {"type": "spc_t", "level": "s0:c1,c2"},
            "sysctls": [
                {"name": "kernel.msgmax", "value": "1"},
                {"name": "net/ipv4/tcp_syncookies", "value": "1"},
                {"name": "net.ipv4.ip_local_port_range", "value": "1024 65535"},
                # Safe since Pod Security v1.32 (Cassandra's usual tuning).
                {"name": "net.ipv4.tcp_rmem", "value": "4096 87380 16777216"},
            ],
        },
        "containers": [
            {"name": "odd", "securityContext": {"seLinuxOptions": {"user": "system_u"}}},
            {"name": "fine", "securityContext": {"seLinuxOptions": {"type": "container_t"}}},
        ],
    }
    assert host_access(spec) == [
        "SELinux type spc_t of the pod",
        "sysctl kernel.msgmax",
        "SELinux user of container 'odd'",
    ]
    refusal = host_access_refusal(spec, "apps", (), "lower-1")
    assert refusal is not None and "sysctl kernel.msgmax" in refusal
    assert host_access_refusal(spec, "apps", ("apps",), "lower-1") is None


def test_a_deleted_pod_ends_as_a_kubelet_ends_it() -> None:
    pod = upper_pod()
    ready = {"status": "True", "lastTransitionTime": "2026-11-27T09:00:00Z"}
    pod["status"] = {
        "phase": "Running",
        "conditions": [
            {"type": "Ready", **ready},
            {"type": "ContainersReady", **ready},
            {"type": "PodScheduled", **ready},
        ],
        "initContainerStatuses": [
            {"name": "done", "state": {"terminated": {"exitCode": 0}}},
            {"name": "never", "state": {"waiting": {"reason": "PodInitializing"}}},
        ],
        "containerStatuses": [
            {"name": "ended", "ready": False, "state": {"terminated": {"exitCode": 0}}},
            {"name": "running", "ready": True, "started": True, "state": {"running": {}}},
        ],
    }
    status = terminated_status(pod, "2026-11-27T10:00:00Z")
    assert status["phase"] == "Failed", "never Succeeded on a guess"
    assert [c["state"] for c in status["initContainerStatuses"]] == [
        {"terminated": {"exitCode": 0}},
        {"waiting": {"reason": "PodInitializing"}},
    ], "an init container never started stays waiting"
    ended, running = status["containerStatuses"]
    assert ended["state"] == {"terminated": {"exitCode": 0}}
    assert running["state"]["terminated"] == {
        "reason": "ContainerStatusUnknown",
        "message": "The container could not be located when the pod was terminated",
        "exitCode": 137,
        "finishedAt": "2026-11-27T10:00:00Z",
    }
    assert (running["ready"], running["started"]) == (False, False)
    by_type = {c["type"]: c for c in status["conditions"]}
    for kind in ("Ready", "ContainersReady"):
        assert by_type[kind]["status"] == "False" and by_type[kind]["reason"] == "PodFailed"
        assert by_type[kind]["lastTransitionTime"] == "2026-11-27T10:00:00Z"
    assert by_type["PodScheduled"]["status"] == "True"
    assert pod["status"]["phase"] == "Running", "the pod itself untouched"
    pod["status"]["phase"] = "Succeeded"
    assert terminated_status(pod, "2026-11-27T10:00:00Z") == pod["status"], "ended already"


def test_a_deleted_pod_that_never_initialized_leaves_its_containers_waiting() -> None:
    pod = upper_pod(initContainers=[{"name": "setup", "image": "i"}])
    waiting = {"waiting": {"reason": "PodInitializing"}}
    pod["status"] = {
        "phase": "Pending",
        "initContainerStatuses": [{"name": "setup", "state": {"running": {}}}],
        "containerStatuses": [{"name": "app", "ready": False, "state": waiting}],
    }
    status = terminated_status(pod, "2026-11-27T10:00:00Z")
    assert status["phase"] == "Failed"
    (setup,) = status["initContainerStatuses"]
    assert setup["state"]["terminated"]["reason"] == "ContainerStatusUnknown"
    assert status["containerStatuses"][0]["state"] == waiting


@pytest.mark.parametrize(("started", "initialized"), [(True, True), (False, False)])
def test_a_deleted_pod_whose_last_init_container_is_a_running_sidecar_has_initialized(
    started: bool, initialized: bool
) -> None:
    """As the kubelet's hasPodInitialized: its app container, still being created, ends
    with the unknown status (exit 137, which a Job's podFailurePolicy may name), not
    waiting as in a pod that never initialized."""
    pod = upper_pod(initContainers=[{"name": "proxy", "image": "i", "restartPolicy": "Always"}])
    waiting = {"waiting": {"reason": "ContainerCreating"}}
    proxy = {"name": "proxy", "started": started, "state": {"running": {}}}
    pod["status"] = {
        "phase": "Pending",
        "initContainerStatuses": [proxy],
        "containerStatuses": [{"name": "app", "ready": False, "state": waiting}],
    }
    (app,) = terminated_status(pod, "2026-11-28T10:00:00Z")["containerStatuses"]
    if initialized:
        assert app["state"]["terminated"]["exitCode"] == 137
    else:
        assert app["state"] == waiting


def test_a_lower_pod_is_deleted_again_only_for_a_shorter_grace() -> None:
    lower: dict[str, Any] = {"metadata": {"name": "web-1"}}
    assert deletion_due(lower, None) and deletion_due(lower, 30)
    lower["metadata"] |= {"deletionTimestamp": "2026-11-27T10:00:00Z"}
    lower["metadata"]["deletionGracePeriodSeconds"] = 30
    assert deletion_due(lower, 5) and deletion_due(lower, 0)
    assert not deletion_due(lower, 30) and not deletion_due(lower, 60)
    assert not deletion_due(lower, None), "nothing known above: the lower grace stands"


def test_virtual_kubelets_usual_targeting_is_met_here_and_goes() -> None:
    """``type: virtual-kubelet`` and a hostname pin name this virtual node, whose lower
    nodes carry neither: met here, they would keep the pod from every lower node."""
    selector = {keys.NODE_TYPE_LABEL: keys.NODE_TYPE_VIRTUAL, "disk": "ssd"}
    lower = desired_lower_pod(upper_pod(nodeSelector=selector), NamespaceMapping(), OWNER)
    assert lower["spec"]["nodeSelector"] == {"disk": "ssd"}
    # The labels the webhook selects above (the one it gave before 2026-11-29 too),
    # written by a user into the original.
    for label in (keys.VIRTUAL_NODE_LABEL, keys.PROVEN_VIRTUAL_NODE_LABEL):
        selector = {label: keys.VIRTUAL_NODE_LABEL_VALUE, "disk": "ssd"}
        lower = desired_lower_pod(upper_pod(nodeSelector=selector), NamespaceMapping(), OWNER)
        assert lower["spec"]["nodeSelector"] == {"disk": "ssd"}
    pinned = required_terms(node_term((keys.HOSTNAME_LABEL, "In", ["vk-lower-1", "vk-lower-2"])))
    assert lower_affinity(pinned) is None


def test_values_this_virtual_node_does_not_have_are_left_for_the_lower_nodes() -> None:
    """``type: gpu`` or a lower node's hostname speak of lower nodes: kept as they are."""
    selector = {keys.NODE_TYPE_LABEL: "gpu"}
    lower = desired_lower_pod(upper_pod(nodeSelector=selector), NamespaceMapping(), OWNER)
    assert lower["spec"]["nodeSelector"] == selector
    lower_node_pin = required_terms(node_term((keys.HOSTNAME_LABEL, "In", ["kwok-node-3"])))
    assert lower_affinity(lower_node_pin) == lower_node_pin


def test_label_keys_the_upper_apiserver_merged_are_not_merged_again_below() -> None:
    """A Deployment's zone spread with matchLabelKeys [pod-template-hash] stays above
    (zone kept), and the upper apiserver merged the key into its selector: sent down as
    it is, the lower apiserver would merge it again, find the key in both and refuse the
    pod."""
    region = "topology.kubernetes.io/region"
    merged = {"key": "pod-template-hash", "operator": "In", "values": ["abc"]}
    other = {"key": "track", "operator": "NotIn", "values": ["canary"]}
    spread = {
        "maxSkew": 1,
        "topologyKey": region,
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"app": "web"}, "matchExpressions": [merged]},
        "matchLabelKeys": ["pod-template-hash", "unlabelled"],
    }
    anti = {
        "topologyKey": region,
        "labelSelector": {"matchExpressions": [other]},
        "mismatchLabelKeys": ["track"],
    }
    upper = upper_pod(
        topologySpreadConstraints=[spread],
        affinity={"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [anti]}},
    )
    upper["metadata"]["labels"] = {"app": "web", "pod-template-hash": "abc", "track": "canary"}
    lower = desired_lower_pod(upper, NamespaceMapping(), OWNER)["spec"]
    (lower_spread,) = lower["topologySpreadConstraints"]
    assert lower_spread["matchLabelKeys"] == ["unlabelled"], "a key not merged stays"
    assert lower_spread["labelSelector"] == spread["labelSelector"]
    (lower_anti,) = lower["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert "mismatchLabelKeys" not in lower_anti
    assert lower_anti["labelSelector"]["matchExpressions"] == [other, OWN_PODS]
    assert upper["spec"]["topologySpreadConstraints"][0]["matchLabelKeys"] == [
        "pod-template-hash",
        "unlabelled",
    ], "the upper pod is not changed"
