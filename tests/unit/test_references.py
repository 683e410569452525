from typing import Any

from kubekit import keys
from virtual_node.naming import NamespaceMapping
from virtual_node.references import (
    copy_differs,
    desired_copy,
    desired_endpoint_slice,
    desired_service,
    desired_service_account,
    for_a_volume_made_by_hand,
    made_again,
    referenced_objects,
    reflectable,
    replacement,
    selector_matches,
    service_of_slice,
    service_selector,
    token_account,
)
from virtual_node.translate import Ownership

OWNER = Ownership(origin="o", node_name="vk-a", cluster_id="a")
MAPPING = NamespaceMapping("same")


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
            {
                "name": "f",
                "csi": {"driver": "secrets-store", "nodePublishSecretRef": {"name": "csi-creds"}},
            },
            {"name": "g", "csi": {"driver": "inline"}},
            {"name": "h", "cephfs": {"monitors": ["m"], "secretRef": {"name": "ceph-key"}}},
            {"name": "i", "azureFile": {"secretName": "azure-key", "shareName": "s"}},
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
        ("secrets", "csi-creds"),
        ("secrets", "ceph-key"),
        ("secrets", "azure-key"),
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


def test_a_token_secret_goes_below_without_its_token_and_keeps_the_lower_one() -> None:
    """The upper token would not authenticate below: the copy names the account, and the
    lower tokens controller fills it with a token of the lower copy of that account."""
    annotations = {
        keys.SERVICE_ACCOUNT_NAME_ANNOTATION: "robot",
        keys.SERVICE_ACCOUNT_UID_ANNOTATION: "upper-robot-uid",
    }
    # Written by the upper apiserver the day its token was last used: nothing below.
    used_above = {"kubernetes.io/legacy-token-last-used": "2026-10-01"}
    metadata = {"name": "robot-token", "namespace": "shop", "uid": "u1", "labels": used_above}
    upper: dict[str, Any] = {
        "kind": "Secret",
        "type": keys.SERVICE_ACCOUNT_TOKEN_TYPE,
        "metadata": {**metadata, "annotations": annotations},
        "data": {"token": "dXBwZXI=", "ca.crt": "Y2E=", "namespace": "c2hvcA=="},
    }
    assert token_account(upper) == "robot"
    assert token_account({**upper, "type": "Opaque"}) is None
    assert reflectable(upper)
    copy = desired_copy(upper, MAPPING, OWNER)
    assert "data" not in copy and copy["type"] == keys.SERVICE_ACCOUNT_TOKEN_TYPE
    # An immutable one's copy is not: the lower tokens controller could not fill it.
    assert "immutable" not in desired_copy({**upper, "immutable": True}, MAPPING, OWNER)
    assert copy["metadata"]["annotations"][keys.SERVICE_ACCOUNT_NAME_ANNOTATION] == "robot"
    assert keys.SERVICE_ACCOUNT_UID_ANNOTATION not in copy["metadata"]["annotations"]
    assert copy["metadata"]["labels"] == OWNER.labels()
    filled_below = {
        **copy,
        "data": {"token": "bG93ZXI="},
        "metadata": {
            **copy["metadata"],
            "resourceVersion": "5",
            # The lower apiserver's, each day the token authenticates there.
            "labels": {
                **copy["metadata"]["labels"],
                "kubernetes.io/legacy-token-last-used": "2026-11-28",
            },
            "annotations": {
                **copy["metadata"]["annotations"],
                keys.SERVICE_ACCOUNT_UID_ANNOTATION: "lower-robot-uid",
            },
        },
    }
    assert not copy_differs(filled_below, copy), "the lower controller's work is no change"
    relabelled = {**copy, "metadata": {**copy["metadata"], "labels": {"team": "a"}}}
    assert copy_differs(filled_below, relabelled)
    body = replacement(filled_below, relabelled)
    assert body["data"] == {"token": "bG93ZXI="}, "an update keeps the lower token"
    assert body["metadata"]["labels"]["kubernetes.io/legacy-token-last-used"] == "2026-11-28"
    # The lower cleaner's mark of a token unused below would stop the one a pod now
    # mounts: a difference, and not kept.
    marked = {
        **filled_below,
        "metadata": {
            **filled_below["metadata"],
            "labels": {
                **filled_below["metadata"]["labels"],
                "kubernetes.io/legacy-token-invalid-since": "2026-11-01",
            },
        },
    }
    assert copy_differs(marked, copy)
    assert (
        "kubernetes.io/legacy-token-invalid-since"
        not in (replacement(marked, copy)["metadata"]["labels"])
    )
    assert body["metadata"]["annotations"][keys.SERVICE_ACCOUNT_UID_ANNOTATION] == (
        "lower-robot-uid"
    )
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


UPPER_BINDING = {
    "pv.kubernetes.io/bind-completed": "yes",
    "pv.kubernetes.io/bound-by-controller": "yes",
    "volume.kubernetes.io/storage-provisioner": "upper.example/disk",
    "volume.beta.kubernetes.io/storage-provisioner": "upper.example/disk",
    "volume.kubernetes.io/selected-node": "vk-a",
    "volume.kubernetes.io/storage-resizer": "upper.example/disk",
}
BOUND_CLAIM: dict[str, Any] = {
    "kind": "PersistentVolumeClaim",
    "metadata": {
        "name": "data",
        "namespace": "db",
        "uid": "u",
        "resourceVersion": "7",
        "labels": {"app": "db"},
        "annotations": {**UPPER_BINDING, "team": "storage"},
    },
    "spec": {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "manual",
        "volumeName": "pv-upper",
        "resources": {"requests": {"storage": "1Gi"}},
    },
}


def bound_below(copy: dict[str, Any]) -> dict[str, Any]:
    """The copy as the lower cluster has it once its own controllers bound it."""
    return {
        **copy,
        "metadata": {
            **copy["metadata"],
            "resourceVersion": "42",
            "annotations": {
                **copy["metadata"]["annotations"],
                "pv.kubernetes.io/bind-completed": "yes",
                "volume.kubernetes.io/selected-node": "lower-node-3",
                # Its resize controller's, while the volume grows.
                "volume.kubernetes.io/storage-resizer": "lower.example/disk",
            },
        },
        "spec": {**copy["spec"], "volumeName": "pv-lower"},
    }


def test_a_claim_bound_above_goes_down_without_the_upper_binding() -> None:
    # bind-completed without a volume would make the lower PV controller call it Lost.
    copy = desired_copy(BOUND_CLAIM, MAPPING, OWNER)
    annotations = copy["metadata"]["annotations"]
    assert not set(UPPER_BINDING) & set(annotations)
    assert annotations["team"] == "storage"
    assert "volumeName" not in copy["spec"]


def test_a_claim_bound_below_is_in_step_with_its_upper_claim() -> None:
    copy = desired_copy(BOUND_CLAIM, MAPPING, OWNER)
    assert not copy_differs(bound_below(copy), copy)


def test_a_claim_copy_takes_new_labels_and_keeps_its_binding_below() -> None:
    lower = bound_below(desired_copy(BOUND_CLAIM, MAPPING, OWNER))
    relabelled = {
        **BOUND_CLAIM,
        "metadata": {**BOUND_CLAIM["metadata"], "labels": {"app": "db", "tier": "gold"}},
    }
    desired = desired_copy(relabelled, MAPPING, OWNER)
    assert copy_differs(lower, desired)
    body = replacement(lower, desired)
    assert body["metadata"]["labels"]["tier"] == "gold"
    assert body["metadata"]["resourceVersion"] == "42"
    assert body["spec"] == lower["spec"]
    assert body["metadata"]["annotations"] == lower["metadata"]["annotations"]
    assert not copy_differs(body, desired)


def test_a_claim_expanded_above_grows_below_and_never_shrinks() -> None:
    lower = bound_below(desired_copy(BOUND_CLAIM, MAPPING, OWNER))

    def asking(storage: str) -> dict[str, Any]:
        spec = {**BOUND_CLAIM["spec"], "resources": {"requests": {"storage": storage}}}
        return desired_copy({**BOUND_CLAIM, "spec": spec}, MAPPING, OWNER)

    grown = asking("2Gi")
    assert copy_differs(lower, grown)
    body = replacement(lower, grown)
    assert body["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert body["spec"]["volumeName"] == "pv-lower"
    assert not copy_differs(lower, asking("1024Mi"))
    assert not copy_differs(lower, asking("512Mi"))


def test_a_copy_other_than_a_claim_is_replaced_by_the_desired_one() -> None:
    desired: dict[str, Any] = {
        "kind": "ConfigMap",
        "metadata": {"name": "c", "labels": {}, "annotations": {}},
    }
    lower = {**desired, "metadata": {**desired["metadata"], "resourceVersion": "3"}, "data": {}}
    assert replacement(lower, desired) == {
        "kind": "ConfigMap",
        "metadata": {"name": "c", "labels": {}, "annotations": {}, "resourceVersion": "3"},
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


def test_a_hand_made_token_volume_names_the_lower_clusters_own_ca() -> None:
    """The lower kube-root-ca.crt is the CA of the apiserver the pod talks to; a copy of
    the upper one would be refused as a name taken, and the pod would wait for good."""
    own = {
        "name": "token",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "audience": "vault"}},
                {"configMap": {"name": "kube-root-ca.crt"}},
                {"configMap": {"name": "settings"}},
            ]
        },
    }
    assert referenced_objects({"volumes": [own]}) == {("configmaps", "settings")}


def test_a_claim_a_pod_controls_is_made_below_by_the_lower_cluster() -> None:
    ephemeral = {
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": "web-0-scratch",
            "ownerReferences": [{"kind": "Pod", "name": "web-0", "uid": "p", "controller": True}],
        },
    }
    assert not reflectable(ephemeral)
    assert reflectable({"kind": "PersistentVolumeClaim", "metadata": {"name": "data"}})
    # Other kinds a pod controls go below as any (a Spark driver's executors' ConfigMap).
    assert reflectable({**ephemeral, "kind": "ConfigMap"})


def test_a_service_accounts_mountable_secrets_go_below_by_name() -> None:
    upper = {
        "metadata": {
            "name": "builder",
            "namespace": "ci",
            "uid": "sa",
            "annotations": {"kubernetes.io/enforce-mountable-secrets": "true"},
        },
        "secrets": [{"name": "registry", "namespace": "ci", "uid": "s"}],
        "imagePullSecrets": [{"name": "pull"}],
    }
    copy = desired_service_account(upper, MAPPING, OWNER)
    assert copy["secrets"] == [{"name": "registry"}]
    assert copy["imagePullSecrets"] == [{"name": "pull"}]
    bare = desired_service_account({**upper, "secrets": []}, MAPPING, OWNER)
    assert "secrets" not in bare
    # A copy made before, or before a Secret was added, is brought up to date.
    assert copy_differs(bare, copy)


def service(name: str, selector: dict[str, str] | None, **spec: object) -> dict[str, object]:
    return {
        "metadata": {"name": name, "namespace": "shop", "uid": f"uid-{name}"},
        "spec": {**({"selector": selector} if selector is not None else {}), **spec},
    }


def test_services_select_pods_by_their_whole_selector() -> None:
    labels = {"app": "web", "tier": "1"}

    def selects(service: dict[str, Any]) -> bool:
        return selector_matches(service_selector(service), labels)

    assert selects(service("web", {"app": "web"}))
    assert not selects(service("web-tier-2", {"app": "web", "tier": "2"}))
    assert not selects(service("manual", None))
    assert not selects(service("empty", {}))
    alias = service("alias", {"app": "web"}, type="ExternalName", externalName="example.com")
    assert not selects(alias)


def test_lower_service_gets_its_own_addresses_and_no_selector() -> None:
    upper = service(
        "web",
        {"app": "web"},
        type="NodePort",
        clusterIP="10.0.0.7",
        clusterIPs=["10.0.0.7"],
        ports=[{"port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30080}],
        sessionAffinity="ClientIP",
        internalTrafficPolicy="Local",
    )
    lower = desired_service(upper, NamespaceMapping("prefix", "up"), OWNER)
    assert lower["metadata"]["namespace"] == "up-shop"
    assert lower["metadata"]["annotations"][keys.UPPER_UID_ANNOTATION] == "uid-web"
    assert lower["spec"] == {
        "type": "ClusterIP",
        "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}],
        "sessionAffinity": "ClientIP",
        # Local would drop every packet below: kube-proxy finds an endpoint local by its
        # nodeName, which reflected endpoints do not carry.
        "internalTrafficPolicy": "Cluster",
    }
    made_local_before = {**lower, "spec": {**lower["spec"], "internalTrafficPolicy": "Local"}}
    assert copy_differs(made_local_before, lower)
    headless = desired_service(service("db", {"app": "db"}, clusterIP="None"), MAPPING, OWNER)
    assert headless["spec"]["clusterIP"] == "None"
    # What the lower apiserver fills in is no difference; what we set is.
    defaulted = {**lower, "spec": {**lower["spec"], "clusterIP": "10.96.0.9"}}
    assert not copy_differs(defaulted, lower)
    assert copy_differs({**defaulted, "spec": {**defaulted["spec"], "ports": []}}, lower)


def test_what_a_service_no_longer_sets_above_is_undone_below() -> None:
    """Not ready addresses no longer published, every port of a headless Service gone,
    the session affinity back to none: the copy changes too. What the lower apiserver
    defaults them to is no difference."""
    before = desired_service(
        service(
            "db",
            {"app": "db"},
            clusterIP="None",
            ports=[{"port": 5432}],
            publishNotReadyAddresses=True,
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        ),
        MAPPING,
        OWNER,
    )
    now = desired_service(service("db", {"app": "db"}, clusterIP="None"), MAPPING, OWNER)
    assert copy_differs(before, now)
    for field in ("ports", "publishNotReadyAddresses", "sessionAffinity", "sessionAffinityConfig"):
        spec = {k: v for k, v in before["spec"].items() if k != field}
        assert copy_differs({**before, "spec": spec}, now), field
    defaulted = {
        **now,
        "spec": {**now["spec"], "sessionAffinity": "None", "publishNotReadyAddresses": False},
    }
    assert not copy_differs(defaulted, now)


def test_an_empty_endpoint_slice_stored_as_null_is_no_difference() -> None:
    upper = {
        "kind": "EndpointSlice",
        "metadata": {"name": "db-1", "namespace": "shop", "uid": "u"},
        "addressType": "IPv4",
        "endpoints": [],
    }
    copy = desired_endpoint_slice(upper, MAPPING, OWNER)
    assert not copy_differs({**copy, "endpoints": None}, copy)
    assert copy_differs({**copy, "endpoints": [{"addresses": ["10.0.0.1"]}]}, copy)


def test_a_service_that_becomes_headless_or_stops_being_so_is_made_again_below() -> None:
    """Its cluster IP cannot change, and an update leaving it out keeps the old one."""
    ordinary = desired_service(service("db", {"app": "db"}), MAPPING, OWNER)
    headless = desired_service(service("db", {"app": "db"}, clusterIP="None"), MAPPING, OWNER)
    allocated = {**ordinary, "spec": {**ordinary["spec"], "clusterIP": "10.96.0.9"}}
    assert made_again(headless, ordinary) and made_again(allocated, headless)
    assert not made_again(allocated, ordinary) and not made_again(headless, headless)
    alias = service("db", None, type="ExternalName", externalName="example.com")
    assert not made_again(allocated, desired_service(alias, MAPPING, OWNER)), "an update does"


def test_a_copy_whose_immutable_fields_differ_is_made_again_below() -> None:
    settings = {"kind": "ConfigMap", "metadata": {"name": "s"}, "data": {"k": "v1"}}
    frozen = {**settings, "immutable": True}
    assert made_again(frozen, {**frozen, "data": {"k": "v2"}})
    assert made_again(frozen, settings), "no longer immutable"
    assert not made_again(frozen, {**frozen, "metadata": {"name": "s", "labels": {"a": "b"}}})
    assert not made_again(settings, {**settings, "data": {"k": "v2"}}), "an update does"
    secret = {"kind": "Secret", "metadata": {"name": "t"}, "data": {}}
    assert made_again(secret, {**secret, "type": "kubernetes.io/tls"})
    assert not made_again(secret, {**secret, "type": "Opaque"}), "Opaque when left out"
    endpoints = {"kind": "EndpointSlice", "metadata": {"name": "e"}, "addressType": "IPv4"}
    assert made_again(endpoints, {**endpoints, "addressType": "IPv6"})
    priority = {"kind": "PriorityClass", "metadata": {"name": "p"}, "value": 10}
    assert made_again(priority, {**priority, "value": 20})
    assert not made_again(priority, {**priority, "description": "high"})


def test_lower_endpoint_slice_is_ours_without_upper_node_names() -> None:
    upper = {
        "metadata": {
            "name": "web-abcde",
            "namespace": "shop",
            "uid": "u1",
            "labels": {
                keys.SERVICE_NAME_LABEL: "web",
                keys.ENDPOINT_SLICE_MANAGED_BY_LABEL: "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": ["10.1.0.5"],
                "conditions": {"ready": True},
                "nodeName": "vk-lower-1",
                "targetRef": {"kind": "Pod", "name": "web-1", "namespace": "shop", "uid": "x"},
            }
        ],
        "ports": [{"name": "", "port": 8080, "protocol": "TCP"}],
    }
    assert service_of_slice(upper) == "web"
    lower = desired_endpoint_slice(upper, MAPPING, OWNER)
    labels = lower["metadata"]["labels"]
    assert labels[keys.ENDPOINT_SLICE_MANAGED_BY_LABEL] == keys.PREFIX
    assert labels[keys.SERVICE_NAME_LABEL] == "web"
    assert lower["endpoints"] == [
        {
            "addresses": ["10.1.0.5"],
            "conditions": {"ready": True},
            "targetRef": {"kind": "Pod", "name": "web-1", "namespace": "shop"},
        }
    ]
    assert lower["ports"] == upper["ports"]
    assert not copy_differs(lower, lower)
    assert copy_differs({**lower, "endpoints": []}, lower)


def test_an_external_name_service_stays_a_dns_alias_below() -> None:
    """As a ClusterIP Service with no ports, the lower apiserver refuses it; with ports,
    it resolves to an address that leads nowhere."""
    alias = service("db", {}, type="ExternalName", externalName="db.example.com")
    lower = desired_service(alias, MAPPING, OWNER)
    assert lower["spec"] == {"type": "ExternalName", "externalName": "db.example.com"}
    moved = service("db", {}, type="ExternalName", externalName="db2.example.com")
    assert copy_differs(lower, desired_service(moved, MAPPING, OWNER))


def test_a_claim_naming_its_volume_asks_for_one_made_by_hand() -> None:
    """``volumeName`` its creator wrote names a volume of the upper cluster: below, the
    copy (which cannot name it) would bind whichever lower volume of the class it found."""
    spec = {"storageClassName": "manual", "volumeName": "nfs-share"}
    named = {"kind": "PersistentVolumeClaim", "metadata": {"name": "data"}, "spec": spec}
    assert for_a_volume_made_by_hand(named)
    assert not reflectable(named)
    # Bound by the PersistentVolume controller (to a volume of ours, say): made for it.
    bound = {
        **named,
        "metadata": {"name": "data", "annotations": {keys.BOUND_BY_CONTROLLER: "yes"}},
    }
    assert not for_a_volume_made_by_hand(bound)
    assert reflectable(bound)
    unbound = {**named, "spec": {"storageClassName": "manual"}}
    assert not for_a_volume_made_by_hand(unbound)
