"""The orphan sweep's table of our lower pods, fed by watch events as the lower pod
cache would be: only our pods count, and a deleted one leaves it."""

import asyncio
import sys
from typing import Any

import pytest

from kubekit import keys
from kubekit.client import NODES, PODS
from kubekit.informer import Informer
from tests.unit.fakeapi import FakeClient
from virtual_node.lower import LowerCluster
from virtual_node.main import VirtualNodeConfig, until_made_under_this_mapping
from virtual_node.naming import NamespaceMapping
from virtual_node.translate import Ownership

OWNER = Ownership(origin="upper-cluster-uid", node_name="vk-lower-1", cluster_id="lower-1")


def lower_pod(name: str, upper_namespace: str | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "east-shop", "resourceVersion": "1"}
    if upper_namespace is not None:
        metadata["labels"] = OWNER.labels()
        metadata["annotations"] = {keys.UPPER_NAMESPACE_ANNOTATION: upper_namespace}
    return {"metadata": metadata, "spec": {"nodeName": "n-1"}, "status": {"phase": "Running"}}


def test_orphans_are_our_lower_pods_without_an_upper_pod() -> None:
    pods = Informer(client=None, resource=PODS)  # type: ignore[arg-type]
    nodes = Informer(client=None, resource=NODES)  # type: ignore[arg-type]
    backend = LowerCluster(
        None,  # type: ignore[arg-type]
        pods,
        nodes,
        OWNER,
        NamespaceMapping("prefix", "east"),
        "127.0.0.1",
    )
    for pod in (lower_pod("kept", "shop"), lower_pod("left", "shop"), lower_pod("theirs", None)):
        pods.apply({"type": "ADDED", "object": pod})
    assert backend.orphan_keys({"shop/kept"}) == ["shop/left"]
    pods.apply({"type": "DELETED", "object": lower_pod("left", "shop")})
    assert backend.orphan_keys({"shop/kept"}) == []
    assert backend.orphan_keys(set()) == ["shop/kept"]


def backend_with(
    mapping: NamespaceMapping, *pods: dict[str, Any], lower: FakeClient | None = None
) -> LowerCluster:
    informer = Informer(client=lower, resource=PODS)  # type: ignore[arg-type]
    backend = LowerCluster(
        lower,  # type: ignore[arg-type]
        informer,
        Informer(client=lower, resource=NODES),  # type: ignore[arg-type]
        OWNER,
        mapping,
        "127.0.0.1",
    )
    for pod in pods:
        informer.apply({"type": "ADDED", "object": pod})
    return backend


def test_pods_made_under_another_namespace_mapping_are_found() -> None:
    """Made in east-shop for upper shop: under the prefix `west`, or the namespace kept
    as it is, shop/web would be looked for elsewhere, taken for lost and made again."""
    pods = (lower_pod("web", "shop"), lower_pod("theirs", None))
    running = {"shop/web"}.__contains__
    east = backend_with(NamespaceMapping("prefix", "east"), *pods)
    assert east.made_under_another_mapping(running) == []
    for mapping in (NamespaceMapping("prefix", "west"), NamespaceMapping()):
        backend = backend_with(mapping, *pods)
        assert backend.made_under_another_mapping(running) == [("east-shop/web", "shop/web")]
        # Its upper pod gone, or finished: the orphan sweep's, found where it is.
        assert backend.made_under_another_mapping(lambda _key: False) == []


async def test_the_start_waits_while_pods_were_made_under_another_mapping(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys.modules["virtual_node.main"], "MAPPING_RECHECK_SECONDS", 0.0)
    backend = backend_with(NamespaceMapping("prefix", "west"), lower_pod("web", "shop"))
    config = VirtualNodeConfig(
        lower_kubeconfig="l",
        cluster_id="lower-1",
        client_ca_file="ca.crt",
        namespace_strategy="prefix",
        namespace_prefix="west",
    )
    waiting = asyncio.create_task(
        until_made_under_this_mapping(backend, config, {"shop/web"}.__contains__)
    )
    await asyncio.sleep(0.01)
    assert not waiting.done()
    assert "east-shop/web, for upper pod shop/web" in caplog.text
    assert "--namespace-strategy prefix --namespace-prefix west" in caplog.text
    # Deleted below by the operator: the start goes on.
    backend.pods.apply({"type": "DELETED", "object": lower_pod("web", "shop")})
    await asyncio.wait_for(waiting, 1)


async def test_an_orphan_made_under_another_mapping_is_removed_where_it_is() -> None:
    orphan = lower_pod("web", "shop")
    orphan["metadata"]["uid"] = "lower-uid"
    lower = FakeClient()
    backend = backend_with(NamespaceMapping("prefix", "west"), orphan, lower=lower)
    assert backend.orphan_keys(set()) == ["shop/web"]
    await backend.remove_orphan("shop/web", None)
    assert lower.writes() == [("DELETE", "/api/v1/namespaces/east-shop/pods/web")]
