"""The lower cluster behind a virtual node: the backend of the node and pod controllers."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from datetime import timedelta
from typing import Any, Protocol

from kubekit import keys, metrics
from kubekit.client import (
    API_ERRORS,
    NAMESPACES,
    PODS,
    SERVICEACCOUNTS,
    ApiError,
    KubeClient,
    is_not_found,
)
from kubekit.informer import FunctionHandler, Informer, object_key, resource_version
from kubekit.timestamps import now_rfc3339, parse_time
from kubekit.workqueue import WorkQueue
from virtual_node.capacity import (
    PodUsage,
    as_resource_list,
    free_capacity,
    free_slot,
    pod_usage,
)
from virtual_node.naming import NamespaceMapping, NamingError, made_under_another_mapping
from virtual_node.node import NodeReport, nodes_digest, shared_labels
from virtual_node.podcontroller import (
    FINISHED,
    EndingBelow,
    Gone,
    Mirrored,
    Refused,
    Rejected,
    SyncResult,
    Vanished,
    Waiting,
)
from virtual_node.quotas import quota_caps, quotas_digest
from virtual_node.references import DEFAULT_SERVICE_ACCOUNT, hand_made_refusal
from virtual_node.translate import (
    Ownership,
    StashNotGuarded,
    TranslationError,
    deletion_due,
    desired_lower_pod,
    ephemeral_containers_patch,
    host_access_refusal,
    left_unpinned,
    lower_pod_patch,
    made_from,
    pinned_to,
    resize_patch,
    resources_record_patch,
    upper_status,
    with_resize_refusal,
)
from virtual_node.volumes import hand_made_template

log = logging.getLogger(__name__)

JSON = dict[str, Any]
_SMP = "application/strategic-merge-patch+json"
# A lower cluster is unreachable once this many pings in a row failed, a pause apart: one
# dropped connection or one apiserver of several restarting would otherwise mark the Node
# not ready, pause mirroring and reconcile every pod again once back (a kubelet tries its
# node status five times before it gives up on an update). All of them within the Lease's
# renewal interval, so a lower cluster that answers slowly does not let the Lease lapse.
PING_ATTEMPTS = 3
PING_PAUSE_SECONDS = 1.0
PING_DEADLINE_SECONDS = 10.0
# Each request of a try: one that hangs leaves room for another try within the deadline.
PING_REQUEST_SECONDS = 3.0
# Statuses of the lower apiserver that mean "this pod will never be accepted as is".
# 403 is not one: admission refuses for reasons that pass (quota, a namespace still
# being set up).
_PERMANENT = frozenset({400, 422})
_PATCH_REFUSED = _PERMANENT | {403}


# Whole seconds, and the kubelet's clock against the apiserver's: a container that ended
# this close to its pod's deletion is taken for one the deletion ended.
_DELETION_CLOCK_SLACK = timedelta(seconds=2)


def ended_by_its_deletion(lower: Mapping[str, Any]) -> bool:
    """Whether a lower pod deleted (or removed) below was still running when its deletion
    began: not finished then, or a container of it ended since, or with no word of when
    (``ContainerStatusUnknown``, a container the deletion stopped before it started). A
    kubelet writes a deleted pod's terminal phase, Succeeded when its containers exit 0
    on SIGTERM. One that had finished before (a clean-up: the lower pod GC past its
    threshold, an admin) was not."""
    metadata = lower.get("metadata") or {}
    deleted = metadata.get("deletionTimestamp")
    if not deleted:
        return False
    status = lower.get("status") or {}
    if status.get("phase") not in FINISHED:
        return True
    began = parse_time(deleted) - timedelta(seconds=metadata.get("deletionGracePeriodSeconds") or 0)
    for field in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(field) or []:
            ended = (container.get("state") or {}).get("terminated")
            if ended is None:
                continue
            finished_at = ended.get("finishedAt")
            if not finished_at or parse_time(finished_at) >= began - _DELETION_CLOCK_SLACK:
                return True
    return False


def _ran(removed: Mapping[str, Any] | None, upper: Mapping[str, Any]) -> bool:
    """Whether the lower pod last seen removed was this upper pod's, and a node below had
    taken it (or it had finished)."""
    if removed is None or not made_from(removed, upper):
        return False
    status = removed.get("status") or {}
    return bool(status.get("hostIP")) or status.get("phase") in FINISHED


def namespace_is_gone(error: ApiError) -> bool:
    """A create refused because its namespace does not exist (404 about the namespace)
    or is being deleted (403 with the cause NamespaceTerminating)."""
    details = error.body.get("details") if isinstance(error.body, dict) else None
    if not isinstance(details, dict):
        return False
    if error.status == 404:
        return details.get("kind") == "namespaces"
    causes = details.get("causes")
    return isinstance(causes, list) and any(
        isinstance(cause, dict) and cause.get("reason") == "NamespaceTerminating"
        for cause in causes
    )


class NotCopied(Exception):
    """Something a pod needs is not made below; the pod waits, saying ``reason`` and the
    message."""

    reason = "DependencyNotMirrored"


class NameTaken(NotCopied):
    """A pod's ConfigMap, Secret, ServiceAccount or claim has a namesake below that is not
    ours; the message says which."""

    reason = "LowerNameTaken"


class ClaimNotCopied(NotCopied):
    """A pod's claim asks for a volume made by hand above, which no copy below may stand
    for."""

    reason = "ClaimNotMirrored"


class PodDependencies(Protocol):
    async def ensure_for_pod(self, pod: Mapping[str, Any]) -> None:
        """The copies ``pod`` needs, made or brought up to date below; raises NotCopied."""
        ...


class LowerCluster:
    """Implements NodeProvider (reachability, capacity, labels) and PodBackend (mirroring)
    over one watch cache per kind of the lower cluster."""

    def __init__(
        self,
        client: KubeClient,
        pods: Informer,
        nodes: Informer,
        owner: Ownership,
        mapping: NamespaceMapping,
        host_ip: str,
        dependencies: PodDependencies | None = None,
        held_node: Callable[[str], str | None] | None = None,
        largest_free_slot: Callable[[Collection[str]], tuple[str, Mapping[str, int]] | None]
        | None = None,
        counted_taint_keys: frozenset[str] = frozenset(),
        host_access_namespaces: frozenset[str] = frozenset(),
        heartbeat: KubeClient | None = None,
        outside_slices: Callable[[str], str | None] | None = None,
        stash_unguarded: Callable[[Mapping[str, Any]], str | None] = lambda _pod: None,
    ) -> None:
        self.client = client
        # Why the webhook does not guard an upper pod's stash, or None when it does.
        self.stash_unguarded = stash_unguarded
        # The ping's client, when it is not ``client``: one whose requests wait for no
        # token (the kubelet's heartbeat client).
        self.heartbeat = heartbeat or client
        self.pods = pods
        self.nodes = nodes
        self.owner = owner
        self.mapping = mapping
        self.host_ip = host_ip
        self.dependencies = dependencies
        # Upper pod UID -> the lower node the fit estimator holds room on for it.
        self.held_node = held_node
        # The fit estimator's view of the roomiest lower node, in-flight pods counted.
        self.largest_free_slot = largest_free_slot
        # Lower nodes tainted (NoSchedule, NoExecute) only with these still count above.
        self.counted_taint_keys = counted_taint_keys
        # Upper namespaces whose pods may use the lower nodes' host (privileged, host
        # namespaces, hostPath, host ports); others' such pods are not created below.
        self.host_access_namespaces = host_access_namespaces
        # Why a new pod of an upper namespace is not made here: its quota's slices are
        # elsewhere (slices.bound_outside_slices), or None.
        self.outside_slices = outside_slices
        self.version = ""
        # As the last ping found it: a lower cluster that cannot be reached is not
        # mirrored (its pods' last statuses are no news; the node controller above marks
        # them not ready) until it answers again and every upper pod is resynced.
        self.reachable = True
        self.changed = asyncio.Event()
        # Namespaces made below (or being made), and those where `default` exists: a
        # burst of pods into a new namespace waits for one request, not one per worker.
        self._namespaces: dict[str, asyncio.Future[None]] = {}
        self._default_accounts: dict[str, asyncio.Future[None]] = {}
        # What each lower pod takes (ours marked), kept by the pod handler: a report sums this
        # table (never running totals that could drift) instead of decoding every pod.
        self._usage: dict[str, PodUsage] = {}
        # lower key -> upper key of each pod of ours below, kept by the same handler, so
        # the orphan sweep decodes no pod (it decoded 10,000 on the event loop a minute).
        self._mirrored: dict[str, str] = {}
        # The same the other way (upper key -> lower key): one made under an earlier
        # namespace mapping is found where it is.
        self._mirrors: dict[str, str] = {}
        # upper key -> our lower pod as its removal showed it, until the upper pod's next
        # sync passes it by or the upper pod is gone (its deletion's last status).
        self._removed: dict[str, JSON] = {}
        metrics.MIRRORED_PODS.set_function(lambda: len(self._mirrored))
        pods.add_handler(
            FunctionHandler(
                add=self._pod_changed,
                update=self._pod_changed,
                delete=self._pod_deleted,
            )
        )
        nodes.add_handler(FunctionHandler.on_any(lambda _node: self.changed.set()))
        # quota key -> what it caps (quotas.quota_caps), once the quotas are watched.
        self._quota_caps: dict[str, str] = {}
        self._quota_changes = 0
        self._quotas_watched = False

    def watch_quotas(self, quotas: Informer) -> None:
        """The report carries what the quotas cap (a Node annotation): a quota raised or
        removed changes the Node, on which the upper scheduler retries the pods the
        extender failed."""
        self._quotas_watched = True
        quotas.add_handler(
            FunctionHandler(
                add=self._quota_changed, update=self._quota_changed, delete=self._quota_deleted
            )
        )

    def _quota_changed(self, quota: JSON) -> None:
        caps = quota_caps(quota)
        if self._quota_caps.get(object_key(quota)) != caps:
            self._quota_caps[object_key(quota)] = caps
            self._quota_changes += 1
            self.changed.set()

    def _quota_deleted(self, quota: JSON) -> None:
        if self._quota_caps.pop(object_key(quota), None) is not None:
            self._quota_changes += 1
            self.changed.set()

    def _pod_changed(self, pod: JSON) -> None:
        key = object_key(pod)
        self._set_usage(key, pod_usage(pod, self.owner.owns))
        upper_key = self.upper_key(pod)
        if upper_key is None:
            self._forget_mirror(key)
        else:
            self._mirrored[key] = upper_key
            self._mirrors[upper_key] = key
            self._slot_changed()

    def _pod_deleted(self, pod: JSON) -> None:
        key = object_key(pod)
        self._set_usage(key, None)
        upper_key = self._forget_mirror(key)
        if upper_key is not None:
            self._removed[upper_key] = pod
            self._slot_changed()

    def _forget_mirror(self, lower_key: str) -> str | None:
        upper_key = self._mirrored.pop(lower_key, None)
        if upper_key is not None and self._mirrors.get(upper_key) == lower_key:
            del self._mirrors[upper_key]
        return upper_key

    def _slot_changed(self) -> None:
        # Our own pods change no capacity above, but the room left on each lower node.
        if self.largest_free_slot is not None:
            self.changed.set()

    def _set_usage(self, key: str, usage: PodUsage | None) -> None:
        if self._usage.get(key) == usage:
            return
        if usage is None:
            del self._usage[key]
        else:
            self._usage[key] = usage
        self.changed.set()

    def watch_mirrored_pods(self, queue: WorkQueue[str]) -> None:
        """Changes of our lower pods wake the upper pod's key."""

        def enqueue(pod: JSON) -> None:
            key = self.upper_key(pod)
            if key is not None:
                queue.add(key)

        self.pods.add_handler(FunctionHandler.on_any(enqueue))

    def upper_key(self, lower: Mapping[str, Any]) -> str | None:
        if not self.owner.owns(lower):
            return None
        metadata = lower["metadata"]
        namespace = (metadata.get("annotations") or {}).get(keys.UPPER_NAMESPACE_ANNOTATION)
        return f"{namespace}/{metadata['name']}" if namespace else None

    def lower_key(self, upper_key: str) -> str:
        namespace, name = upper_key.split("/", 1)
        return f"{self.mapping.lower(namespace)}/{name}"

    def made_under_another_mapping(self, running: Callable[[str], bool]) -> list[tuple[str, str]]:
        """Those of our pods below made under another namespace mapping whose upper pod
        is ``running`` (there, not finished): the others are the orphan sweep's."""
        return [
            (lower_key, upper_key)
            for lower_key, upper_key in made_under_another_mapping(self._mirrored, self.mapping)
            if running(upper_key)
        ]

    # -- NodeProvider ----------------------------------------------------------------------

    async def ping(self) -> bool:
        """Whether the lower apiserver is ready (up to ``PING_ATTEMPTS`` tries within
        ``PING_DEADLINE_SECONDS``): /version alone answers with its etcd down, when it
        can neither create nor report a pod."""
        try:
            async with asyncio.timeout(PING_DEADLINE_SECONDS):
                version = await self._ping_tries()
        except API_ERRORS as error:  # TimeoutError among them
            log.debug("lower cluster %s: %s", self.owner.cluster_id, error)
            self.reachable = False
            return False
        self.version = str(version.get("gitVersion", ""))
        self.reachable = True
        return True

    async def _ping_tries(self) -> JSON:
        for _ in range(PING_ATTEMPTS - 1):
            try:
                return await self._ready_version()
            except API_ERRORS as error:
                log.info(
                    "lower cluster %s did not answer (%s); trying again",
                    self.owner.cluster_id,
                    error,
                )
                await asyncio.sleep(PING_PAUSE_SECONDS)
        return await self._ready_version()

    async def _ready_version(self) -> JSON:
        # No wait the apiserver names: the deadline is the Lease's.
        await self.heartbeat.get_text(
            "/readyz", timeout=PING_REQUEST_SECONDS, retry_when_told=False
        )
        version: JSON = await self.heartbeat.request(
            "GET", "/version", timeout=PING_REQUEST_SECONDS, retry_when_told=False
        )
        if not isinstance(version, dict):
            raise ApiError(
                502, f"the version is not an object: {version!r:.200}", "GET", "/version"
            )
        return version

    def report(self, reachable: bool) -> NodeReport:
        nodes = list(self.nodes.items())
        free = free_capacity(nodes, self._usage.values(), self.counted_taint_keys)
        slot = (
            self.largest_free_slot(self.counted_taint_keys)
            if self.largest_free_slot is not None
            else None
        )
        return NodeReport(
            ready=reachable,
            allocatable=as_resource_list(free),
            labels=shared_labels(nodes, self.counted_taint_keys),
            kubelet_version=self.version,
            nodes_digest=nodes_digest(nodes),
            quotas_digest=quotas_digest(self._quota_caps.values(), self._quota_changes)
            if self._quotas_watched
            else "",
            largest_free_slot=free_slot(*slot) if slot is not None else {},
        )

    # -- PodBackend ------------------------------------------------------------------------

    def mirror_version(self, upper_key: str) -> str | None:
        try:
            return self.pods.resource_version_of(self.lower_key(upper_key))
        except NamingError:
            return None

    async def sync(self, upper: Mapping[str, Any]) -> SyncResult:
        if not self.reachable:
            return Waiting()  # what a removal left is kept for the reconcile once back
        # Read, not taken: the status written from it may fail, or lose a race, and the
        # next try needs it again (taken, that try found the pod gone and had it deleted
        # as lost). Dropped once the upper pod has ended, or runs below again.
        upper_key = object_key(upper)
        removed = self._removed.get(upper_key)
        try:
            desired = desired_lower_pod(upper, self.mapping, self.owner, self.stash_unguarded)
        except (TranslationError, NamingError) as error:
            running = self._mirror_of(upper)
            if running is None and isinstance(error, StashNotGuarded):
                # Tried again: the namespace's labels may not be in the cache yet (made
                # just before its pod, relabelled), and failed for good, a bare pod is lost.
                return Refused(keys.STASH_NOT_GUARDED, str(error))
            if running is None:
                return Rejected(keys.TRANSLATION_FAILED, str(error))
            # Made below already (its stash annotation edited since, say): it runs on as
            # it is, its status still mirrored, as a kubelet does not judge a running pod
            # again; failing it above would leave it running below beside its
            # replacement.
            log.warning(
                "pod %s/%s: no longer translated, left as it runs below: %s",
                upper["metadata"]["namespace"],
                upper["metadata"]["name"],
                error,
            )
            return Mirrored(upper_status(running, upper, self.host_ip), resource_version(running))
        namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
        lower = self.pods.get(f"{namespace}/{name}")
        finished = (upper.get("status") or {}).get("phase") in FINISHED
        if lower is None:
            if finished:
                self._removed.pop(upper_key, None)
                return Waiting()  # never run again
            if (upper.get("status") or {}).get("hostIP") or _ran(removed, upper):
                # It ran below before (the status saying so may not have come up yet: our
                # write lost a race, the upper apiserver was down); the cache may only
                # lag behind our own create. Made again, a pod that ran would run twice.
                lower = await self._get_live(namespace, name)
                if lower is None:
                    mine = removed if removed is not None and made_from(removed, upper) else None
                    if (
                        mine is not None
                        and (mine.get("status") or {}).get("phase") in FINISHED
                        and not ended_by_its_deletion(mine)
                    ):
                        # Finished, then removed below (a TTL, the pod GC) before its
                        # last status came up: it ends above as it ended there.
                        return Mirrored(upper_status(mine, upper, self.host_ip), "")
                    gone = f"pod {namespace}/{name} is gone from lower cluster"
                    return Vanished(
                        f"{gone} {self.owner.cluster_id}",
                        # Its last update (the exit codes) and its removal often land in
                        # one reconcile.
                        None if mine is None else upper_status(mine, upper, self.host_ip),
                    )
            else:
                self._removed.pop(upper_key, None)
                refused = (
                    self._refused_namespace(upper)
                    or self._refused_host_access(upper, desired)
                    or _refused_volume(desired)
                    or await self._refused_outside_slices(upper, namespace, name)
                )
                return refused or await self._create(upper, desired)
        if not self.owner.owns(lower):
            return Rejected(
                keys.NAME_CONFLICT,
                f"pod {namespace}/{name} already exists in lower cluster {self.owner.cluster_id} "
                "and was not created by this virtual node; it is left alone",
            )
        if not made_from(lower, upper):
            # Left by an earlier upper pod of the same name: it goes before ours is made.
            await self.client.delete_exact(PODS, lower, grace_period_seconds=0)
            return Waiting()
        self._removed.pop(upper_key, None)
        if lower["metadata"].get("deletionTimestamp"):
            if not ended_by_its_deletion(lower):
                # Finished, then cleaned up below: it ends above as it ended there (a
                # controlled pod deleted for it, a Job's finished pod went with its logs).
                if finished:
                    return Waiting()
                return Mirrored(upper_status(lower, upper, self.host_ip), resource_version(lower))
            return EndingBelow(
                upper_status(lower, upper, self.host_ip),
                lower["metadata"].get("deletionGracePeriodSeconds"),
                f"pod {namespace}/{name} is being deleted in lower cluster {self.owner.cluster_id}",
            )
        refusals = []
        retry = False
        debug = ephemeral_containers_patch(upper, lower)
        if debug is not None and (refused := self._refused_host_access(upper, debug)):
            refusals.append(f"ephemeral containers not added below: {refused.message}")
            debug = None
        if debug is not None and self.dependencies is not None:
            # What a debug container refers to is copied first, as for the pod: with a
            # namesake below not ours, the container would read someone else's Secret.
            # A quota or policy below refusing a copy holds back the container (tried
            # again later), not the pod's status.
            why = None
            try:
                await self.dependencies.ensure_for_pod(upper)
            except NotCopied as error:
                why = str(error)
            except API_ERRORS as error:
                # Whatever keeps the container's needs from being copied now (until
                # 2026-11-29 all but a 403 was raised, and the pod's status, its end
                # included, was no longer mirrored while a debug container waited).
                why = (
                    f"lower cluster {self.owner.cluster_id} refused what they need: {error.message}"
                    if isinstance(error, ApiError) and error.status in _PATCH_REFUSED
                    else f"what they need was not copied below: {error}"
                )
            if why is not None:
                refusals.append(f"ephemeral containers not added below: {why}")
                retry = True
                debug = None
        resize = resize_patch(lower, desired)
        resize_deferred = None
        for patch, subresource in (
            (lower_pod_patch(lower, desired, resize_pending=resize is not None), ""),
            (resize, "resize"),
            (debug, "ephemeralcontainers"),
        ):
            if patch is not None:
                lower, refusal, again = await self._patch(lower, patch, subresource)
                if refusal is not None:
                    refusals.append(refusal)
                    retry = retry or again
                if subresource == "resize" and again:
                    resize_deferred = refusal
                elif subresource == "resize":
                    # Made, or refused for good: not asked for again on the next sync.
                    lower, _, _ = await self._patch(
                        lower, resources_record_patch(desired, refusal), ""
                    )
        # A finished pod takes no change: nothing to try again for.
        done = (lower.get("status") or {}).get("phase") in FINISHED
        status = upper_status(lower, upper, self.host_ip)
        if not done:
            status = with_resize_refusal(
                status, lower, desired, upper, resize_deferred, now_rfc3339()
            )
        return Mirrored(status, resource_version(lower), tuple(refusals), retry and not done)

    def _mirror_of(self, upper: Mapping[str, Any]) -> JSON | None:
        """The lower pod made from this very upper pod, if any."""
        metadata = upper["metadata"]
        try:
            lower = self.pods.get(self.lower_key(f"{metadata['namespace']}/{metadata['name']}"))
        except NamingError:
            return None
        if lower is None or not self.owner.owns(lower):
            return None
        return lower if made_from(lower, upper) else None

    def _refused_namespace(self, upper: Mapping[str, Any]) -> Rejected | None:
        why = self.mapping.refusal(upper["metadata"]["namespace"])
        return None if why is None else Rejected(keys.LOWER_NAMESPACE_REFUSED, why)

    async def _refused_outside_slices(
        self, upper: Mapping[str, Any], namespace: str, name: str
    ) -> Rejected | Waiting | None:
        """A pod its creator bound here outside its namespace's slices. Not one that is
        PodScheduled: a scheduler's binding says so (the extender has judged the pod, on
        records that may be newer than ours: a quota just removed, slices just placed
        here), and so do we once it runs below. (PodScheduled False is ours: refused below
        for now, the pod is judged again at each try.) A rejection is for good: so not
        while a copy is below already (our create's answer lost, the cache behind)."""
        conditions = (upper.get("status") or {}).get("conditions") or []
        if self.outside_slices is None or any(
            c.get("type") == "PodScheduled" and c.get("status") == "True" for c in conditions
        ):
            return None
        why = self.outside_slices(upper["metadata"]["namespace"])
        if why is None:
            return None
        if await self._get_live(namespace, name) is not None:
            return Waiting()  # its watch event brings the pod back here
        return Rejected(keys.OUTSIDE_QUOTA_SLICES, why)

    def _refused_host_access(self, upper: Mapping[str, Any], desired: JSON) -> Rejected | None:
        why = host_access_refusal(
            desired["spec"],
            upper["metadata"]["namespace"],
            self.host_access_namespaces,
            self.owner.cluster_id,
        )
        return None if why is None else Rejected(keys.HOST_ACCESS_REFUSED, why)

    async def _patch(
        self, lower: JSON, patch: JSON, subresource: str
    ) -> tuple[JSON, str | None, bool]:
        """The lower pod patched; or as it was, with why and whether it is worth trying
        again later, when the lower apiserver refuses the change (the pod runs on as it
        is, its status still mirrored, as a kubelet's status does not wait for one
        operation)."""
        namespace, name = lower["metadata"]["namespace"], lower["metadata"]["name"]
        try:
            patched = await self.client.patch(
                PODS, name, patch, namespace, subresource=subresource, patch_type=_SMP
            )
            return patched, None, False
        except ApiError as error:
            # 403: an admission plugin (Pod Security on a debug container, a quota on a
            # resize). A subresource an older lower apiserver does not serve is as final
            # (a 404 of the pod itself comes with the watch event of its removal).
            if error.status not in _PATCH_REFUSED and not (subresource and error.status == 404):
                raise
            what = {"": "update", "resize": "resize", "ephemeralcontainers": "debug container"}
            refusal = (
                f"lower cluster {self.owner.cluster_id} refused the pod's "
                f"{what.get(subresource, subresource)}: {error.message}"
            )
            log.warning("lower pod %s/%s: %s", namespace, name, refusal)
            # A quota may have room later for a resize; an invalid change never becomes
            # valid, nor does a debug container Pod Security forbids (they ask no room).
            return lower, refusal, error.status == 403 and subresource != "ephemeralcontainers"

    async def _create(self, upper: Mapping[str, Any], desired: JSON) -> SyncResult:
        namespace = desired["metadata"]["namespace"]
        account = desired["spec"].get("serviceAccountName") or DEFAULT_SERVICE_ACCOUNT
        try:
            # A policy below may refuse the namespace or its account as well as the copies.
            await self.ensure_namespace(namespace)
            if account == DEFAULT_SERVICE_ACCOUNT:
                await self._ensure_default_service_account(namespace)
            if self.dependencies is not None:
                await self.dependencies.ensure_for_pod(upper)
        except NotCopied as error:
            # Made once the namesake is gone (the claim made again); until then the pod
            # says why it waits.
            return Refused(error.reason, str(error))
        except ApiError as error:
            if namespace_is_gone(error):
                # Deleted below since we made it: made again on the retry.
                self.forget_namespace(namespace)
            # A policy denying with no code of its own answers 400: until 2026-11-29 only a
            # 403 was said, and the pod waited with no word, tried again for good.
            if error.status in _PATCH_REFUSED:
                return Refused(
                    "LowerClusterRefused",
                    f"lower cluster {self.owner.cluster_id} refused what the pod needs: "
                    f"{error.message}",
                )
            raise
        if self.held_node is not None and not left_unpinned(desired["spec"]):
            node = self.held_node(upper["metadata"]["uid"])
            if node is not None:
                desired = pinned_to(desired, node)
        try:
            created = await self.client.create(PODS, desired, namespace)
        except ApiError as error:
            if error.status == 409:
                raise  # exists after all: the next round sees it in the cache
            if namespace_is_gone(error):
                # Deleted below since we made it: made again on the retry.
                self.forget_namespace(namespace)
            message = f"lower cluster {self.owner.cluster_id} refused the pod: {error.message}"
            if error.status in _PERMANENT:
                return Rejected(keys.LOWER_CLUSTER_REJECTED, message)
            if error.status == 403:
                return Refused("LowerClusterRefused", message)
            raise
        return Mirrored(upper_status(created, upper, self.host_ip), resource_version(created))

    async def ensure_namespace(self, namespace: str) -> None:
        await _once(self._namespaces, namespace, lambda: self._make_namespace(namespace))

    async def _make_namespace(self, namespace: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": namespace,
                "labels": self.owner.namespace_labels(),
            },
        }
        try:
            await self.client.create(NAMESPACES, body)
        except ApiError as error:
            if error.status != 409:
                raise

    async def _ensure_default_service_account(self, namespace: str) -> None:
        """The lower controllers make `default` in every namespace, but admission refuses
        a pod in a namespace just made until they have. Made here as they make it, so not
        ours: never updated or removed (other service accounts are reflected)."""
        await _once(
            self._default_accounts, namespace, lambda: self._make_default_account(namespace)
        )

    async def _make_default_account(self, namespace: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": DEFAULT_SERVICE_ACCOUNT, "namespace": namespace},
        }
        try:
            await self.client.create(SERVICEACCOUNTS, body, namespace)
        except ApiError as error:
            if namespace_is_gone(error):
                self.forget_namespace(namespace)
            if error.status != 409:
                raise

    def forget_namespace(self, namespace: str) -> None:
        """A namespace made here is gone: the next pod in it makes it again."""
        self._namespaces.pop(namespace, None)
        self._default_accounts.pop(namespace, None)

    async def _get_live(self, namespace: str, name: str) -> JSON | None:
        try:
            return await self.client.get(PODS, name, namespace)
        except ApiError as error:
            if is_not_found(error):
                return None
            raise

    async def delete(self, upper: Mapping[str, Any]) -> JSON | Gone:
        metadata = upper["metadata"]
        if not self.reachable:
            # Its status stays the node controller's (not ready) until the cluster is
            # back, when every pod is reconciled again.
            return dict(upper.get("status") or {})
        # Read, not taken: kept until the upper pod is gone (remove_orphan), as the
        # terminal status written from it may lose a race and this runs again.
        removed = self._removed.get(object_key(upper))
        try:
            namespace = self.mapping.lower(metadata["namespace"])
        except NamingError:
            return Gone()  # no lower pod was ever made for it
        lower = self.pods.get(f"{namespace}/{metadata['name']}") or await self._get_live(
            namespace, metadata["name"]
        )
        if lower is None or not self.owner.owns(lower) or not made_from(lower, upper):
            if removed is not None and made_from(removed, upper):
                return Gone(upper_status(removed, upper, self.host_ip))
            return Gone()
        grace = upper["metadata"].get("deletionGracePeriodSeconds")
        if deletion_due(lower, grace):
            await self.client.delete_exact(PODS, lower, grace_period_seconds=grace)
        # Gone once the lower informer reports the delete, which wakes this key again.
        return upper_status(lower, upper, self.host_ip)

    async def remove_orphan(self, upper_key: str, grace_period_seconds: int | None) -> None:
        gone_below = self._removed.pop(upper_key, None) is not None
        try:
            lower_key = self._mirrors.get(upper_key) or self.lower_key(upper_key)
        except NamingError:
            return
        lower = self.pods.get(lower_key)
        if lower is None and grace_period_seconds is not None and not gone_below:
            # Deleted above with a grace of its own (a force delete's 0) while our create
            # may not have reached the cache yet: found later by a sweep, the lower pod
            # would be given its own grace instead.
            namespace, _, name = lower_key.partition("/")
            lower = await self._get_live(namespace, name)
        if (
            lower is not None
            and self.owner.owns(lower)
            and deletion_due(lower, grace_period_seconds)
        ):
            log.info("removing orphan lower pod %s", lower_key)
            await self.client.delete_exact(PODS, lower, grace_period_seconds=grace_period_seconds)

    def orphan_keys(self, upper_keys: set[str]) -> list[str]:
        """Upper keys of our lower pods whose upper pod does not exist."""
        return [key for key in self._mirrored.values() if key not in upper_keys]


def _refused_volume(desired: Mapping[str, Any]) -> Rejected | None:
    for volume in (desired.get("spec") or {}).get("volumes") or []:
        if what := hand_made_template(volume):
            return Rejected(keys.VOLUME_REFUSED, hand_made_refusal(what))
    return None


async def _once(
    made: dict[str, asyncio.Future[None]], key: str, make: Callable[[], Awaitable[None]]
) -> None:
    """Runs ``make`` for ``key`` until it has succeeded once. Callers that come while it
    runs wait for that same attempt; a failed attempt is forgotten, so the next caller
    tries again. A caller cancelled meanwhile leaves the attempt to the others."""
    attempt = made.get(key)
    if attempt is None:
        attempt = made[key] = asyncio.ensure_future(make())
        attempt.add_done_callback(functools.partial(_forget_failed, made, key))
    await asyncio.shield(attempt)


def _forget_failed(
    made: dict[str, asyncio.Future[None]], key: str, attempt: asyncio.Future[None]
) -> None:
    if (attempt.cancelled() or attempt.exception() is not None) and made.get(key) is attempt:
        del made[key]
