"""Keeps the virtual Node registered, its Lease renewed and its status current.

Generic kubelet machinery (virtual-kubelet's node controller): what the Node says comes
from a NodeProvider; this module only talks to the upper apiserver.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from kubekit import keys
from kubekit.client import (
    API_ERRORS,
    LEASES,
    NODES,
    ApiError,
    KubeClient,
    is_conflict,
    is_not_found,
)
from kubekit.loops import run_together
from kubekit.timestamps import now_micro
from virtual_node.node import (
    NodeIdentity,
    NodeReport,
    keys_record,
    labels_of_others,
    labels_to_set,
    lease,
    node_labels,
    node_status,
    recorded_label_keys,
    recorded_resource_keys,
    registration,
    registration_patch,
    report_annotations,
    status_changed,
    status_patch,
    with_not_started_taint,
    without_foreign_resources,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

LEASE_INTERVAL_SECONDS = 10.0
# An admission webhook's refusal (400 unless it says), a policy's (403, 422).
REFUSED_STATUSES = frozenset({400, 403, 422})
# A renewal waits this long at most (the kubelet's heartbeat client: min(10 s, the lease's
# duration)), and one that failed is tried again this soon: a request hung on a dead
# connection for the client's usual 60 s would outlast the 40 s Lease, and the upper node
# controller would taint the Node and take its pods off their Services' endpoints.
LEASE_REQUEST_TIMEOUT_SECONDS = 10.0
LEASE_RETRY_SECONDS = 2.0
# How long a start (the serving certificate, then the caches' first sync) may take before
# the Node of an earlier run is tainted not-started: one that never ends (a kind the lower
# RBAC refuses, listed for ever) kept it Ready with its old status while nothing was
# mirrored, and the upper scheduler bound pods to it that never ran. Its Lease is still
# renewed: let lapse, the Node would be tainted unreachable and every pod evicted.
START_LIMIT_SECONDS = 300.0
STATUS_INTERVAL_SECONDS = 60.0
# Changes arriving close together become one status update.
STATUS_COALESCE_SECONDS = 1.0
# The least pause after a status not sent (an error, an unreachable lower cluster):
# the heartbeat it owed is due already, and would be tried again at once, for ever.
STATUS_RETRY_SECONDS = 5.0
REGISTER_ATTEMPTS = 5

_SMP = "application/strategic-merge-patch+json"


class NodeProvider(Protocol):
    """The backend's side of the Node: reachability and what it can run."""

    changed: asyncio.Event

    async def ping(self) -> bool: ...

    def report(self, reachable: bool) -> NodeReport: ...


class NodeController:
    def __init__(
        self,
        upper: KubeClient,
        identity: NodeIdentity,
        provider: NodeProvider,
        on_reachable: Callable[[], None] | None = None,
    ) -> None:
        self.upper = upper
        self.identity = identity
        self.provider = provider
        self.reachable = False
        self._node_uid = ""
        self._last_status: dict[str, object] = {}
        self._reachability_changed = asyncio.Event()
        self._last_sent = 0.0
        self._next_status_at = 0.0
        self._annotations: dict[str, str] = {}  # as last sent
        # What we last sent no longer says what the Node holds: read it before the next
        # status (the upper node controller marks the conditions Unknown while we are
        # silent, with a transition time of its own).
        self._status_unknown = False
        self._labels: dict[str, str] = {}  # as last sent, or found at registration
        # Labels the lower nodes share that the Node held with a value we did not set (a
        # user's), with the lower nodes' value we left: the Node is read again for such a
        # key only once that value changes.
        self._labels_of_others: dict[str, str] = {}
        # The resources we advertised that may be on the Node still (a former run's, as
        # recorded on it): only those are ever written as null.
        self._resource_keys: set[str] = set()
        # Whether the Node was cordoned when last seen: one deleted then (cordon, drain,
        # delete, the usual way to retire a node) is made again cordoned, not open to
        # new pods.
        self._cordoned = False
        # Called once the Node is Ready again after its lower cluster was unreachable.
        self.on_reachable = on_reachable
        self._reachable_unannounced = False
        # When the start should be over by (loop time), and whether the Node was tainted
        # for a start that was not.
        self._started_by: float | None = None
        self._not_started_told = False
        self._tainting: asyncio.Future[None] | None = None

    async def renewing_lease_while(self, work: Awaitable[T]) -> T:
        """Awaits ``work`` (the serving certificate, the caches' first sync) renewing the
        Lease of a Node that is registered already (a restart, a standby taking over):
        the kubelet renews its Lease apart from its pods, and a start longer than the
        Lease's 40 s would have the upper node controller mark the Node not ready, taint
        it unreachable and take every pod off its Services' endpoints. A Node not there
        yet waits for the sync: what it registers with comes from the caches."""
        # Beside the work, not in turn with it: a renewal (a ping of an unreachable lower
        # cluster takes its whole 10 s) holds the start back no longer than the work.
        if self._started_by is None:
            # One limit for the whole start, however many steps it takes.
            self._started_by = asyncio.get_running_loop().time() + START_LIMIT_SECONDS
        renewing = asyncio.create_task(self._renew_registered(self._started_by))
        try:
            return await work
        finally:
            renewing.cancel()
            if self._tainting is not None:
                # Sent, the patch may land after the registration that takes the taint
                # off has read the Node: it stayed for good. It ends first.
                await asyncio.wait({self._tainting})

    async def _renew_registered(self, started_by: float) -> None:
        while True:
            try:
                if not self._node_uid:
                    existing = await self.upper.request(
                        "GET",
                        NODES.path(None, self.identity.name),
                        timeout=LEASE_REQUEST_TIMEOUT_SECONDS,
                    )
                    self._node_uid = existing["metadata"]["uid"]
                if await self.provider.ping():
                    await self.renew_lease()
                if not self._not_started_told and asyncio.get_running_loop().time() > started_by:
                    self._tainting = asyncio.ensure_future(self._taint_not_started())
                    await asyncio.shield(self._tainting)
            except API_ERRORS as error:
                if is_not_found(error) and not self._node_uid:
                    return
                log.warning("lease of %s not renewed: %s", self.identity.name, error)
            await asyncio.sleep(LEASE_INTERVAL_SECONDS)

    async def _taint_not_started(self) -> None:
        node = await self.upper.get(NODES, self.identity.name)
        patch = with_not_started_taint(node)
        if patch is not None:
            await self.upper.patch(NODES, self.identity.name, patch)
        self._not_started_told = True
        log.error(
            "virtual node %s has not started in %.0f s: tainted %s so that nothing new is "
            "bound to it until it has",
            self.identity.name,
            START_LIMIT_SECONDS,
            keys.NOT_STARTED_TAINT_KEY,
        )

    async def run(self) -> None:
        self.reachable = await self.provider.ping()
        await self.register()
        await run_together(self._lease_loop(), self._status_loop())

    async def register(self) -> None:
        for attempt in range(1, REGISTER_ATTEMPTS + 1):
            try:
                await self._register_once()
                break
            except ApiError as error:
                # The Node changed between our read and our conditional patch (the node
                # controller's taints, the old leader's last status), or was made by
                # another: read again.
                if not is_conflict(error) or attempt == REGISTER_ATTEMPTS:
                    raise
                log.info("node %s changed while registering; read again", self.identity.name)
        await self.update_status(force=True)

    async def _register_once(self) -> None:
        report = self.provider.report(self.reachable)
        try:
            await self._register_with(report)
        except ApiError as error:
            if error.status not in REFUSED_STATUSES or not report.labels:
                raise
            # A label of the lower nodes an upper admission policy refuses would keep
            # the Node from registering at every start; the status update tries the
            # labels again and goes on without them when refused. A new Node gets the
            # OS and the architecture (defaulted, pods would be placed on a wrong one),
            # one there keeps the labels it has (taken off, the shared ones the refusal
            # held back would stay off).
            log.warning(
                "node %s not registered with its lower nodes' labels (%s); registering "
                "without them",
                self.identity.name,
                error,
            )
            platform = {
                k: v for k, v in report.labels.items() if k in (keys.OS_LABEL, keys.ARCH_LABEL)
            }
            await self._register_with(dataclasses.replace(report, labels=platform), True)

    async def _register_with(self, report: NodeReport, keep_labels: bool = False) -> None:
        try:
            existing = await self.upper.get(NODES, self.identity.name)
        except ApiError as error:
            if not is_not_found(error):
                raise
            created = await self.upper.create(
                NODES, registration(self.identity, report, self._cordoned)
            )
            log.info(
                "registered node %s%s",
                self.identity.name,
                " cordoned, as it was when deleted" if self._cordoned else "",
            )
            self._node_uid = created["metadata"]["uid"]
            self._seen(created)
            # A Node made again (deleted meanwhile) has none of what we sent the last:
            # nor its conditions' transition times.
            self._annotations = {}
            self._last_status = created.get("status") or {}
            self._resource_keys = set(report.allocatable)
            self._labels = node_labels(self.identity, report)
            self._labels_of_others = {}
        else:
            if keep_labels:
                report = dataclasses.replace(report, labels={})
            wanted = labels_to_set(existing, self.identity, report)
            self._labels_of_others = {
                k: v for k, v in node_labels(self.identity, report).items() if k not in wanted
            }
            self._log_labels_of_others(self._labels_of_others)
            patch = registration_patch(existing, self.identity, report)
            if patch:
                existing = await self.upper.patch(NODES, self.identity.name, patch)
            self._node_uid = existing["metadata"]["uid"]
            self._seen(existing)
            self._last_status = existing.get("status") or {}
            self._resource_keys = recorded_resource_keys(existing)
            self._annotations = dict(existing["metadata"].get("annotations") or {})
            self._labels = wanted
            if not report.labels:
                # Registered while no lower node counted, the labels a former run set
                # stayed: counted as ours, the next update takes off those the lower
                # nodes no longer share.
                have = existing["metadata"].get("labels") or {}
                kept = recorded_label_keys(existing) & set(have)
                self._labels = {**self._labels, **{k: have[k] for k in kept}}
        self._status_unknown = False

    async def _lease_loop(self) -> None:
        lease_failed = False
        while True:
            try:
                reachable = await self.provider.ping()
                if reachable != self.reachable:
                    log.warning(
                        "lower cluster %s %s",
                        self.identity.cluster_id,
                        "reachable again" if reachable else "unreachable",
                    )
                    self.reachable = reachable
                    self._reachable_unannounced = reachable
                    self._reachability_changed.set()
                # An unreachable lower cluster lets the lease lapse, so the upper node
                # controller marks the Node NotReady and evicts by its normal path.
                if reachable:
                    await self.renew_lease()
            except API_ERRORS as error:
                log.warning("lease of %s not renewed: %s", self.identity.name, error)
                lease_failed = True
                await asyncio.sleep(LEASE_RETRY_SECONDS)
                continue
            if lease_failed and reachable:
                # The upper node controller may have marked the Node Unknown meanwhile,
                # and a renewed Lease does not make it Ready: the status does.
                lease_failed = False
                self._reachability_changed.set()
            await asyncio.sleep(LEASE_INTERVAL_SECONDS)

    async def renew_lease(self) -> None:
        try:
            await self.upper.patch(
                LEASES,
                self.identity.name,
                {
                    "spec": {
                        "holderIdentity": self.identity.name,
                        "renewTime": now_micro(),
                    }
                },
                keys.NODE_LEASE_NAMESPACE,
                timeout=LEASE_REQUEST_TIMEOUT_SECONDS,
            )
        except ApiError as error:
            if not is_not_found(error):
                raise
            # The Lease goes with its Node: a `kubectl delete node` is seen here, within
            # a renewal, rather than at the next heartbeat up to a minute on, by when the
            # upper pod GC may have deleted the pods bound to a Node that is not there.
            try:
                await self.upper.get(NODES, self.identity.name)
            except ApiError as node_error:
                if not is_not_found(node_error):
                    raise
                log.warning("node %s was deleted; registering it again", self.identity.name)
                await self.register()
            await self.upper.create(
                LEASES,
                lease(self.identity, self._node_uid),
                keys.NODE_LEASE_NAMESPACE,
                timeout=LEASE_REQUEST_TIMEOUT_SECONDS,
            )

    async def _status_loop(self) -> None:
        while True:
            wait_for = max(0.0, self._next_status_at - time.monotonic())
            changed = asyncio.ensure_future(self.provider.changed.wait())
            reachability = asyncio.ensure_future(self._reachability_changed.wait())
            done, pending = await asyncio.wait(
                {changed, reachability}, timeout=wait_for, return_when=asyncio.FIRST_COMPLETED
            )
            for future in pending:
                future.cancel()
            if done:
                await asyncio.sleep(STATUS_COALESCE_SECONDS)
            self.provider.changed.clear()
            # Read as it is cleared: set during the pause above, it would be lost.
            reachability_changed = self._reachability_changed.is_set()
            self._reachability_changed.clear()
            # The upper node controller rewrote the conditions while we were silent, so
            # what we last sent says nothing of what is there now: send it all again.
            force = reachability_changed or (
                time.monotonic() - self._last_sent >= STATUS_INTERVAL_SECONDS
            )
            if reachability_changed:
                self._status_unknown = True
            try:
                await self.update_status(force=force)
                due = self._last_sent + STATUS_INTERVAL_SECONDS
            except API_ERRORS as error:
                log.warning("status of %s not updated: %s", self.identity.name, error)
                self._status_unknown = True
                due = 0.0
            self._next_status_at = max(due, time.monotonic() + STATUS_RETRY_SECONDS)
            if due == 0.0:
                continue
            if self._reachable_unannounced and self.reachable:
                self._reachable_unannounced = False
                if self.on_reachable is not None:
                    self.on_reachable()

    async def _send_metadata(self, report: NodeReport) -> None:
        """The annotations and labels that follow the lower cluster, where they changed;
        a label this process set that the lower nodes no longer share goes (one a user
        put on the Node is never touched, nor taken over when they come to share it)."""
        given = {
            **report_annotations(report),
            # Recorded before the status brings a new resource, so that a restart finds
            # every one we may have put on the Node.
            keys.NODE_RESOURCE_KEYS_ANNOTATION: keys_record(
                self._resource_keys | set(report.allocatable)
            ),
        }
        annotations = {
            key: value for key, value in given.items() if self._annotations.get(key) != value
        }
        # No lower node counting (all NotReady a moment, a kwok restart) says nothing of
        # the labels: they are left as they are rather than flap to the defaults.
        shared = node_labels(self.identity, report) if report.labels else self._labels
        if report.labels:
            # One left to someone else is looked at again once the lower nodes share
            # another value, or stop sharing it and share it again.
            self._labels_of_others = {
                k: v for k, v in self._labels_of_others.items() if shared.get(k) == v
            }
        wanted = {k: v for k, v in shared.items() if k not in self._labels_of_others}
        resource_version = None
        if taken := set(wanted) - set(self._labels):
            # A key we did not set may hold a user's value: the Node as it is now says,
            # and the write is conditional on it.
            node = await self.upper.get(NODES, self.identity.name)
            # Recorded as ours: set by a patch whose answer was lost, say.
            others = labels_of_others(
                taken, node["metadata"].get("labels") or {}, recorded_label_keys(node)
            )
            left = {k: wanted.pop(k) for k in sorted(others)}
            self._log_labels_of_others(left)
            self._labels_of_others |= left
            resource_version = node["metadata"].get("resourceVersion")
        labels: dict[str, str | None] = {
            key: value for key, value in wanted.items() if self._labels.get(key) != value
        }
        labels.update(dict.fromkeys(set(self._labels) - set(wanted)))
        # Goes with the labels only: recorded, a label refused would be taken off later.
        record = keys_record(wanted)
        with_labels = (
            {keys.NODE_LABEL_KEYS_ANNOTATION: record}
            if labels and self._annotations.get(keys.NODE_LABEL_KEYS_ANNOTATION) != record
            else {}
        )
        metadata: dict[str, object] = {}
        if annotations or with_labels:
            metadata["annotations"] = {**annotations, **with_labels}
        if labels:
            metadata["labels"] = labels
            if resource_version:
                metadata["resourceVersion"] = resource_version
        if not metadata:
            return
        try:
            self._seen(await self.upper.patch(NODES, self.identity.name, {"metadata": metadata}))
        except ApiError as error:
            if is_not_found(error) or not (labels and annotations):
                raise
            # A label refused (an admission policy) holds back no annotation: the
            # multischeduler reads the largest free slot and the digests from them.
            log.warning("labels of node %s not updated: %s", self.identity.name, error)
            await self.upper.patch(
                NODES, self.identity.name, {"metadata": {"annotations": annotations}}
            )
            self._sent_annotations(annotations)
            return
        self._sent_annotations({**annotations, **with_labels})
        self._labels = wanted

    def _seen(self, node: Mapping[str, Any]) -> None:
        self._cordoned = bool((node.get("spec") or {}).get("unschedulable"))

    def _log_labels_of_others(self, labels: Mapping[str, str]) -> None:
        for key, value in labels.items():
            log.info(
                "node %s: label %s keeps the value someone else set, not %r of the lower nodes",
                self.identity.name,
                key,
                value,
            )

    def _sent_annotations(self, annotations: Mapping[str, str | None]) -> None:
        for key, value in annotations.items():
            if value is None:
                self._annotations.pop(key, None)
            else:
                self._annotations[key] = value

    async def update_status(self, force: bool) -> None:
        """Sends the status when it changed, or when ``force`` (the periodic heartbeat),
        and never while the lower cluster is unreachable: silence is how the upper node
        controller learns of it."""
        if not self.reachable and self._last_status:
            return
        report = self.provider.report(self.reachable)
        try:
            if self._status_unknown:
                node = await self.upper.get(NODES, self.identity.name)
                self._seen(node)
                self._last_status = node.get("status") or {}
                self._status_unknown = False
            try:
                await self._send_metadata(report)
            except ApiError as error:
                # A deleted Node's labels fail as its status would; a policy refusing a
                # label copied from the lower nodes holds no status back.
                if is_not_found(error):
                    raise
                log.warning("labels of node %s not updated: %s", self.identity.name, error)
            # With no lower node counting, the labels kept say what the OS and machine are.
            described = (
                report if report.labels else dataclasses.replace(report, labels=self._labels)
            )
            status = node_status(self.identity, described, self._last_status)
            ours = without_foreign_resources(self._last_status, self._resource_keys)
            if not force and not status_changed(ours, status):
                return
            node = await self.upper.patch(
                NODES,
                self.identity.name,
                {"status": status_patch(ours, status)},
                subresource="status",
                patch_type=_SMP,
            )
        except ApiError as error:
            if not is_not_found(error):
                raise
            log.warning("node %s was deleted; registering it again", self.identity.name)
            await self.register()
            return
        self._seen(node)
        self._last_status = node.get("status") or status
        # The rest went as null; the record follows at the next metadata sent.
        self._resource_keys = set(status["capacity"]) | set(status["allocatable"])
        self._last_sent = time.monotonic()
