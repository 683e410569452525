"""Re-emits the lower cluster's events about mirrored pods on the upper pods, so
`kubectl describe pod` above tells what happened below."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from kubekit import keys
from kubekit.client import API_ERRORS, EVENTS, ApiError, KubeClient, is_not_found
from kubekit.informer import FunctionHandler, Informer, object_key
from kubekit.ratelimit import ItemBackoff
from kubekit.timestamps import parse_time
from kubekit.workqueue import WorkQueue
from virtual_node.naming import NamespaceMapping, NamingError
from virtual_node.translate import Ownership, made_from

log = logging.getLogger(__name__)

JSON = dict[str, Any]
_COPIED = (
    "type",
    "reason",
    "message",
    "count",
    "firstTimestamp",
    "lastTimestamp",
    "eventTime",
    "action",
    "reportingComponent",
    "reportingInstance",
    "series",
)
# What changes when an event recurs, and so what a copy already made is patched with: an
# old-style event counts its repeats, a new-style one (the scheduler's) its series.
_RECURRING = ("count", "lastTimestamp", "message", "series")


def upper_event(
    lower_event: Mapping[str, Any], lower_pod: Mapping[str, Any], owner: Ownership, cluster_id: str
) -> JSON | None:
    """The upper copy of a lower event about one of our pods (pure); None when the pod is
    not ours, or the event is about an earlier pod of its name. Its name derives from the
    lower event's UID so a restart updates rather than duplicates it; it carries our
    ownership labels so a restart can list the copies it made."""
    annotations = lower_pod["metadata"].get("annotations") or {}
    namespace = annotations.get(keys.UPPER_NAMESPACE_ANNOTATION)
    uid = annotations.get(keys.UPPER_UID_ANNOTATION)
    if not namespace or not uid:
        return None
    about = (lower_event.get("involvedObject") or {}).get("uid")
    if about and about != lower_pod["metadata"].get("uid"):
        return None  # about an earlier pod of that name, not this one's upper pod
    name = lower_pod["metadata"]["name"]
    source = dict(lower_event.get("source") or {})
    source["component"] = (
        f"{source.get('component') or lower_event.get('reportingComponent') or 'lower'}"
        f" (lower cluster {cluster_id})"
    )
    event: JSON = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{name}.{lower_event['metadata']['uid']}",
            "namespace": namespace,
            "labels": owner.labels(),
        },
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": name,
            "namespace": namespace,
            "uid": uid,
            **(
                {"fieldPath": lower_event["involvedObject"]["fieldPath"]}
                if lower_event["involvedObject"].get("fieldPath")
                else {}
            ),
        },
        "source": source,
    }
    for field in _COPIED:
        if lower_event.get(field) is not None:
            event[field] = lower_event[field]
    if not event.get("reportingComponent"):
        event["reportingComponent"] = ""
    return event


def recurrence(event: Mapping[str, Any]) -> JSON:
    """The part of an event that changes when it recurs (pure). A null field is an absent
    one: the apiserver lists a new-style event's empty lastTimestamp as null, which the
    copy made from it leaves out."""
    return {field: event[field] for field in _RECURRING if event.get(field) is not None}


def fingerprint(event: Mapping[str, Any]) -> int:
    """Tells whether a copy is up to date, in far less memory than the copy (pure;
    stable within one process only)."""
    return hash(orjson.dumps(recurrence(event), option=orjson.OPT_SORT_KEYS))


def lower_event_uid(copy_name: str) -> str:
    """The UID of the lower event an upper copy was made from, out of its name (pure)."""
    return copy_name.rpartition(".")[2]


# As client-go's event broadcaster, which a kubelet uses: an event is tried for minutes
# (12 times, 1 s apart doubling to a minute), so an upper apiserver's restart or a
# second of 503s drops none. A one-off event (Scheduled, Started) never comes back to
# be tried again.
EVENT_ATTEMPTS = 12
# An event about a pod the lower pod cache does not show yet (its watch relisting after a
# 410, or behind the event watch) is looked at again this many times, a second later
# and then twice as long each time: dropped at once, a new pod's one-off events
# (Scheduled, Pulled, Started) never came up.
POD_WAITS = 5
POD_WAIT_SECONDS = 1.0
# Only an event this recent waits for its pod: listed at a restart, the events of pods
# long gone (an event lives an hour) would each be looked at again for nothing.
POD_WAIT_WINDOW = datetime.timedelta(minutes=1)


def event_queue(first_retry_seconds: float = 1.0) -> WorkQueue[str]:
    return WorkQueue("events", backoff=ItemBackoff(base=first_retry_seconds, cap=60.0))


class EventReflector:
    def __init__(
        self,
        upper: KubeClient,
        lower_events: Informer,
        lower_pods: Informer,
        upper_pods: Informer,
        mapping: NamespaceMapping,
        owner: Ownership,
        cluster_id: str,
        queue: WorkQueue[str],
        clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:
        self.upper = upper
        self.lower_events = lower_events
        self.lower_pods = lower_pods
        self.upper_pods = upper_pods
        self.mapping = mapping
        self.owner = owner
        self.cluster_id = cluster_id
        self.queue = queue
        self.clock = clock
        self._copied: dict[str, int] = {}  # lower event UID -> fingerprint of its copy
        # Event key -> times it was put off for its pod not in the cache yet.
        self._waiting: dict[str, int] = {}
        lower_events.add_handler(
            FunctionHandler(
                add=self._changed,
                update=self._changed,
                delete=self._forget,
            )
        )

    def _forget(self, event: Mapping[str, Any]) -> None:
        self._copied.pop(event["metadata"].get("uid", ""), None)
        self._waiting.pop(object_key(event), None)

    def _wait_for_pod(self, key: str, event: Mapping[str, Any]) -> None:
        made = event["metadata"].get("creationTimestamp")
        try:
            old = isinstance(made, str) and parse_time(made) < self.clock() - POD_WAIT_WINDOW
        except ValueError:
            old = False
        if old:
            return
        tries = self._waiting.get(key, 0)
        if tries >= POD_WAITS:
            del self._waiting[key]
            return
        self._waiting[key] = tries + 1
        self.queue.add_after(key, POD_WAIT_SECONDS * 2**tries)

    def _changed(self, event: Mapping[str, Any]) -> None:
        if (event.get("involvedObject") or {}).get("kind") == "Pod":
            self.queue.add(object_key(event))

    async def run(self, workers: int) -> None:
        await self._load_copies()
        await self.queue.run_workers(workers, self.reconcile, max_retries=EVENT_ATTEMPTS)

    def _mirrors(self, lower_pod: Mapping[str, Any]) -> bool:
        """Whether the lower pod is the copy of an upper pod bound to this node: whoever
        may make pods below may give one our labels, and annotations naming any upper
        namespace (kube-system, say) and pod, whose events would then be written there."""
        metadata = lower_pod["metadata"]
        annotations = metadata.get("annotations") or {}
        namespace = annotations.get(keys.UPPER_NAMESPACE_ANNOTATION)
        try:
            if not namespace or self.mapping.lower(namespace) != metadata.get("namespace"):
                return False
        except NamingError:
            return False
        upper_pod = self.upper_pods.get(f"{namespace}/{metadata['name']}")
        return upper_pod is not None and made_from(lower_pod, upper_pod)

    async def _load_copies(self) -> None:
        """Learns the copies made before a restart, so they are not sent again: with
        thousands of pods that would take the event budget for minutes. Without them
        (the list failed) each copy costs a refused create more, nothing worse."""
        try:
            async for page in self.upper.list_pages(
                EVENTS, limit=500, labelSelector=self.owner.selector()
            ):
                for copy in page["items"]:
                    self._copied[lower_event_uid(copy["metadata"]["name"])] = fingerprint(copy)
        except API_ERRORS as error:
            log.warning("copied events not listed, each is sent once more: %s", error)

    async def reconcile(self, key: str) -> None:
        event = self.lower_events.get(key)
        if event is None:
            return
        involved = event["involvedObject"]
        pod = self.lower_pods.get(f"{involved.get('namespace')}/{involved.get('name')}")
        about = involved.get("uid")
        if pod is None or (about and about != pod["metadata"].get("uid")):
            self._wait_for_pod(key, event)  # or it is about an earlier pod of the name
            return
        self._waiting.pop(key, None)
        if not self.owner.owns(pod) or not self._mirrors(pod):
            return
        body = upper_event(event, pod, self.owner, self.cluster_id)
        if body is None:
            return
        uid = event["metadata"]["uid"]
        copied = self._copied.get(uid)
        if copied == fingerprint(body):
            return
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            if copied is None:
                await self.upper.create(EVENTS, body, namespace)
            else:
                await self.upper.patch(EVENTS, name, recurrence(body), namespace)
        except ApiError as error:
            if error.status == 409:  # a copy not listed at the start
                await self.upper.patch(EVENTS, name, recurrence(body), namespace)
            elif is_not_found(error):  # the copy expired above
                await self.upper.create(EVENTS, body, namespace)
            else:
                raise
        self._copied[uid] = fingerprint(body)
