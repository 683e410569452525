"""An incremental view of one lower cluster for fit queries: where would a pod go?

Fed by watch events in any order (a pod may arrive before its node), it keeps per node
what the fit rules of ``kubekit.fit`` compare, updated by each event rather than
recomputed by each query: what the placed pods request (and the ``Headroom`` that
follows), the host ports they use, how many pods of each kind are there. Indexes let a
query decide the node-only filters once per group of alike nodes instead of once per
node: nodes by barriers (cordon, readiness, taints) and by label value; pods with
required anti-affinity are listed apart, so other pods never look at the rest. A query
then loops over nodes only to compare precomputed integers.

Assumptions are the scheduler's "assume" cache: a pod counted on the node it would
take before the cluster says it is there. They are keyed apart from real pods.
"""

from __future__ import annotations

import heapq
import itertools
from collections import ChainMap, Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from kubekit import fit
from kubekit.fit import JSON, Barriers, ClusterCounts, Headroom, HostPort, Kind, PodFacts
from kubekit.informer import object_key

# (True for an assumption, key): a real pod and an assumption never share a slot.
Ref = tuple[bool, str]
# What copies placed during a simulation request and use, by node.
_Scratch = dict[str, tuple[Counter[str], Counter[HostPort]]]
K = TypeVar("K")
# Keys of the assumptions a simulation makes and takes back: NUL is in no pod's UID.
_SIMULATED = "\0"
# The work one search for the fewest evictions may do, since it runs on the event loop
# that serves queries: sets of pods looked at (integer sums), and sets judged by every
# filter. Nodes are searched in name order; those left when it is spent give no plan.
FREEING_SETS = 100_000
FREEING_CHECKS = 500


@dataclass(slots=True)
class _SearchBudget:
    sets: int = FREEING_SETS
    checks: int = FREEING_CHECKS


@dataclass(frozen=True, slots=True)
class Estimate:
    """How a pod fares in one lower cluster."""

    total_nodes: int
    # Nodes where one copy fits, sorted.
    fitting: tuple[str, ...]
    # Reason -> number of nodes it rejected (a node may count under several).
    reasons: Mapping[str, int]
    # How many of the copies asked about fit, placed one after another on the best node.
    max_replicas: int
    # On the fitting node that strands the least: mean requested share once placed.
    best_fit: float
    # On the emptiest fitting node: mean free share once placed.
    least_allocated: float
    # The largest summed weight of preferred node affinity terms a fitting node matches.
    preferred: int
    # The node one copy would take (assume's choice), None when none fits.
    roomiest: str | None = None

    def message(self) -> str:
        """The scheduler's summary, reasons by count, most first (the scheduler sorts its
        "count reason" strings as text, which puts 10 before 9)."""
        if self.fitting:
            return f"{len(self.fitting)}/{self.total_nodes} nodes fit"
        ranked = sorted(self.reasons.items(), key=lambda item: (-item[1], item[0]))
        summary = ", ".join(f"{count} {reason}" for reason, count in ranked)
        available = f"0/{self.total_nodes} nodes are available"
        return f"{available}: {summary}" if summary else available


@dataclass(frozen=True, slots=True)
class Freeing:
    """Room for a pod made on one node by evicting some of the pods there."""

    node: str
    # The keys of the pods to evict: the fewest that make room.
    evicted: tuple[str, ...]
    # Those no other node of the cluster takes once the pod holds this one.
    homeless: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Evaluation:
    # The nodes that pass the node-only filters, in name order.
    candidates: list[str]
    reasons: Counter[str]
    # The best fit of each node the pod fits, in name order.
    scores: dict[str, float]


class ClusterState:
    def __init__(self) -> None:
        self._nodes: dict[str, fit.NodeFacts] = {}
        self._headroom: dict[str, Headroom] = {}
        self._names: list[str] | None = []  # sorted node names; None until asked again
        # By node name, whether the node is known yet or not.
        self._requested: dict[str, Counter[str]] = {}
        self._ports: dict[str, Counter[HostPort]] = {}
        self._pod_count: Counter[str] = Counter()
        # Namespace -> kind -> node -> pods: what spread and inter-pod terms count.
        self._by_kind: dict[str, dict[Kind, Counter[str]]] = {}
        self._placed: dict[Ref, tuple[str, PodFacts]] = {}
        # Key -> fit.facts_fingerprint of each real pod placed, to skip unchanged facts.
        self._fingerprints: dict[str, int] = {}
        self._anti_affinity: dict[Ref, tuple[str, PodFacts]] = {}
        self._by_barriers: dict[Barriers, set[str]] = {}
        self._by_label: dict[str, dict[str, set[str]]] = {}

    # -- watch events ----------------------------------------------------------------------

    def set_node(self, node: JSON) -> None:
        facts = fit.NodeFacts.of(node)
        old = self._nodes.get(facts.name)
        # Most updates are status heartbeats: labels and taints stay, so do the indexes.
        if old is None or old.barriers != facts.barriers or old.labels != facts.labels:
            if old is not None:
                self._unindex(old)
            self._index(facts)
        if old is None:
            self._names = None
        self._nodes[facts.name] = facts
        self._refresh(facts.name)

    def remove_node(self, name: str) -> None:
        old = self._nodes.pop(name, None)
        if old is not None:
            self._unindex(old)
            del self._headroom[name]
            self._names = None

    def set_pod(self, pod: JSON) -> None:
        """A pod counts on its node while bound and not finished, or on the node it was
        nominated to while it waits (``fit.counted_node``); an update replaces what it
        counted before, unless its node and facts are the same."""
        key = object_key(pod)
        ref = (False, key)
        node = fit.counted_node(pod)
        if node is None:
            self.remove_pod(key)
            return
        fingerprint = fit.facts_fingerprint(pod)
        placed = self._placed.get(ref)
        if placed is not None and placed[0] == node and self._fingerprints.get(key) == fingerprint:
            return
        self._unplace(ref)
        self._place(ref, node, PodFacts.of(pod))
        self._fingerprints[key] = fingerprint

    def remove_pod(self, key: str) -> None:
        self._unplace((False, key))
        self._fingerprints.pop(key, None)

    # -- assumptions -----------------------------------------------------------------------

    def assume(self, key: str, pod: JSON | PodFacts, node_name: str | None = None) -> str | None:
        """Counts the pod on ``node_name``, or on the node it would take (``_home``).
        Returns that node, or None when none fits (then nothing is assumed)."""
        self.forget(key)
        facts = facts_of(pod)
        if node_name is None:
            node_name = self._home(facts, self._evaluate(facts).scores)
            if node_name is None:
                return None
        self._place((True, key), node_name, facts)
        return node_name

    def reassume(self, key: str) -> str | None:
        """Checks an assumption again: kept on its node if the node still takes the pod,
        else moved to the node it would take now (its node cordoned, gone, or filled by
        pods seen since). Returns its node, None when none takes it (then nothing is
        assumed) or when nothing was."""
        placed = self._placed.get((True, key))
        if placed is None:
            return None
        node_name, facts = placed
        self.forget(key)
        scores = self._evaluate(facts).scores
        chosen = node_name if node_name in scores else self._home(facts, scores)
        if chosen is not None:
            self._place((True, key), chosen, facts)
        return chosen

    def forget(self, key: str) -> str | None:
        """Drops an assumption; returns the node it held room on."""
        return self._unplace((True, key))

    def assumed_node(self, key: str) -> str | None:
        placed = self._placed.get((True, key))
        return None if placed is None else placed[0]

    # -- queries ---------------------------------------------------------------------------

    def estimate(self, pod: JSON | PodFacts, replicas: int = 1) -> Estimate:
        facts = facts_of(pod)
        evaluation = self._evaluate(facts)
        scores = evaluation.scores
        preferences = self._preferences(facts, scores)
        return Estimate(
            total_nodes=len(self._nodes),
            fitting=tuple(scores),
            reasons=dict(+evaluation.reasons),
            max_replicas=self._replicas(facts, replicas, evaluation),
            best_fit=max(scores.values(), default=0.0),
            # The free share is one minus the requested share, resource by resource.
            least_allocated=1.0 - min(scores.values()) if scores else 0.0,
            preferred=max(preferences.values(), default=0),
            roomiest=self._home(facts, scores, preferences),
        )

    def _preferences(self, facts: PodFacts, scores: Mapping[str, float]) -> dict[str, int]:
        """The weight of the pod's preferred node affinity each fitting node matches."""
        if not facts.preferred:
            return {}
        return {n: fit.preference(facts, self._nodes[n].labels, n) for n in scores}

    def _home(
        self,
        facts: PodFacts,
        scores: Mapping[str, float],
        preferences: Mapping[str, int] | None = None,
    ) -> str | None:
        """The node the pod would take: of the fitting ones matching the most of its
        preferred node affinity, the one left with the most room (the lowest best fit),
        ties to the first name, as the stock scheduler's LeastAllocated spreads pods. The
        pod is pinned there below: a cluster chosen for the preference its nodes meet
        must put the pod on one that meets it.

        Spreading within a cluster keeps room on every node for what comes next: on the
        production trace of bench/placement.py, packing each pod on its tightest node
        strands GPUs behind the cpu of the pods packed beside them."""
        if preferences is None:
            preferences = self._preferences(facts, scores)
        if preferences:
            top = max(preferences.values())
            scores = {n: s for n, s in scores.items() if preferences[n] == top}
        return _roomiest(scores)

    def largest_free_slot(
        self, counted_taint_keys: Collection[str] = ()
    ) -> tuple[str, dict[str, int]] | None:
        """The schedulable Ready node with the most cpu left (then memory, then the first
        name) and what it has left in milli-units, pods in flight counted: the biggest pod
        the cluster could still take, whatever its total says. None without such a node.
        A node with a NoSchedule or NoExecute taint keyed outside ``counted_taint_keys``
        is left out, as from the capacity (``capacity.node_counts``)."""
        usable = [
            headroom
            for name, headroom in self._headroom.items()
            if _usable(self._nodes[name].barriers, counted_taint_keys)
        ]
        if not usable:
            return None
        best = min(usable, key=lambda h: (-h.cpu, -h.memory, h.name))
        return best.name, {resource: max(0, value) for resource, value in best.free.items()}

    def node_count(self) -> int:
        return len(self._nodes)

    def has_node(self, name: str) -> bool:
        return name in self._nodes

    def fit_in_turn(self, pods: Sequence[JSON | PodFacts]) -> list[str | None]:
        """Where each pod would go, placed one after another on the roomiest node that
        takes it (one that fits nowhere takes nothing); the state is left as it was."""
        return self._in_turn([facts_of(pod) for pod in pods])

    def freeing(
        self, pod: JSON | PodFacts, movable: Mapping[str, JSON], most: int
    ) -> list[Freeing]:
        """How evicting at most ``most`` of the ``movable`` pods would make room for a pod
        that fits no node now: for each node the pod could take once some of them left,
        the fewest to evict, and which of those then fit no other node (``movable`` maps
        the key of a real pod to what its replacement would be). Fewest evictions first,
        ties by node name; nothing when the pod fits somewhere already."""
        facts = facts_of(pod)
        evaluation = self._evaluate(facts)
        if evaluation.scores or most <= 0:
            return []
        candidates = set(evaluation.candidates)
        on_node: dict[str, list[tuple[str, PodFacts]]] = {}
        for (assumed, key), (node, other) in self._placed.items():
            if not assumed and key in movable and node in candidates:
                on_node.setdefault(node, []).append((key, other))
        plans = []
        budget = _SearchBudget()
        for node in evaluation.candidates:
            victims = on_node.get(node)
            if not victims:
                continue
            evicted = self._fewest_evictions(facts, node, victims, most, budget)
            if evicted is not None:
                replacements = [PodFacts.of(movable[key]) for key in evicted]
                homeless = self._homeless(facts, node, evicted, replacements)
                plans.append(Freeing(node, evicted, homeless))
        return sorted(plans, key=lambda plan: (len(plan.evicted), plan.node))

    def _fewest_evictions(
        self,
        pod: PodFacts,
        node: str,
        victims: list[tuple[str, PodFacts]],
        most: int,
        budget: _SearchBudget,
    ) -> tuple[str, ...] | None:
        """The smallest set of ``victims`` whose going lets the pod fit on ``node``, found
        by trying sets in order of size, each size's sets biggest first; None when none
        does within the budget. A set must first cover what the node lacks, which is
        integer arithmetic; only those are judged by every filter."""
        free = self._headroom[node].free
        missing = {
            resource: need - free.get(resource, 0)
            for resource, need in pod.requests.items()
            if need > free.get(resource, 0)
        }
        if any(
            sum(other.requests.get(resource, 0) for _, other in victims) < short
            for resource, short in missing.items()
        ):
            return None  # not even all of them would make room
        victims = sorted(victims, key=lambda victim: (-_cover(victim[1], missing), victim[0]))
        for size in range(1, min(most, len(victims)) + 1):
            for chosen in itertools.combinations(victims, size):
                budget.sets -= 1
                if budget.sets < 0 or budget.checks <= 0:
                    return None
                if any(
                    sum(other.requests.get(resource, 0) for _, other in chosen) < short
                    for resource, short in missing.items()
                ):
                    continue
                budget.checks -= 1
                keys = tuple(key for key, _ in chosen)
                if self._fits_without(pod, node, keys):
                    return keys
        return None

    def _fits_without(self, pod: PodFacts, node: str, keys: Iterable[str]) -> bool:
        with self._without(keys):
            counts = self._cluster_counts(pod, Counter())
            return node in self._usage_filters(
                pod, [node], counts, Counter(), self._headroom, self._ports
            )

    def _homeless(
        self,
        pod: PodFacts,
        node: str,
        evicted: tuple[str, ...],
        replacements: list[PodFacts],
    ) -> tuple[str, ...]:
        planned: Ref = (True, _SIMULATED)
        with self._without(evicted):
            self._place(planned, node, pod)
            try:
                homes = self._in_turn(replacements)
            finally:
                self._unplace(planned)
        return tuple(key for key, home in zip(evicted, homes, strict=True) if home is None)

    @contextmanager
    def _without(self, keys: Iterable[str]) -> Iterator[None]:
        """The real pods of ``keys`` taken off their nodes for a while."""
        removed = [(ref, self._placed[ref]) for ref in ((False, key) for key in keys)]
        for ref, _ in removed:
            self._unplace(ref)
        try:
            yield
        finally:
            for ref, (node, facts) in removed:
                self._place(ref, node, facts)

    def _in_turn(self, pods: Sequence[PodFacts]) -> list[str | None]:
        refs: list[Ref] = []
        homes: list[str | None] = []
        try:
            for index, facts in enumerate(pods):
                home = self._home(facts, self._evaluate(facts).scores)
                homes.append(home)
                if home is not None:
                    ref = (True, f"{_SIMULATED}{index}")
                    self._place(ref, home, facts)
                    refs.append(ref)
            return homes
        finally:
            for ref in refs:
                self._unplace(ref)

    # -- bookkeeping -----------------------------------------------------------------------

    def _place(self, ref: Ref, node: str, pod: PodFacts) -> None:
        self._placed[ref] = (node, pod)
        self._pod_count[node] += 1
        kinds = self._by_kind.setdefault(pod.kind.namespace, {})
        kinds.setdefault(pod.kind, Counter())[node] += 1
        self._requested.setdefault(node, Counter()).update(pod.requests)
        if pod.host_ports:
            self._ports.setdefault(node, Counter()).update(pod.host_ports)
        if pod.anti_affinity:
            self._anti_affinity[ref] = (node, pod)
        self._refresh(node)

    def _unplace(self, ref: Ref) -> str | None:
        placed = self._placed.pop(ref, None)
        if placed is None:
            return None
        node, pod = placed
        kinds = self._by_kind[pod.kind.namespace]
        _discount(kinds[pod.kind], node)
        if not kinds[pod.kind]:
            del kinds[pod.kind]
            if not kinds:
                del self._by_kind[pod.kind.namespace]
        self._requested[node].subtract(pod.requests)
        if pod.host_ports:
            self._ports[node] = self._ports[node] - Counter(pod.host_ports)
        self._anti_affinity.pop(ref, None)
        _discount(self._pod_count, node)
        if node not in self._pod_count:
            # Nothing placed there any more: forget the name, it may never be a node.
            del self._requested[node]
            self._ports.pop(node, None)
        self._refresh(node)
        return node

    def _refresh(self, name: str) -> None:
        node = self._nodes.get(name)
        if node is not None:
            requested: Mapping[str, int] = self._requested.get(name, {})
            self._headroom[name] = Headroom.of(name, node.allocatable, requested)

    def _index(self, node: fit.NodeFacts) -> None:
        self._by_barriers.setdefault(node.barriers, set()).add(node.name)
        for key, value in node.labels.items():
            self._by_label.setdefault(key, {}).setdefault(value, set()).add(node.name)

    def _unindex(self, node: fit.NodeFacts) -> None:
        _discard(self._by_barriers, node.barriers, node.name)
        for key, value in node.labels.items():
            values = self._by_label[key]
            _discard(values, value, node.name)
            if not values:
                del self._by_label[key]

    def _sorted_names(self) -> list[str]:
        if self._names is None:
            self._names = sorted(self._nodes)
        return self._names

    # -- evaluation ------------------------------------------------------------------------

    def _evaluate(self, pod: PodFacts) -> _Evaluation:
        reasons: Counter[str] = Counter()
        passing = self._node_filters(pod, reasons)
        names = self._sorted_names()
        candidates = names if len(passing) == len(names) else [n for n in names if n in passing]
        counts = self._cluster_counts(pod, Counter())
        scores = self._usage_filters(pod, candidates, counts, reasons, self._headroom, self._ports)
        return _Evaluation(candidates, reasons, scores)

    def _node_filters(self, pod: PodFacts, reasons: Counter[str]) -> set[str]:
        """NodeUnschedulable, NodeName, TaintToleration, NodeAffinity over whole groups of
        nodes, in the scheduler's order: a node counts under the first that rejects it."""
        candidates = set(self._nodes)
        for barriers, names in self._by_barriers.items():
            reason = fit.unschedulable_failure(pod, barriers)
            if reason:
                reasons[reason] += len(names)
                candidates -= names
        if pod.node_name:
            reasons[fit.NODE_NAME] += len(candidates - {pod.node_name})
            candidates &= {pod.node_name}
        for barriers, names in self._by_barriers.items():
            reason = fit.taint_failure(pod, barriers)
            if reason:
                rejected = names & candidates
                reasons[reason] += len(rejected)
                candidates -= rejected
        if pod.node_selector or pod.node_terms is not None:
            matching = self._affinity_nodes(pod, candidates)
            reasons[fit.NODE_AFFINITY] += len(candidates - matching)
            candidates = matching
        return candidates

    def _affinity_nodes(self, pod: PodFacts, candidates: set[str]) -> set[str]:
        """The candidates that match the pod's node selector and required node affinity,
        found through the label index: a requirement is judged once per label value."""
        matching = set(candidates)
        for requirement in pod.node_selector:
            matching &= self._accepting(requirement)
        if pod.node_terms is None:
            return matching
        any_term: set[str] = set()
        for term in pod.node_terms:
            nodes = set(matching)
            for requirement in term.labels:
                nodes &= self._accepting(requirement)
            if term.names:
                nodes = {n for n in nodes if all(r.accepts(n) for r in term.names)}
            any_term |= nodes
        return any_term

    def _accepting(self, requirement: fit.Requirement) -> set[str]:
        values = self._by_label.get(requirement.key, {})
        nodes: set[str] = set()
        for value, names in values.items():
            if requirement.accepts(value):
                nodes |= names
        if requirement.accepts(None):
            nodes |= self._nodes.keys() - set().union(*values.values())
        return nodes

    def _cluster_counts(self, pod: PodFacts, copies: Mapping[str, int]) -> ClusterCounts:
        """The cluster-wide counts, with ``copies`` of the pod placed on top (by node)."""
        nodes, placed = self._nodes, self._by_kind
        anti_affinity = [
            (nodes[node], other) for node, other in self._anti_affinity.values() if node in nodes
        ]
        if copies:
            namespace = pod.kind.namespace
            kinds = dict(placed.get(namespace, {}))
            kinds[pod.kind] = Counter(kinds.get(pod.kind, {})) + Counter(copies)
            placed = {**placed, namespace: kinds}
            if pod.anti_affinity:
                anti_affinity += [
                    (nodes[n], pod) for n, number in copies.items() for _ in range(number)
                ]
        return fit.cluster_counts(pod, nodes, placed, anti_affinity)

    def _usage_filters(
        self,
        pod: PodFacts,
        candidates: Iterable[str],
        counts: ClusterCounts,
        reasons: Counter[str],
        headroom: Mapping[str, Headroom],
        ports: Mapping[str, Collection[HostPort]],
    ) -> dict[str, float]:
        """NodePorts, NodeResourcesFit, PodTopologySpread, InterPodAffinity: the best fit
        of each candidate that passes them all."""
        if pod.host_ports:
            conflicting = {
                n for n in candidates if fit.ports_conflict(pod.host_ports, ports.get(n, ()))
            }
            reasons[fit.NODE_PORTS] += len(conflicting)
            candidates = [n for n in candidates if n not in conflicting]
        scores, shortages = fit.rank(pod, [headroom[n] for n in candidates])
        reasons.update(shortages)
        if counts.spread is None and counts.inter_pod is None:
            return scores
        for name in list(scores):
            rejected = fit.cluster_failures(pod, self._nodes[name].labels, counts)
            if rejected:
                reasons.update(rejected)
                del scores[name]
        return scores

    # -- replicas --------------------------------------------------------------------------

    def _replicas(self, pod: PodFacts, replicas: int, evaluation: _Evaluation) -> int:
        if replicas <= 0 or not evaluation.scores:
            return 0
        if replicas == 1:
            return 1
        if pod.spans_nodes:
            return self._replicas_across(pod, replicas, evaluation.candidates)
        return self._replicas_by_node(pod, replicas, evaluation.scores)

    def _replicas_by_node(self, pod: PodFacts, replicas: int, scores: Mapping[str, float]) -> int:
        """Copies that change only the node they land on: each goes to the best node and
        only that node is judged again, on a scratch copy of its usage. A node's best
        fit only grows as copies land, so the first copies go to the initially best
        nodes: only as many of them as there are copies need be ranked."""
        # nlargest keeps the name order of equal scores, as the heap's tuples do.
        top = heapq.nlargest(replicas, scores, key=scores.__getitem__)
        best = [(-scores[name], name) for name in top]
        scratch: _Scratch = {}
        placed = 0
        while best and placed < replicas:
            _, name = heapq.heappop(best)
            requested, ports = self._place_copy(pod, name, scratch)
            placed += 1
            if pod.host_ports and fit.ports_conflict(pod.host_ports, ports):
                continue
            again, _ = fit.rank(pod, [Headroom.of(name, self._nodes[name].allocatable, requested)])
            if again:
                heapq.heappush(best, (-again[name], name))
        return placed

    def _replicas_across(self, pod: PodFacts, replicas: int, candidates: list[str]) -> int:
        """Copies whose spread or inter-pod terms reach other nodes: each copy placed
        changes the cluster-wide counts, so each round judges every candidate again,
        the placed copies held in scratch overlays of the nodes they landed on."""
        scratch: _Scratch = {}
        headroom: dict[str, Headroom] = {}
        ports: dict[str, Counter[HostPort]] = {}
        copies: Counter[str] = Counter()
        all_headroom = ChainMap(headroom, self._headroom)
        all_ports: ChainMap[str, Counter[HostPort]] = ChainMap(ports, self._ports)
        for placed in range(replicas):
            counts = self._cluster_counts(pod, copies)
            scores = self._usage_filters(
                pod, candidates, counts, Counter(), all_headroom, all_ports
            )
            name = _best(scores)
            if name is None:
                return placed
            copies[name] += 1
            requested, ports[name] = self._place_copy(pod, name, scratch)
            headroom[name] = Headroom.of(name, self._nodes[name].allocatable, requested)
        return replicas

    def _place_copy(
        self, pod: PodFacts, name: str, scratch: _Scratch
    ) -> tuple[Counter[str], Counter[HostPort]]:
        """Counts one more copy on a node in the scratch copy of its usage."""
        requested, ports = scratch.get(name) or (
            Counter(self._requested.get(name, {})),
            Counter(self._ports.get(name, {})),
        )
        requested.update(pod.requests)
        ports.update(pod.host_ports)
        scratch[name] = requested, ports
        return requested, ports


def _best(scores: Mapping[str, float]) -> str | None:
    """The node with the highest best fit; ``scores`` is in name order, so the first of
    equals wins."""
    top = max(scores.values(), default=None)
    return next((name for name, score in scores.items() if score == top), None)


def facts_of(pod: JSON | PodFacts) -> PodFacts:
    """What the fit needs of a pod, read once by a caller that asks several questions."""
    return pod if isinstance(pod, PodFacts) else PodFacts.of(pod)


def _usable(barriers: Barriers, counted_taint_keys: Collection[str]) -> bool:
    return (
        barriers.ready
        and not barriers.unschedulable
        and all(taint.key in counted_taint_keys for taint in barriers.taints)
    )


def _roomiest(scores: Mapping[str, float]) -> str | None:
    """The node with the lowest best fit; the first of equals wins."""
    bottom = min(scores.values(), default=None)
    return next((name for name, score in scores.items() if score == bottom), None)


def _cover(pod: PodFacts, missing: Mapping[str, int]) -> float:
    """How much of what a node lacks a pod's going would give back, summed over the
    resources as shares of each."""
    return sum(min(pod.requests.get(r, 0), short) / short for r, short in missing.items())


def _discount(counts: Counter[str], key: str) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]


def _discard(groups: dict[K, set[str]], key: K, name: str) -> None:
    members = groups[key]
    members.discard(name)
    if not members:
        del groups[key]
