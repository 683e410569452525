"""The scheduling stash: which scheduling fields of a federated pod the upper scheduler
sees, and how the lower cluster gets the originals back (pure functions).

The webhook calls ``stash_scheduling``: every scheduling field it changes is recorded
whole, as it was, in one versioned JSON annotation, and the pod keeps only the parts that
speak about clusters (keys the virtual nodes carry: the cluster-id label, the region,
keys configured as "keep"), and all its tolerations, with the provider's taint's; its node
selector also asks for the virtual nodes' own label, which keeps it off ordinary nodes. The
virtual node calls ``restore_scheduling``, which puts the recorded originals back (the
tolerations are the upper pod's, which keeps them all): restore(stash(pod)) is the
original pod, and stashing the stashed pod again changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

import orjson

from kubekit import keys, shapes
from kubekit.jsonvalue import json_copy
from kubekit.moves import keep_off

JSON = dict[str, Any]

VERSION = 1
FIELDS = ("nodeSelector", "affinity", "tolerations", "topologySpreadConstraints")
DEFAULT_KEEP_KEYS = frozenset({keys.CLUSTER_ID_LABEL, "topology.kubernetes.io/region"})
# The entry the webhook gives a federated pod's node selector: a label every virtual Node
# carries, which a kubelet cannot give its own Node (the NodeRestriction plugin). Until
# 2026-11-29 it was kubestrata.io/virtual-node, which any kubelet could set on itself to
# draw federated pods (their Secrets with them); pods given that one keep it.
VIRTUAL_NODE_SELECTOR = {keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE}
# Every entry the webhook ever gave: its own, never the pod's.
WEBHOOK_SELECTOR_ENTRIES = {
    **VIRTUAL_NODE_SELECTOR,
    keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
}
PROVIDER_TOLERATION: JSON = {
    "key": keys.PROVIDER_TAINT_KEY,
    "operator": "Equal",
    "value": keys.PROVIDER_TAINT_VALUE,
    "effect": "NoSchedule",
}


class StashError(ValueError):
    """A stash annotation that cannot be read."""


# Never federated, whatever their labels say: the cluster's own and ours (the webhook's
# configuration leaves them out).
PROTECTED_NAMESPACES = (
    "kube-system",
    keys.NODE_LEASE_NAMESPACE,
    "kube-public",
    keys.SYSTEM_NAMESPACE,
)


def is_federated(namespace: str, namespace_labels: Mapping[str, str]) -> bool:
    """Whether the webhook federates a namespace's pods (those that do not opt out)."""
    return (
        namespace not in PROTECTED_NAMESPACES
        and namespace_labels.get(keys.FEDERATION_LABEL) == keys.FEDERATION_ENABLED
    )


def unguarded_reason(
    namespace: str, namespace_labels: Mapping[str, str], pod_labels: Mapping[str, str]
) -> str | None:
    """Why the webhook does not see a pod's creates and updates, so that its stash is not
    the webhook's record (``stash_change_refusal``) but whatever its creator wrote; None
    when it does, as its configuration selects pods: a federated namespace, not one of
    the protected, and a pod that has not opted out."""
    if namespace in PROTECTED_NAMESPACES:
        return f"namespace {namespace} is never federated"
    if namespace_labels.get(keys.FEDERATION_LABEL) != keys.FEDERATION_ENABLED:
        return (
            f"namespace {namespace} is not labelled "
            f"{keys.FEDERATION_LABEL}={keys.FEDERATION_ENABLED}"
        )
    if pod_labels.get(keys.FEDERATION_LABEL) == keys.FEDERATION_DISABLED:
        return f"the pod opted out ({keys.FEDERATION_LABEL}={keys.FEDERATION_DISABLED})"
    return None


def encode(originals: Mapping[str, Any]) -> str:
    return json.dumps(
        {"version": VERSION, "originals": originals}, sort_keys=True, separators=(",", ":")
    )


def decode(text: str) -> JSON:
    try:
        # orjson reads an integer past 64 bits as a float, which the shapes refuse: as an
        # int it passed, and no JSON encoder of ours could write the pod again.
        payload = orjson.loads(text)
    except ValueError as error:
        raise StashError(f"not JSON: {error}") from error
    version = payload.get("version") if isinstance(payload, dict) else None
    if type(version) is not int or version != VERSION:
        raise StashError(f"unknown stash version {version!r} (this kubestrata reads {VERSION})")
    originals = payload.get("originals")
    if not isinstance(originals, dict) or not set(originals) <= set(FIELDS):
        raise StashError(f"originals must be an object with keys among {', '.join(FIELDS)}")
    # Anyone may write the annotation: what it restores is read as a pod's fields.
    for field, value in originals.items():
        try:
            shapes.check(value, shapes.SCHEDULING_FIELDS[field], f"originals.{field}")
        except shapes.ShapeError as error:
            raise StashError(str(error)) from error
    return originals


def _project_node_selector(
    selector: Mapping[str, str], keep: Collection[str], bound: bool = False
) -> JSON | None:
    """The entries on cluster-level keys, and the virtual nodes' own label: an ordinary
    upper node would run the pod with none of its stashed fields judged (a GPU selector,
    a spread over zones), as would a virtual node of another provider. Not for a pod made
    bound to a node (``spec.nodeName``): no scheduler reads it, and an ordinary node's
    kubelet would refuse the pod for it (``kubectl debug node/...``)."""
    kept = {k: v for k, v in selector.items() if k in keep}
    return (kept or None) if bound else {**kept, **VIRTUAL_NODE_SELECTOR}


# Labels every virtual Node carries with a value of its own (virtual-kubelet's type, its
# name as hostname), which lower nodes have other values of, if at all.
OWN_LABEL_KEYS = frozenset({keys.NODE_TYPE_LABEL, keys.HOSTNAME_LABEL})
# The operators by which a requirement picks nodes out; the others keep nodes away.
SELECTING_OPERATORS = frozenset({"In", "Exists"})


def _kept_above(expression: Mapping[str, Any], keep: Collection[str]) -> bool:
    """On a cluster-level key; or keeping nodes away by a virtual Node's own label, which
    may keep the pod off a virtual node (``type NotIn [virtual-kubelet]``, a hostname
    NotIn naming one): below every lower node meets it, so only the upper scheduler can
    (until 2026-11-29 it was stashed, and the pod was bound where it had excluded). One
    about lower nodes (``type NotIn [gpu]``) holds of every virtual node."""
    key = expression.get("key")
    return key in keep or (
        key in OWN_LABEL_KEYS and expression.get("operator") not in SELECTING_OPERATORS
    )


def _project_term(term: Mapping[str, Any], keep: Collection[str]) -> JSON:
    """The term's expressions on cluster-level keys or keeping nodes away by a virtual
    Node's own labels, and its requirements on the node's name: in the upper cluster a
    name is a virtual node's, so a pin to one holds above (dropped, the pod could be
    bound to another virtual node, whose lower nodes all fail the pin)."""
    projected: JSON = {}
    expressions = [e for e in term.get("matchExpressions") or [] if _kept_above(e, keep)]
    if expressions:
        projected["matchExpressions"] = expressions
    fields = [f for f in term.get("matchFields") or [] if f.get("key") == "metadata.name"]
    if fields:
        projected["matchFields"] = fields
    return projected


def _project_node_affinity(node_affinity: Mapping[str, Any], keep: Collection[str]) -> JSON:
    projected: JSON = {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required:
        terms = [_project_term(t, keep) for t in required.get("nodeSelectorTerms") or []]
        # Terms are ORed: one with no cluster-level part lets every cluster through.
        if terms and all(terms):
            projected["requiredDuringSchedulingIgnoredDuringExecution"] = {
                "nodeSelectorTerms": terms
            }
    preferred = []
    for entry in node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []:
        term = _project_term(entry.get("preference") or {}, keep)
        if term:
            preferred.append({"weight": entry["weight"], "preference": term})
    if preferred:
        projected["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    return projected


def _project_pod_affinity(pod_affinity: Mapping[str, Any], keep: Collection[str]) -> JSON:
    projected: JSON = {}
    required = [
        t
        for t in pod_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or []
        if t.get("topologyKey") in keep
    ]
    if required:
        projected["requiredDuringSchedulingIgnoredDuringExecution"] = required
    preferred = [
        t
        for t in pod_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        if (t.get("podAffinityTerm") or {}).get("topologyKey") in keep
    ]
    if preferred:
        projected["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    return projected


def _project_affinity(affinity: Mapping[str, Any], keep: Collection[str]) -> JSON | None:
    projected: JSON = {}
    if affinity.get("nodeAffinity"):
        node = _project_node_affinity(affinity["nodeAffinity"], keep)
        if node:
            projected["nodeAffinity"] = node
    for kind in ("podAffinity", "podAntiAffinity"):
        if affinity.get(kind):
            pod = _project_pod_affinity(affinity[kind], keep)
            if pod:
                projected[kind] = pod
    return projected or None


def _project_tolerations(tolerations: list[JSON]) -> list[JSON]:
    """Every toleration stays above (one only lets a pod onto more nodes: an ordinary
    node's taint, one an admin puts on a virtual node, the node controller's not-ready;
    a toleration of every taint keeps its meaning), and the provider's taint is
    tolerated."""
    if any(tolerates_provider_taint(t) or tolerates_every_taint(t) for t in tolerations):
        return tolerations
    return [*tolerations, dict(PROVIDER_TOLERATION)]


def _tolerations_below(upper: list[JSON], stashed: list[JSON] | None) -> list[JSON] | None:
    """The upper pod's tolerations but the provider's one the webhook added. Every
    toleration stays above (``_project_tolerations``), so they are the pod's own and those
    added since (the only change a pod's tolerations may take); the stash's copy is not
    read: anyone may write the annotation, and the upper cluster's admission (a policy
    on tolerations) saw only the spec. Only whether the field was there is taken from it."""
    return [t for t in upper if t != PROVIDER_TOLERATION] or (None if stashed is None else [])


def tolerates_every_taint(toleration: Mapping[str, Any]) -> bool:
    return (
        not toleration.get("key")
        and toleration.get("operator") == "Exists"
        and toleration.get("effect") in (None, "", "NoSchedule")
    )


def tolerates_provider_taint(toleration: Mapping[str, Any]) -> bool:
    if toleration.get("key") != keys.PROVIDER_TAINT_KEY:
        return False
    if toleration.get("effect") not in (None, "", "NoSchedule"):
        return False
    return (
        toleration.get("operator") == "Exists"
        or toleration.get("value") == keys.PROVIDER_TAINT_VALUE
    )


def _project_spread(constraints: list[JSON], keep: Collection[str]) -> list[JSON] | None:
    kept = [c for c in constraints if c.get("topologyKey") in keep]
    return kept or None


def upper_view(
    spec: Mapping[str, Any],
    keep: Collection[str] = DEFAULT_KEEP_KEYS,
    kept_off: Collection[str] = (),
) -> JSON:
    """The scheduling fields as the upper scheduler should see them (None: absent);
    ``kept_off`` names virtual nodes the pod must not be bound to (kubekit.moves)."""
    affinity = _project_affinity(spec.get("affinity") or {}, keep)
    return {
        "nodeSelector": _project_node_selector(
            spec.get("nodeSelector") or {}, keep, bound=bool(spec.get("nodeName"))
        ),
        "affinity": keep_off(affinity, kept_off) if kept_off else affinity,
        "tolerations": _project_tolerations(list(spec.get("tolerations") or [])),
        "topologySpreadConstraints": _project_spread(
            list(spec.get("topologySpreadConstraints") or []), keep
        ),
    }


def stash_scheduling(
    spec: Mapping[str, Any],
    annotations: Mapping[str, str],
    keep: Collection[str] = DEFAULT_KEEP_KEYS,
    kept_off: Collection[str] = (),
) -> tuple[JSON, dict[str, str]]:
    """The pod spec the upper scheduler should see and the annotations that carry the
    originals.

    A pod that carries a stash gets what was added to it since stashed too: after a
    webhook changed a pod the apiserver runs its own admission plugins again, and the
    RuntimeClass and PodNodeSelector plugins put back the node selector entries they
    add, which the upper scheduler would then look for on the virtual nodes. An entry
    added to a stashed node selector joins the stashed one; another field that is not
    the view of its stashed value (not stashed, changed by a webhook since, or a stash
    written by hand) is stashed as it is now. A pod as it left the webhook comes back
    unchanged."""
    existing = annotations.get(keys.STASH_ANNOTATION)
    originals: JSON = decode(existing) if existing is not None else {}
    if "nodeSelector" in originals and spec.get("nodeSelector"):
        seen_above = (
            _project_node_selector(
                originals["nodeSelector"] or {}, keep, bound=bool(spec.get("nodeName"))
            )
            or {}
        )
        # The virtual nodes' entry is ours (a bound copy of a pod keeps it), never added.
        added = {
            k: v for k, v in _own_entries(spec["nodeSelector"]).items() if seen_above.get(k) != v
        }
        if added:
            originals["nodeSelector"] = {**(originals["nodeSelector"] or {}), **added}
    new_spec: JSON = json_copy(dict(spec))
    # The tolerations above are the pod's own (see _tolerations_below).
    stashed = {k: v for k, v in originals.items() if k != "tolerations"}
    as_it_is = upper_view(spec, keep, kept_off)
    of_the_stash = upper_view({**spec, **stashed}, keep, kept_off) if stashed else as_it_is
    for field, value in of_the_stash.items():
        if field in ("nodeSelector", "tolerations") and field in originals:
            _set_or_drop(new_spec, field, value)
        elif not (
            spec.get(field) == value
            or (value is None and field not in spec)
            or (
                field == "affinity"
                and field in stashed
                and _viewed_with_other_moves(spec.get(field), {**spec, **stashed}, keep)
            )
        ):
            # Not stashed, or not the view of what is stashed (changed by a webhook since,
            # or a stash written by hand beside what the upper admission saw): the spec's.
            originals[field] = spec.get(field)  # only encoded, never changed
            _set_or_drop(new_spec, field, as_it_is[field])
    new_annotations = dict(annotations)
    if originals:
        new_annotations[keys.STASH_ANNOTATION] = encode(originals)
    return new_spec, new_annotations


def _viewed_with_other_moves(
    affinity: Any, original: Mapping[str, Any], keep: Collection[str]
) -> bool:
    """Whether ``affinity`` is the view of the ``original`` spec's with other virtual
    nodes kept off: this webhook's answer, called again in the same admission (after a
    later webhook's change) while a move record came or lapsed. Taken for an affinity
    changed since, it was stashed in place of the original, and the lower pod lost its
    own."""
    view = upper_view(original, keep)["affinity"]
    moved_off = _appended_keep_offs(affinity, view)
    if moved_off is None:
        return False
    return bool(affinity == (keep_off(view, moved_off) if moved_off else view))


def _required_terms(affinity: Any) -> list[Any]:
    node_affinity = (affinity or {}).get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    return list(required.get("nodeSelectorTerms") or [])


def _appended_keep_offs(affinity: Any, view: Any) -> set[str] | None:
    """The nodes ``keep_off`` would have appended to ``view`` to make ``affinity``: the
    requirements its first term has past the view's (None: not such a tail). Read from
    what follows, not as the names the view lacks: a pod's own term may exclude a node
    it is also kept off, and the second exclusion was taken for a change of its own."""
    terms, viewed = _required_terms(affinity), _required_terms(view)
    if not terms:
        return set() if not viewed else None
    fields = list((terms[0] or {}).get("matchFields") or [])
    before = list((viewed[0] or {}).get("matchFields") or []) if viewed else []
    tail = fields[len(before) :]
    if fields[: len(before)] != before or not all(
        isinstance(r, dict)
        and r.get("key") == "metadata.name"
        and r.get("operator") == "NotIn"
        and len(r.get("values") or []) == 1
        for r in tail
    ):
        return None
    return {str(r["values"][0]) for r in tail}


def stash_update(
    old_spec: Mapping[str, Any],
    old_stash: str,
    spec: Mapping[str, Any],
    annotations: Mapping[str, str],
    keep: Collection[str] = DEFAULT_KEEP_KEYS,
) -> tuple[JSON, dict[str, str]]:
    """The spec and annotations an update of a stashed pod should store (``annotations``
    carry its stash, if it has one; ``old_stash`` is the one stored before the update:
    called again on its own answer, after another webhook's change, the function changes
    nothing more), as ``stash_scheduling`` for a create.

    An update that puts back what the stash restores (the pod's manifest applied again,
    with a new image or label: the apply puts back the fields the webhook moved and
    drops the provider's toleration it added) leaves that field as the upper scheduler
    saw it, so the update changes what it meant to and no field a pod may not change.
    Tolerations added are kept, with the provider's. A pod waiting on a scheduling gate
    may be given what Kubernetes lets it take before it is scheduled (what a queueing
    controller such as Kueue does): node selector entries join the stashed ones, and a
    node affinity on cluster-level keys (or node names) only is taken as it is (it speaks
    to the upper scheduler; the lower pod keeps its stashed affinity). One that names a
    key the stash holds with another value, or a node affinity on lower nodes' labels, is
    refused (``StashRefused``): the apiserver, which sees only the upper view, would take
    it and lose the stashed one. Any other change is left for the apiserver, which
    refuses it as it would without kubestrata."""
    stashed_before = keys.STASH_ANNOTATION in annotations
    originals = decode(annotations[keys.STASH_ANNOTATION]) if stashed_before else {}
    restored = restore_scheduling(old_spec, old_stash)
    gated = bool(old_spec.get("schedulingGates"))
    new_spec: JSON = json_copy(dict(spec))
    for field in FIELDS:
        value, old = spec.get(field), old_spec.get(field)
        if value == old:
            continue
        if _puts_back(field, value, old, restored.get(field)):
            _set_or_drop(new_spec, field, old)
        elif field == "tolerations":
            new_spec[field] = _project_tolerations(list(value or []))
        elif (
            gated and field == "nodeSelector" and _own_entries(old).items() <= (value or {}).items()
        ):
            # Entries added (one changed or dropped is the apiserver's to refuse).
            stashed = originals.get(field, old) or {}
            # The webhook's entries (today's, or the one it gave before) are never the
            # pod's own, whoever writes them.
            added = {k: v for k, v in _own_entries(value).items() if k not in (old or {})}
            for key, wanted in added.items():
                if key in stashed and stashed[key] != wanted:
                    raise StashRefused(
                        f"spec.nodeSelector: the pod asks for {key}={stashed[key]} already "
                        f"(kept in annotation {keys.STASH_ANNOTATION}); a node selector "
                        "entry cannot be changed"
                    )
            originals[field] = {**stashed, **added}
            projected = _project_node_selector(added, keep) or {}
            if _own_entries(old) != (old or {}):
                # Given an entry of the webhook's already (the one before 2026-11-29,
                # say): kept, not joined by today's, so a call again on this answer
                # changes nothing more.
                projected = _own_entries(projected)
            above = {**(old or {}), **projected}
            _set_or_drop(new_spec, field, above or old)
            tolerations = list(new_spec.get("tolerations") or [])
            if PROVIDER_TOLERATION not in tolerations:
                # Made before the webhook: held to virtual nodes now, it needs what a
                # create would have given it to go on one (their taint's toleration), or
                # it waited for good.
                new_spec["tolerations"] = [*tolerations, dict(PROVIDER_TOLERATION)]
        elif gated and field == "affinity" and _only_node_affinity_changed(old, value):
            node_affinity = (value or {}).get("nodeAffinity") or {}
            if _project_node_affinity(node_affinity, keep) != node_affinity:
                raise StashRefused(
                    "spec.affinity.nodeAffinity: a node affinity on lower nodes' labels "
                    "given to a pod waiting on a scheduling gate cannot be kept apart from "
                    "the upper scheduler; give those labels as a nodeSelector"
                )
            originals.setdefault(field, old)
    new_annotations = dict(annotations)
    if originals or stashed_before:
        new_annotations[keys.STASH_ANNOTATION] = encode(originals)
    return new_spec, new_annotations


class StashRefused(ValueError):
    """An update of a stashed pod's scheduling fields that cannot be taken."""


_ABSENT = object()


def stash_change_refusal(
    old_spec: Mapping[str, Any], stored: str | None, incoming: str | None
) -> str | None:
    """Why an update may not bring the stash annotation ``incoming`` to a pod that stored
    ``stored`` (None: the change is one ``stash_update`` makes, or none). The lower pod is
    made from the stash, and the upper cluster's admission saw only the spec: written by
    hand after the pod was admitted, it would undo what a policy set at create (the
    namespace's PodNodeSelector, a RuntimeClass's selector). What a pod waiting on a
    scheduling gate may be given passes, as the webhook stashes it (called again in the
    same admission, it sees its own answer): node selector entries added, a node
    affinity recorded where there was none. A stash dropped is put back."""
    if incoming is None or incoming == stored:
        return None
    before = decode(stored) if stored is not None else {}
    after = decode(incoming)
    gated = bool(old_spec.get("schedulingGates"))
    for field in FIELDS:
        was, now = before.get(field, _ABSENT), after.get(field, _ABSENT)
        if now == was:
            continue
        if gated and field == "nodeSelector" and isinstance(now, dict):
            base = old_spec.get(field) if was is _ABSENT else was
            if (base or {}).items() <= now.items():
                continue
        if gated and field == "affinity" and was is _ABSENT and now == old_spec.get(field):
            continue
        return (
            f"annotation {keys.STASH_ANNOTATION}: {field} differs from the one recorded when "
            "the pod was admitted; the record is kubestrata's and cannot be written (change "
            "the pod's spec instead, where Kubernetes lets it change)"
        )
    return None


def _puts_back(field: str, value: Any, old: Any, restored: Any) -> bool:
    """Whether ``value`` is the stashed original (or, for a node selector, which an apply
    merges key by key into the upper one, a part of it over the upper entries; the
    virtual nodes' own entry the webhook added may be there or not)."""
    if field != "nodeSelector" or not isinstance(value, dict):
        return bool(value == restored)
    return (
        _own_entries(old).items()
        <= value.items()
        <= {**(restored or {}), **WEBHOOK_SELECTOR_ENTRIES}.items()
    )


def _own_entries(selector: Mapping[str, str] | None) -> dict[str, str]:
    """An upper node selector but the virtual nodes' own entry the webhook adds."""
    return {k: v for k, v in (selector or {}).items() if WEBHOOK_SELECTOR_ENTRIES.get(k) != v}


def _only_node_affinity_changed(old: Mapping[str, Any] | None, value: Any) -> bool:
    others = ("podAffinity", "podAntiAffinity")
    return isinstance(value, dict) and all(
        (old or {}).get(kind) == value.get(kind) for kind in others
    )


def _set_or_drop(spec: JSON, field: str, value: Any) -> None:
    """The field set to value, absent for None (an empty value stays: the pod as written)."""
    if value is None:
        spec.pop(field, None)
    else:
        spec[field] = value


def restore_scheduling(spec: Mapping[str, Any], stash: str | None) -> JSON:
    """The pod spec with its stashed scheduling fields back as they were."""
    restored: JSON = json_copy(dict(spec))
    if stash is None:
        return restored
    for field, value in decode(stash).items():
        if field == "tolerations":
            value = _tolerations_below(list(spec.get("tolerations") or []), value)
        _set_or_drop(restored, field, value)  # decoded afresh, nobody else holds it
    return restored
