"""The pure parts of the kubelet API: query parsing, authorization attributes, metrics,
serving-certificate approval and the exec status translation."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID
from multidict import MultiDict

from kubekit import keys, pki
from kubekit.client import PODS, ApiError, ClientSettings, KubeClient
from kubekit.informer import Informer
from kubekit.keys import UPPER_UID_ANNOTATION
from tests.unit.fakeapi import FakeClient
from tests.unit.tlsserver import serving_over_tls
from virtual_node.kubeletapi import auth, channels
from virtual_node.kubeletapi.auth import (
    MAX_PENDING_REVIEWS,
    AuthError,
    Authorizer,
    User,
    node_attributes,
    user_from_certificate,
)
from virtual_node.kubeletapi.certificates import SIGNER, USAGES, approvable, signing_request
from virtual_node.kubeletapi.metrics import (
    COUNTER_START_SECONDS,
    NODE_MEMORY_FLOOR_BYTES,
    CpuCounters,
    UpperPod,
    cadvisor_text,
    mirrored_pod_metrics,
    prometheus_text,
    summary,
)
from virtual_node.kubeletapi.provider import ExecOptions, LogOptions, ProviderError
from virtual_node.kubeletapi.server import (
    BadParameter,
    error_response,
    parse_exec_options,
    parse_log_options,
    parse_ports,
    running_pods,
)
from virtual_node.kubeletstreams import (
    LowerKubelet,
    WebSocketPort,
    container_starts,
    exec_status,
    lower_failure,
)
from virtual_node.naming import NamespaceMapping

# --- containerLogs query ---------------------------------------------------------------------


def test_log_options_default_to_nothing() -> None:
    assert parse_log_options(MultiDict()) == LogOptions()
    assert LogOptions().query() == {}


def test_log_options_read_every_parameter() -> None:
    query = MultiDict(
        follow="true",
        tailLines="0",
        limitBytes="1",
        previous="1",
        sinceSeconds="30",
        timestamps="TRUE",
    )
    assert parse_log_options(query) == LogOptions(
        follow=True,
        tail_lines=0,
        limit_bytes=1,
        previous=True,
        since_seconds=30,
        since_time=None,
        timestamps=True,
    )


@pytest.mark.parametrize("since_time", ["2024-05-01T10:20:30Z", "2024-05-01T10:20:30.123456+02:00"])
def test_log_options_accept_rfc3339_since_time(since_time: str) -> None:
    options = parse_log_options(MultiDict(sinceTime=since_time, follow="false"))
    assert options.since_time == since_time
    assert options.follow is False


@pytest.mark.parametrize(
    ("query", "parameter"),
    [
        ({"tailLines": "-1"}, "tailLines"),
        ({"tailLines": "ten"}, "tailLines"),
        ({"limitBytes": "0"}, "limitBytes"),
        ({"sinceSeconds": "0"}, "sinceSeconds"),
        ({"sinceTime": "2024-05-01 10:20:30"}, "sinceTime"),
        ({"sinceTime": "yesterday"}, "sinceTime"),
        ({"follow": "maybe"}, "follow"),
        ({"previous": "yes"}, "previous"),
        ({"timestamps": "2"}, "timestamps"),
        ({"sinceSeconds": "5", "sinceTime": "2024-05-01T10:20:30Z"}, "sinceSeconds and sinceTime"),
    ],
)
def test_bad_log_parameter_is_named(query: dict[str, str], parameter: str) -> None:
    with pytest.raises(BadParameter) as raised:
        parse_log_options(MultiDict(query))
    assert str(raised.value).startswith(f"{parameter}:")


def test_since_time_with_trailing_newline_is_refused() -> None:
    with pytest.raises(BadParameter, match="sinceTime"):
        parse_log_options(MultiDict(sinceTime="2024-05-01T10:20:30Z\n"))


def test_log_options_query_uses_apiserver_names_and_round_trips() -> None:
    options = LogOptions(
        follow=True, tail_lines=0, limit_bytes=512, previous=True, since_seconds=9, timestamps=True
    )
    assert options.query() == {
        "follow": "true",
        "tailLines": "0",
        "limitBytes": "512",
        "previous": "true",
        "sinceSeconds": "9",
        "timestamps": "true",
    }
    assert parse_log_options(MultiDict(options.query())) == options
    timed = LogOptions(since_time="2024-05-01T10:20:30Z")
    assert timed.query() == {"sinceTime": "2024-05-01T10:20:30Z"}
    assert parse_log_options(MultiDict(timed.query())) == timed


# --- exec, attach and port-forward queries -----------------------------------------------------


def test_exec_options_from_apiserver_names() -> None:
    query = MultiDict(
        [
            ("command", "sh"),
            ("command", "-c"),
            ("command", "echo hi"),
            ("input", "1"),
            ("output", "1"),
            ("error", "1"),
        ]
    )
    assert parse_exec_options(query, attach=False) == ExecOptions(
        command=("sh", "-c", "echo hi"), stdin=True, stdout=True, stderr=True, tty=False
    )


def test_exec_options_from_kubectl_names() -> None:
    query = MultiDict([("command", "bash"), ("stdin", "true"), ("stdout", "true"), ("tty", "1")])
    assert parse_exec_options(query, attach=False) == ExecOptions(
        command=("bash",), stdin=True, stdout=True, stderr=False, tty=True
    )


def test_exec_stream_flag_false_is_not_a_stream() -> None:
    query = MultiDict(command="ls", output="0", error="1")
    options = parse_exec_options(query, attach=False)
    assert (options.stdin, options.stdout, options.stderr) == (False, False, True)


@pytest.mark.parametrize(
    ("query", "attach", "parameter"),
    [
        ([("command", "ls")], False, "input, output, error"),
        ([("command", "ls"), ("output", "0"), ("stdout", "false")], False, "input, output, error"),
        ([("output", "1")], False, "command"),
        ([("output", "perhaps"), ("command", "ls")], False, "output"),
        ([], True, "input, output, error"),
    ],
)
def test_bad_exec_query_is_named(
    query: list[tuple[str, str]], attach: bool, parameter: str
) -> None:
    with pytest.raises(BadParameter) as raised:
        parse_exec_options(MultiDict(query), attach=attach)
    assert str(raised.value).startswith(parameter)


def test_attach_needs_no_command() -> None:
    options = parse_exec_options(MultiDict(input="1", output="1", tty="1"), attach=True)
    assert options == ExecOptions(command=(), stdin=True, stdout=True, stderr=False, tty=True)


def test_ports_comma_separated_and_repeated() -> None:
    assert parse_ports(MultiDict([("port", "80,443"), ("port", "8080")])) == (80, 443, 8080)
    assert parse_ports(MultiDict([("port", "1"), ("port", "65535")])) == (1, 65535)
    assert parse_ports(MultiDict()) == ()


@pytest.mark.parametrize("value", ["0", "65536", "-1", "http", "80,", "80,,443", "8o"])
def test_bad_port_is_named(value: str) -> None:
    with pytest.raises(BadParameter, match=r"^port: "):
        parse_ports(MultiDict(port=value))


def test_an_error_is_its_message_in_plain_text_as_the_kubelet_writes_it() -> None:
    response = error_response(404, "pod default/x not found on this node")
    assert (response.status, response.content_type) == (404, "text/plain")
    assert response.body == b"pod default/x not found on this node"


# --- authorization attributes and certificate users --------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/containerLogs/default/p/app", ("get", ("proxy",))),
        ("POST", "/exec/default/p/app", ("create", ("proxy",))),
        ("HEAD", "/pods", ("get", ("pods", "proxy"))),
        ("PUT", "/pods", ("update", ("pods", "proxy"))),
        ("PATCH", "/pods", ("patch", ("pods", "proxy"))),
        ("DELETE", "/pods", ("delete", ("pods", "proxy"))),
        ("GET", "/pods/", ("get", ("pods", "proxy"))),
        ("GET", "/podsx", ("get", ("proxy",))),
        ("OPTIONS", "/healthz", ("options", ("healthz", "proxy"))),
        ("GET", "/healthz/ping", ("get", ("healthz", "proxy"))),
        ("GET", "/configz", ("get", ("configz", "proxy"))),
        ("GET", "/runningpods/", ("get", ("pods", "proxy"))),
        ("GET", "/stats", ("get", ("stats",))),
        ("GET", "/stats/summary", ("get", ("stats",))),
        ("GET", "/metrics", ("get", ("metrics",))),
        ("GET", "/metrics/resource", ("get", ("metrics",))),
        ("GET", "/logs/x", ("get", ("log",))),
        ("GET", "/logs", ("get", ("log",))),
        ("POST", "/checkpoint/default/p/app", ("create", ("checkpoint",))),
        ("GET", "/statusz", ("get", ("statusz",))),
        ("GET", "/flagz", ("get", ("configz",))),
        ("GET", "/statsfoo", ("get", ("proxy",))),
        ("GET", "/metricsx/resource", ("get", ("proxy",))),
        ("GET", "/logsy", ("get", ("proxy",))),
        # A stream into a pod takes create, also asked for with GET (a WebSocket).
        ("GET", "/exec/default/p/app", ("create", ("proxy",))),
        ("GET", "/attach/default/p/app", ("create", ("proxy",))),
        ("GET", "/portForward/default/p", ("create", ("proxy",))),
        ("GET", "/run/default/p/app", ("create", ("proxy",))),
        ("GET", "/executor", ("get", ("proxy",))),
    ],
)
def test_node_attributes(method: str, path: str, expected: tuple[str, tuple[str, ...]]) -> None:
    assert node_attributes(method, path) == expected


def container_status(name: str, state: str) -> dict[str, Any]:
    return {"name": name, "image": f"img-{name}", "state": {state: {}}}


def test_running_pods_lists_running_containers_of_pods_that_have_one() -> None:
    pods: list[dict[str, Any]] = [
        {
            "metadata": {"name": "web", "namespace": "shop", "uid": "u1", "labels": {"a": "b"}},
            "spec": {"containers": [{"name": "app"}, {"name": "side"}]},
            "status": {
                "phase": "Running",
                "initContainerStatuses": [container_status("init", "terminated")],
                "containerStatuses": [
                    container_status("app", "running"),
                    container_status("side", "waiting"),
                ],
                "ephemeralContainerStatuses": [container_status("debugger", "running")],
            },
        },
        {
            "metadata": {"name": "done", "namespace": "shop", "uid": "u2"},
            "status": {"containerStatuses": [container_status("app", "terminated")]},
        },
        {"metadata": {"name": "new", "namespace": "shop", "uid": "u3"}, "status": {}},
    ]
    assert running_pods(pods) == [
        {
            "metadata": {
                "name": "web",
                "namespace": "shop",
                "uid": "u1",
                "creationTimestamp": None,
            },
            "spec": {
                "containers": [
                    {"name": "app", "image": "img-app", "resources": {}},
                    {"name": "debugger", "image": "img-debugger", "resources": {}},
                ]
            },
            "status": {},
        }
    ]


def test_user_from_certificate_names_and_groups() -> None:
    peercert: dict[str, Any] = {
        "subject": (
            (("organizationName", "system:masters"),),
            (("organizationName", "ops"),),
            (("commonName", "kube-apiserver-kubelet-client"),),
        ),
        "issuer": ((("commonName", "kubernetes"),),),
    }
    assert user_from_certificate(peercert) == User(
        "kube-apiserver-kubelet-client", groups=("system:masters", "ops")
    )


def test_user_from_certificate_without_common_name_or_certificate() -> None:
    assert user_from_certificate({"subject": ((("organizationName", "system:masters"),),)}) is None
    assert user_from_certificate({}) is None  # what getpeercert() gives for no certificate
    assert user_from_certificate(None) is None


# --- metrics ---------------------------------------------------------------------------------

LOWER_METRICS: list[dict[str, Any]] = [
    {
        "metadata": {"name": "p", "namespace": "lower-default"},
        "containers": [
            {"name": "app", "usage": {"cpu": "250m", "memory": "64Mi"}},
            {"name": "side", "usage": {"cpu": "125m", "memory": "1Ki"}},
        ],
    },
    {
        # A lower pod we do not mirror: it counts nowhere.
        "metadata": {"name": "intruder", "namespace": "lower-default"},
        "containers": [{"name": "x", "usage": {"cpu": "8", "memory": "8Gi"}}],
    },
    {
        "metadata": {"name": "q", "namespace": "lower-team"},
        "containers": [{"name": "main", "usage": {"cpu": "1", "memory": "1Gi"}}],
    },
]
P = UpperPod("default", "p", "uid-p", (("app", 1764000000.5),))
Q = UpperPod("team", "q", "uid-q")
MIRRORED = {"lower-default/p": P, "lower-team/q": Q}


def test_mirrored_pod_metrics_maps_lower_keys_to_upper_pods() -> None:
    found = mirrored_pod_metrics(LOWER_METRICS, MIRRORED)
    assert [(upper, item["metadata"]["name"]) for upper, item in found] == [(P, "p"), (Q, "q")]
    assert mirrored_pod_metrics(LOWER_METRICS, {"default/p": P}) == []


SUMMARY_AT = 1714558830.0  # 2024-05-01T10:20:30Z


def test_summary_sums_containers_into_pods_and_mirrored_pods_into_the_node() -> None:
    counters = CpuCounters()
    summary("vn-1", LOWER_METRICS, MIRRORED, counters, SUMMARY_AT - 10)
    result = summary("vn-1", LOWER_METRICS, MIRRORED, counters, SUMMARY_AT)
    stamp = "2024-05-01T10:20:30Z"
    node = result["node"]
    assert (node["nodeName"], node["startTime"]) == ("vn-1", "2024-05-01T10:20:20Z")
    assert node["memory"] == {"time": stamp, "workingSetBytes": 64 * 2**20 + 1024 + 2**30}
    assert node["cpu"]["usageNanoCores"] == 1_375_000_000
    # The counters the other endpoints advance: 10 s at 1.375 cores.
    assert node["cpu"]["usageCoreNanoSeconds"] == pytest.approx(13_750_000_000, abs=2)
    # As a kubelet writes it: consumers match pods on the uid.
    assert [p["podRef"] for p in result["pods"]] == [
        {"name": "p", "namespace": "default", "uid": "uid-p"},
        {"name": "q", "namespace": "team", "uid": "uid-q"},
    ]
    pods = {(p["podRef"]["namespace"], p["podRef"]["name"]): p for p in result["pods"]}
    p = pods["default", "p"]
    assert p["startTime"] == "2025-11-24T16:00:00Z"
    assert p["cpu"]["usageNanoCores"] == 375_000_000
    assert p["memory"] == {"time": stamp, "workingSetBytes": 64 * 2**20 + 1024}
    app, side = p["containers"]
    assert (app["name"], app["startTime"], side["name"]) == ("app", p["startTime"], "side")
    assert "startTime" not in side, "no start in the pod's status"
    assert (app["cpu"]["usageNanoCores"], side["cpu"]["usageNanoCores"]) == (
        250_000_000,
        125_000_000,
    )
    assert app["cpu"]["usageCoreNanoSeconds"] == pytest.approx(2_500_000_000, abs=2)
    assert app["memory"] == {"time": stamp, "workingSetBytes": 64 * 2**20}
    assert side["memory"] == {"time": stamp, "workingSetBytes": 1024}
    assert pods["team", "q"]["cpu"]["usageNanoCores"] == 1_000_000_000
    assert "startTime" not in pods["team", "q"]


def test_summary_of_no_mirrored_pods_is_an_idle_node() -> None:
    result = summary("vn-1", LOWER_METRICS, {}, CpuCounters(), SUMMARY_AT)
    assert result["pods"] == []
    assert result["node"]["cpu"]["usageNanoCores"] == 0
    # As /metrics/resource: metrics-server drops a node whose working set reads 0.
    assert result["node"]["memory"]["workingSetBytes"] == NODE_MEMORY_FLOOR_BYTES


@pytest.mark.parametrize(("cpu", "nanocores"), [("1001m", 1_001_000_000), ("131071n", 131_071)])
def test_summary_nanocores_are_exact(cpu: str, nanocores: int) -> None:
    item = {
        "metadata": {"name": "p", "namespace": "lower-default"},
        "containers": [{"name": "app", "usage": {"cpu": cpu, "memory": "0"}}],
    }
    result = summary("vn-1", [item], MIRRORED, CpuCounters(), SUMMARY_AT)
    assert result["pods"][0]["containers"][0]["cpu"]["usageNanoCores"] == nanocores


def _samples(text: str) -> dict[str, float]:
    """'name{labels}' → value of each sample line (a timestamp dropped)."""
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value, *_stamp = line.split(" ")
            found[series] = float(value)
    return found


APP = 'container_cpu_usage_seconds_total{container="app",namespace="default",pod="p"}'
APP_START = 'container_start_time_seconds{container="app",namespace="default",pod="p"}'
MAIN = 'container_cpu_usage_seconds_total{container="main",namespace="team",pod="q"}'
NODE = "node_cpu_usage_seconds_total"
POD_Q = 'pod_cpu_usage_seconds_total{namespace="team",pod="q"}'


def test_prometheus_text_families_have_help_and_type() -> None:
    text = prometheus_text(LOWER_METRICS, MIRRORED, CpuCounters(), now=1000.0)
    assert text.endswith("\n")
    for family, kind in (
        ("container_cpu_usage_seconds_total", "counter"),
        ("container_memory_working_set_bytes", "gauge"),
        ("container_start_time_seconds", "gauge"),
        ("node_cpu_usage_seconds_total", "counter"),
        ("node_memory_working_set_bytes", "gauge"),
        ("pod_cpu_usage_seconds_total", "counter"),
        ("pod_memory_working_set_bytes", "gauge"),
        ("resource_scrape_error", "gauge"),
    ):
        lines = text.splitlines()
        help_at = next(
            i for i, line in enumerate(lines) if line.startswith(f"# HELP {family} [STABLE] ")
        )
        assert lines[help_at + 1] == f"# TYPE {family} {kind}"
        assert lines[help_at + 2].startswith(family)
    samples = _samples(text)
    assert samples[APP] == COUNTER_START_SECONDS  # nothing has elapsed yet
    memory = 'container_memory_working_set_bytes{container="app",namespace="default",pod="p"}'
    assert samples[memory] == 64 * 2**20
    assert samples["node_memory_working_set_bytes"] == 64 * 2**20 + 1024 + 2**30
    assert samples['pod_memory_working_set_bytes{namespace="default",pod="p"}'] == 64 * 2**20 + 1024
    assert samples['pod_memory_working_set_bytes{namespace="team",pod="q"}'] == 2**30
    assert samples["resource_scrape_error"] == 0
    start = 'container_start_time_seconds{container="app",namespace="default",pod="p"}'
    assert samples[start] == 1764000000.5
    # Only the containers whose start is known: no made-up zero for the others.
    assert [k for k in samples if k.startswith("container_start_time_seconds")] == [start]
    # Families in name order, as the kubelet's registry writes them.
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert families == sorted(families)
    assert not any("intruder" in line for line in text.splitlines())
    assert re.search(r"^node_cpu_usage_seconds_total 0\.000000001 1000000$", text, re.M)


def test_prometheus_labels_are_escaped() -> None:
    item = {
        "metadata": {"name": "p", "namespace": "lower-default"},
        "containers": [{"name": 'a"b\\c\nd', "usage": {"cpu": "1", "memory": "1"}}],
    }
    text = prometheus_text([item], MIRRORED, CpuCounters(), now=1.0)
    assert 'container="a\\"b\\\\c\\nd",namespace="default",pod="p"' in text
    # The newline inside the name did not split a sample line.
    assert all(
        line.startswith(("#", "container_", "node_", "pod_", "resource_"))
        for line in text.splitlines()
    )


def test_cpu_counters_integrate_the_rate_monotonically() -> None:
    counters = CpuCounters()
    first = _samples(prometheus_text(LOWER_METRICS, MIRRORED, counters, now=1000.0))
    second = _samples(prometheus_text(LOWER_METRICS, MIRRORED, counters, now=1010.0))
    faster = [
        {**item, "containers": [{"name": "main", "usage": {"cpu": "3", "memory": "1"}}]}
        if item["metadata"]["name"] == "q"
        else item
        for item in LOWER_METRICS
    ]
    third = _samples(prometheus_text(faster, MIRRORED, counters, now=1012.0))
    start = COUNTER_START_SECONDS
    assert (first[APP], second[APP], third[APP]) == pytest.approx((start, 2.5, 3.0))
    assert (first[MAIN], second[MAIN], third[MAIN]) == pytest.approx((start, 10.0, 16.0))
    assert (first[NODE], second[NODE], third[NODE]) == pytest.approx((start, 13.75, 20.5))
    assert (first[POD_Q], second[POD_Q], third[POD_Q]) == pytest.approx((start, 10.0, 16.0))


def test_cpu_counters_forget_pods_that_are_gone() -> None:
    counters = CpuCounters()
    prometheus_text(LOWER_METRICS, MIRRORED, counters, now=1000.0)
    prometheus_text(LOWER_METRICS, MIRRORED, counters, now=1010.0)
    only_q = {"lower-team/q": Q}
    later = _samples(prometheus_text(LOWER_METRICS, only_q, counters, now=1020.0))
    assert APP not in later and MAIN in later
    # p's counter was dropped: were it kept, 20 s at 0.25 cores would show up as 5.0.
    assert counters.advance("default/p/app", 0.25, 1030.0) == COUNTER_START_SECONDS
    assert counters.advance("default/p", 0.375, 1030.0) == COUNTER_START_SECONDS
    assert counters.advance("team/q/main", 1.0, 1030.0, ("uid-q", None)) == pytest.approx(30.0)
    # The node's counter survives the pod going away.
    assert later[NODE] == pytest.approx(13.75 + 10.0)


def test_a_restarted_container_and_a_pod_made_again_count_anew() -> None:
    """A container started again (its start time moves), or its pod made again under
    the same name (a StatefulSet's), counts from its own start, as a cgroup's counter
    does, as if it had run at the rate seen since it started: metrics-server takes a
    recently started container's counter for its usage since the start (carried on,
    one at 1 core restarted 20 s before read as 181 cores)."""
    counters = CpuCounters()
    at = 5000.0
    p = P._replace(container_starts=(("app", 1000.0),))
    prometheus_text(LOWER_METRICS, {"lower-default/p": p}, counters, now=at)
    before = _samples(prometheus_text(LOWER_METRICS, {"lower-default/p": p}, counters, now=at + 10))
    assert before[APP] == pytest.approx(0.25 * 10), "counted from the first reading"
    restarted = p._replace(container_starts=(("app", at + 600.0),))
    after = _samples(
        prometheus_text(LOWER_METRICS, {"lower-default/p": restarted}, counters, now=at + 620)
    )
    assert after[APP] == pytest.approx(0.25 * 20)
    pod_p = 'pod_cpu_usage_seconds_total{namespace="default",pod="p"}'
    assert after[pod_p] > before[pod_p], "the pod's own counter goes on"
    made_again = restarted._replace(uid="uid-p2")
    again = _samples(
        prometheus_text(LOWER_METRICS, {"lower-default/p": made_again}, counters, now=at + 630)
    )
    assert again[pod_p] == pytest.approx(COUNTER_START_SECONDS)
    assert again[APP] == pytest.approx(0.25 * 30)


def test_a_container_whose_start_is_not_known_for_a_while_counts_on() -> None:
    """The upper status does not show it running (it exited, it is restarting) while the
    lower metrics still list it: started again at 0, the counter ran backwards, and
    metrics-server skipped the container."""
    counters = CpuCounters()
    at = 5000.0
    p = P._replace(container_starts=(("app", 1000.0),))
    first = _samples(prometheus_text(LOWER_METRICS, {"lower-default/p": p}, counters, now=at))
    unknown = p._replace(container_starts=())
    later = _samples(
        prometheus_text(LOWER_METRICS, {"lower-default/p": unknown}, counters, now=at + 10)
    )
    assert later[APP] == pytest.approx(first[APP] + 0.25 * 10)
    assert later[APP_START] == 1000.0, "its start as its counter knows it"
    known = _samples(prometheus_text(LOWER_METRICS, {"lower-default/p": p}, counters, now=at + 20))
    assert known[APP] == pytest.approx(later[APP] + 0.25 * 10), "the same start: no restart"
    # First seen with no start, then one learned from before: the same counter still.
    counters = CpuCounters()
    seen = _samples(prometheus_text(LOWER_METRICS, {"lower-default/p": unknown}, counters, now=at))
    learned = _samples(
        prometheus_text(LOWER_METRICS, {"lower-default/p": p}, counters, now=at + 10)
    )
    assert learned[APP] == pytest.approx(seen[APP] + 0.25 * 10)
    # A start learned that is later than the counter's beginning is a restart since: its
    # counter counts from it, or the whole history read as used since then.
    # (Another scraper advanced it after the restart, its start still unknown.)
    counters = CpuCounters()
    for then in (at, at + 15):
        prometheus_text(LOWER_METRICS, {"lower-default/p": unknown}, counters, now=then)
    restarted = p._replace(container_starts=(("app", at + 12.0),))
    after = _samples(
        prometheus_text(LOWER_METRICS, {"lower-default/p": restarted}, counters, now=at + 20)
    )
    assert after[APP] == pytest.approx(0.25 * 8)


def test_a_restarted_virtual_node_reports_no_cpu_spike() -> None:
    """metrics-server holds the last process's sample of a container that ran at 0.25
    core for a day, then at 1 core; the new process's first samples give a rate no
    higher than the container's own (counted from its start at 1 core, they read a
    day's history at 1 core over one scrape's interval: thousands of cores)."""
    start, restart = 1000.0, 1000.0 + 86_400
    p = P._replace(container_starts=(("app", start),))
    old_sample = 0.25 * (restart - start)
    busy = [
        {
            **item,
            "containers": [{**c, "usage": {**c["usage"], "cpu": "1"}} for c in item["containers"]],
        }
        if item["metadata"]["name"] == "p"
        else item
        for item in LOWER_METRICS
    ]
    counters = CpuCounters()
    for now in (restart + 5, restart + 20):
        sample = _samples(prometheus_text(busy, {"lower-default/p": p}, counters, now=now))[APP]
        rate = (sample - old_sample) / (now - restart)
        assert rate <= 1.0


def test_a_pod_left_out_of_one_lower_listing_keeps_its_counters() -> None:
    """A lower metrics-server leaves a pod out for a cycle (a container or one of its
    own replicas restarting): started again at 0, its counters ran backwards and the
    upper metrics-server skipped the pod."""
    counters = CpuCounters()
    prometheus_text(LOWER_METRICS, MIRRORED, counters, now=1000.0)
    before = _samples(prometheus_text(LOWER_METRICS, MIRRORED, counters, now=1010.0))
    without_q = [item for item in LOWER_METRICS if item["metadata"]["name"] != "q"]
    prometheus_text(without_q, MIRRORED, counters, now=1020.0)
    after = _samples(prometheus_text(LOWER_METRICS, MIRRORED, counters, now=1030.0))
    assert after[MAIN] >= before[MAIN] and after[POD_Q] >= before[POD_Q]


def test_cadvisor_text_names_containers_with_cadvisor_s_labels() -> None:
    p = P._replace(container_images=(("app", "registry.example/app:1.2"),))
    text = cadvisor_text(LOWER_METRICS, {**MIRRORED, "lower-default/p": p}, CpuCounters(), 1.0)
    assert text.endswith("\n")
    families = [line.split()[2:] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert families == [
        ["container_cpu_usage_seconds_total", "counter"],
        ["container_memory_working_set_bytes", "gauge"],
        ["container_start_time_seconds", "gauge"],
    ]
    app = 'container="app",image="registry.example/app:1.2",namespace="default",pod="p"'
    side = 'container="side",image="",namespace="default",pod="p"'
    assert _samples(text) == {
        'container_cpu_usage_seconds_total{container="app",cpu="total",'
        'image="registry.example/app:1.2",namespace="default",pod="p"}': COUNTER_START_SECONDS,
        'container_cpu_usage_seconds_total{container="side",cpu="total",image="",'
        'namespace="default",pod="p"}': COUNTER_START_SECONDS,
        'container_cpu_usage_seconds_total{container="main",cpu="total",image="",'
        'namespace="team",pod="q"}': COUNTER_START_SECONDS,
        f"container_memory_working_set_bytes{{{app}}}": 64 * 2**20,
        f"container_memory_working_set_bytes{{{side}}}": 1024,
        'container_memory_working_set_bytes{container="main",image="",namespace="team",pod="q"}': 2
        ** 30,
        f"container_start_time_seconds{{{app}}}": 1764000000.5,
    }


def test_every_metrics_endpoint_reads_one_cpu_counter_per_container() -> None:
    """A kubelet reads one cgroup for both endpoints; scraped in turn, neither sees the
    other's counter go back, and a container's counter is the same in both."""
    counters = CpuCounters()
    prometheus_text(LOWER_METRICS, MIRRORED, counters, now=1000.0)
    cadvisor = _samples(cadvisor_text(LOWER_METRICS, MIRRORED, counters, now=1004.0))
    resource = _samples(prometheus_text(LOWER_METRICS, MIRRORED, counters, now=1008.0))
    main = 'container="main",cpu="total",image="",namespace="team",pod="q"'
    assert cadvisor[f"container_cpu_usage_seconds_total{{{main}}}"] == pytest.approx(4.0)
    assert resource[MAIN] == pytest.approx(8.0)
    assert resource[POD_Q] == pytest.approx(8.0)
    assert resource[NODE] == pytest.approx(1.375 * 8)


def test_an_idle_containers_counter_is_never_zero() -> None:
    # metrics-server drops a whole pod for one container whose counter reads 0.
    idle = [
        {**item, "containers": [*item["containers"], {"name": "idle", "usage": {"cpu": "0"}}]}
        for item in LOWER_METRICS
    ]
    counters = CpuCounters()
    for now in (1000.0, 1015.0, 1030.0):
        samples = _samples(prometheus_text(idle, MIRRORED, counters, now=now))
        counts = [
            v for k, v in samples.items() if k.startswith("container_cpu_usage_seconds_total")
        ]
        assert len(counts) == 5 and all(v > 0 for v in counts)


def test_a_node_with_no_pod_running_reports_a_working_set_metrics_server_keeps() -> None:
    """metrics-server drops a node whose working set reads 0, as an empty virtual node's
    sum of its pods' would: ``kubectl top node`` would show it <unknown>."""
    samples = _samples(prometheus_text([], MIRRORED, CpuCounters(), now=1000.0))
    assert samples["node_memory_working_set_bytes"] > 0
    assert samples[NODE] > 0


def test_cpu_counter_ignores_a_clock_going_back() -> None:
    counters = CpuCounters()
    assert counters.advance("k", 1.0, 100.0) == COUNTER_START_SECONDS
    assert counters.advance("k", 1.0, 110.0) == pytest.approx(10.0)
    assert counters.advance("k", 1.0, 105.0) == pytest.approx(10.0)


# --- serving certificate approval ------------------------------------------------------------

NODE_NAME = "vn-lower-1"
NAMES = ("vn-lower-1.example", "10.0.0.7")


def csr_object(
    pem: bytes, signer: str = SIGNER, usages: Collection[str] = USAGES
) -> dict[str, Any]:
    """A CertificateSigningRequest as the apiserver returns it."""
    return {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": "kubestrata-vn-lower-1-0a0b"},
        "spec": {
            "request": base64.b64encode(pem).decode(),
            "signerName": signer,
            "usages": list(usages),
            "username": "system:serviceaccount:kubestrata:vn",
        },
    }


@pytest.fixture(scope="module")
def own_request() -> bytes:
    return signing_request(NODE_NAME, NAMES)[0]


def test_signing_request_names_the_node(own_request: bytes) -> None:
    request = x509.load_pem_x509_csr(own_request)
    assert request.is_signature_valid
    assert request.subject.rfc4514_string() == f"CN=system:node:{NODE_NAME},O=system:nodes"
    san = request.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["vn-lower-1.example"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]


def test_own_request_is_approvable(own_request: bytes) -> None:
    assert approvable(csr_object(own_request), NODE_NAME, NAMES) == ""
    assert approvable(csr_object(own_request), NODE_NAME, list(reversed(NAMES))) == ""
    with_encipherment = csr_object(own_request, usages=(*USAGES, "key encipherment"))
    assert approvable(with_encipherment, NODE_NAME, NAMES) == ""


def test_refuses_another_signer(own_request: bytes) -> None:
    csr = csr_object(own_request, signer="kubernetes.io/kube-apiserver-client")
    assert "signer" in approvable(csr, NODE_NAME, NAMES)
    del csr["spec"]["signerName"]
    assert "signer" in approvable(csr, NODE_NAME, NAMES)


def test_refuses_client_auth_usage(own_request: bytes) -> None:
    csr = csr_object(own_request, usages=(*USAGES, "client auth"))
    assert "usages" in approvable(csr, NODE_NAME, NAMES)


def test_refuses_another_node(own_request: bytes) -> None:
    other = csr_object(signing_request("vn-lower-2", NAMES)[0])
    assert "is not node vn-lower-1" in approvable(other, NODE_NAME, NAMES)
    assert "is not node vn-lower-2" in approvable(csr_object(own_request), "vn-lower-2", NAMES)


@pytest.mark.parametrize(
    "requested",
    [
        ("vn-lower-1.example",),
        (*NAMES, "kubernetes.default.svc"),
        ("vn-lower-1.example", "10.0.0.8"),
        (*NAMES, "10.0.0.7"),  # a duplicate still counts
    ],
)
def test_refuses_other_names(requested: tuple[str, ...]) -> None:
    csr = csr_object(signing_request(NODE_NAME, requested)[0])
    assert approvable(csr, NODE_NAME, NAMES).startswith("names ")


def _build_request(subject: x509.Name, names: list[x509.GeneralName] | None) -> bytes:
    builder = x509.CertificateSigningRequestBuilder().subject_name(subject)
    if names is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    request = builder.sign(pki.new_private_key(), hashes.SHA256())
    return request.public_bytes(serialization.Encoding.PEM)


NODE_SUBJECT = x509.Name(
    [
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{NODE_NAME}"),
    ]
)


def test_refuses_missing_names_and_other_groups() -> None:
    assert approvable(csr_object(_build_request(NODE_SUBJECT, None)), NODE_NAME, NAMES) == (
        "no subject alternative names"
    )
    masters = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{NODE_NAME}"),
        ]
    )
    names: list[x509.GeneralName] = [x509.DNSName(NAMES[0])]
    assert "is not node" in approvable(
        csr_object(_build_request(masters, names)), NODE_NAME, NAMES[:1]
    )


@pytest.mark.parametrize(
    "request_field",
    [
        base64.b64encode(b"not a certificate request").decode(),
        base64.b64encode(b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n").decode(),
        "%%% not base64 %%%",
        "",
    ],
)
def test_refuses_garbage_request(request_field: str, own_request: bytes) -> None:
    csr = csr_object(own_request)
    csr["spec"]["request"] = request_field
    assert approvable(csr, NODE_NAME, NAMES).startswith("request is not a PEM CSR")


# --- exec status translation -----------------------------------------------------------------

COMMAND = ("sh", "-c", "exit 3")


def test_an_empty_error_channel_is_a_session_cut_short_not_a_success() -> None:
    """The lower side writes a Status in every case, Success included."""
    status = json.loads(exec_status(b"", COMMAND))
    assert (status["status"], status["reason"], status["code"]) == ("Failure", "InternalError", 500)
    assert "ended before the command's exit status came" in status["message"]
    success = channels.success_status()
    assert exec_status(success, COMMAND) is success


def test_non_zero_exit_code_passes_through_unchanged() -> None:
    lower = channels.exit_code_status(7, ("false",))
    assert exec_status(lower, COMMAND) is lower


def test_go_exit_status_failure_becomes_non_zero_exit_code() -> None:
    lower = json.dumps(
        {
            "metadata": {},
            "status": "Failure",
            "message": "Internal error occurred: error executing command in container: "
            "exit status 3",
            "reason": "InternalError",
            "code": 500,
        }
    ).encode()
    status = exec_status(lower, COMMAND)
    assert channels.parse_exec_status(status) == 3
    decoded = json.loads(status)
    assert decoded["reason"] == "NonZeroExitCode"
    assert decoded["details"]["causes"] == [{"reason": "ExitCode", "message": "3"}]
    assert "[sh -c exit 3]" in decoded["message"]


@pytest.mark.parametrize(
    "message",
    [
        "container not found",
        "exit status 0",
        "exit status 256",
        "exit status 3 and then some",
        "exit status -1",
    ],
)
def test_other_failures_pass_through_unchanged(message: str) -> None:
    lower = json.dumps(
        {"metadata": {}, "status": "Failure", "message": message, "reason": "InternalError"}
    ).encode()
    assert exec_status(lower, COMMAND) is lower


@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b'{"status": "Pending"}', b"\xff"])
def test_unreadable_error_channel_passes_through_unchanged(payload: bytes) -> None:
    assert exec_status(payload, COMMAND) is payload


def test_container_starts_are_read_from_the_running_states() -> None:
    pod = {
        "status": {
            "containerStatuses": [
                {"name": "app", "state": {"running": {"startedAt": "2025-11-24T16:00:00Z"}}},
                {"name": "waiting", "state": {"waiting": {"reason": "ContainerCreating"}}},
            ]
        }
    }
    assert container_starts(pod) == (("app", 1764000000.0),)
    assert container_starts({"status": {}}) == ()


def test_a_pod_whose_namespace_has_no_name_below_spoils_no_other_pods_metrics() -> None:
    """With the prefix strategy a long upper namespace has no lower name; its pod was
    never made below (TranslationFailed) and answers 400 (as the kubelet for a container
    waiting to start: the apiserver hands kubectl the message of a 400, not of a 404),
    the others' metrics stand."""
    upper_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    lower_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    long_namespace = "n" * 60
    for namespace in ("shop", long_namespace):
        metadata = {"name": "web", "namespace": namespace, "uid": f"uid-{namespace}"}
        pod = {"metadata": metadata, "spec": {"nodeName": "vk-lower-1"}, "status": {}}
        upper_pods.apply({"type": "ADDED", "object": pod})
    copy = {
        "metadata": {
            "name": "web",
            "namespace": "tenant-shop",
            "annotations": {keys.UPPER_UID_ANNOTATION: "uid-shop"},
        }
    }
    lower_pods.apply({"type": "ADDED", "object": copy})
    kubelet = LowerKubelet(
        "vk-lower-1",
        upper_pods,
        lower_pods,
        None,  # type: ignore[arg-type]
        NamespaceMapping("prefix", "tenant"),
    )
    assert list(kubelet._mirrored_by_lower_key()) == ["tenant-shop/web"]
    # A namesake below (another tenant's, or one an earlier pod of the name left): its
    # usage is not the upper pod's.
    for namesake in ({}, {keys.UPPER_UID_ANNOTATION: "uid-earlier"}):
        copy["metadata"]["annotations"] = namesake
        lower_pods.apply({"type": "MODIFIED", "object": copy})
        assert kubelet._mirrored_by_lower_key() == {}
    stranded = kubelet.pod(long_namespace, "web")
    assert stranded is not None
    with pytest.raises(ProviderError) as refused:
        kubelet._lower_path(stranded, "log")
    assert refused.value.status == 400
    assert refused.value.message == f"pod {long_namespace}/web is not running below yet"


SAR = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


def reviewed(allowed: bool) -> dict[str, Any]:
    return {"status": {"allowed": allowed}}


def reviewed_subresources(client: FakeClient) -> list[str]:
    return [
        request.body["spec"]["resourceAttributes"]["subresource"]
        for request in client.requests
        if request.path == SAR
    ]


async def test_pods_are_let_through_on_nodes_pods_without_asking_for_nodes_proxy() -> None:
    client = FakeClient()
    client.answer("POST", SAR, reviewed(True))
    authorizer = Authorizer(client, "vk-1")
    await authorizer.authorize(User("collector"), "GET", "/pods")
    assert reviewed_subresources(client) == ["pods"]


async def test_fine_grained_paths_fall_back_to_nodes_proxy() -> None:
    client = FakeClient()
    client.answer("POST", SAR, reviewed(False), reviewed(True))
    authorizer = Authorizer(client, "vk-1")
    await authorizer.authorize(User("old-role"), "GET", "/runningpods/")
    assert reviewed_subresources(client) == ["pods", "proxy"]
    # Both answers are cached: the next request asks nothing.
    await authorizer.authorize(User("old-role"), "GET", "/pods")
    assert reviewed_subresources(client) == ["pods", "proxy"]


async def test_a_refusal_names_every_subresource_checked() -> None:
    client = FakeClient()
    client.answer("POST", SAR, reviewed(False), reviewed(False), reviewed(False))
    authorizer = Authorizer(client, "vk-1")
    with pytest.raises(AuthError) as refused:
        await authorizer.authorize(User("nobody"), "GET", "/healthz")
    assert (refused.value.status, refused.value.message) == (
        403,
        "Forbidden (user=nobody, verb=get, resource=nodes, subresource(s)=[healthz proxy])",
    )
    # Exec is nodes/proxy alone, with no narrower subresource to ask for first.
    with pytest.raises(AuthError):
        await authorizer.authorize(User("nobody"), "POST", "/exec/default/p/app")
    assert reviewed_subresources(client) == ["healthz", "proxy", "proxy"]


TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"


def token_reviewed(*audiences: str) -> dict[str, Any]:
    return {"status": {"authenticated": True, "user": {"username": "ms"}, "audiences": audiences}}


async def test_a_token_for_an_audience_is_reviewed_for_it_alone() -> None:
    """The estimator takes tokens for its audience only: a token for the apiserver, which
    every estimator would see, is not one; nor is a token the apiserver's review passes
    without telling audiences. A token let in for the apiserver is reviewed again for
    the estimator, not taken from the cache."""
    client = FakeClient()
    client.answer(
        "POST",
        TOKEN_REVIEWS,
        token_reviewed("https://kubernetes.default.svc"),
        {"status": {"authenticated": False, "error": "token audiences are invalid"}},
        {"status": {"authenticated": True, "user": {"username": "ms"}}},
        token_reviewed(keys.ESTIMATOR_AUDIENCE),
    )
    authorizer = Authorizer(client, "vk-1")
    assert (await authorizer.authenticate(None, "Bearer api")).name == "ms"
    for answer in (
        "Unauthorized: token audiences are invalid",
        f"Unauthorized: the token is not for audience {keys.ESTIMATOR_AUDIENCE}",
    ):
        with pytest.raises(AuthError) as refused:
            await authorizer.authenticate(None, "Bearer api", keys.ESTIMATOR_AUDIENCE)
        assert (refused.value.status, refused.value.message) == (401, answer)
    user = await authorizer.authenticate(None, "Bearer for-us", keys.ESTIMATOR_AUDIENCE)
    assert user.name == "ms"
    assert await authorizer.authenticate(None, "Bearer for-us", keys.ESTIMATOR_AUDIENCE) == user
    assert [r.body["spec"] for r in client.requests] == [
        {"token": "api"},
        {"token": "api", "audiences": [keys.ESTIMATOR_AUDIENCE]},
        {"token": "api", "audiences": [keys.ESTIMATOR_AUDIENCE]},
        {"token": "for-us", "audiences": [keys.ESTIMATOR_AUDIENCE]},
    ]


async def flooded(authorizer: Authorizer) -> list[asyncio.Task[User]]:
    """Bad tokens enough to fill the reviews' places, waiting; one more is told 429."""
    flood = [
        asyncio.create_task(authorizer.authenticate(None, f"Bearer t{n}"))
        for n in range(MAX_PENDING_REVIEWS)
    ]
    await asyncio.sleep(0)
    with pytest.raises(AuthError) as refused:
        await authorizer.authenticate(None, "Bearer one-more")
    assert refused.value.status == 429
    return flood


async def test_reviews_waiting_past_the_limit_are_told_to_come_back() -> None:
    """Tokens sent by the thousand (a denied one is not cached) each wait for a review:
    past the limit a caller gets 429 at once, and once they end, reviews go on."""
    release = asyncio.Event()

    class SlowApiserver(FakeClient):
        async def request(self, method: str, path: str, **kwargs: Any) -> Any:
            await release.wait()
            return {"status": {"authenticated": False, "error": "invalid"}}

    authorizer = Authorizer(SlowApiserver(), "vk-1")
    waiting = await flooded(authorizer)
    release.set()
    for outcome in await asyncio.gather(*waiting, return_exceptions=True):
        assert isinstance(outcome, AuthError) and outcome.status == 401
    with pytest.raises(AuthError) as denied:
        await authorizer.authenticate(None, "Bearer again")
    assert denied.value.status == 401


async def test_callers_let_in_before_are_reviewed_again_past_a_flood(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once a valid token's or an allowed access's cached answer lapses, its review has
    places of its own: a flood of bad tokens filling the others does not refuse it."""
    monkeypatch.setattr(auth, "TOKEN_TTL", 0.0)
    monkeypatch.setattr(auth, "ALLOW_TTL", 0.0)
    release = asyncio.Event()

    class FloodedApiserver(FakeClient):
        async def request(self, method: str, path: str, **kwargs: Any) -> Any:
            if path == SAR:
                return reviewed(True)
            token = kwargs["body"]["spec"]["token"]
            if token != "good":
                await release.wait()
            return {"status": {"authenticated": token == "good", "user": {"username": "ms"}}}

    authorizer = Authorizer(FloodedApiserver(), "vk-1")
    user = await authorizer.authenticate(None, "Bearer good")
    await authorizer.authorize_node_access(user, "get", "estimator")
    flood = await flooded(authorizer)
    # Both answers have lapsed (a TTL of 0): each is asked again, and given.
    assert await authorizer.authenticate(None, "Bearer good") == user
    await authorizer.authorize_node_access(user, "get", "estimator")
    release.set()
    await asyncio.gather(*flood, return_exceptions=True)


def web_mirrored_on(node: str) -> tuple[Informer, Informer]:
    """The upper and lower pod caches of a node running shop/web below."""
    upper_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    lower_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    metadata = {"name": "web", "namespace": "shop", "uid": "uid-web"}
    upper_pods.apply(
        {"type": "ADDED", "object": {"metadata": metadata, "spec": {"nodeName": node}}}
    )
    below = {**metadata, "uid": "uid-below", "annotations": {UPPER_UID_ANNOTATION: "uid-web"}}
    lower_pods.apply({"type": "ADDED", "object": {"metadata": below, "spec": {}}})
    return upper_pods, lower_pods


async def test_a_lower_log_stream_cut_short_is_a_provider_error(tmp_path: Path) -> None:
    """The lower apiserver's connection dropped mid-log: an error the kubelet API can
    tell from a log that ended (it then cuts its own answer short)."""

    async def log(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first line\n")
        assert request.transport is not None
        request.transport.close()
        return response

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/shop/pods/web/log", log)
    upper_pods, lower_pods = web_mirrored_on("vk-1")
    async with (
        serving_over_tls(tmp_path, app) as server,
        await KubeClient.connect(ClientSettings(str(server.kubeconfig(tmp_path)))) as lower,
    ):
        kubelet = LowerKubelet("vk-1", upper_pods, lower_pods, lower, NamespaceMapping())
        pod = kubelet.pod("shop", "web")
        assert pod is not None
        chunks = kubelet.container_logs(pod, "app", LogOptions())
        assert await anext(chunks) == b"first line\n"
        with pytest.raises(ProviderError) as broken:
            await anext(chunks)
        assert broken.value.status == 502
        assert broken.value.message.startswith("the lower log stream broke")


async def test_logs_of_an_unreachable_lower_cluster_say_so_through_the_apiserver() -> None:
    """502 with the reason: the apiserver hands kubectl a 503's body as "the server is
    currently unable to handle the request", read as the upper apiserver being down."""

    class Unreachable:
        async def stream(self, *_args: Any, **_kwargs: Any) -> Any:
            raise aiohttp.ClientConnectionError("connection refused")

    upper_pods, lower_pods = web_mirrored_on("vk-1")
    kubelet = LowerKubelet(
        "vk-1",
        upper_pods,
        lower_pods,
        Unreachable(),  # type: ignore[arg-type]
        NamespaceMapping(),
    )
    pod = kubelet.pod("shop", "web")
    assert pod is not None
    with pytest.raises(ProviderError) as refused:
        await anext(kubelet.container_logs(pod, "app", LogOptions()))
    assert refused.value.status == 502
    assert refused.value.message == "the lower cluster is unreachable: connection refused"


RBAC_REFUSAL = (
    'pods "web" is forbidden: User "system:serviceaccount:kubestrata-system:vk" cannot '
    'create resource "pods/exec" in API group "" in the namespace "shop"'
)
ADMISSION_REFUSAL = 'admission webhook "audit.example.com" denied the request: no shells'


@pytest.mark.parametrize(
    ("status", "message", "expected"),
    [
        (401, "Unauthorized", (502, "lower cluster refused the virtual node: Unauthorized")),
        (403, RBAC_REFUSAL, (502, f"lower cluster refused the virtual node: {RBAC_REFUSAL}")),
        (403, ADMISSION_REFUSAL, (403, f"lower cluster: {ADMISSION_REFUSAL}")),
        (404, "gone", (404, "lower cluster: gone")),
        (500, "etcd", (502, "lower cluster: etcd")),
    ],
)
def test_the_lower_clusters_refusal_of_the_virtual_node_is_no_refusal_of_the_caller(
    status: int, message: str, expected: tuple[int, str]
) -> None:
    error = lower_failure(ApiError(status, {"message": message}))
    assert (error.status, str(error)) == expected


@pytest.mark.parametrize("ending", ["dropped", "closed"])
async def test_a_lower_port_connection_that_drops_says_so_on_its_error_stream(
    ending: str,
) -> None:
    """Ended as if the pod had closed it, the client took a download cut short for all of
    it; a connection the pod closes says nothing."""

    async def lower_port(request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse(protocols=(channels.V4_PROTOCOL,))
        await socket.prepare(request)
        announced = (80).to_bytes(2, "little")
        await socket.send_bytes(b"\x00" + announced)
        await socket.send_bytes(b"\x01" + announced)
        await socket.send_bytes(b"\x00hello")
        if ending == "dropped":
            assert request.transport is not None
            request.transport.abort()
        else:
            await socket.close()
        return socket

    app = web.Application()
    app.router.add_get("/port", lower_port)
    async with TestClient(TestServer(app)) as client:
        socket = await client.ws_connect("/port", protocols=(channels.V4_PROTOCOL,))
        port = WebSocketPort(socket, 80)
        assert await port.receive() == b"hello"
        assert await port.receive() == b""
    expected = "the connection to the lower cluster broke" if ending == "dropped" else ""
    assert port.error() == expected


async def test_metrics_wait_for_the_pod_caches_to_be_listed() -> None:
    """Served from empty caches at a restart, the node read idle (`kubectl top node` about
    0, not `<unknown>`)."""
    upper_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    lower_pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    kubelet = LowerKubelet(
        "vk-lower-1",
        upper_pods,
        lower_pods,
        None,  # type: ignore[arg-type]
        NamespaceMapping(),
    )
    for serve in (kubelet.resource_metrics, kubelet.cadvisor_metrics, kubelet.stats_summary):
        with pytest.raises(ProviderError) as starting:
            await serve()
        assert starting.value.status == 503
