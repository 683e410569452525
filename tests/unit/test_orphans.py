"""The orphan sweep's table of our lower pods, fed by watch events as the lower pod
cache would be: only our pods count, and a deleted one leaves it."""

from typing import Any

from kubekit import keys
from kubekit.client import NODES, PODS
from kubekit.informer import Informer
from virtual_node.lower import LowerCluster
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
