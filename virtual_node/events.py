"""Re-emits the lower cluster's events about mirrored pods on the upper pods, so
`kubectl describe pod` above tells what happened below."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kubekit import keys
from kubekit.client import EVENTS, ApiError, KubeClient
from kubekit.informer import FunctionHandler, Informer, object_key
from kubekit.workqueue import WorkQueue
from virtual_node.translate import Ownership

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
)


def upper_event(
    lower_event: Mapping[str, Any], lower_pod: Mapping[str, Any], cluster_id: str
) -> JSON | None:
    """The upper copy of a lower event about one of our pods (pure); None when the pod is
    not ours. Its name derives from the lower event's UID so a restart updates rather
    than duplicates it."""
    annotations = lower_pod["metadata"].get("annotations") or {}
    namespace = annotations.get(keys.UPPER_NAMESPACE_ANNOTATION)
    uid = annotations.get(keys.UPPER_UID_ANNOTATION)
    if not namespace or not uid:
        return None
    name = lower_pod["metadata"]["name"]
    source = dict(lower_event.get("source") or {})
    source["component"] = (
        f"{source.get('component') or lower_event.get('reportingComponent') or 'lower'}"
        f" (lower cluster {cluster_id})"
    )
    event: JSON = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.{lower_event['metadata']['uid']}", "namespace": namespace},
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


class EventReflector:
    def __init__(
        self,
        upper: KubeClient,
        lower_events: Informer,
        lower_pods: Informer,
        owner: Ownership,
        cluster_id: str,
        queue: WorkQueue[str],
    ) -> None:
        self.upper = upper
        self.lower_events = lower_events
        self.lower_pods = lower_pods
        self.owner = owner
        self.cluster_id = cluster_id
        self.queue = queue
        self._sent: dict[str, str] = {}  # lower event key -> resourceVersion copied
        lower_events.add_handler(
            FunctionHandler(
                add=self._changed,
                update=self._changed,
                delete=self._forget,
            )
        )

    def _forget(self, event: Mapping[str, Any]) -> None:
        self._sent.pop(object_key(event), None)

    def _changed(self, event: Mapping[str, Any]) -> None:
        if (event.get("involvedObject") or {}).get("kind") == "Pod":
            self.queue.add(object_key(event))

    async def run(self, workers: int) -> None:
        await self.queue.run_workers(workers, self.reconcile, max_retries=5)

    async def reconcile(self, key: str) -> None:
        event = self.lower_events.get(key)
        if event is None or self._sent.get(key) == event["metadata"].get("resourceVersion"):
            return
        involved = event["involvedObject"]
        pod = self.lower_pods.get(f"{involved.get('namespace')}/{involved.get('name')}")
        if pod is None or not self.owner.owns(pod):
            return
        body = upper_event(event, pod, self.cluster_id)
        if body is None:
            return
        namespace = body["metadata"]["namespace"]
        try:
            await self.upper.create(EVENTS, body, namespace)
        except ApiError as error:
            if error.status != 409:
                raise
            patch = {k: body[k] for k in ("count", "lastTimestamp", "message") if k in body}
            await self.upper.patch(EVENTS, body["metadata"]["name"], patch, namespace)
        self._sent[key] = event["metadata"].get("resourceVersion", "")
