"""Admission latency of `kubestrata webhook` at a steady request rate.

    .venv/bin/python bench/webhook_admission.py [--rate 200] [--seconds 30] [--rounds 3]

Starts the real webhook (`kubestrata webhook`, its own process, TLS) and, as the direct
path, a bare aiohttp HTTPS server in its own process that answers every review with a
fixed "allowed" without reading it. Both get the same AdmissionReview of a pod with a
nodeSelector, node affinity, pod anti-affinity and topology spread (what the webhook
has most work for), sent open-loop at a fixed rate over keep-alive connections, the way
the apiserver calls webhooks. Latency counts from the scheduled send time, so a stall
shows up in the figures instead of silently lowering the rate. Each round loads the
direct server, then the webhook; per round p50/p99/max both ways, then over ``--rounds``
the median and min-max of each and of what the webhook adds at p50, and the target
(webhook p99 <= 5 ms) judged on the median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from common import judge, spread

from harness.localcluster import free_port
from kubekit import keys, pki

DIRECT = "direct (bare HTTPS server)"
WEBHOOK = "kubestrata webhook"


def review(index: int) -> dict[str, Any]:
    term = {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}
    spec = {
        "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
        "nodeSelector": {"disk": "ssd", keys.CLUSTER_ID_LABEL: "lower-1"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            },
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app": "web"}},
                    }
                ]
            },
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app": "web"}},
            }
        ],
        "tolerations": [{"key": "dedicated", "operator": "Exists"}],
    }
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": f"uid-{index}",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": "bench",
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"web-{index}",
                    "namespace": "bench",
                    "labels": {"app": "web"},
                },
                "spec": spec,
            },
        },
    }


def serve_baseline(port: int, cert: str, key: str) -> None:
    """The direct path: HTTPS + aiohttp + a fixed answer, nothing of ours."""
    body = json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": "x", "allowed": True},
        }
    ).encode()

    async def allow(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/mutate", allow)
    app.router.add_get("/healthz", healthz)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    web.run_app(app, host="127.0.0.1", port=port, ssl_context=context, print=None, access_log=None)


async def wait_healthy(session: aiohttp.ClientSession, base: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            async with session.get(f"{base}/healthz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base} not healthy after 30 s")
        await asyncio.sleep(0.2)


async def load(base: str, ca: Path, rate: float, seconds: float) -> tuple[list[float], int]:
    """Open-loop POSTs at ``rate``/s; returns latencies (ms) and the count of bad answers."""
    context = ssl.create_default_context(cafile=str(ca))
    bodies = [json.dumps(review(i)).encode() for i in range(256)]
    latencies: list[float] = []
    failures = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=64)) as s:
        await wait_healthy(s, base)

        async def one(index: int, scheduled: float) -> None:
            nonlocal failures
            async with s.post(
                f"{base}/mutate",
                data=bodies[index % len(bodies)],
                headers={"Content-Type": "application/json"},
            ) as response:
                answer = await response.json()
                if response.status != 200 or not answer["response"]["allowed"]:
                    failures += 1
            latencies.append((time.perf_counter() - scheduled) * 1000)

        for warm in range(50):
            await one(warm, time.perf_counter())
        latencies.clear()
        start = time.perf_counter()
        tasks = []
        for index in range(int(rate * seconds)):
            scheduled = start + index / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, scheduled)))
        await asyncio.gather(*tasks)
    return latencies, failures


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3, help="default %(default)s")
    parser.add_argument(
        "--serve-baseline", nargs=3, metavar=("PORT", "CERT", "KEY"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.serve_baseline:
        port, cert, key = args.serve_baseline
        serve_baseline(int(port), cert, key)
        return
    with tempfile.TemporaryDirectory(prefix="kubestrata-bench-") as workdir:
        pair = pki.serving_pair(Path(workdir), "bench", ("127.0.0.1",))
        ca = pki.ca_path(pair)
        webhook_port, baseline_port = free_port(), free_port()
        servers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kubekit.cli",
                    "webhook",
                    f"--listen=127.0.0.1:{webhook_port}",
                    f"--tls-cert-file={pair.cert_path}",
                    f"--tls-key-file={pair.key_path}",
                    "--log-level=WARNING",
                ]
            ),
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--serve-baseline",
                    str(baseline_port),
                    str(pair.cert_path),
                    str(pair.key_path),
                ]
            ),
        ]
        try:
            p99s: dict[str, list[float]] = {DIRECT: [], WEBHOOK: []}
            p50s: dict[str, list[float]] = {DIRECT: [], WEBHOOK: []}
            for number in range(1, args.rounds + 1):
                print(f"round {number}/{args.rounds}:")
                for name, port in ((DIRECT, baseline_port), (WEBHOOK, webhook_port)):
                    latencies, failures = asyncio.run(
                        load(f"https://127.0.0.1:{port}", ca, args.rate, args.seconds)
                    )
                    if failures:
                        raise SystemExit(f"{name}: {failures} requests failed")
                    p50s[name].append(statistics.median(latencies))
                    p99s[name].append(percentile(latencies, 0.99))
                    print(
                        f"    {name:28} {len(latencies)} requests at {args.rate:.0f}/s: "
                        f"p50 {p50s[name][-1]:.2f} ms, p99 {p99s[name][-1]:.2f} ms, "
                        f"max {max(latencies):.2f} ms"
                    )
            print(f"over {args.rounds} rounds: median (min-max)")
            for name in (DIRECT, WEBHOOK):
                print(
                    f"    {name:28} p50 {spread(p50s[name], '.2f')} ms, "
                    f"p99 {spread(p99s[name], '.2f')} ms"
                )
            added = [
                ours - direct for ours, direct in zip(p50s[WEBHOOK], p50s[DIRECT], strict=True)
            ]
            print(f"    {'added by the webhook, p50':28} {spread(added, '+.2f')} ms")
            print("targets (judged on the median):")
            judge("webhook p99 <= 5 ms", p99s[WEBHOOK], lambda v: v <= 5, ".2f")
        finally:
            for server in servers:
                server.terminate()
                server.wait(10)


if __name__ == "__main__":
    main()
