import re
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubekit import keys, pki
from kubekit.client import PODS, RESOURCEQUOTAS, Resource
from kubekit.clusterstate import ClusterState
from kubekit.fit import pod_limits
from kubekit.informer import FunctionHandler, Informer
from virtual_node.capacity import (
    PodUsage,
    as_resource_list,
    free_capacity,
    node_share,
    pod_requests,
    pod_usage,
)
from virtual_node.lower import LowerCluster
from virtual_node.main import VirtualNodeConfig, check_files, parse_args
from virtual_node.naming import NamespaceMapping
from virtual_node.translate import Ownership


def node(
    name: str,
    *,
    ready: bool = True,
    unschedulable: bool = False,
    extended: Mapping[str, str] | None = None,
    taints: tuple[tuple[str, str], ...] = (),
    **allocatable: str,
) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "unschedulable": unschedulable,
            "taints": [{"key": key, "effect": effect} for key, effect in taints],
        },
        "status": {
            "allocatable": {**allocatable, **(extended or {})},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def container(name: str, **requests: str) -> dict[str, Any]:
    return {"name": name, "resources": {"requests": requests}}


def pod(
    node_name: str | None,
    *containers: dict[str, Any],
    phase: str = "Running",
    mirrored: bool = False,
    **spec: Any,
) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "labels": {"mirrored": "yes"} if mirrored else {}},
        "spec": {"nodeName": node_name, "containers": list(containers), **spec},
        "status": {"phase": phase},
    }


def is_mirrored(p: Mapping[str, Any]) -> bool:
    return bool(p["metadata"]["labels"].get("mirrored") == "yes")


def test_requests_sum_containers_take_init_peak_and_add_overhead() -> None:
    requests = pod_requests(
        pod(
            "n",
            container("a", cpu="100m", memory="1Gi"),
            container("b", cpu="200m"),
            initContainers=[container("init", cpu="1", memory="512Mi")],
            overhead={"cpu": "50m"},
        )
    )
    assert requests == {"cpu": Fraction(1) + Fraction(50, 1000), "memory": 2**30, "pods": 1}


def test_sidecars_run_beside_later_init_containers_and_the_app() -> None:
    sidecar = {**container("proxy", cpu="100m"), "restartPolicy": "Always"}
    requests = pod_requests(
        pod(
            "n",
            container("app", cpu="200m"),
            initContainers=[sidecar, container("migrate", cpu="500m")],
        )
    )
    # max(app 200m + sidecar 100m, init 500m + sidecar 100m)
    assert requests["cpu"] == Fraction(600, 1000)


def test_pod_level_resources_stand_for_the_containers_cpu_memory_and_hugepages() -> None:
    """As the scheduler's PodRequests: pod-level requests replace the containers' total
    of those resources; one left out defaults to the containers' requests when one asks
    for it, else to the pod-level limit. Other resources come from the containers."""
    level = {
        "requests": {"cpu": "8"},
        "limits": {"cpu": "10", "memory": "16Gi", "hugepages-2Mi": "1Gi"},
    }
    requests = pod_requests(
        pod(
            "n",
            container("a", cpu="100m", **{"example.com/gpu": "1"}),
            {"name": "b", "resources": {"limits": {"hugepages-2Mi": "2Mi"}}},
            resources=level,
            overhead={"cpu": "250m"},
        )
    )
    assert requests == {
        "cpu": Fraction(8) + Fraction(1, 4),
        "memory": 16 * 2**30,
        "hugepages-2Mi": 2 * 2**20,
        "example.com/gpu": 1,
        "pods": 1,
    }
    assert pod_limits(pod("n", container("a", cpu="1"), resources=level)) == {
        "cpu": 10,
        "memory": 16 * 2**30,
        "hugepages-2Mi": 2**30,
    }


def resized(spec_cpu: str, actual_cpu: str, allocated_cpu: str, reason: str | None) -> Any:
    """A pod whose container asks ``spec_cpu`` (a resize made above) while the kubelet
    allocated ``allocated_cpu`` and the container has ``actual_cpu``."""
    resizing = pod("n", container("app", cpu=spec_cpu, memory="1Gi"))
    resizing["status"] = {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "app",
                "allocatedResources": {"cpu": allocated_cpu, "memory": "1Gi"},
                "resources": {"requests": {"cpu": actual_cpu, "memory": "1Gi"}},
            }
        ],
        "conditions": [{"type": "PodResizePending", "status": "True", "reason": reason}]
        if reason
        else [],
    }
    return resizing


def test_a_pod_being_resized_holds_the_larger_room_and_an_infeasible_resize_none() -> None:
    """As the scheduler counts a pod with in-place resize: a resize down keeps the old
    room until made (until 2026-11-29 the new, smaller requests counted at once); one up
    the kubelet finds infeasible holds only what the pod has (until then its spec filled
    the node, and pods that fit were refused)."""
    assert pod_requests(resized("1", "2", "2", None))["cpu"] == 2
    assert pod_requests(resized("1", "2", "1", "Deferred"))["cpu"] == 2
    assert pod_requests(resized("16", "1", "1", "Infeasible"))["cpu"] == 1
    assert pod_requests(resized("3", "3", "3", None))["cpu"] == 3
    assert pod_requests(resized("3", "3", "3", None))["memory"] == 2**30


def test_limits_stand_in_for_missing_requests() -> None:
    assert pod_requests(pod("n", {"name": "a", "resources": {"limits": {"cpu": "2"}}}))["cpu"] == 2


def test_free_capacity_counts_usable_nodes_and_foreign_pods_only() -> None:
    nodes = [
        node("a", cpu="8", memory="32Gi", pods="110", extended={"example.com/gpu": "2"}),
        node("b", cpu="8", memory="32Gi", pods="110"),
        node("not-ready", ready=False, cpu="100", pods="110"),
        node("cordoned", unschedulable=True, cpu="100", pods="110"),
    ]
    pods = [
        pod("a", container("x", cpu="3", memory="4Gi", **{"example.com/gpu": "1"})),
        pod("b", container("mirrored", cpu="5"), mirrored=True),
        pod("b", container("done", cpu="5"), phase="Succeeded"),
        pod("not-ready", container("elsewhere", cpu="5")),
        pod(None, container("pending", cpu="5"), phase="Pending"),
    ]
    usages = [u for u in (pod_usage(p, is_mirrored) for p in pods) if u is not None]
    assert [(u.node_name, u.mirrored) for u in usages] == [
        ("a", False),
        ("b", True),
        ("not-ready", False),
    ]
    free = free_capacity(nodes, usages)
    assert as_resource_list(free) == {
        "cpu": "13",
        "example.com/gpu": "1",
        "memory": "60Gi",
        "pods": "219",
    }


def test_our_pods_on_a_node_that_does_not_count_are_given_back() -> None:
    """The upper scheduler subtracts every pod bound to the virtual Node: ours on a
    lower node cordoned under them too, from room that node's allocatable never added."""
    nodes = [node("a", cpu="8", pods="110"), node("c", unschedulable=True, cpu="8", pods="110")]
    ours = [
        pod("a", container("ours-on-a", cpu="2"), mirrored=True),
        pod("c", container("ours-on-c", cpu="3", **{"example.com/gpu": "1"}), mirrored=True),
    ]
    usages = [u for u in (pod_usage(p, is_mirrored) for p in ours) if u is not None]
    free = free_capacity(nodes, usages)
    # The scheduler takes the 2 + 3 cpu of ours from 11: 6 left above, as on a.
    assert as_resource_list(free) == {"cpu": "11", "example.com/gpu": "1", "pods": "111"}


def test_tainted_nodes_count_only_when_their_taint_keys_are_listed() -> None:
    nodes = [
        node("plain", cpu="1", pods="10", taints=(("cheap", "PreferNoSchedule"),)),
        node(
            "control-plane",
            cpu="10",
            taints=(("node-role.kubernetes.io/control-plane", "NoSchedule"),),
        ),
        node("gpu", cpu="100", taints=(("nvidia.com/gpu", "NoSchedule"),)),
        node(
            "draining",
            cpu="1000",
            taints=(("nvidia.com/gpu", "NoSchedule"), ("drain", "NoExecute")),
        ),
    ]
    assert free_capacity(nodes, []) == {"cpu": 1, "pods": 10}
    assert free_capacity(nodes, [], {"nvidia.com/gpu"}) == {"cpu": 101, "pods": 10}
    lower, _pods, informer = lower_cluster(counted_taint_keys=frozenset({"nvidia.com/gpu"}))
    for lower_node in nodes:
        informer.apply({"type": "ADDED", "object": lower_node})
    assert lower.report(True).allocatable == {"cpu": "101", "pods": "10"}


def test_free_capacity_never_goes_negative() -> None:
    usage = PodUsage("a", {"cpu": Fraction(4), "pods": Fraction(1)})
    free = free_capacity([node("a", cpu="1", pods="1")], [usage, usage])
    assert free == {"cpu": 0, "pods": 0}


def test_a_node_whose_pods_take_more_than_it_has_takes_no_room_from_the_others() -> None:
    """a's device plugin restarts: it reports no GPU while its pods hold all 8; b's 8 free
    GPUs are still offered."""
    usage = PodUsage("a", {"nvidia.com/gpu": Fraction(8)})
    gpus = {"nvidia.com/gpu": "8"}
    nodes = [node("a", extended={"nvidia.com/gpu": "0"}), node("b", extended=gpus)]
    assert free_capacity(nodes, [usage])["nvidia.com/gpu"] == 8


def test_our_pods_on_a_node_that_shrank_under_them_hide_no_room_of_the_others() -> None:
    """a's device plugin restarts: it reports no GPU while our mirrored pods keep all 8;
    b has 8 free. The upper scheduler takes the 8 of ours from what the Node offers, so
    the Node offers 16 and 8 are left above, b's, not 0 with new GPU pods Pending."""
    ours = [PodUsage("a", {"nvidia.com/gpu": Fraction(8)}, mirrored=True)]
    for shrunk in ({"nvidia.com/gpu": "0"}, {}):
        nodes = [node("a", extended=shrunk), node("b", extended={"nvidia.com/gpu": "8"})]
        offered = free_capacity(nodes, ours)["nvidia.com/gpu"]
        assert offered - 8 == 8


def test_a_node_share_is_the_room_left_never_below_zero_plus_ours() -> None:
    gpu = "nvidia.com/gpu"
    share = node_share(
        {"cpu": Fraction(4), gpu: Fraction(2)},
        {"cpu": Fraction(3), "example.com/unlisted": Fraction(1)},
        {"cpu": Fraction(2), gpu: Fraction(1), "pods": Fraction(1)},
    )
    assert share == {"cpu": 2, gpu: 2, "pods": 1}


OWNER = Ownership(origin="upper-uid", node_name="vk-lower-1", cluster_id="lower-1")


def lower_cluster(
    state: ClusterState | None = None, counted_taint_keys: frozenset[str] = frozenset()
) -> tuple[LowerCluster, Informer, Informer]:
    """A LowerCluster over informers fed by hand (and, given one, an estimator's state):
    the lower cluster, its pod informer and its node informer."""
    pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    nodes = Informer(client=None, resource=Resource("", "v1", "nodes"))  # type: ignore[arg-type]
    if state is not None:
        nodes.add_handler(FunctionHandler(add=state.set_node))
        pods.add_handler(FunctionHandler(add=state.set_pod))
    lower = LowerCluster(
        None,  # type: ignore[arg-type]
        pods,
        nodes,
        OWNER,
        NamespaceMapping(),
        "127.0.0.1",
        largest_free_slot=state.largest_free_slot if state is not None else None,
        counted_taint_keys=counted_taint_keys,
    )
    return lower, pods, nodes


def test_lower_cluster_capacity_follows_each_foreign_pod_through_its_life() -> None:
    lower, pods, nodes = lower_cluster()
    nodes.apply({"type": "ADDED", "object": node("a", cpu="8", pods="110")})

    def cpu() -> str:
        return lower.report(True).allocatable["cpu"]

    def event(kind: str, obj: dict[str, Any]) -> None:
        obj["metadata"]["namespace"] = "ns"
        pods.apply({"type": kind, "object": obj})

    foreign = pod("a", container("x", cpu="3"))
    event("ADDED", foreign)
    assert cpu() == "5"
    mirrored = pod("a", container("y", cpu="2"))
    mirrored["metadata"].update(name="ours", labels=OWNER.labels())
    event("ADDED", mirrored)
    assert cpu() == "5"
    lower.changed.clear()
    event("MODIFIED", pod("a", container("x", cpu="3")))
    assert not lower.changed.is_set(), "an unchanged usage is no news for the Node"
    event("MODIFIED", pod("a", container("x", cpu="3"), phase="Succeeded"))
    assert cpu() == "8"
    assert lower.changed.is_set()
    event("MODIFIED", pod("a", container("x", cpu="4")))
    assert cpu() == "4"
    event("DELETED", pod("a", container("x", cpu="4")))
    assert cpu() == "8"


def test_the_report_carries_what_the_lower_quotas_cap_and_wakes_only_when_that_changes() -> None:
    lower, _pods, _nodes = lower_cluster()
    assert lower.report(True).quotas_digest == "", "not watched: no annotation"
    quotas = Informer(client=None, resource=RESOURCEQUOTAS)  # type: ignore[arg-type]
    lower.watch_quotas(quotas)
    none = lower.report(True).quotas_digest
    assert none, "watched and none: a digest too, so the last one's removal shows"

    def quota(pods: str, used: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "q", "namespace": "ns"},
            "spec": {"hard": {"pods": pods}},
            "status": {"used": {"pods": used}},
        }

    lower.changed.clear()
    quotas.apply({"type": "ADDED", "object": quota("1", "0")})
    assert lower.changed.is_set()
    capped = lower.report(True).quotas_digest
    assert capped != none
    lower.changed.clear()
    quotas.apply({"type": "MODIFIED", "object": quota("1", "1")})
    assert not lower.changed.is_set(), "its usage moves with every pod: no news above"
    assert lower.report(True).quotas_digest == capped
    quotas.apply({"type": "MODIFIED", "object": quota("2", "1")})
    assert lower.changed.is_set()
    assert lower.report(True).quotas_digest not in (none, capped)
    raised = lower.report(True).quotas_digest
    quotas.apply({"type": "DELETED", "object": quota("2", "1")})
    removed = lower.report(True).quotas_digest
    assert removed not in (none, capped, raised)
    # Made and removed between two reports: the estimator refused pods for it meanwhile,
    # so the Node changes all the same.
    quotas.apply({"type": "ADDED", "object": quota("1", "0")})
    quotas.apply({"type": "DELETED", "object": quota("1", "0")})
    assert lower.report(True).quotas_digest != removed


def test_the_report_names_the_roomiest_lower_node_with_our_own_pods_counted() -> None:
    lower, pods, nodes = lower_cluster(ClusterState())
    nodes.apply({"type": "ADDED", "object": node("a", cpu="8", memory="16Gi", pods="110")})
    nodes.apply({"type": "ADDED", "object": node("b", cpu="4", memory="32Gi", pods="110")})
    assert lower.report(True).largest_free_slot == {
        "node": "a",
        "cpu": "8",
        "memory": "16Gi",
        "pods": "110",
    }
    lower.changed.clear()
    ours = pod("a", container("y", cpu="6", memory="1Gi"))
    ours["metadata"].update(
        name="ours",
        namespace="ns",
        labels=OWNER.labels(),
        annotations={keys.UPPER_NAMESPACE_ANNOTATION: "ns"},
    )
    pods.apply({"type": "ADDED", "object": ours})
    assert lower.changed.is_set(), "our pods change no capacity above, but the room below"
    assert lower.report(True).allocatable["cpu"] == "12"
    assert lower.report(True).largest_free_slot == {
        "node": "b",
        "cpu": "4",
        "memory": "32Gi",
        "pods": "110",
    }


def test_the_slot_leaves_out_a_node_tainted_against_federated_pods() -> None:
    """A control-plane node's room is no slot for them: reported, it was larger than the
    cluster's whole capacity above."""
    lower, _, nodes = lower_cluster(ClusterState(), counted_taint_keys=frozenset({"gpu"}))
    control_plane = node(
        "control-plane", cpu="16", taints=(("node-role.kubernetes.io/control-plane", "NoSchedule"),)
    )
    gpu = node("gpu", cpu="8", taints=(("gpu", "NoExecute"),))
    for each in (control_plane, gpu, node("worker", cpu="4")):
        nodes.apply({"type": "ADDED", "object": each})
    report = lower.report(True)
    assert report.allocatable["cpu"] == "12"
    assert report.largest_free_slot["node"] == "gpu"


def test_without_an_estimator_no_slot_is_reported() -> None:
    lower, _, nodes = lower_cluster()
    nodes.apply({"type": "ADDED", "object": node("a", cpu="8")})
    assert lower.report(True).largest_free_slot == {}


def test_the_virtual_node_takes_lists_from_repeated_flags_or_its_file(tmp_path: Path) -> None:
    base = ["--lower-kubeconfig=l", "--cluster-id=c", "--client-ca-file=ca"]
    flags = [*base, "--count-tainted-nodes=nvidia.com/gpu", "--count-tainted-nodes=dedicated"]
    assert parse_args(flags).counted_taint_keys == ("nvidia.com/gpu", "dedicated")
    config = tmp_path / "vn.yaml"
    config.write_text("counted_taint_keys: [nvidia.com/gpu]\n")
    assert parse_args([*base, f"--config={config}"]).counted_taint_keys == ("nvidia.com/gpu",)
    with pytest.raises(ValueError, match="counted_taint_keys must be a list"):
        VirtualNodeConfig("l", "c", client_ca_file="ca", counted_taint_keys="nvidia.com/gpu")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "--config: [Errno 2] No such file"),
        ("a: [", "--config: while parsing"),
        ("42", "a mapping of settings, not int"),
        (b"cluster_id: \xff", "--config: 'utf-8' codec can't decode"),
        ("1: 2\nno: 1\n", "unknown keys 1, False"),
        ("counted_taint_keys: 5", "counted_taint_keys must be a list of non-empty strings"),
    ],
)
def test_a_bad_config_file_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | bytes | None, words: str
) -> None:
    config = tmp_path / "vn.yaml"
    if isinstance(content, bytes):
        config.write_bytes(content)
    elif content is not None:
        config.write_text(content)
    with pytest.raises(SystemExit):
        parse_args(
            ["--lower-kubeconfig=l", "--cluster-id=c", "--client-ca-file=ca", f"--config={config}"]
        )
    assert words in capsys.readouterr().err


def test_a_kubeconfig_that_is_not_there_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upper = tmp_path / "upper.kubeconfig"
    upper.write_text("")
    missing = tmp_path / "lower.kubeconfig"
    config = parse_args(
        [
            f"--lower-kubeconfig={missing}",
            "--cluster-id=c",
            f"--upper-kubeconfig={upper}",
            "--client-ca-file=ca",
        ]
    )
    with pytest.raises(SystemExit):
        check_files(config)
    assert f"--lower-kubeconfig: no such file: {missing}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "--client-ca-file: {ca}: [Errno 2] No such file"),
        ("not a certificate", "--client-ca-file: {ca}: [X509: NO_CERTIFICATE_OR_CRL_FOUND]"),
    ],
)
def test_a_client_ca_that_cannot_be_loaded_is_one_line_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, words: str
) -> None:
    """Before, it failed as an OSError when mirroring began, taken for a connection
    failure, and mirroring was started again for ever."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("")
    ca = tmp_path / "ca.crt"
    if content is not None:
        ca.write_text(content)
    config = VirtualNodeConfig(
        str(kubeconfig), "c", upper_kubeconfig=str(kubeconfig), client_ca_file=str(ca)
    )
    with pytest.raises(SystemExit):
        check_files(config)
    assert words.format(ca=ca) in capsys.readouterr().err


def test_a_serving_certificate_that_is_not_there_is_one_line_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("")
    ca = pki.create_ca(tmp_path, "clients").cert_path
    config = VirtualNodeConfig(
        str(kubeconfig),
        "c",
        upper_kubeconfig=str(kubeconfig),
        client_ca_file=str(ca),
        tls_cert_file=str(tmp_path / "tls.crt"),
        tls_key_file=str(ca),
    )
    with pytest.raises(SystemExit):
        check_files(config)
    assert f"--tls-cert-file: no such file: {tmp_path / 'tls.crt'}" in capsys.readouterr().err


def test_a_serving_pair_that_does_not_load_or_a_cert_dir_not_writable_is_one_line_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found at the first listen, an SSLError is an OSError, taken for a connection's:
    the virtual node started again for good and never registered its Node."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("")
    ca = pki.create_ca(tmp_path, "clients")
    other = pki.create_ca(tmp_path, "others")
    config = VirtualNodeConfig(
        str(kubeconfig),
        "c",
        upper_kubeconfig=str(kubeconfig),
        client_ca_file=str(ca.cert_path),
        tls_cert_file=str(ca.cert_path),
        tls_key_file=str(other.key_path),
    )
    with pytest.raises(SystemExit):
        check_files(config)
    assert f"--tls-cert-file {ca.cert_path} and --tls-key-file {other.key_path}: " in (
        capsys.readouterr().err
    )
    unwritable = VirtualNodeConfig(
        str(kubeconfig),
        "c",
        upper_kubeconfig=str(kubeconfig),
        client_ca_file=str(ca.cert_path),
        cert_dir="/proc/nope",
    )
    with pytest.raises(SystemExit):
        check_files(unwritable)
    assert "--cert-dir /proc/nope: " in capsys.readouterr().err


@pytest.mark.parametrize("name", ["upper_burst", "lower_burst", "event_burst"])
def test_a_client_with_no_burst_is_refused_at_start(name: str) -> None:
    """A token bucket of none would let no request through: it failed as a traceback
    once mirroring began."""
    with pytest.raises(ValueError, match=f"{name} must be at least 1, not 0"):
        VirtualNodeConfig("l", "c", client_ca_file="ca", **{name: 0})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"node_name": "vk-" + "x" * 61}, "node name 'vk-xxx"),
        ({"node_name": "VK_Lower"}, "must be a DNS name of at most 63 characters"),
        # Label values, but no names of a Node or a Lease: its create was refused for ever.
        ({"node_name": "vk..lower"}, "node name 'vk..lower'"),
        ({"node_name": "vk.-lower"}, "node name 'vk.-lower'"),
        ({"node_name": "vk-.lower"}, "node name 'vk-.lower'"),
        ({"namespace_strategy": "prefix", "namespace_prefix": "Tenant_1"}, "lowercase letters"),
        ({"namespace_strategy": "prefix", "namespace_prefix": "t" * 62}, "at most 61"),
        ({"namespace_strategy": "prefix", "namespace_prefix": "acme-dev"}, "no '-'"),
        # A regular expression's `$` takes a trailing newline for the end.
        ({"namespace_strategy": "prefix", "namespace_prefix": "acme\n"}, "at most 61"),
        ({"namespace_strategy": "Prefix", "namespace_prefix": "acme"}, "not one of"),
        ({"namespace_prefix": "acme"}, "used only by the prefix namespace strategy"),
    ],
)
def test_a_name_every_lower_object_would_be_refused_for_is_refused_at_start(
    settings: dict[str, Any], words: str
) -> None:
    """The node name labels every lower pod; the prefix starts every lower namespace's
    name: either wrong, every create below would fail, and the pods wait for good."""
    with pytest.raises(ValueError, match=words):
        VirtualNodeConfig("l", "c", client_ca_file="ca", **settings)


def test_a_cluster_id_with_a_trailing_newline_is_refused_at_start() -> None:
    """A regular expression's `$` takes a trailing newline for the end: the id passed,
    and every label value made of it was refused below."""
    with pytest.raises(ValueError, match="cluster id 'lower-1\\\\n' must be a DNS label"):
        VirtualNodeConfig("l", "lower-1\n", client_ca_file="ca")


@pytest.mark.parametrize("name", ["a", "vk-lower-1", "vk.lower-1.eu-west", "a." * 31 + "b"])
def test_a_dns_subdomain_short_enough_for_a_label_value_is_a_node_name(name: str) -> None:
    assert VirtualNodeConfig("l", "c", client_ca_file="ca", node_name=name).node_name == name


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"taint": "false"}, "taint must be bool, not 'false'"),
        ({"leader_elect": 0}, "leader_elect must be bool, not 0"),
        ({"upper_qps": "abc"}, "upper_qps must be a number, not 'abc'"),
        ({"workers": 2.5}, "workers must be int, not 2.5"),
        ({"kubelet_port": True}, "kubelet_port must be int, not True"),
        ({"address": 10}, "address must be str, not 10"),
        ({"event_qps": -1}, "event_qps must be above 0, not -1"),
        ({"health_port": 10250}, "ports must differ"),
        ({"estimator_port": 10250}, "ports must differ"),
    ],
)
def test_a_setting_of_the_wrong_type_or_a_port_taken_twice_is_refused_at_start(
    settings: dict[str, Any], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A YAML file's `taint: "false"` is a true string, a quoted number failed at the
    first request, and a port given twice failed its bind at every restart of the work."""
    with pytest.raises(ValueError, match=re.escape(words)):
        VirtualNodeConfig("l", "c", client_ca_file="ca", **settings)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(settings))
    with pytest.raises(SystemExit):
        parse_args(["--lower-kubeconfig=l", "--cluster-id=c", f"--config={config}"])
    assert words in capsys.readouterr().err


def test_zero_ports_are_none_and_may_repeat() -> None:
    config = VirtualNodeConfig("l", "c", client_ca_file="ca", estimator_port=0, health_port=0)
    assert (config.estimator_port, config.health_port) == (0, 0)
