"""The lower RuntimeClass admission as the estimator models it (pure)."""

from __future__ import annotations

from typing import Any

from virtual_node.runtimes import (
    RuntimeClassFacts,
    runtime_class_facts,
    runtime_refusal,
    with_runtime_class,
)

GVISOR = runtime_class_facts(
    {
        "metadata": {"name": "gvisor"},
        "handler": "runsc",
        "overhead": {"podFixed": {"cpu": "250m"}},
        "scheduling": {
            "nodeSelector": {"sandbox": "gvisor"},
            "tolerations": [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }
)
CLASSES = {"gvisor": GVISOR, "plain": RuntimeClassFacts()}


def lower_pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}], **spec}}


def test_a_class_gives_its_overhead_node_selector_and_tolerations() -> None:
    pod = lower_pod(
        runtimeClassName="gvisor",
        nodeSelector={"disk": "ssd"},
        tolerations=[{"key": "gpu", "operator": "Exists"}],
    )
    assert with_runtime_class(pod, CLASSES)["spec"] == {
        **pod["spec"],
        "overhead": {"cpu": "250m"},
        "nodeSelector": {"disk": "ssd", "sandbox": "gvisor"},
        "tolerations": [
            {"key": "gpu", "operator": "Exists"},
            {"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"},
        ],
    }
    assert pod["spec"]["nodeSelector"] == {"disk": "ssd"}, "the pod is not changed in place"
    assert runtime_refusal(with_runtime_class(pod, CLASSES), CLASSES, "lower-1") is None


def test_a_class_without_scheduling_or_a_pod_without_a_class_is_left_as_it_is() -> None:
    plain = lower_pod(runtimeClassName="plain")
    assert with_runtime_class(plain, CLASSES) == plain
    assert with_runtime_class(lower_pod(), CLASSES) == lower_pod()
    assert runtime_refusal(lower_pod(), CLASSES, "lower-1") is None


def test_a_missing_class_or_a_conflicting_selector_is_refused_as_the_admission_would() -> None:
    missing = lower_pod(runtimeClassName="kata")
    assert (
        runtime_refusal(missing, CLASSES, "lower-1")
        == "lower cluster lower-1 has no runtime class kata"
    )
    conflicting = lower_pod(runtimeClassName="gvisor", nodeSelector={"sandbox": "kata"})
    assert with_runtime_class(conflicting, CLASSES) == conflicting
    assert runtime_refusal(conflicting, CLASSES, "lower-1") == (
        "lower cluster lower-1's runtime class gvisor runs on sandbox=gvisor, "
        "the pod asks for sandbox=kata"
    )
