"""Runs the pods bound to the virtual Node: level-triggered, one key per upper pod.

Generic kubelet machinery (virtual-kubelet's pod controller): the upper side, the work
queue and the upper status; the lower cluster is reached only through a PodBackend.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kubekit.client import PODS, ApiError, KubeClient, is_conflict, is_not_found
from kubekit.informer import FunctionHandler, Informer, object_key, resource_version
from kubekit.podevents import record_pod_event
from kubekit.timestamps import now_rfc3339
from kubekit.workqueue import WorkQueue
from virtual_node.translate import (
    failed_status,
    refused_status,
    terminated_status,
    without_observed_generation,
)

log = logging.getLogger(__name__)

JSON = dict[str, Any]
FINISHED = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class Mirrored:
    """The lower pod exists; this is the status the upper pod should have, read from the
    lower pod at ``version`` (its resourceVersion, after any write of this sync)."""

    status: JSON
    version: str
    # Changes the lower apiserver refused this time (a debug container, a resize): the
    # pod runs on as it is below, and its owner is told; ``retry``: one was refused for
    # now (403: a quota full today), so the pod is synced again after a backoff.
    refusals: tuple[str, ...] = ()
    retry: bool = False


@dataclass(frozen=True)
class Waiting:
    """Nothing to report yet (a stale lower pod is going away, or a pod is finished)."""


@dataclass(frozen=True)
class Gone:
    """The lower pod of a deleted upper pod is gone, with the status it last reported
    (the upper pod's form) when its removal was seen: the kubelet's last update and the
    removal often land in one reconcile, and the exit codes are in that update."""

    last_status: JSON | None = None


@dataclass(frozen=True)
class Vanished:
    """The lower pod existed and was deleted or evicted by someone else; with the status
    it last reported (the upper pod's form) when its removal was seen, as ``Gone``."""

    message: str
    last_status: JSON | None = None


@dataclass(frozen=True)
class EndingBelow:
    """The lower pod is being deleted by someone else (a drain or an eviction below, the
    taint manager of a lower node that went away): its status as it ends, the grace it
    was given."""

    status: JSON
    grace: int | None
    message: str


@dataclass(frozen=True)
class Refused:
    """The lower cluster refused the pod for now (quota, admission); try again later."""

    reason: str
    message: str


class RetryLater(Exception):
    """Raised to have the work queue retry the key with backoff."""


@dataclass(frozen=True)
class Rejected:
    """The pod cannot run below; retrying would not help."""

    reason: str
    message: str


SyncResult = Mirrored | EndingBelow | Waiting | Vanished | Refused | Rejected


class PodBackend(Protocol):
    async def sync(self, upper: Mapping[str, Any]) -> SyncResult: ...

    def mirror_version(self, upper_key: str) -> str | None:
        """The version of what ``sync`` reads below for this upper pod (None: nothing).
        Once a sync has left both sides in step, it has nothing new to do until this or
        the upper pod's version changes."""
        ...

    async def delete(self, upper: Mapping[str, Any]) -> JSON | Gone:
        """Starts or continues deleting the lower pod: the upper pod's status as the lower
        pod reports it while it ends, ``Gone`` once it is."""
        ...

    async def remove_orphan(self, upper_key: str, grace_period_seconds: int | None) -> None:
        """Deletes our lower pod whose upper pod is gone, with the grace the upper pod was
        deleted with (None when unknown: the lower pod's own)."""
        ...


class PodController:
    def __init__(
        self,
        upper: KubeClient,
        pods: Informer,
        backend: PodBackend,
        node_name: str,
        queue: WorkQueue[str],
    ) -> None:
        self.upper = upper
        self.pods = pods
        self.backend = backend
        self.node_name = node_name
        self.queue = queue
        # The grace of upper pods deleted before their lower pods went, by key: a force
        # delete (grace 0) leaves no upper pod to read it from at reconcile time.
        self._deleted_grace: dict[str, int] = {}
        # By key, the upper and lower resourceVersions a reconcile left in step. The watch
        # events of its own writes (the create below, the status above) bring the key
        # back with exactly these: two of a mirrored pod's four or five reconciles, which
        # would decode, translate and compare both pods to do nothing.
        self._in_step: dict[str, tuple[str, str]] = {}
        # By key, the refusals already told in an event: the same refused change comes
        # back with every reconcile of the pod until it is taken out above.
        self._told: dict[str, frozenset[str]] = {}
        pods.add_handler(
            FunctionHandler(add=self._changed, update=self._changed, delete=self._deleted)
        )

    def _changed(self, pod: JSON) -> None:
        self.queue.add(object_key(pod))

    def _deleted(self, pod: JSON) -> None:
        key = object_key(pod)
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is not None:
            self._deleted_grace[key] = grace
        self.queue.add(key)

    async def run(self, workers: int) -> None:
        await self.queue.run_workers(workers, self.reconcile)

    def resync(self) -> None:
        """Every upper pod reconciled again, as a kubelet's status manager does: after
        the lower cluster was unreachable, their statuses above are the node
        controller's (not ready), and no change of the pods themselves would wake them."""
        self._in_step.clear()
        keys = self.pods.keys()
        for key in keys:
            self.queue.add(key)

    async def reconcile(self, key: str) -> None:
        upper_version = self.pods.resource_version_of(key)
        in_step = self._in_step.get(key)
        if (
            in_step is not None
            and in_step[0] == upper_version
            and in_step[1] == self.backend.mirror_version(key)
        ):
            return
        self._in_step.pop(key, None)
        upper = self.pods.get(key)
        if upper is None:
            await self.backend.remove_orphan(key, self._deleted_grace.get(key))
            self._deleted_grace.pop(key, None)
            self._told.pop(key, None)
            return
        self._deleted_grace.pop(key, None)
        if upper["metadata"].get("deletionTimestamp"):
            ending = await self.backend.delete(upper)
            if not isinstance(ending, Gone):
                # The containers' shutdown below shows above, exit codes included.
                await self._set_status(upper, ending)
                return
            # Gone below. A kubelet's last word on a deleted pod is a terminal phase,
            # which a Job's finalizer waits for; only then does the pod go. Said once: a
            # pod a finalizer holds had it made again, with new times, at each reconcile.
            ended = (upper.get("status") or {}).get("phase") in FINISHED
            last_seen = (
                upper
                if ending.last_status is None or ended
                else {**upper, "status": ending.last_status}
            )
            terminated = terminated_status(last_seen, now_rfc3339())
            if await self._set_status(upper, terminated) is not None and (
                upper["metadata"].get("deletionGracePeriodSeconds") != 0
            ):
                await self.upper.delete_exact(PODS, upper, grace_period_seconds=0)
            return
        result = await self.backend.sync(upper)
        match result:
            case Mirrored(status, version, refusals, retry):
                await self._tell_refusals(key, upper, refusals)
                status_version = await self._set_status(upper, status)
                if retry:
                    raise RetryLater("; ".join(refusals))
                if status_version is not None:
                    self._in_step[key] = (status_version, version)
            case EndingBelow(status, grace, message):
                if (upper.get("status") or {}).get("phase") in FINISHED:
                    pass  # its end is said already
                elif _controlled(upper):
                    # Terminating above at once, as a pod evicted from a node: its owner
                    # makes another now (a StatefulSet's once this one is gone), not
                    # only once the lower pod is gone, which on a lower node that went
                    # away may be never. Its status comes up as it ends below.
                    await self.event(upper, "Warning", "LowerPodDeleted", message)
                    await self.upper.delete_exact(PODS, upper, grace_period_seconds=grace)
                elif status.get("phase") in FINISHED:
                    # Its end is the deletion's, whatever phase the lower kubelet wrote
                    # (Succeeded when its containers exited 0 on SIGTERM): not a run to
                    # its end, which anything polling the phase would have taken it for.
                    as_it_ended = {**upper, "status": status}  # its exit codes
                    await self.event(upper, "Warning", "LowerPodDeleted", message)
                    await self._set_status(
                        upper, failed_status(as_it_ended, "LowerPodDeleted", message, now_rfc3339())
                    )
                else:
                    await self._set_status(upper, status)
            case Vanished(message, last_status):
                await self._lost(upper, message, last_status)
            case Rejected(reason, message):
                if upper.get("status", {}).get("phase") not in FINISHED:
                    await self.event(upper, "Warning", reason, message)
                    await self._set_status(
                        upper, failed_status(upper, reason, message, now_rfc3339())
                    )
            case Refused(reason, message):
                if self.queue.retries(key) == 0:
                    await self.event(upper, "Warning", reason, message)
                await self._set_status(upper, refused_status(upper, reason, message, now_rfc3339()))
                raise RetryLater(message)
            case Waiting():
                pass

    async def _tell_refusals(
        self, key: str, upper: Mapping[str, Any], refusals: tuple[str, ...]
    ) -> None:
        told = self._told.get(key, frozenset())
        for message in refusals:
            if message not in told:
                await self.event(upper, "Warning", "LowerUpdateRefused", message)
        if refusals:
            self._told[key] = frozenset(refusals)
        else:
            self._told.pop(key, None)

    async def _set_status(self, upper: Mapping[str, Any], status: JSON) -> str | None:
        """The upper pod's resourceVersion once it has ``status``; None when the write
        lost a race. The observed generation rides along with the next change: written
        for it alone, a pod would cost two status writes where it costs one (its first
        reconcile would write it on the pending pod)."""
        known = upper.get("status") or {}
        if known == status or without_observed_generation(known) == without_observed_generation(
            status
        ):
            return resource_version(upper)
        body = {**upper, "status": status}
        try:
            written = await self.upper.replace(
                PODS, body, upper["metadata"]["namespace"], subresource="status"
            )
        except ApiError as error:
            if is_conflict(error) or is_not_found(error):
                # The cache is behind; the watch event that follows brings the key back.
                return None
            raise
        return resource_version(written)

    async def _lost(
        self, upper: Mapping[str, Any], message: str, last_status: JSON | None = None
    ) -> None:
        """A lower pod gone behind our back: a controlled pod is deleted so its owner
        makes a new one; a bare pod is marked Failed, as a kubelet would after losing it,
        over the exit codes its containers ended with below when they were seen."""
        await self.event(upper, "Warning", "LowerPodDeleted", message)
        if _controlled(upper):
            await self.upper.delete_exact(PODS, upper, grace_period_seconds=0)
        else:
            as_it_ended = upper if last_status is None else {**upper, "status": last_status}
            await self._set_status(
                upper, failed_status(as_it_ended, "LowerPodDeleted", message, now_rfc3339())
            )

    async def event(self, pod: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        source = {"component": "kubestrata-virtual-node", "host": self.node_name}
        await record_pod_event(self.upper, pod, kind, reason, message, source)


def _controlled(pod: Mapping[str, Any]) -> bool:
    return any(ref.get("controller") for ref in pod["metadata"].get("ownerReferences") or [])
