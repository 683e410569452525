"""`kubestrata webhook`: the HTTPS shell around webhook.admission."""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import urllib.parse
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from kubekit import keys, logs, stash
from kubekit.certreload import start_https_site
from kubekit.client import CONFIGMAPS, ApiError, ClientSettings, KubeClient, Resource
from kubekit.component import run_component
from kubekit.health import serve_metrics
from kubekit.informer import Informer
from kubekit.moves import Moves, parse_moves
from kubekit.serving import (
    add_serving_arguments,
    check_kubeconfig,
    check_serving_arguments,
    serving,
)
from webhook.admission import BadReview, keep_off_response, parse_review, review_response
from webhook.certificate import ca_bundle_patch
from webhook.configuration import CONFIGURATION_NAME, KEEP_OFF_PATH, PATH, url_configuration

log = logging.getLogger("webhook")

JSON = dict[str, Any]

MUTATING_WEBHOOK_CONFIGURATIONS = Resource(
    "admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations", namespaced=False
)
# An AdmissionReview of a pod is a few KiB; 3 MiB covers the largest object etcd stores.
MAX_BODY = 3 * 1024 * 1024


@dataclass(frozen=True)
class WebhookConfig:
    host: str
    port: int
    cert_file: Path
    key_file: Path
    keep_keys: frozenset[str]
    kubeconfig: str | None
    register_url: str | None
    inject_ca_bundle: str | None
    ca_file: Path | None
    follow_moves: bool = False


class MovesFollower:
    """The descheduler's records of moves (kubekit.moves), kept by a watch of their one
    ConfigMap and parsed once per change, not per admission."""

    def __init__(self) -> None:
        self.moves: Moves = {}

    def on_add(self, obj: JSON) -> None:
        self.moves = parse_moves(obj.get("data") or {})

    on_update = on_add

    def on_delete(self, _obj: JSON) -> None:
        self.moves = {}

    def informer(self, client: KubeClient) -> Informer:
        informer = Informer(
            client,
            CONFIGMAPS,
            namespace=keys.SYSTEM_NAMESPACE,
            field_selector=f"metadata.name={keys.MOVES_CONFIGMAP}",
        )
        informer.add_handler(self)
        return informer


def make_app(keep: Collection[str], follower: MovesFollower | None = None) -> web.Application:
    async def read_review(request: web.Request) -> JSON | web.Response:
        """The review the request carries, or the 400 answering it."""
        if request.content_type != "application/json":
            return _bad_request(
                f"Content-Type must be application/json, not {request.content_type}"
            )
        try:
            return parse_review(await request.read())
        except BadReview as error:
            return _bad_request(str(error))

    async def mutate(request: web.Request) -> web.Response:
        review = await read_review(request)
        if isinstance(review, web.Response):
            return review
        moves = follower.moves if follower is not None else None
        return web.json_response(review_response(review, keep, moves))

    async def keep_off(request: web.Request) -> web.Response:
        review = await read_review(request)
        if isinstance(review, web.Response):
            return review
        return web.json_response(keep_off_response(review))

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post(PATH, mutate)
    app.router.add_post(KEEP_OFF_PATH, keep_off)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", serve_metrics)
    return app


def _bad_request(message: str) -> web.Response:
    log.info("bad admission request: %s", message)
    return web.json_response(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "code": 400,
            "reason": "BadRequest",
            "message": message,
        },
        status=400,
    )


async def publish_ca_bundle(config: WebhookConfig) -> None:
    """Points the apiserver at us: applies the whole configuration for a URL, or puts our
    CA into an existing one (deployed from manifests/) for an in-cluster Service."""
    assert config.ca_file is not None
    ca_bundle = config.ca_file.read_bytes()
    async with await KubeClient.connect(ClientSettings(config.kubeconfig)) as client:
        if config.register_url is not None:
            desired = url_configuration(config.register_url, ca_bundle)
            try:
                current = await client.get(MUTATING_WEBHOOK_CONFIGURATIONS, CONFIGURATION_NAME)
            except ApiError as error:
                if error.status != 404:
                    raise
                await client.create(MUTATING_WEBHOOK_CONFIGURATIONS, desired)
            else:
                desired["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                await client.replace(MUTATING_WEBHOOK_CONFIGURATIONS, desired)
            log.info("registered %s for %s", CONFIGURATION_NAME, config.register_url)
        if config.inject_ca_bundle is not None:
            await inject_ca_bundle(client, config.inject_ca_bundle, lambda _published: ca_bundle)


async def inject_ca_bundle(
    client: KubeClient, name: str, bundle_of: Callable[[list[bytes]], bytes]
) -> None:
    """Puts a CA bundle into every webhook of the existing configuration ``name``, unless
    they all have it already: ``bundle_of`` the bundles its webhooks have now."""
    configuration = await client.get(MUTATING_WEBHOOK_CONFIGURATIONS, name)
    published = [
        base64.b64decode(webhook["clientConfig"].get("caBundle") or "")
        for webhook in configuration.get("webhooks") or []
    ]
    patch = ca_bundle_patch(configuration, bundle_of(published))
    if not patch:
        return
    await client.patch(
        MUTATING_WEBHOOK_CONFIGURATIONS, name, patch, patch_type="application/json-patch+json"
    )
    log.info("put our CA bundle into %s", name)


def check_register_url(
    parser: argparse.ArgumentParser, url: str, certificate_names: Sequence[str] | None
) -> None:
    """The URL registered must be one the apiserver can call: refused, every pod create of
    a federated namespace failed (the stash webhook fails closed). ``certificate_names``:
    those of the certificate this process generated (None: one given)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        parser.error(f"--register-url must be an https URL, not {url!r}")
    if parts.path != PATH:
        parser.error(f"--register-url must end in the path {PATH}, which is served, not {url!r}")
    if certificate_names is not None and parts.hostname not in certificate_names:
        parser.error(
            f"--register-url's host {parts.hostname} is not a name of the generated "
            f"certificate ({', '.join(certificate_names)}): add --server-name {parts.hostname}"
        )


def parse_args(argv: Sequence[str]) -> WebhookConfig:
    parser = argparse.ArgumentParser(
        prog="kubestrata webhook",
        description="Mutating admission webhook: stashes the scheduling fields of federated "
        "pods so the upper scheduler sees clusters, not lower nodes.",
    )
    add_serving_arguments(parser, "its certificate is the caBundle to publish")
    parser.add_argument(
        "--keep-key",
        action="append",
        default=[],
        help="label key that speaks about clusters and stays visible to the upper scheduler "
        f"(repeatable; always kept: {', '.join(sorted(stash.DEFAULT_KEEP_KEYS))})",
    )
    parser.add_argument(
        "--kubeconfig",
        help="for --register-url/--inject-ca-bundle/--follow-moves (default: in-cluster)",
    )
    parser.add_argument(
        "--follow-moves",
        action="store_true",
        help=f"keep the new pods of a controller off the virtual nodes the descheduler moved "
        f"its pods off (watches ConfigMap {keys.SYSTEM_NAMESPACE}/{keys.MOVES_CONFIGMAP})",
    )
    parser.add_argument(
        "--register-url",
        help=f"create or update MutatingWebhookConfiguration {CONFIGURATION_NAME} calling this "
        "https URL with our CA",
    )
    parser.add_argument(
        "--inject-ca-bundle",
        metavar="CONFIGURATION",
        help="put our CA into every webhook of this existing MutatingWebhookConfiguration",
    )
    parser.add_argument(
        "--ca-file", type=Path, help="the CA to publish (default: the generated one)"
    )
    logs.add_arguments(parser)
    args = parser.parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    check_serving_arguments(parser, args)
    listening = serving(parser, args, "webhook")
    ca_file = args.ca_file or listening.generated_ca
    if (args.register_url or args.inject_ca_bundle) and ca_file is None:
        parser.error("--register-url/--inject-ca-bundle need --ca-file with --tls-cert-file")
    if args.register_url is not None:
        check_register_url(parser, args.register_url, listening.names)
    if args.register_url or args.inject_ca_bundle or args.follow_moves:
        check_kubeconfig(parser, args.kubeconfig)
    return WebhookConfig(
        host=listening.host,
        port=listening.port,
        cert_file=listening.cert_file,
        key_file=listening.key_file,
        keep_keys=stash.DEFAULT_KEEP_KEYS | frozenset(args.keep_key),
        kubeconfig=args.kubeconfig,
        register_url=args.register_url,
        inject_ca_bundle=args.inject_ca_bundle,
        ca_file=ca_file,
        follow_moves=args.follow_moves,
    )


async def run(config: WebhookConfig) -> None:
    follower = MovesFollower() if config.follow_moves else None
    runner = web.AppRunner(make_app(config.keep_keys, follower), access_log=None)
    await runner.setup()
    reloading: asyncio.Task[None] | None = None
    following: asyncio.Task[None] | None = None
    client: KubeClient | None = None
    try:
        if follower is not None:
            # Admissions are answered before the first list: a webhook that waited for
            # the apiserver would fail every pod creation (failurePolicy Fail) meanwhile.
            client = await KubeClient.connect(ClientSettings(config.kubeconfig))
            following = asyncio.create_task(follower.informer(client).run())
        reloading = await start_https_site(
            runner, config.host, config.port, config.cert_file, config.key_file
        )
        log.info("serving admission reviews on https://%s:%d%s", config.host, config.port, PATH)
        if config.register_url or config.inject_ca_bundle:
            await publish_ca_bundle(config)
        # Until a signal cancels the task, which the finally below cleans up after.
        await asyncio.Future()
    finally:
        for task in (reloading, following):
            if task is not None:
                task.cancel()
        await runner.cleanup()
        if client is not None:
            await client.close()


def main(argv: Sequence[str]) -> int:
    return run_component(run(parse_args(argv)), log)
