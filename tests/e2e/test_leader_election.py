"""Two replicas of a virtual node: only the holder of its Lease mirrors; kill -9 it and
the other takes over with no pod lost or made twice; a replica that stops hands over at
once."""

from __future__ import annotations

import time

from harness.federation import Federation, virtual_node_name
from kubekit import keys
from virtual_node.main import VirtualNodeConfig

from .helpers import (
    apply,
    federated_deployment,
    get_json,
    namespace,
    pods_by_name,
    rollout,
    wait_for,
)

CLUSTER = "lower-1"
NODE = keys.default_node_name(CLUSTER)
LEASE = keys.virtual_node_lease_name(NODE)
TAKEOVER_SECONDS = 15


def lease_holder(federation: Federation) -> str:
    return str(
        get_json(federation.upper, "lease", "-n", keys.SYSTEM_NAMESPACE, LEASE)["spec"].get(
            "holderIdentity"
        )
        or ""
    )


def kubelet_port(federation: Federation) -> int:
    node = get_json(federation.upper, "node", NODE)
    return int(node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"])


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def lower_uids(federation: Federation) -> dict[str, str]:
    """The lower pods of the test, by name: the upper pod's uid each carries."""
    lower = federation.clusters[CLUSTER]
    return {
        name: pod["metadata"]["annotations"][keys.UPPER_UID_ANNOTATION]
        for name, pod in pods_by_name(lower, "leader", "app=held").items()
    }


def upper_uids(federation: Federation) -> dict[str, str]:
    return {
        name: pod["metadata"]["uid"]
        for name, pod in pods_by_name(federation.upper, "leader", "app=held").items()
    }


def test_the_standby_takes_over_from_a_killed_leader_and_a_stopped_one_hands_over(
    federation: Federation,
) -> None:
    upper, lower = federation.upper, federation.clusters[CLUSTER]
    name = virtual_node_name(CLUSTER)
    first = federation.components[name]
    assert lease_holder(federation) == name
    first_port = kubelet_port(federation)
    apply(
        upper,
        namespace("leader"),
        federated_deployment("held", "leader", 3, node_selector={keys.CLUSTER_ID_LABEL: CLUSTER}),
    )
    rollout(upper, "held", "leader")

    standby_args = federation.virtual_node_args(lower, replica="standby")
    standby_identity = flag(standby_args, "leader-elect-identity")
    standby = federation.start_component(standby_identity, standby_args)
    wait_for(
        lambda: "waiting to lead" in standby.log_path.read_text(), "the second replica to stand by"
    )
    # Standing by: it writes nothing, so one more replica is mirrored once, by the leader.
    upper.kubectl("scale", "deployment", "held", "-n", "leader", "--replicas=4")
    rollout(upper, "held", "leader")
    time.sleep(2 * 2)  # two of the standby's attempts on the Lease
    assert lease_holder(federation) == name
    assert kubelet_port(federation) == first_port
    assert "caches synced" not in standby.log_path.read_text()
    # Logged as key=value fields, one line per event.
    (waiting,) = [line for line in standby.log_path.read_text().splitlines() if "to lead" in line]
    assert waiting.startswith("ts=")
    assert " level=info logger=kubekit.leader msg=" in waiting
    before = lower_uids(federation)
    assert before == upper_uids(federation) and len(before) == 4

    first.kill()
    wait_for(
        lambda: lease_holder(federation) == standby_identity,
        "the standby to take the Lease",
        timeout=TAKEOVER_SECONDS,
        interval=0.2,
    )
    standby_port = int(flag(standby_args, "kubelet-port"))
    wait_for(lambda: kubelet_port(federation) == standby_port, "the Node to name the new leader")

    # The new leader found every pod where it was: none lost, none made again...
    assert lower_uids(federation) == before
    # ...and mirrors what comes next.
    upper.kubectl("scale", "deployment", "held", "-n", "leader", "--replicas=6")
    rollout(upper, "held", "leader")
    wait_for(
        lambda: (
            len(lower_uids(federation)) == 6 and lower_uids(federation) == upper_uids(federation)
        ),
        "six pods below, one per upper pod",
    )
    assert all(before[n] == uid for n, uid in lower_uids(federation).items() if n in before)

    # Back as it was: the first replica stands by until the standby stops and releases
    # the Lease, well before it would expire.
    logged = first.log_path.stat().st_size
    first.start()
    wait_for(
        lambda: "waiting to lead" in first.log_path.read_text()[logged:],
        "the first replica to stand by",
    )
    standby.stop()
    stopped_at = time.monotonic()
    wait_for(lambda: lease_holder(federation) == name, "the first replica to lead again")
    handed_over = time.monotonic() - stopped_at
    wait_for(lambda: kubelet_port(federation) == first_port, "the Node to name the first")
    assert handed_over < VirtualNodeConfig.leader_elect_lease_duration, "released, not expired"
    federation.components.pop(standby_identity)
    upper.kubectl("delete", "namespace", "leader", "--timeout=120s")
    wait_for(lambda: not lower_uids(federation), "the pods to go below")


def test_of_two_deschedulers_one_moves_and_the_other_takes_over_when_it_stops(
    federation: Federation,
) -> None:
    lease = ("lease", "-n", keys.SYSTEM_NAMESPACE, keys.DESCHEDULER_LEASE)
    first = federation.start_component("descheduler", federation.descheduler_args())
    second = federation.start_component(
        "descheduler-standby",
        [*federation.descheduler_args(), "--leader-elect-identity=descheduler-standby"],
    )
    try:
        wait_for(
            lambda: (
                get_json(federation.upper, *lease)["spec"].get("holderIdentity") == "descheduler"
            ),
            "the first descheduler to lead",
        )
        wait_for(lambda: "held by descheduler" in second.log_path.read_text(), "the standby")
        assert "descheduling" not in second.log_path.read_text(), "the standby moves nothing"
        first.stop()
        wait_for(
            lambda: (
                get_json(federation.upper, *lease)["spec"].get("holderIdentity")
                == "descheduler-standby"
            ),
            "the standby to lead once the first released the Lease",
            timeout=VirtualNodeConfig.leader_elect_lease_duration,
        )
        wait_for(lambda: "descheduling" in second.log_path.read_text(), "the standby to work")
    finally:
        for name in ("descheduler", "descheduler-standby"):
            federation.components.pop(name).stop()
