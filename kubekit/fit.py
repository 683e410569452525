"""Would a pod fit on one node of a lower cluster: the Filter plugins of a stock
kube-scheduler v1.35, as pure functions.

A pod is compiled once per query (``PodFacts.of``) and a node once per change
(``NodeFacts.of``), so checking one against the other compares precomputed values:
quantities are integers in milli-units (rounded up), selectors are tuples of
``Requirement``. ``failures`` gives the reasons a pod does not fit a node, in the
scheduler's words; like the scheduler, it reports only the first plugin that rejects
the node, in the default plugin order: NodeUnschedulable, NodeName, TaintToleration,
NodeAffinity, NodePorts, NodeResourcesFit, PodTopologySpread, InterPodAffinity.
NodeResourcesFit is ``rank``, one pass over many nodes' ``Headroom`` that also gives
each fitting node's best fit: the per-node loop of a query over a whole cluster.

Modelled beyond the plugins: a node whose Ready condition is not True rejects pods that
do not tolerate the taint the node lifecycle controller gives it, as part of
TaintToleration: ``node.kubernetes.io/not-ready:NoSchedule`` for Ready False,
``node.kubernetes.io/unreachable:NoSchedule`` for Unknown or no Ready condition.

Not modelled: volumes (VolumeRestrictions, NodeVolumeLimits, VolumeBinding, VolumeZone),
dynamic resource allocation, NodeDeclaredFeatures, the lower
cluster's LimitRange defaults (admission's, not a filter's), the scheduler's ignored extended
resources, the comparison operators of tolerations (alpha, off by default), and the
NodeAffinity PreFilter's narrowing to the nodes named by ``matchFields`` (the scheduler
reports the other nodes as "didn't satisfy plugin(s) [NodeAffinity]", here they get the
Filter's reason). A non-empty ``namespaceSelector`` of a pod affinity term selects no
namespace: namespaces' labels are not known here (its ``namespaces`` list still counts).
Selectors are checked for structure (operators, value counts, integers), not for the
syntax of keys and values, which the apiserver validates.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple

import orjson

from kubekit.quantity import parse_quantity

Resources = dict[str, Fraction]
JSON = Mapping[str, Any]
# (hostIP, protocol, hostPort), defaulted as the scheduler does.
HostPort = tuple[str, str, int]
# (topology key, topology value)
Domain = tuple[str, str]

UNSCHEDULABLE = "node(s) were unschedulable"
NOT_READY = "node(s) were not ready"
UNREACHABLE = "node(s) were unreachable"
NODE_NAME = "node(s) didn't match the requested node name"
# v1.35 no longer names the taint: taint keys and values are not for every pod's owner
# to read in its status (kubernetes#134740).
UNTOLERATED_TAINT = "node(s) had untolerated taint(s)"
NODE_AFFINITY = "node(s) didn't match Pod's node affinity/selector"
NODE_PORTS = "node(s) didn't have free ports for the requested pod ports"
TOO_MANY_PODS = "Too many pods"
SPREAD = "node(s) didn't match pod topology spread constraints"
SPREAD_LABEL = f"{SPREAD} (missing required label)"
POD_AFFINITY = "node(s) didn't match pod affinity rules"
POD_ANTI_AFFINITY = "node(s) didn't match pod anti-affinity rules"
EXISTING_ANTI_AFFINITY = "node(s) didn't satisfy existing pods anti-affinity rules"

UNSCHEDULABLE_TAINT_KEY = "node.kubernetes.io/unschedulable"
NOT_READY_TAINT_KEY = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT_KEY = "node.kubernetes.io/unreachable"
NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"
BIND_ALL = "0.0.0.0"

IN, NOT_IN, EXISTS, DOES_NOT_EXIST, GT, LT = "In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"
LABEL_OPERATORS = frozenset({IN, NOT_IN, EXISTS, DOES_NOT_EXIST})
NODE_OPERATORS = LABEL_OPERATORS | {GT, LT}
NAME_FIELD = "metadata.name"

_CORE = ("pods", "cpu", "memory", "ephemeral-storage")
_INT64 = re.compile(r"[+-]?[0-9]+")
_MAX_INT32 = 2**31 - 1


# -- what a pod takes --------------------------------------------------------------------


def add(total: Resources, extra: Mapping[str, Fraction]) -> None:
    for name, value in extra.items():
        total[name] = total.get(name, Fraction(0)) + value


def _parsed(declared: Mapping[str, Any]) -> Resources:
    result: Resources = {}
    for name, value in declared.items():
        try:
            result[name] = parse_quantity(value)
        except (ValueError, TypeError, AttributeError, OverflowError):
            continue  # the apiserver validated it; an unknown form is not ours to judge
    return result


def _requests(container: JSON) -> Resources:
    resources = container.get("resources") or {}
    # The apiserver defaults each request left out to its limit, resource by resource.
    return _parsed({**(resources.get("limits") or {}), **(resources.get("requests") or {})})


def _limits(container: JSON) -> Resources:
    return _parsed((container.get("resources") or {}).get("limits") or {})


def _pod_total(pod: JSON, of_container: Callable[[JSON], Resources]) -> Resources:
    """The larger of the app containers' sum (restartable init containers, i.e. sidecars,
    included) and each init container's peak."""
    spec = pod.get("spec") or {}
    total: Resources = {}
    for container in spec.get("containers") or []:
        add(total, of_container(container))
    sidecars: Resources = {}
    init_peak: Resources = {}
    for container in spec.get("initContainers") or []:
        resources = of_container(container)
        if container.get("restartPolicy") == "Always":
            add(sidecars, resources)
            continue
        # A plain init container runs beside the sidecars started before it.
        for name, value in resources.items():
            init_peak[name] = max(
                init_peak.get(name, Fraction(0)), value + sidecars.get(name, Fraction(0))
            )
    add(total, sidecars)
    for name, value in init_peak.items():
        total[name] = max(total.get(name, Fraction(0)), value)
    return total


def _overhead(pod: JSON) -> Resources:
    return _parsed((pod.get("spec") or {}).get("overhead") or {})


def _is_pod_level(name: str) -> bool:
    return name in ("cpu", "memory") or name.startswith("hugepages-")


def _pod_level(pod: JSON, kind: str, containers: Resources) -> Resources:
    """The pod-level ``spec.resources`` of ``kind`` that stand for the containers' total.
    A pod-level request left out is defaulted as the apiserver does: to the containers'
    requests when one of them asks for that resource, else to the pod-level limit."""
    declared = (pod.get("spec") or {}).get("resources") or {}
    values = _parsed(declared.get(kind) or {})
    if kind == "requests":
        for name, limit in _parsed(declared.get("limits") or {}).items():
            if name not in values and name not in containers:
                values[name] = limit
    return {name: value for name, value in values.items() if _is_pod_level(name)}


def _container_statuses(pod: JSON) -> dict[Any, Mapping[str, Any]]:
    status = pod.get("status") or {}
    return {
        found.get("name"): found
        for group in ("containerStatuses", "initContainerStatuses")
        for found in status.get(group) or []
        if isinstance(found, Mapping)
    }


def resize_infeasible(pod: JSON) -> bool:
    """The kubelet found no way to make the pod's last in-place resize."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "PodResizePending":
            return bool(condition.get("reason") == "Infeasible")
    return False


def _larger(*totals: Resources) -> Resources:
    found: Resources = {}
    for total in totals:
        for name, value in total.items():
            found[name] = max(found.get(name, value), value)
    return found


def _requests_in_place(pod: JSON) -> Resources:
    """The containers' requests as the scheduler counts a pod a kubelet runs, with
    in-place resize: the larger, resource by resource, of the spec's, what the kubelet
    allocated and what the containers have (their statuses); without the spec's while
    the kubelet finds a resize infeasible, which it will not make. A pod being resized
    down keeps its old room until it is resized; one whose resize up is infeasible
    holds only what it has."""
    statuses = _container_statuses(pod)
    if not any(
        isinstance(found.get("allocatedResources"), Mapping)
        or isinstance(found.get("resources"), Mapping)
        for found in statuses.values()
    ):
        return _pod_total(pod, _requests)
    infeasible = resize_infeasible(pod)
    spec_or_none = (lambda _container: {}) if infeasible else _requests

    def allocated(container: JSON) -> Resources:
        held = statuses.get(container.get("name"), {}).get("allocatedResources")
        return _parsed(held) if isinstance(held, Mapping) else spec_or_none(container)

    def actual(container: JSON) -> Resources:
        resources = statuses.get(container.get("name"), {}).get("resources")
        requests = resources.get("requests") if isinstance(resources, Mapping) else None
        return _parsed(requests) if isinstance(requests, Mapping) else allocated(container)

    totals = [_pod_total(pod, allocated), _pod_total(pod, actual)]
    if not infeasible:
        totals.append(_pod_total(pod, _requests))
    return _larger(*totals)


def pod_requests(pod: JSON) -> Resources:
    """What the scheduler reserves for a pod: ``_requests_in_place`` of its containers,
    or its pod-level requests (cpu, memory, hugepages) where it has them, plus the pod
    overhead; ``pods`` counts one."""
    total = _requests_in_place(pod)
    total.update(_pod_level(pod, "requests", total))
    add(total, _overhead(pod))
    total["pods"] = Fraction(1)
    return total


def pod_limits(pod: JSON) -> Resources:
    """A pod's limits as a ResourceQuota counts them: ``_pod_total`` of the limits, or its
    pod-level limits where it has them, the overhead added to those it has (a resource
    without a limit stays without)."""
    total = _pod_total(pod, _limits)
    total.update(_pod_level(pod, "limits", total))
    for name, value in _overhead(pod).items():
        if name in total:
            total[name] += value
    return total


_DECLARED = ("requests", "limits")


def negative_quantity(pod: JSON) -> str | None:
    """The first resource quantity of the pod below zero, named; None when there is none.
    The apiserver refuses them; a pod sent to the estimator may have them, and each would
    count as room given back."""
    spec = pod.get("spec") or {}
    declared: list[tuple[str, Any]] = [
        ("overhead", spec.get("overhead")),
        *((f"pod {kind}", (spec.get("resources") or {}).get(kind)) for kind in _DECLARED),
    ]
    for group in ("initContainers", "containers"):
        for container in spec.get(group) or []:
            resources = container.get("resources") or {}
            declared += [
                (f"container {container.get('name')} {kind}", resources.get(kind))
                for kind in _DECLARED
            ]
    for where, values in declared:
        for name, value in _parsed(values or {}).items():
            if value < 0:
                return f"{where}: {name} {values[name]} is below zero"
    return None


def pod_holds_resources(pod: JSON) -> bool:
    """Bound and not finished: the scheduler counts it against its node."""
    phase = (pod.get("status") or {}).get("phase")
    return bool((pod.get("spec") or {}).get("nodeName")) and phase not in {"Succeeded", "Failed"}


def counted_node(pod: JSON) -> str | None:
    """The node the scheduler counts a pod on: its own once bound and until it finishes,
    or, while it waits to be bound, the one it was nominated to after preempting pods
    there (the scheduler counts nominated pods of a priority at least the incoming pod's:
    here every one, preemption not being modelled)."""
    if pod_holds_resources(pod):
        return str(pod["spec"]["nodeName"])
    status = pod.get("status") or {}
    if status.get("phase") in {"Succeeded", "Failed"} or (pod.get("metadata") or {}).get(
        "deletionTimestamp"
    ):
        return None
    nominated = status.get("nominatedNodeName")
    return nominated if isinstance(nominated, str) and nominated else None


def node_is_ready(node: JSON) -> bool:
    return readiness_taint_key(node) is None


def readiness_taint_key(node: JSON) -> str | None:
    """The taint the node lifecycle controller gives a node that is not Ready: not-ready
    for Ready False, unreachable for Unknown or no Ready condition at all. None for a
    Ready node."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c.get("status") for c in conditions if c.get("type") == "Ready"), None)
    if ready == "True":
        return None
    return NOT_READY_TAINT_KEY if ready == "False" else UNREACHABLE_TAINT_KEY


def milli(resources: Mapping[str, Fraction]) -> dict[str, int]:
    return {name: math.ceil(value * 1000) for name, value in resources.items()}


def _is_scalar(resource: str) -> bool:
    # What the scheduler compares beyond the core resources: extended, hugepages,
    # attachable volumes and kubernetes.io-prefixed ones; other unprefixed names never.
    return "/" in resource or resource.startswith(("hugepages-", "attachable-volumes-"))


def _extended(requests: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(
        sorted(
            (name, value)
            for name, value in requests.items()
            if value > 0 and name not in _CORE and _is_scalar(name)
        )
    )


def insufficient(resource: str) -> str:
    return TOO_MANY_PODS if resource == "pods" else f"Insufficient {resource}"


# -- selectors ---------------------------------------------------------------------------


def _int64(text: str) -> int | None:
    """Go's strconv.ParseInt(text, 10, 64)."""
    if not _INT64.fullmatch(text):
        return None
    number = int(text)
    return number if -(2**63) <= number < 2**63 else None


@dataclass(frozen=True, slots=True)
class Requirement:
    """One requirement of a label selector or node selector term, already validated."""

    key: str
    operator: str
    values: frozenset[str] = frozenset()
    bound: int = 0

    def accepts(self, value: str | None) -> bool:
        """Whether a label value (None: the label is absent) satisfies it."""
        if self.operator == IN:
            return value in self.values
        if self.operator == NOT_IN:
            return value not in self.values
        if self.operator == EXISTS:
            return value is not None
        if self.operator == DOES_NOT_EXIST:
            return value is None
        number = None if value is None else _int64(value)
        if number is None:
            return False
        return number > self.bound if self.operator == GT else number < self.bound


# None selects nothing (a nil selector, or one that does not parse); () selects everything.
Selector = tuple[Requirement, ...] | None


def requirement(expression: Any, operators: Collection[str]) -> Requirement | None:
    """A requirement from its JSON form, or None when the apiserver's parser would reject
    it (unknown operator, wrong number of values, Gt/Lt value not an integer)."""
    if not isinstance(expression, Mapping):
        return None
    key, operator = expression.get("key"), expression.get("operator")
    values = expression.get("values") or []
    if (
        not (isinstance(key, str) and key and isinstance(operator, str))
        or operator not in operators
    ):
        return None
    if not isinstance(values, list) or not all(isinstance(value, str) for value in values):
        return None
    if operator in (IN, NOT_IN):
        return Requirement(key, operator, frozenset(values)) if values else None
    if operator in (EXISTS, DOES_NOT_EXIST):
        return None if values else Requirement(key, operator)
    bound = _int64(values[0]) if len(values) == 1 else None
    return None if bound is None else Requirement(key, operator, bound=bound)


def label_selector(selector: Any) -> Selector:
    """metav1.LabelSelectorAsSelector: nil selects nothing, {} everything."""
    if not isinstance(selector, Mapping):
        return None
    required: list[Requirement] = []
    for key, value in _mapping(selector.get("matchLabels")).items():
        if not isinstance(value, str):
            return None
        required.append(Requirement(key, IN, frozenset({value})))
    for expression in _list(selector.get("matchExpressions")):
        parsed = requirement(expression, LABEL_OPERATORS)
        if parsed is None:
            return None
        required.append(parsed)
    return tuple(required)


def selector_matches(selector: Selector, labels: Mapping[str, str]) -> bool:
    return selector is not None and all(r.accepts(labels.get(r.key)) for r in selector)


def with_label_keys(
    selector: Selector, match: Iterable[str], mismatch: Iterable[str], labels: Mapping[str, str]
) -> Selector:
    """The apiserver's merge of ``matchLabelKeys`` (key In [own value]) and
    ``mismatchLabelKeys`` (key NotIn [own value]) at pod creation."""
    if selector is None:
        return None
    merged = [
        Requirement(key, operator, frozenset({labels[key]}))
        for operator, keys in ((IN, match), (NOT_IN, mismatch))
        for key in keys
        if key in labels
    ]
    return (*selector, *merged)


# -- nodes -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str
    effect: str


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str
    operator: str
    value: str
    effect: str


def tolerates(tolerations: Iterable[Toleration], taint: Taint) -> bool:
    """v1.Toleration.ToleratesTaint for any of them."""
    for toleration in tolerations:
        if toleration.effect and toleration.effect != taint.effect:
            continue
        if toleration.key and toleration.key != taint.key:
            continue
        if toleration.operator == "Exists" or (
            toleration.operator in ("", "Equal") and toleration.value == taint.value
        ):
            return True
    return False


def untolerated(tolerations: Sequence[Toleration], taints: Iterable[Taint]) -> bool:
    return any(not tolerates(tolerations, taint) for taint in taints)


@dataclass(frozen=True, slots=True)
class Barriers:
    """What keeps pods off a node whatever its labels: cordon, readiness (the key of the
    taint a node not Ready gets, which may lag behind its condition) and the taints that
    filter (NoSchedule, NoExecute; PreferNoSchedule only scores). Nodes with equal
    barriers are judged once per query."""

    unschedulable: bool
    readiness_taint: str | None
    taints: tuple[Taint, ...]

    @property
    def ready(self) -> bool:
        return self.readiness_taint is None


@dataclass(frozen=True, slots=True)
class NodeFacts:
    name: str
    labels: Mapping[str, str]
    barriers: Barriers
    allocatable: Mapping[str, int]

    @classmethod
    def of(cls, node: JSON) -> NodeFacts:
        metadata, spec = _mapping(node.get("metadata")), _mapping(node.get("spec"))
        status = _mapping(node.get("status"))
        taints = tuple(
            Taint(_text(t.get("key")), _text(t.get("value")), _text(t.get("effect")))
            for t in map(_mapping, _list(spec.get("taints")))
            if t.get("effect") in (NO_SCHEDULE, NO_EXECUTE)
        )
        return cls(
            name=_text(metadata.get("name")),
            labels=_labels(metadata.get("labels")),
            barriers=Barriers(bool(spec.get("unschedulable")), readiness_taint_key(node), taints),
            allocatable=milli(_parsed(_mapping(status.get("allocatable")))),
        )


# -- pods --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeTerm:
    """One nodeSelectorTerm: its label requirements and its requirements on the node's
    name (``matchFields``), ANDed."""

    labels: tuple[Requirement, ...]
    names: tuple[Requirement, ...]


def node_term_matches(term: NodeTerm, labels: Mapping[str, str], name: str) -> bool:
    return all(r.accepts(labels.get(r.key)) for r in term.labels) and all(
        r.accepts(name) for r in term.names
    )


def _name_requirement(field: Any) -> Requirement | None:
    # matchFields know only the node's name, compared with exactly one value.
    if len(_list(_mapping(field).get("values"))) != 1:
        return None
    parsed = requirement(field, (IN, NOT_IN))
    return parsed if parsed is not None and parsed.key == NAME_FIELD else None


def _node_term(term: Any) -> NodeTerm | None:
    """None for a term that selects no node: empty, or one the parser rejects."""
    term = _mapping(term)
    labels = [requirement(e, NODE_OPERATORS) for e in _list(term.get("matchExpressions"))]
    names = [_name_requirement(f) for f in _list(term.get("matchFields"))]
    valid_labels = tuple(r for r in labels if r is not None)
    valid_names = tuple(r for r in names if r is not None)
    if len(valid_labels) < len(labels) or len(valid_names) < len(names):
        return None
    return NodeTerm(valid_labels, valid_names) if labels or names else None


class Kind(NamedTuple):
    """What other pods' terms and spread constraints see of a pod. Pods of one kind are
    counted together, so a selector is judged once per kind rather than once per pod."""

    namespace: str
    labels: frozenset[tuple[str, str]]
    deleting: bool


@dataclass(frozen=True, slots=True)
class PodTerm:
    """A required pod (anti-)affinity term. ``namespaces`` None means every namespace."""

    selector: Selector
    namespaces: frozenset[str] | None
    topology_key: str


def term_matches(term: PodTerm, kind: Kind) -> bool:
    in_namespace = term.namespaces is None or kind.namespace in term.namespaces
    return in_namespace and selector_matches(term.selector, dict(kind.labels))


def _namespaces(term: JSON, own: str) -> frozenset[str] | None:
    listed = frozenset(n for n in _list(term.get("namespaces")) if isinstance(n, str))
    selector = term.get("namespaceSelector")
    if selector is None:
        return listed or frozenset({own})
    if label_selector(selector) == ():
        return None
    return listed


def _pod_terms(terms: Any, namespace: str, labels: Mapping[str, str]) -> tuple[PodTerm, ...]:
    compiled = []
    for term in map(_mapping, _list(terms)):
        selector = with_label_keys(
            label_selector(term.get("labelSelector")),
            _strings(term.get("matchLabelKeys")),
            _strings(term.get("mismatchLabelKeys")),
            labels,
        )
        compiled.append(
            PodTerm(selector, _namespaces(term, namespace), _text(term.get("topologyKey")))
        )
    return tuple(compiled)


@dataclass(frozen=True, slots=True)
class Spread:
    """A topology spread constraint with whenUnsatisfiable: DoNotSchedule."""

    max_skew: int
    topology_key: str
    selector: Selector
    min_domains: int
    honor_affinity: bool
    honor_taints: bool
    self_match: int


def _spread(constraints: Any, labels: Mapping[str, str]) -> tuple[Spread, ...]:
    compiled = []
    for c in map(_mapping, _list(constraints)):
        if c.get("whenUnsatisfiable") != "DoNotSchedule":
            continue
        selector = with_label_keys(
            label_selector(c.get("labelSelector")), _strings(c.get("matchLabelKeys")), (), labels
        )
        compiled.append(
            Spread(
                max_skew=_integer(c.get("maxSkew"), 1),
                topology_key=_text(c.get("topologyKey")),
                selector=selector,
                min_domains=_integer(c.get("minDomains"), 1),
                honor_affinity=c.get("nodeAffinityPolicy") in (None, "Honor"),
                honor_taints=c.get("nodeTaintsPolicy") == "Honor",
                self_match=int(selector_matches(selector, labels)),
            )
        )
    return tuple(compiled)


def _host_ports(spec: JSON) -> tuple[HostPort, ...]:
    # Sidecars (restartable init containers) hold their ports as long as the pod runs.
    init = map(_mapping, _list(spec.get("initContainers")))
    containers = [
        *(c for c in init if c.get("restartPolicy") == "Always"),
        *map(_mapping, _list(spec.get("containers"))),
    ]
    return tuple(
        (_text(p.get("hostIP")) or BIND_ALL, _text(p.get("protocol")) or "TCP", p["hostPort"])
        for c in containers
        for p in map(_mapping, _list(c.get("ports")))
        if _integer(p.get("hostPort"), 0) > 0
    )


def toleration_of(toleration: JSON) -> Toleration:
    return Toleration(
        _text(toleration.get("key")),
        _text(toleration.get("operator")),
        _text(toleration.get("value")),
        _text(toleration.get("effect")),
    )


def _preferred(terms: Any) -> tuple[tuple[int, NodeTerm], ...]:
    weighted = (
        (_integer(t.get("weight"), 0), _node_term(t.get("preference")))
        for t in map(_mapping, _list(terms))
    )
    return tuple((weight, term) for weight, term in weighted if weight and term is not None)


def _in_place_status(pod: JSON) -> tuple[Any, ...]:
    """What ``_requests_in_place`` reads of a pod's status."""
    return (
        resize_infeasible(pod),
        *(
            (name, found.get("allocatedResources"), found.get("resources"))
            for name, found in _container_statuses(pod).items()
        ),
    )


def facts_fingerprint(pod: JSON) -> int:
    """A hash of everything ``PodFacts.of`` reads: equal for two versions of a pod whose
    facts are equal. Most updates of a bound pod are status changes, and hashing its
    JSON costs a tenth of compiling it again (a collision between two versions of one pod
    is 1 in 2**64)."""
    metadata = _mapping(pod.get("metadata"))
    return hash(
        orjson.dumps(
            (
                metadata.get("namespace"),
                metadata.get("labels"),
                metadata.get("deletionTimestamp") is not None,
                pod.get("spec"),
                _in_place_status(pod),
            )
        )
    )


@dataclass(frozen=True, slots=True)
class PodFacts:
    """A pod compiled for fit checks: once per query for the pod asked about, once per
    change of what it reads (``facts_fingerprint``) for the pods already in the cluster."""

    kind: Kind
    node_name: str
    requests: Mapping[str, int]
    # Requested resources checked beyond pods, cpu, memory and ephemeral-storage.
    extended: tuple[tuple[str, int], ...]
    tolerations: tuple[Toleration, ...]
    tolerates_unschedulable: bool
    # Of the not-ready and unreachable taints, the keys whose NoSchedule it tolerates.
    tolerated_readiness: frozenset[str]
    node_selector: tuple[Requirement, ...]
    # None without required node affinity; () when it selects no node.
    node_terms: tuple[NodeTerm, ...] | None
    preferred: tuple[tuple[int, NodeTerm], ...]
    host_ports: tuple[HostPort, ...]
    spread: tuple[Spread, ...]
    affinity: tuple[PodTerm, ...]
    anti_affinity: tuple[PodTerm, ...]

    @classmethod
    def of(cls, pod: JSON) -> PodFacts:
        metadata, spec = _mapping(pod.get("metadata")), _mapping(pod.get("spec"))
        # A pod sent without a namespace is created in the default one, as kubectl does.
        namespace = _text(metadata.get("namespace")) or "default"
        labels = _labels(metadata.get("labels"))
        affinity = _mapping(spec.get("affinity"))
        node_affinity = _mapping(affinity.get("nodeAffinity"))
        required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
        pod_affinity = _mapping(affinity.get("podAffinity"))
        anti_affinity = _mapping(affinity.get("podAntiAffinity"))
        tolerations = tuple(map(toleration_of, map(_mapping, _list(spec.get("tolerations")))))
        requests = milli(pod_requests(pod))
        # The apiserver merges matchLabelKeys into the affinity terms once, at creation: a
        # stored pod (it has a uid) carries them merged with the labels it had then, which
        # relabelling it leaves as they were.
        merged_from = {} if metadata.get("uid") else labels
        return cls(
            kind=Kind(
                namespace,
                frozenset(labels.items()),
                metadata.get("deletionTimestamp") is not None,
            ),
            node_name=_text(spec.get("nodeName")),
            requests=requests,
            extended=_extended(requests),
            tolerations=tolerations,
            tolerates_unschedulable=tolerates(
                tolerations, Taint(UNSCHEDULABLE_TAINT_KEY, "", NO_SCHEDULE)
            ),
            tolerated_readiness=frozenset(
                key
                for key in (NOT_READY_TAINT_KEY, UNREACHABLE_TAINT_KEY)
                if tolerates(tolerations, Taint(key, "", NO_SCHEDULE))
            ),
            node_selector=tuple(
                Requirement(key, IN, frozenset({value} if isinstance(value, str) else ()))
                for key, value in _mapping(spec.get("nodeSelector")).items()
            ),
            node_terms=None
            if required is None
            else tuple(
                term
                for term in map(_node_term, _list(_mapping(required).get("nodeSelectorTerms")))
                if term is not None
            ),
            preferred=_preferred(
                node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution")
            ),
            host_ports=_host_ports(spec),
            spread=_spread(spec.get("topologySpreadConstraints"), labels),
            affinity=_pod_terms(
                pod_affinity.get("requiredDuringSchedulingIgnoredDuringExecution"),
                namespace,
                merged_from,
            ),
            anti_affinity=_pod_terms(
                anti_affinity.get("requiredDuringSchedulingIgnoredDuringExecution"),
                namespace,
                merged_from,
            ),
        )

    @property
    def spans_nodes(self) -> bool:
        """Whether where one copy lands changes where the next one fits beyond that node."""
        return bool(self.spread or self.affinity or self.anti_affinity)


# -- the node's own filters --------------------------------------------------------------


def unschedulable_failure(pod: PodFacts, barriers: Barriers) -> str | None:
    return UNSCHEDULABLE if barriers.unschedulable and not pod.tolerates_unschedulable else None


def node_name_failure(pod: PodFacts, name: str) -> str | None:
    return NODE_NAME if pod.node_name and pod.node_name != name else None


def taint_failure(pod: PodFacts, barriers: Barriers) -> str | None:
    key = barriers.readiness_taint
    if key is not None and key not in pod.tolerated_readiness:
        return NOT_READY if key == NOT_READY_TAINT_KEY else UNREACHABLE
    return UNTOLERATED_TAINT if untolerated(pod.tolerations, barriers.taints) else None


def node_affinity_matches(pod: PodFacts, labels: Mapping[str, str], name: str) -> bool:
    """nodeSelector and required node affinity (nodeaffinity.RequiredNodeAffinity)."""
    if not all(r.accepts(labels.get(r.key)) for r in pod.node_selector):
        return False
    return pod.node_terms is None or any(
        node_term_matches(term, labels, name) for term in pod.node_terms
    )


def node_failures(pod: PodFacts, node: NodeFacts) -> list[str]:
    """NodeUnschedulable, NodeName, TaintToleration, NodeAffinity: what the node alone
    decides."""
    reason = (
        unschedulable_failure(pod, node.barriers)
        or node_name_failure(pod, node.name)
        or taint_failure(pod, node.barriers)
        or (None if node_affinity_matches(pod, node.labels, node.name) else NODE_AFFINITY)
    )
    return [reason] if reason else []


def preference(pod: PodFacts, labels: Mapping[str, str], name: str) -> int:
    """The summed weights of the preferred node affinity terms the node matches."""
    return sum(weight for weight, term in pod.preferred if node_term_matches(term, labels, name))


# -- what the node's pods use ------------------------------------------------------------


# name, pods, cpu, memory, ephemeral storage, free, used, 1/cpu, 1/memory, scale, shares,
# allocatable: Headroom's fields in the order rank unpacks them.
HeadroomRow = tuple[
    str,
    int,
    int,
    int,
    int,
    Mapping[str, int],
    float,
    float,
    float,
    float,
    int,
    Mapping[str, int],
]


@dataclass(frozen=True, slots=True)
class Headroom:
    """What a node has left once its pods' requests are taken, laid out for ``rank``:
    the resources every pod is checked against in fields, and the share of cpu and of
    memory already requested summed, so a node's best fit costs two multiplications."""

    name: str
    pods: int
    cpu: int
    memory: int
    storage: int
    # 1 / allocatable; 0 when the node has none, which leaves it out of best fit.
    inverse_cpu: float
    inverse_memory: float
    used: float
    # How many of cpu and memory the node has, and 1 / that (0 for none).
    shares: int
    scale: float
    allocatable: Mapping[str, int] = field(repr=False)
    free: Mapping[str, int] = field(repr=False)
    # The fields rank reads, as a tuple it unpacks: a third faster than attribute reads
    # in the loop that runs once per node and query.
    row: HeadroomRow = field(repr=False, compare=False)

    @classmethod
    def of(
        cls, name: str, allocatable: Mapping[str, int], requested: Mapping[str, int]
    ) -> Headroom:
        """Allocatable minus requested; negative where the node is overcommitted or
        pods request what it does not have."""
        free = dict(allocatable)
        for resource, value in requested.items():
            free[resource] = free.get(resource, 0) - value
        cpu, memory = allocatable.get("cpu", 0), allocatable.get("memory", 0)
        inverse_cpu = 1 / cpu if cpu > 0 else 0.0
        inverse_memory = 1 / memory if memory > 0 else 0.0
        shares = (cpu > 0) + (memory > 0)
        pods, free_cpu = free.get("pods", 0), free.get("cpu", 0)
        free_memory, storage = free.get("memory", 0), free.get("ephemeral-storage", 0)
        used = requested.get("cpu", 0) * inverse_cpu + requested.get("memory", 0) * inverse_memory
        scale = 1 / shares if shares else 0.0
        return cls(
            name=name,
            pods=pods,
            cpu=free_cpu,
            memory=free_memory,
            storage=storage,
            inverse_cpu=inverse_cpu,
            inverse_memory=inverse_memory,
            used=used,
            shares=shares,
            scale=scale,
            allocatable=allocatable,
            free=free,
            row=(
                name,
                pods,
                free_cpu,
                free_memory,
                storage,
                free,
                used,
                inverse_cpu,
                inverse_memory,
                scale,
                shares,
                allocatable,
            ),
        )


def _floor(requests: Mapping[str, int], resource: str) -> float:
    # The scheduler does not check what a pod does not request: no free amount is below.
    quantity = requests.get(resource, 0)
    return quantity if quantity > 0 else -math.inf


def rank(pod: PodFacts, nodes: Iterable[Headroom]) -> tuple[dict[str, float], Counter[str]]:
    """NodeResourcesFit over many nodes in one pass: the best fit of each node the pod's
    requests fit (in the order given), and how many nodes each shortage rejected (one
    node may lack several resources). Best fit is the mean, over cpu, memory and the
    requested extended resources, of the share requested once the pod is placed: 1
    leaves nothing stranded."""
    pods, cpu, memory, storage = (_floor(pod.requests, r) for r in _CORE)
    want_cpu, want_memory = pod.requests.get("cpu", 0), pod.requests.get("memory", 0)
    extended = pod.extended
    # Plain ints and indexes in the loop: it runs once per node and query, and a Counter
    # update or a generator per node cost more than the comparisons themselves.
    extended_names = tuple(r for r, _ in extended)
    extended_wants = tuple(q for _, q in extended)
    extended_range = range(len(extended))
    fitting: dict[str, float] = {}
    short_pods = short_cpu = short_memory = short_storage = 0
    short_extended = [0] * len(extended)
    for node in nodes:
        (
            name,
            free_pods,
            free_cpu,
            free_memory,
            free_storage,
            free,
            used,
            inverse_cpu,
            inverse_memory,
            scale,
            shares,
            allocatable,
        ) = node.row
        lacking = False
        if extended:
            for index in extended_range:
                if free.get(extended_names[index], 0) < extended_wants[index]:
                    short_extended[index] += 1
                    lacking = True
        if (
            not lacking
            and free_cpu >= cpu
            and free_memory >= memory
            and free_pods >= pods
            and free_storage >= storage
        ):
            share = used + want_cpu * inverse_cpu + want_memory * inverse_memory
            if extended:
                # Fitting means allocatable >= free >= request > 0 for each of them.
                share += sum((allocatable[r] - free[r] + q) / allocatable[r] for r, q in extended)
                share /= shares + len(extended)
            else:
                share *= scale
            fitting[name] = share if share < 1.0 else 1.0
            continue
        short_pods += free_pods < pods
        short_cpu += free_cpu < cpu
        short_memory += free_memory < memory
        short_storage += free_storage < storage
    short = Counter(
        dict(
            zip(
                (*_CORE, *extended_names),
                (short_pods, short_cpu, short_memory, short_storage, *short_extended),
                strict=True,
            )
        )
    )
    return fitting, Counter({insufficient(r): n for r, n in short.items() if n})


def ports_conflict(wanted: Iterable[HostPort], used: Collection[HostPort]) -> bool:
    """HostPortInfo.CheckConflict: 0.0.0.0 on either side conflicts with every address."""
    for ip, protocol, port in wanted:
        if ip == BIND_ALL:
            if any(p == port and proto == protocol for _, proto, p in used):
                return True
        elif (BIND_ALL, protocol, port) in used or (ip, protocol, port) in used:
            return True
    return False


def usage_failures(pod: PodFacts, node: Headroom, ports: Collection[HostPort]) -> list[str]:
    """NodePorts, then NodeResourcesFit."""
    if pod.host_ports and ports_conflict(pod.host_ports, ports):
        return [NODE_PORTS]
    return list(rank(pod, [node])[1])


# -- what the cluster's pods decide ------------------------------------------------------

# Where pods are placed: namespace -> kind -> node name -> number of pods.
Placed = Mapping[str, Mapping[Kind, Mapping[str, int]]]


@dataclass(frozen=True, slots=True)
class SpreadCounts:
    """Per constraint: matching pods per domain of the eligible nodes, and the global
    minimum the skew is measured from."""

    counts: tuple[Mapping[str, int], ...]
    minimum: tuple[int, ...]


def _eligible(pod: PodFacts, constraint: Spread, node: NodeFacts) -> bool:
    if constraint.honor_affinity and not node_affinity_matches(pod, node.labels, node.name):
        return False
    return not (constraint.honor_taints and untolerated(pod.tolerations, node.barriers.taints))


def spread_counts(pod: PodFacts, nodes: Iterable[NodeFacts], placed: Placed) -> SpreadCounts:
    # The domain of each eligible node, per constraint: nodes lacking any of the keys
    # are left out of every constraint.
    domains: list[dict[str, str]] = [{} for _ in pod.spread]
    for node in nodes:
        if all(c.topology_key in node.labels for c in pod.spread):
            for constraint, domain in zip(pod.spread, domains, strict=True):
                if _eligible(pod, constraint, node):
                    domain[node.name] = node.labels[constraint.topology_key]
    counts = [Counter(dict.fromkeys(domain.values(), 0)) for domain in domains]
    for kind, where in placed.get(pod.kind.namespace, {}).items():
        # Terminating pods are on their way out (kubernetes#87621).
        if kind.deleting:
            continue
        labels = dict(kind.labels)
        for constraint, domain, count in zip(pod.spread, domains, counts, strict=True):
            # An empty selector counts no pod but the pod itself (self_match).
            if constraint.selector and selector_matches(constraint.selector, labels):
                for name, number in where.items():
                    if name in domain:
                        count[domain[name]] += number
    minimum = tuple(
        min(count.values(), default=_MAX_INT32) if len(count) >= c.min_domains else 0
        for c, count in zip(pod.spread, counts, strict=True)
    )
    return SpreadCounts(tuple(counts), minimum)


def spread_failure(pod: PodFacts, labels: Mapping[str, str], state: SpreadCounts) -> str | None:
    for index, constraint in enumerate(pod.spread):
        value = labels.get(constraint.topology_key)
        if value is None:
            return SPREAD_LABEL
        matching = state.counts[index].get(value, 0)
        if matching + constraint.self_match - state.minimum[index] > constraint.max_skew:
            return SPREAD
    return None


@dataclass(frozen=True, slots=True)
class InterPodCounts:
    """Pods per topology domain that match the pod's affinity terms (all of them), its
    anti-affinity terms, and existing pods' anti-affinity terms that match the pod."""

    affinity: Mapping[Domain, int]
    anti_affinity: Mapping[Domain, int]
    existing_anti_affinity: Mapping[Domain, int]
    self_match: bool


def _count_domains(
    counts: Counter[Domain], terms: Iterable[PodTerm], labels: Mapping[str, str], number: int
) -> None:
    for term in terms:
        value = labels.get(term.topology_key)
        if value is not None:
            counts[term.topology_key, value] += number


def _term_namespaces(pod: PodFacts, placed: Placed) -> Iterable[str]:
    """The namespaces the pod's own terms can match pods in."""
    terms = (*pod.affinity, *pod.anti_affinity)
    if any(t.namespaces is None for t in terms):
        return placed.keys()
    return {n for t in terms if t.namespaces is not None for n in t.namespaces}


def inter_pod_counts(
    pod: PodFacts,
    nodes: Mapping[str, NodeFacts],
    placed: Placed,
    anti_affinity_pods: Iterable[tuple[NodeFacts, PodFacts]],
) -> InterPodCounts | None:
    """None when no inter-pod term concerns the pod. ``anti_affinity_pods``: placed pods
    with required anti-affinity terms, and their nodes."""
    existing: Counter[Domain] = Counter()
    for node, other in anti_affinity_pods:
        matching = (t for t in other.anti_affinity if term_matches(t, pod.kind))
        _count_domains(existing, matching, node.labels, 1)
    if not (pod.affinity or pod.anti_affinity or existing):
        return None
    affinity: Counter[Domain] = Counter()
    anti: Counter[Domain] = Counter()
    for namespace in _term_namespaces(pod, placed):
        for kind, where in placed.get(namespace, {}).items():
            joins = bool(pod.affinity) and all(term_matches(t, kind) for t in pod.affinity)
            repels = [t for t in pod.anti_affinity if term_matches(t, kind)]
            if not (joins or repels):
                continue
            for name, number in where.items():
                host = nodes.get(name)
                if host is not None:
                    _count_domains(affinity, pod.affinity if joins else (), host.labels, number)
                    _count_domains(anti, repels, host.labels, number)
    self_match = bool(pod.affinity) and all(term_matches(t, pod.kind) for t in pod.affinity)
    return InterPodCounts(affinity, anti, existing, self_match)


def _satisfies_affinity(pod: PodFacts, labels: Mapping[str, str], state: InterPodCounts) -> bool:
    pods_exist = True
    for term in pod.affinity:
        value = labels.get(term.topology_key)
        if value is None:
            return False
        if state.affinity.get((term.topology_key, value), 0) <= 0:
            pods_exist = False
    # The first of a group of pods with affinity to each other may go anywhere.
    return pods_exist or (not state.affinity and state.self_match)


def inter_pod_failure(
    pod: PodFacts, labels: Mapping[str, str], state: InterPodCounts
) -> str | None:
    if not _satisfies_affinity(pod, labels, state):
        return POD_AFFINITY
    for term in pod.anti_affinity:
        value = labels.get(term.topology_key)
        if value is not None and state.anti_affinity.get((term.topology_key, value), 0) > 0:
            return POD_ANTI_AFFINITY
    if state.existing_anti_affinity and any(
        state.existing_anti_affinity.get(label, 0) > 0 for label in labels.items()
    ):
        return EXISTING_ANTI_AFFINITY
    return None


@dataclass(frozen=True, slots=True)
class ClusterCounts:
    """What PodTopologySpread and InterPodAffinity precompute over the whole cluster;
    None where the pod has nothing to check."""

    spread: SpreadCounts | None
    inter_pod: InterPodCounts | None


def cluster_counts(
    pod: PodFacts,
    nodes: Mapping[str, NodeFacts],
    placed: Placed,
    anti_affinity_pods: Iterable[tuple[NodeFacts, PodFacts]],
) -> ClusterCounts:
    """The counts over every node and the pods placed on them (pods on nodes not in
    ``nodes`` are not counted)."""
    return ClusterCounts(
        spread_counts(pod, nodes.values(), placed) if pod.spread else None,
        inter_pod_counts(pod, nodes, placed, anti_affinity_pods),
    )


def cluster_failures(pod: PodFacts, labels: Mapping[str, str], counts: ClusterCounts) -> list[str]:
    """PodTopologySpread, then InterPodAffinity."""
    reason = (counts.spread and spread_failure(pod, labels, counts.spread)) or (
        counts.inter_pod and inter_pod_failure(pod, labels, counts.inter_pod)
    )
    return [reason] if reason else []


def failures(
    pod: PodFacts,
    node: NodeFacts,
    headroom: Headroom,
    ports: Collection[HostPort],
    counts: ClusterCounts,
) -> list[str]:
    """Why the pod does not fit the node (empty: it fits): the reasons of the first
    filter that rejects it. ``headroom`` and ``ports`` come from the pods placed on the
    node, ``counts`` from ``cluster_counts``."""
    return (
        node_failures(pod, node)
        or usage_failures(pod, headroom, ports)
        or cluster_failures(pod, node.labels, counts)
    )


# -- reading JSON that may be malformed --------------------------------------------------


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _strings(value: Any) -> list[str]:
    return [item for item in _list(value) if isinstance(item, str)]


def _integer(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _labels(value: Any) -> dict[str, str]:
    return {k: v for k, v in _mapping(value).items() if isinstance(v, str)}
