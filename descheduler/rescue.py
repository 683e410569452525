"""Which upper pods are stuck in their lower cluster, and what to do about each (pure).

A pod is stuck when its virtual node has been NotReady for ``clusterDownTimeout`` (or
is within ``RESCUE_AHEAD`` of the taint eviction that would delete it from that Node, if
sooner), or when its lower copy has been unschedulable (the PodScheduled False the virtual node
reports up) for ``pendingTimeout``. It moves only where an estimator says one real node
fits it now: a controller's pod is evicted and its controller makes the replacement the
scheduler places; a bare pod has nobody to replace it, so a copy bound to the chosen
cluster is created, and the original goes once that cluster has taken the copy (a crash
between the two leaves both, and a later cycle, finding the copy by its name, only
deletes the original).
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from descheduler.policy import Limits, Policy
from kubekit import fit, keys
from kubekit.estimatorapi.estimator_pb2 import PodEstimate
from kubekit.informer import object_key
from kubekit.jsonvalue import json_copy
from kubekit.moves import (
    Moves,
    controller_reference,
    controller_uid,
    is_daemon_pod,
    kept_off_names,
)
from kubekit.stash import StashError, decode
from kubekit.timestamps import parse_time, rfc3339

JSON = dict[str, Any]

_FINISHED = frozenset({"Succeeded", "Failed"})
# Room for the copy's suffix within a pod name's 253 characters.
_BASE_NAME_LIMIT = 240
# How long before the upper node controller's taint eviction would delete a pod of a
# NotReady virtual node the pod is moved, whatever clusterDownTimeout says: deleted, a
# bare pod is lost (its copy is never made). Three cycles at the default interval, and
# three cycles at a longer one (``rescue_ahead``): one look may find an estimator slow.
RESCUE_AHEAD = timedelta(seconds=30)
LOOKS_AHEAD = 3


def rescue_ahead(policy: Policy) -> timedelta:
    return max(RESCUE_AHEAD, timedelta(seconds=LOOKS_AHEAD * policy.interval))


class Why(enum.StrEnum):
    UNSCHEDULABLE = "Unschedulable"
    CLUSTER_DOWN = "ClusterDown"


# The controllers known to make a new pod for one of theirs evicted: the built-in ones. A
# Job counts one evicted pod as failed, against its backoffLimit: it is moved when stuck
# (it makes no progress where it is, and a cluster down would have it deleted), never to
# make room (a running one would lose its work). Another controller (a workflow engine's,
# a CI system's) may fail its whole run, or never make the pod again: its pods stay.
REPLACING_CONTROLLERS = frozenset(
    {("apps", "ReplicaSet"), ("apps", "StatefulSet"), ("", "ReplicationController")}
)
JOB = ("batch", "Job")
STATEFUL_SET = ("apps", "StatefulSet")


def owned(pod: Mapping[str, Any]) -> bool:
    """Whether the pod has a controller (which may or may not replace it when it goes)."""
    return controller_uid(pod) is not None


def bare(pod: Mapping[str, Any]) -> bool:
    """Whether the pod has no owner at all. One with owners none of which is its
    controller (an operator's ``SetOwnerReference``) is neither: its owner may track it
    by name, and deletes it with itself, which a copy under another name escapes."""
    return not (pod.get("metadata") or {}).get("ownerReferences")


def controller_kind(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """The API group and kind of the pod's controller."""
    reference = controller_reference(pod)
    if reference is None:
        return None
    group = str(reference.get("apiVersion") or "").rpartition("/")[0]
    return group, str(reference.get("kind") or "")


def replaced_when_stuck(pod: Mapping[str, Any]) -> bool:
    """Whether evicting the pod, stuck where it is, has its controller make a new one."""
    kind = controller_kind(pod)
    return kind in REPLACING_CONTROLLERS or kind == JOB


# The apiserver's default spec.backoffLimit of a Job: 6, or, with a limit per index,
# none (the largest int32).
DEFAULT_BACKOFF_LIMIT = 6
DEFAULT_BACKOFF_LIMIT_PER_INDEXED_JOB = 2**31 - 1


def job_lost_by_eviction(
    job: Mapping[str, Any], pod: Mapping[str, Any], evicted_before: int = 0
) -> str | None:
    """Why evicting the Job's pod would fail the Job, or the pod's index, rather than
    have the pod made again; None when it would be made again. ``evicted_before``: the
    Job's pods this descheduler evicts before it (this cycle), each one more failure.

    An eviction marks the pod with a ``DisruptionTarget`` condition, which the Job's
    podFailurePolicy judges first (its first rule that names that condition); else the
    pod counts as one failure against the backoff limit of its index, if the Job has one,
    and against the Job's (the apiserver fills in a default), with the failures the Job
    controller has seen and not yet counted. A limit is exceeded by one failure more than
    it allows."""
    spec, status = job.get("spec") or {}, job.get("status") or {}
    for rule in (spec.get("podFailurePolicy") or {}).get("rules") or []:
        conditions = rule.get("onPodConditions") or []
        if not any(
            c.get("type") == "DisruptionTarget" and c.get("status", "True") == "True"
            for c in conditions
        ):
            continue
        action = rule.get("action")
        if action == "Ignore":
            return None
        if action == "FailJob":
            return "its Job's podFailurePolicy fails the Job on an eviction"
        if action == "FailIndex":
            return "its Job's podFailurePolicy fails the pod's index on an eviction"
        break  # Count: a failure like any other
    per_index = spec.get("backoffLimitPerIndex")
    if isinstance(per_index, int):
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        try:
            failures = int(annotations.get(keys.JOB_INDEX_FAILURE_COUNT_ANNOTATION, 0))
        except (TypeError, ValueError):
            failures = 0
        if failures >= per_index:
            return (
                f"its index has failed {failures} times, its Job's backoffLimitPerIndex: "
                "evicted, the index would fail"
            )
    limit = spec.get("backoffLimit")
    if not isinstance(limit, int):
        limit = (
            DEFAULT_BACKOFF_LIMIT_PER_INDEXED_JOB
            if isinstance(per_index, int)
            else DEFAULT_BACKOFF_LIMIT
        )
    failed = status.get("failed")
    uncounted = (status.get("uncountedTerminatedPods") or {}).get("failed")
    failures = (
        (failed if isinstance(failed, int) else 0)
        + (len(uncounted) if isinstance(uncounted, list) else 0)
        + evicted_before
    )
    if failures >= limit:
        return (
            f"its Job has failed {failures} times, its backoffLimit"
            + (
                f" (counting {evicted_before} of its pods evicted before it)"
                if evicted_before
                else ""
            )
            + ": evicted, the Job would fail"
        )
    return None


def hands_off(pod: Mapping[str, Any]) -> bool:
    """A pod the descheduler neither moves nor makes room for: opted out by its
    annotation (whatever its value); a DaemonSet's, which its controller makes again for
    the same node (moving it would free nothing and place nothing elsewhere); or one with
    a PersistentVolumeClaim, whose data is in the cluster it was placed in (moved, it would
    find an empty volume elsewhere, or, its claim's volume bound to that cluster, fit
    nowhere else)."""
    annotations = pod["metadata"].get("annotations") or {}
    if keys.DESCHEDULER_ANNOTATION in annotations:
        return True
    if any("persistentVolumeClaim" in v for v in (pod.get("spec") or {}).get("volumes") or []):
        return True
    return is_daemon_pod(pod)


@dataclass(frozen=True)
class PodCase:
    """A pod the descheduler has something to decide about."""

    pod: Mapping[str, Any]

    @property
    def key(self) -> str:
        return object_key(self.pod)

    @property
    def uid(self) -> str:
        return str(self.pod["metadata"]["uid"])

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])


@dataclass(frozen=True)
class Stuck(PodCase):
    node: str
    why: Why
    # For how long, in seconds, and the lower cluster's own words.
    seconds: float
    detail: str
    # When the upper taint manager deletes it from its cluster down; None if it never does.
    deleted_at: datetime | None = None
    # Whether that is soon: within the looks ahead the descheduler moves such a pod.
    deleted_soon: bool = False

    @property
    def owned(self) -> bool:
        return owned(self.pod)

    @property
    def lost_if_left(self) -> bool:
        """A bare pod the taint manager is about to delete from its cluster down, which
        nobody makes again. One whose deletion is further off (a toleration of an hour)
        is moved within the limits, like any other (until 2026-11-29 it went past them
        as soon as clusterDownTimeout was reached)."""
        return self.why is Why.CLUSTER_DOWN and not self.owned and self.deleted_soon

    def describe(self) -> str:
        if self.why is Why.CLUSTER_DOWN:
            return f"{self.node} NotReady for {self.seconds:.0f} s"
        return f"unschedulable in {self.node} for {self.seconds:.0f} s: {self.detail}"


def made_again_only_once_gone(job: Mapping[str, Any] | None) -> bool:
    """Whether the pod's controller makes its new pod only once the old one is gone or
    failed: a StatefulSet (``job`` None), or a Job replacing pods only once failed
    (``podReplacementPolicy: Failed``, the default with a podFailurePolicy). Evicted off
    a cluster that is down, such a pod stays Terminating, nothing making it again, until
    that cluster comes back."""
    if job is None:
        return True
    spec = job.get("spec") or {}
    policy = spec.get("podReplacementPolicy")
    return policy == "Failed" or (policy is None and bool(spec.get("podFailurePolicy")))


def kept_for_its_controller(stuck: Stuck, job: Mapping[str, Any] | None = None) -> str | None:
    """Why a pod of a cluster that is down stays where it is when its controller makes
    no new pod for it until it is gone (None: evicted, it is made again)."""
    if stuck.why is not Why.CLUSTER_DOWN or not made_again_only_once_gone(job):
        return None
    kind = "Job" if job is not None else "StatefulSet"
    return (
        f"its {kind} makes no new pod until this one is gone, which {stuck.node}, down, "
        "cannot confirm: delete it with --force, or taint the node "
        "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute, to have it made again"
    )


def lapsed_keep_off(pod: Mapping[str, Any], moves: Moves, now: datetime) -> set[str]:
    """The virtual nodes the webhook keeps a pod off (its required affinity above excludes
    them by name, its own in the stash does not) whose move record has lapsed or is gone.
    Written into the pod at its creation, a keep-off outlives its record: a pod's
    affinity cannot change, and a replacement that found no room elsewhere waited above
    for good while the cluster it was kept off had room again."""
    text = (pod["metadata"].get("annotations") or {}).get(keys.STASH_ANNOTATION)
    if not isinstance(text, str):
        return set()
    try:
        originals = decode(text)
    except StashError:
        return set()
    if "affinity" not in originals:
        return set()  # the affinity above is the pod's own
    own = originals["affinity"]
    ours = kept_off_names((pod.get("spec") or {}).get("affinity")) - kept_off_names(
        own if isinstance(own, Mapping) else None
    )
    owner = controller_uid(pod)
    recorded = moves.get(owner, {}) if owner else {}
    return {name for name in ours if recorded.get(name, now) <= now}


def kept_off_for_nothing(
    pods: Iterable[Mapping[str, Any]], moves: Moves, now: datetime, policy: Policy
) -> list[tuple[Mapping[str, Any], set[str]]]:
    """Unbound pods of a controller that replaces them (a ReplicaSet's, a StatefulSet's,
    a ReplicationController's) the upper scheduler has found no node for since
    ``pendingTimeout``, kept off virtual nodes by records that have lapsed, with those
    nodes, in key order: evicted (an unbound pod runs nothing, and no disruption budget
    counts it), the controller makes one kept off only what is recorded now."""
    found = []
    for pod in pods:
        if controller_kind(pod) not in REPLACING_CONTROLLERS:
            continue
        waited = unschedulable_above(pod, now)
        if waited is None or waited[0] < policy.pending_timeout:
            continue
        if lapsed := lapsed_keep_off(pod, moves, now):
            found.append((pod, lapsed))
    return sorted(found, key=lambda each: object_key(each[0]))


def unschedulable_above(pod: Mapping[str, Any], now: datetime) -> tuple[float, str] | None:
    """For how long the upper scheduler has found no node for an unbound pod, and its
    words; None for a pod bound, being deleted, left alone, not Pending or not turned
    away (Unschedulable)."""
    metadata, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    if spec.get("nodeName") or metadata.get("deletionTimestamp") or hands_off(pod):
        return None
    if status.get("phase", "Pending") != "Pending":
        return None
    scheduled = condition(status.get("conditions") or [], "PodScheduled")
    if scheduled is None or (scheduled.get("status"), scheduled.get("reason")) != (
        "False",
        "Unschedulable",
    ):
        return None
    seconds = since(scheduled, now)
    return None if seconds is None else (seconds, str(scheduled.get("message") or ""))


def condition(conditions: Iterable[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def since(transition: Mapping[str, Any], now: datetime) -> float | None:
    """How long ago a condition took its status."""
    stamp = transition.get("lastTransitionTime")
    if not isinstance(stamp, str):
        return None
    try:
        return (now - parse_time(stamp)).total_seconds()
    except ValueError:
        return None


def down_for(node: Mapping[str, Any], now: datetime) -> float | None:
    """How long a Node has not been Ready; None while it is."""
    ready = condition((node.get("status") or {}).get("conditions") or [], "Ready")
    if ready is None or ready.get("status") == "True":
        return None
    return since(ready, now)


class TaintDeletion(NamedTuple):
    """When the taint manager began to count for a pod (``since``), and when it deletes
    the pod (``at``)."""

    since: datetime
    at: datetime


def taint_deletion(pod: Mapping[str, Any], node: Mapping[str, Any]) -> TaintDeletion | None:
    """When the upper node controller's taint eviction deletes the pod from the Node, by
    the taint manager's rule: at once for a NoExecute taint the pod does not tolerate,
    else the shortest ``tolerationSeconds`` of the tolerations it uses after it began to
    count, when the earliest taint it tolerates only for a while was added
    (``node.kubernetes.io/unreachable`` and ``not-ready`` get 300 s tolerations on every
    pod by default; a taint tolerated for ever, an admin's ``dedicated`` added weeks
    ago, starts no count: until 2026-11-29 it was taken for the start, and a pod of a
    cluster down for a moment was taken for one about to be deleted); None when never."""
    taints = [
        taint
        for taint in (node.get("spec") or {}).get("taints") or []
        if taint.get("effect") == "NoExecute" and isinstance(taint.get("timeAdded"), str)
    ]
    tolerations = [t for t in (pod.get("spec") or {}).get("tolerations") or [] if t]
    counted: list[datetime] = []
    shortest: float | None = None
    for taint in taints:
        added = parse_time(taint["timeAdded"])
        facts = fit.Taint(str(taint.get("key", "")), str(taint.get("value", "")), "NoExecute")
        used = [t for t in tolerations if fit.tolerates([fit.toleration_of(t)], facts)]
        if not used:
            return TaintDeletion(added, added)
        for toleration in used:
            seconds = toleration.get("tolerationSeconds")
            if isinstance(seconds, int | float) and not isinstance(seconds, bool):
                seconds = max(0.0, float(seconds))
                shortest = seconds if shortest is None else min(shortest, seconds)
                counted.append(added)
    if shortest is None:
        return None
    since = min(counted)
    try:
        return TaintDeletion(since, since + timedelta(seconds=shortest))
    except OverflowError:
        # Past the last moment there is (tolerationSeconds of a trillion, to say "for
        # ever"): it raised out of every look while a cluster was down.
        return None


def _ahead_of(deletion: TaintDeletion, ahead: timedelta, policy: Policy) -> timedelta:
    """How long before its deletion a pod of a cluster down is moved: ``ahead``, but no
    more than half its toleration (with a long interval, three looks ahead were more
    than the default 300 s, and a cluster down for a moment had its pods moved at the
    first look), and no less than a look and a half (a toleration of 10 s would have a
    window one look could miss), short of the first look's when the toleration leaves
    room for both (two looks or more)."""
    toleration = deletion.at - deletion.since
    look = timedelta(seconds=policy.interval)
    floor = 1.5 * look
    if toleration >= 2 * look:
        floor = min(floor, toleration - look)
    return min(ahead, max(toleration / 2, floor))


def _tainted_down(node: Mapping[str, Any]) -> bool:
    """Whether the upper node controller has tainted the Node NoExecute for being down."""
    return any(
        taint.get("key") in keys.NODE_DOWN_TAINTS and taint.get("effect") == "NoExecute"
        for taint in (node.get("spec") or {}).get("taints") or []
    )


def stuck_pods(
    pods: Iterable[Mapping[str, Any]],
    virtual_nodes: Mapping[str, Mapping[str, Any]],
    now: datetime,
    policy: Policy,
) -> list[Stuck]:
    """The pods on virtual nodes that have waited past the policy's timeouts, in key
    order (the same state gives the same list)."""
    down = {
        name: seconds
        for name, node in virtual_nodes.items()
        if (seconds := down_for(node, now)) is not None
    }
    ahead = rescue_ahead(policy)
    found = []
    for pod in pods:
        metadata, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        node = str(spec.get("nodeName") or "")
        if node not in virtual_nodes or metadata.get("deletionTimestamp"):
            continue
        if status.get("phase") in _FINISHED:
            continue
        if hands_off(pod) or not (bare(pod) or replaced_when_stuck(pod)):
            continue
        if node in down:
            deletion = taint_deletion(pod, virtual_nodes[node])
            if deletion is None and _tainted_down(virtual_nodes[node]):
                # It tolerates its node unreachable for ever: bound there whatever
                # happens, as the taint manager leaves it (moved, a bare pod cut off from
                # the upper cluster but running on below would run twice).
                continue
            soon = deletion is not None and now >= deletion.at - _ahead_of(deletion, ahead, policy)
            if down[node] >= policy.cluster_down_timeout or soon:
                deleted_at = deletion.at if deletion is not None else None
                found.append(Stuck(pod, node, Why.CLUSTER_DOWN, down[node], "", deleted_at, soon))
            continue
        if status.get("phase") != "Pending":
            continue
        scheduled = condition(status.get("conditions") or [], "PodScheduled")
        if scheduled is None or scheduled.get("status") != "False":
            continue
        seconds = since(scheduled, now)
        if seconds is not None and seconds >= policy.pending_timeout:
            detail = str(scheduled.get("message") or scheduled.get("reason") or "")
            found.append(Stuck(pod, node, Why.UNSCHEDULABLE, seconds, detail))
    return sorted(found, key=lambda stuck: stuck.key)


@dataclass(frozen=True)
class Move:
    stuck: Stuck
    # The cluster (virtual node) the estimators rank first for the pod.
    to: str


@dataclass(frozen=True)
class Stay:
    stuck: Stuck
    message: str


def destination(stuck: Stuck, answers: Mapping[str, PodEstimate | str]) -> Move | Stay:
    """Where the pod goes: the fitting cluster whose best node is left with the least
    stranded room (the extender's default score), ties to the first name. ``answers``
    are the other virtual nodes' estimates, or why one could not be asked."""
    fitting = {
        name: answer
        for name, answer in answers.items()
        if isinstance(answer, PodEstimate) and not answer.error and answer.max_replicas > 0
    }
    if fitting:
        best = max(sorted(fitting), key=lambda name: fitting[name].best_fit)
        return Move(stuck, best)
    if not answers:
        return Stay(stuck, "no other cluster to move it to")
    reasons = "; ".join(
        f"{name}: {answer if isinstance(answer, str) else answer.error or answer.message}"
        for name, answer in sorted(answers.items())
    )
    return Stay(stuck, f"no cluster can run it now ({reasons})")


def within_limits(moves: Sequence[Move], limits: Limits) -> tuple[list[Move], list[Move]]:
    """The moves this cycle may make, bare pods first, and those left for later. A bare
    pod of a cluster that is down is moved whatever the limits (counted against them
    all the same): left, it is lost once the taint manager deletes it, and at 5 a look
    most of a cluster's bare pods were. A controller makes its pods again anyway."""
    allowed: list[Move] = []
    deferred: list[Move] = []
    for move in sorted(moves, key=lambda move: move.stuck.owned):
        case = [(move.stuck.namespace, move.stuck.node)]
        if move.stuck.lost_if_left:
            limits.count(case)
            allowed.append(move)
        else:
            (allowed if limits.take(case) else deferred).append(move)
    return allowed, deferred


def copy_name(pod: Mapping[str, Any]) -> str:
    """The copy's name, the same on every try: derived from the original's UID."""
    metadata = pod["metadata"]
    digest = hashlib.sha256(str(metadata["uid"]).encode()).hexdigest()[:6]
    return f"{str(metadata['name'])[:_BASE_NAME_LIMIT]}-{digest}"


def left_until(pod: Mapping[str, Any]) -> dict[str, datetime]:
    """The virtual nodes a bare pod was moved off, and until when its copies stay off
    them (an entry that cannot be read is none)."""
    text = (pod["metadata"].get("annotations") or {}).get(keys.LEFT_UNTIL_ANNOTATION)
    try:
        written = json.loads(text) if isinstance(text, str) else {}
    except (ValueError, RecursionError):
        return {}
    found = {}
    for name, until in written.items() if isinstance(written, dict) else ():
        try:
            moment = parse_time(until) if isinstance(until, str) else None
        except ValueError:
            continue
        if moment is not None:
            found[str(name)] = moment
    return found


def kept_off(pod: Mapping[str, Any], now: datetime) -> set[str]:
    """The virtual nodes a bare pod's next copy may not go to now: those it was moved off
    within ``returnAfter``. Without this, two clusters that both refuse the pod (a policy
    below the estimators do not model) had it copied from one to the other for good."""
    return {name for name, until in left_until(pod).items() if until > now}


def kept_off_reasons(pod: Mapping[str, Any], names: Iterable[str], now: datetime) -> dict[str, str]:
    """Of the virtual nodes ``names``, those a bare pod's next copy may not go to now
    (``kept_off``), each with until when: named in the event that says the pod stays."""
    if owned(pod):
        return {}
    off, until = kept_off(pod, now), left_until(pod)
    return {
        name: f"left out until {rfc3339(until[name])} (the pod left it, or a copy of it was "
        "refused or not taken there)"
        for name in names
        if name in off
    }


def left_until_text(
    pod: Mapping[str, Any], leaving: str, now: datetime, return_after: float
) -> str:
    """The pod's virtual nodes to keep off, as written: those it is kept off now, and
    ``leaving`` (none if empty) for ``return_after`` seconds more."""
    left = {name: rfc3339(until) for name, until in left_until(pod).items() if until > now}
    if leaving:
        left[leaving] = rfc3339(now + timedelta(seconds=return_after))
    return json.dumps(left, sort_keys=True)


def pod_copy(pod: Mapping[str, Any], to: str, now: datetime, return_after: float) -> JSON:
    """A bare pod re-created on virtual node ``to``: what its creator wrote (metadata the
    apiserver sets, status, the old binding and ephemeral containers dropped), marked with
    the original's UID and with the virtual node it leaves, kept off for ``return_after``
    seconds (with those its original was still kept off)."""
    metadata = pod["metadata"]
    annotations = dict(metadata.get("annotations") or {})
    annotations[keys.COPY_OF_ANNOTATION] = str(metadata["uid"])
    leaving = str((pod.get("spec") or {}).get("nodeName") or "")
    annotations[keys.LEFT_UNTIL_ANNOTATION] = left_until_text(pod, leaving, now, return_after)
    spec = json_copy(dict(pod.get("spec") or {}))
    spec["nodeName"] = to
    # Added by `kubectl debug` through their own subresource; a create refuses them.
    spec.pop("ephemeralContainers", None)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": copy_name(pod),
            "namespace": metadata["namespace"],
            "labels": dict(metadata.get("labels") or {}),
            "annotations": annotations,
        },
        "spec": spec,
    }


def is_copy_of(candidate: Mapping[str, Any], original: Mapping[str, Any]) -> bool:
    annotations = candidate["metadata"].get("annotations") or {}
    return bool(annotations.get(keys.COPY_OF_ANNOTATION) == original["metadata"]["uid"])


def copy_alive(copy: Mapping[str, Any]) -> bool:
    """A copy not failed, not being deleted."""
    phase = (copy.get("status") or {}).get("phase")
    return phase != "Failed" and not copy["metadata"].get("deletionTimestamp")


def copy_taken(copy: Mapping[str, Any]) -> bool:
    """A live copy its cluster has taken: made below, where its scheduler has placed it or
    found no node for it yet (Unschedulable), or a node has admitted it. Only then may
    its original go: the lower apiserver may refuse the copy (an admission policy of that
    cluster alone: a 403 the virtual node reports as PodScheduled False with its own
    reason, a 400 it fails the copy for), which, its original gone, left the pod
    nowhere."""
    status = copy.get("status") or {}
    scheduled = condition(status.get("conditions") or [], "PodScheduled") or {}
    return copy_landed(copy) or (
        copy_alive(copy)
        and scheduled.get("status") == "False"
        and scheduled.get("reason") == "Unschedulable"
    )


def copy_landed(copy: Mapping[str, Any]) -> bool:
    """A live copy its lower scheduler has placed on a node (or a node admitted, or that
    ran to its end): taken, and more than waiting below for room."""
    status = copy.get("status") or {}
    scheduled = condition(status.get("conditions") or [], "PodScheduled") or {}
    return copy_alive(copy) and (
        status.get("phase") in ("Running", "Succeeded")
        or bool(status.get("hostIP"))
        or scheduled.get("status") == "True"
    )


def runs(pod: Mapping[str, Any]) -> bool:
    """A pod running where it is bound, not being deleted."""
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")


def copy_refused(copy: Mapping[str, Any]) -> bool:
    """A copy its virtual node failed before making it below, for a reason of its own
    (``keys.REFUSED_BEFORE_MADE``: outside its namespace's quota slices, a volume it will
    not make, the lower apiserver's 400), that no node admitted nor lower scheduler
    placed. Its original is the pod. A copy failed as lost after a node below took it
    (``LowerPodDeleted``, its hostIP maybe never reported) may have run, and is not one."""
    status = copy.get("status") or {}
    scheduled = condition(status.get("conditions") or [], "PodScheduled") or {}
    return (
        status.get("phase") == "Failed"
        and status.get("reason") in keys.REFUSED_BEFORE_MADE
        and not copy["metadata"].get("deletionTimestamp")
        and not status.get("hostIP")
        and scheduled.get("status") != "True"
    )


def unfinished_moves(pods: Iterable[Mapping[str, Any]]) -> list[tuple[JSON, JSON]]:
    """(original, copy) of the bare pods whose copy its cluster has taken, but which were
    not deleted after it (the copy taken after the original stopped being stuck, the
    delete failed, or the process stopped between the two): the move was decided, and
    left so, both would run for ever once the original is no longer stuck (its cluster
    back, say). In key order of the originals."""
    listed = list(pods)
    by_uid = {str(pod["metadata"].get("uid")): pod for pod in listed}
    found = []
    for copy in listed:
        uid = (copy["metadata"].get("annotations") or {}).get(keys.COPY_OF_ANNOTATION)
        original = by_uid.get(str(uid)) if uid else None
        if (
            original is not None
            and not original["metadata"].get("deletionTimestamp")
            and copy["metadata"].get("namespace") == original["metadata"].get("namespace")
            and copy["metadata"].get("name") == copy_name(original)
            and copy_taken(copy)
        ):
            found.append((dict(original), dict(copy)))
    return sorted(found, key=lambda pair: object_key(pair[0]))
