from __future__ import annotations

import base64
import copy
import ipaddress
import json
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from cryptography import x509
from hypothesis import given

from kubekit import keys, pki, stash
from kubekit.schedulingvalidation import Invalid, check_scheduling_fields
from tests.unit.test_stash import specs
from webhook import certjob
from webhook.admission import BadReview, keep_off_response, parse_review, review_response
from webhook.configuration import (
    KEEP_OFF_PATH,
    PATH,
    daemonsets_webhook,
    stash_webhook,
    tolerating_pods_webhook,
    url_configuration,
)
from webhook.daemonsets import off_virtual_nodes
from webhook.server import MovesFollower, make_app, parse_args

MANIFESTS = Path(__file__).parents[2] / "manifests"


def review(
    pod: dict[str, Any] | None = None, *, operation: str = "CREATE", **request: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "uid": "d2c1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "operation": operation,
        "object": pod,
        **request,
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": body}


def pod(spec: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "p", "namespace": "ns"}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def answer(body: dict[str, Any]) -> dict[str, Any]:
    response: dict[str, Any] = review_response(
        parse_review(json.dumps(body).encode()), stash.DEFAULT_KEEP_KEYS
    )["response"]
    return response


def patched(original: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    if "patch" not in response:
        return original
    assert response["patchType"] == "JSONPatch"
    operations = json.loads(base64.b64decode(response["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(original, operations)
    return result


def daemonset_review(
    template_spec: dict[str, Any], old_template_spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    def daemonset(spec: dict[str, Any]) -> dict[str, Any]:
        template = {"metadata": {"labels": {"app": "a"}}, "spec": spec}
        return {
            "metadata": {"name": "a", "namespace": "kube-system"},
            "spec": {"template": template},
        }

    body = review(
        daemonset(template_spec),
        operation="CREATE" if old_template_spec is None else "UPDATE",
        kind={"group": "apps", "version": "v1", "kind": "DaemonSet"},
        resource={"group": "apps", "version": "v1", "resource": "daemonsets"},
    )
    if old_template_spec is not None:
        body["request"]["oldObject"] = daemonset(old_template_spec)
    return body


@given(specs)
def test_the_patch_makes_the_stashed_pod(spec: dict[str, Any]) -> None:
    for existing in (None, {"a/b~c": "x"}):
        original = pod(spec, existing)
        response = answer(review(copy.deepcopy(original)))
        assert response["uid"] == "d2c1"
        try:
            check_scheduling_fields(spec)
        except Invalid as error:
            # The apiserver, which sees the upper view only, would have taken it.
            assert not response["allowed"]
            assert response["status"]["message"].startswith(str(error))
            continue
        assert response["allowed"]
        result = patched(original, response)
        new_spec, new_annotations = stash.stash_scheduling(spec, existing or {})
        assert result["spec"] == new_spec
        assert result["metadata"].get("annotations", {}) == new_annotations
        # The lower cluster gets the original back.
        restored = stash.restore_scheduling(
            result["spec"], new_annotations.get(keys.STASH_ANNOTATION)
        )
        assert restored == spec


def test_a_pod_gets_the_provider_toleration_and_keeps_cluster_level_selectors() -> None:
    spec = {
        "containers": [{"name": "c", "image": "i"}],
        "nodeSelector": {"disk": "ssd", keys.CLUSTER_ID_LABEL: "lower-1"},
    }
    result = patched(pod(spec), answer(review(pod(spec))))
    # The virtual nodes' label a kubelet cannot set on itself (until 2026-11-29 ours,
    # which a kubelet could, drawing federated pods).
    assert result["spec"]["nodeSelector"] == {
        keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
        keys.CLUSTER_ID_LABEL: "lower-1",
    }
    assert result["spec"]["tolerations"] == [stash.PROVIDER_TOLERATION]
    saved = stash.decode(result["metadata"]["annotations"][keys.STASH_ANNOTATION])
    assert saved == {"nodeSelector": spec["nodeSelector"], "tolerations": None}


def test_dry_run_gets_the_same_answer() -> None:
    spec = {"containers": [{"name": "c", "image": "i"}], "nodeSelector": {"disk": "ssd"}}
    assert answer(review(pod(spec), dryRun=True)) == answer(review(pod(spec)))


@pytest.mark.parametrize("value", ["Never", "false", "", "no"])
def test_a_descheduler_annotation_other_than_never_is_warned_of(value: str) -> None:
    spec = {"containers": [{"name": "c", "image": "i"}]}
    response = answer(review(pod(spec, {keys.DESCHEDULER_ANNOTATION: value})))
    assert response["warnings"] == [
        f"annotation kubestrata.io/descheduler={value!r} is read as 'never', the only value "
        "it takes: the descheduler will not move this pod or evict it to make room"
    ]
    assert "patch" in response
    daemon = pod(spec, {keys.DESCHEDULER_ANNOTATION: value})
    daemon["metadata"]["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "u", "controller": True}
    ]
    assert answer(review(daemon))["warnings"] == response["warnings"]
    never = answer(review(pod(spec, {keys.DESCHEDULER_ANNOTATION: "never"})))
    assert "warnings" not in never


@pytest.mark.parametrize(
    "body",
    [
        review(pod({"nodeSelector": {"disk": "ssd"}}), operation="UPDATE", oldObject=pod({})),
        review(pod({"nodeSelector": {"disk": "ssd"}}), subResource="ephemeralcontainers"),
        review(
            {"metadata": {"name": "c"}, "data": {}},
            kind={"group": "", "version": "v1", "kind": "ConfigMap"},
        ),
        review(None, operation="DELETE", oldObject=pod({})),
    ],
    ids=["update of a pod made before the webhook", "subresource", "configmap", "delete"],
)
def test_what_is_not_a_pod_creation_passes_untouched(body: dict[str, Any]) -> None:
    assert answer(body) == {"uid": "d2c1", "allowed": True}


def test_a_pod_with_a_stash_is_left_alone_and_a_bad_stash_is_refused() -> None:
    stashed_spec, annotations = stash.stash_scheduling({"nodeSelector": {"disk": "ssd"}}, {})
    assert answer(review(pod(stashed_spec, annotations))) == {"uid": "d2c1", "allowed": True}
    refused = answer(review(pod({}, {keys.STASH_ANNOTATION: '{"version": 9}'})))
    assert refused["allowed"] is False
    assert refused["status"]["code"] == 400
    assert "unknown stash version 9" in refused["status"]["message"]
    forged = '{"version": 1, "originals": {"nodeSelector": ["disk"]}}'
    refused = answer(review(pod({}, {keys.STASH_ANNOTATION: forged})))
    assert refused["allowed"] is False
    assert "originals.nodeSelector must be a JSON object" in refused["status"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "body is not JSON"),
        (b"[]", "the AdmissionReview must be a JSON object, not list"),
        (b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}', "v1beta1"),
        (json.dumps({**review(pod({})), "request": "x"}).encode(), "request must be a JSON object"),
        (json.dumps(review(pod({}), uid="")).encode(), "request.uid must be a non-empty string"),
        (json.dumps(review(None)).encode(), "request.object must be a JSON object, not NoneType"),
        (json.dumps(review({"metadata": {}})).encode(), "request.object.spec must be"),
        (
            json.dumps(review(pod({}, {"a": 1}))).encode(),  # type: ignore[dict-item]
            "annotations must map strings to strings",
        ),
        (
            json.dumps(
                {
                    **daemonset_review({}),
                    "request": {**daemonset_review({})["request"], "object": {"spec": {}}},
                }
            ).encode(),
            "request.object.spec.template must be a JSON object",
        ),
        (
            json.dumps(
                {
                    **daemonset_review({}, {}),
                    "request": {**daemonset_review({}, {})["request"], "oldObject": None},
                }
            ).encode(),
            "request.oldObject must be a JSON object",
        ),
        (
            json.dumps(review({**pod({}), "metadata": {"ownerReferences": ["x"]}})).encode(),
            r"ownerReferences\[0\] must be a JSON object",
        ),
    ],
)
def test_unreadable_reviews_say_what_is_wrong(body: bytes, message: str) -> None:
    with pytest.raises(BadReview, match=message):
        parse_review(body)


async def test_the_server_answers_400_for_bad_bodies_and_200_with_a_patch() -> None:
    async with TestClient(TestServer(make_app(stash.DEFAULT_KEEP_KEYS))) as client:
        bad = await client.post("/mutate", data=b"{", headers={"Content-Type": "application/json"})
        assert bad.status == 400
        assert "body is not JSON" in (await bad.json())["message"]
        wrong_type = await client.post(
            "/mutate", data=b"{}", headers={"Content-Type": "text/plain"}
        )
        assert wrong_type.status == 400
        assert "Content-Type must be application/json" in (await wrong_type.json())["message"]
        good = await client.post("/mutate", json=review(pod({"nodeSelector": {"disk": "ssd"}})))
        assert good.status == 200
        assert (await good.json())["response"]["patchType"] == "JSONPatch"


MOVED_UNTIL = "2099-01-01T00:00:00Z"


def controlled_pod(owner: str) -> dict[str, Any]:
    made = pod({"nodeSelector": {"disk": "ssd"}})
    made["metadata"]["ownerReferences"] = [{"uid": owner, "controller": True, "kind": "ReplicaSet"}]
    return made


def test_a_daemonsets_pod_keeps_its_pin_to_one_node() -> None:
    """Stashed, the pin would go, the pod would be bound to another node, its DaemonSet
    would delete it there and make another, without end."""
    name_pin = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a"]}]}
    daemon = pod(
        {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [name_pin]
                    }
                }
            },
            "tolerations": [{"operator": "Exists"}],
            "nodeSelector": {"disk": "ssd"},
        }
    )
    assert answer(review(daemon))["patch"]  # a bare pod of that spec is stashed
    daemon["metadata"]["ownerReferences"] = [{"uid": "d", "controller": True, "kind": "DaemonSet"}]
    assert answer(review(daemon)) == {"uid": "d2c1", "allowed": True}


EVERY_TAINT = [{"operator": "Exists"}]
OFF = {"key": keys.CLUSTER_ID_LABEL, "operator": "DoesNotExist"}


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


def test_a_daemonset_tolerating_every_taint_is_kept_off_virtual_nodes_in_every_term() -> None:
    assert off_virtual_nodes({"tolerations": EVERY_TAINT}) == required({"matchExpressions": [OFF]})
    disk = {"key": "disk", "operator": "In", "values": ["ssd"]}
    by_name = {"key": "metadata.name", "operator": "In", "values": ["n"]}
    spec = {
        "tolerations": EVERY_TAINT,
        "affinity": {
            **required({"matchExpressions": [disk]}, {"matchFields": [by_name]}),
            "podAntiAffinity": {"x": 1},
        },
    }
    kept_off = off_virtual_nodes(spec)
    assert kept_off == {
        **required(
            {"matchExpressions": [disk, OFF]}, {"matchFields": [by_name], "matchExpressions": [OFF]}
        ),
        "podAntiAffinity": {"x": 1},
    }
    assert spec["affinity"] == {
        **required({"matchExpressions": [disk]}, {"matchFields": [by_name]}),
        "podAntiAffinity": {"x": 1},
    }, "the template is not changed in place"
    assert off_virtual_nodes({**spec, "affinity": kept_off}) is None, "already kept off"
    assert kept_off is not None
    terms = kept_off["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    terms["nodeSelectorTerms"].append({"matchExpressions": [disk]})
    assert off_virtual_nodes({**spec, "affinity": kept_off}) == required(
        {"matchExpressions": [disk, OFF]},
        {"matchFields": [by_name], "matchExpressions": [OFF]},
        {"matchExpressions": [disk, OFF]},
    ) | {"podAntiAffinity": {"x": 1}}, "a term added later is kept off too"


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"tolerations": [{"key": "gpu", "operator": "Exists"}]},
        {"tolerations": [{"operator": "Exists", "effect": "NoExecute"}]},
        {"tolerations": [*EVERY_TAINT, {"key": keys.PROVIDER_TAINT_KEY, "operator": "Exists"}]},
        {"tolerations": EVERY_TAINT, "nodeSelector": {keys.CLUSTER_ID_LABEL: "lower-1"}},
        {
            "tolerations": EVERY_TAINT,
            "affinity": required(
                {"matchExpressions": [{"key": keys.CLUSTER_ID_LABEL, "operator": "Exists"}]}
            ),
        },
        {"tolerations": EVERY_TAINT, "nodeSelector": {keys.VIRTUAL_NODE_LABEL: "true"}},
        {"tolerations": EVERY_TAINT, "nodeSelector": {"type": "virtual-kubelet"}},
        {
            "tolerations": EVERY_TAINT,
            "affinity": required(
                {
                    "matchExpressions": [
                        {"key": "type", "operator": "In", "values": ["virtual-kubelet"]}
                    ]
                }
            ),
        },
        {
            "tolerations": EVERY_TAINT,
            "affinity": required(
                {"matchExpressions": [{"key": keys.VIRTUAL_NODE_LABEL, "operator": "Exists"}]}
            ),
        },
        {"tolerations": EVERY_TAINT, "nodeSelector": {keys.PROVEN_VIRTUAL_NODE_LABEL: "true"}},
        {
            "tolerations": EVERY_TAINT,
            "affinity": required(
                {
                    "matchExpressions": [
                        {"key": keys.PROVEN_VIRTUAL_NODE_LABEL, "operator": "Exists"}
                    ]
                }
            ),
        },
    ],
    ids=[
        "no-toleration",
        "keyed-toleration",
        "no-execute-only",
        "tolerates-the-provider-by-key",
        "selects-a-cluster",
        "requires-virtual-nodes",
        # Until 2026-11-28 these got the cluster-id DoesNotExist term: no node matched both.
        "selects-the-virtual-node-label",
        "selects-the-virtual-kubelet-type",
        "requires-the-virtual-kubelet-type",
        "requires-the-virtual-node-label",
        "selects-the-proven-virtual-node-label",
        "requires-the-proven-virtual-node-label",
    ],
)
def test_a_daemonset_that_stays_off_or_means_virtual_nodes_is_left_alone(
    spec: dict[str, Any],
) -> None:
    assert off_virtual_nodes(spec) is None


def test_a_daemonset_is_kept_off_when_made_and_when_its_template_changes_only() -> None:
    agent = {"tolerations": EVERY_TAINT, "containers": [{"name": "a", "image": "i"}]}
    made = daemonset_review(agent)
    kept_off = patched(made["request"]["object"], answer(made))["spec"]["template"]["spec"]
    assert kept_off["affinity"] == required({"matchExpressions": [OFF]})
    # A label on it, no new template: nothing, or every pod of it would be made again.
    assert "patch" not in answer(daemonset_review(agent, agent))
    # Applied again from a manifest without the affinity: put back, the template as it was.
    applied = daemonset_review(agent, kept_off)
    assert patched(applied["request"]["object"], answer(applied))["spec"]["template"]["spec"] == (
        kept_off
    )
    new_image = {**agent, "containers": [{"name": "a", "image": "j"}]}
    assert "patch" in answer(daemonset_review(new_image, agent))
    with_affinity = {**agent, "affinity": required({"matchExpressions": [OFF]})}
    assert "patch" not in answer(daemonset_review(with_affinity))


def test_a_daemonset_edited_to_mean_virtual_nodes_loses_the_expression_it_was_given() -> None:
    """Kept (an edit or a client-side apply keeps the live affinity), the expression and
    the virtual nodes' selector left no node for its pods."""
    agent = {"tolerations": EVERY_TAINT, "containers": [{"name": "a", "image": "i"}]}
    made = daemonset_review(agent)
    kept_off = patched(made["request"]["object"], answer(made))["spec"]["template"]["spec"]
    provider = {"key": keys.PROVIDER_TAINT_KEY, "operator": "Exists"}
    meaning = {**kept_off, "tolerations": [*EVERY_TAINT, provider]}
    edited = daemonset_review(meaning, kept_off)
    assert (
        patched(edited["request"]["object"], answer(edited))["spec"]["template"]["spec"]["affinity"]
        == {}
    )
    disk = {"key": "disk", "operator": "In", "values": ["ssd"]}
    by_name = {"key": "metadata.name", "operator": "In", "values": ["n"]}
    selecting = {
        "nodeSelector": {keys.VIRTUAL_NODE_LABEL: "true"},
        "affinity": required(
            {"matchExpressions": [disk, OFF]}, {"matchFields": [by_name], "matchExpressions": [OFF]}
        ),
    }
    assert off_virtual_nodes(selecting) == required(
        {"matchExpressions": [disk]}, {"matchFields": [by_name]}
    )


def moves_config_map(data: dict[str, str]) -> dict[str, Any]:
    metadata = {"name": keys.MOVES_CONFIGMAP, "namespace": keys.SYSTEM_NAMESPACE}
    return {"metadata": {**metadata, "resourceVersion": "1"}, "data": data}


def upper_required_terms(response: dict[str, Any], original: dict[str, Any]) -> list[Any]:
    affinity = patched(original, response)["spec"].get("affinity") or {}
    required = (affinity.get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    return list((required or {}).get("nodeSelectorTerms") or [])


async def test_a_controllers_new_pod_is_kept_off_the_nodes_the_descheduler_moved_it_off() -> None:
    """The moves come from the ConfigMap through the informer, as the server runs it; the
    lower pod gets the pod's own affinity back from the stash."""
    follower = MovesFollower()
    informer = follower.informer(client=None)  # type: ignore[arg-type]
    record = {"rs-1": json.dumps({"vk-lower-1": MOVED_UNTIL, "vk-lower-2": "2020-01-01T00:00:00Z"})}
    informer.apply({"type": "ADDED", "object": moves_config_map(record)})
    async with TestClient(TestServer(make_app(stash.DEFAULT_KEEP_KEYS, follower))) as client:

        async def answered(sent: dict[str, Any]) -> dict[str, Any]:
            response = await client.post("/mutate", json=review(sent))
            assert response.status == 200
            return dict((await response.json())["response"])

        moved = controlled_pod("rs-1")
        response = await answered(moved)
        kept_off = {"key": "metadata.name", "operator": "NotIn", "values": ["vk-lower-1"]}
        assert upper_required_terms(response, moved) == [{"matchFields": [kept_off]}]
        upper = patched(moved, response)
        lower = stash.restore_scheduling(
            upper["spec"], upper["metadata"]["annotations"][keys.STASH_ANNOTATION]
        )
        assert lower == moved["spec"]
        other = controlled_pod("rs-2")
        assert upper_required_terms(await answered(other), other) == []

        informer.apply({"type": "DELETED", "object": moves_config_map(record)})
        assert upper_required_terms(await answered(moved), moved) == []


def test_the_manifest_configuration_has_the_same_rules_as_the_code() -> None:
    manifest = yaml.safe_load(
        (MANIFESTS / "webhook" / "mutatingwebhookconfiguration.yaml").read_text()
    )
    local = url_configuration("https://127.0.0.1:1/mutate", b"ca")
    assert manifest["metadata"]["name"] == local["metadata"]["name"]
    pods, daemonsets, tolerating = manifest["webhooks"]
    assert pods == stash_webhook(pods["clientConfig"])
    assert daemonsets == daemonsets_webhook(daemonsets["clientConfig"])
    assert tolerating == tolerating_pods_webhook(tolerating["clientConfig"])
    assert [w["name"] for w in local["webhooks"]] == [
        pods["name"],
        daemonsets["name"],
        tolerating["name"],
    ]
    for webhook in (pods, daemonsets):
        assert webhook["clientConfig"]["service"]["path"] == PATH
    assert tolerating["clientConfig"]["service"]["path"] == KEEP_OFF_PATH
    assert local["webhooks"][2]["clientConfig"]["url"] == "https://127.0.0.1:1" + KEEP_OFF_PATH
    # Each is called again after a later webhook's change (a toleration of every taint
    # added to a node agent); each of their patches is made once.
    assert {w["reinvocationPolicy"] for w in local["webhooks"]} == {"IfNeeded"}


def test_a_serving_pair_is_reused_while_it_covers_the_names(tmp_path: Path) -> None:
    first = pki.serving_pair(tmp_path, "webhook", ("127.0.0.1",))
    created = first.cert_path.read_bytes()
    assert pki.serving_pair(tmp_path, "webhook", ("127.0.0.1",)).cert_path.read_bytes() == created
    ca = pki.ca_path(first).read_bytes()
    wider = pki.serving_pair(tmp_path, "webhook", ("127.0.0.1", "webhook.svc"))
    assert wider.cert_path.read_bytes() != created
    assert pki.ca_path(wider).read_bytes() == ca


def test_an_update_putting_back_the_moved_fields_is_patched_back() -> None:
    """``kubectl apply`` of the manifest again, and ``kubectl replace``, which also drops
    the stash annotation: the fields return to the upper view and the stash stays."""
    manifest = {"nodeSelector": {"disk": "ssd"}, "containers": [{"name": "c", "image": "i"}]}
    stashed_spec, annotations = stash.stash_scheduling(manifest, {})
    old = pod(stashed_spec, annotations)
    new_image = {"name": "c", "image": "i2"}
    for new in (
        pod(
            {**manifest, "tolerations": stashed_spec["tolerations"], "containers": [new_image]},
            annotations,
        ),
        pod({**manifest, "containers": [new_image]}, {}),
    ):
        response = answer(review(new, operation="UPDATE", oldObject=old))
        assert patched(new, response) == pod(
            {**stashed_spec, "containers": [new_image]}, annotations
        )


def test_an_update_with_an_unreadable_stash_is_refused() -> None:
    stashed_spec, annotations = stash.stash_scheduling({"nodeSelector": {"disk": "ssd"}}, {})
    old = pod(stashed_spec, annotations)
    forged = pod(stashed_spec, {keys.STASH_ANNOTATION: '{"version": 9}'})
    refused = answer(review(forged, operation="UPDATE", oldObject=old))
    assert refused["allowed"] is False
    assert "unknown stash version 9" in refused["status"]["message"]
    bad_old = pod(stashed_spec, {keys.STASH_ANNOTATION: "{"})
    refused = answer(review(pod(stashed_spec), operation="UPDATE", oldObject=bad_old))
    assert refused["allowed"] is False
    # A readable one given while the stored one is not: refused with the reason too.
    refused = answer(review(pod(stashed_spec, annotations), operation="UPDATE", oldObject=bad_old))
    assert refused["status"]["code"] == 400
    assert refused["status"]["message"].startswith("as stored, annotation")


def test_a_stash_written_by_hand_after_admission_is_refused() -> None:
    """The lower pod is made from the stash, and the upper admission saw only the spec: a
    namespace's PodNodeSelector entry changed in it would place the pod below where the
    policy said it may not go."""
    manifest = {"schedulingGates": [{"name": "q"}], "nodeSelector": {"pool": "team-a"}}
    stashed_spec, annotations = stash.stash_scheduling(manifest, {})
    old = pod(stashed_spec, annotations)
    forged = {keys.STASH_ANNOTATION: stash.encode({"nodeSelector": {"pool": "team-b"}})}
    refused = answer(review(pod(stashed_spec, forged), operation="UPDATE", oldObject=old))
    assert refused["allowed"] is False
    assert refused["status"]["code"] == 422
    assert "nodeSelector differs from the one recorded" in refused["status"]["message"]
    # A stash on a pod that had none is no more the pod's to write.
    unstashed = pod({"containers": [{"name": "c", "image": "i"}]})
    added = pod(unstashed["spec"], forged)
    assert answer(review(added, operation="UPDATE", oldObject=unstashed))["allowed"] is False
    # Dropped, it is put back.
    dropped = answer(review(pod(stashed_spec), operation="UPDATE", oldObject=old))
    assert patched(pod(stashed_spec), dropped) == old


def test_a_pod_carrying_a_stash_may_not_opt_in_or_out() -> None:
    """Made opted out (the webhook skipped it) with a stash written by hand, then opted
    in, the stash was read as the webhook's record."""
    forged = {keys.STASH_ANNOTATION: stash.encode({"nodeSelector": {"pool": "team-b"}})}
    opted_out = pod({"containers": [{"name": "c", "image": "i"}]}, forged)
    opted_out["metadata"]["labels"] = {keys.FEDERATION_LABEL: keys.FEDERATION_DISABLED}
    opted_in = {**opted_out, "metadata": {**opted_out["metadata"], "labels": {}}}
    refused = answer(review(opted_in, operation="UPDATE", oldObject=opted_out))
    assert refused["status"]["code"] == 422
    assert f"label {keys.FEDERATION_LABEL} of a pod carrying" in refused["status"]["message"]
    back = answer(review(opted_out, operation="UPDATE", oldObject=opted_in))
    assert back["allowed"] is False
    # Without a stash, as it likes.
    plain_out = pod({}, {})
    plain_out["metadata"]["labels"] = {keys.FEDERATION_LABEL: keys.FEDERATION_DISABLED}
    plain_in = {**plain_out, "metadata": {**plain_out["metadata"], "labels": {}}}
    assert answer(review(plain_in, operation="UPDATE", oldObject=plain_out))["allowed"]


def test_the_webhook_called_again_on_its_own_answer_to_a_gated_pod_takes_it() -> None:
    """After a later webhook's change in the same admission the stash it wrote differs
    from the stored one: entries it added to the node selector, a node affinity it
    recorded."""
    gated = {"schedulingGates": [{"name": "q"}], "nodeSelector": {"disk": "ssd"}}
    stashed_spec, annotations = stash.stash_scheduling(gated, {})
    old = pod(stashed_spec, annotations)
    zone = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": keys.CLUSTER_ID_LABEL, "operator": "Exists"}]}
                ]
            }
        }
    }
    new = pod(
        {
            **stashed_spec,
            "nodeSelector": {**stashed_spec["nodeSelector"], "pool": "a"},
            "affinity": zone,
        },
        annotations,
    )
    first = patched(new, answer(review(new, operation="UPDATE", oldObject=old)))
    assert first["metadata"]["annotations"] != annotations
    again = answer(review(first, operation="UPDATE", oldObject=old))
    assert again["allowed"] is True
    assert patched(first, again) == first


def test_a_stashed_field_the_apiserver_would_refuse_is_refused_at_admission() -> None:
    """The apiserver validates only the upper view: the lower apiserver refused the pod
    later, Failed, and its controller made it again without end."""
    typo = {"key": "gpu", "operator": "Equals", "values": ["a100"]}
    terms = {"nodeSelectorTerms": [{"matchExpressions": [typo]}]}
    spec = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": terms}}}
    refused = answer(review(pod(spec)))
    assert refused["allowed"] is False
    assert refused["status"]["code"] == 422
    message = refused["status"]["message"]
    assert message.startswith(
        "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].operator: Invalid value: 'Equals'"
    )
    assert keys.STASH_ANNOTATION in message
    # Given to a gated pod later, the same.
    gated = {"schedulingGates": [{"name": "q"}]}
    new = pod({**gated, "nodeSelector": {"disk": "-ssd"}})
    refused = answer(review(new, operation="UPDATE", oldObject=pod(gated)))
    assert refused["status"]["code"] == 422
    assert refused["status"]["message"].startswith("spec.nodeSelector[disk]: Invalid value")


def test_scheduling_fields_too_large_to_stash_are_refused_with_the_reason() -> None:
    """10,000 hostnames in a node affinity: the apiserver refused the pod as "Too long" of
    an annotation its user never wrote."""
    names = [f"worker-{n:05d}.example.com" for n in range(10000)]
    terms = {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": names}
    ]}]}  # fmt: skip
    spec = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": terms}}}
    refused = answer(review(pod(spec)))
    assert refused["status"]["code"] == 422
    assert "more than the 262144 the apiserver takes" in refused["status"]["message"]


def test_a_stash_with_an_integer_past_64_bits_is_refused_not_answered_500() -> None:
    """As an int it passed, and no JSON encoder of the webhook or the virtual node could
    write the pod again."""
    spread = '{"topologySpreadConstraints":[{"maxSkew":' + str(10**20) + "}]}"
    huge = '{"version":1,"originals":' + spread + "}"
    refused = answer(review(pod({}, {keys.STASH_ANNOTATION: huge})))
    assert refused["status"]["code"] == 400
    assert "maxSkew must be a int, not float" in refused["status"]["message"]


def test_an_update_review_without_an_old_pod_is_a_bad_review() -> None:
    with pytest.raises(BadReview, match=r"request\.oldObject must be a JSON object"):
        parse_review(json.dumps(review(pod({}), operation="UPDATE")).encode())


def test_a_gated_pod_asking_for_another_value_of_a_stashed_key_is_refused_with_the_reason() -> None:
    gated = {"schedulingGates": [{"name": "q"}], "nodeSelector": {"disk": "ssd"}}
    stashed_spec, annotations = stash.stash_scheduling(gated, {})
    old = pod(stashed_spec, annotations)
    new = pod({**stashed_spec, "nodeSelector": {"disk": "hdd"}}, annotations)
    refused = answer(review(new, operation="UPDATE", oldObject=old))
    assert refused["allowed"] is False
    assert refused["status"]["code"] == 422
    assert "spec.nodeSelector: the pod asks for disk=ssd already" in refused["status"]["message"]


def test_a_gated_pod_that_stashed_nothing_has_a_node_selector_given_later_stashed() -> None:
    """Made before the webhook (no stash): a queueing controller's node selector must not
    reach the upper scheduler."""
    provider = dict(stash.PROVIDER_TOLERATION)
    gated = {"schedulingGates": [{"name": "q"}], "tolerations": [provider]}
    old = pod(gated)
    new = pod({**gated, "nodeSelector": {"disk": "ssd"}})
    after = patched(new, answer(review(new, operation="UPDATE", oldObject=old)))
    assert after["spec"]["nodeSelector"] == stash.VIRTUAL_NODE_SELECTOR
    saved = stash.decode(after["metadata"]["annotations"][keys.STASH_ANNOTATION])
    assert saved["nodeSelector"] == {"disk": "ssd"}


def test_a_gated_pod_made_before_the_webhook_given_a_node_selector_may_go_on_a_virtual_node() -> (
    None
):
    """Held to virtual nodes by the selector, it needs their taint's toleration too, as a
    create would have given it: without, it waited for good."""
    gated = {"schedulingGates": [{"name": "q"}]}
    new = pod({**gated, "nodeSelector": {"disk": "ssd"}})
    after = patched(new, answer(review(new, operation="UPDATE", oldObject=pod(gated))))
    assert after["spec"]["nodeSelector"] == stash.VIRTUAL_NODE_SELECTOR
    assert after["spec"]["tolerations"] == [stash.PROVIDER_TOLERATION]


def test_a_gated_pod_that_stashed_nothing_gets_no_empty_stash_for_a_toleration() -> None:
    gated = {"schedulingGates": [{"name": "q"}], "tolerations": [dict(stash.PROVIDER_TOLERATION)]}
    spot = {"key": "spot", "operator": "Exists"}
    new = pod({**gated, "tolerations": [*gated["tolerations"], spot]})
    after = patched(new, answer(review(new, operation="UPDATE", oldObject=pod(gated))))
    assert after == new


def test_a_gated_daemonset_pod_is_left_as_it_is_on_update() -> None:
    """Its DaemonSet pins it to one node by name: stashed, the pin would be lost above."""
    owner = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "name": "d",
        "uid": "d",
        "controller": True,
    }
    gated = pod({"schedulingGates": [{"name": "q"}]})
    gated["metadata"]["ownerReferences"] = [owner]
    pinned = copy.deepcopy(gated)
    pinned["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}
                ]
            }
        }
    }
    pinned["spec"]["nodeSelector"] = {"disk": "ssd"}
    assert answer(review(pinned, operation="UPDATE", oldObject=gated)) == {
        "uid": "d2c1",
        "allowed": True,
    }


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--follow-moves"], "--kubeconfig is needed outside a cluster"),
        (["--follow-moves", "--kubeconfig=/nonexistent"], "--kubeconfig: no such file"),
        (["--inject-ca-bundle=kubestrata-webhook"], "--kubeconfig is needed outside a cluster"),
        (["--register-url=https://127.0.0.1:1/mutate"], "--kubeconfig is needed outside a cluster"),
    ],
)
def test_a_webhook_that_talks_to_the_apiserver_needs_a_kubeconfig_at_start(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    words: str,
) -> None:
    """Said in one line before it serves, not as a traceback once it does."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(SystemExit):
        parse_args([f"--cert-dir={tmp_path}", "--listen=127.0.0.1:9443", *flags])
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1:9443/mutate", "must be an https URL"),
        ("https://127.0.0.1:9443/", "must end in the path /mutate, which is served"),
        ("https://127.0.0.1:9443/stash", "must end in the path /mutate"),
        (
            "https://10.0.0.5:9443/mutate",
            "host 10.0.0.5 is not a name of the generated certificate (127.0.0.1): "
            "add --server-name 10.0.0.5",
        ),
    ],
)
def test_a_registered_url_the_apiserver_could_not_call_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, words: str
) -> None:
    """Registered, every pod create of a federated namespace failed (the stash webhook
    fails closed): a path nothing serves, a host the certificate does not name."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("{}")
    with pytest.raises(SystemExit):
        parse_args(
            [
                f"--cert-dir={tmp_path}",
                "--listen=127.0.0.1:9443",
                f"--kubeconfig={kubeconfig}",
                f"--register-url={url}",
            ]
        )
    assert words in capsys.readouterr().err
    config = parse_args(
        [
            f"--cert-dir={tmp_path}",
            "--listen=127.0.0.1:9443",
            "--server-name=10.0.0.5",
            f"--kubeconfig={kubeconfig}",
            "--register-url=https://10.0.0.5:9443/mutate",
        ]
    )
    assert config.register_url == "https://10.0.0.5:9443/mutate"


def test_a_webhook_that_only_answers_needs_no_kubeconfig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = parse_args([f"--cert-dir={tmp_path}", "--listen=127.0.0.1:9443"])
    assert config.kubeconfig is None and not config.follow_moves


def pod_review(spec: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    pod = {"metadata": {"name": "operator", "namespace": "kube-system", **metadata}, "spec": spec}
    return {
        "uid": "u",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": "CREATE",
        "object": pod,
    }


def test_a_pod_outside_federation_tolerating_every_taint_is_kept_off_virtual_nodes() -> None:
    """An operator of kube-system tolerating every taint tolerates the virtual nodes'
    too: the upper scheduler, seeing a virtual node's room, bound it there, and it ran
    in a lower cluster."""
    spec = {"tolerations": EVERY_TAINT, "containers": [{"name": "c", "image": "i"}]}
    review = pod_review(spec)
    kept = patched(review["object"], keep_off_response(review)["response"])
    assert kept["spec"]["affinity"] == required({"matchExpressions": [OFF]})
    left_alone = [
        pod_review({**spec, "nodeName": "worker-1"}),  # a static pod's mirror
        pod_review(spec, ownerReferences=[{"kind": "DaemonSet", "uid": "d", "controller": True}]),
        pod_review({**spec, "nodeSelector": stash.VIRTUAL_NODE_SELECTOR}),  # federated
        pod_review({**spec, "nodeSelector": {keys.VIRTUAL_NODE_LABEL: "true"}}),  # before
        pod_review({"tolerations": [{"key": "gpu", "operator": "Exists"}]}),
    ]
    for review in left_alone:
        assert "patch" not in keep_off_response(review)["response"]


def test_a_bracketed_ipv6_listen_address_is_bound_and_named_without_its_brackets(
    tmp_path: Path,
) -> None:
    """`[::1]:8443`, as addresses with a port are written: the brackets went to the bind
    (which failed) and into the certificate as a DNS name."""
    config = parse_args([f"--cert-dir={tmp_path}", "--listen=[::1]:9443"])
    assert (config.host, config.port) == ("::1", 9443)
    certificate = x509.load_pem_x509_certificate(config.cert_file.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("::1")]


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("--renew-before-days=inf", "--renew-before-days must be from 0 to 36500"),
        ("--renew-before-days=1e12", "--renew-before-days must be from 0 to 36500"),
        ("--renew-before-days=-1", "--renew-before-days must be from 0 to 36500"),
        ("--ca-overlap-minutes=nan", "--ca-overlap-minutes must be from 0 to 525600"),
    ],
)
def test_the_certificate_job_s_periods_past_a_timedelta_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, words: str
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(SystemExit):
        certjob.parse_args([f"--kubeconfig={kubeconfig}", flag])
    assert words in capsys.readouterr().err
