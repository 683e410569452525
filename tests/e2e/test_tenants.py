"""Two tenant (upper) control planes sharing one lower cluster, as `kubestrata up
--tenants 2` starts them: each has its own virtual node, webhook and multischeduler, its
namespaces prefixed below, and their quota slices never promise the same room.

The lower cluster: 2 nodes of 4 CPU, 10% kept out: 7.2 CPU to promise, 3 slices of 2 CPU.
Both tenants ask for 2 at the same moment.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from harness.toolchain import Toolchain
from kubekit import keys
from kubekit.slices import Amount, ledger_entry

from .helpers import wait_for
from .test_cli import kubestrata

TENANTS = ("upper", "tenant-2")
LOWER = "lower-1"
ROOM = Amount(cpu=7200)


@dataclass(frozen=True)
class Kubectl:
    binary: Path
    kubeconfig: str

    def __call__(self, *args: str, input: str | None = None, check: bool = True) -> str:
        done = subprocess.run(
            [str(self.binary), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
        return done.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self("get", *args, "-o", "json"))


@pytest.fixture(scope="module")
def pool(
    tmp_path_factory: pytest.TempPathFactory, toolchain: Toolchain
) -> Iterator[dict[str, Kubectl]]:
    state_dir = tmp_path_factory.mktemp("tenants") / "state"
    try:
        up = kubestrata(
            "up",
            "--detach",
            "--tenants",
            "2",
            "--lower",
            "1",
            "--nodes",
            "2",
            "--node-cpu",
            "4",
            "--node-memory",
            "16Gi",
            "--no-metrics-server",
            "--no-descheduler",
            "--state-dir",
            str(state_dir),
        )
        assert up.returncode == 0, up.stderr
        clusters = {}
        for name in (*TENANTS, LOWER):
            found = kubestrata("kubeconfig", "--cluster", name, "--state-dir", str(state_dir))
            assert found.returncode == 0, found.stderr
            clusters[name] = Kubectl(toolchain.kubectl, found.stdout.strip())
        yield clusters
    finally:
        kubestrata("down", "--state-dir", str(state_dir))


def team(cpu: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "List",
            "items": [
                {
                    "apiVersion": "v1",
                    "kind": "Namespace",
                    "metadata": {
                        "name": "team",
                        "labels": {keys.FEDERATION_LABEL: keys.FEDERATION_ENABLED},
                    },
                },
                {
                    "apiVersion": "v1",
                    "kind": "ResourceQuota",
                    "metadata": {"name": "compute", "namespace": "team"},
                    "spec": {"hard": {"requests.cpu": cpu}},
                },
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": "settings", "namespace": "team"},
                    "data": {"owner": "tenant"},
                },
            ],
        }
    )


def placement(kubectl: Kubectl) -> dict[str, int] | None:
    annotations = kubectl.json("namespace", "team")["metadata"].get("annotations") or {}
    text = annotations.get(keys.SLICE_PLACEMENT_ANNOTATION)
    return json.loads(text) if text else None


def reasons(kubectl: Kubectl) -> set[str]:
    return {event["reason"] for event in kubectl.json("events", "--namespace=team")["items"]}


def test_two_tenants_filling_one_pool_at_once_never_promise_its_room_twice(
    pool: dict[str, Kubectl],
) -> None:
    with ThreadPoolExecutor(2) as threads:
        list(threads.map(lambda name: pool[name]("apply", "-f", "-", input=team("4")), TENANTS))
    wait_for(
        lambda: all(reasons(pool[name]) & {"SlicesPlaced", "SlicesNotPlaced"} for name in TENANTS),
        "both tenants told where their slices are",
    )
    placed = {name: placement(pool[name]) for name in TENANTS}
    # Room for 3: one tenant has its 2 slices, the other is told what is missing.
    assert sorted(str(p) for p in placed.values()) == ["None", "{'lower-1': 2}"], placed
    short = next(name for name in TENANTS if placed[name] is None)
    [message] = [
        e["message"]
        for e in pool[short].json("events", "--namespace=team")["items"]
        if e["reason"] == "SlicesNotPlaced"
    ]
    assert "2 slices of cpu 2 wanted, room for 1: 1 missing (cpu 2)" in message, message
    ledger = pool[LOWER].json(
        "configmap", keys.SLICE_LEDGER_CONFIGMAP, f"--namespace={keys.SYSTEM_NAMESPACE}"
    )["data"]
    promised = sum((ledger_entry(k, v).promised for k, v in ledger.items()), Amount())
    assert promised.within(ROOM) and promised == Amount(cpu=4000)
    # Lowered to what is left, the short tenant is placed too: the pool is full.
    pool[short]("apply", "-f", "-", input=team("2"))
    wait_for(lambda: placement(pool[short]) == {LOWER: 1}, "the short tenant placed")
    ledger = pool[LOWER].json(
        "configmap", keys.SLICE_LEDGER_CONFIGMAP, f"--namespace={keys.SYSTEM_NAMESPACE}"
    )["data"]
    assert sorted(ledger) == ["t1-team", "t2-team"]
    assert sum((ledger_entry(k, v).promised for k, v in ledger.items()), Amount()) == Amount(6000)


def test_each_tenant_s_namespace_is_its_own_below(pool: dict[str, Kubectl]) -> None:
    origins = {
        name: pool[name].json("namespace", "kube-system")["metadata"]["uid"] for name in TENANTS
    }
    for index, name in enumerate(TENANTS, start=1):
        lower_namespace = f"t{index}-team"
        found = pool[LOWER].json("namespace", lower_namespace)
        assert found["metadata"]["labels"][keys.ORIGIN_LABEL] == origins[name]
        wait_for(partial(has_settings, pool[LOWER], lower_namespace), f"{name}'s ConfigMap below")
        settings = pool[LOWER].json("configmap", "settings", f"--namespace={lower_namespace}")
        assert settings["metadata"]["labels"][keys.ORIGIN_LABEL] == origins[name]
        assert settings["metadata"]["annotations"][keys.UPPER_NAMESPACE_ANNOTATION] == "team"
        quota = pool[LOWER].json(
            "resourcequota", keys.SLICE_QUOTA, f"--namespace={lower_namespace}"
        )
        assert quota["metadata"]["labels"][keys.ORIGIN_LABEL] == origins[name]
    # Each tenant's pod runs in its own namespace below and only it sees it.
    for name in TENANTS:
        pool[name]("apply", "-f", "-", input=json.dumps(pod(f"web-of-{name}")))
    for index, name in enumerate(TENANTS, start=1):
        wait_for(partial(running, pool[name], f"web-of-{name}"), f"{name}'s pod running")
        upper_pods = pool[name].json("pods", "--namespace=team")["items"]
        assert [p["metadata"]["name"] for p in upper_pods] == [f"web-of-{name}"]
        [lower_pod] = pool[LOWER].json("pods", f"--namespace=t{index}-team")["items"]
        assert lower_pod["metadata"]["name"] == f"web-of-{name}"
        assert lower_pod["metadata"]["labels"][keys.ORIGIN_LABEL] == origins[name]


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team"},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "app",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"requests": {"cpu": "1"}},
                }
            ],
        },
    }


def has_settings(kubectl: Kubectl, namespace: str) -> bool:
    return bool(kubectl("get", "configmap", "settings", f"--namespace={namespace}", check=False))


def running(kubectl: Kubectl, name: str) -> bool:
    found = kubectl.json("pod", name, "--namespace=team")
    return bool(found["status"].get("phase") == "Running")
