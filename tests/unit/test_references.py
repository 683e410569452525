from kubekit import keys
from virtual_node.naming import NamespaceMapping
from virtual_node.references import copy_differs, desired_copy, referenced_objects, reflectable
from virtual_node.translate import Ownership

OWNER = Ownership(origin="o", node_name="vk-a")


def test_every_kind_of_reference_is_found() -> None:
    spec = {
        "volumes": [
            {"name": "a", "configMap": {"name": "cm-volume"}},
            {"name": "b", "secret": {"secretName": "secret-volume"}},
            {
                "name": "c",
                "projected": {
                    "sources": [
                        {"configMap": {"name": "cm-projected"}},
                        {"secret": {"name": "secret-projected"}},
                        {"serviceAccountToken": {"path": "token"}},
                    ]
                },
            },
            {"name": "d", "emptyDir": {}},
            {"name": "e", "persistentVolumeClaim": {"claimName": "data"}},
        ],
        "initContainers": [{"name": "i", "envFrom": [{"configMapRef": {"name": "cm-envfrom"}}]}],
        "containers": [
            {
                "name": "c",
                "env": [
                    {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "cm-env", "key": "k"}}},
                    {
                        "name": "B",
                        "valueFrom": {"secretKeyRef": {"name": "secret-env", "key": "k"}},
                    },
                    {"name": "C", "value": "literal"},
                    {"name": "D", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                ],
                "envFrom": [{"secretRef": {"name": "secret-envfrom"}}],
            }
        ],
        "imagePullSecrets": [{"name": "registry"}],
    }
    assert referenced_objects(spec) == {
        ("configmaps", "cm-volume"),
        ("configmaps", "cm-projected"),
        ("configmaps", "cm-envfrom"),
        ("configmaps", "cm-env"),
        ("secrets", "secret-volume"),
        ("secrets", "secret-projected"),
        ("secrets", "secret-env"),
        ("secrets", "secret-envfrom"),
        ("secrets", "registry"),
        ("persistentvolumeclaims", "data"),
    }


def test_copy_keeps_content_and_marks_ownership() -> None:
    upper = {
        "kind": "Secret",
        "type": "Opaque",
        "data": {"k": "dg=="},
        "metadata": {
            "name": "s",
            "namespace": "shop",
            "uid": "u1",
            "resourceVersion": "9",
            "labels": {"a": "b"},
        },
    }
    copy = desired_copy(upper, NamespaceMapping("prefix", "east"), OWNER)
    assert copy["metadata"]["namespace"] == "east-shop"
    assert copy["metadata"]["labels"] == {"a": "b", **OWNER.labels()}
    assert copy["metadata"]["annotations"][keys.UPPER_UID_ANNOTATION] == "u1"
    assert (copy["type"], copy["data"]) == ("Opaque", {"k": "dg=="})
    assert "resourceVersion" not in copy["metadata"]
    assert not copy_differs(
        {**copy, "metadata": {**copy["metadata"], "resourceVersion": "3"}}, copy
    )
    assert copy_differs({**copy, "data": {"k": "old"}}, copy)


def test_service_account_tokens_are_not_reflected() -> None:
    assert not reflectable({"type": "kubernetes.io/service-account-token"})
    assert reflectable({"type": "Opaque"})
    assert reflectable({"data": {}})


def test_claim_copy_is_unbound_below() -> None:
    upper = {
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data", "namespace": "db", "uid": "u"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "volumeName": "pv-upper",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    copy = desired_copy(upper, NamespaceMapping(), OWNER)
    assert copy["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "1Gi"}},
    }


def test_the_service_account_token_volume_needs_nothing_below() -> None:
    token_volume = {
        "name": "kube-api-access-x7k2p",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt"}},
            ]
        },
    }
    assert referenced_objects({"volumes": [token_volume]}) == set()
