"""`kubectl top` on the upper cluster with a real metrics-server in every cluster: kwok
simulates each lower pod's usage (from its annotations), the lower metrics-server scrapes
kwok, the virtual node reports the lower figures of its pods on its kubelet API, and the
upper metrics-server scrapes the virtual nodes as it would any kubelet."""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import pytest

from harness.federation import Federation
from harness.localcluster import USAGE_CPU_ANNOTATION, USAGE_MEMORY_ANNOTATION
from kubekit.quantity import parse_quantity

from .helpers import apply, cluster_pod, get_json, get_raw, namespace, wait_for

NS = "top"
POD = "busy"
CPU, MEMORY = "250m", "64Mi"
# metrics-server derives CPU from two samples of a counter, each layer over its own
# window: a few millicores either way.
CPU_TOLERANCE = parse_quantity("10m")
# Each layer needs two scrapes 10 s apart before it has a rate.
FIRST_FIGURES_SECONDS = 240.0
METRICS = "/apis/metrics.k8s.io/v1beta1"


@pytest.fixture(scope="module")
def busy(federation: Federation) -> Iterator[str]:
    upper = federation.upper
    apply(
        upper,
        namespace(NS),
        cluster_pod(
            POD,
            NS,
            "lower-1",
            annotations={USAGE_CPU_ANNOTATION: CPU, USAGE_MEMORY_ANNOTATION: MEMORY},
        ),
    )
    try:
        upper.kubectl("wait", "--for=condition=Ready", f"pod/{POD}", "-n", NS, "--timeout=90s")
        wait_for(
            lambda: get_raw(upper, f"{METRICS}/namespaces/{NS}/pods/{POD}"),
            "the pod's metrics in the upper cluster",
            timeout=FIRST_FIGURES_SECONDS,
            interval=5,
        )
        yield POD
    finally:
        upper.kubectl("delete", "namespace", NS, "--wait=false")


def usage(metrics: Any) -> tuple[Fraction, int]:
    """A PodMetrics' cpu and memory, summed over its containers."""
    figures = [c["usage"] for c in metrics["containers"]]
    return (
        sum((parse_quantity(f["cpu"]) for f in figures), Fraction(0)),
        sum(int(parse_quantity(f["memory"])) for f in figures),
    )


def test_kubectl_top_pod_above_shows_the_lower_figures(federation: Federation, busy: str) -> None:
    upper, lower = federation.upper, federation.clusters["lower-1"]
    above = get_raw(upper, f"{METRICS}/namespaces/{NS}/pods/{POD}")
    below = get_raw(lower, f"{METRICS}/namespaces/{NS}/pods/{POD}")
    assert above is not None and below is not None
    (cpu_above, memory_above), (cpu_below, memory_below) = usage(above), usage(below)
    assert memory_above == memory_below == parse_quantity(MEMORY)
    assert abs(cpu_above - cpu_below) <= CPU_TOLERANCE, (cpu_above, cpu_below)
    assert abs(cpu_above - parse_quantity(CPU)) <= CPU_TOLERANCE, cpu_above
    name, cpu, memory = upper.kubectl("top", "pod", "-n", NS, POD, "--no-headers").stdout.split()
    assert name == POD
    assert abs(parse_quantity(cpu) - parse_quantity(CPU)) <= CPU_TOLERANCE, cpu
    assert parse_quantity(memory) == parse_quantity(MEMORY)


def test_kubectl_top_node_shows_each_virtual_node_as_the_sum_of_its_pods(
    federation: Federation, busy: str
) -> None:
    upper = federation.upper
    rows = upper.kubectl("top", "node", "--no-headers").stdout.splitlines()
    assert {"vk-lower-1", "vk-lower-2"} <= {row.split()[0] for row in rows}

    def one_scrape() -> tuple[int, int] | None:
        """(node memory, its pods' memory) from one scrape of the virtual node (the same
        timestamp); None until the busy pod is in it."""
        node = get_raw(upper, f"{METRICS}/nodes/vk-lower-1")
        listed = get_raw(upper, f"{METRICS}/pods")
        if node is None or listed is None:
            return None
        on_node = {
            (p["metadata"]["namespace"], p["metadata"]["name"])
            for p in get_json(upper, "pods", "-A", "--field-selector", "spec.nodeName=vk-lower-1")[
                "items"
            ]
        }
        pods = [
            p
            for p in listed["items"]
            if p["timestamp"] == node["timestamp"]
            and (p["metadata"]["namespace"], p["metadata"]["name"]) in on_node
        ]
        if not any(p["metadata"]["name"] == POD for p in pods):
            return None
        return int(parse_quantity(node["usage"]["memory"])), sum(usage(p)[1] for p in pods)

    # A pod new in the last scrape is in the node's figure but has no rate yet: wait for
    # a scrape where every pod has both.
    found = wait_for(
        lambda: (pair := one_scrape()) is not None and pair[0] == pair[1] and pair,
        "one scrape where the virtual node's memory is its pods' sum",
        interval=2,
    )
    assert found and found[0] >= parse_quantity(MEMORY)
