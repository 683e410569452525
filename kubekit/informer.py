"""Watch caches: list then watch one kind, keep every object in memory, tell handlers.

Objects are kept as JSON, compressed once they have stopped changing, and decoded on each
read: a decoded pod takes six to seven times the memory of its JSON, and the caches hold
every pod of a cluster. Each read gives the caller its own copy, so no handler can change
what another one sees.

The client-go reflector's behaviour: a paginated list gives a snapshot and a
resourceVersion (taken in one piece if its pages outlive the snapshot); a watch from
there with bookmarks keeps it current; a watch that ends or breaks is resumed from the
last version seen, after a jittered backoff if it broke; one silent for two minutes,
while the apiserver sends a bookmark about every minute, is presumed dead and opened
again at once (client-go pings its HTTP/2 connections for the same reason: a
connection whose peer vanished without closing it holds the cache still until TCP
gives up, hours later);
410 Gone (the version was compacted away) means list again, and the new snapshot is
compared with the cache so handlers see exactly the adds, updates and deletes they
missed. One informer per kind is shared by every handler that needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from kubekit.client import CONNECTION_ERRORS, JSON, ApiError, KubeClient, Resource, WatchSilent
from kubekit.ratelimit import Backoff

log = logging.getLogger(__name__)


def object_key(obj: Mapping[str, Any]) -> str:
    """``namespace/name``, or ``name`` for cluster-scoped objects (client-go's key)."""
    metadata = obj["metadata"]
    namespace = metadata.get("namespace")
    return f"{namespace}/{metadata['name']}" if namespace else str(metadata["name"])


def namespace_of(key: str) -> str:
    """The namespace part of an object key ("" for a cluster-scoped object)."""
    return key.rpartition("/")[0]


def namespace_index(keys: Iterable[str]) -> dict[str, set[str]]:
    """Object keys by namespace (client-go's namespace index)."""
    index: dict[str, set[str]] = {}
    for key in keys:
        index.setdefault(namespace_of(key), set()).add(key)
    return index


def strip_for_cache(obj: JSON) -> None:
    """Drops what no controller here reads, before an object is cached: managedFields
    are often the larger half of an object, and there is one cached copy per object."""
    obj.get("metadata", {}).pop("managedFields", None)


def resource_version(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("resourceVersion", ""))


class EventHandler(Protocol):
    """What a watch cache tells. An update carries the object as it is now, not as it
    was: handlers are level-triggered, and decoding the cached old object for each of
    them would cost every watch event for nothing."""

    def on_add(self, obj: JSON) -> None: ...
    def on_update(self, obj: JSON) -> None: ...
    def on_delete(self, obj: JSON) -> None: ...


@dataclass
class FunctionHandler:
    """An EventHandler from plain callables; the common case is one function that
    enqueues a key for any change."""

    # What they return is not read.
    add: Callable[[JSON], object] | None = None
    update: Callable[[JSON], object] | None = None
    delete: Callable[[JSON], object] | None = None

    @classmethod
    def on_any(cls, notify: Callable[[JSON], object]) -> FunctionHandler:
        return cls(add=notify, update=notify, delete=notify)

    def on_add(self, obj: JSON) -> None:
        if self.add:
            self.add(obj)

    def on_update(self, obj: JSON) -> None:
        if self.update:
            self.update(obj)

    def on_delete(self, obj: JSON) -> None:
        if self.delete:
            self.delete(obj)


@dataclass(frozen=True)
class SnapshotDiff:
    added: list[str]
    updated: list[str]
    deleted: list[str]


def _take_page(page: JSON, listed: dict[str, JSON]) -> None:
    kind = page.get("kind", "").removesuffix("List")
    api_version = page.get("apiVersion")
    for obj in page.get("items", []):
        # List items come without kind/apiVersion; watch objects have them.
        obj.setdefault("kind", kind)
        obj.setdefault("apiVersion", api_version)
        strip_for_cache(obj)
        listed[object_key(obj)] = obj


def _uid(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


def diff_snapshot(cached: Mapping[str, str], listed: Mapping[str, JSON]) -> SnapshotDiff:
    """What changed between the cache (key -> resourceVersion) and a fresh list, by key:
    handlers must hear of every object that appeared, changed or vanished while not
    watching."""
    added = [key for key in listed if key not in cached]
    updated = [
        key for key, obj in listed.items() if key in cached and cached[key] != resource_version(obj)
    ]
    deleted = [key for key in cached if key not in listed]
    return SnapshotDiff(added, updated, deleted)


class Compressor:
    """Compresses one kind's objects with zlib, primed with the first of them as its
    preset dictionary.

    The objects of one kind in one cluster share most of their text (keys, defaults,
    tolerations, volumes, conditions), so a pod's 2.5-3 KiB of JSON is stored in about
    160 bytes where zlib alone makes 1.2 KiB of it. The price is CPU: 6 us to compress
    and 2.5 us to decompress a pod in a quiet loop, several times that in a busy virtual
    node, which is why the informer compresses an object only once it has settled.
    Copying a primed (de)compressor skips setting the dictionary up for every object,
    and leaves the primed ones untouched for other threads.
    """

    # An 8 KiB window holds a whole pod of several containers as dictionary; the state
    # each object's copy allocates stays small.
    WINDOW_BITS = -13
    MEMORY_LEVEL = 6

    def __init__(self, sample: bytes) -> None:
        # zlib reads only a window's worth of the dictionary, its end; the decompressor
        # keeps the dictionary it was given, which need not be a whole large object.
        dictionary = sample[-(1 << -self.WINDOW_BITS) :]
        self._compressor = zlib.compressobj(
            1, zlib.DEFLATED, self.WINDOW_BITS, self.MEMORY_LEVEL, zdict=dictionary
        )
        self._decompressor = zlib.decompressobj(self.WINDOW_BITS, zdict=dictionary)

    def compress(self, data: bytes) -> bytes:
        compressor = self._compressor.copy()
        return compressor.compress(data) + compressor.flush()

    def decompress(self, data: bytes) -> bytes:
        return self._decompressor.copy().decompress(data)


@dataclass(frozen=True, slots=True)
class _Cached:
    resource_version: str
    text: bytes
    # None while ``text`` is the object's JSON, before it settles.
    compressor: Compressor | None = None

    def decode(self) -> JSON:
        text = self.text if self.compressor is None else self.compressor.decompress(self.text)
        decoded: JSON = orjson.loads(text)
        return decoded


# A body that does not decode (ValueError) is a stream cut short, as the others.
_TRANSIENT: tuple[type[Exception], ...] = (*CONNECTION_ERRORS, ValueError)


def _expired(error: ApiError) -> bool:
    """A resourceVersion the server no longer has: 410, or its reasons (as client-go's
    IsResourceExpired and IsGone read them, a Status without a code included)."""
    return error.status == 410 or error.reason in ("Expired", "Gone")


def _beyond_the_server(error: ApiError) -> bool:
    """The apiserver's "Too large resource version" (504, cause ResourceVersionTooLarge)."""
    body = error.body if isinstance(error.body, dict) else {}
    causes = (body.get("details") or {}).get("causes") or []
    return any(c.get("reason") == "ResourceVersionTooLarge" for c in causes) or (
        "Too large resource version" in error.message
    )


class Informer:
    def __init__(
        self,
        client: KubeClient,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        page_size: int = 500,
        backoff: Backoff | None = None,
        settle_seconds: float = 2.0,
        silence_seconds: float = 120.0,
    ) -> None:
        self.client = client
        self.resource = resource
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.page_size = page_size
        self.backoff = backoff or Backoff()
        self._store: dict[str, _Cached] = {}
        self._compressor: Compressor | None = None
        # A pod changes several times in its first seconds and is read after each change:
        # an object is compressed once it has stayed unchanged this long, not each time.
        self.settle_seconds = settle_seconds
        # Two of the apiserver's bookmark intervals without a byte: the watch is dead.
        self.silence_seconds = silence_seconds
        # Keys of the objects stored as JSON, by when they last changed, oldest first.
        self._unsettled: dict[str, float] = {}
        # A handler that wants one namespace's objects reads that many, not the whole cache.
        self._by_namespace: dict[str, set[str]] = {}
        self._handlers: list[EventHandler] = []
        self.synced = asyncio.Event()
        self.resource_version = ""
        self.relists = 0
        self._resumed = asyncio.Event()

    def __repr__(self) -> str:
        return (
            f"Informer({self.resource.plural}, ns={self.namespace}, labels={self.label_selector})"
        )

    # -- the cache -------------------------------------------------------------------------

    def get(self, key: str) -> JSON | None:
        cached = self._store.get(key)
        return None if cached is None else cached.decode()

    def resource_version_of(self, key: str) -> str | None:
        """The cached object's resourceVersion, without decoding it."""
        cached = self._store.get(key)
        return None if cached is None else cached.resource_version

    def items(self, namespace: str | None = None) -> Iterator[JSON]:
        """Every cached object, or every one in ``namespace``."""
        if namespace is None:
            found = list(self._store.values())
        else:
            found = [self._store[key] for key in self._by_namespace.get(namespace, ())]
        return (cached.decode() for cached in found)

    def keys(self) -> list[str]:
        return list(self._store)

    def __len__(self) -> int:
        return len(self._store)

    def add_handler(self, handler: EventHandler) -> None:
        """Registers a handler; one added after the first sync hears of every cached
        object as an add, so it never misses what was there before it."""
        self._handlers.append(handler)
        if self.synced.is_set():
            for obj in self.items():
                self._call(handler.on_add, obj)

    async def wait_synced(self) -> None:
        await self.synced.wait()

    # -- the loop --------------------------------------------------------------------------

    def _selectors(self) -> dict[str, Any]:
        return {"labelSelector": self.label_selector, "fieldSelector": self.field_selector}

    async def run(self) -> None:
        """Lists and watches until cancelled."""
        compressing = asyncio.create_task(self._compress_settled_forever())
        need_list = True
        try:
            while True:
                try:
                    if need_list:
                        await self._relist()
                        need_list = False
                    started = time.monotonic()
                    if not await self._watch_once() and time.monotonic() - started < 1:
                        # Ended at once with nothing (a proxy, an apiserver shutting
                        # down): watched again at once, it would spend the client's whole
                        # request budget (client-go's "very short watch").
                        await self._pause("the watch ended at once with no event")
                except asyncio.CancelledError:
                    raise
                except ApiError as error:
                    # A resourceVersion the server no longer has (410 Gone) or has not
                    # reached (its etcd restored from a backup: watched from it, for
                    # good) is listed again; after a pause, or lists that expire before
                    # their watch starts would follow each other. Other errors (403, 429,
                    # 5xx) retry what failed, with the backoff growing.
                    if _expired(error) or _beyond_the_server(error):
                        need_list = True
                        log.info(
                            "%r: resourceVersion %s too %s, listing again",
                            self,
                            self.resource_version,
                            "old" if _expired(error) else "large",
                        )
                        await self._pause(error, logging.INFO)
                    else:
                        await self._pause(error)
                except _TRANSIENT as error:
                    await self._pause(error)
                except Exception:
                    # An object or event this code cannot read (without metadata, a
                    # name): the cache missed it, so it is listed again. A task ended
                    # here would leave the cache as it was, with nobody told.
                    log.exception("%r: cannot read what the server sent; listing again", self)
                    need_list = True
                    await self._pause("unreadable list or watch event")
        finally:
            compressing.cancel()

    async def _compress_settled_forever(self) -> None:
        while True:
            # In slices, so that the 10,000 objects of a relist do not hold the loop up.
            more = self.compress_settled(time.monotonic() - self.settle_seconds, limit=500)
            await asyncio.sleep(0 if more else self.settle_seconds / 2)

    def compress_settled(self, unchanged_since: float, limit: int | None = None) -> bool:
        """Compresses the objects unchanged since ``unchanged_since`` (monotonic), at most
        ``limit`` of them; says whether settled ones are left."""
        settled: list[str] = []
        for key, changed in self._unsettled.items():
            if changed > unchanged_since or len(settled) == limit:
                break
            settled.append(key)
        for key in settled:
            del self._unsettled[key]
            cached = self._store[key]
            if self._compressor is None:
                self._compressor = Compressor(cached.text)
            self._store[key] = _Cached(
                cached.resource_version, self._compressor.compress(cached.text), self._compressor
            )
        oldest = next(iter(self._unsettled.values()), None)
        return oldest is not None and oldest <= unchanged_since

    async def _pause(self, why: BaseException | str, level: int = logging.WARNING) -> None:
        delay = self.backoff.next_delay()
        if isinstance(why, ApiError) and why.retry_after is not None:
            # Told to wait, but never past the backoff's cap: a proxy answering
            # Retry-After: 3600 froze the cache for an hour, and only the virtual node's
            # lower caches are ever told to resume early.
            delay = max(delay, min(why.retry_after, self.backoff.cap))
        log.log(level, "%r: %s; retrying in %.1f s", self, why or type(why).__name__, delay)
        self._resumed.clear()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for may swallow a
        # cancellation that comes as the event is set.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._resumed.wait()

    def resume(self) -> None:
        """Ends a pause between retries now. After an outage of a minute the backoff has
        grown to as much (jitter included); whoever sees the server answer again says so,
        and the cache catches up at once rather than up to a minute later."""
        self.backoff.reset()
        self._resumed.set()

    async def _list(self) -> tuple[dict[str, JSON], str]:
        """Every object, by key, and the list's resourceVersion."""
        listed: dict[str, JSON] = {}
        pages = 0
        try:
            async for page in self.client.list_pages(
                self.resource, self.namespace, limit=self.page_size, **self._selectors()
            ):
                pages += 1
                _take_page(page, listed)
        except ApiError as error:
            if error.status != 410 or pages == 0:
                raise
            # The first page's snapshot was compacted away while the later pages were
            # fetched (a list slower than etcd's compaction interval): listed in pages
            # again it would expire again, so it is taken in one piece (client-go's
            # pager falls back the same way).
            log.info("%r: list expired between pages; listing in one piece", self)
            listed = {}
            page = await self.client.list(self.resource, self.namespace, **self._selectors())
            _take_page(page, listed)
        return listed, page["metadata"]["resourceVersion"]

    async def _relist(self) -> None:
        began = time.monotonic()
        listed, resource_version = await self._list()
        self.relists += 1
        diff = diff_snapshot(
            {key: cached.resource_version for key, cached in self._store.items()}, listed
        )
        before = self._store
        self._store = {key: self._cached(obj) for key, obj in listed.items()}
        changed = time.monotonic()
        self._unsettled = dict.fromkeys(self._store, changed)
        self._by_namespace = namespace_index(self._store)
        self.resource_version = resource_version
        for key in diff.added:
            self._notify("on_add", listed[key])
        for key in diff.updated:
            old = before[key].decode()
            if _uid(old) == _uid(listed[key]):
                self._notify("on_update", listed[key])
            else:
                # Deleted and made again under its name while not watching (a
                # StatefulSet's pod): an update would hide the old one's end from
                # handlers keyed by UID, whose room or copy then lingered.
                self._notify("on_delete", old)
                self._notify("on_add", listed[key])
        for key in diff.deleted:
            self._notify("on_delete", before[key].decode())
        self.synced.set()
        log.info("%r: listed %d objects in %.2f s", self, len(listed), time.monotonic() - began)

    async def _watch_once(self) -> int:
        """Watches from the cache's resourceVersion until the server ends the watch; the
        number of events it brought."""
        events = 0
        try:
            async for event in self.client.watch(
                self.resource,
                self.namespace,
                resourceVersion=self.resource_version,
                allowWatchBookmarks=True,
                # Spread so that many informers do not reconnect together.
                timeoutSeconds=random.randint(300, 600),
                read_timeout=self.silence_seconds,
                **self._selectors(),
            ):
                self.apply(event)
                # Only an event applied says the cache works again (not a list, nor an
                # event received): one that cannot be applied lets the backoff grow.
                self.backoff.reset()
                events += 1
        except WatchSilent as silent:
            log.info("%r: %s, not even a bookmark; watching again", self, silent)
        return events

    def apply(self, event: Mapping[str, Any]) -> None:
        """Applies one watch event to the cache and tells the handlers."""
        kind = event["type"]
        obj: JSON = event["object"]
        strip_for_cache(obj)
        version = resource_version(obj)
        if kind == "BOOKMARK":
            self._watched_to(version)
            return
        key = object_key(obj)
        if kind == "DELETED":
            self._unsettled.pop(key, None)
            if self._store.pop(key, None) is not None:
                keys = self._by_namespace[namespace_of(key)]
                keys.discard(key)
                if not keys:
                    del self._by_namespace[namespace_of(key)]
            self._notify("on_delete", obj)
        else:
            known = key in self._store
            self._store[key] = self._cached(obj)
            # Moved to the end: the keys stay in the order they last changed.
            self._unsettled.pop(key, None)
            self._unsettled[key] = time.monotonic()
            if not known:
                self._by_namespace.setdefault(namespace_of(key), set()).add(key)
            self._notify("on_update" if known else "on_add", obj)
        self._watched_to(version)

    def _watched_to(self, version: str) -> None:
        # An event without a version (a proxy's, not an apiserver's) says nothing of where
        # the watch is: an empty one would have the next watch start from now, with no
        # deletion told of what went meanwhile.
        if version:
            self.resource_version = version

    @staticmethod
    def _cached(obj: JSON) -> _Cached:
        return _Cached(resource_version(obj), orjson.dumps(obj))

    def _notify(self, method: str, *args: JSON) -> None:
        for handler in self._handlers:
            self._call(getattr(handler, method), *args)

    def _call(self, function: Callable[..., None], *args: JSON) -> None:
        try:
            function(*args)
        except Exception:
            # A broken handler must not stop the cache or the other handlers.
            log.exception("%r: handler %s failed", self, function)


class InformerFactory:
    """Hands out one shared informer per (kind, namespace, selectors)."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self._informers: dict[tuple[Resource, str | None, str | None, str | None], Informer] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False

    def informer(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> Informer:
        key = (resource, namespace, label_selector, field_selector)
        if key not in self._informers:
            informer = Informer(
                self.client,
                resource,
                namespace=namespace,
                label_selector=label_selector,
                field_selector=field_selector,
            )
            self._informers[key] = informer
            if self._started:  # this one too (started empty, there are no tasks)
                self._tasks.append(asyncio.create_task(informer.run(), name=repr(informer)))
        return self._informers[key]

    def start(self) -> None:
        self._started = True
        for informer in self._informers.values():
            self._tasks.append(asyncio.create_task(informer.run(), name=repr(informer)))

    async def wait_synced(self) -> None:
        await asyncio.gather(*(i.synced.wait() for i in self._informers.values()))

    def resume(self) -> None:
        """Every informer of this server retries now (see `Informer.resume`)."""
        for informer in self._informers.values():
            informer.resume()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._started = False
