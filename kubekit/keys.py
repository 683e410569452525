"""Every label, annotation, taint and finalizer key kubestrata reads or writes."""

from __future__ import annotations

PREFIX = "kubestrata.io"

# The namespace of every component and ServiceAccount the manifests deploy, in the upper
# cluster and (for the virtual node's lower identity) in each lower cluster.
SYSTEM_NAMESPACE = "kubestrata-system"
# Where every Node's heartbeat Lease is, a virtual node's as a kubelet's.
NODE_LEASE_NAMESPACE = "kube-node-lease"

# On virtual Nodes: which lower cluster a Node stands for. Also what the webhook keeps on
# pods and the schedulers select on.
CLUSTER_ID_LABEL = f"{PREFIX}/cluster-id"
# On virtual Nodes: how the components find them. Until 2026-11-29 also the webhook's entry
# in every federated pod's node selector, which pods admitted then keep; a kubelet may
# set it on its own Node, so it proves nothing.
VIRTUAL_NODE_LABEL = f"{PREFIX}/virtual-node"
VIRTUAL_NODE_LABEL_VALUE = "true"
# On virtual Nodes too, under the prefix the NodeRestriction admission plugin keeps
# kubelets from setting on their own Node: the webhook's entry in every federated pod's
# node selector (keeping it off the upper cluster's ordinary nodes; a key of our own,
# which no lower node or admission plugin gives another value), and the multischeduler
# and the descheduler ask a Node's estimator only with it.
PROVEN_VIRTUAL_NODE_LABEL = "node-restriction.kubernetes.io/kubestrata-virtual-node"
NODE_TYPE_LABEL = "type"
NODE_TYPE_VIRTUAL = "virtual-kubelet"
HOSTNAME_LABEL = "kubernetes.io/hostname"
OS_LABEL = "kubernetes.io/os"
ARCH_LABEL = "kubernetes.io/arch"


def default_node_name(cluster_id: str) -> str:
    """The name of a lower cluster's virtual Node unless one is given."""
    return f"vk-{cluster_id}"


# The Lease (in SYSTEM_NAMESPACE) whose holder is the one descheduler replica that moves.
DESCHEDULER_LEASE = "kubestrata-descheduler"
# The Lease (in SYSTEM_NAMESPACE) whose holder is the one multischeduler replica that
# places quota slices (every replica serves the extender).
SLICES_LEASE = "kubestrata-multischeduler-slices"


def virtual_node_lease_name(node_name: str) -> str:
    """The Lease (in SYSTEM_NAMESPACE) whose holder is the one replica of a virtual node
    that mirrors; not the Node's heartbeat Lease in kube-node-lease."""
    return f"kubestrata-virtual-node-{node_name}"


# The taint that keeps ordinary pods and DaemonSets off virtual Nodes; federated pods
# get its toleration from the webhook.
PROVIDER_TAINT_KEY = "virtual-kubelet.io/provider"
PROVIDER_TAINT_VALUE = "kubestrata"
# NoSchedule on a virtual Node whose process has not finished starting in time: nothing new
# is bound to it meanwhile, and its Lease is still renewed, so what runs there stays.
NOT_STARTED_TAINT_KEY = f"{PREFIX}/not-started"
# Kubernetes' own: the node controller's taints of a Node that stopped reporting.
NODE_DOWN_TAINTS = frozenset({"node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"})

# On every lower object kubestrata creates: who made it. MANAGED_BY marks it as ours;
# ORIGIN names the upper cluster (the UID of its kube-system namespace), so lower
# clusters shared by several upper clusters keep their objects apart.
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "kubestrata"
ORIGIN_LABEL = f"{PREFIX}/origin"
UPPER_UID_ANNOTATION = f"{PREFIX}/upper-uid"
UPPER_NAMESPACE_ANNOTATION = f"{PREFIX}/upper-namespace"
# Which labels and annotations of a lower pod came from the upper pod: only those are
# removed below when they go above; what the lower cluster adds (topology labels at
# binding, its webhooks' annotations) is left alone.
UPPER_KEYS_ANNOTATION = f"{PREFIX}/upper-keys"
# On a lower pod: each container's image as the upper pod gives it, by container name (a
# lower admission webhook may have rewritten the one the pod runs).
UPPER_IMAGES_ANNOTATION = f"{PREFIX}/upper-images"
# On a lower pod: each container's resources as the upper pod gave them when it was made
# or last resized (a lower admission webhook may have changed the ones the pod has).
UPPER_RESOURCES_ANNOTATION = f"{PREFIX}/upper-resources"
# On a lower pod: why its lower apiserver refused for good the resize to the resources
# recorded above (the upper pod's PodResizePending says so while they stay asked for).
RESIZE_REFUSED_ANNOTATION = f"{PREFIX}/resize-refused"

# The webhook's stash of scheduling fields on federated pods (kubekit.stash).
STASH_ANNOTATION = f"{PREFIX}/scheduling-stash"

# Namespaces whose pods the webhook federates carry this label with value "enabled";
# a pod opts out with the same label set to "disabled".
FEDERATION_LABEL = f"{PREFIX}/federation"
FEDERATION_ENABLED = "enabled"
FEDERATION_DISABLED = "disabled"

# A Secret of this type names a ServiceAccount, and each cluster's tokens controller
# fills it with a token of that account (and records the account's UID on it).
SERVICE_ACCOUNT_TOKEN_TYPE = "kubernetes.io/service-account-token"
SERVICE_ACCOUNT_NAME_ANNOTATION = "kubernetes.io/service-account.name"
SERVICE_ACCOUNT_UID_ANNOTATION = "kubernetes.io/service-account.uid"
# Labels each cluster's apiserver and legacy-token cleaner put on such a Secret: the day
# its token last authenticated, and since when it is marked unused (it then no longer
# authenticates).
LEGACY_TOKEN_LAST_USED_LABEL = "kubernetes.io/legacy-token-last-used"
LEGACY_TOKEN_INVALID_SINCE_LABEL = "kubernetes.io/legacy-token-invalid-since"

# The Job controller's count, on a pod of a Job with a backoff limit per index, of the
# failures of that pod's index so far.
JOB_INDEX_FAILURE_COUNT_ANNOTATION = "batch.kubernetes.io/job-index-failure-count"

# Kubernetes' own keys on EndpointSlices: the Service a slice belongs to, and which
# controller manages it (the lower cluster's controllers leave slices marked as ours).
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
ENDPOINT_SLICE_MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"

# The provisioner name a StorageClass of the upper cluster gives for volumes the lower
# clusters make: a claim of such a class that waits for its first consumer gets, once the
# upper scheduler has put its pod on a virtual node, an upper volume from that virtual node
# standing for the lower cluster's, which binds below with the pod.
LOWER_CLUSTER_PROVISIONER = f"{PREFIX}/lower-cluster"
# The CSI driver such a volume names (a DNS subdomain, as the API wants); nothing above
# mounts it: the virtual node's pods mount the lower cluster's volume.
LOWER_CLUSTER_CSI_DRIVER = f"lower-cluster.{PREFIX}"
# Kubernetes' own: the node the upper scheduler chose for a claim, the provisioner the PV
# controller expects to act, and the one a volume was made by.
SELECTED_NODE_ANNOTATION = "volume.kubernetes.io/selected-node"
STORAGE_PROVISIONER_ANNOTATION = "volume.kubernetes.io/storage-provisioner"
PROVISIONED_BY_ANNOTATION = "pv.kubernetes.io/provisioned-by"

# Kubernetes' own annotations on a claim, written by the cluster that binds it: its
# PersistentVolume controller's (bound, by whom, which provisioner, which plugin it moved
# to, which resizer grows it) and its scheduler's (the node a WaitForFirstConsumer volume
# is made for). The upper cluster's mean nothing below (bind-completed without a volume
# makes the claim Lost), and the lower cluster's are its own (dropped by an update, the
# resizer's would be written again, and dropped again, through a whole expansion).
BOUND_BY_CONTROLLER = "pv.kubernetes.io/bound-by-controller"
CLAIM_BINDING_ANNOTATIONS = frozenset(
    {
        "pv.kubernetes.io/bind-completed",
        BOUND_BY_CONTROLLER,
        "pv.kubernetes.io/migrated-to",
        "volume.beta.kubernetes.io/storage-provisioner",
        "volume.kubernetes.io/storage-resizer",
        STORAGE_PROVISIONER_ANNOTATION,
        SELECTED_NODE_ANNOTATION,
    }
)

# On virtual Nodes: where the fit estimator of the lower cluster listens (host:port, gRPC
# over TLS with the kubelet API's serving certificate).
ESTIMATOR_ADDRESS_ANNOTATION = f"{PREFIX}/estimator-address"
# The audience of the tokens estimators accept: one an apiserver refuses (its audiences
# are its own), so an estimator, which sees its callers' tokens, cannot replay them
# against the apiserver. Every estimator takes it: one can still replay a caller's token
# against the others.
ESTIMATOR_AUDIENCE = f"{PREFIX}/estimator"
# When that estimator started (RFC 3339): its reservations are gone, and the change makes
# the upper kube-scheduler retry the pods the extender failed while it was away (a Node
# annotation change is a cluster event; an extender's rejection waits for one).
ESTIMATOR_STARTED_ANNOTATION = f"{PREFIX}/estimator-started"
# On virtual Nodes: a digest of the lower nodes' labels, taints, schedulability and
# readiness. The upper scheduler retries a pod the extender failed only on a cluster event;
# a lower node labelled or uncordoned changes no capacity above, but changes this.
LOWER_NODES_ANNOTATION = f"{PREFIX}/lower-nodes"
# On virtual Nodes: a digest of what the lower cluster's ResourceQuotas cap (not their
# usage). The estimator holds pods to them; a quota raised or removed below changes no
# capacity above, but changes this: a Node change, on which the upper scheduler retries
# the pods the extender failed (not always: docs/multischeduler.md, Known limits).
LOWER_QUOTAS_ANNOTATION = f"{PREFIX}/lower-quotas"
# On virtual Nodes: the roomiest lower node and what it has left, as JSON quantities
# ({"node": ..., "cpu": ..., "memory": ...}); what fragmentation leaves of the total.
LARGEST_FREE_SLOT_ANNOTATION = f"{PREFIX}/largest-free-slot"
# On virtual Nodes: the keys of the labels the virtual node set (a JSON list), so that a
# restarted one takes off those the lower nodes no longer share, and no user's label.
NODE_LABEL_KEYS_ANNOTATION = f"{PREFIX}/label-keys"
# On virtual Nodes: the resources of status.capacity and allocatable the virtual node set
# (a JSON list), so that one gone from the lower nodes is taken off after a restart or a
# failover too, and one someone else put there (an extended resource) never is.
NODE_RESOURCE_KEYS_ANNOTATION = f"{PREFIX}/resource-keys"

# On upper pods: "never" keeps the descheduler's hands off the pod. Any other value does
# too (a user who wrote "Never" or "false" meant it), and the webhook warns of it.
DESCHEDULER_ANNOTATION = f"{PREFIX}/descheduler"
DESCHEDULER_NEVER = "never"
# On a waiting upper pod the descheduler made room for: how many plans were carried out
# for it and when the last was ({"plans": n, "at": RFC 3339}); the next waits longer.
DEFRAGMENTED_ANNOTATION = f"{PREFIX}/defragmented"
# The ConfigMap (in SYSTEM_NAMESPACE) where the descheduler records, per controller UID,
# the virtual nodes it moved that controller's pods off and until when the webhook keeps
# the controller's new pods off them (kubekit.moves).
MOVES_CONFIGMAP = "kubestrata-moves"
# On a bare pod the descheduler re-created in another cluster: the UID of the original.
COPY_OF_ANNOTATION = f"{PREFIX}/copy-of"
# On such a copy: the virtual nodes the pod was moved off, and until when its later copies
# stay off them (JSON {virtual node: RFC 3339 time}).
LEFT_UNTIL_ANNOTATION = f"{PREFIX}/left-until"

# The reasons the virtual node fails an upper pod with before anything of it is made
# below (its lower cluster cannot take it, and retrying would not help); the descheduler
# withdraws a bare pod's copy failed for one of them, and copies the original elsewhere.
# A pod failed otherwise (LowerPodDeleted: lost after a node below took it) may have run.
TRANSLATION_FAILED = "TranslationFailed"
NAME_CONFLICT = "NameConflict"
LOWER_NAMESPACE_REFUSED = "LowerNamespaceRefused"
HOST_ACCESS_REFUSED = "HostAccessRefused"
VOLUME_REFUSED = "VolumeRefused"
OUTSIDE_QUOTA_SLICES = "OutsideQuotaSlices"
LOWER_CLUSTER_REJECTED = "LowerClusterRejected"
REFUSED_BEFORE_MADE = frozenset(
    {
        TRANSLATION_FAILED,
        NAME_CONFLICT,
        LOWER_NAMESPACE_REFUSED,
        HOST_ACCESS_REFUSED,
        VOLUME_REFUSED,
        OUTSIDE_QUOTA_SLICES,
        LOWER_CLUSTER_REJECTED,
    }
)
# A pod carrying a stash the webhook does not guard: not made below while so (tried
# again: its namespace's labels may not have been seen yet).
STASH_NOT_GUARDED = "StashNotGuarded"

# Quota slices (kubekit.slices). On upper namespaces: the size of a slice (JSON
# {"cpu": "2", "memory": "4Gi"}), the placement ({cluster-id: slices}, which users may
# edit), and what the multischeduler last applied (JSON, so an edit is told from it).
SLICE_SIZE_ANNOTATION = f"{PREFIX}/slice-size"
SLICE_PLACEMENT_ANNOTATION = f"{PREFIX}/slice-placement"
SLICE_APPLIED_ANNOTATION = f"{PREFIX}/slice-applied"
# The condition on a sliced namespace's status: are its slices placed, and if not, why.
SLICES_PLACED_CONDITION = f"{PREFIX}/SlicesPlaced"
# In each lower cluster's SYSTEM_NAMESPACE: what it promised every sliced namespace of
# every tenant; and in each sliced lower namespace, the ResourceQuota holding it to that.
SLICE_LEDGER_CONFIGMAP = "kubestrata-slices"
SLICE_QUOTA = "kubestrata-slices"
