"""The MutatingWebhookConfiguration that routes federated pods, DaemonSets and pods that
tolerate every taint to the webhook (pure).

One definition serves both deployments: ``kubestrata webhook --register-url`` applies it
for a local federation, and ``manifests/webhook/`` carries the same rules (a unit test
keeps the two equal).
"""

from __future__ import annotations

import base64
from typing import Any

from kubekit import keys, stash

JSON = dict[str, Any]

CONFIGURATION_NAME = "kubestrata-webhook"
WEBHOOK_NAME = "stash.kubestrata.io"
DAEMONSETS_WEBHOOK_NAME = "daemonsets.kubestrata.io"
PATH = "/mutate"
TOLERATING_PODS_WEBHOOK_NAME = "tolerating-pods.kubestrata.io"
# Where pods of the third entry are sent, below the main path: a URL configuration
# reaches it by the URL it was given with this added.
KEEP_OFF_SUFFIX = "/keep-off-virtual-nodes"
KEEP_OFF_PATH = PATH + KEEP_OFF_SUFFIX
# A toleration with no key and operator Exists, for every effect or NoSchedule's: the
# virtual nodes' taint among all others. The handler judges the rest.
TOLERATES_EVERY_TAINT = (
    "has(object.spec.tolerations) && object.spec.tolerations.exists(t,"
    " (!has(t.key) || t.key == '') && has(t.operator) && t.operator == 'Exists'"
    " && (!has(t.effect) || t.effect == '' || t.effect == 'NoSchedule'))"
)
TIMEOUT_SECONDS = 5


def _metadata_value(pod: str, field: str, key: str) -> str:
    return (
        f"(has({pod}.metadata.{field}) && '{key}' in"
        f" {pod}.metadata.{field} ? {pod}.metadata.{field}['{key}'] : '')"
    )


def _changed(field: str, key: str) -> str:
    return f"{_metadata_value('object', field, key)} != {_metadata_value('oldObject', field, key)}"


ON_CREATE_OR_STASHED_SCHEDULING_CHANGE = (
    "request.operation == 'CREATE'"
    f" || {_changed('annotations', keys.STASH_ANNOTATION)}"
    f" || {_changed('labels', keys.FEDERATION_LABEL)}"
    " || (has(oldObject.spec.schedulingGates)"
    " || has(oldObject.metadata.annotations)"
    f" && '{keys.STASH_ANNOTATION}' in oldObject.metadata.annotations) && ("
    + " || ".join(
        f"has(object.spec.{f}) != has(oldObject.spec.{f})"
        f" || has(object.spec.{f}) && object.spec.{f} != oldObject.spec.{f}"
        for f in stash.FIELDS
    )
    + ")"
)


def stash_webhook(client_config: JSON) -> JSON:
    """One webhook entry of the configuration.

    - failurePolicy Fail: a federated pod admitted without its stash would carry
      lower-cluster scheduling fields to the upper scheduler and never schedule (or land
      on the wrong cluster); refusing it makes its controller retry until we are back.
    - timeoutSeconds 5: the work is a pure function of the pod; a slow answer means the
      webhook is unwell, and failing fast keeps pod creation from stalling for 10 s.
    - sideEffects None: nothing is written anywhere, so dryRun requests are served.
    - reinvocationPolicy IfNeeded: after our change the apiserver runs its own admission
      plugins again (RuntimeClass, PodNodeSelector put their node selector back), and
      other webhooks may add scheduling fields after ours; called again, the webhook
      stashes them again (``kubekit.stash.stash_scheduling`` says how).
    - UPDATE too, but only of a stashed or gated pod's scheduling fields, or of the
      stash annotation or the federation label (``matchConditions``; written by hand, or
      read once the pod opts in, it would change where the pod runs below past the
      admission the pod had):
      applying a pod's manifest again puts back the fields the webhook moved, which a
      running pod may not take, and a pod waiting on a scheduling gate may be given
      scheduling fields (``kubekit.stash.stash_update``). Other updates (labels,
      finalizers, a controller's adoption, a new image, a scheduling gate lifted) never
      wait on the webhook, nor fail while it is away.
    """
    return {
        "name": WEBHOOK_NAME,
        "admissionReviewVersions": ["v1"],
        "clientConfig": client_config,
        "rules": [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ],
        "matchConditions": [
            {
                "name": "create-or-stashed-scheduling-change",
                "expression": ON_CREATE_OR_STASHED_SCHEDULING_CHANGE,
            }
        ],
        "namespaceSelector": {
            "matchExpressions": [
                {
                    "key": keys.FEDERATION_LABEL,
                    "operator": "In",
                    "values": [keys.FEDERATION_ENABLED],
                },
                {
                    "key": "kubernetes.io/metadata.name",
                    "operator": "NotIn",
                    "values": list(stash.PROTECTED_NAMESPACES),
                },
            ]
        },
        "objectSelector": {
            "matchExpressions": [
                {
                    "key": keys.FEDERATION_LABEL,
                    "operator": "NotIn",
                    "values": [keys.FEDERATION_DISABLED],
                }
            ]
        },
        "failurePolicy": "Fail",
        "matchPolicy": "Equivalent",
        "sideEffects": "None",
        "timeoutSeconds": TIMEOUT_SECONDS,
        "reinvocationPolicy": "IfNeeded",
    }


def daemonsets_webhook(client_config: JSON) -> JSON:
    """The entry for DaemonSets (webhook.daemonsets), different in three policies:

    - failurePolicy Ignore: a DaemonSet admitted as it is puts pods on virtual nodes, as
      it would without kubestrata; refusing would block every DaemonSet write of the
      cluster, kube-system's own, while the webhook is away.
    - every namespace: node agents live in kube-system first, and federation is about
      pods, not about the namespaces their node agents run in.
    - UPDATE too: an existing DaemonSet is kept off virtual nodes with its next change of
      pod template (``kubectl rollout restart`` makes one); the webhook leaves updates
      that keep the template alone, so no update rolls the pods for our sake.
    """
    return {
        "name": DAEMONSETS_WEBHOOK_NAME,
        "admissionReviewVersions": ["v1"],
        "clientConfig": client_config,
        "rules": [
            {
                "apiGroups": ["apps"],
                "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["daemonsets"],
                "scope": "Namespaced",
            }
        ],
        "failurePolicy": "Ignore",
        "matchPolicy": "Equivalent",
        "sideEffects": "None",
        "timeoutSeconds": TIMEOUT_SECONDS,
        "reinvocationPolicy": "IfNeeded",
    }


def tolerating_pods_webhook(client_config: JSON) -> JSON:
    """The entry for pods outside federation that tolerate every taint (an operator of
    kube-system, say): they tolerate the virtual nodes' taint without meaning them, and
    were bound there, to run in a lower cluster. Kept off virtual nodes as DaemonSets
    are (``webhook.admission.keep_off_response``), with the same policies:

    - failurePolicy Ignore, every namespace: the cluster's own pods must never wait on
      the webhook; one admitted as it is may land on a virtual node, as without it.
    - CREATE only, and only pods with such a toleration (``matchConditions``): others
      never reach the webhook. A federated pod reaches it after the stash entry has
      pointed it at the virtual nodes, and is left as it is.
    """
    return {
        "name": TOLERATING_PODS_WEBHOOK_NAME,
        "admissionReviewVersions": ["v1"],
        "clientConfig": client_config,
        "rules": [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": ["CREATE"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ],
        "matchConditions": [{"name": "tolerates-every-taint", "expression": TOLERATES_EVERY_TAINT}],
        "failurePolicy": "Ignore",
        "matchPolicy": "Equivalent",
        "sideEffects": "None",
        "timeoutSeconds": TIMEOUT_SECONDS,
        "reinvocationPolicy": "IfNeeded",
    }


def url_configuration(url: str, ca_bundle: bytes = b"") -> JSON:
    """The configuration for a webhook reached by URL (a local federation); without
    ``ca_bundle``, for a webhook that puts its CA in itself."""
    client_config = {"url": url}
    if ca_bundle:
        client_config["caBundle"] = base64.b64encode(ca_bundle).decode()
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {
            "name": CONFIGURATION_NAME,
            "labels": {keys.MANAGED_BY_LABEL: keys.MANAGED_BY_VALUE},
        },
        "webhooks": [
            stash_webhook(client_config),
            daemonsets_webhook(client_config),
            tolerating_pods_webhook({**client_config, "url": url.rstrip("/") + KEEP_OFF_SUFFIX}),
        ],
    }
