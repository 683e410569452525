"""Events our components write about an upper pod, as `kubectl describe pod` lists them,
or about a namespace."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kubekit.client import API_ERRORS, EVENTS, KubeClient
from kubekit.informer import object_key
from kubekit.timestamps import now_rfc3339

JSON = dict[str, Any]

log = logging.getLogger(__name__)


def pod_event(
    pod: Mapping[str, Any],
    event_type: str,
    reason: str,
    message: str,
    source: Mapping[str, str],
    now: str,
    kind: str = "Pod",
) -> JSON:
    metadata = pod["metadata"]
    # A Namespace's events are kept in it (the apiserver wants the involved object's
    # namespace to be the event's), where its users list them.
    namespace = metadata["name"] if kind == "Namespace" else metadata["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{metadata['name']}.", "namespace": namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": kind,
            "name": metadata["name"],
            "namespace": namespace,
            "uid": metadata["uid"],
        },
        "type": event_type,
        "reason": reason,
        "message": message,
        "source": dict(source),
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


async def record_pod_event(
    client: KubeClient,
    pod: Mapping[str, Any],
    event_type: str,
    reason: str,
    message: str,
    source: Mapping[str, str],
    kind: str = "Pod",
) -> None:
    """Creates the event; one that cannot be written is logged, since an event is news,
    not state, and its loss must not stop the work it tells of."""
    body = pod_event(pod, event_type, reason, message, source, now_rfc3339(), kind)
    try:
        await client.create(EVENTS, body, body["metadata"]["namespace"])
    except API_ERRORS as error:
        # The apiserver out of reach too: a descheduler's plan cut short by its event
        # would have evicted pods for nothing and kept the room held for the waiting one.
        log.warning("event %s on %s not recorded: %s", reason, object_key(pod), error)
