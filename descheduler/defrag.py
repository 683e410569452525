"""Defragmentation (pure): which pods wait above for a node that no cluster has, which
pods may be evicted to make room for one, and which of the estimators' plans to carry out.

A federated pod the upper scheduler cannot place (PodScheduled False, Unschedulable) for
``defragAfter`` may have room made for it: the estimator of each cluster plans, per lower
node, the fewest evictions of movable pods that let it fit there, and says which of the
evicted would fit no other node of that cluster. A plan is carried out only if it is
complete: every evicted pod's PodDisruptionBudget allows it, the limits allow them all,
and those its cluster cannot take again fit, together, in the others.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from descheduler.policy import Policy
from descheduler.rescue import (
    REPLACING_CONTROLLERS,
    PodCase,
    controller_kind,
    hands_off,
    unschedulable_above,
)
from kubekit import fit, keys
from kubekit.estimatorapi.estimator_pb2 import DefragmentResponse
from kubekit.informer import object_key
from kubekit.slices import outside_applied_slices
from kubekit.timestamps import parse_time, rfc3339

# Never evicted to make room: the cluster's own machinery.
PROTECTED_NAMESPACES = frozenset({"kube-system"})
# Plans carried out for one waiting pod before the descheduler leaves it be: each waits
# twice as long as the one before after it (holdTimeout the first), at most an hour.
MAX_PLANS = 4
LONGEST_REPLAN_WAIT = timedelta(hours=1)
_PROVIDER_TAINT = fit.Taint(keys.PROVIDER_TAINT_KEY, keys.PROVIDER_TAINT_VALUE, fit.NO_SCHEDULE)


def priority(pod: Mapping[str, Any]) -> int:
    value = (pod.get("spec") or {}).get("priority")
    return value if isinstance(value, int) else 0


@dataclass(frozen=True)
class Waiting(PodCase):
    # For how long the upper scheduler has found no node, and its words.
    seconds: float
    message: str


def defragmented(pod: Mapping[str, Any]) -> tuple[int, datetime] | None:
    """How many plans were carried out for a waiting pod, and when the last was (None:
    none, or a record that cannot be read)."""
    text = (pod["metadata"].get("annotations") or {}).get(keys.DEFRAGMENTED_ANNOTATION)
    if not isinstance(text, str):
        return None
    try:
        record = json.loads(text)
        plans, at = record["plans"], parse_time(record["at"])
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    if not isinstance(plans, int) or isinstance(plans, bool) or plans < 1:
        return None
    return plans, at


def defragmented_record(pod: Mapping[str, Any], now: datetime) -> str:
    """The pod's record once one more plan is carried out for it now."""
    plans = (defragmented(pod) or (0, now))[0] + 1
    return json.dumps({"plans": plans, "at": rfc3339(now)}, sort_keys=True)


def planned_again_at(pod: Mapping[str, Any], policy: Policy) -> datetime | None:
    """When room may be made for a waiting pod again (None: at once, never made before;
    datetime.max: never, ``MAX_PLANS`` carried out). The evicted pods' replacements may
    take longer than the hold to go, or the pod wait for a reason the estimators do not
    model: planned again at each hold's end, new pods were evicted for it for good."""
    record = defragmented(pod)
    if record is None:
        return None
    plans, at = record
    if plans >= MAX_PLANS:
        return datetime.max.replace(tzinfo=at.tzinfo)
    wait = min(timedelta(seconds=policy.hold_timeout * 2 ** (plans - 1)), LONGEST_REPLAN_WAIT)
    try:
        return at + wait
    except OverflowError:
        return None  # a time no plan of ours wrote (year 9999): unreadable, as garbage


def waiting_pods(pods: Iterable[Mapping[str, Any]], now: datetime, policy: Policy) -> list[Waiting]:
    """Unbound federated pods the upper scheduler has found no node for since
    ``defragAfter``, and that no plan carried out for them lately waits for, the highest
    priority first, then by key."""
    found = []
    for pod in pods:
        waited = unschedulable_above(pod, now)
        if waited is None or waited[0] < policy.defrag_after:
            continue
        if (again := planned_again_at(pod, policy)) is not None and now < again:
            continue
        # Its PriorityClass says it never displaces running pods.
        if (pod.get("spec") or {}).get("preemptionPolicy") == "Never":
            continue
        # Only a pod that may go to a virtual node waits for a lower node's room.
        if fit.tolerates(fit.PodFacts.of(dict(pod)).tolerations, _PROVIDER_TAINT):
            found.append(Waiting(pod, *waited))
    return sorted(found, key=lambda waiting: (-priority(waiting.pod), waiting.key))


def admitting(
    pod: Mapping[str, Any], virtual_nodes: Mapping[str, Mapping[str, Any]], names: Iterable[str]
) -> list[str]:
    """Of the virtual nodes ``names``, those the pod's own nodeSelector, required node
    affinity and tolerations admit, as the upper scheduler's NodeAffinity and
    TaintToleration filters judge them: a controller's new pods are kept off a cluster it
    moved pods out of that way (``kubekit.moves.keep_off``), and an admin may taint a
    virtual node to keep pods off its cluster, which the estimators below, judging the
    lower pod, cannot see. Room made there would be made for nothing, and a bare pod's
    copy bound there would break the pod's own rules (or, under a NoExecute taint, be
    deleted by the taint manager: the pod lost). The virtual nodes' own taint is not
    judged: the pod is on one already."""
    facts = fit.PodFacts.of(dict(pod))
    admitted = []
    for name in names:
        node = fit.NodeFacts.of(dict(virtual_nodes[name]))
        taints = [t for t in node.barriers.taints if t.key != keys.PROVIDER_TAINT_KEY]
        if fit.node_affinity_matches(facts, node.labels, name) and not fit.untolerated(
            facts.tolerations, taints
        ):
            admitted.append(name)
    return admitted


def outside_slices(
    pod: Mapping[str, Any],
    virtual_nodes: Mapping[str, Mapping[str, Any]],
    names: Iterable[str],
    applied_annotation: str | None,
) -> dict[str, str]:
    """Of the virtual nodes ``names``, those whose cluster holds none of the quota slices
    of the pod's namespace (``applied_annotation``: the multischeduler's record on it),
    each with why. The extender turns a controller's new pod away from them, and their
    virtual node fails a bare pod's copy bound there (``OutsideQuotaSlices``): a move
    there, or room made there, would be for nothing."""
    namespace = str(pod["metadata"].get("namespace", ""))
    outside = {}
    for name in names:
        labels = virtual_nodes[name].get("metadata", {}).get("labels") or {}
        cluster = str(labels.get(keys.CLUSTER_ID_LABEL, ""))
        why = outside_applied_slices(namespace, applied_annotation, cluster)
        if why is not None:
            outside[name] = why
    return outside


def budgets_of(
    pod: Mapping[str, Any], budgets: Iterable[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The PodDisruptionBudgets that cover a pod: same namespace, selector matching."""
    metadata = pod["metadata"]
    labels = metadata.get("labels") or {}
    return [
        budget
        for budget in budgets
        if budget["metadata"].get("namespace") == metadata.get("namespace")
        and fit.selector_matches(
            fit.label_selector((budget.get("spec") or {}).get("selector")), labels
        )
    ]


def _allowed(budget: Mapping[str, Any]) -> int:
    value = (budget.get("status") or {}).get("disruptionsAllowed")
    return value if isinstance(value, int) else 0


def movable_pods(
    pods: Iterable[Mapping[str, Any]],
    waiting: Waiting,
    virtual_nodes: Iterable[str],
    budgets: Sequence[Mapping[str, Any]],
) -> dict[str, list[Mapping[str, Any]]]:
    """By virtual node, the pods that may be evicted to make room for ``waiting``:
    Running there, replaced by a controller (``rescue.REPLACING_CONTROLLERS``: not a
    DaemonSet, not a Job), of no higher priority, not
    in a protected namespace, not opted out, and under at most one PodDisruptionBudget
    that allows a disruption now (the Eviction API refuses a pod under several)."""
    nodes = set(virtual_nodes)
    ceiling = priority(waiting.pod)
    found: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        metadata, spec = pod["metadata"], pod.get("spec") or {}
        node = spec.get("nodeName")
        if node not in nodes or metadata.get("deletionTimestamp"):
            continue
        if (pod.get("status") or {}).get("phase") != "Running":
            continue
        if controller_kind(pod) not in REPLACING_CONTROLLERS:
            continue
        if hands_off(pod) or priority(pod) > ceiling:
            continue
        if metadata.get("namespace") in PROTECTED_NAMESPACES:
            continue
        covering = budgets_of(pod, budgets)
        if len(covering) > 1 or any(_allowed(budget) < 1 for budget in covering):
            continue
        found.setdefault(str(node), []).append(pod)
    return found


def taking_from_budgets(evicted: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Of the pods evicted (or planned, in a dry run) this cycle, those whose eviction
    takes from a budget: the Running ones (the Eviction API takes nothing for a pod that
    is not). The cached budgets may show some of them already: counted again, a plan
    waits for the next cycle's fresh look; counted too few, it would be refused half way,
    its first evictions made for nothing."""
    return [pod for pod in evicted if (pod.get("status") or {}).get("phase") == "Running"]


def budgets_allow(
    evicted: Iterable[Mapping[str, Any]], budgets: Sequence[Mapping[str, Any]]
) -> bool:
    """Whether evicting all of them at once stays within every budget that covers them."""
    taken: Counter[str] = Counter()
    by_key = {object_key(budget): budget for budget in budgets}
    for pod in evicted:
        taken.update(object_key(budget) for budget in budgets_of(pod, budgets))
    return all(count <= _allowed(by_key[key]) for key, count in taken.items())


@dataclass(frozen=True)
class Plan:
    waiting: Waiting
    # The virtual node of the cluster, and the lower node freed there.
    cluster: str
    node: str
    evicted: tuple[Mapping[str, Any], ...]
    # Those of them that must find room in another cluster.
    homeless: tuple[Mapping[str, Any], ...]

    def describe(self) -> str:
        names = ", ".join(object_key(pod) for pod in self.evicted)
        return (
            f"free lower node {self.node} of {self.cluster} for pod {self.waiting.key}: "
            f"evict {names}"
        )


def candidate_plans(
    waiting: Waiting,
    responses: Mapping[str, DefragmentResponse],
    movable: Mapping[str, Sequence[Mapping[str, Any]]],
) -> list[Plan]:
    """The estimators' plans, the fewest evictions first, then by cluster and node; a
    plan naming a pod that was not offered is dropped."""
    plans = []
    for cluster, response in responses.items():
        offered = {str(pod["metadata"]["uid"]): pod for pod in movable.get(cluster, ())}
        for freeing in response.plans:
            uids = list(freeing.evicted_pod_uids)
            if not uids or any(uid not in offered for uid in uids):
                continue
            homeless = [uid for uid in freeing.homeless_pod_uids if uid in uids]
            plans.append(
                Plan(
                    waiting,
                    cluster,
                    freeing.node,
                    tuple(offered[uid] for uid in uids),
                    tuple(offered[uid] for uid in homeless),
                )
            )
    return sorted(plans, key=lambda plan: (len(plan.evicted), plan.cluster, plan.node))
