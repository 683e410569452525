"""The descheduler: its policy file, which pods are stuck, where each goes, the limits,
the bare pod's copy (pure), and the loop over a fake client fed through real informers."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from descheduler.controller import STAY_EVENT_SECONDS, Descheduler, receivers
from descheduler.defrag import (
    MAX_PLANS,
    Plan,
    Waiting,
    budgets_allow,
    candidate_plans,
    defragmented,
    defragmented_record,
    movable_pods,
    outside_slices,
    planned_again_at,
    taking_from_budgets,
    waiting_pods,
)
from descheduler.main import parse_args
from descheduler.policy import Limits, Policy, PolicyError, parse_policy
from descheduler.rescue import (
    Move,
    Stay,
    Stuck,
    Why,
    copy_name,
    copy_refused,
    destination,
    is_copy_of,
    job_lost_by_eviction,
    kept_off,
    left_until,
    pod_copy,
    stuck_pods,
    taint_deletion,
    unfinished_moves,
    within_limits,
)
from kubekit import keys
from kubekit.client import (
    CONFIGMAPS,
    JOBS,
    NAMESPACES,
    NODES,
    PODDISRUPTIONBUDGETS,
    PODS,
    ApiError,
    KubeClient,
)
from kubekit.estimatorapi.estimator_pb2 import (
    DefragmentRequest,
    DefragmentResponse,
    FitInTurnRequest,
    FitInTurnResponse,
    Freeing,
    HoldRequest,
    PodEstimate,
    PodQuery,
)
from kubekit.informer import Informer
from kubekit.moves import keep_off, parse_moves
from kubekit.slices import Amount, Applied
from kubekit.stash import stash_scheduling
from kubekit.timestamps import rfc3339
from multischeduler.extender import Answer, EstimatorFailure
from tests.unit.test_multischeduler import core_grants
from virtual_node.translate import refused_status

NOW = datetime(2026, 11, 23, 12, 0, 0, tzinfo=UTC)


def stamp(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def virtual(name: str, down_for: float | None = None, cordoned: bool = False) -> dict[str, Any]:
    ready = (
        {"type": "Ready", "status": "True", "lastTransitionTime": stamp(3600)}
        if down_for is None
        else {"type": "Ready", "status": "Unknown", "lastTransitionTime": stamp(down_for)}
    )
    return {
        "metadata": {
            "name": name,
            "labels": {
                keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
                keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
                keys.CLUSTER_ID_LABEL: name.removeprefix("vk-"),
            },
        },
        "spec": {"unschedulable": True} if cordoned else {},
        "status": {"conditions": [ready]},
    }


def pod(
    name: str,
    node: str = "vk-lower-1",
    unschedulable_for: float | None = 120,
    phase: str = "Pending",
    owned: bool = True,
    namespace: str = "apps",
    **metadata: Any,
) -> dict[str, Any]:
    conditions = (
        []
        if unschedulable_for is None
        else [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient cpu.",
                "lastTransitionTime": stamp(unschedulable_for),
            }
        ]
    )
    owners = [
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "name": "web-1",
            "uid": "rs",
            "controller": True,
        }
    ]
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            **({"ownerReferences": owners} if owned else {}),
            **metadata,
        },
        "spec": {"nodeName": node, "containers": [{"name": "app", "image": "app"}]},
        "status": {"phase": phase, "conditions": conditions},
    }


NODES_UP = {name: virtual(name) for name in ("vk-lower-1", "vk-lower-2", "vk-lower-3")}


# -- the policy ----------------------------------------------------------------------------


def test_an_empty_policy_is_the_defaults() -> None:
    assert parse_policy("") == Policy()
    assert Policy().pending_timeout == 60 and Policy().cluster_down_timeout == 300


def test_every_policy_key() -> None:
    policy = parse_policy(
        "pendingTimeout: 5\nclusterDownTimeout: 30.5\ninterval: 2\ndefragAfter: 7\n"
        "holdTimeout: 90\nreturnAfter: 300\nmaxEvictionsPerCycle: 3\n"
        "maxEvictionsPerNamespace: 2\nmaxEvictionsPerNode: 1\n"
    )
    assert policy == Policy(
        pending_timeout=5.0,
        cluster_down_timeout=30.5,
        interval=2.0,
        defrag_after=7.0,
        hold_timeout=90.0,
        return_after=300.0,
        max_evictions_per_cycle=3,
        max_evictions_per_namespace=2,
        max_evictions_per_node=1,
    )


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("- 1\n", "must be a mapping"),
        ("pendingTimout: 5\n", "unknown key 'pendingTimout'"),
        ("defragAfter: -1\n", "not above 0"),
        ("pendingTimeout: soon\n", "'soon' is not a number"),
        ("pendingTimeout: 0\n", "not above 0"),
        ("pendingTimeout: true\n", "is not a number"),
        ("maxEvictionsPerCycle: 1.5\n", "not a whole number"),
        ("maxEvictionsPerNode: -1\n", "not a whole number"),
        # Sent to the estimators as an int32: a larger count crashed the first plan.
        ("maxEvictionsPerNode: 10000000000\n", "from 0 to 2147483647"),
        ("pendingTimeout: [\n", "not YAML"),
        # The estimators hold room no longer: every plan's room would go unheld.
        ("holdTimeout: 7200\n", "longer than the estimators hold room"),
    ],
)
def test_a_bad_policy_says_what_is_wrong(text: str, complaint: str) -> None:
    with pytest.raises(PolicyError, match=complaint):
        parse_policy(text)


# -- which pods are stuck -------------------------------------------------------------------


def test_a_pod_unschedulable_below_past_the_timeout_is_stuck() -> None:
    pods = [pod("late", unschedulable_for=61), pod("early", unschedulable_for=59)]
    (stuck,) = stuck_pods(pods, NODES_UP, NOW, Policy())
    assert (stuck.key, stuck.node, stuck.why) == ("apps/late", "vk-lower-1", Why.UNSCHEDULABLE)
    assert stuck.describe() == (
        "unschedulable in vk-lower-1 for 61 s: 0/3 nodes are available: 3 Insufficient cpu."
    )


def test_a_pod_its_lower_cluster_refuses_past_the_timeout_is_stuck() -> None:
    """The virtual node reports a refusal below (a quota, an admission webhook) as the
    lower scheduler's failure: PodScheduled False since it began."""
    refused = pod("refused", unschedulable_for=None)
    message = 'lower cluster lower-1 refused the pod: exceeded quota: "compute"'
    since = NOW - timedelta(seconds=61)
    refused["status"] = refused_status(
        refused, "LowerClusterRefused", message, since.strftime("%Y-%m-%dT%H:%M:%SZ")
    )
    (stuck,) = stuck_pods([refused], NODES_UP, NOW, Policy())
    assert (stuck.key, stuck.why) == ("apps/refused", Why.UNSCHEDULABLE)
    assert stuck.describe() == f"unschedulable in vk-lower-1 for 61 s: {message}"


def test_pods_of_a_cluster_down_past_the_timeout_are_stuck_whatever_their_phase() -> None:
    nodes = {**NODES_UP, "vk-lower-2": virtual("vk-lower-2", down_for=301)}
    pods = [
        pod("running", node="vk-lower-2", unschedulable_for=None, phase="Running"),
        pod("done", node="vk-lower-2", unschedulable_for=None, phase="Succeeded"),
        pod("fine", node="vk-lower-1", unschedulable_for=None, phase="Running"),
    ]
    (stuck,) = stuck_pods(pods, nodes, NOW, Policy())
    assert (stuck.key, stuck.why, stuck.describe()) == (
        "apps/running",
        Why.CLUSTER_DOWN,
        "vk-lower-2 NotReady for 301 s",
    )
    briefly = {**NODES_UP, "vk-lower-2": virtual("vk-lower-2", down_for=100)}
    assert stuck_pods(pods, briefly, NOW, Policy()) == []


def unreachable(name: str, down_for: float) -> dict[str, Any]:
    """A virtual node the upper node controller has found unreachable ``down_for`` ago."""
    node = virtual(name, down_for=down_for)
    node["spec"]["taints"] = [
        {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
        {
            "key": "node.kubernetes.io/unreachable",
            "effect": "NoExecute",
            "timeAdded": stamp(down_for),
        },
    ]
    return node


def tolerating(seconds: int | None, **toleration: Any) -> dict[str, Any]:
    bare = pod("bare", node="vk-lower-2", unschedulable_for=None, phase="Running", owned=False)
    bare["spec"]["tolerations"] = [
        {
            "key": "node.kubernetes.io/unreachable",
            "operator": "Exists",
            "effect": "NoExecute",
            **({} if seconds is None else {"tolerationSeconds": seconds}),
            **toleration,
        }
    ]
    return bare


@pytest.mark.parametrize(
    ("seconds", "down", "moved"),
    [
        # The default toleration: deleted 300 s after the taint, so moved 30 s before,
        # though clusterDownTimeout (300 s) is not reached.
        (300, 269, False),
        (300, 271, True),
        (60, 31, True),
        (60, 29, False),
        # Tolerated for ever: bound there whatever happens, as the taint manager leaves it.
        (None, 299, False),
        (None, 301, False),
        (None, 3600, False),
        # "For ever" written as a number past the last moment there is: it raised out of
        # every look while the cluster was down.
        (10**12, 3600, False),
        (2**63 - 1, 3600, False),
    ],
)
def test_a_pod_of_a_cluster_down_moves_before_the_taint_eviction_would_delete_it(
    seconds: int | None, down: float, moved: bool
) -> None:
    nodes = {**NODES_UP, "vk-lower-2": unreachable("vk-lower-2", down_for=down)}
    stuck = stuck_pods([tolerating(seconds)], nodes, NOW, Policy())
    assert [s.why for s in stuck] == ([Why.CLUSTER_DOWN] if moved else [])


def test_a_bare_pod_the_taint_manager_never_deletes_is_not_moved_past_the_limits() -> None:
    """Only a pod of a cluster down the taint manager would delete is lost if left; the
    policy's timeout moves the others within the limits."""
    nodes = {**NODES_UP, "vk-lower-2": virtual("vk-lower-2", down_for=400)}
    bare = pod("bare", node="vk-lower-2", unschedulable_for=None, phase="Running", owned=False)
    (stuck,) = stuck_pods([bare], nodes, NOW, Policy())
    assert stuck.why is Why.CLUSTER_DOWN and not stuck.lost_if_left
    tainted = {**NODES_UP, "vk-lower-2": unreachable("vk-lower-2", down_for=400)}
    (stuck,) = stuck_pods([bare], tainted, NOW, Policy())
    assert stuck.lost_if_left


@pytest.mark.parametrize(
    ("interval", "seconds", "down", "moved"),
    [
        (10, 300, 269, False),
        (10, 300, 271, True),
        (60, 300, 149, False),
        (60, 300, 151, True),
        (120, 300, 5, False),
        (120, 300, 121, True),
        # A short toleration: moved at once, as a window of half of it could be missed.
        (10, 10, 1, True),
        (10, 20, 9, False),
        (10, 20, 11, True),
        # Never at the first look when the toleration has room for two looks.
        (150, 300, 149, False),
        (150, 300, 151, True),
        # One of two looks at most: the first may move it, else none would.
        (200, 300, 1, True),
    ],
)
def test_with_a_long_interval_a_pod_of_a_cluster_down_moves_looks_ahead(
    interval: float, seconds: int, down: float, moved: bool
) -> None:
    """Three looks ahead, no more than half its toleration, no less than a look and a half,
    and never back to the first look when the toleration has room for two: at one look
    a minute, 30 s ahead of the taint eviction often had no look in it; three looks at
    two minutes are more than the default 300 s, and a cluster down for a moment had its
    pods moved at the first look."""
    nodes = {**NODES_UP, "vk-lower-2": unreachable("vk-lower-2", down_for=down)}
    stuck = stuck_pods([tolerating(seconds)], nodes, NOW, Policy(interval=interval))
    assert [s.why for s in stuck] == ([Why.CLUSTER_DOWN] if moved else [])
    assert all(s.lost_if_left for s in stuck)


def deleted_at(pod: dict[str, Any], node: dict[str, Any]) -> datetime | None:
    deletion = taint_deletion(pod, node)
    return None if deletion is None else deletion.at


def test_taint_deletion_follows_the_taint_managers_rule() -> None:
    node = unreachable("vk-lower-2", down_for=100)
    added = NOW - timedelta(seconds=100)
    assert deleted_at(tolerating(300), node) == added + timedelta(seconds=300)
    assert deleted_at(tolerating(None), node) is None
    assert deleted_at(tolerating(-5), node) == added
    other = tolerating(300, key="node.kubernetes.io/not-ready")
    assert deleted_at(other, node) == added, "a taint it does not tolerate: at once"
    assert deleted_at(tolerating(300), virtual("vk-lower-2", down_for=100)) is None


def with_dedicated_taint(node: dict[str, Any], weeks_ago: int) -> dict[str, Any]:
    added = stamp(weeks_ago * 7 * 86400)
    dedicated = {"key": "dedicated", "value": "x", "effect": "NoExecute", "timeAdded": added}
    node["spec"]["taints"] = [*node["spec"]["taints"], dedicated]
    return node


def test_a_taint_tolerated_for_ever_starts_no_count() -> None:
    """An admin's dedicated taint added weeks ago, which the pod tolerates for ever: taken
    for the start of the count, a cluster down for 45 s had its pods taken for ones about
    to be deleted, and the bare ones moved past the limits."""
    node = with_dedicated_taint(unreachable("vk-lower-2", down_for=45), weeks_ago=3)
    pod = tolerating(300)
    pod["spec"]["tolerations"].append({"key": "dedicated", "operator": "Exists"})
    assert deleted_at(pod, node) == NOW + timedelta(seconds=255)
    assert stuck_pods([pod], {**NODES_UP, "vk-lower-2": node}, NOW, Policy()) == []


def test_a_bare_pod_tolerating_an_hour_goes_within_the_limits_at_the_timeout() -> None:
    """clusterDownTimeout moves it; its deletion an hour off, it is not lost if left."""
    nodes = {**NODES_UP, "vk-lower-2": unreachable("vk-lower-2", down_for=301)}
    (stuck,) = stuck_pods([tolerating(3600)], nodes, NOW, Policy())
    assert stuck.why is Why.CLUSTER_DOWN and not stuck.lost_if_left


# Its controller makes a DaemonSet's pod again for the same node: moving it frees nothing.
DAEMON_SET_OWNER = {"kind": "DaemonSet", "name": "agent", "uid": "ds", "controller": True}
# A controller that may fail its whole run for one pod evicted, or never make it again.
WORKFLOW_OWNER = {
    "apiVersion": "argoproj.io/v1alpha1",
    "kind": "Workflow",
    "name": "w",
    "uid": "wf",
    "controller": True,
}
JOB_OWNER = {"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "job", "controller": True}


def test_pods_left_alone() -> None:
    pods = [
        pod("ordinary-node", node="worker-1"),
        pod("deleting", deletionTimestamp=stamp(1)),
        pod("opted-out", annotations={keys.DESCHEDULER_ANNOTATION: keys.DESCHEDULER_NEVER}),
        # Any value: a user who wrote it meant the pod to stay (the webhook warns).
        pod("opted-out-otherwise", annotations={keys.DESCHEDULER_ANNOTATION: "Never"}),
        pod("opted-out-falsely", annotations={keys.DESCHEDULER_ANNOTATION: "false"}),
        pod("running", phase="Running"),
        pod("waiting-without-a-verdict", unschedulable_for=None),
        pod("daemon", ownerReferences=[DAEMON_SET_OWNER]),
        pod("workflow-step", ownerReferences=[WORKFLOW_OWNER]),
        # Owned, by no controller (an operator's SetOwnerReference): its owner may track
        # it by name and deletes it with itself; a copy would escape both.
        pod("helper", owned=False, ownerReferences=[{**WORKFLOW_OWNER, "controller": False}]),
    ]
    # Its data is in the cluster it was placed in.
    stateful = pod("stateful")
    stateful["spec"]["volumes"] = [{"name": "d", "persistentVolumeClaim": {"claimName": "d"}}]
    pods.append(stateful)
    assert stuck_pods(pods, NODES_UP, NOW, Policy()) == []


def test_a_stuck_job_pod_is_moved_by_eviction() -> None:
    """It makes no progress where it is; its Job makes a new one (one failure counted)."""
    (stuck,) = stuck_pods([pod("batch", ownerReferences=[JOB_OWNER])], NODES_UP, NOW, Policy())
    assert stuck.owned


def job(failed: int = 0, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "j", "uid": "job"}, "spec": spec, "status": {"failed": failed}}


DISRUPTED = {"onPodConditions": [{"type": "DisruptionTarget"}]}


@pytest.mark.parametrize(
    ("stored", "annotations", "lost"),
    [
        (job(), {}, None),
        (job(failed=5), {}, None),
        # The default backoffLimit is 6: a seventh failure fails the Job.
        (job(failed=6), {}, "failed 6 times, its backoffLimit"),
        (job(failed=0, backoffLimit=0), {}, "failed 0 times, its backoffLimit"),
        (job(failed=2, backoffLimit=3), {}, None),
        # Per index, the pod's own index counts, and the Job's only against a backoffLimit
        # set beside it (none by default then).
        (job(failed=9, backoffLimitPerIndex=1), {}, None),
        (job(failed=6, backoffLimitPerIndex=1, backoffLimit=6), {}, "failed 6 times"),
        # Failures the Job controller has seen and not counted yet count too.
        (
            {
                **job(failed=1, backoffLimit=2),
                "status": {"failed": 1, "uncountedTerminatedPods": {"failed": ["x"]}},
            },
            {},
            "failed 2 times",
        ),
        (
            job(backoffLimitPerIndex=1),
            {keys.JOB_INDEX_FAILURE_COUNT_ANNOTATION: "1"},
            "its index has failed 1 times",
        ),
        (job(backoffLimitPerIndex=0), {keys.JOB_INDEX_FAILURE_COUNT_ANNOTATION: "x"}, "index"),
        # The first rule naming the eviction's condition decides.
        (job(failed=6, podFailurePolicy={"rules": [{"action": "Ignore", **DISRUPTED}]}), {}, None),
        (
            job(podFailurePolicy={"rules": [{"action": "FailJob", **DISRUPTED}]}),
            {},
            "fails the Job",
        ),
        (
            job(podFailurePolicy={"rules": [{"action": "FailIndex", **DISRUPTED}]}),
            {},
            "fails the pod's index",
        ),
        (
            job(failed=6, podFailurePolicy={"rules": [{"action": "Count", **DISRUPTED}]}),
            {},
            "6 times",
        ),
        (
            job(
                podFailurePolicy={
                    "rules": [
                        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}},
                        {"action": "Ignore", **DISRUPTED},
                    ]
                }
            ),
            {},
            None,
        ),
    ],
)
def test_a_job_pod_is_evicted_only_when_its_job_makes_it_again(
    stored: dict[str, Any], annotations: dict[str, str], lost: str | None
) -> None:
    batch = pod("batch", ownerReferences=[JOB_OWNER], annotations=annotations)
    found = job_lost_by_eviction(stored, batch)
    assert found is None if lost is None else (found is not None and lost in found), found


async def test_a_stuck_job_pod_whose_job_would_fail_stays_and_says_why() -> None:
    world = World(ROOM_IN_2)
    world.client.jobs["j"] = job(failed=6)
    world.add(pod("batch", ownerReferences=[JOB_OWNER]))
    (decision,) = await world.descheduler.cycle()
    assert isinstance(decision, Stay) and "the Job would fail" in decision.message
    assert world.client.evictions() == 0 and world.pool.asked == []
    assert world.reasons() == ["NotRescheduled"]
    world.client.jobs["j"] = job(failed=5)
    world.moment += 10
    (decision,) = await world.descheduler.cycle()
    assert isinstance(decision, Move), "a failure left to spend: moved"
    assert world.client.evictions() == 1


STATEFUL_SET_OWNER = {
    "apiVersion": "apps/v1",
    "kind": "StatefulSet",
    "name": "db",
    "uid": "sts",
    "controller": True,
}


@pytest.mark.parametrize(
    ("owner", "job_spec", "kept"),
    [
        (STATEFUL_SET_OWNER, None, True),
        (JOB_OWNER, {"podFailurePolicy": {"rules": []}}, True),
        (JOB_OWNER, {"podReplacementPolicy": "Failed"}, True),
        (
            JOB_OWNER,
            {"podFailurePolicy": {"rules": []}, "podReplacementPolicy": "TerminatingOrFailed"},
            False,
        ),
        (JOB_OWNER, {}, False),
        (None, None, False),
    ],
)
async def test_a_pod_its_controller_makes_again_only_once_gone_stays_on_a_cluster_down(
    owner: dict[str, Any] | None, job_spec: dict[str, Any] | None, kept: bool
) -> None:
    """Evicted, it stayed Terminating while its cluster was down (nothing below can let it
    go), and its controller made no new pod: the move said it did."""
    world = World(ROOM_IN_2)
    world.nodes.apply({"type": "MODIFIED", "object": virtual("vk-lower-1", down_for=400)})
    if job_spec is not None:
        world.client.jobs["j"] = job(**job_spec)
    owners = [owner] if owner is not None else [pod("x")["metadata"]["ownerReferences"][0]]
    world.add(pod("db-0", unschedulable_for=None, phase="Running", ownerReferences=owners))
    (decision,) = await world.descheduler.cycle()
    if kept:
        assert isinstance(decision, Stay) and "--force" in decision.message
        assert world.client.evictions() == 0 and world.reasons() == ["NotRescheduled"]
    else:
        assert isinstance(decision, Move) and world.client.evictions() == 1


def replacement(own_affinity: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ReplicaSet's new pod the webhook kept off vk-lower-1 (a move), waiting above."""
    made = pod("web-2", node="")
    if own_affinity is not None:
        made["spec"]["affinity"] = own_affinity
    made["spec"], made["metadata"]["annotations"] = stash_scheduling(
        made["spec"], {}, kept_off=["vk-lower-1"]
    )
    return made


def moves_until(seconds_from_now: float) -> dict[str, Any]:
    until = (NOW + timedelta(seconds=seconds_from_now)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"resourceVersion": "1"}, "data": {"rs": json.dumps({"vk-lower-1": until})}}


@pytest.mark.parametrize(
    ("moves", "evicted"),
    [(moves_until(60), False), (moves_until(-60), True), (None, True)],
    ids=["recorded", "lapsed", "no-record"],
)
async def test_a_pod_kept_off_by_a_lapsed_move_is_made_again(
    moves: dict[str, Any] | None, evicted: bool
) -> None:
    """The keep-off is in the pod's affinity, which cannot change: with no room elsewhere
    it waited above for good, while the cluster it was kept off had room again."""
    world = World({"vk-lower-2": NO_ROOM, "vk-lower-3": NO_ROOM})
    world.client.moves = moves
    world.add(replacement())
    await world.descheduler.cycle()
    assert world.client.evictions() == (1 if evicted else 0)
    assert ("Rescheduled" in world.reasons()) == evicted


async def test_a_pod_kept_off_for_nothing_waits_while_room_is_made_for_it() -> None:
    """Evicted, the plan's evictions were made for nothing."""
    world = World({"vk-lower-2": NO_ROOM, "vk-lower-3": NO_ROOM})
    world.client.moves = moves_until(-60)
    held = replacement()
    world.descheduler._holding[held["metadata"]["uid"]] = (world.moment + 60, "vk-lower-2")
    world.add(held)
    recorded = replacement()
    recorded["metadata"] |= {"name": "web-3", "uid": "uid-web-3"}
    recorded["metadata"]["annotations"][keys.DEFRAGMENTED_ANNOTATION] = defragmented_record(
        recorded, NOW - timedelta(seconds=10)
    )
    world.add(recorded)
    await world.descheduler.cycle()
    assert world.client.evictions() == 0
    world.moment += 600  # the hold and the plan's wait are over
    await world.descheduler.cycle()
    assert world.client.evictions() == 2


async def test_a_pod_s_own_keep_off_is_its_own() -> None:
    name_out = {"key": "metadata.name", "operator": "NotIn", "values": ["vk-lower-1"]}
    own = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [name_out]}]
            }
        }
    }
    world = World({"vk-lower-2": NO_ROOM, "vk-lower-3": NO_ROOM})
    world.client.moves = moves_until(-60)
    world.add(replacement(own))
    await world.descheduler.cycle()
    assert world.client.evictions() == 0


def test_each_pod_of_a_job_evicted_before_counts_as_a_failure() -> None:
    batch = pod("batch", ownerReferences=[JOB_OWNER])
    assert job_lost_by_eviction(job(failed=4), batch, evicted_before=1) is None
    lost = job_lost_by_eviction(job(failed=4), batch, evicted_before=2)
    assert lost is not None and "counting 2 of its pods evicted before it" in lost


async def test_pods_of_one_job_stuck_together_go_only_as_far_as_its_failures_to_spare() -> None:
    """Each evicted pod is one failure more: all moved at once, the Job failed."""
    world = World(ROOM_IN_2)
    world.client.jobs["j"] = job(failed=0, backoffLimit=1)
    world.add(pod("batch-a", ownerReferences=[JOB_OWNER]))
    world.add(pod("batch-b", ownerReferences=[JOB_OWNER]))
    first, second = await world.descheduler.cycle()
    assert isinstance(first, Move) and first.stuck.key == "apps/batch-a"
    assert isinstance(second, Stay) and "counting 1 of its pods evicted before it" in second.message
    assert world.client.evictions() == 1
    assert world.client.job_reads == 1, "read once for both"


async def test_a_stuck_job_pod_of_a_job_gone_or_made_again_stays() -> None:
    world = World(ROOM_IN_2)
    world.add(pod("batch", ownerReferences=[JOB_OWNER]))
    (decision,) = await world.descheduler.cycle()
    assert isinstance(decision, Stay) and "could not be read" in decision.message
    world.client.jobs["j"] = {**job(), "metadata": {"name": "j", "uid": "another"}}
    (decision,) = await world.descheduler.cycle()
    assert isinstance(decision, Stay) and decision.message == "its Job is gone"
    assert world.client.evictions() == 0


def test_stuck_pods_come_in_key_order() -> None:
    pods = [pod("b"), pod("a", namespace="zz"), pod("a")]
    keys_found = [s.key for s in stuck_pods(pods, NODES_UP, NOW, Policy())]
    assert keys_found == ["apps/a", "apps/b", "zz/a"]


# -- where each goes ------------------------------------------------------------------------


def stuck(name: str = "web", node: str = "vk-lower-1", owned: bool = True, **kw: Any) -> Stuck:
    return Stuck(pod(name, node=node, owned=owned, **kw), node, Why.UNSCHEDULABLE, 61, "full")


def fits(best_fit: float) -> PodEstimate:
    return PodEstimate(max_replicas=1, fitting_count=1, total_nodes=3, best_fit=best_fit)


NO_ROOM = PodEstimate(total_nodes=3, message="0/3 nodes are available: 3 Insufficient cpu")


def test_the_pod_goes_to_the_best_fitting_cluster_ties_to_the_first_name() -> None:
    answers = {"vk-c": fits(0.9), "vk-b": fits(0.9), "vk-a": fits(0.2), "vk-d": NO_ROOM}
    assert destination(stuck(), answers) == Move(stuck(), "vk-b")


def test_a_pod_no_cluster_can_run_stays_and_says_why() -> None:
    answers: dict[str, PodEstimate | str] = {
        "vk-b": NO_ROOM,
        "vk-c": "estimator unavailable: UNAVAILABLE",
        "vk-d": PodEstimate(error="the stash cannot be read"),
    }
    decision = destination(stuck(), answers)
    assert isinstance(decision, Stay)
    assert decision.message == (
        "no cluster can run it now (vk-b: 0/3 nodes are available: 3 Insufficient cpu; "
        "vk-c: estimator unavailable: UNAVAILABLE; vk-d: the stash cannot be read)"
    )
    assert destination(stuck(), {}) == Stay(stuck(), "no other cluster to move it to")


def test_receivers_are_the_other_ready_uncordoned_virtual_nodes() -> None:
    nodes = {
        **NODES_UP,
        "vk-down": virtual("vk-down", down_for=5),
        "vk-cordoned": virtual("vk-cordoned", cordoned=True),
    }
    assert receivers(nodes, NOW, "vk-lower-1") == ["vk-lower-2", "vk-lower-3"]


def test_limits_per_cycle_namespace_and_node() -> None:
    moves = [
        Move(stuck("a1", namespace="a"), "vk-x"),
        Move(stuck("a2", namespace="a"), "vk-x"),
        Move(stuck("b1", namespace="b", node="vk-lower-2"), "vk-x"),
        Move(stuck("c1", namespace="c"), "vk-x"),
        Move(stuck("d1", namespace="d", node="vk-lower-3"), "vk-x"),
    ]
    policy = Policy(
        max_evictions_per_cycle=3, max_evictions_per_namespace=1, max_evictions_per_node=2
    )
    allowed, deferred = within_limits(moves, Limits(policy))
    assert [m.stuck.pod["metadata"]["name"] for m in allowed] == ["a1", "b1", "c1"]
    assert [m.stuck.pod["metadata"]["name"] for m in deferred] == ["a2", "d1"]


def test_bare_pods_move_first_within_the_limits() -> None:
    """A bare pod left on a cluster that is down is lost once the taint manager deletes
    it; a controller makes its pod again anyway."""
    moves = [Move(stuck("a-owned"), "vk-x"), Move(stuck("b-bare", owned=False), "vk-x")]
    allowed, deferred = within_limits(moves, Limits(Policy(max_evictions_per_cycle=1)))
    assert [m.stuck.key for m in allowed] == ["apps/b-bare"]
    assert [m.stuck.key for m in deferred] == ["apps/a-owned"]


def test_every_bare_pod_of_a_cluster_down_moves_whatever_the_limits() -> None:
    """Left, each is lost when the taint manager deletes it (at 5 a look, 15 of 20 were);
    they count against the limits all the same, so pods with a controller wait."""
    bare = [
        Move(
            Stuck(
                pod(f"bare-{i}", owned=False), "vk-lower-1", Why.CLUSTER_DOWN, 280, "", NOW, True
            ),
            "vk-x",
        )
        for i in range(20)
    ]
    owned_down = Move(Stuck(pod("owned"), "vk-lower-1", Why.CLUSTER_DOWN, 280, ""), "vk-x")
    bare_waiting = Move(stuck("bare-pending", owned=False, namespace="other"), "vk-x")
    allowed, deferred = within_limits([*bare, owned_down, bare_waiting], Limits(Policy()))
    assert allowed == bare
    assert deferred == [bare_waiting, owned_down]


# -- the bare pod's copy --------------------------------------------------------------------


def test_a_bare_pods_copy_is_bound_elsewhere_and_named_the_same_every_time() -> None:
    original = pod(
        "solo",
        owned=False,
        labels={"app": "solo"},
        annotations={keys.STASH_ANNOTATION: "{}"},
        resourceVersion="42",
        creationTimestamp=stamp(100),
    )
    original["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox"}]
    copy = pod_copy(original, "vk-lower-2", NOW, 600)
    assert "ephemeralContainers" not in copy["spec"], "kubectl debug's: a create refuses them"
    assert copy["metadata"] == {
        "name": copy_name(original),
        "namespace": "apps",
        "labels": {"app": "solo"},
        "annotations": {
            keys.STASH_ANNOTATION: "{}",
            keys.COPY_OF_ANNOTATION: "uid-solo",
            keys.LEFT_UNTIL_ANNOTATION: json.dumps(
                {"vk-lower-1": rfc3339(NOW + timedelta(seconds=600))}
            ),
        },
    }
    assert copy["spec"]["nodeName"] == "vk-lower-2"
    assert "status" not in copy
    assert original["spec"]["nodeName"] == "vk-lower-1", "the original is not touched"
    assert copy_name(original) == copy_name(pod("solo", owned=False)) != copy_name(pod("other"))
    assert copy_name(original).startswith("solo-")
    assert is_copy_of({**copy, "metadata": {**copy["metadata"], "uid": "new"}}, original)
    assert not is_copy_of(pod("solo-x"), original)
    long_name = pod("x" * 253, owned=False)
    assert len(copy_name(long_name)) <= 253


# -- the loop -------------------------------------------------------------------------------


class FakeClient:
    """Records what the descheduler asks of the upper apiserver."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.bodies: list[Any] = []
        self.graces: list[int | None] = []
        self.events: list[dict[str, Any]] = []
        self.created: dict[str, dict[str, Any]] = {}
        self.eviction_error: ApiError | None = None
        # What an event's write raises (the apiserver out of reach).
        self.event_error: Exception | None = None
        # The pods' merge patches and what they raise; the pod cache they show in.
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.patch_error: ApiError | None = None
        self.pods: Informer | None = None
        # What a pod's delete raises, and the preconditions of each delete.
        self.delete_error: ApiError | None = None
        self.preconditions: list[dict[str, str | None]] = []
        # The moves ConfigMap, as stored; writes to refuse with this error, then accept.
        self.moves: dict[str, Any] | None = None
        self.moves_errors: list[ApiError] = []
        # Pod name -> the error its creation gets.
        self.create_errors: dict[str, ApiError] = {}
        # Job name -> the Job as stored; how many times Jobs were read.
        self.jobs: dict[str, dict[str, Any]] = {}
        self.job_reads = 0

    def evictions(self) -> int:
        return sum(path.endswith("/eviction") for _, path in self.calls)

    async def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        self.calls.append((method, path))
        self.bodies.append(kw.get("body"))
        # A budget's 429 is the descheduler's to try again, not waited out by the client.
        assert kw.get("retry_when_told") is False
        if self.eviction_error is not None:
            raise self.eviction_error
        return {}

    def _write_moves(self, body: dict[str, Any], version: str | None) -> dict[str, Any]:
        self.calls.append(("write", keys.MOVES_CONFIGMAP))
        if self.moves_errors:
            raise self.moves_errors.pop(0)
        stored = (self.moves or {}).get("metadata", {}).get("resourceVersion")
        if version != stored:
            raise ApiError(409, {"reason": "Conflict", "message": "changed meanwhile"})
        metadata = {**body["metadata"], "resourceVersion": str(int(stored or 0) + 1)}
        self.moves = {**body, "metadata": metadata}
        return self.moves

    async def replace(self, resource: Any, body: dict[str, Any], namespace: str) -> dict[str, Any]:
        assert resource is CONFIGMAPS and namespace == keys.SYSTEM_NAMESPACE
        return self._write_moves(body, body["metadata"]["resourceVersion"])

    async def create(self, resource: Any, body: dict[str, Any], namespace: str) -> dict[str, Any]:
        if body["kind"] == "Event":
            if self.event_error is not None:
                raise self.event_error
            self.events.append(body)
            return body
        if resource is CONFIGMAPS:
            assert namespace == keys.SYSTEM_NAMESPACE
            if self.moves is not None:
                raise ApiError(409, {"reason": "AlreadyExists", "message": "exists"})
            return self._write_moves(body, None)
        name = body["metadata"]["name"]
        self.calls.append(("create", f"{namespace}/{name}"))
        if name in self.create_errors:
            raise self.create_errors[name]
        if name in self.created:
            raise ApiError(409, {"reason": "AlreadyExists", "message": "exists"})
        made = {**body, "metadata": {**body["metadata"], "uid": f"uid-{name}"}}
        self.created[name] = made
        return made

    async def get(self, resource: Any, name: str, namespace: str) -> dict[str, Any]:
        if resource is JOBS:
            self.job_reads += 1
            if name not in self.jobs:
                raise ApiError(404, {"reason": "NotFound", "message": "not found"})
            return self.jobs[name]
        if resource is CONFIGMAPS:
            if self.moves is None:
                raise ApiError(404, {"reason": "NotFound", "message": "not found"})
            return self.moves
        return self.created[name]

    # The real read-modify-write, over this fake's get, create and replace.
    update_configmap_data = KubeClient.update_configmap_data

    async def patch(
        self, resource: Any, name: str, patch: dict[str, Any], namespace: str
    ) -> dict[str, Any]:
        """A merge patch of a pod's annotations, seen at once by ``pods`` (the cache)."""
        assert resource is PODS
        self.patches.append((f"{namespace}/{name}", patch))
        if self.patch_error is not None:
            raise self.patch_error
        cached = self.pods.get(f"{namespace}/{name}") if self.pods is not None else None
        if cached is None:
            return {}
        annotations = {**(cached["metadata"].get("annotations") or {})}
        for key, value in patch["metadata"]["annotations"].items():
            if value is None:
                annotations.pop(key, None)  # a merge patch's null
            else:
                annotations[key] = value
        patched = {**cached, "metadata": {**cached["metadata"], "annotations": annotations}}
        assert self.pods is not None
        self.pods.apply({"type": "MODIFIED", "object": patched})
        return patched

    async def delete_exact(
        self, resource: Any, obj: dict[str, Any], grace_period_seconds: int | None = None
    ) -> None:
        metadata = obj["metadata"]
        self.calls.append(("delete", f"{metadata['namespace']}/{metadata['name']}"))
        self.graces.append(grace_period_seconds)

    async def delete(
        self,
        resource: Any,
        name: str,
        namespace: str,
        *,
        uid: str | None = None,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        self.calls.append(("delete", f"{namespace}/{name}"))
        self.preconditions.append({"uid": uid, "resourceVersion": resource_version})
        if self.delete_error is not None:
            raise self.delete_error
        return {}


class FakePool:
    def __init__(self, answers: Mapping[str, Answer]) -> None:
        self.answers = answers
        self.asked: list[tuple[list[str], PodQuery]] = []
        # Virtual node -> its plans; -> how many of the pods asked in turn it takes.
        self.plans: dict[str, list[Freeing]] = {}
        self.room: dict[str, int] = {}
        self.defragment_asked: dict[str, DefragmentRequest] = {}
        self.held: list[tuple[str, HoldRequest]] = []
        self.released: list[tuple[list[str], str]] = []
        # Virtual node -> the names of the pods asked in turn, each time.
        self.asked_in_turn: list[tuple[str, list[str]]] = []
        self.in_turn_failure: EstimatorFailure | None = None
        # Pod name -> the answers for it, where they are not ``answers``.
        self.answers_for: dict[str, Mapping[str, Answer]] = {}

    async def estimate(
        self, names: Sequence[str], query: PodQuery, timeout: float
    ) -> dict[str, Answer]:
        self.asked.append((list(names), query))
        answers = self.answers_for.get(orjson.loads(query.pod)["metadata"]["name"], self.answers)
        return {name: answers[name] for name in names}

    async def defragment(
        self, name: str, request: DefragmentRequest, timeout: float
    ) -> DefragmentResponse:
        self.defragment_asked[name] = request
        return DefragmentResponse(cluster_id=name, plans=self.plans.get(name, []))

    async def fit_in_turn(
        self, name: str, request: FitInTurnRequest, timeout: float
    ) -> FitInTurnResponse | EstimatorFailure:
        pods = [orjson.loads(pod) for pod in request.pods]
        self.asked_in_turn.append((name, [p["metadata"]["name"] for p in pods]))
        if self.in_turn_failure is not None:
            return self.in_turn_failure
        room = self.room.get(name, 0)
        nodes = ["n" if index < room else "" for index in range(len(request.pods))]
        return FitInTurnResponse(cluster_id=name, nodes=nodes)

    async def hold(self, name: str, request: HoldRequest, timeout: float) -> None:
        self.held.append((name, request))

    def release(self, names: Sequence[str], uid: str) -> None:
        self.released.append((list(names), uid))


START = 1000.0


class World:
    def __init__(self, answers: Mapping[str, Answer], dry_run: bool = False) -> None:
        self.client = FakeClient()
        self.pool = FakePool(answers)
        self.pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
        self.nodes = Informer(client=None, resource=NODES)  # type: ignore[arg-type]
        self.budgets = Informer(client=None, resource=PODDISRUPTIONBUDGETS)  # type: ignore[arg-type]
        self.namespaces = Informer(client=None, resource=NAMESPACES)  # type: ignore[arg-type]
        for node in NODES_UP.values():
            self.nodes.apply({"type": "ADDED", "object": node})
        self.client.pods = self.pods
        self.descheduler = Descheduler(
            self.client,  # type: ignore[arg-type]
            self.pods,
            self.nodes,
            self.budgets,
            self.namespaces,
            self.pool,  # type: ignore[arg-type]
            Policy(),
            dry_run=dry_run,
            # The wall clock moves with the monotonic one, from NOW.
            now=lambda: NOW + timedelta(seconds=self.moment - START),
            clock=lambda: self.moment,
        )
        self.moment = START

    def add(self, obj: dict[str, Any]) -> None:
        self.pods.apply({"type": "ADDED", "object": obj})

    def reasons(self) -> list[str]:
        return [event["reason"] for event in self.client.events]


ROOM_IN_2: dict[str, Answer] = {"vk-lower-2": fits(0.5), "vk-lower-3": NO_ROOM}


async def test_a_controllers_pod_is_evicted_through_the_eviction_api() -> None:
    world = World(ROOM_IN_2)
    world.add(pod("web"))
    (decision,) = await world.descheduler.cycle()
    assert decision == Move(stuck_pods([pod("web")], NODES_UP, NOW, Policy())[0], "vk-lower-2")
    assert world.client.calls == [
        ("write", keys.MOVES_CONFIGMAP),
        ("POST", "/api/v1/namespaces/apps/pods/web/eviction"),
    ]
    assert world.pool.asked[0][0] == ["vk-lower-2", "vk-lower-3"]
    assert not world.pool.asked[0][1].reserve
    (event,) = world.client.events
    assert event["reason"] == "Rescheduled"
    assert event["involvedObject"]["uid"] == "uid-web"
    assert "evicted from vk-lower-1" in event["message"] and "vk-lower-2" in event["message"]


async def test_an_eviction_holds_only_for_the_pod_as_it_was_judged() -> None:
    """The cache may be seconds behind by a look's last move: a pod placed below
    meanwhile was evicted all the same. Changed since (a 409), it is judged again at the
    next look."""
    world = World(ROOM_IN_2)
    world.add(pod("web", resourceVersion="41"))
    world.client.eviction_error = ApiError(409, {"reason": "Conflict", "message": "changed"})
    await world.descheduler.cycle()
    (body,) = world.client.bodies
    assert body["deleteOptions"]["preconditions"] == {"uid": "uid-web", "resourceVersion": "41"}
    assert world.reasons() == [], "nobody was evicted"
    world.client.eviction_error = None
    world.add(pod("web", resourceVersion="42"))
    await world.descheduler.cycle()
    assert world.client.bodies[-1]["deleteOptions"]["preconditions"]["resourceVersion"] == "42"
    assert world.reasons() == ["Rescheduled"]


async def test_an_eviction_a_budget_refuses_is_tried_again_later() -> None:
    world = World(ROOM_IN_2)
    world.add(pod("web"))
    world.client.eviction_error = ApiError(
        429, {"message": "Cannot evict pod as it would violate the pod's disruption budget."}
    )
    await world.descheduler.cycle()
    assert world.reasons() == ["EvictionBlocked"]
    evictions = world.client.evictions
    assert "disruption budget" in world.client.events[0]["message"]
    await world.descheduler.cycle()
    assert evictions() == 1, "not again before the retry time"
    world.moment += 31
    await world.descheduler.cycle()
    assert evictions() == 2
    assert world.reasons() == ["EvictionBlocked"], "said once while it stays so"
    world.moment += 31
    world.client.eviction_error = None
    await world.descheduler.cycle()
    assert evictions() == 3
    assert world.reasons() == ["EvictionBlocked", "Rescheduled"]


async def test_a_move_the_apiserver_refuses_waits_and_the_others_go_on() -> None:
    world = World(ROOM_IN_2)
    world.pool.room["vk-lower-2"] = 2
    first, second = (pod(name, owned=False) for name in ("a-first", "b-second"))
    world.add(first)
    world.add(second)
    quota = ApiError(403, {"reason": "Forbidden", "message": 'exceeded quota: "compute"'})
    world.client.create_errors[copy_name(first)] = quota
    await world.descheduler.cycle()
    assert ("create", f"apps/{copy_name(second)}") in world.client.calls, "the next still moves"
    (refused,) = [e for e in world.client.events if e["reason"] == "NotRescheduled"]
    assert refused["involvedObject"]["name"] == "a-first"
    assert 'exceeded quota: "compute"' in refused["message"]
    assert refused["type"] == "Warning"
    copy_of_first = ("create", f"apps/{copy_name(first)}")
    assert world.client.calls.count(copy_of_first) == 1
    await world.descheduler.cycle()
    assert world.client.calls.count(copy_of_first) == 1, "not again before 30 s"
    world.moment += 31
    await world.descheduler.cycle()
    assert world.client.calls.count(copy_of_first) == 2
    assert world.reasons().count("NotRescheduled") == 1, "said once while it stays so"
    del world.client.create_errors[copy_name(first)]
    world.moment += 31
    await world.descheduler.cycle()
    assert world.client.calls.count(copy_of_first) == 3
    assert copy_name(first) in world.client.created


async def test_the_move_is_recorded_before_the_eviction_and_a_lost_race_written_again() -> None:
    world = World(ROOM_IN_2)
    world.client.moves = {
        "metadata": {"name": keys.MOVES_CONFIGMAP, "resourceVersion": "7"},
        "data": {"rs-other": '{"vk-lower-3": "2099-01-01T00:00:00Z"}'},
    }
    world.client.moves_errors = [ApiError(409, {"reason": "Conflict", "message": "changed"})]
    world.add(pod("web"))
    await world.descheduler.cycle()
    assert world.client.calls == [
        ("write", keys.MOVES_CONFIGMAP),
        ("write", keys.MOVES_CONFIGMAP),
        ("POST", "/api/v1/namespaces/apps/pods/web/eviction"),
    ]
    assert world.client.moves is not None
    assert parse_moves(world.client.moves["data"]) == {
        "rs-other": {"vk-lower-3": datetime(2099, 1, 1, tzinfo=UTC)},
        "rs": {"vk-lower-1": NOW + timedelta(seconds=Policy().return_after)},
    }


async def test_a_move_that_cannot_be_recorded_is_not_made_this_cycle() -> None:
    world = World(ROOM_IN_2)
    world.client.moves_errors = [ApiError(403, {"reason": "Forbidden", "message": "no"})]
    world.add(pod("web"))
    await world.descheduler.cycle()
    assert world.client.evictions() == 0
    await world.descheduler.cycle()
    assert world.client.evictions() == 1, "made the next cycle"


def taken(copy: dict[str, Any], uid: str = "uid-copy") -> dict[str, Any]:
    """The copy as its cluster has taken it: its lower scheduler's verdict came up."""
    scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp(1)}
    return {
        **copy,
        "metadata": {**copy["metadata"], "uid": uid, "resourceVersion": "7"},
        "status": {"phase": "Pending", "conditions": [scheduled]},
    }


async def test_a_bare_pod_is_copied_and_the_original_goes_once_the_copy_is_taken() -> None:
    world = World(ROOM_IN_2)
    solo = pod("solo", owned=False, resourceVersion="5")
    world.add(solo)
    await world.descheduler.cycle()
    name = copy_name(solo)
    assert world.client.calls == [("create", f"apps/{name}")]
    made = world.client.created[name]
    assert made["spec"]["nodeName"] == "vk-lower-2"
    assert world.reasons() == ["Rescheduled"]
    assert "the original goes once vk-lower-2 has taken it" in world.client.events[0]["message"]
    # Made above, not yet below: the original stays.
    world.add(made)
    await world.descheduler.cycle()
    assert world.client.calls == [("create", f"apps/{name}")]
    world.add(taken(made))
    await world.descheduler.cycle()
    assert world.client.calls[1:] == [("delete", "apps/solo")]
    assert world.client.preconditions == [{"uid": "uid-solo", "resourceVersion": "5"}]
    assert world.reasons() == ["Rescheduled", "Rescheduled"]
    assert f"re-created as pod {name} on vk-lower-2" in world.client.events[1]["message"]


async def test_a_copy_its_cluster_refused_goes_and_the_original_is_copied_elsewhere() -> None:
    """The lower apiserver refused the copy (an admission policy of that cluster alone)
    and the virtual node failed it: the original, still there, is the pod, copied
    elsewhere in the same cycle (a pod of a cluster down has no later one to wait for).
    Until 2026-11-29 the failed copy stopped the move for good, though lower-3 could run
    it."""
    world = World({"vk-lower-2": fits(0.9), "vk-lower-3": fits(0.3)})
    solo = pod("solo", owned=False, resourceVersion="5")
    world.add(solo)
    await world.descheduler.cycle()
    name = copy_name(solo)
    made = world.client.created.pop(name)
    assert made["spec"]["nodeName"] == "vk-lower-2"
    refused = {"phase": "Failed", "reason": "LowerClusterRejected", "message": "denied by policy"}
    old = {**made, "metadata": {**made["metadata"], "uid": "uid-copy"}, "status": refused}
    world.add(old)
    world.client.calls.clear()
    await world.descheduler.cycle()
    assert world.client.calls == [("delete", f"apps/{name}"), ("create", f"apps/{name}")]
    again = world.client.created[name]
    assert again["spec"]["nodeName"] == "vk-lower-3"
    assert set(left_until(again)) == {"vk-lower-1", "vk-lower-2"}
    kept = world.pods.get("apps/solo")
    assert kept is not None and set(kept_off(kept, NOW)) == {"vk-lower-2"}
    # Written over the pod as cached, or not at all: a stale one lacks earlier keep-offs.
    assert world.client.patches[-1][1]["metadata"]["resourceVersion"] == "5"
    said = [e for e in world.client.events if e["reason"] == "NotRescheduled"]
    assert [e["involvedObject"]["name"] for e in said] == ["solo"]
    refused_by = f"its copy {name} was refused by vk-lower-2"
    assert f"{refused_by} (LowerClusterRejected: denied by policy)" in said[0]["message"]
    # The cache shows the refused copy a while yet: it is not taken for the new one.
    world.client.calls.clear()
    await world.descheduler.cycle()
    assert world.client.calls == [("create", f"apps/{name}")], "found made, not withdrawn again"
    assert len([e for e in world.client.events if e["reason"] == "NotRescheduled"]) == 1


def test_only_a_copy_refused_before_it_was_made_below_is_withdrawn() -> None:
    made = pod_copy(pod("solo", owned=False), "vk-lower-2", NOW, 600)
    failed = {"phase": "Failed", "reason": keys.OUTSIDE_QUOTA_SLICES, "message": "no slices"}
    assert copy_refused({**made, "status": failed})
    scheduled = {"type": "PodScheduled", "status": "True"}
    for status, metadata in (
        # Lost after a node below took it: it may have run.
        ({**failed, "reason": "LowerPodDeleted"}, {}),
        ({**failed, "hostIP": "10.0.0.7"}, {}),
        ({**failed, "conditions": [scheduled]}, {}),
        (failed, {"deletionTimestamp": "2026-11-23T11:00:00Z"}),
        ({**failed, "phase": "Pending"}, {}),
    ):
        judged = {**made, "metadata": {**made["metadata"], **metadata}, "status": status}
        assert not copy_refused(judged), (status, metadata)


async def test_a_pod_whose_copies_every_cluster_refused_stays_and_says_where_it_is_kept_off() -> (
    None
):
    world = World(ROOM_IN_2)
    left = json.dumps({"vk-lower-2": rfc3339(NOW + timedelta(seconds=300))})
    world.add(pod("solo", owned=False, annotations={keys.LEFT_UNTIL_ANNOTATION: left}))
    world.pool.answers = {"vk-lower-3": NO_ROOM}
    (decision,) = await world.descheduler.cycle()
    assert isinstance(decision, Stay)
    assert [names for names, _ in world.pool.asked] == [["vk-lower-3"]]
    assert "vk-lower-2: left out until 2026-11-23T12:05:00Z" in decision.message


async def test_a_dry_run_withdraws_no_refused_copy_and_says_it_would(
    capsys: pytest.CaptureFixture[str],
) -> None:
    world = World(ROOM_IN_2, dry_run=True)
    solo = pod("solo", owned=False)
    made = pod_copy(solo, "vk-lower-3", NOW, 600)
    made["metadata"]["uid"] = "uid-copy"
    made["status"] = {"phase": "Failed", "reason": keys.VOLUME_REFUSED}
    world.add(solo)
    world.add(made)
    await world.descheduler.cycle()
    assert world.client.calls == [] and world.client.patches == []
    printed = capsys.readouterr().out
    assert f"dry run: apps/solo: delete {copy_name(solo)}; its copy" in printed
    assert "refused by vk-lower-3 (VolumeRefused)" in printed
    assert "re-create" not in printed


async def test_an_original_changed_since_it_was_judged_is_not_said_to_be_re_created() -> None:
    world = World(ROOM_IN_2)
    solo = pod("solo", owned=False)
    world.add(solo)
    world.add(taken(pod_copy(solo, "vk-lower-2", NOW, 600)))
    world.client.delete_error = ApiError(409, {"reason": "Conflict", "message": "changed"})
    await world.descheduler.cycle()
    assert world.client.calls == [("delete", "apps/solo")]
    assert world.reasons() == []


async def test_bare_pods_sent_to_one_cluster_in_a_cycle_go_as_far_as_its_room_goes() -> None:
    """Each estimate counts the same free room: three stuck pods each fit vk-lower-2,
    which has room for two of them together. The third waits for the next cycle, where
    the estimators count the copies bound meanwhile."""
    world = World(ROOM_IN_2)
    world.pool.room["vk-lower-2"] = 2
    for name in ("a", "b", "c"):
        world.add(pod(name, owned=False))
    world.add(pod("web"))
    await world.descheduler.cycle()
    assert world.pool.asked_in_turn == [("vk-lower-2", ["a", "b", "c"])]
    made = sorted(
        c["metadata"]["annotations"][keys.COPY_OF_ANNOTATION] for c in world.client.created.values()
    )
    assert made == ["uid-a", "uid-b"]
    assert ("delete", "apps/c") not in world.client.calls
    assert world.client.evictions() == 1, "a controller's pod is placed by the scheduler"
    assert "NotRescheduled" not in world.reasons(), "nothing to say: it moves next cycle"


async def test_an_estimator_that_cannot_say_how_many_fit_in_turn_takes_one() -> None:
    world = World(ROOM_IN_2)
    world.pool.in_turn_failure = EstimatorFailure("deadline")
    for name in ("a", "b"):
        world.add(pod(name, owned=False))
    await world.descheduler.cycle()
    assert list(world.client.created) == [copy_name(pod("a"))]


async def test_a_bare_pod_is_not_copied_back_to_a_cluster_it_left_within_return_after() -> None:
    """Two clusters that both refuse the pod (a policy below, which the estimators do not
    model): its copies went from one to the other and back for good."""
    world = World({"vk-lower-1": fits(0.5), "vk-lower-3": NO_ROOM})
    solo = pod("solo", owned=False)
    copy = pod_copy(solo, "vk-lower-2", NOW, Policy().return_after)
    copy["metadata"]["uid"] = "uid-copy"
    copy["status"] = solo["status"]  # stuck in vk-lower-2 too
    world.add(copy)
    (stay,) = await world.descheduler.cycle()
    assert isinstance(stay, Stay) and world.client.calls == []
    assert world.pool.asked[0][0] == ["vk-lower-3"], "not vk-lower-1, which it left"
    world.moment += Policy().return_after + 1
    (move,) = await world.descheduler.cycle()
    assert isinstance(move, Move) and move.to == "vk-lower-1"
    made = world.client.created[copy_name(copy)]
    assert set(left_until(made)) == {"vk-lower-2"}, "vk-lower-1's lapsed"


@pytest.mark.parametrize(
    "written",
    [
        "",
        "[",
        "[1]",
        '{"vk-1": 5}',
        '{"vk-1": "soon"}',
        '{"vk-1": "2026-11-23T10:00:00"}',
        # No UTC form: written back on the pod's copy, it raised out of every look.
        '{"vk-1": "9999-12-31T23:59:59-12:00"}',
    ],
)
def test_an_unreadable_left_until_entry_keeps_the_pod_off_nothing(written: str) -> None:
    solo = pod("solo", owned=False, annotations={keys.LEFT_UNTIL_ANNOTATION: written})
    assert left_until(solo) == {} and kept_off(solo, NOW) == set()


async def test_a_copy_its_cluster_never_took_is_withdrawn_not_copied_in_turn() -> None:
    """The copy's cluster went down before it made the copy below: copied in turn, the
    original (never deleted, its copy never taken) ran beside the copy's copy once its
    own cluster was back."""
    world = World(ROOM_IN_2)
    solo = pod("solo", owned=False)
    world.add(solo)
    made = pod_copy(solo, "vk-lower-3", NOW, 600)
    made["metadata"]["uid"] = "uid-copy"
    made["status"] = {"phase": "Pending"}  # never made below
    world.add(made)
    world.nodes.apply({"type": "MODIFIED", "object": virtual("vk-lower-3", down_for=400)})
    await world.descheduler.cycle()
    name = copy_name(solo)
    assert ("delete", f"apps/{name}") in world.client.calls
    assert ("create", f"apps/{copy_name(made)}") not in world.client.calls
    assert ("delete", "apps/solo") not in world.client.calls
    # At once: deleted gracefully from a cluster down, it stayed Terminating until that
    # cluster was back, and its name, the next copy's, held every new copy back.
    assert world.client.graces == [0]


async def test_a_cluster_that_refused_a_copy_is_not_given_the_next_one() -> None:
    """Ranked first again, the cluster refusing it (a policy below the estimators do not
    model) got a copy at every other look, and the one that would run it never did."""
    world = World({"vk-lower-2": fits(0.9), "vk-lower-3": fits(0.3)})
    solo = pod("solo", owned=False)
    world.add(solo)
    await world.descheduler.cycle()
    name = copy_name(solo)
    made = world.client.created.pop(name)
    assert made["spec"]["nodeName"] == "vk-lower-2"
    made["status"] = {
        **refused_status(made, "LowerClusterRefused", "denied", stamp(0)),
        "phase": "Pending",
    }
    world.add(made)
    world.moment += Policy().pending_timeout + 1
    await world.descheduler.cycle()
    assert ("delete", f"apps/{name}") in world.client.calls
    kept = world.pods.get("apps/solo")
    assert kept is not None and set(kept_off(kept, NOW)) == {"vk-lower-2"}
    assert world.client.patches[-1][1]["metadata"]["uid"] == "uid-solo", "this pod, no other"
    world.pods.apply({"type": "DELETED", "object": made})
    await world.descheduler.cycle()
    assert world.client.created[name]["spec"]["nodeName"] == "vk-lower-3"


def sliced(**slices: int) -> dict[str, Any]:
    """The namespace apps as the multischeduler records where its quota slices are."""
    record = Applied(Amount(cpu=2000, memory=4 * 2**30), slices)
    return {
        "metadata": {
            "name": "apps",
            "annotations": {keys.SLICE_APPLIED_ANNOTATION: record.encode()},
        }
    }


def test_clusters_holding_none_of_a_namespace_s_slices_are_refused_with_the_reason() -> None:
    record = Applied(Amount(cpu=2000, memory=0), {"lower-3": 2, "lower-1": 0}).encode()
    names = ["vk-lower-1", "vk-lower-2", "vk-lower-3"]
    assert outside_slices(pod("web"), NODES_UP, names, record) == {
        "vk-lower-1": "namespace apps holds no quota slices in lower-1 (its slices: lower-3 2)",
        "vk-lower-2": "namespace apps holds no quota slices in lower-2 (its slices: lower-3 2)",
    }
    # No record, or slices placed nowhere yet (the extender alone judges): none refused.
    assert outside_slices(pod("web"), NODES_UP, names, None) == {}
    assert outside_slices(pod("web"), NODES_UP, names, Applied(Amount(), {}).encode()) == {}


async def test_a_pod_moves_only_to_a_cluster_holding_its_namespace_s_slices() -> None:
    """lower-2 fits the bare pod best, but holds none of its namespace's slices: its
    virtual node would fail the copy bound there (OutsideQuotaSlices), a controller's
    replacement would be refused there by the extender."""
    for owned in (False, True):
        world = World({"vk-lower-2": fits(0.9), "vk-lower-3": fits(0.3)})
        world.namespaces.apply({"type": "ADDED", "object": sliced(**{"lower-1": 1, "lower-3": 1})})
        world.add(pod("solo", owned=owned))
        (decision,) = await world.descheduler.cycle()
        assert isinstance(decision, Move) and decision.to == "vk-lower-3", owned
        assert [names for names, _ in world.pool.asked] == [["vk-lower-3"]]


async def test_a_pod_whose_slices_are_all_where_it_is_stuck_stays_and_says_why() -> None:
    world = World(ROOM_IN_2)
    world.namespaces.apply({"type": "ADDED", "object": sliced(**{"lower-1": 2})})
    world.add(pod("solo", owned=False))
    (decision,) = await world.descheduler.cycle()
    assert isinstance(decision, Stay)
    assert world.pool.asked == [] and world.client.created == {}
    (said,) = world.client.events
    assert said["reason"] == "NotRescheduled"
    assert (
        "vk-lower-2: namespace apps holds no quota slices in lower-2 (its slices: lower-1 2)"
    ) in said["message"]


async def test_room_is_made_only_in_a_cluster_holding_the_waiting_pod_s_slices() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    world.namespaces.apply({"type": "ADDED", "object": sliced(**{"lower-2": 1})})
    assert await world.descheduler.cycle() == []
    assert [names for names, _ in world.pool.asked] == [["vk-lower-2"]]
    assert world.pool.defragment_asked == {}, "lower-1's plan not asked for"
    assert world.client.evictions() == 0


async def test_a_plan_s_evicted_pods_go_only_where_their_namespace_has_slices() -> None:
    """The waiting pod's namespace is another; b's, sliced in lower-2 alone, has no room
    there: lower-3's room is not for it."""
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    big = federated("big")
    big["metadata"]["namespace"] = "other"
    world.pods.apply({"type": "DELETED", "object": federated("big")})
    world.add(big)
    world.namespaces.apply({"type": "ADDED", "object": sliced(**{"lower-1": 1, "lower-2": 1})})
    assert await world.descheduler.cycle() == []
    assert [name for name, _ in world.pool.asked_in_turn] == ["vk-lower-2"]
    assert world.client.evictions() == 0
    assert "no other cluster has room for apps/b" in world.client.events[-1]["message"]


async def test_a_copy_made_before_a_crash_is_found_and_only_the_original_deleted() -> None:
    world = World(ROOM_IN_2)
    solo = pod("solo", owned=False)
    world.client.created[copy_name(solo)] = taken(pod_copy(solo, "vk-lower-2", NOW, 600))
    world.add(solo)
    await world.descheduler.cycle()
    assert world.client.calls == [("create", f"apps/{copy_name(solo)}"), ("delete", "apps/solo")]


async def test_a_copy_the_cache_holds_finishes_the_move_though_its_room_is_taken() -> None:
    """Restarted after a crash between the two steps: the copy now takes the room the
    estimators would find for the original, so the move is finished without asking them."""
    world = World({"vk-lower-2": NO_ROOM, "vk-lower-3": NO_ROOM})
    solo = pod("solo", owned=False)
    world.add(solo)
    world.add(taken(pod_copy(solo, "vk-lower-2", NOW, 600)))
    (decision,) = [d for d in await world.descheduler.cycle() if isinstance(d, Move)]
    assert (decision.stuck.key, decision.to) == ("apps/solo", "vk-lower-2")
    assert world.client.calls == [("delete", "apps/solo")]
    assert world.pool.asked == []
    assert world.reasons() == ["Rescheduled"]


async def test_a_name_taken_by_another_pod_stops_the_copy() -> None:
    world = World(ROOM_IN_2)
    solo = pod("solo", owned=False)
    world.client.created[copy_name(solo)] = pod(copy_name(solo))
    world.add(solo)
    await world.descheduler.cycle()
    assert ("delete", "apps/solo") not in world.client.calls
    assert world.reasons() == ["NotRescheduled"]
    world.moment += 31
    await world.descheduler.cycle()
    assert world.reasons() == ["NotRescheduled"], "said once while it stays so"


async def test_a_copy_that_failed_or_goes_never_takes_the_original_with_it() -> None:
    """A copy a node had admitted, failed since, and one being deleted: left to the user."""
    failed = {"status": {"phase": "Failed", "hostIP": "10.0.0.7"}}
    for ending in (failed, {"deletionTimestamp": "2026-11-23T11:00:00Z"}):
        world = World({"vk-lower-2": NO_ROOM, "vk-lower-3": NO_ROOM})
        solo = pod("solo", owned=False)
        made = pod_copy(solo, "vk-lower-2", NOW, 600)
        made["metadata"]["uid"] = "uid-copy"
        if "status" in ending:
            made["status"] = ending["status"]
        else:
            made["metadata"] |= ending
        world.add(solo)
        world.add(made)
        await world.descheduler.cycle()
        assert ("delete", "apps/solo") not in world.client.calls, ending
        (said,) = world.client.events
        assert said["reason"] == "NotRescheduled"
        assert "has failed or is being deleted" in said["message"]


async def test_a_move_cut_short_is_finished_once_the_original_is_no_longer_stuck() -> None:
    world = World(ROOM_IN_2)
    solo = pod("solo", owned=False, unschedulable_for=None, phase="Running")
    made = taken(pod_copy(solo, "vk-lower-2", NOW, 600))
    world.add(solo)
    world.add(made)
    assert unfinished_moves([solo, made]) == [(solo, made)]
    await world.descheduler.cycle()
    assert world.client.calls == [("delete", "apps/solo")]
    (event,) = world.client.events
    assert (event["reason"], event["involvedObject"]["name"]) == ("Rescheduled", "solo")
    assert "which its cluster has taken" in event["message"]
    other = pod("other", owned=False)
    stranger = {**made, "metadata": {**made["metadata"], "name": "not-its-copy-name"}}
    failed = {**made, "status": {"phase": "Failed"}}
    untaken = {**made, "status": {"phase": "Pending"}}
    assert unfinished_moves([other, made]) == [], "no original of that UID"
    assert unfinished_moves([solo, stranger]) == [] and unfinished_moves([solo, failed]) == []
    assert unfinished_moves([solo, untaken]) == [], "not taken below yet"
    running = {**made, "status": {"phase": "Running"}}
    admitted = {**made, "status": {"phase": "Pending", "hostIP": "10.0.0.1"}}
    assert unfinished_moves([solo, running]) == [(solo, running)]
    assert unfinished_moves([solo, admitted]) == [(solo, admitted)]
    waiting_below = {
        **made,
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
        },
    }
    assert unfinished_moves([solo, waiting_below]) == [(solo, waiting_below)]
    # But it is no reason to delete an original that runs again: the copy goes instead.
    world = World(ROOM_IN_2)
    world.add(solo)
    world.add(waiting_below)
    await world.descheduler.cycle()
    assert world.client.calls == [("delete", f"apps/{made['metadata']['name']}")]
    assert world.client.graces == [0]
    (event,) = world.client.events
    assert (event["reason"], event["involvedObject"]["name"]) == ("NotRescheduled", "solo")
    assert "it runs again" in event["message"]
    # A copy waiting below for room, and an original not running either: both wait.
    world = World(ROOM_IN_2)
    world.add(pod("solo", owned=False, unschedulable_for=30))
    world.add(waiting_below)
    await world.descheduler.cycle()
    assert world.client.calls == []
    # The virtual node's own word for a create the lower apiserver refuses (an admission
    # policy's 403): not taken.
    refused = {
        **made,
        "status": refused_status(made, "LowerClusterRefused", "denied", "2026-11-23T12:00:00Z"),
    }
    assert unfinished_moves([solo, refused]) == []


async def test_the_copy_of_a_pod_waiting_out_a_failed_delete_is_not_taken_for_running_again() -> (
    None
):
    """Its cluster down, its delete refused (a 500): waiting out the failed try it is not
    among the cycle's stuck pods, and with its stale Running phase its copy was taken for
    one of a pod that runs again and deleted; the taint manager then deleted the
    original, and the pod ran nowhere."""
    world = World(ROOM_IN_2)
    world.nodes.apply({"type": "MODIFIED", "object": virtual("vk-lower-1", down_for=400)})
    solo = pod("solo", owned=False, unschedulable_for=None, phase="Running")
    world.add(solo)
    waiting_below = {
        **taken(pod_copy(solo, "vk-lower-2", NOW, 600)),
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
        },
    }
    world.add(waiting_below)
    world.client.delete_error = ApiError(500, {"message": "etcd timed out"})
    await world.descheduler.cycle()
    assert world.client.calls == [("delete", "apps/solo")]
    world.client.delete_error = None
    world.moment += 10
    await world.descheduler.cycle()
    assert world.client.calls == [("delete", "apps/solo")], "nothing before the retry"
    world.moment += 21
    await world.descheduler.cycle()
    assert world.client.calls == [("delete", "apps/solo")] * 2


async def test_a_pod_no_cluster_can_run_is_left_and_said_once() -> None:
    world = World({"vk-lower-2": NO_ROOM, "vk-lower-3": EstimatorFailure("deadline")})
    world.add(pod("web"))
    await world.descheduler.cycle()
    await world.descheduler.cycle()
    assert world.client.calls == []
    assert world.reasons() == ["NotRescheduled"]
    assert "vk-lower-3: estimator unavailable: deadline" in world.client.events[0]["message"]


async def test_a_dry_run_moves_nothing_and_prints_the_plan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    world = World(ROOM_IN_2, dry_run=True)
    world.add(pod("web"))
    world.add(pod("solo", owned=False))
    await world.descheduler.cycle()
    assert world.client.calls == [] and world.client.events == []
    printed = capsys.readouterr().out
    assert "dry run: apps/web: unschedulable in vk-lower-1 for 120 s" in printed
    assert f"re-create as {copy_name(pod('solo'))} on vk-lower-2" in printed


# -- defragmentation -----------------------------------------------------------------------


def federated(name: str, waiting_for: float = 120, **spec: Any) -> dict[str, Any]:
    """An unbound pod the upper scheduler has found no node for."""
    waiting = pod(name, node="", unschedulable_for=waiting_for, owned=False)
    waiting["spec"] = {
        "tolerations": [
            {
                "key": keys.PROVIDER_TAINT_KEY,
                "operator": "Equal",
                "value": keys.PROVIDER_TAINT_VALUE,
                "effect": "NoSchedule",
            }
        ],
        "containers": [{"name": "app", "image": "app"}],
        **spec,
    }
    return waiting


def running(name: str, node: str = "vk-lower-1", **spec: Any) -> dict[str, Any]:
    bound = pod(name, node=node, unschedulable_for=None, phase="Running")
    bound["metadata"]["labels"] = {"app": "small"}
    bound["spec"].update(spec)
    return bound


def budget(allowed: int, name: str = "small", **selector: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "apps"},
        "spec": {"selector": selector or {"matchLabels": {"app": "small"}}},
        "status": {"disruptionsAllowed": allowed},
    }


def waiting_one(pod_json: dict[str, Any]) -> Waiting:
    (found,) = waiting_pods([pod_json], NOW, Policy())
    return found


def test_a_federated_pod_the_scheduler_cannot_place_waits_past_defrag_after() -> None:
    pods = [
        federated("late", 61),
        federated("early", 59),
        federated("important", 61, priority=1000),
        {**federated("plain", 61), "spec": {"containers": []}},
        federated("bound", 61, nodeName="vk-lower-1"),
        pod("never", node="", annotations={keys.DESCHEDULER_ANNOTATION: keys.DESCHEDULER_NEVER}),
        # Its PriorityClass says it never displaces running pods.
        federated("patient", 61, preemptionPolicy="Never"),
    ]
    found = waiting_pods(pods, NOW, Policy())
    assert [w.key for w in found] == ["apps/important", "apps/late"]
    assert found[1].seconds == 61 and "Insufficient cpu" in found[1].message
    gated = federated("gated")
    gated["status"]["conditions"][0]["reason"] = "SchedulingGated"
    assert waiting_pods([gated], NOW, Policy()) == []


def test_movable_pods_are_running_controller_pods_of_no_higher_priority() -> None:
    waiting = waiting_one(federated("big", priority=100))
    pods = [
        running("ok"),
        running("elsewhere", node="vk-lower-2"),
        running("on-a-real-node", node="real-1"),
        running("higher", priority=200),
        running("equal", priority=100),
        {**running("bare"), "metadata": {**running("bare")["metadata"], "ownerReferences": []}},
        pod("pending", unschedulable_for=None),
        running("system")
        | {"metadata": {**running("system")["metadata"], "namespace": "kube-system"}},
        pod("never", phase="Running", annotations={keys.DESCHEDULER_ANNOTATION: "never"}),
        pod("no", phase="Running", annotations={keys.DESCHEDULER_ANNOTATION: "no"}),
        pod("daemon", phase="Running", ownerReferences=[DAEMON_SET_OWNER]),
        # A running Job pod would lose its work and count against the Job's backoffLimit.
        pod("batch", phase="Running", ownerReferences=[JOB_OWNER]),
        pod("workflow-step", phase="Running", ownerReferences=[WORKFLOW_OWNER]),
    ]
    stateful = running("stateful")
    stateful["spec"]["volumes"] = [{"name": "d", "persistentVolumeClaim": {"claimName": "d"}}]
    pods.append(stateful)
    found = movable_pods(pods, waiting, ["vk-lower-1", "vk-lower-2"], [])
    assert {node: [p["metadata"]["name"] for p in ps] for node, ps in found.items()} == {
        "vk-lower-1": ["ok", "equal"],
        "vk-lower-2": ["elsewhere"],
    }


def test_a_budget_that_allows_no_disruption_or_two_budgets_keep_a_pod_in_place() -> None:
    waiting = waiting_one(federated("big"))
    pods = [running("a")]
    assert movable_pods(pods, waiting, ["vk-lower-1"], [budget(1)]) != {}
    assert movable_pods(pods, waiting, ["vk-lower-1"], [budget(0)]) == {}
    assert movable_pods(pods, waiting, ["vk-lower-1"], [budget(1), budget(1, "all")]) == {}
    other = {**budget(0), "metadata": {"name": "small", "namespace": "other"}}
    assert movable_pods(pods, waiting, ["vk-lower-1"], [other]) != {}


def test_budgets_allow_a_plan_only_within_each_budget() -> None:
    pods = [running("a"), running("b")]
    assert budgets_allow(pods, [budget(2)])
    assert not budgets_allow(pods, [budget(1)])
    assert budgets_allow(pods, [])
    assert budgets_allow(pods, [budget(0, matchLabels={"app": "other"})])


def test_limits_take_a_plan_whole_or_not_at_all() -> None:
    limits = Limits(Policy(max_evictions_per_cycle=3, max_evictions_per_node=2))
    assert not limits.take([("a", "vk-1")] * 3), "three from one node"
    assert limits.take([("a", "vk-1"), ("b", "vk-1")])
    assert not limits.take([("c", "vk-2"), ("c", "vk-2")]), "one left in the cycle"
    assert limits.take([("c", "vk-2")])


def test_candidate_plans_fewest_evictions_first_and_only_offered_pods() -> None:
    waiting = waiting_one(federated("big"))
    a, b, c = running("a"), running("b"), running("c", node="vk-lower-2")
    responses = {
        "vk-lower-1": DefragmentResponse(
            plans=[
                Freeing(
                    node="n1", evicted_pod_uids=["uid-a", "uid-b"], homeless_pod_uids=["uid-b"]
                ),
                Freeing(node="n2", evicted_pod_uids=["uid-x"]),
            ]
        ),
        "vk-lower-2": DefragmentResponse(plans=[Freeing(node="m1", evicted_pod_uids=["uid-c"])]),
    }
    plans = candidate_plans(waiting, responses, {"vk-lower-1": [a, b], "vk-lower-2": [c]})
    assert [(p.cluster, p.node, len(p.evicted), len(p.homeless)) for p in plans] == [
        ("vk-lower-2", "m1", 1, 0),
        ("vk-lower-1", "n1", 2, 1),
    ]
    assert plans[1].describe() == (
        "free lower node n1 of vk-lower-1 for pod apps/big: evict apps/a, apps/b"
    )


class Fragmented(World):
    """vk-lower-1 runs a and b; evicting both frees its node n1 for the waiting pod."""

    def __init__(self, dry_run: bool = False) -> None:
        super().__init__({name: NO_ROOM for name in NODES_UP}, dry_run=dry_run)
        self.add(federated("big"))
        self.add(running("a"))
        self.add(running("b"))
        self.pool.plans["vk-lower-1"] = [
            Freeing(node="n1", evicted_pod_uids=["uid-a", "uid-b"], homeless_pod_uids=["uid-b"])
        ]


async def test_a_complete_plan_holds_the_room_then_evicts() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    (plan,) = await world.descheduler.cycle()
    assert isinstance(plan, Plan) and plan.node == "n1"
    assert list(world.pool.defragment_asked) == ["vk-lower-1"]
    assert sorted(world.pool.defragment_asked["vk-lower-1"].movable_pod_uids) == ["uid-a", "uid-b"]
    ((held_on, hold),) = world.pool.held
    assert (held_on, hold.node, hold.seconds) == ("vk-lower-1", "n1", Policy().hold_timeout)
    assert world.client.calls == [
        ("POST", "/api/v1/namespaces/apps/pods/a/eviction"),
        ("POST", "/api/v1/namespaces/apps/pods/b/eviction"),
    ]
    assert world.reasons() == ["Defragmenting", "Descheduled", "Descheduled"]
    assert "to make room for pod apps/big" in world.client.events[1]["message"]
    assert await world.descheduler.cycle() == [], "not planned again while the room is held"
    ((patched, patch),) = world.client.patches
    record = json.loads(patch["metadata"]["annotations"][keys.DEFRAGMENTED_ANNOTATION])
    assert (patched, record) == ("apps/big", {"plans": 1, "at": "2026-11-23T12:00:00Z"})
    world.moment += Policy().hold_timeout + 1
    await world.descheduler.cycle()
    assert len(world.pool.held) == 2, "planned again once the hold lapsed"


async def test_plans_for_one_pod_wait_longer_each_time_and_stop_after_the_last() -> None:
    """Its evicted pods' replacements may take longer than the hold to go, or it waits
    for a reason the estimators do not model: planned again at each hold's end, new pods
    were evicted for it for good, every two minutes (and at once by a new leader)."""
    hold = Policy().hold_timeout
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    planned = []
    for _ in range(60):  # two hours, a look a minute... and a few more
        if await world.descheduler.cycle():
            planned.append(world.moment - START)
        world.moment += 60
        world.client.calls.clear()
    assert len(planned) == MAX_PLANS
    waits = [later - earlier for earlier, later in itertools.pairwise(planned)]
    assert waits == [hold, 2 * hold, 4 * hold], "each wait twice the one before"
    assert "plan 4 of at most 4 for it" in world.client.events[-3]["message"]


async def test_a_new_leader_plans_no_sooner_for_a_pod_planned_for_lately() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    await world.descheduler.cycle()
    successor = Fragmented()
    successor.pool.room["vk-lower-3"] = 1
    recorded = world.pods.get("apps/big")  # as the first one recorded it
    assert recorded is not None
    successor.add(recorded)
    assert await successor.descheduler.cycle() == []
    assert successor.pool.held == [] and successor.client.evictions() == 0


async def test_a_plan_that_cannot_be_recorded_evicts_nothing() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    world.client.patch_error = ApiError(500, {"message": "etcd is slow"})
    await world.descheduler.cycle()
    assert world.client.evictions() == 0
    assert world.pool.released == [(["vk-lower-1"], "uid-big")]


async def test_no_room_is_made_in_a_cluster_the_waiting_pod_is_kept_off() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    big = federated("big")
    big["spec"]["affinity"] = keep_off(None, ["vk-lower-1"])
    world.pods.apply({"type": "MODIFIED", "object": big})
    assert await world.descheduler.cycle() == []
    assert "vk-lower-1" not in world.pool.defragment_asked
    assert world.pool.held == [] and world.client.calls == []


async def test_a_plan_whose_homeless_pods_find_no_room_is_not_carried_out() -> None:
    world = Fragmented()
    await world.descheduler.cycle()
    assert world.client.calls == [] and world.pool.held == []
    assert world.reasons() == ["NotDefragmented"]
    message = world.client.events[0]["message"]
    assert "vk-lower-1/n1: no other cluster has room for apps/b" in message
    world.moment += 10
    await world.descheduler.cycle()
    assert world.reasons() == ["NotDefragmented"], "said once, though it waited longer"


async def test_a_plan_beyond_a_budget_or_the_limits_is_not_carried_out() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-2"] = 5
    world.budgets.apply({"type": "ADDED", "object": budget(1)})
    await world.descheduler.cycle()
    # Each pod alone may go (so both are offered), not both at once.
    assert world.client.calls == []
    assert "do not allow all its evictions at once" in world.client.events[0]["message"]
    limited = Fragmented()
    limited.pool.room["vk-lower-2"] = 5
    limited.descheduler.policy = Policy(max_evictions_per_namespace=1)
    await limited.descheduler.cycle()
    assert limited.client.calls == []
    assert "beyond this cycle's limits" in limited.client.events[0]["message"]


async def test_a_pod_a_node_fits_now_is_left_to_the_scheduler() -> None:
    world = Fragmented()
    world.pool.answers = {**world.pool.answers, "vk-lower-2": fits(0.5)}
    assert await world.descheduler.cycle() == []
    assert world.pool.defragment_asked == {} and world.client.events == []


async def test_an_eviction_refused_mid_plan_stops_it_with_a_warning() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-2"] = 5
    world.client.eviction_error = ApiError(429, {"message": "disruption budget"})
    await world.descheduler.cycle()
    assert len(world.client.calls) == 1, "the second pod is not evicted"
    assert world.reasons() == ["Defragmenting", "DefragmentationIncomplete"]
    assert "apps/a was refused: disruption budget" in world.client.events[-1]["message"]
    assert world.pool.released == [(["vk-lower-1"], "uid-big")], "the room goes back at once"
    assert await world.descheduler.cycle() == [], "not planned again before the hold's time"


async def test_a_plan_stopped_before_any_eviction_does_not_count() -> None:
    """Four plans refused at their first eviction (a budget changed meanwhile) left the
    pod never planned for again, though no pod had ever been evicted for it."""
    world = Fragmented()
    world.pool.room["vk-lower-2"] = 5
    world.client.eviction_error = ApiError(429, {"message": "disruption budget"})
    await world.descheduler.cycle()
    (first, rollback) = [patch for _, patch in world.client.patches]
    assert keys.DEFRAGMENTED_ANNOTATION in first["metadata"]["annotations"]
    assert rollback == {"metadata": {"annotations": {keys.DEFRAGMENTED_ANNOTATION: None}}}
    big = world.pods.get("apps/big")
    assert big is not None and keys.DEFRAGMENTED_ANNOTATION not in big["metadata"].get(
        "annotations", {}
    )


async def test_room_held_for_a_pod_deleted_or_bound_elsewhere_goes_back_at_once() -> None:
    for where in ("vk-lower-1", "vk-lower-2", None):
        world = Fragmented()
        world.pool.room["vk-lower-3"] = 1
        await world.descheduler.cycle()
        assert len(world.pool.held) == 1
        big = federated("big")
        if where is None:
            world.pods.apply({"type": "DELETED", "object": big})
        else:
            big["spec"]["nodeName"] = where
            world.pods.apply({"type": "MODIFIED", "object": big})
        if where == "vk-lower-1":
            assert world.pool.released == [], "its room turns into the pod on its way down"
        else:
            assert world.pool.released == [(["vk-lower-1"], "uid-big")], where
        world.pods.apply({"type": "DELETED", "object": big})
        assert len(world.pool.released) == (where != "vk-lower-1"), "given back once"


async def test_a_pod_gone_before_its_eviction_is_not_said_to_be_evicted() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-2"] = 5
    world.client.eviction_error = ApiError(404, {"reason": "NotFound", "message": "gone"})
    await world.descheduler.cycle()
    assert world.reasons() == ["Defragmenting"]


async def test_a_pod_changed_since_the_plan_stops_it_for_its_room_is_not_freed() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-2"] = 5
    world.client.eviction_error = ApiError(409, {"reason": "Conflict", "message": "changed"})
    await world.descheduler.cycle()
    assert len(world.client.calls) == 1, "the second pod is not evicted for nothing"
    assert world.reasons() == ["Defragmenting", "DefragmentationIncomplete"]
    assert (
        "apps/a was not made, the pod changed since the plan" in world.client.events[-1]["message"]
    )
    assert world.pool.released == [(["vk-lower-1"], "uid-big")]


async def test_events_that_cannot_be_written_stop_no_plan() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    world.client.event_error = aiohttp.ClientConnectionError("connection reset")
    (plan,) = await world.descheduler.cycle()
    assert isinstance(plan, Plan)
    assert world.client.evictions() == 2, "the whole plan is carried out"
    assert world.pool.released == []


async def test_an_eviction_failing_mid_plan_stops_it_and_the_cycle_goes_on() -> None:
    world = Fragmented()
    world.pool.room["vk-lower-2"] = 5
    world.client.eviction_error = ApiError(500, {"message": "more than one budget"})
    assert len(await world.descheduler.cycle()) == 1
    assert world.reasons() == ["Defragmenting", "DefragmentationIncomplete"]
    assert "apps/a failed" in world.client.events[-1]["message"]
    assert world.pool.released == [(["vk-lower-1"], "uid-big")]


async def test_a_dry_run_prints_the_plan_and_holds_and_evicts_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    world = Fragmented(dry_run=True)
    world.pool.room["vk-lower-2"] = 5
    await world.descheduler.cycle()
    assert world.client.calls == [] and world.pool.held == [] and world.client.events == []
    printed = capsys.readouterr().out
    assert (
        "dry run: free lower node n1 of vk-lower-1 for pod apps/big: evict apps/a, apps/b"
        in printed
    )


# -- manifests ------------------------------------------------------------------------------

MANIFESTS = Path(__file__).parents[2] / "manifests" / "descheduler"


def documents(name: str) -> list[Any]:
    return list(yaml.safe_load_all((MANIFESTS / name).read_text()))


def test_the_deployment_runs_the_policy_of_its_config_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    config_map, deployment, _budget = documents("deployment.yaml")
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(config_map["data"]["policy.yaml"])
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    command, *args = container["args"]
    assert command == "descheduler"
    config = parse_args([a.replace("/etc/kubestrata/policy.yaml", str(policy_file)) for a in args])
    assert config.policy == Policy(), "the ConfigMap spells out the defaults"
    assert deployment["spec"]["replicas"] == 2, "one moves, one stands by"
    assert config.election is not None
    assert config.election.name == "kubestrata-descheduler"
    # A preview neither waits for the Lease nor takes it from the replicas moving pods.
    assert parse_args(["--dry-run"]).election is None


def test_rbac_grants_exactly_what_the_descheduler_uses() -> None:
    account, role, binding, lease_role, lease_binding = documents("rbac.yaml")
    assert account["metadata"]["name"] == "kubestrata-descheduler"
    watch = {"get", "list", "watch"}
    assert core_grants(role) == {
        (kind, verb) for kind in ("nodes", "namespaces") for verb in ("list", "watch")
    } | {("pods", v) for v in watch} | {
        ("pods", "create"),
        ("pods", "patch"),
        ("pods", "delete"),
        ("pods/eviction", "create"),
        ("events", "create"),
        ("nodes/estimator", "get"),
        ("nodes/estimator", "create"),
    }
    assert [rule for rule in role["rules"] if rule["apiGroups"] == ["batch"]] == [
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get"]}
    ]
    policy_rules = [rule for rule in role["rules"] if rule["apiGroups"] == ["policy"]]
    assert policy_rules == [
        {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["list", "watch"]}
    ]
    assert "*" not in str(role["rules"])
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    # Its leader Lease and its record of moves, in its own namespace only.
    assert lease_role["metadata"]["namespace"] == "kubestrata-system"
    assert lease_role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update"],
        },
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [keys.MOVES_CONFIGMAP],
            "verbs": ["get", "update"],
        },
    ]
    assert lease_binding["subjects"][0]["name"] == account["metadata"]["name"]


def test_a_bad_policy_file_stops_the_command_with_its_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("defragAfter: soon\n")
    with pytest.raises(SystemExit) as exit_info:
        parse_args([f"--policy={policy_file}"])
    assert exit_info.value.code == 2
    assert "defragAfter: 'soon' is not a number" in capsys.readouterr().err
    # Not UTF-8: a traceback before.
    policy_file.write_bytes(b"\xff\xfe")
    with pytest.raises(SystemExit):
        parse_args([f"--policy={policy_file}"])
    assert f"--policy {policy_file}: 'utf-8' codec can't decode" in capsys.readouterr().err


async def test_a_pod_no_cluster_can_take_is_warned_of_once_while_it_waits_on() -> None:
    """Its message says how long it has been stuck, which grows every cycle."""
    world = World({"vk-lower-2": NO_ROOM, "vk-lower-3": NO_ROOM})
    world.add(pod("solo", owned=False))
    for _ in range(3):
        await world.descheduler.cycle()
        world.moment += 10
    assert world.reasons() == ["NotRescheduled"]
    world.moment += STAY_EVENT_SECONDS
    await world.descheduler.cycle()
    assert world.reasons() == ["NotRescheduled", "NotRescheduled"], "said again after a while"


async def test_a_bare_pod_is_not_copied_to_a_virtual_node_whose_taints_it_does_not_tolerate() -> (
    None
):
    """An admin taints a virtual node NoExecute to empty its cluster: a copy bound there
    would be deleted by the taint manager once the original had gone, the pod lost."""
    world = World(ROOM_IN_2)
    draining = virtual("vk-lower-2")
    draining["spec"]["taints"] = [{"key": "drain", "effect": "NoExecute"}]
    world.nodes.apply({"type": "MODIFIED", "object": draining})
    world.add(pod("solo", owned=False))
    (decision,) = await world.descheduler.cycle()
    assert isinstance(decision, Stay)
    assert world.client.calls == []
    tolerant = pod("tolerant", owned=False)
    tolerant["spec"]["tolerations"] = [{"key": "drain", "operator": "Exists"}]
    world.add(tolerant)
    moved = [d for d in await world.descheduler.cycle() if isinstance(d, Move)]
    assert [(m.stuck.key, m.to) for m in moved] == [("apps/tolerant", "vk-lower-2")]


def two_plans_one_budget(dry_run: bool = False) -> Fragmented:
    world = Fragmented(dry_run=dry_run)
    world.add(federated("big-2"))
    world.add(running("c", node="vk-lower-2"))
    world.add(running("d", node="vk-lower-2"))
    world.pool.plans["vk-lower-1"] = [Freeing(node="n1", evicted_pod_uids=["uid-a", "uid-b"])]
    world.pool.plans["vk-lower-2"] = [Freeing(node="n2", evicted_pod_uids=["uid-c", "uid-d"])]
    world.budgets.apply({"type": "ADDED", "object": budget(2)})
    return world


async def test_plans_of_one_cycle_share_its_budgets_and_never_evict_a_pod_twice() -> None:
    """The cache shows the first plan's evictions neither in the budget nor in the pods:
    judged on it, the second plan asked the budget for more than it allows (refused half
    way, its first evictions for nothing) or took the same pods again."""
    world = two_plans_one_budget()
    (plan,) = await world.descheduler.cycle()
    assert isinstance(plan, Plan) and plan.node == "n1"
    assert world.client.calls == [
        ("POST", "/api/v1/namespaces/apps/pods/a/eviction"),
        ("POST", "/api/v1/namespaces/apps/pods/b/eviction"),
    ]
    (refused,) = [e for e in world.client.events if e["reason"] == "NotDefragmented"]
    assert "do not allow all its evictions at once" in refused["message"]


async def test_a_homeless_pod_finds_room_only_in_a_cluster_its_own_rules_admit() -> None:
    """The waiting pod may go anywhere; the pod its plan evicts is kept to vk-lower-1 by
    its nodeSelector, so room in vk-lower-3 is no home for it."""
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    b = running("b", nodeSelector={"region": "eu"})
    world.pods.apply({"type": "MODIFIED", "object": b})
    labelled = virtual("vk-lower-1")
    labelled["metadata"]["labels"] = {"region": "eu"}
    world.nodes.apply({"type": "MODIFIED", "object": labelled})
    assert await world.descheduler.cycle() == []
    assert world.client.calls == [] and world.pool.held == []
    assert world.pool.asked_in_turn == [], "no other cluster admits it: none is asked"
    assert "no other cluster has room for apps/b" in world.client.events[0]["message"]


async def test_plans_of_one_cycle_do_not_count_on_the_same_room_for_their_homeless_pods() -> None:
    """Two waiting pods, each with a plan whose one homeless pod needs a home elsewhere:
    vk-lower-3 has room for one. The first plan is carried out; the second's check asks
    for room for the first's homeless pod before its own, and is refused."""
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    world.add(federated("big-2"))
    world.add(running("c", node="vk-lower-2"))
    world.add(running("d", node="vk-lower-2"))
    world.pool.plans["vk-lower-2"] = [
        Freeing(node="n2", evicted_pod_uids=["uid-c", "uid-d"], homeless_pod_uids=["uid-d"])
    ]
    (plan,) = await world.descheduler.cycle()
    assert isinstance(plan, Plan) and plan.node == "n1"
    assert ("vk-lower-3", ["b", "d"]) in world.pool.asked_in_turn
    assert world.client.calls == [
        ("POST", "/api/v1/namespaces/apps/pods/a/eviction"),
        ("POST", "/api/v1/namespaces/apps/pods/b/eviction"),
    ]
    (refused,) = [e for e in world.client.events if e["reason"] == "NotDefragmented"]
    assert "no other cluster has room for apps/d" in refused["message"]


async def test_one_plan_a_cycle_makes_room_in_a_cluster() -> None:
    """Its estimator does not know yet of the room the first plan's evicted pods take
    again on its other nodes: a second plan there could give that room away, and the
    first plan's pods then waited with nowhere to go."""
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 2
    world.add(federated("big-2"))
    world.add(running("c"))
    world.add(running("d"))
    world.pool.plans["vk-lower-1"].append(
        Freeing(node="n2", evicted_pod_uids=["uid-c", "uid-d"], homeless_pod_uids=["uid-d"])
    )
    (plan,) = await world.descheduler.cycle()
    assert isinstance(plan, Plan) and plan.waiting.key == "apps/big"
    assert [name for name, _ in world.pool.held] == ["vk-lower-1"]
    assert world.client.evictions() == 2


async def test_a_bare_pods_copy_bound_this_cycle_is_left_to_its_estimator_to_count() -> None:
    """The copy is bound to its cluster, whose estimator counts it: asked again for room
    in a plan's check, it was counted twice, and the plan refused for nothing."""
    world = Fragmented()
    world.pool.answers_for["solo"] = {**world.pool.answers, "vk-lower-3": fits(0.5)}
    world.pool.room["vk-lower-3"] = 1
    world.add(pod("solo", owned=False, node="vk-lower-2"))
    decisions = await world.descheduler.cycle()
    assert [d.to for d in decisions if isinstance(d, Move)] == ["vk-lower-3"]
    assert ("vk-lower-3", ["b"]) in world.pool.asked_in_turn
    assert any(isinstance(d, Plan) for d in decisions)


def test_only_evictions_of_running_pods_are_counted_against_the_budgets() -> None:
    """A Pending pod's eviction takes nothing from a budget."""
    evicted = running("a")
    pending = pod("p", phase="Pending")
    assert taking_from_budgets([evicted, pending]) == [evicted]


async def test_a_dry_run_plans_one_cycle_as_it_would_carry_it_out() -> None:
    (plan,) = await two_plans_one_budget(dry_run=True).descheduler.cycle()
    assert isinstance(plan, Plan) and plan.node == "n1"


async def test_a_stuck_pod_goes_only_where_its_node_selector_admits_it() -> None:
    """A bare pod's copy is bound by name, past the scheduler: on a virtual node its
    selector does not admit it would run against its own rules."""
    world = World(ROOM_IN_2)
    pinned = pod("pinned", owned=False)
    pinned["spec"]["nodeSelector"] = {keys.CLUSTER_ID_LABEL: "lower-3"}
    world.add(pinned)
    (decision,) = await world.descheduler.cycle()
    assert isinstance(decision, Stay)
    assert world.client.calls == []


@pytest.mark.parametrize(
    "written",
    [
        "",
        "{",
        "[]",
        '{"plans": 0, "at": "2026-11-23T12:00:00Z"}',
        '{"plans": 2}',
        # Raised out of every look (AttributeError), any pod creator may write it.
        '{"plans": 1, "at": null}',
    ],
)
def test_a_defragmentation_record_that_cannot_be_read_is_none(written: str) -> None:
    waiting = federated("big")
    waiting["metadata"]["annotations"] = {keys.DEFRAGMENTED_ANNOTATION: written}
    assert defragmented(waiting) is None
    assert planned_again_at(waiting, Policy()) is None


async def test_a_defragmentation_record_at_the_end_of_time_crashes_no_cycle() -> None:
    """Its next plan's time overflowed, and the leader's work died at every look."""
    world = Fragmented()
    world.pool.room["vk-lower-3"] = 1
    big = federated("big")
    big["metadata"]["annotations"] = {
        keys.DEFRAGMENTED_ANNOTATION: '{"plans": 1, "at": "9999-12-31T23:59:00Z"}'
    }
    world.pods.apply({"type": "MODIFIED", "object": big})
    (plan,) = await world.descheduler.cycle()
    assert isinstance(plan, Plan)
