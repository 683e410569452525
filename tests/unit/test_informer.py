import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from kubekit.client import JSON, ApiError, ClientSettings, KubeClient, LineSplitter, Resource
from kubekit.informer import (
    Compressor,
    FunctionHandler,
    Informer,
    InformerFactory,
    diff_snapshot,
    namespace_index,
    object_key,
)
from kubekit.ratelimit import Backoff
from tests.unit.tlsserver import serving_over_tls


def obj(name: str, rv: str, namespace: str | None = "ns", **extra: Any) -> JSON:
    metadata: JSON = {"name": name, "resourceVersion": rv}
    if namespace:
        metadata["namespace"] = namespace
    return {"metadata": metadata, **extra}


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def on_add(self, o: JSON) -> None:
        self.events.append(("add", object_key(o)))

    def on_update(self, o: JSON) -> None:
        self.events.append(("update", object_key(o)))

    def on_delete(self, o: JSON) -> None:
        self.events.append(("delete", object_key(o)))


def informer() -> Informer:
    return Informer(client=None, resource=Resource("", "v1", "configmaps"))  # type: ignore[arg-type]


def test_object_key_namespaced_and_cluster_scoped() -> None:
    assert object_key(obj("a", "1")) == "ns/a"
    assert object_key(obj("node-1", "1", namespace=None)) == "node-1"


def test_diff_snapshot_reports_what_was_missed() -> None:
    cached = {"ns/kept": "1", "ns/changed": "1", "ns/gone": "1"}
    listed = {
        "ns/kept": obj("kept", "1"),
        "ns/changed": obj("changed", "2"),
        "ns/new": obj("new", "3"),
    }
    diff = diff_snapshot(cached, listed)
    assert diff.added == ["ns/new"]
    assert diff.updated == ["ns/changed"]
    assert diff.deleted == ["ns/gone"]


def test_each_read_of_the_cache_is_a_copy_of_its_own() -> None:
    cache = informer()
    cache.apply({"type": "ADDED", "object": obj("a", "1", data={"k": "v"})})
    first = cache.get("ns/a")
    assert first is not None
    first["data"]["k"] = "changed by a careless reader"
    assert cache.get("ns/a") == obj("a", "1", data={"k": "v"})
    assert list(cache.items()) == [obj("a", "1", data={"k": "v"})]


def test_an_update_hands_the_handler_the_object_as_it_is_now() -> None:
    cache = informer()
    seen: list[JSON] = []
    cache.add_handler(FunctionHandler(update=seen.append))
    cache.apply({"type": "ADDED", "object": obj("a", "1", data={"k": "v"})})
    cache.apply({"type": "MODIFIED", "object": obj("a", "2", data={"k": "w"})})
    assert seen == [obj("a", "2", data={"k": "w"})]


def test_apply_watch_events_updates_cache_and_handlers() -> None:
    cache = informer()
    recorder = Recorder()
    cache.add_handler(recorder)
    cache.apply({"type": "ADDED", "object": obj("a", "5")})
    cache.apply({"type": "MODIFIED", "object": obj("a", "6", data={"k": "v"})})
    cache.apply({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}})
    assert cache.resource_version == "9"
    assert cache.get("ns/a") == obj("a", "6", data={"k": "v"})
    cache.apply({"type": "DELETED", "object": obj("a", "10")})
    assert cache.get("ns/a") is None
    assert recorder.events == [("add", "ns/a"), ("update", "ns/a"), ("delete", "ns/a")]
    assert cache.resource_version == "10"
    # A bookmark without a version (a proxy's): the next watch would start from now,
    # told of no deletion made meanwhile.
    cache.apply({"type": "BOOKMARK", "object": {"metadata": {}}})
    assert cache.resource_version == "10"


def test_a_namespace_reads_only_its_own_objects_as_they_come_and_go() -> None:
    cache = informer()
    cache.apply({"type": "ADDED", "object": obj("a", "1", namespace="shop")})
    cache.apply({"type": "ADDED", "object": obj("b", "2", namespace="shop")})
    cache.apply({"type": "ADDED", "object": obj("a", "3", namespace="blog")})
    cache.apply({"type": "MODIFIED", "object": obj("b", "4", namespace="shop", data={"k": "v"})})
    assert sorted(o["metadata"]["resourceVersion"] for o in cache.items("shop")) == ["1", "4"]
    cache.apply({"type": "DELETED", "object": obj("a", "5", namespace="shop")})
    cache.apply({"type": "DELETED", "object": obj("a", "6", namespace="blog")})
    cache.apply({"type": "DELETED", "object": obj("gone", "7", namespace="blog")})
    assert [o["metadata"]["name"] for o in cache.items("shop")] == ["b"]
    assert list(cache.items("blog")) == []
    assert len(list(cache.items())) == 1


def test_namespace_index_of_listed_keys() -> None:
    assert namespace_index(["shop/a", "shop/b", "blog/a", "node-1"]) == {
        "shop": {"shop/a", "shop/b"},
        "blog": {"blog/a"},
        "": {"node-1"},
    }


def pod(name: str) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "shop", "uid": f"uid-of-{name}"},
        "spec": {
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
            "tolerations": [
                {"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute"}
                for taint in ("not-ready", "unreachable")
            ],
        },
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_an_object_like_the_first_is_stored_in_a_fraction_of_its_json() -> None:
    compressor = Compressor(orjson.dumps(pod("first")))
    text = orjson.dumps(pod("second"))
    compressed = compressor.compress(text)
    assert len(compressed) * 4 < len(text)
    assert compressor.decompress(compressed) == text


@given(st.binary(max_size=20_000), st.binary(max_size=20_000))
def test_whatever_the_first_object_anything_comes_back_as_it_went_in(
    sample: bytes, data: bytes
) -> None:
    compressor = Compressor(sample)
    assert compressor.decompress(compressor.compress(data)) == data


def stored_size(cache: Informer, key: str) -> int:
    return len(cache._store[key].text)


def pods_cache() -> Informer:
    return Informer(client=None, resource=Resource("", "v1", "pods"))  # type: ignore[arg-type]


def test_an_object_is_compressed_once_it_has_stayed_unchanged() -> None:
    cache = pods_cache()
    before = time.monotonic()
    for name in ("first", "second"):
        cache.apply({"type": "ADDED", "object": pod(name)})
    json_size = len(orjson.dumps(pod("second")))
    assert not cache.compress_settled(before)
    assert stored_size(cache, "shop/second") == json_size
    assert not cache.compress_settled(time.monotonic())
    assert stored_size(cache, "shop/second") * 4 < json_size
    assert cache.get("shop/second") == pod("second")
    names = sorted(cached["metadata"]["name"] for cached in cache.items("shop"))
    assert names == ["first", "second"]


def test_a_change_starts_an_objects_wait_again() -> None:
    cache = pods_cache()
    for name in ("a", "b"):
        cache.apply({"type": "ADDED", "object": pod(name)})
    changed = pod("a") | {"status": {"phase": "Succeeded"}}
    cache.apply({"type": "MODIFIED", "object": changed})
    cache.apply({"type": "ADDED", "object": pod("c")})
    cache.apply({"type": "DELETED", "object": pod("c")})
    assert cache.compress_settled(time.monotonic(), limit=1), "a settled one is left"
    assert stored_size(cache, "shop/a") == len(orjson.dumps(changed))
    assert stored_size(cache, "shop/b") < len(orjson.dumps(pod("b"))) // 4
    assert not cache.compress_settled(time.monotonic(), limit=1)
    assert cache.get("shop/a") == changed and cache.keys() == ["shop/a", "shop/b"]


class Lists:
    """A server that answers each list with the next of ``snapshots``."""

    def __init__(self, *snapshots: list[JSON]) -> None:
        self.snapshots = list(snapshots)

    async def list_pages(self, resource: Resource, namespace: str | None, **query: Any) -> Any:
        yield {
            "kind": "PodList",
            "metadata": {"resourceVersion": "9"},
            "items": self.snapshots.pop(0),
        }


async def test_objects_cached_before_a_relist_are_told_deleted_as_they_were() -> None:
    server = Lists([pod("a"), pod("b")], [pod("b")])
    cache = Informer(server, Resource("", "v1", "pods"))  # type: ignore[arg-type]
    recorder = Recorder()
    deleted: list[JSON] = []
    cache.add_handler(recorder)
    cache.add_handler(FunctionHandler(delete=deleted.append))
    await cache._relist()
    cache.apply({"type": "ADDED", "object": pod("c")})
    await cache._relist()
    assert deleted == [pod("a"), pod("c")]
    assert cache.get("shop/b") == pod("b")
    assert [event for event in recorder.events if event[0] == "delete"] == [
        ("delete", "shop/a"),
        ("delete", "shop/c"),
    ]


class ExpiringBetweenPages:
    """A server whose second page is refused 410 Expired, as when etcd compacts the first
    page's snapshot away; a list in one piece gives what is there now."""

    def __init__(self) -> None:
        self.whole_lists: list[dict[str, Any]] = []

    async def list_pages(self, resource: Resource, namespace: str | None, **query: Any) -> Any:
        yield {
            "kind": "PodList",
            "metadata": {"resourceVersion": "9", "continue": "next"},
            "items": [pod("a"), pod("b")],
        }
        raise ApiError(410, {"reason": "Expired", "message": "continue token too old"})

    async def list(self, resource: Resource, namespace: str | None, **query: Any) -> JSON:
        self.whole_lists.append(query)
        return {"kind": "PodList", "metadata": {"resourceVersion": "12"}, "items": [pod("b")]}


async def test_a_list_expiring_between_pages_is_taken_in_one_piece() -> None:
    server = ExpiringBetweenPages()
    cache = Informer(server, Resource("", "v1", "pods"), label_selector="app=shop")  # type: ignore[arg-type]
    recorder = Recorder()
    cache.add_handler(recorder)
    await cache._relist()
    assert server.whole_lists == [{"labelSelector": "app=shop", "fieldSelector": None}]
    assert cache.keys() == ["shop/b"], "a is gone since the first page"
    assert cache.resource_version == "12"
    assert recorder.events == [("add", "shop/b")]


class ExpiringAtOnce(ExpiringBetweenPages):
    async def list_pages(self, resource: Resource, namespace: str | None, **query: Any) -> Any:
        raise ApiError(410, {"reason": "Expired", "message": "too old"})
        yield {}


async def test_a_list_refused_on_its_first_page_is_not_taken_in_one_piece() -> None:
    server = ExpiringAtOnce()
    cache = Informer(server, Resource("", "v1", "pods"))  # type: ignore[arg-type]
    with pytest.raises(ApiError):
        await cache._relist()
    assert server.whole_lists == []


async def test_an_object_made_again_under_its_name_while_not_watching_is_a_delete_and_add() -> None:
    """A StatefulSet's pod deleted and made again while the watch was down: told as an
    update, a handler keyed by UID never heard the old one end (its held room, its copy
    lingered)."""
    web = {**pod("web-0"), "metadata": {**pod("web-0")["metadata"], "resourceVersion": "1"}}
    again = {**web, "metadata": {**web["metadata"], "uid": "uid-2", "resourceVersion": "5"}}
    changed = {**again, "metadata": {**again["metadata"], "resourceVersion": "8"}}
    server = Lists([web], [again], [changed])
    cache = Informer(server, Resource("", "v1", "pods"))  # type: ignore[arg-type]
    seen: list[tuple[str, str]] = []
    cache.add_handler(
        FunctionHandler(
            add=lambda o: seen.append(("add", o["metadata"]["uid"])),
            update=lambda o: seen.append(("update", o["metadata"]["uid"])),
            delete=lambda o: seen.append(("delete", o["metadata"]["uid"])),
        )
    )
    await cache._relist()
    await cache._relist()
    await cache._relist()
    assert seen == [
        ("add", "uid-of-web-0"),
        ("delete", "uid-of-web-0"),
        ("add", "uid-2"),
        ("update", "uid-2"),  # the same pod changed: an update
    ]


def test_cached_objects_carry_no_managed_fields() -> None:
    cache = informer()
    managed = obj("a", "1")
    managed["metadata"]["managedFields"] = [{"manager": "kubectl", "fieldsV1": {"f:data": {}}}]
    cache.apply({"type": "ADDED", "object": managed})
    assert "managedFields" not in cache.get("ns/a")["metadata"]  # type: ignore[index]


def test_a_modified_event_for_an_unknown_object_is_an_add() -> None:
    cache = informer()
    recorder = Recorder()
    cache.add_handler(recorder)
    cache.apply({"type": "MODIFIED", "object": obj("late", "3")})
    assert recorder.events == [("add", "ns/late")]


def test_a_failing_handler_does_not_stop_the_others() -> None:
    cache = informer()
    recorder = Recorder()

    def broken(_o: JSON) -> None:
        raise RuntimeError("bug in a handler")

    cache.add_handler(FunctionHandler(add=broken))
    cache.add_handler(recorder)
    cache.apply({"type": "ADDED", "object": obj("a", "1")})
    assert recorder.events == [("add", "ns/a")]
    assert cache.get("ns/a") is not None


def test_handler_added_after_sync_hears_the_cached_objects() -> None:
    cache = informer()
    cache.apply({"type": "ADDED", "object": obj("a", "1")})
    cache.synced.set()
    recorder = Recorder()
    cache.add_handler(recorder)
    assert recorder.events == [("add", "ns/a")]


def test_function_handler_on_any_maps_every_event_to_one_callback() -> None:
    seen: list[str] = []
    handler = FunctionHandler.on_any(lambda o: seen.append(object_key(o)))
    handler.on_add(obj("a", "1"))
    handler.on_update(obj("b", "2"))
    handler.on_delete(obj("c", "1"))
    assert seen == ["ns/a", "ns/b", "ns/c"]


class UnreachableAtFirst:
    """A server that refuses the first list (as one that is down, or with ``refusal``),
    then answers it and holds the watch open."""

    def __init__(self, refusal: Exception | None = None) -> None:
        self.lists = 0
        self.refused = asyncio.Event()
        self.refusal = refusal or ConnectionRefusedError("connect call failed")

    async def list_pages(self, resource: Resource, namespace: str | None, **query: Any) -> Any:
        self.lists += 1
        if self.lists == 1:
            self.refused.set()
            raise self.refusal
        yield {
            "kind": "ConfigMapList",
            "metadata": {"resourceVersion": "7"},
            "items": [obj("a", "5")],
        }

    async def watch(self, *args: Any, **kwargs: Any) -> AsyncIterator[JSON]:
        await asyncio.Event().wait()
        yield {}


async def test_resume_ends_the_pause_between_retries_at_once() -> None:
    server = UnreachableAtFirst()
    an_hour = Backoff(initial=3600, jitter=0)
    cache = Informer(server, Resource("", "v1", "configmaps"), backoff=an_hour)  # type: ignore[arg-type]
    running = asyncio.create_task(cache.run())
    try:
        await server.refused.wait()
        await asyncio.sleep(0.05)
        assert not cache.synced.is_set(), "paused for an hour after the refused list"
        cache.resume()
        await asyncio.wait_for(cache.synced.wait(), 30)
        assert server.lists == 2 and cache.keys() == ["ns/a"]
    finally:
        running.cancel()


async def test_a_wait_the_server_asks_for_is_no_longer_than_the_backoffs_cap() -> None:
    """A proxy answering Retry-After: 3600 froze the cache for an hour."""
    server = UnreachableAtFirst(ApiError(429, "slow down", retry_after=3600))
    quick = Backoff(initial=0.01, cap=0.05, jitter=0)
    cache = Informer(server, Resource("", "v1", "configmaps"), backoff=quick)  # type: ignore[arg-type]
    running = asyncio.create_task(cache.run())
    try:
        await asyncio.wait_for(cache.synced.wait(), 5)
        assert server.lists == 2
    finally:
        running.cancel()


async def test_a_running_informer_compresses_what_it_listed_and_stops_with_it() -> None:
    server = UnreachableAtFirst()
    at_once = Backoff(initial=0.01, jitter=0)
    cache = Informer(server, Resource("", "v1", "configmaps"), backoff=at_once, settle_seconds=0.01)  # type: ignore[arg-type]
    running = asyncio.create_task(cache.run())
    await asyncio.wait_for(cache.synced.wait(), 30)
    for _ in range(500):
        await asyncio.sleep(0.01)
        if cache._store["ns/a"].compressor is not None:
            break
    assert cache._store["ns/a"].compressor is not None
    assert cache.get("ns/a") == obj("a", "5", kind="ConfigMap", apiVersion=None)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert [task for task in asyncio.all_tasks() if task is not asyncio.current_task()] == []


class WatchAnswering:
    """A server whose lists answer at once and whose watches answer ``watch_error`` (an
    ApiError raised), or end at once with nothing when it is None, or send ``events``;
    counts both."""

    def __init__(self, watch_error: ApiError | None, events: tuple[JSON, ...] = ()) -> None:
        self.watch_error = watch_error
        self.events = events
        self.lists = 0
        self.watches = 0

    async def list_pages(self, resource: Resource, namespace: str | None, **query: Any) -> Any:
        self.lists += 1
        yield {"kind": "ConfigMapList", "metadata": {"resourceVersion": "7"}, "items": []}

    async def watch(self, *args: Any, **kwargs: Any) -> AsyncIterator[JSON]:
        self.watches += 1
        if self.watch_error is not None:
            raise self.watch_error
        for event in self.events:
            yield event


async def run_for(server: WatchAnswering, seconds: float) -> None:
    paused = Backoff(initial=0.1, cap=0.1, jitter=0)
    cache = Informer(server, Resource("", "v1", "configmaps"), backoff=paused)  # type: ignore[arg-type]
    running = asyncio.create_task(cache.run())
    await asyncio.sleep(seconds)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


@pytest.mark.parametrize(
    "error",
    [
        ApiError(410, {"reason": "Expired", "code": 410}, "WATCH"),
        # A Status without its code (a proxy's), which the client takes for a 500.
        ApiError(500, {"reason": "Expired"}, "WATCH"),
        # The server's etcd restored from a backup: its resourceVersions went back.
        ApiError(
            504,
            {
                "reason": "Timeout",
                "message": "Too large resource version: 900, current: 12",
                "details": {"causes": [{"reason": "ResourceVersionTooLarge"}]},
            },
            "WATCH",
        ),
    ],
    ids=["gone", "expired without a code", "too large"],
)
async def test_a_watch_from_a_version_the_server_lacks_lists_again_after_a_pause(
    error: ApiError,
) -> None:
    server = WatchAnswering(error)
    await run_for(server, 0.5)
    # One list and watch per 0.1 s pause, not thousands back to back; a list each time.
    assert 2 <= server.lists <= 7 and server.watches in (server.lists, server.lists - 1)


@pytest.mark.parametrize("status", [403, 429, 500])
async def test_other_watch_errors_retry_the_watch_not_the_list(status: int) -> None:
    server = WatchAnswering(ApiError(status, {"code": status}, "WATCH"))
    await run_for(server, 0.5)
    assert server.lists == 1 and 2 <= server.watches <= 7


async def test_an_event_without_metadata_lists_again_and_the_informer_runs_on() -> None:
    # Were the task to end, the cache would stay as it was with nobody told.
    server = WatchAnswering(None, ({"type": "ADDED", "object": {"kind": "ConfigMap"}},))
    await run_for(server, 0.5)
    assert 2 <= server.lists <= 7 and server.watches in (server.lists, server.lists - 1)


async def test_an_event_that_keeps_failing_lets_the_pause_before_the_relist_grow() -> None:
    """The backoff is reset by an event applied, not by one received: reset before, the
    pause stayed at its first step and the cache relisted everything that often."""
    server = WatchAnswering(None, ({"type": "ADDED", "object": {"kind": "ConfigMap"}},))
    growing = Backoff(initial=0.05, cap=10, jitter=0)
    cache = Informer(server, Resource("", "v1", "configmaps"), backoff=growing)  # type: ignore[arg-type]
    running = asyncio.create_task(cache.run())
    await asyncio.sleep(0.6)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    # Pauses of 0.05, 0.1, 0.2 and 0.4 s: four lists at most, not one every 0.05 s.
    assert 2 <= server.lists <= 4


async def test_a_watch_that_ends_at_once_with_nothing_is_opened_again_after_a_pause() -> None:
    server = WatchAnswering(None)
    await run_for(server, 0.5)
    assert server.lists == 1 and 2 <= server.watches <= 7


def silent_watches() -> tuple[web.Application, list[str], asyncio.Event, asyncio.Event]:
    """An apiserver whose watches send one event and then nothing, not even a bookmark,
    as a connection whose peer vanished; the resourceVersions watched from are listed,
    and the first event is set at the third watch."""
    watched_from: list[str] = []
    thrice, ended = asyncio.Event(), asyncio.Event()

    async def configmaps(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") != "true":
            return web.json_response(
                {"kind": "ConfigMapList", "metadata": {"resourceVersion": "7"}, "items": []}
            )
        watched_from.append(request.query["resourceVersion"])
        if len(watched_from) == 3:
            thrice.set()
        response = web.StreamResponse()
        await response.prepare(request)
        added = obj(f"cm-{len(watched_from)}", str(7 + len(watched_from)), kind="ConfigMap")
        await response.write(orjson.dumps({"type": "ADDED", "object": added}) + b"\n")
        await ended.wait()
        return response

    app = web.Application()
    app.router.add_get("/api/v1/configmaps", configmaps)
    return app, watched_from, thrice, ended


async def test_a_silent_watch_is_opened_again_from_where_it_was(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app, watched_from, thrice, ended = silent_watches()
    async with serving_over_tls(tmp_path, app) as server:
        settings = ClientSettings(str(server.kubeconfig(tmp_path)))
        async with await KubeClient.connect(settings) as client:
            cache = Informer(client, Resource("", "v1", "configmaps"), silence_seconds=0.5)
            running = asyncio.create_task(cache.run())
            try:
                await asyncio.wait_for(thrice.wait(), 30)
            finally:
                running.cancel()
                ended.set()
                with pytest.raises(asyncio.CancelledError):
                    await running
    # Listed once; each watch from the version its predecessor brought, without a pause.
    assert watched_from[:3] == ["7", "8", "9"] and cache.relists == 1
    assert {"ns/cm-1", "ns/cm-2", "ns/cm-3"} <= set(cache.keys())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_backoff_grows_with_jitter_and_resets() -> None:
    backoff = Backoff(initial=1, cap=8, jitter=0.5)
    delays = [backoff.next_delay() for _ in range(6)]
    for delay, base in zip(delays, [1, 2, 4, 8, 8, 8], strict=True):
        assert base <= delay <= base * 1.5
    backoff.reset()
    assert backoff.next_delay() <= 1.5


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64, 10_000])
def test_line_splitter_is_independent_of_chunking(chunk_size: int) -> None:
    big = b'{"x":"' + b"y" * 200_000 + b'"}'
    stream = b'{"a":1}\n\n' + big + b"\n" + b'{"b":2}\n' + b'{"partial"'
    splitter = LineSplitter()
    lines: list[bytes] = []
    for start in range(0, len(stream), chunk_size):
        lines += splitter.feed(stream[start : start + chunk_size])
    assert lines == [b'{"a":1}', big, b'{"b":2}']


async def test_an_informer_asked_of_a_factory_started_empty_runs() -> None:
    """Started with no informer, the factory took a later one for not started yet: it
    never ran, and waiting for the caches waited for good."""
    factory = InformerFactory(WatchAnswering(None))  # type: ignore[arg-type]
    factory.start()
    cache = factory.informer(Resource("", "v1", "configmaps"))
    try:
        await asyncio.wait_for(factory.wait_synced(), 5)
        assert cache.synced.is_set()
    finally:
        await factory.stop()
