"""Faults during mirroring, and what the federation converges to: three scenarios a round.

    .venv/bin/python bench/chaos.py [--rounds 3] [--pods 1000] [--seed N] [--state-dir DIR]

One federation (1 upper + 1 lower cluster of kwok nodes, one virtual node) for every
round. The virtual node reaches its lower apiserver through a TCP relay of this script,
which can cut every connection through it (only the virtual node's: the lower cluster and
its other clients carry on). Three scenarios, each run ``--rounds`` times in a row (the
later two restart kwok, which is slow to start new pods for a while after):

- kill: ``--pods`` pods bound to the virtual node (``spec.nodeName``) created at once; the
  virtual node is killed (SIGKILL) and started again at once 5 times, at random moments
  (``--seed``) of the burst's first ``--kill-window`` seconds. Figures: lost (upper pods
  not Running, or with no lower pod, once settled), duplicated (lower pods beyond one per
  upper pod), seconds from the last restart to every pod Running.
- outage: 100 pods Running; the lower kube-apiserver stopped for 60 s; meanwhile 10 of
  the pods are deleted with ``--grace-period=30`` and 10 with ``--force --grace-period=0``
  above. Figures:
  seconds from the stop to the Node NotReady (the upper node-monitor grace is 50 s),
  what upper users saw at the end of the outage (pod phases and Ready conditions, the
  events of the namespace), and after the return: seconds to the Node Ready, lower pods
  of the deleted ones left, lower pods duplicated, seconds until the lower pods are
  exactly the upper ones.
- compaction: 50 pods Running; the relay cuts the virtual node off its lower apiserver;
  meanwhile foreign pods are created and deleted below, etcd is compacted at its current
  revision and the lower apiserver restarted, so its watch cache begins after every
  resourceVersion the virtual node holds; then the relay lets it through again. Figures:
  watches answered 410 Gone and listed again (from the virtual node's log), pods the
  virtual node created or deleted after the return (from its /metrics; 0 is right, as
  nothing changed for its pods).

Targets (every round must meet them: a pod lost once is lost): kill: 0 lost, 0
duplicated, all Running within 30 s of the last restart; outage: NotReady within the
node-monitor grace (50 s), 0 deleted pods left below, 0 duplicated; compaction: a relist
after 410, 0 spurious creates, 0 spurious deletes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import random
import re
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from common import delete_namespaces, judge, spread, upper_and_one_lower, wait_no_pods

from harness.federation import Federation, virtual_node_name
from harness.localcluster import LocalCluster
from harness.process import ManagedProcess
from harness.toolchain import Toolchain
from kubekit import keys
from kubekit.client import NAMESPACES, PODS, ClientSettings, KubeClient

NODE = keys.default_node_name("lower-1")
KILLS = 5
OUTAGE_PODS = 100
OUTAGE_SECONDS = 60
DELETED_GRACEFULLY = 10
DELETED_BY_FORCE = 10
COMPACTION_PODS = 50
NODE_MONITOR_GRACE = 50.0
RUNNING_AFTER_LAST_RESTART = 30.0


class Relay:
    """A TCP relay to one address, on a thread of its own, that can cut every connection
    through it and refuse new ones until it is let through again."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self._open = True
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        started.wait()

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", 0)
        )
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self._loop.run_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._open:
            writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, upstream_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while chunk := await source.read(65536):
                    sink.write(chunk)
                    await sink.drain()
            except OSError:
                pass
            finally:
                sink.close()
                self._writers.discard(sink)

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    def cut(self) -> None:
        def close_all() -> None:
            self._open = False
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()

        self._loop.call_soon_threadsafe(close_all)

    def let_through(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_open", True)


def relayed_kubeconfig(kubeconfig: str, relay: Relay, path: Path) -> Path:
    """The kubeconfig with its server on the relay's port (the apiserver's certificate
    names 127.0.0.1, whatever the port)."""
    config = yaml.safe_load(Path(kubeconfig).read_text())
    for cluster in config["clusters"]:
        server = cluster["cluster"]["server"]
        cluster["cluster"]["server"] = re.sub(r":\d+$", f":{relay.port}", server)
    path.write_text(yaml.safe_dump(config))
    return path


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
        },
    }


async def create_pods(cluster: LocalCluster, namespace: str, count: int) -> None:
    async with await KubeClient.connect(
        ClientSettings(str(cluster.kubeconfig), qps=0, burst=1)
    ) as client:
        await client.create(
            NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        )
        limit = asyncio.Semaphore(64)

        async def create(index: int) -> None:
            async with limit:
                await client.create(PODS, pod(f"p-{index:05d}"), namespace)

        await asyncio.gather(*(create(i) for i in range(count)))


def pods(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    found = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json", timeout=120)
    return list(json.loads(found.stdout)["items"])


def running(items: list[dict[str, Any]]) -> int:
    return sum(1 for p in items if (p.get("status") or {}).get("phase") == "Running")


def lower_by_upper_uid(lower: LocalCluster, namespace: str) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for item in pods(lower, namespace):
        uid = (item["metadata"].get("annotations") or {}).get(keys.UPPER_UID_ANNOTATION)
        if uid:
            counts[uid] += 1
    return dict(counts)


def node_ready(upper: LocalCluster) -> str:
    node = json.loads(upper.kubectl("get", "node", NODE, "-o", "json").stdout)
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    return str(ready[0]["status"]) if ready else "Unknown"


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 1.0) -> float | None:
    """Seconds until ``check`` holds, or None if it did not within ``timeout``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if check():
            return time.monotonic() - began
        time.sleep(interval)
    return None


def clean(federation: Federation, namespace: str) -> None:
    asyncio.run(delete_namespaces(federation.upper, [namespace]))
    asyncio.run(wait_no_pods(federation.clusters["lower-1"], [namespace]))


@dataclass
class Round:
    lost: float = 0.0
    duplicated: float = 0.0
    running_after_restart: float | None = None
    not_ready_after: float | None = None
    ready_after_return: float | None = None
    deleted_left: float = 0.0
    outage_duplicated: float = 0.0
    converged_after_return: float | None = None
    seen_above: dict[str, int] = field(default_factory=dict)
    events_above: dict[str, int] = field(default_factory=dict)
    relists: float = 0.0
    spurious_creates: float = 0.0
    spurious_deletes: float = 0.0


def kill_during_burst(
    federation: Federation,
    virtual_node: ManagedProcess,
    args: argparse.Namespace,
    rng: random.Random,
    number: int,
    result: Round,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-1"]
    namespace = f"kill-{number}"
    moments = sorted(rng.uniform(0.5, args.kill_window) for _ in range(KILLS))
    print(f"    kill: {args.pods} pods; SIGKILL at {', '.join(f'{m:.1f}' for m in moments)} s")
    burst = threading.Thread(target=asyncio.run, args=(create_pods(upper, namespace, args.pods),))
    began = time.monotonic()
    burst.start()
    for moment in moments:
        time.sleep(max(0.0, began + moment - time.monotonic()))
        virtual_node.kill()
        virtual_node.start()
    last_restart = time.monotonic()
    burst.join()
    settled = wait_until(
        lambda: running(pods(upper, namespace)) == args.pods, timeout=600, interval=1.0
    )
    result.running_after_restart = None if settled is None else time.monotonic() - last_restart
    above = pods(upper, namespace)
    below = lower_by_upper_uid(lower, namespace)
    result.lost = float(
        args.pods
        - sum(
            1
            for p in above
            if p["status"].get("phase") == "Running" and p["metadata"]["uid"] in below
        )
    )
    result.duplicated = float(sum(n - 1 for n in below.values()))
    print(
        f"        lost {result.lost:.0f}, duplicated {result.duplicated:.0f}, all Running "
        f"{'never' if settled is None else f'{result.running_after_restart:.1f} s'} after "
        "the last restart"
    )
    clean(federation, namespace)


def lower_unreachable(federation: Federation, number: int, result: Round) -> None:
    upper, lower = federation.upper, federation.clusters["lower-1"]
    namespace = f"outage-{number}"
    asyncio.run(create_pods(upper, namespace, OUTAGE_PODS))
    wait_until(lambda: running(pods(upper, namespace)) == OUTAGE_PODS, timeout=300)
    print(f"    outage: {OUTAGE_PODS} pods Running; lower apiserver stopped for {OUTAGE_SECONDS} s")
    lower.stop_component("kube-apiserver")
    stopped = time.monotonic()
    names = sorted(p["metadata"]["name"] for p in pods(upper, namespace))
    graceful = names[:DELETED_GRACEFULLY]
    forced = names[DELETED_GRACEFULLY : DELETED_GRACEFULLY + DELETED_BY_FORCE]
    time.sleep(10)
    # The pods ask for no grace period (a quick burst); these deletes give one, so they
    # wait above, terminating, until the virtual node deletes them below.
    upper.kubectl("delete", "pods", "-n", namespace, "--wait=false", "--grace-period=30", *graceful)
    upper.kubectl("delete", "pods", "-n", namespace, "--force", "--grace-period=0", *forced)
    while time.monotonic() < stopped + OUTAGE_SECONDS:
        if result.not_ready_after is None and node_ready(upper) != "True":
            result.not_ready_after = time.monotonic() - stopped
        time.sleep(0.5)
    seen = pods(upper, namespace)
    result.seen_above = dict(
        Counter(
            f"{p['status'].get('phase')}"
            + (" terminating" if p["metadata"].get("deletionTimestamp") else "")
            + ", Ready="
            + next(
                (c["status"] for c in p["status"].get("conditions") or [] if c["type"] == "Ready"),
                "-",
            )
            for p in seen
        )
    )
    events = json.loads(upper.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    result.events_above = dict(Counter(e["reason"] for e in events["items"]))
    lower.restart("kube-apiserver")
    returned = time.monotonic()
    result.ready_after_return = wait_until(lambda: node_ready(upper) == "True", timeout=180)
    kept = {p["metadata"]["uid"] for p in seen if p["metadata"]["name"] not in graceful}

    def converged() -> bool:
        above = {p["metadata"]["uid"] for p in pods(upper, namespace)}
        below = lower_by_upper_uid(lower, namespace)
        return above == kept and set(below) == kept and all(n == 1 for n in below.values())

    settled = wait_until(converged, timeout=300, interval=2)
    result.converged_after_return = None if settled is None else time.monotonic() - returned
    below = lower_by_upper_uid(lower, namespace)
    result.deleted_left = float(len(set(below) - kept))
    result.outage_duplicated = float(sum(n - 1 for n in below.values()))
    print(
        f"        NotReady {fmt_seconds(result.not_ready_after)} after the stop; seen above at "
        f"the end of the outage: {result.seen_above}; events: {result.events_above}"
    )
    print(
        f"        after the return: Ready in {fmt_seconds(result.ready_after_return)}, lower "
        f"pods exactly the upper ones in {fmt_seconds(result.converged_after_return)}; "
        f"deleted pods left below {result.deleted_left:.0f}, duplicated "
        f"{result.outage_duplicated:.0f}"
    )
    clean(federation, namespace)


def fmt_seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def etcd_compact(cluster: LocalCluster) -> int:
    """Compacts a local cluster's etcd at its current revision (its JSON gateway)."""
    url = f"http://127.0.0.1:{cluster.ports.etcd_client}/v3/kv"

    def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{url}/{path}", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return dict(json.loads(response.read()))

    key = base64.b64encode(b"/").decode()
    revision = int(call("range", {"key": key, "limit": 1})["header"]["revision"])
    call("compaction", {"revision": revision, "physical": True})
    return revision


SAMPLE = re.compile(r"^rest_client_requests_total\{([^}]*)\} (\S+)$", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def pod_writes(metrics_url: str) -> Counter[str]:
    """The virtual node's answered requests that created or deleted pods, by verb (its
    upper side neither creates pods nor, here, deletes them)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    counts: Counter[str] = Counter()
    for labels, value in SAMPLE.findall(text):
        label = dict(LABEL.findall(labels))
        if label.get("resource") == "pods" and label.get("code", "").startswith("2"):
            counts[label.get("verb", "")] += int(float(value))
    return counts


def compaction_during_cut(
    federation: Federation,
    virtual_node: ManagedProcess,
    relay: Relay,
    metrics_url: str,
    number: int,
    result: Round,
) -> None:
    upper, lower = federation.upper, federation.clusters["lower-1"]
    namespace = f"compact-{number}"
    asyncio.run(create_pods(upper, namespace, COMPACTION_PODS))
    wait_until(lambda: running(pods(upper, namespace)) == COMPACTION_PODS, timeout=300)
    time.sleep(5)
    before = pod_writes(metrics_url)
    log_offset = len(virtual_node.log_path.read_text())
    relay.cut()
    foreign = f"foreign={number}"
    for index in range(20):
        lower.kubectl(
            "run", f"foreign-{number}-{index}", "--image=registry.k8s.io/pause:3.10",
            f"--labels={foreign}",
        )  # fmt: skip
    lower.kubectl("delete", "pods", "-l", foreign, "--grace-period=0", "--force")
    revision = etcd_compact(lower)
    lower.restart("kube-apiserver")
    print(
        f"    compaction: cut; foreign pods made and deleted; etcd compacted at {revision}; "
        "lower apiserver restarted"
    )
    relay.let_through()
    wait_until(
        lambda: "too old, listing again" in virtual_node.log_path.read_text()[log_offset:],
        timeout=120,
    )
    time.sleep(20)  # the relisted pods reconciled
    after = pod_writes(metrics_url)
    log = virtual_node.log_path.read_text()[log_offset:]
    result.relists = float(log.count("too old, listing again"))
    result.spurious_creates = float(after["POST"] - before["POST"])
    result.spurious_deletes = float(after["DELETE"] - before["DELETE"])
    print(
        f"        watches answered 410 and listed again: {result.relists:.0f}; pod creates "
        f"after the return {result.spurious_creates:.0f}, deletes {result.spurious_deletes:.0f}"
    )
    clean(federation, namespace)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pods", type=int, default=1000, help="pods of the kill scenario")
    parser.add_argument(
        "--kill-window", type=float, default=20.0, help="kills fall in the burst's first N s"
    )
    parser.add_argument("--seed", type=int, default=None, help="of the kill moments")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="keep the federation's state and logs here (default: a directory removed after)",
    )
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    specs = upper_and_one_lower(2, 600)
    with contextlib.ExitStack() as stack:
        state = (
            str(args.state_dir)
            if args.state_dir
            else stack.enter_context(tempfile.TemporaryDirectory(prefix="kubestrata-chaos-"))
        )
        federation = Federation(Path(state), specs, Toolchain.locate())
        federation.start()
        try:
            lower = federation.clusters["lower-1"]
            relay = Relay("127.0.0.1", lower.ports.apiserver)
            name = virtual_node_name("lower-1")
            arguments = federation.virtual_node_args(lower)
            lower_kubeconfig = next(a for a in arguments if a.startswith("--lower-kubeconfig="))
            relayed = relayed_kubeconfig(
                lower_kubeconfig.split("=", 1)[1], relay, Path(state) / "lower-relayed.kubeconfig"
            )
            arguments[arguments.index(lower_kubeconfig)] = f"--lower-kubeconfig={relayed}"
            health = next(a for a in arguments if a.startswith("--health-port="))
            metrics_url = f"http://127.0.0.1:{health.split('=', 1)[1]}/metrics"
            virtual_node = federation.start_component(name, arguments)
            if (
                wait_until(
                    lambda: (
                        federation.upper.kubectl("get", "node", NODE, check=False).returncode == 0
                        and node_ready(federation.upper) == "True"
                    ),
                    timeout=120,
                )
                is None
            ):
                raise SystemExit(f"{NODE} not Ready; log: {virtual_node.log_path}")
            print(f"seed {seed}; lower cluster: 2 kwok nodes; the virtual node through a relay")
            rounds = [Round() for _ in range(args.rounds)]
            # Each scenario's rounds in a row: the outage and the compaction restart the
            # lower apiserver and kwok, and a kwok just restarted is slow to start new pods
            # (38 s in a run where kill rounds followed them), which the kill figure would
            # charge to the virtual node.
            for number, result in enumerate(rounds, start=1):
                print(f"kill, round {number}/{args.rounds}:")
                kill_during_burst(federation, virtual_node, args, rng, number, result)
            for number, result in enumerate(rounds, start=1):
                print(f"outage, round {number}/{args.rounds}:")
                lower_unreachable(federation, number, result)
            for number, result in enumerate(rounds, start=1):
                print(f"compaction, round {number}/{args.rounds}:")
                compaction_during_cut(federation, virtual_node, relay, metrics_url, number, result)
        finally:
            federation.stop()
    summarize(rounds)


def summarize(rounds: list[Round]) -> None:
    def values(get: Callable[[Round], float | None]) -> list[float | None]:
        return [get(r) for r in rounds]

    n = len(rounds)
    print(f"over {n} round{'s' if n > 1 else ''}: median (min-max)")
    for title, get in (
        ("kill: seconds from the last restart to all Running", lambda r: r.running_after_restart),
        ("outage: seconds to NotReady", lambda r: r.not_ready_after),
        ("outage: seconds to Ready after the return", lambda r: r.ready_after_return),
        ("outage: seconds to lower pods = upper pods", lambda r: r.converged_after_return),
    ):
        measured = [v for v in values(get) if v is not None]
        print(f"    {title}: {spread(measured, '.1f')}")
    print("targets (every round):")
    never = float("inf")  # a figure never reached misses its target
    targets: list[tuple[str, Callable[[Round], float | None], Callable[[float], bool], str]] = [
        ("kill: 0 lost", lambda r: r.lost, lambda v: v == 0, ".0f"),
        ("kill: 0 duplicated", lambda r: r.duplicated, lambda v: v == 0, ".0f"),
        (
            f"kill: all Running within {RUNNING_AFTER_LAST_RESTART:.0f} s of the last restart",
            lambda r: never if r.running_after_restart is None else r.running_after_restart,
            lambda v: v <= RUNNING_AFTER_LAST_RESTART,
            ".1f",
        ),
        (
            f"outage: NotReady within the node-monitor grace ({NODE_MONITOR_GRACE:.0f} s)",
            lambda r: never if r.not_ready_after is None else r.not_ready_after,
            lambda v: v <= NODE_MONITOR_GRACE,
            ".1f",
        ),
        ("outage: 0 deleted pods left below", lambda r: r.deleted_left, lambda v: v == 0, ".0f"),
        ("outage: 0 duplicated", lambda r: r.outage_duplicated, lambda v: v == 0, ".0f"),
        ("compaction: listed again after 410", lambda r: r.relists, lambda v: v >= 1, ".0f"),
        ("compaction: 0 spurious creates", lambda r: r.spurious_creates, lambda v: v == 0, ".0f"),
        ("compaction: 0 spurious deletes", lambda r: r.spurious_deletes, lambda v: v == 0, ".0f"),
    ]
    for title, get, met, fmt in targets:
        judge(title, values(get), met, fmt, every_round=True)


if __name__ == "__main__":
    main()
