"""`kubestrata webhook-cert`: makes or renews the webhook's shared serving certificate.

Keeps a CA in one Secret and the serving certificate it signs (with the CA, for clients)
in the kubernetes.io/tls Secret every webhook replica mounts, and puts the CA into the
MutatingWebhookConfiguration. Each is written only when due: run again, it changes
nothing until the certificate is within --renew-before of its end; a renewed leaf keeps
the CA, so the caBundle stays and replicas that have not reloaded yet are still trusted.
A new CA (the old one near its end, or its Secret lost) is published beside the one that
signed the certificate served so far, which goes at the next run once the new one is
served (``webhook.certificate.ca_bundle``).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kubekit import keys, logs, pki
from kubekit.client import SECRETS, ApiError, ClientSettings, KubeClient, is_not_found
from kubekit.component import run_component
from kubekit.serving import check_kubeconfig
from webhook.certificate import (
    CA_OVERLAP,
    CA_SECRET,
    RENEW_BEFORE,
    SERVICE,
    TLS_SECRET,
    ca_bundle,
    ca_due,
    leaf_due,
    secret,
    secret_data,
    service_names,
)
from webhook.configuration import CONFIGURATION_NAME
from webhook.server import inject_ca_bundle

log = logging.getLogger("webhook.certjob")


MAX_RENEW_BEFORE_DAYS = 36_500
MAX_CA_OVERLAP_MINUTES = 525_600


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kubestrata webhook-cert", description=__doc__)
    parser.add_argument("--kubeconfig", help="of the upper cluster (default: in-cluster)")
    parser.add_argument("--namespace", default=keys.SYSTEM_NAMESPACE)
    parser.add_argument("--service", default=SERVICE, help="the webhook's Service")
    parser.add_argument("--secret", default=TLS_SECRET, help="the replicas' TLS Secret")
    parser.add_argument("--ca-secret", default=CA_SECRET, help="where the CA and its key live")
    parser.add_argument(
        "--configuration",
        default=CONFIGURATION_NAME,
        help="the MutatingWebhookConfiguration to put the CA into",
    )
    parser.add_argument(
        "--extra-name",
        action="append",
        default=[],
        help="one more DNS name or IP the certificate covers (repeatable), for a webhook "
        "reached by URL",
    )
    parser.add_argument(
        "--renew-before-days",
        type=float,
        default=RENEW_BEFORE.days,
        help="renew what expires within this many days (default %(default)s)",
    )
    parser.add_argument(
        "--ca-overlap-minutes",
        type=float,
        default=CA_OVERLAP.total_seconds() / 60,
        help="for this long after the serving certificate was issued, the CAs published "
        "before stay in the bundle beside ours, for replicas that have not loaded it yet "
        "(default %(default)g)",
    )
    logs.add_arguments(parser)
    args = parser.parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    check_kubeconfig(parser, args.kubeconfig)
    # Past these a timedelta overflows; a certificate lives for far less.
    if not 0 <= args.renew_before_days <= MAX_RENEW_BEFORE_DAYS:
        parser.error(f"--renew-before-days must be from 0 to {MAX_RENEW_BEFORE_DAYS}")
    if not 0 <= args.ca_overlap_minutes <= MAX_CA_OVERLAP_MINUTES:
        parser.error(f"--ca-overlap-minutes must be from 0 to {MAX_CA_OVERLAP_MINUTES}")
    return args


async def _read(client: KubeClient, name: str, namespace: str) -> dict[str, Any] | None:
    try:
        return await client.get(SECRETS, name, namespace)
    except ApiError as error:
        if is_not_found(error):
            return None
        raise


async def _write(
    client: KubeClient, current: dict[str, Any] | None, desired: dict[str, Any]
) -> None:
    namespace = desired["metadata"]["namespace"]
    if current is None:
        await client.create(SECRETS, desired, namespace)
        return
    # Written over only what we read: a writer in between makes this fail, not vanish.
    desired["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    await client.replace(SECRETS, desired, namespace)


async def run(args: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.UTC)
    renew_before = datetime.timedelta(days=args.renew_before_days)
    names = (*service_names(args.service, args.namespace), *args.extra_name)
    async with await KubeClient.connect(ClientSettings(args.kubeconfig)) as client:
        ca_secret = await _read(client, args.ca_secret, args.namespace)
        tls_secret = await _read(client, args.secret, args.namespace)
        with tempfile.TemporaryDirectory(prefix="kubestrata-webhook-cert-") as scratch:
            directory = Path(scratch)
            ca_data = secret_data(ca_secret)
            ca_before = ca_data.get("ca.crt", b"")
            served_before = secret_data(tls_secret).get("tls.crt")
            why = ca_due(ca_data, now, renew_before)
            if why:
                ca = pki.create_ca(directory, "kubestrata-webhook")
                ca_data = {"ca.crt": ca.cert_path.read_bytes(), "ca.key": ca.key_path.read_bytes()}
                await _write(client, ca_secret, secret(args.ca_secret, args.namespace, ca_data))
                log.info("new webhook CA in %s/%s: %s", args.namespace, args.ca_secret, why)
            else:
                ca = pki.KeyPair(directory / "ca.crt", directory / "ca.key")
                ca.cert_path.write_bytes(ca_data["ca.crt"])
                ca.key_path.write_bytes(ca_data["ca.key"])
            why = leaf_due(secret_data(tls_secret), ca_data["ca.crt"], names, now, renew_before)
            if why:
                leaf = pki.issue(ca, directory / "tls", names[0], server_names=names)
                tls_data = {
                    "tls.crt": leaf.cert_path.read_bytes(),
                    "tls.key": leaf.key_path.read_bytes(),
                    "ca.crt": ca_data["ca.crt"],
                }
                await _write(
                    client,
                    tls_secret,
                    secret(args.secret, args.namespace, tls_data, "kubernetes.io/tls"),
                )
                log.info("new webhook certificate in %s/%s: %s", args.namespace, args.secret, why)
            else:
                log.info("webhook certificate in %s/%s serves on", args.namespace, args.secret)
        ca_pem = ca_data["ca.crt"]
        await inject_ca_bundle(
            client,
            args.configuration,
            lambda published: ca_bundle(
                ca_pem,
                served_before,
                [ca_before, *published],
                now,
                datetime.timedelta(minutes=args.ca_overlap_minutes),
            ),
        )


def main(argv: Sequence[str]) -> int:
    return run_component(run(parse_args(argv)), log)
