from kubekit import keys
from virtual_node.events import upper_event

LOWER_POD = {
    "metadata": {
        "name": "web-1",
        "namespace": "east-shop",
        "annotations": {
            keys.UPPER_NAMESPACE_ANNOTATION: "shop",
            keys.UPPER_UID_ANNOTATION: "upper-uid",
        },
    }
}


def test_lower_event_becomes_an_event_on_the_upper_pod() -> None:
    lower = {
        "metadata": {"name": "web-1.abc", "namespace": "east-shop", "uid": "e-1"},
        "involvedObject": {
            "kind": "Pod",
            "name": "web-1",
            "namespace": "east-shop",
            "uid": "lower-uid",
            "fieldPath": "spec.containers{app}",
        },
        "type": "Warning",
        "reason": "BackOff",
        "message": "Back-off pulling image",
        "count": 3,
        "source": {"component": "kubelet", "host": "node-7"},
        "firstTimestamp": "2026-01-01T00:00:00Z",
        "lastTimestamp": "2026-01-01T00:01:00Z",
    }
    event = upper_event(lower, LOWER_POD, "lower-1")
    assert event is not None
    assert event["metadata"] == {"name": "web-1.e-1", "namespace": "shop"}
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "web-1",
        "namespace": "shop",
        "uid": "upper-uid",
        "fieldPath": "spec.containers{app}",
    }
    assert (event["type"], event["reason"], event["count"]) == ("Warning", "BackOff", 3)
    assert event["source"] == {"component": "kubelet (lower cluster lower-1)", "host": "node-7"}


def test_pod_without_ownership_annotations_gets_nothing() -> None:
    lower = {"metadata": {"uid": "e"}, "involvedObject": {"kind": "Pod"}}
    assert upper_event(lower, {"metadata": {"name": "x"}}, "c") is None
