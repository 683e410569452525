"""Every manifest: least-privilege RBAC, and the virtual node's Deployment started with
flags its command accepts (the apiserver's verdict is in tests/e2e/test_manifests.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kubekit import keys
from multischeduler.estimators import ESTIMATOR_TOKEN
from virtual_node.main import parse_args

MANIFESTS = Path(__file__).parents[2] / "manifests"
# Roles that grant far more than any component needs.
BROAD_ROLES = {"cluster-admin", "admin", "edit", "system:masters"}
# Verbs that let a holder grant itself more than it was given.
ESCALATING_VERBS = {"escalate", "bind", "impersonate"}


def all_documents() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (path, document)
        for path in sorted(MANIFESTS.rglob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


def roles() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in all_documents() if d["kind"] in ("Role", "ClusterRole")]


def test_every_component_has_a_role() -> None:
    names = {d["metadata"]["name"] for _, d in roles()}
    assert names == {
        "kubestrata-webhook",
        "kubestrata-webhook-cert",
        "kubestrata-multischeduler",
        "kubestrata-descheduler",
        "kubestrata-virtual-node",
        "kubestrata-virtual-node-leader",
    }
    # The virtual node's: in the upper cluster, for its heartbeat Lease, for its leader
    # Lease, and in each lower cluster; the webhook certificate job's: for its Secrets and
    # for the configuration's CA bundle; the descheduler's in its namespace (leader Lease,
    # record of moves); the webhook's for that record; the multischeduler's for the Lease
    # of the replica placing quota slices.
    assert len(roles()) == 12


@pytest.mark.parametrize("path, role", roles(), ids=lambda v: str(v)[-40:])
def test_no_role_grants_wildcards_or_escalation(path: Path, role: dict[str, Any]) -> None:
    assert not role.get("aggregationRule"), path
    for rule in role["rules"]:
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert not any("*" in value for value in rule.get(field) or ()), (path, rule)
        assert not rule.get("nonResourceURLs"), (path, rule)
        assert not set(rule["verbs"]) & ESCALATING_VERBS, (path, rule)


def test_every_binding_names_one_of_our_roles_for_one_of_our_accounts() -> None:
    ours = {(d["kind"], d["metadata"]["name"]) for _, d in roles()}
    bindings = [
        (p, d) for p, d in all_documents() if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
    ]
    assert bindings
    for path, binding in bindings:
        reference = binding["roleRef"]
        assert reference["name"] not in BROAD_ROLES, path
        assert (reference["kind"], reference["name"]) in ours, path
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount", path
            assert subject["namespace"] == "kubestrata-system", path
            # A component's roles bear its account's name.
            assert reference["name"] in (subject["name"], f"{subject['name']}-leader"), path


def virtual_node_container() -> dict[str, Any]:
    deployment, _budget = yaml.safe_load_all(
        (MANIFESTS / "virtual-node" / "deployment" / "deployment.yaml").read_text()
    )
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_the_virtual_node_advertises_its_pod_ip() -> None:
    container = virtual_node_container()
    assert "--address=$(POD_IP)" in container["args"]
    [pod_ip] = [v for v in container["env"] if v["name"] == "POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_the_virtual_node_deployment_starts_with_flags_it_knows() -> None:
    container = virtual_node_container()
    command, *args = container["args"]
    assert command == "virtual-node"
    config = parse_args([a.replace("$(POD_IP)", "10.0.0.7") for a in args])
    assert config.upper_kubeconfig == "", "in-cluster"
    assert config.address == "10.0.0.7"
    assert config.cluster_id == "lower"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "kubelet": config.kubelet_port,
        "estimator": config.estimator_port,
        "health": config.health_port,
    }
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert Path(config.lower_kubeconfig).parent.as_posix() in mounts
    assert config.cert_dir in mounts
    # The API client writes a kubeconfig's embedded CA to a temporary file: with a
    # read-only root filesystem and no /tmp, the lower client could not be made.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "/tmp" in mounts


def containers() -> list[tuple[str, dict[str, Any]]]:
    """Every container of a pod template (Deployments, Jobs, CronJobs), by its object."""
    found = []
    for path, document in all_documents():
        spec = document.get("spec") or {}
        template = spec.get("template") or (spec.get("jobTemplate") or {}).get("spec", {}).get(
            "template"
        )
        for container in (template or {}).get("spec", {}).get("containers") or []:
            found.append((f"{path}: {document['metadata']['name']}", container))
    return found


def test_every_container_with_a_read_only_root_has_a_writable_tmp() -> None:
    """A renewed serving certificate is loaded through scratch files (and the API client
    writes a kubeconfig's embedded CA to one): on a read-only root with no /tmp, the
    webhook and the multischeduler served their old certificate until they restarted."""
    checked = []
    for where, container in containers():
        if (container.get("securityContext") or {}).get("readOnlyRootFilesystem"):
            mounts = {m["mountPath"] for m in container.get("volumeMounts") or []}
            assert "/tmp" in mounts, where
            checked.append(where)
    assert any("kubestrata-webhook" in w for w in checked)
    assert any("kubestrata-multischeduler" in w for w in checked)


def test_every_container_passes_the_restricted_pod_security_standard() -> None:
    """Where the namespace enforces `restricted`, a container without a seccomp profile
    is refused: the ReplicaSets and Jobs would make no pod, said only in their events."""
    found = containers()
    assert len(found) >= 6
    for where, container in found:
        context = container.get("securityContext") or {}
        assert context.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert context.get("runAsNonRoot") is True, where
        assert context.get("allowPrivilegeEscalation") is False, where
        assert context.get("capabilities") == {"drop": ["ALL"]}, where


def flow_schemas() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in all_documents() if d["kind"] == "FlowSchema"]


BUILT_IN_LEVELS = {"node-high", "system", "workload-high", "workload-low", "leader-election"}


@pytest.mark.parametrize("path, schema", flow_schemas(), ids=lambda v: str(v)[-40:])
def test_every_flow_schema_matches_one_of_our_accounts_first(
    path: Path, schema: dict[str, Any]
) -> None:
    spec = schema["spec"]
    assert spec["priorityLevelConfiguration"]["name"] in BUILT_IN_LEVELS
    # Ahead of the built-in schemas for service accounts (kube-system-service-accounts
    # 900, service-accounts 9000), or they would take the requests.
    assert spec["matchingPrecedence"] < 900
    for rule in spec["rules"]:
        for subject in rule["subjects"]:
            assert subject["kind"] == "ServiceAccount"
            assert subject["serviceAccount"]["namespace"] == "kubestrata-system"
    kustomization = yaml.safe_load((path.parent / "kustomization.yaml").read_text())
    assert path.name in kustomization["resources"]


def test_a_virtual_node_s_heartbeat_is_matched_before_the_rest_of_its_requests() -> None:
    upper = {
        d["metadata"]["name"]: d["spec"]
        for p, d in flow_schemas()
        if p.parent.name == "rbac" and p.parent.parent.name == "virtual-node"
    }
    heartbeat, rest = upper["kubestrata-virtual-node-heartbeat"], upper["kubestrata-virtual-node"]
    assert heartbeat["matchingPrecedence"] < rest["matchingPrecedence"]
    assert heartbeat["priorityLevelConfiguration"]["name"] == "node-high"
    assert rest["priorityLevelConfiguration"]["name"] == "system"
    [rule] = heartbeat["rules"]
    matched = {
        (g, r) for rr in rule["resourceRules"] for g in rr["apiGroups"] for r in rr["resources"]
    }
    assert matched == {("", "nodes"), ("", "nodes/status"), ("coordination.k8s.io", "leases")}
    [lower] = [d["spec"] for p, d in flow_schemas() if p.parent.name == "virtual-node-lower"]
    assert lower["priorityLevelConfiguration"]["name"] == "workload-high"


def deployments() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in all_documents() if d["kind"] == "Deployment"]


def test_every_deployment_runs_above_workloads_with_one_disruption_at_a_time() -> None:
    """The webhook and the extender fail closed, and a virtual node's replicas keep its
    heartbeat: preempted for a workload, or both evicted by one drain, they stopped
    every federated pod's creation or scheduling, or had a cluster's pods taken for
    lost."""
    classes = {d["metadata"]["name"]: d for _, d in all_documents() if d["kind"] == "PriorityClass"}
    budgets = [d for _, d in all_documents() if d["kind"] == "PodDisruptionBudget"]
    found = deployments()
    assert len(found) == 4
    for path, deployment in found:
        where = f"{path}: {deployment['metadata']['name']}"
        template = deployment["spec"]["template"]
        priority = classes[template["spec"]["priorityClassName"]]
        assert 0 < priority["value"] <= 1_000_000_000 and not priority["globalDefault"]
        labels = template["metadata"]["labels"]
        covering = [
            b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert len(covering) == 1, where  # the Eviction API refuses a pod under several
        assert covering[0]["spec"] == {
            "maxUnavailable": 1,
            "selector": deployment["spec"]["selector"],
        }, where
        [spread] = template["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname", where
        assert spread["labelSelector"] == deployment["spec"]["selector"], where
        assert spread["whenUnsatisfiable"] == "ScheduleAnyway", where


def test_the_install_job_goes_once_it_has_ended() -> None:
    """A Job's pod template cannot change: while the ended Job stayed, applying the
    manifests again with a new image was refused."""
    jobs = [d for _, d in all_documents() if d["kind"] == "Job"]
    assert jobs
    for job in jobs:
        assert 0 < job["spec"]["ttlSecondsAfterFinished"] <= 3600, job["metadata"]["name"]


def test_the_webhook_deployment_cannot_rewrite_its_own_configuration() -> None:
    """Only the single replica of `kubestrata up` (--inject-ca-bundle) patches it: with
    that right a compromised replica of the Deployment could change its namespaceSelector
    or failurePolicy and hold up pods cluster-wide."""
    deployed = [
        rule
        for document in yaml.safe_load_all((MANIFESTS / "webhook" / "rbac.yaml").read_text())
        if document and document["kind"] in ("Role", "ClusterRole")
        for rule in document["rules"]
    ]
    assert deployed and not any(
        "mutatingwebhookconfigurations" in rule["resources"] for rule in deployed
    )
    kustomization = yaml.safe_load((MANIFESTS / "webhook" / "kustomization.yaml").read_text())
    assert not any("inject-ca-bundle" in resource for resource in kustomization["resources"])


def kustomized(directory: Path) -> list[dict[str, Any]]:
    """The documents a kustomization's resources name, its bases' included."""
    found: list[dict[str, Any]] = []
    for resource in yaml.safe_load((directory / "kustomization.yaml").read_text())["resources"]:
        path = (directory / resource).resolve()
        if path.is_dir():
            found += kustomized(path)
        else:
            found += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return found


def test_the_components_priority_class_is_not_put_in_lower_clusters() -> None:
    """A lower cluster's class is used as it is for a mirrored pod naming it: there, the
    components' class (1,000,000,000, preempting) was any tenant's for the asking."""
    kinds = {d["kind"] for d in kustomized(MANIFESTS / "virtual-node-lower")}
    assert "Namespace" in kinds and "PriorityClass" not in kinds
    for upper in ("upper", "with-cert-manager"):
        assert [
            d["metadata"]["name"]
            for d in kustomized(MANIFESTS / upper)
            if d["kind"] == "PriorityClass"
        ] == ["kubestrata-system"], upper


def test_every_component_is_restarted_when_wedged() -> None:
    """Ready but never restarted, a wedged webhook replica (it fails closed) stayed out
    of its Service for good: both wedged, no federated pod was created."""
    for path, deployment in deployments():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            ports = {p["name"] for p in container["ports"]}
            probe = container["livenessProbe"]["httpGet"]
            assert probe["path"] == "/healthz" and probe["port"] in ports, path


def test_a_component_serving_only_once_its_caches_are_filled_has_minutes_to_start() -> None:
    """The multischeduler opens its port once its watches have listed: after a
    control-plane restart that can take minutes, and a liveness probe 30 s in killed
    both replicas into a back-off while nothing was scheduled."""
    [(_, deployment)] = [
        (p, d) for p, d in deployments() if d["metadata"]["name"] == "kubestrata-multischeduler"
    ]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    startup = container["startupProbe"]
    assert startup["httpGet"] == container["livenessProbe"]["httpGet"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert "initialDelaySeconds" not in container["livenessProbe"]


def test_the_estimators_callers_mount_a_token_for_the_estimators_alone() -> None:
    """The estimators refuse any token not for their audience: one for the apiserver,
    sent to every virtual node, let each act as the multischeduler or the descheduler."""
    callers = 0
    for path, deployment in deployments():
        spec = deployment["spec"]["template"]["spec"]
        [container] = spec["containers"]
        if container["args"][0] not in ("multischeduler", "descheduler"):
            continue
        callers += 1
        [mount] = [
            m for m in container["volumeMounts"] if m["mountPath"] == str(ESTIMATOR_TOKEN.parent)
        ]
        [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        [source] = volume["projected"]["sources"]
        assert source["serviceAccountToken"]["audience"] == keys.ESTIMATOR_AUDIENCE, path
        assert source["serviceAccountToken"]["path"] == ESTIMATOR_TOKEN.name, path
    assert callers == 2
