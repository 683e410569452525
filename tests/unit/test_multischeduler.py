"""The extender's pure parts: the scheduler's requests, filter answers, scores, what is
remembered between calls, metrics, and the command line."""

from __future__ import annotations

import asyncio
import importlib
import os
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from harness.federation import scheduler_extender
from kubekit import keys, pki
from kubekit.client import NODES
from kubekit.estimatorapi import RESERVATION_SECONDS
from kubekit.estimatorapi.estimator_pb2 import PodEstimate
from kubekit.ratelimit import TokenBucket
from multischeduler.estimators import TokenFile
from multischeduler.extender import (
    Answer,
    BadRequest,
    BindingArgs,
    Decisions,
    EstimatorFailure,
    Metrics,
    OnEstimatorError,
    Score,
    VirtualNode,
    binding_body,
    chosen_cluster,
    filter_result,
    parse_binding_args,
    parse_extender_args,
    reserved_nodes,
    room_to_give_back,
    scores,
    virtual_node,
)
from multischeduler.main import api_calls, parse_args
from multischeduler.server import Callers
from tests.unit.fakeapi import FakeClient

MANIFESTS = Path(__file__).parents[2] / "manifests" / "multischeduler"
POD = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"}, "spec": {}}


def body(value: Any) -> bytes:
    return orjson.dumps(value)


def fitting(**fields: Any) -> PodEstimate:
    return PodEstimate(max_replicas=1, fitting_count=1, total_nodes=3, **fields)


NO_ROOM = PodEstimate(
    max_replicas=0,
    total_nodes=3,
    reasons={"Insufficient cpu": 3},
    message="0/3 nodes are available: 3 Insufficient cpu",
)


# -- requests ----------------------------------------------------------------------------


def test_extender_args_are_read() -> None:
    args = parse_extender_args(body({"Pod": POD, "NodeNames": ["a", "b"], "Nodes": None}))
    assert args.uid == "u1"
    assert args.node_names == ["a", "b"]
    assert args.pod == POD
    assert args.pod_key == "ns/p"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not JSON"),
        (b"[]", "must be a JSON object"),
        (body({"NodeNames": []}), "Pod must be a Pod object"),
        (body({"Pod": "p", "NodeNames": []}), "Pod must be a Pod object"),
        (body({"Pod": {"metadata": []}, "NodeNames": []}), "Pod.metadata must be an object"),
        (body({"Pod": {"metadata": {"name": "p"}}, "NodeNames": []}), "Pod.metadata.uid"),
        (body({"Pod": {"metadata": {"uid": 7}}, "NodeNames": []}), "Pod.metadata.uid"),
        (body({"Pod": POD, "Nodes": {"items": []}}), "nodeCacheCapable: true"),
        (body({"Pod": POD, "NodeNames": "a"}), "NodeNames must be a list of strings"),
        (body({"Pod": POD, "NodeNames": ["a", 1]}), "NodeNames must be a list of strings"),
    ],
)
def test_bad_extender_args_are_refused_clearly(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_extender_args(raw)


def test_binding_args_make_the_binding() -> None:
    args = parse_binding_args(
        body({"PodName": "p", "PodNamespace": "ns", "PodUID": "u1", "Node": "vk-lower-1"})
    )
    assert args == BindingArgs("p", "ns", "u1", "vk-lower-1")
    assert binding_body(args) == {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "vk-lower-1"},
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"PodNamespace": "ns", "PodUID": "u", "Node": "n"}, "PodName"),
        ({"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": ""}, "Node"),
        ({"PodName": "p", "PodNamespace": 3, "PodUID": "u", "Node": "n"}, "PodNamespace"),
        ("bind", "must be a JSON object"),
    ],
)
def test_bad_binding_args_are_refused_clearly(value: Any, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_binding_args(body(value))


def node(name: str, labels: dict[str, str], annotations: dict[str, str] | None = None) -> Any:
    return {"metadata": {"name": name, "labels": labels, "annotations": annotations or {}}}


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (node("worker", {"type": "worker"}), None),
        (node("worker", {}), None),
        # Another virtual-kubelet provider's Node (ACI): not ours, no estimator to ask.
        (node("virtual-node-aci-linux", {keys.NODE_TYPE_LABEL: keys.NODE_TYPE_VIRTUAL}), None),
        (
            node(
                "vk-lower-1",
                {
                    keys.NODE_TYPE_LABEL: keys.NODE_TYPE_VIRTUAL,
                    keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
                    keys.PROVEN_VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE,
                    keys.CLUSTER_ID_LABEL: "lower-1",
                },
                {keys.ESTIMATOR_ADDRESS_ANNOTATION: "10.0.0.5:10351"},
            ),
            VirtualNode("vk-lower-1", "lower-1", "10.0.0.5:10351"),
        ),
        (
            # A kubelet may label its own Node virtual, not under node-restriction.
            node(
                "vk-x",
                {keys.VIRTUAL_NODE_LABEL: keys.VIRTUAL_NODE_LABEL_VALUE},
                {keys.ESTIMATOR_ADDRESS_ANNOTATION: "10.0.0.7:10351"},
            ),
            VirtualNode("vk-x", "", "10.0.0.7:10351", proven=False),
        ),
    ],
)
def test_virtual_nodes_are_told_from_ordinary_ones(obj: Any, expected: VirtualNode | None) -> None:
    assert virtual_node(obj) == expected


# -- filter ------------------------------------------------------------------------------


def test_filter_passes_ordinary_nodes_and_fitting_clusters_and_fails_the_rest() -> None:
    answers: dict[str, Answer] = {
        "vk-fits": fitting(reserved_node="n1"),
        "vk-full": NO_ROOM,
        "vk-bad": PodEstimate(error="cannot decode the stash"),
        "vk-down": EstimatorFailure("10.0.0.9:10351: UNAVAILABLE: connection refused"),
    }
    names = ["worker", "vk-fits", "vk-full", "vk-bad", "vk-down"]
    result = filter_result(names, answers, OnEstimatorError.FAIL, "vk-fits")
    assert result == {
        "NodeNames": ["worker", "vk-fits"],
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": {
            "vk-full": "vk-full: 0/3 nodes are available: 3 Insufficient cpu",
            "vk-bad": "vk-bad: estimator cannot read the pod: cannot decode the stash",
            "vk-down": "vk-down: estimator unavailable: "
            "10.0.0.9:10351: UNAVAILABLE: connection refused",
        },
        "Error": "",
    }
    ignoring = filter_result(names, answers, OnEstimatorError.IGNORE, "vk-fits")
    assert ignoring["NodeNames"] == ["worker", "vk-fits", "vk-down"]
    assert set(ignoring["FailedAndUnresolvableNodes"]) == {"vk-full", "vk-bad"}


def test_of_the_clusters_that_fit_only_the_chosen_one_passes() -> None:
    answers: dict[str, Answer] = {
        "vk-a": fitting(reserved_node="n1"),
        "vk-b": fitting(reserved_node="n2"),
        "vk-down": EstimatorFailure("timeout"),
    }
    names = ["worker", "vk-a", "vk-b", "vk-down"]
    result = filter_result(names, answers, OnEstimatorError.IGNORE, "vk-b")
    assert result["NodeNames"] == ["worker", "vk-b", "vk-down"]
    assert result["FailedAndUnresolvableNodes"] == {
        "vk-a": "vk-a: the pod fits, but vk-b ranks first"
    }


def test_a_cluster_without_room_and_without_a_message_still_says_why() -> None:
    result = filter_result(["vk"], {"vk": PodEstimate()}, OnEstimatorError.FAIL, None)
    assert result["FailedAndUnresolvableNodes"] == {"vk": "vk: the pod fits no node of the cluster"}


def test_room_is_held_where_reserved_or_maybe_reserved() -> None:
    answers: dict[str, Answer] = {
        "vk-a": fitting(reserved_node="n1"),
        "vk-b": fitting(),
        "vk-c": NO_ROOM,
        "vk-slow": EstimatorFailure("DEADLINE_EXCEEDED", maybe_reserved=True),
        "vk-down": EstimatorFailure("UNAVAILABLE"),
    }
    assert reserved_nodes(answers) == {"vk-a", "vk-slow"}


# -- scores ------------------------------------------------------------------------------


def score_of(result: list[dict[str, Any]]) -> dict[str, int]:
    return {entry["Host"]: entry["Score"] for entry in result}


@pytest.mark.parametrize(
    ("estimates", "score", "expected"),
    [
        # Best fit: the tighter cluster wins; least allocated: the emptier one.
        (
            {
                "vk-a": fitting(best_fit=0.9, least_allocated=0.2),
                "vk-b": fitting(best_fit=0.3, least_allocated=0.8),
            },
            Score.BEST_FIT,
            {"worker": 9, "vk-a": 9, "vk-b": 3},
        ),
        (
            {
                "vk-a": fitting(best_fit=0.9, least_allocated=0.2),
                "vk-b": fitting(best_fit=0.3, least_allocated=0.8),
            },
            Score.LEAST_ALLOCATED,
            {"worker": 8, "vk-a": 2, "vk-b": 8},
        ),
        # Preferred weights are normalised to the best candidate's and averaged in.
        (
            {
                "vk-a": fitting(best_fit=0.6, preferred=50),
                "vk-b": fitting(best_fit=0.6, preferred=100),
            },
            Score.BEST_FIT,
            {"worker": 8, "vk-a": 6, "vk-b": 8},
        ),
        # Half rounds up; out-of-range fits are clamped; a cluster without room scores 0;
        # an ordinary node, the best score given (the extender ranks it neither way).
        (
            {"vk-a": fitting(best_fit=0.25), "vk-b": fitting(best_fit=1.7), "vk-c": NO_ROOM},
            Score.BEST_FIT,
            {"worker": 10, "vk-a": 3, "vk-b": 10, "vk-c": 0},
        ),
        ({}, Score.BEST_FIT, {"worker": 0}),
    ],
)
def test_scores(estimates: dict[str, PodEstimate], score: Score, expected: dict[str, int]) -> None:
    names = ["worker", *estimates]
    result = scores(names, estimates, score, ordinary=["worker"])
    assert [entry["Host"] for entry in result] == names
    assert score_of(result) == expected


def test_an_ordinary_node_ranks_with_the_chosen_cluster_above_unchecked_ones() -> None:
    # vk-x was let through without an estimate (--on-estimator-error ignore).
    estimates = {"vk-a": fitting(best_fit=0.5)}
    result = scores(["worker", "vk-a", "vk-x"], estimates, Score.BEST_FIT, ordinary=["worker"])
    assert score_of(result) == {"worker": 5, "vk-a": 5, "vk-x": 0}


def test_preferred_weights_count_only_among_the_candidates() -> None:
    estimates = {"vk-a": fitting(best_fit=1.0, preferred=10), "vk-b": fitting(preferred=90)}
    assert score_of(scores(["vk-a"], estimates, Score.BEST_FIT)) == {"vk-a": 10}


# -- memory between calls ----------------------------------------------------------------


def test_decisions_keep_estimates_briefly_and_reservations_longer() -> None:
    decisions = Decisions(scores_for=5, reservations_for=25)
    decisions.remember("u1", {"vk-a": fitting(reserved_node="n"), "vk-b": NO_ROOM}, now=100)
    assert set(decisions.estimates("u1", now=104)) == {"vk-a", "vk-b"}
    assert decisions.estimates("u1", now=106) == {}
    assert decisions.estimates("other", now=100) == {}
    assert decisions.take_reserved("u1", now=125) == {"vk-a"}
    assert decisions.take_reserved("u1", now=125) == set()


def test_a_reservation_is_taken_for_lapsed_before_its_estimator_drops_it() -> None:
    """A bind 40 s after filter (a volume bound first): the estimator gave the room back
    at 30 s, so bind must hold it again, and needs the pod for that."""
    decisions = Decisions()
    assert decisions.reservations_for < RESERVATION_SECONDS
    decisions.remember("u1", {"vk-a": fitting(reserved_node="n")}, now=0, pod=b"pod")
    decisions.remember("u1", {"vk-b": fitting(reserved_node="m")}, now=20, pod=b"pod")
    assert decisions.pod("u1") == b"pod"
    assert decisions.take_reserved("u1", now=40) == {"vk-b"}, "vk-a's lapsed at 30"


def test_a_second_filter_of_a_pod_adds_to_the_first() -> None:
    decisions = Decisions()
    decisions.remember("u1", {"vk-a": fitting(reserved_node="n")}, now=0)
    decisions.remember("u1", {"vk-b": fitting(reserved_node="m")}, now=1)
    assert set(decisions.estimates("u1", now=1)) == {"vk-a", "vk-b"}
    assert decisions.take_reserved("u1", now=1) == {"vk-a", "vk-b"}


def test_a_second_filter_that_gave_back_the_first_s_room_does_not_count_it_held() -> None:
    """The first filter held room on vk-a; the second's call to vk-a failed and gave it
    back: bind, choosing vk-a (estimator errors ignored), must hold room there anew."""
    decisions = Decisions()
    decisions.remember("u1", {"vk-a": fitting(reserved_node="n")}, now=0)
    decisions.remember("u1", {"vk-b": fitting(reserved_node="m")}, now=1, released=["vk-a"])
    assert decisions.take_reserved("u1", now=1) == {"vk-b"}


def test_decisions_are_forgotten_after_a_while() -> None:
    decisions = Decisions(kept_for=60)
    decisions.remember("old", {"vk-a": fitting(reserved_node="n")}, now=0)
    decisions.remember("new", {"vk-a": fitting(reserved_node="n")}, now=30)
    decisions.remember("newer", {"vk-a": fitting(reserved_node="n")}, now=61)
    assert len(decisions) == 2
    assert decisions.take_reserved("new", now=91) == set()
    assert len(decisions) == 1


def test_a_pod_that_left_the_queue_gets_back_what_a_later_filter_reserves() -> None:
    decisions = Decisions(left_for=30)
    decisions.remember("u1", {"vk-a": fitting(reserved_node="n")}, now=0)
    assert decisions.left_queue("u1", now=1) == {"vk-a"}
    answers = {"vk-a": fitting(reserved_node="n"), "vk-b": fitting(reserved_node="m")}
    assert decisions.remember("u1", answers, now=2, released={"vk-b"}) == {"vk-a"}
    assert len(decisions) == 0, "not remembered: nothing would take it back"
    assert decisions.left_queue("u2", now=3) == set()
    # Forgotten after a while: a pod's UID is never seen in the queue again, so the
    # mark only has to outlive the scheduling cycle that took the pod.
    assert decisions.remember("u2", answers, now=40) == set()
    assert decisions.take_reserved("u2", now=40) == {"vk-a", "vk-b"}


def pod_read(uid: str = "u1", node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": []}
    if node is not None:
        spec["nodeName"] = node
    return {"metadata": {"name": "p", "namespace": "ns", "uid": uid}, "spec": spec}


@pytest.mark.parametrize(
    ("now", "given_back"),
    [
        (None, {"vk-a", "vk-b"}),  # deleted
        (pod_read(uid="u2", node="vk-a"), {"vk-a", "vk-b"}),  # another pod of that name
        (pod_read(node="worker"), {"vk-a", "vk-b"}),  # an ordinary node
        (pod_read(node="vk-a"), {"vk-b"}),  # one of the nodes holding room keeps it
        (pod_read(), set()),  # the read lags: still waiting, the room lapses
    ],
)
def test_room_given_back_depends_on_where_the_pod_went(
    now: dict[str, Any] | None, given_back: set[str]
) -> None:
    assert room_to_give_back({"vk-a", "vk-b"}, "u1", now) == given_back


# -- metrics -----------------------------------------------------------------------------


def test_metrics_text_declares_every_family() -> None:
    metrics = Metrics()
    metrics.filter_seconds.observe(0.002)
    metrics.decisions.labels("filter").inc()
    metrics.estimator_errors.inc(2)
    text = metrics.prometheus_text()
    assert text.endswith("\n")
    for family, kind in [
        ("kubestrata_extender_filter_seconds", "histogram"),
        ("kubestrata_extender_decisions_total", "counter"),
        ("kubestrata_extender_estimator_errors_total", "counter"),
        ("kubestrata_extender_bind_errors_total", "counter"),
        ("kubestrata_extender_bind_seconds", "histogram"),
    ]:
        assert f"# TYPE {family} {kind}\n" in text
        assert f"# HELP {family} " in text
    assert 'kubestrata_extender_filter_seconds_bucket{le="0.005"} 1.0\n' in text
    assert 'kubestrata_extender_decisions_total{verb="filter"} 1.0\n' in text
    assert 'kubestrata_extender_decisions_total{verb="bind"} 0.0\n' in text
    assert "kubestrata_extender_estimator_errors_total 2.0\n" in text
    # With the process's own: API requests, work queues.
    assert "# TYPE rest_client_requests_total counter\n" in text


# -- credentials and the command line ----------------------------------------------------


def test_the_token_is_read_again_when_its_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    token = TokenFile(path)
    assert token.token() == "first"
    # Rotation replaces the file (kubelet swaps a symlink), so its inode changes.
    replacement = tmp_path / "token.new"
    replacement.write_text("second\n")
    os.replace(replacement, path)
    assert token.token() == "second"


def test_defaults_and_a_generated_serving_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    client_ca = pki.create_ca(tmp_path, "scheduler-clients").cert_path
    config = parse_args(
        ["--cert-dir", str(tmp_path), "--listen", "127.0.0.1:9443", f"--client-ca-file={client_ca}"]
    )
    assert (config.host, config.port) == ("127.0.0.1", 9443)
    assert config.client_ca_file == client_ca
    assert config.callers == Callers(names=frozenset())
    assert config.cert_file == tmp_path / "multischeduler.crt"
    assert (tmp_path / "multischeduler-ca.crt").is_file()
    assert config.estimator_timeout == 0.5
    assert config.on_estimator_error is OnEstimatorError.FAIL
    assert config.score is Score.BEST_FIT
    assert config.kubeconfig is None


def test_every_flag(tmp_path: Path) -> None:
    pair = pki.serving_pair(tmp_path, "x", ("127.0.0.1",))
    token = tmp_path / "token"
    token.write_text("t")
    config = parse_args(
        [
            f"--kubeconfig={token}",
            f"--tls-cert-file={pair.cert_path}",
            f"--tls-key-file={pair.key_path}",
            f"--client-ca-file={pki.ca_path(pair)}",
            "--client-name=system:kube-scheduler",
            "--client-name=kubestrata-scheduler",
            f"--estimator-ca-file={pki.ca_path(pair)}",
            f"--estimator-token-file={token}",
            "--estimator-timeout=0.25",
            "--on-estimator-error=ignore",
            "--score=least-allocated",
            "--log-level=DEBUG",
        ]
    )
    assert (config.host, config.port) == ("0.0.0.0", 8443)
    assert config.cert_file == pair.cert_path
    assert config.callers == Callers(frozenset({"system:kube-scheduler", "kubestrata-scheduler"}))
    assert config.estimators.ca_file == pki.ca_path(pair)
    assert config.estimators.token_file == token
    assert config.kubeconfig == str(token)
    assert config.estimator_timeout == 0.25
    assert config.on_estimator_error is OnEstimatorError.IGNORE
    assert config.score is Score.LEAST_ALLOCATED


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kubeconfig=K"], "--tls-cert-file/--tls-key-file or --cert-dir"),
        (["--cert-dir=D"], "--kubeconfig is needed outside a cluster"),
        (["--cert-dir=D", "--kubeconfig=/nonexistent"], "no such file"),
        (["--cert-dir=D", "--kubeconfig=D"], "no such file"),
        (["--kubeconfig=K", "--cert-dir=D", "--listen=8443"], "--listen must be HOST:PORT"),
        (["--kubeconfig=K", "--tls-cert-file=/nonexistent"], "go together"),
        (["--kubeconfig=K", "--tls-cert-file=/x", "--tls-key-file=/y"], "no such file"),
        # Found at the first listen, "[SSL] PEM lib", which names no file.
        (["--kubeconfig=K", "--tls-cert-file=K", "--tls-key-file=K"], "--tls-cert-file"),
        # A traceback before (a read-only root, a typo).
        (["--kubeconfig=K", "--cert-dir=/proc/nope"], "--cert-dir /proc/nope: "),
        (["--kubeconfig=K", "--cert-dir=D", "--estimator-ca-file=/nonexistent"], "no such file"),
        (["--kubeconfig=K", "--cert-dir=D", "--estimator-timeout=0"], "above 0"),
        (["--kubeconfig=K", "--cert-dir=D", "--estimator-timeout=soon"], "not a number"),
        (["--kubeconfig=K", "--cert-dir=D", "--estimator-timeout=5"], "at most 2 seconds"),
        (["--kubeconfig=K", "--cert-dir=D", "--on-estimator-error=retry"], "invalid choice"),
        (["--kubeconfig=K", "--cert-dir=D", "--score=random"], "invalid choice"),
        (["--kubeconfig=K", "--cert-dir=D", "--client-ca-file=/nonexistent"], "No such file"),
        (["--kubeconfig=K", "--cert-dir=D", "--client-ca-file=K"], "no certificate"),
    ],
)
def test_bad_flags_exit_2_with_a_message(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("{}")
    argv = [a.replace("=D", f"={tmp_path}").replace("=K", f"={kubeconfig}") for a in argv]
    client_ca = pki.create_ca(tmp_path, "scheduler-clients").cert_path
    with pytest.raises(SystemExit) as exit_:
        parse_args([f"--client-ca-file={client_ca}", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_extender_does_not_start_without_the_scheduler_s_client_ca(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        parse_args([f"--kubeconfig={kubeconfig}", f"--cert-dir={tmp_path}"])
    assert exit_.value.code == 2
    assert "the following arguments are required: --client-ca-file" in capsys.readouterr().err


# -- manifests ---------------------------------------------------------------------------


def documents(name: str) -> list[Any]:
    return list(yaml.safe_load_all((MANIFESTS / name).read_text()))


def test_the_scheduler_configuration_is_the_one_kubestrata_up_writes() -> None:
    [configuration] = documents("scheduler-config.yaml")
    assert configuration["kind"] == "KubeSchedulerConfiguration"
    [extender] = configuration["extenders"]
    tls = extender["tlsConfig"]
    client = pki.KeyPair(Path(tls["certFile"]), Path(tls["keyFile"]))
    local = scheduler_extender(extender["urlPrefix"], Path(tls["caFile"]), client)
    assert extender == local
    assert extender["urlPrefix"].endswith(":8443")


def core_grants(role: dict[str, Any]) -> set[tuple[str, str]]:
    """(resource, verb) pairs a ClusterRole grants in the core API group."""
    return {
        (resource, verb)
        for rule in role["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        if rule["apiGroups"] == [""]
    }


def test_rbac_grants_exactly_what_the_extender_and_slicing_use() -> None:
    account, role, binding, lease_role, lease_binding = documents("rbac.yaml")
    assert lease_role["metadata"]["namespace"] == "kubestrata-system"
    assert lease_role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update"],
        }
    ]
    assert lease_binding["roleRef"]["name"] == lease_role["metadata"]["name"]
    assert account["metadata"] == {
        "name": "kubestrata-multischeduler",
        "namespace": "kubestrata-system",
    }
    assert core_grants(role) == {
        ("nodes", "get"),
        ("nodes", "list"),
        ("nodes", "watch"),
        ("pods/binding", "create"),
        ("nodes/estimator", "get"),
        ("nodes/estimator", "create"),
        ("namespaces", "get"),
        ("namespaces", "list"),
        ("namespaces", "watch"),
        ("namespaces", "patch"),
        ("namespaces/status", "patch"),
        ("resourcequotas", "list"),
        ("resourcequotas", "watch"),
        ("pods", "get"),
        ("pods", "list"),
        ("pods", "watch"),
        ("events", "create"),
    }
    assert len(role["rules"]) == 8 and "*" not in str(role["rules"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": "kubestrata-multischeduler",
            "namespace": "kubestrata-system",
        }
    ]


def test_the_deployment_starts_the_extender_with_flags_it_knows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    deployment, service, _budget = documents("deployment.yaml")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    command, *args = container["args"]
    assert command == "multischeduler"
    pair = pki.serving_pair(tmp_path, "x", ("127.0.0.1",))
    certs = "/var/run/kubestrata/certs/"
    client_ca = "/var/run/kubestrata/client-ca/ca.crt"
    local = [
        a.replace(certs + "tls.crt", str(pair.cert_path))
        .replace(certs + "tls.key", str(pair.key_path))
        .replace(client_ca, str(pki.ca_path(pair)))
        for a in args
    ]
    config = parse_args(local)
    assert config.client_ca_file == pki.ca_path(pair)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/var/run/kubestrata/client-ca"]]["configMap"] == {
        "name": "kubestrata-multischeduler-client-ca"
    }
    assert config.port == 8443 == service["spec"]["ports"][0]["port"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_chosen_cluster_is_the_one_ranked_first() -> None:
    answers: dict[str, Answer] = {
        "vk-b": fitting(best_fit=0.9, reserved_node="n1"),
        "vk-a": fitting(best_fit=0.5, reserved_node="n2"),
        "vk-c": fitting(best_fit=0.9, reserved_node="n3"),
        "vk-full": NO_ROOM,
        "vk-late": EstimatorFailure("timeout", maybe_reserved=True),
    }
    # vk-b and vk-c tie at the top: the first name is chosen.
    assert chosen_cluster(answers, Score.BEST_FIT) == "vk-b"
    assert chosen_cluster(answers, Score.LEAST_ALLOCATED) == "vk-a"
    assert (
        chosen_cluster({"vk-full": NO_ROOM, "vk-late": answers["vk-late"]}, Score.BEST_FIT) is None
    )


def test_the_multischeduler_s_requests_go_in_the_scheduler_s_priority_level() -> None:
    [account, *_] = documents("rbac.yaml")
    [schema] = documents("flowschema.yaml")
    spec = schema["spec"]
    # The scheduler's own level (precedence and kustomization: tests/unit/test_manifests.py).
    assert spec["priorityLevelConfiguration"] == {"name": "workload-high"}
    [rule] = spec["rules"]
    assert rule["subjects"] == [
        {"kind": "ServiceAccount", "serviceAccount": account["metadata"]},
    ]


class PacedClient(FakeClient):
    """Waits for its request budget first, as KubeClient does."""

    async def request(self, *args: Any, **kwargs: Any) -> Any:
        await self.limiter.acquire()
        return await super().request(*args, **kwargs)


async def test_the_apiserver_calls_keep_their_deadline_while_the_budget_is_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait for the client's request budget came before each call's own timeout: in
    a burst it alone outlasted the scheduler's 5 s for the whole filter or bind."""
    # The module, not the package's `main` function of the same name.
    main_module = importlib.import_module("multischeduler.main")
    monkeypatch.setattr(main_module, "LOOKUP_TIMEOUT", 0.1)
    monkeypatch.setattr(main_module, "BIND_TIMEOUT", 0.1)
    client = PacedClient()
    client.limiter = TokenBucket(qps=0.01, burst=1)
    client.limiter.reserve()  # spent for the next 100 s
    bind, lookup = api_calls(client)
    binding = BindingArgs(pod_name="p", pod_namespace="ns", pod_uid="u", node="vk-lower-1")
    calls: list[asyncio.Future[Any]] = [
        asyncio.ensure_future(lookup(NODES, None, "vk-lower-1")),
        asyncio.ensure_future(bind(binding)),
    ]
    # Twenty times their deadline: ended on their own, not still waiting for a token.
    done, waiting = await asyncio.wait(calls, timeout=2)
    for task in waiting:
        task.cancel()
    assert not waiting
    assert all(isinstance(task.exception(), TimeoutError) for task in done)
    assert client.requests == []
