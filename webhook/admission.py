"""AdmissionReview v1 in, AdmissionReview v1 out (pure functions).

For a pod, the webhook answers with a JSONPatch that stashes the scheduling fields
(kubekit.stash), keeping a controller's new pod off the virtual nodes the descheduler
moved its pods off (kubekit.moves), or allows the pod unchanged (a DaemonSet's pod among
them: its controller pins it to one node by name, and moved off that pin it would be
bound elsewhere, deleted by its controller as on the wrong node, and made again without
end); it refuses only a pod that arrives with a stash annotation the virtual node could
not read, and an update of a stashed pod that would lose a stashed entry
(``stash.StashRefused``). For a DaemonSet whose pods tolerate every taint, it answers
with the affinity that keeps them off virtual nodes (webhook.daemonsets). A body it
cannot read is a ``BadReview``, which the server turns into a 400 naming what is wrong:
not only what is not JSON or not a review, but an object whose scheduling fields do not
have the types the apiserver's own decoding would have given them (only a client that is
not an apiserver sends those)."""

from __future__ import annotations

import base64
import json
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from typing import Any

import orjson

from kubekit import keys, shapes, stash
from kubekit.moves import Moves, is_daemon_pod, kept_off
from kubekit.schedulingvalidation import Invalid, check_scheduling_fields
from webhook.daemonsets import off_virtual_nodes

JSON = dict[str, Any]

API_VERSION = "admission.k8s.io/v1"
# The stash copies the spec through orjson, which writes no deeper than 255 levels; a
# pod's spec is a dozen deep.
MAX_SPEC_DEPTH = 64


class BadReview(ValueError):
    """A request body that is not an AdmissionReview v1 the webhook can answer."""


def _object(value: Any, what: str) -> JSON:
    if not isinstance(value, dict):
        raise BadReview(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def parse_review(body: bytes) -> JSON:
    """The ``request`` of an AdmissionReview v1, checked as far as the webhook relies on it."""
    try:
        # orjson, as the stash copies with: it refuses NaN, Infinity and lone surrogates,
        # which are not JSON, and nesting beyond its depth limit.
        review = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise BadReview(f"body is not JSON: {error}") from error
    review = _object(review, "the AdmissionReview")
    if review.get("apiVersion") != API_VERSION or review.get("kind") != "AdmissionReview":
        raise BadReview(
            f"expected apiVersion {API_VERSION} kind AdmissionReview, got apiVersion "
            f"{review.get('apiVersion')!r} kind {review.get('kind')!r}"
        )
    request = _object(review.get("request"), "request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("request.uid must be a non-empty string")
    if request.get("operation") in ("CREATE", "UPDATE") and _is_daemonset(request):
        daemonset = _object(request.get("object"), "request.object")
        spec = _object(daemonset.get("spec"), "request.object.spec")
        template = _object(spec.get("template"), "request.object.spec.template")
        template_spec = _object(template.get("spec"), "request.object.spec.template.spec")
        _check_shape(template_spec, shapes.SCHEDULING_FIELDS, "request.object.spec.template.spec")
        if not _depth_at_most(template_spec, MAX_SPEC_DEPTH):
            raise BadReview(
                f"request.object.spec.template.spec is nested deeper than {MAX_SPEC_DEPTH}"
            )
        if request["operation"] == "UPDATE":
            old = _object(request.get("oldObject"), "request.oldObject")
            _object(old.get("spec"), "request.oldObject.spec")
    if request.get("operation") in ("CREATE", "UPDATE") and _is_pod(request):
        _check_pod(request.get("object"), "request.object")
        if request["operation"] == "UPDATE":
            _check_pod(request.get("oldObject"), "request.oldObject")
    return request


def _check_pod(value: Any, where: str) -> None:
    pod = _object(value, where)
    spec = _object(pod.get("spec"), f"{where}.spec")
    _check_shape(spec, shapes.SCHEDULING_FIELDS, f"{where}.spec")
    if not _depth_at_most(spec, MAX_SPEC_DEPTH):
        raise BadReview(f"{where}.spec is nested deeper than {MAX_SPEC_DEPTH}")
    metadata = _object(pod.get("metadata", {}), f"{where}.metadata")
    annotations = metadata.get("annotations")
    if annotations is not None and not (
        isinstance(annotations, dict) and all(isinstance(v, str) for v in annotations.values())
    ):
        raise BadReview(f"{where}.metadata.annotations must map strings to strings")
    _check_shape(metadata.get("ownerReferences"), [{}], f"{where}.metadata.ownerReferences")


def _check_shape(value: Any, shape: Any, where: str) -> None:
    try:
        shapes.check(value, shape, where)
    except shapes.ShapeError as error:
        raise BadReview(str(error)) from error


def _depth_at_most(value: Any, limit: int) -> bool:
    level = [value]
    for _ in range(limit):
        level = [
            child
            for item in level
            if isinstance(item, dict | list)
            for child in (item.values() if isinstance(item, dict) else item)
        ]
        if not level:
            return True
    return False


def _is_kind(request: Mapping[str, Any], group: str, kind: str) -> bool:
    """Whether the request is about an object of ``kind`` itself, not a subresource."""
    asked = request.get("kind") or {}
    return (
        isinstance(asked, dict)
        and asked.get("group") == group
        and asked.get("kind") == kind
        and not request.get("subResource")
    )


def _is_pod(request: Mapping[str, Any]) -> bool:
    return _is_kind(request, "", "Pod")


def _is_daemonset(request: Mapping[str, Any]) -> bool:
    return _is_kind(request, "apps", "DaemonSet")


def daemonset_patch(request: Mapping[str, Any]) -> list[JSON]:
    """The JSONPatch keeping a DaemonSet's pods off virtual nodes (webhook.daemonsets). An
    update that leaves the pod template as it was is not touched: a new template rolls
    every pod of the DaemonSet, which a label put on it should not do."""
    template = request["object"]["spec"]["template"]
    if request["operation"] == "UPDATE" and template == request["oldObject"]["spec"].get(
        "template"
    ):
        return []
    return _off_virtual_nodes_patch(template["spec"], "/spec/template/spec/affinity")


def _off_virtual_nodes_patch(spec: Mapping[str, Any], path: str) -> list[JSON]:
    """The JSONPatch giving the pod spec at ``path``'s parent the affinity that keeps it
    off virtual nodes (webhook.daemonsets); none when it is left as it is."""
    affinity = off_virtual_nodes(spec)
    if affinity is None:
        return []
    operation = "replace" if "affinity" in spec else "add"
    return [{"op": operation, "path": path, "value": affinity}]


def keep_off_response(request: Mapping[str, Any]) -> JSON:
    """The AdmissionReview answering a pod made outside federation that tolerates every
    taint (the configuration's third entry): kept off virtual nodes as a DaemonSet's
    pods are (webhook.daemonsets). Such pods (an operator of kube-system, say) tolerate
    the virtual nodes' taint without meaning them, and the upper scheduler, seeing a
    virtual node's room, bound them there: they ran in a lower cluster. A pod bound at
    its creation (a static pod's mirror) or a DaemonSet's, pinned to its node by its
    controller, is left as it is."""
    response: JSON = {"uid": request["uid"], "allowed": True}
    if not _is_pod(request) or request.get("operation") != "CREATE":
        return _review(response)
    pod = request["object"]
    spec = pod.get("spec") or {}
    if spec.get("nodeName") or is_daemon_pod(pod):
        return _review(response)
    return _review(_with_patch(response, _off_virtual_nodes_patch(spec, "/spec/affinity")))


def _pointer(*segments: str) -> str:
    return "".join("/" + s.replace("~", "~0").replace("/", "~1") for s in segments)


def stash_patch(
    pod: Mapping[str, Any], keep: Collection[str], kept_off: Collection[str] = ()
) -> list[JSON]:
    """The JSONPatch that turns ``pod`` into its upper view with the stash annotation,
    kept off the virtual nodes ``kept_off``."""
    new = stash.stash_scheduling(pod["spec"], _annotations(pod), keep, kept_off)
    _check_stash(new[1], None)
    return _patch_to(pod, *new)


def update_patch(
    old: Mapping[str, Any], old_stash: str | None, pod: Mapping[str, Any], keep: Collection[str]
) -> list[JSON]:
    """The JSONPatch for an update of a pod (``stash.stash_update``; ``old_stash`` as
    stored, if any); an update that drops the stash annotation keeps it."""
    annotations = dict(_annotations(pod))
    if old_stash is not None:
        annotations.setdefault(keys.STASH_ANNOTATION, old_stash)
    stored = stash.encode({}) if old_stash is None else old_stash
    new = stash.stash_update(old["spec"], stored, pod["spec"], annotations, keep)
    _check_stash(new[1], old_stash)
    return _patch_to(pod, *new)


# The apiserver's limit on all of an object's annotations, keys and values together.
ANNOTATIONS_LIMIT_BYTES = 256 * 1024


def _check_stash(annotations: Mapping[str, str], stored: str | None) -> None:
    """Raises StashRefused when the fields a new stash holds are ones the apiserver would
    refuse in a pod (it validates only the upper view), or too large to keep there."""
    text = annotations.get(keys.STASH_ANNOTATION)
    if text is None or text == stored:
        return
    try:
        check_scheduling_fields(stash.decode(text))
    except Invalid as error:
        raise stash.StashRefused(
            f"{error} (moved by kubestrata into annotation {keys.STASH_ANNOTATION})"
        ) from error
    size = sum(len(key.encode()) + len(value.encode()) for key, value in annotations.items())
    if size > ANNOTATIONS_LIMIT_BYTES:
        # Said here: the apiserver's "Too long" would name an annotation the user never wrote.
        raise stash.StashRefused(
            f"the pod's scheduling fields take {len(text.encode())} bytes in annotation "
            f"{keys.STASH_ANNOTATION}, where kubestrata keeps them for the lower cluster; "
            f"with its other annotations that is {size} bytes, more than the "
            f"{ANNOTATIONS_LIMIT_BYTES} the apiserver takes"
        )


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def _patch_to(
    pod: Mapping[str, Any], new_spec: Mapping[str, Any], new_annotations: Mapping[str, str]
) -> list[JSON]:
    """The JSONPatch from ``pod`` to one with ``new_spec``'s scheduling fields and
    ``new_annotations``."""
    spec = pod["spec"]
    annotations = (pod.get("metadata") or {}).get("annotations")
    patch: list[JSON] = []
    for field in stash.FIELDS:
        path = _pointer("spec", field)
        if field not in new_spec:
            if field in spec:
                patch.append({"op": "remove", "path": path})
        elif field not in spec:
            patch.append({"op": "add", "path": path, "value": new_spec[field]})
        elif spec[field] != new_spec[field]:
            patch.append({"op": "replace", "path": path, "value": new_spec[field]})
    if new_annotations != (annotations or {}):
        if annotations is None:
            patch.append({"op": "add", "path": "/metadata/annotations", "value": new_annotations})
        else:
            for key, value in new_annotations.items():
                if annotations.get(key) != value:
                    patch.append(
                        {
                            "op": "replace" if key in annotations else "add",
                            "path": _pointer("metadata", "annotations", key),
                            "value": value,
                        }
                    )
    return patch


def descheduler_annotation_warning(pod: Mapping[str, Any]) -> str | None:
    """What ``kubectl`` should say of a descheduler annotation whose value is not the one
    it takes; the descheduler reads any value as that one (descheduler.rescue.hands_off)."""
    value = _annotations(pod).get(keys.DESCHEDULER_ANNOTATION)
    if value is None or value == keys.DESCHEDULER_NEVER:
        return None
    return (
        f"annotation {keys.DESCHEDULER_ANNOTATION}={value!r} is read as "
        f"{keys.DESCHEDULER_NEVER!r}, the only value it takes: the descheduler will not move "
        "this pod or evict it to make room"
    )


def review_response(
    request: Mapping[str, Any],
    keep: Collection[str],
    moves: Moves | None = None,
    now: datetime | None = None,
) -> JSON:
    """The AdmissionReview answering ``request`` (as returned by ``parse_review``); a new
    pod of a controller the descheduler moved pods of is kept off the virtual nodes they
    left (``moves`` as of ``now``). dryRun requests get the same answer: the webhook has
    no side effects to hold back."""
    response: JSON = {"uid": request["uid"], "allowed": True}
    if request.get("operation") in ("CREATE", "UPDATE") and _is_daemonset(request):
        return _review(_with_patch(response, daemonset_patch(request)))
    if not _is_pod(request) or request.get("operation") not in ("CREATE", "UPDATE"):
        return _review(response)
    pod = request["object"]
    old = request.get("oldObject") or {}
    old_stash = _annotations(old).get(keys.STASH_ANNOTATION)
    stored_unreadable = _unreadable_stash(old_stash)
    unreadable = _unreadable_stash(_annotations(pod).get(keys.STASH_ANNOTATION)) or (
        stored_unreadable and f"as stored, {stored_unreadable}"
    )
    if unreadable:
        return _review(_refused(response, 400, "BadRequest", unreadable))
    if request["operation"] == "UPDATE":
        forged = stash.stash_change_refusal(
            old.get("spec") or {}, old_stash, _annotations(pod).get(keys.STASH_ANNOTATION)
        ) or _opting_in_or_out_with_a_stash(old, pod)
        if forged:
            return _review(_refused(response, 422, "Invalid", forged))
        # A pod the webhook stashed when it was made (an older one runs as it was), or one
        # waiting on a gate, which may be given scheduling fields to stash (it had none
        # to stash when made, or was made before the webhook).
        gated = bool((old.get("spec") or {}).get("schedulingGates"))
        if (old_stash is not None or gated) and not is_daemon_pod(pod):
            try:
                patch = update_patch(old, old_stash, pod, keep)
            except stash.StashRefused as error:
                return _review(_refused(response, 422, "Invalid", str(error)))
            response = _with_patch(response, patch)
    else:
        warning = descheduler_annotation_warning(pod)
        if warning:
            response["warnings"] = [warning]
        if is_daemon_pod(pod):
            return _review(response)
        avoided = kept_off(moves, pod, now or datetime.now(UTC)) if moves else []
        try:
            patch = stash_patch(pod, keep, avoided)
        except stash.StashRefused as error:
            return _review(_refused(response, 422, "Invalid", str(error)))
        response = _with_patch(response, patch)
    return _review(response)


def _opting_in_or_out_with_a_stash(old: Mapping[str, Any], pod: Mapping[str, Any]) -> str | None:
    """Why a pod carrying a stash may not change its federation label: made opted out
    (the webhook skipped it) with a stash written by hand, then opted in, that stash
    would be read as the webhook's record."""

    def label(of: Mapping[str, Any]) -> str | None:
        return ((of.get("metadata") or {}).get("labels") or {}).get(keys.FEDERATION_LABEL)

    carrying = keys.STASH_ANNOTATION in _annotations(old) or keys.STASH_ANNOTATION in (
        _annotations(pod)
    )
    if not carrying or label(old) == label(pod):
        return None
    return (
        f"label {keys.FEDERATION_LABEL} of a pod carrying annotation {keys.STASH_ANNOTATION} "
        "cannot change: opted in, a stash the webhook never saw would be read as its record"
    )


def _unreadable_stash(text: str | None) -> str | None:
    """Why a stash annotation cannot be read, if it cannot."""
    if text is None:
        return None
    try:
        stash.decode(text)
    except stash.StashError as error:
        return f"annotation {keys.STASH_ANNOTATION}: {error}"
    return None


def _refused(response: JSON, code: int, reason: str, message: str) -> JSON:
    return {
        **response,
        "allowed": False,
        "status": {"code": code, "reason": reason, "message": message},
    }


def _with_patch(response: JSON, patch: list[JSON]) -> JSON:
    if not patch:
        return response
    encoded = base64.b64encode(json.dumps(patch, separators=(",", ":")).encode()).decode()
    return {**response, "patchType": "JSONPatch", "patch": encoded}


def _review(response: JSON) -> JSON:
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}
