"""Every component's Prometheus metrics, in one place, with client-go's names where
client-go has one (work queues, API requests) so existing dashboards read them; served
at /metrics beside /healthz and /readyz (kubekit/health.py)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from prometheus_client import Counter, Gauge, Histogram

# Latencies from a tenth of a millisecond (an estimator answer) to a minute (a slow list).
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

WORKQUEUE_DEPTH = Gauge("workqueue_depth", "Keys waiting in a work queue.", ["name"])
WORKQUEUE_ADDS = Counter("workqueue_adds", "Keys added to a work queue.", ["name"])
WORKQUEUE_RETRIES = Counter(
    "workqueue_retries", "Keys put back with backoff after a failed reconcile.", ["name"]
)
WORKQUEUE_WORK_DURATION = Histogram(
    "workqueue_work_duration_seconds",
    "How long reconciling one key took.",
    ["name"],
    buckets=LATENCY_BUCKETS,
)
RECONCILE_ERRORS = Counter(
    "kubestrata_reconcile_errors",
    "Reconciles that failed, by work queue and reason (the API's reason, else the error's type).",
    ["name", "reason"],
)
API_REQUESTS = Counter(
    "rest_client_requests",
    "Requests to an apiserver, by verb, resource and HTTP code (<error>: no answer).",
    ["verb", "resource", "code"],
)
API_REQUEST_DURATION = Histogram(
    "rest_client_request_duration_seconds",
    "Time from sending a request to an apiserver to its answer's headers.",
    ["verb", "resource"],
    buckets=LATENCY_BUCKETS,
)
MIRRORED_PODS = Gauge(
    "kubestrata_mirrored_pods", "Lower pods a virtual node made for upper pods and keeps."
)
ESTIMATOR_REQUEST_DURATION = Histogram(
    "kubestrata_estimator_request_duration_seconds",
    "How long the fit estimator took to answer, by method.",
    ["method"],
    buckets=LATENCY_BUCKETS,
)
EVICTIONS = Counter(
    "kubestrata_evictions",
    "Evictions the descheduler asked for, by why and what the API answered.",
    ["reason", "result"],
)


def api_resource(path: str) -> str:
    """The resource (and subresource) an API path names, as metrics label it:
    ``/api/v1/namespaces/ns/pods/p/log`` is ``pods/log``, ``/apis/g/v/nodes`` ``nodes``,
    and a namespace itself ``namespaces``."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    if parts[:1] == ["api"]:
        rest = parts[2:]
    elif parts[:1] == ["apis"]:
        rest = parts[3:]
    else:
        return "<other>"
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    if not rest:
        return "<discovery>"
    return rest[0] if len(rest) < 3 else f"{rest[0]}/{rest[2]}"


P = ParamSpec("P")
R = TypeVar("R")


def timed(
    histogram: Histogram, *labels: str
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Observes how long each call of a coroutine function takes, failed ones too."""
    child = histogram.labels(*labels)

    def decorate(function: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(function)
        async def measured(*args: P.args, **kwargs: P.kwargs) -> R:
            with child.time():
                return await function(*args, **kwargs)

        return measured

    return decorate
