"""A lower cluster down, with the descheduler's default clusterDownTimeout (300 s) far
off: the upper node controller's taint eviction deletes a pod of a NotReady Node once
its toleration runs out, and a bare pod deleted so is lost. The descheduler moves it
first, 30 s before that deadline.

The pod tolerates the unreachable taint for 60 s, so the test takes about two minutes:
the lower apiserver stopped, the virtual Node Unknown (the node controller's grace), the
taint added, and 30 s more.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.federation import Federation
from harness.localcluster import LocalCluster
from kubekit import keys

from .helpers import apply, bound_pod, get_json, namespace, node_ready, pods_by_name, wait_for

NAMESPACE = "down"
LEFT = "vk-lower-1"
TOLERATED = 60


@pytest.fixture(scope="module")
def descheduling(
    federation: Federation, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Federation]:
    policy = Path(tmp_path_factory.mktemp("descheduler")) / "policy.yaml"
    policy.write_text("clusterDownTimeout: 300\ninterval: 1\n")
    apply(federation.upper, namespace(NAMESPACE))
    process = federation.start_descheduler(policy)
    try:
        yield federation
    finally:
        process.stop()
        federation.upper.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


def unreachable_taint(federation: Federation) -> dict[str, Any] | None:
    taints = get_json(federation.upper, "node", LEFT)["spec"].get("taints") or []
    return next(
        (
            t
            for t in taints
            if t["key"] == "node.kubernetes.io/unreachable" and t["effect"] == "NoExecute"
        ),
        None,
    )


def test_a_bare_pod_of_a_cluster_down_is_copied_before_the_taint_eviction_deletes_it(
    descheduling: Federation,
) -> None:
    upper = descheduling.upper
    keeper = bound_pod(
        "keeper",
        NAMESPACE,
        LEFT,
        tolerations=[
            {
                "key": "node.kubernetes.io/unreachable",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": TOLERATED,
            }
        ],
    )
    keeper["metadata"]["labels"] = {"app": "keeper"}
    apply(upper, keeper)
    wait_for(
        lambda: (
            get_json(upper, "pod", "-n", NAMESPACE, "keeper")["status"].get("phase") == "Running"
        ),
        "the pod Running in lower-1",
    )
    original_uid = get_json(upper, "pod", "-n", NAMESPACE, "keeper")["metadata"]["uid"]
    lower = descheduling.clusters["lower-1"]
    assert isinstance(lower, LocalCluster)
    lower.stop_component("kube-apiserver")
    try:
        taint = wait_for(
            lambda: unreachable_taint(descheduling),
            f"{LEFT} tainted unreachable",
            timeout=150,
            interval=2,
        )
        assert taint is not None and taint.get("timeAdded"), taint

        def copy_running() -> dict[str, Any] | None:
            for pod in pods_by_name(upper, NAMESPACE, "app=keeper").values():
                annotations = pod["metadata"].get("annotations") or {}
                if (
                    annotations.get(keys.COPY_OF_ANNOTATION) == original_uid
                    and pod["spec"].get("nodeName") == "vk-lower-2"
                    and pod["status"].get("phase") == "Running"
                ):
                    return pod
            return None

        # Deleted by the taint eviction 60 s after the taint, the pod would have no copy.
        copy = wait_for(copy_running, "the copy Running in lower-2", timeout=TOLERATED + 30)
        assert copy is not None

        def said() -> list[str]:
            return [
                e["message"]
                for e in get_json(
                    upper,
                    "events",
                    "-n",
                    NAMESPACE,
                    "--field-selector",
                    "involvedObject.name=keeper,reason=Rescheduled",
                )["items"]
            ]

        # Said as the original goes, at the look after its copy was taken below.
        (message,) = wait_for(said, "the original said re-created")
        assert f"{LEFT} NotReady for" in message, message
    finally:
        lower.restart("kube-apiserver")
    wait_for(lambda: node_ready(descheduling, LEFT) == "True", f"{LEFT} Ready again", timeout=120)
    wait_for(
        lambda: "keeper" not in pods_by_name(upper, NAMESPACE, "app=keeper"),
        "the original gone once lower-1 is back",
        timeout=120,
    )
