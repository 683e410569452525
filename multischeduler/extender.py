"""The extender's decisions, without I/O: the scheduler's requests read and checked,
filter answers and scores from the estimators' answers, what is remembered between the
scheduler's calls for one pod, and the metrics.

Wire format: kube-scheduler's `extender/v1` structs have no json tags, so every key is a
Go field name (`Pod`, `NodeNames`, `FailedAndUnresolvableNodes`, `Host`, ...).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest

from kubekit import keys, metrics
from kubekit.client import JSON
from kubekit.estimatorapi import RESERVATION_SECONDS
from kubekit.estimatorapi.estimator_pb2 import PodEstimate
from kubekit.slices import no_slices_here

# kube-scheduler's MaxExtenderPriority.
MAX_SCORE = 10


class BadRequest(ValueError):
    """A request the scheduler should never send: answered with HTTP 400."""


class OnEstimatorError(enum.StrEnum):
    FAIL = "fail"
    IGNORE = "ignore"


class Score(enum.StrEnum):
    BEST_FIT = "best-fit"
    LEAST_ALLOCATED = "least-allocated"


@dataclass(frozen=True)
class ExtenderArgs:
    """A filter or prioritize request (nodeCacheCapable: names, not Node objects)."""

    pod: JSON
    uid: str
    node_names: list[str]

    @property
    def pod_key(self) -> str:
        metadata = self.pod["metadata"]
        return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


@dataclass(frozen=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


@dataclass(frozen=True)
class EstimatorFailure:
    """An estimator that could not answer: unreachable, refused us, or too slow.
    ``maybe_reserved``: the request may have reached it, so it may hold room for the pod."""

    message: str
    maybe_reserved: bool = False


Answer = PodEstimate | EstimatorFailure


@dataclass(frozen=True)
class VirtualNode:
    name: str
    cluster_id: str
    # host:port of the lower cluster's fit estimator; None when the Node does not say.
    address: str | None
    # When that estimator started: a restarted one is connected to afresh.
    started: str = ""
    # Labelled as only a virtual node's own identity can (not a kubelet): its estimator
    # may be sent the caller's token.
    proven: bool = True


def virtual_node(node: Mapping[str, Any]) -> VirtualNode | None:
    """The virtual node a Node object stands for, or None for an ordinary Node."""
    metadata = node.get("metadata") or {}
    labels = metadata.get("labels") or {}
    # Our own label, not virtual-kubelet's `type`: another provider's virtual Node (ACI)
    # has no estimator, and every pod meant for it would be refused.
    if labels.get(keys.VIRTUAL_NODE_LABEL) != keys.VIRTUAL_NODE_LABEL_VALUE:
        return None
    annotations = metadata.get("annotations") or {}
    address = annotations.get(keys.ESTIMATOR_ADDRESS_ANNOTATION)
    return VirtualNode(
        name=str(metadata["name"]),
        cluster_id=str(labels.get(keys.CLUSTER_ID_LABEL, "")),
        address=str(address) if address else None,
        started=str(annotations.get(keys.ESTIMATOR_STARTED_ANNOTATION, "")),
        proven=labels.get(keys.PROVEN_VIRTUAL_NODE_LABEL) == keys.VIRTUAL_NODE_LABEL_VALUE,
    )


# -- requests ----------------------------------------------------------------------------


def _object(body: bytes, what: str) -> JSON:
    try:
        decoded = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise BadRequest(f"the body is not JSON: {error}") from None
    if not isinstance(decoded, dict):
        raise BadRequest(f"the body must be a JSON object ({what}), not {type(decoded).__name__}")
    return decoded


def _string(container: Mapping[str, Any], key: str, where: str) -> str:
    value = container.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where}{key} must be a non-empty string, not {value!r}")
    return value


def parse_extender_args(body: bytes) -> ExtenderArgs:
    args = _object(body, "ExtenderArgs")
    pod = args.get("Pod")
    if not isinstance(pod, dict):
        raise BadRequest(f"Pod must be a Pod object, not {pod!r}")
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict):
        raise BadRequest("Pod.metadata must be an object")
    uid = _string(metadata, "uid", "Pod.metadata.")
    names = args.get("NodeNames")
    if names is None:
        raise BadRequest(
            "NodeNames is missing: configure this extender with nodeCacheCapable: true"
        )
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadRequest("NodeNames must be a list of strings")
    return ExtenderArgs(pod=pod, uid=uid, node_names=names)


def parse_binding_args(body: bytes) -> BindingArgs:
    args = _object(body, "ExtenderBindingArgs")
    return BindingArgs(
        pod_name=_string(args, "PodName", ""),
        pod_namespace=_string(args, "PodNamespace", ""),
        pod_uid=_string(args, "PodUID", ""),
        node=_string(args, "Node", ""),
    )


def binding_body(args: BindingArgs) -> JSON:
    """The Binding the binder must create itself (the scheduler leaves binding to us)."""
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": args.pod_name, "namespace": args.pod_namespace, "uid": args.pod_uid},
        "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
    }


# -- answers -----------------------------------------------------------------------------


def fits(answer: Answer | None) -> bool:
    return isinstance(answer, PodEstimate) and not answer.error and answer.max_replicas > 0


def rejection(node: str, answer: Answer, on_error: OnEstimatorError) -> str | None:
    """Why ``node`` fails the pod, or None when it passes."""
    if isinstance(answer, EstimatorFailure):
        if on_error is OnEstimatorError.IGNORE:
            return None
        return f"{node}: estimator unavailable: {answer.message}"
    if answer.error:
        return f"{node}: estimator cannot read the pod: {answer.error}"
    if answer.max_replicas == 0:
        return f"{node}: {answer.message or 'the pod fits no node of the cluster'}"
    return None


def outside_slices(
    node: VirtualNode, namespace: str, slices: Mapping[str, int]
) -> PodEstimate | None:
    """The rejection of a virtual node whose cluster holds none of the quota slices of
    the pod's namespace (``slices``: {cluster-id: slices}), or None."""
    why = no_slices_here(namespace, node.cluster_id, slices)
    if why is None:
        return None
    if not any(slices.values()):
        why += f": see its {keys.SLICES_PLACED_CONDITION} condition"
    return PodEstimate(message=why)


def filter_result(
    node_names: Sequence[str],
    answers: Mapping[str, Answer],
    on_error: OnEstimatorError,
    chosen: str | None,
) -> JSON:
    """The ExtenderFilterResult: nodes without an answer (ordinary ones) pass untouched.
    Of the clusters that fit, only ``chosen`` passes: the scheduler, left one feasible
    node, binds it without scoring (no prioritize call), and cannot break a tie towards a
    cluster holding no room for the pod. Every rejection is unresolvable: preempting upper
    pods on a virtual node frees no room on the lower node the pod would need, and an
    estimator that could not answer is no better a reason to evict anything."""
    passing: list[str] = []
    unresolvable: dict[str, str] = {}
    for name in node_names:
        answer = answers.get(name)
        reason = None if answer is None else rejection(name, answer, on_error)
        if reason is None and name != chosen and fits(answer):
            reason = f"{name}: the pod fits, but {chosen} ranks first"
        if reason is None:
            passing.append(name)
        else:
            unresolvable[name] = reason
    return {
        "NodeNames": passing,
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": unresolvable,
        "Error": "",
    }


def reserved_nodes(answers: Mapping[str, Answer]) -> set[str]:
    """The nodes whose estimators hold (or may hold) room for the pod."""
    return {
        name
        for name, answer in answers.items()
        if (isinstance(answer, PodEstimate) and answer.reserved_node)
        or (isinstance(answer, EstimatorFailure) and answer.maybe_reserved)
    }


def scores(
    node_names: Sequence[str],
    estimates: Mapping[str, PodEstimate],
    score: Score,
    ordinary: Collection[str] = (),
) -> list[JSON]:
    """The HostPriorityList: the fit score of each virtual node, averaged with its
    preferred node-affinity weight (normalised so the best candidate has 1) when the pod
    prefers anything, 0 without a fitting estimate. ``ordinary`` nodes get the best score
    given: the extender ranks them neither above nor below the cluster it would choose
    (its weight would otherwise outweigh every score of the scheduler's own), so between
    them the scheduler's own scores decide."""
    fitting = {n: estimates[n] for n in node_names if fits(estimates.get(n))}
    top_preferred = max((e.preferred for e in fitting.values()), default=0)

    def of(name: str) -> int:
        estimate = fitting.get(name)
        if estimate is None:
            return 0
        fit = estimate.best_fit if score is Score.BEST_FIT else estimate.least_allocated
        value = min(max(fit, 0.0), 1.0)
        if top_preferred > 0:
            value = (value + max(estimate.preferred, 0) / top_preferred) / 2
        # Half up rather than Python's half to even: 0.25 is 3, like 0.35 is 4.
        return int(MAX_SCORE * value + 0.5)

    virtual = {name: of(name) for name in node_names if name not in ordinary}
    best = max(virtual.values(), default=0)
    return [{"Host": name, "Score": virtual.get(name, best)} for name in node_names]


def chosen_cluster(answers: Mapping[str, Answer], score: Score) -> str | None:
    """The fitting virtual node prioritize would rank first (highest score, then name),
    or None when no cluster fits."""
    estimates = {n: a for n, a in answers.items() if isinstance(a, PodEstimate)}
    ranked = [r for r in scores(sorted(estimates), estimates, score) if fits(estimates[r["Host"]])]
    return min(ranked, key=lambda r: (-r["Score"], r["Host"]))["Host"] if ranked else None


# -- memory between the scheduler's calls ------------------------------------------------


@dataclass
class _Decision:
    at: float
    estimates: dict[str, PodEstimate]
    reserved: dict[str, float]  # node -> when its estimator reserved room
    pod: bytes  # as the estimators were asked about it


def room_to_give_back(reserved: Collection[str], uid: str, now: JSON | None) -> set[str]:
    """Of the virtual nodes holding room for a pod that stopped waiting for a node, those
    that must give it back, judged on the pod as read since (``now``; None: not found):
    every one when the pod is gone (or another pod has its name now), every one but its
    own when it was bound. A read that still shows it waiting lags behind the watch that
    said otherwise: nothing is given back, and the room lapses on its own."""
    if now is None or (now.get("metadata") or {}).get("uid") != uid:
        return set(reserved)
    node = (now.get("spec") or {}).get("nodeName")
    return set(reserved) - {node} if node else set()


class Decisions:
    """What each pod's filter learnt, by pod UID: the estimates prioritize scores right
    after, and the nodes holding room that bind, or the pod leaving the scheduler's queue,
    must release. A reservation is taken for lapsed after ``reservations_for`` seconds,
    a little before its estimator gives the room back on its own: a bind later than that
    (a volume bound first) holds room again rather than bind the pod without. Forgotten
    when bound or gone, or after ``kept_for`` seconds, so a pod never bound costs nothing
    for long. The pods that left the queue are kept for ``left_for`` seconds: the scheduler
    may still be filtering one (its cycle goes on with the pod it took from the queue),
    and what that filter reserves must go back at once, not lapse unannounced."""

    def __init__(
        self,
        *,
        scores_for: float = 5.0,
        reservations_for: float = RESERVATION_SECONDS - 5,
        kept_for: float = 60.0,
        left_for: float = 30.0,
    ) -> None:
        self.scores_for = scores_for
        self.reservations_for = reservations_for
        self.kept_for = kept_for
        self.left_for = left_for
        self._by_uid: OrderedDict[str, _Decision] = OrderedDict()
        self._left: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_uid)

    def remember(
        self,
        uid: str,
        answers: Mapping[str, Answer],
        now: float,
        released: Collection[str] = (),
        pod: bytes = b"",
    ) -> set[str]:
        """Remembers what the filter learnt; returns the nodes holding room to give back
        now, those it reserved for a pod that has left the queue meanwhile."""
        estimates = {n: a for n, a in answers.items() if isinstance(a, PodEstimate)}
        reserved = dict.fromkeys(reserved_nodes(answers) - set(released), now)
        self._expire(now)
        if uid in self._left:
            return set(reserved)
        earlier = self._by_uid.pop(uid, None)
        if earlier is not None:
            # A second filter of the same pod (a nominated node first, then all) adds to
            # what the first one reserved, less what this filter gave back: kept, bind
            # would take the pod for held there and bind it without room.
            estimates = {**earlier.estimates, **estimates}
            kept = {n: at for n, at in earlier.reserved.items() if n not in released}
            reserved = kept | reserved
        self._by_uid[uid] = _Decision(now, estimates, reserved, pod)
        return set()

    def pod(self, uid: str) -> bytes:
        """The pod as filter asked about it last (b"" once forgotten)."""
        decision = self._by_uid.get(uid)
        return b"" if decision is None else decision.pod

    def estimates(self, uid: str, now: float) -> dict[str, PodEstimate]:
        decision = self._by_uid.get(uid)
        if decision is None or now - decision.at > self.scores_for:
            return {}
        return dict(decision.estimates)

    def take_reserved(self, uid: str, now: float) -> set[str]:
        """The nodes holding room for the pod, their reservation not lapsed, forgetting
        the pod."""
        self._expire(now)
        decision = self._by_uid.pop(uid, None)
        if decision is None:
            return set()
        return {n for n, at in decision.reserved.items() if now - at <= self.reservations_for}

    def left_queue(self, uid: str, now: float) -> set[str]:
        """The pod left the scheduler's queue (bound or deleted): the nodes holding room
        for it, forgetting the pod; a filter of it remembered later gives its room back."""
        reserved = self.take_reserved(uid, now)
        self._left.pop(uid, None)
        self._left[uid] = now
        return reserved

    def _expire(self, now: float) -> None:
        while self._by_uid:
            uid, oldest = next(iter(self._by_uid.items()))
            if now - oldest.at <= self.kept_for:
                break
            del self._by_uid[uid]
        while self._left:
            uid, at = next(iter(self._left.items()))
            if now - at <= self.left_for:
                break
            del self._left[uid]


# -- metrics -----------------------------------------------------------------------------

# Finer around 5 ms than the common buckets: a decision is judged against 5 ms, and its
# quantiles are read off these.
FILTER_BUCKETS = tuple(sorted({*metrics.LATENCY_BUCKETS, 0.002, 0.003, 0.004, 0.0075}))


VERBS = ("filter", "prioritize", "bind")


class Metrics:
    """One extender's metrics, in a registry of its own (a process or a test may hold
    several extenders); served with the process-wide ones (kubekit.metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.filter_seconds = Histogram(
            "kubestrata_extender_filter_seconds",
            "Time to answer one filter request.",
            buckets=FILTER_BUCKETS,
            registry=self.registry,
        )
        # A bind waits for the apiserver: slow ones keep the scheduler's binding cycles,
        # and a connection to the extender each, open.
        self.bind_seconds = Histogram(
            "kubestrata_extender_bind_seconds",
            "Time to answer one bind request.",
            buckets=metrics.LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "kubestrata_extender_decisions",
            "Requests answered, by verb.",
            ["verb"],
            registry=self.registry,
        )
        for verb in VERBS:
            self.decisions.labels(verb)
        self.estimator_errors = Counter(
            "kubestrata_extender_estimator_errors",
            "Estimator calls that failed or missed the deadline.",
            registry=self.registry,
        )
        self.bind_errors = Counter(
            "kubestrata_extender_bind_errors",
            "Bindings the apiserver refused.",
            registry=self.registry,
        )
        self.room_given_back = Counter(
            "kubestrata_extender_room_given_back",
            "Virtual nodes told to give back the room filter kept for a pod that was then "
            "bound elsewhere or deleted.",
            registry=self.registry,
        )

    def prometheus_text(self) -> str:
        return (generate_latest(self.registry) + generate_latest(REGISTRY)).decode()
