"""The components' /metrics scraped while they work: the counters move."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from harness.federation import Federation, virtual_node_name
from kubekit import keys

from .helpers import apply, federated_deployment, namespace, rollout, wait_for


def scrape(federation: Federation, component: str) -> dict[tuple[str, frozenset[str]], float]:
    """The samples of a component's /metrics on its health port, by name and labels."""
    (port,) = [
        a.split("=", 1)[1]
        for a in federation.components[component].argv
        if a.startswith("--health-port=")
    ]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {
        (sample.name, frozenset(f"{k}={v}" for k, v in sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, frozenset[str]], float], metric: str, **labels: str) -> float:
    return samples.get((metric, frozenset(f"{k}={v}" for k, v in labels.items())), 0.0)


def test_the_virtual_node_counts_its_queues_api_requests_pods_and_estimates(
    federation: Federation,
) -> None:
    component = virtual_node_name("lower-1")
    before = scrape(federation, component)
    upper = federation.upper
    apply(
        upper,
        namespace("counted"),
        federated_deployment(
            "counted", "counted", 3, cpu="100m", node_selector={keys.CLUSTER_ID_LABEL: "lower-1"}
        ),
    )
    rollout(upper, "counted", "counted")
    after = wait_for(
        lambda: (
            samples
            if value(samples := scrape(federation, component), "kubestrata_mirrored_pods")
            >= value(before, "kubestrata_mirrored_pods") + 3
            else None
        ),
        "three more mirrored pods in the metrics",
    )
    assert after is not None

    def moved(metric: str, **labels: str) -> float:
        return value(after, metric, **labels) - value(before, metric, **labels)

    # Three lower pods created, each reconciled at least once, nothing waiting now.
    assert moved("rest_client_requests_total", verb="POST", resource="pods", code="201") >= 3
    assert moved("rest_client_request_duration_seconds_count", verb="POST", resource="pods") >= 3
    assert moved("workqueue_adds_total", name="pods") >= 3
    assert moved("workqueue_work_duration_seconds_count", name="pods") >= 3
    assert value(after, "workqueue_depth", name="pods") == 0
    # The multischeduler asked this cluster's estimator about each pod.
    assert (
        moved("kubestrata_estimator_request_duration_seconds_count", method="EstimateStream") >= 3
    )
    assert value(after, "rest_client_requests_total", verb="WATCH", resource="pods", code="200")
    upper.kubectl("delete", "namespace", "counted", "--timeout=120s")


def test_the_descheduler_serves_health_and_metrics(federation: Federation) -> None:
    process = federation.start_component("descheduler", federation.descheduler_args())
    try:
        (port,) = [a.split("=", 1)[1] for a in process.argv if a.startswith("--health-port=")]

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for(ready, "the descheduler to be ready")
        wait_for(
            lambda: value(
                scrape(federation, "descheduler"),
                "rest_client_requests_total",
                verb="GET",
                resource="pods",
                code="200",
            ),
            "the descheduler's list of pods in its metrics",
        )
    finally:
        process.stop()
        federation.components.pop("descheduler")
