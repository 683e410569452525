"""The webhook's shared certificate: `kubestrata webhook-cert`, with the identity of
manifests/webhook-cert-job, makes it and puts its CA into a configuration; two webhook
replicas serve it (the apiserver admits through either), a renewal keeps the CA and the
replicas serve the renewed pair without a restart; run again, it changes nothing.

The configuration here is one of the test's own (reached by URL, for its own namespace),
so the federation's webhook is left alone; the test lets the job's identity patch it."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

from cryptography import x509

from harness.federation import MANIFESTS, Federation
from harness.localcluster import free_port
from harness.process import ManagedProcess
from kubekit import keys
from webhook.configuration import PATH, url_configuration

from .helpers import get_json, wait_for

ACCOUNT = "kubestrata-webhook-cert"
CONFIGURATION = "kubestrata-webhook-e2e"
NAMESPACE_LABEL = "kubestrata.io/e2e-webhook-cert"


def webhook_cert(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kubekit.cli",
            "webhook-cert",
            f"--kubeconfig={kubeconfig}",
            f"--configuration={CONFIGURATION}",
            "--extra-name=127.0.0.1",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def served_serial(port: int, ca_pem: bytes) -> int:
    context = ssl.create_default_context(cadata=ca_pem.decode())
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def secret(federation: Federation, name: str) -> dict[str, Any]:
    found: dict[str, Any] = get_json(federation.upper, "secret", "-n", keys.SYSTEM_NAMESPACE, name)
    return found


def secret_files(federation: Federation, directory: Path) -> dict[str, bytes]:
    """The TLS Secret's data, written out as a Secret volume holds it."""
    data = get_json(
        federation.upper, "secret", "-n", keys.SYSTEM_NAMESPACE, "kubestrata-webhook-tls"
    )
    decoded = {k: base64.b64decode(v) for k, v in data["data"].items()}
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in decoded.items():
        (directory / name).write_bytes(value)
    return decoded


def configuration(url: str) -> dict[str, Any]:
    config = url_configuration(url)
    config["metadata"]["name"] = CONFIGURATION
    config["webhooks"] = config["webhooks"][:1]  # pods' only: DaemonSets are not the subject
    config["webhooks"][0]["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: "yes"}}
    return config


def admitted_with_stash(federation: Federation, name: str) -> bool:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "wh-cert"},
        "spec": {
            "nodeSelector": {"disk": "ssd"},
            "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
        },
    }
    created = json.loads(
        federation.upper.kubectl(
            "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod)
        ).stdout
    )
    return keys.STASH_ANNOTATION in (created["metadata"].get("annotations") or {})


def test_one_certificate_made_by_the_job_serves_every_replica_and_renews_in_place(
    federation: Federation, tmp_path: Path
) -> None:
    upper = federation.upper
    identity = federation.identity(upper, "webhook-cert", ACCOUNT, MANIFESTS / "webhook-cert-job")
    # Only for this test's own configuration; the manifests' role names ours alone.
    upper.kubectl(
        "create",
        "clusterrole",
        "kubestrata-webhook-cert-e2e",
        "--verb=get,patch",
        "--resource=mutatingwebhookconfigurations",
        f"--resource-name={CONFIGURATION}",
    )
    upper.kubectl(
        "create",
        "clusterrolebinding",
        "kubestrata-webhook-cert-e2e",
        "--clusterrole=kubestrata-webhook-cert-e2e",
        f"--serviceaccount={keys.SYSTEM_NAMESPACE}:{ACCOUNT}",
    )
    ports = [free_port(), free_port()]
    upper.kubectl(
        "apply", "-f", "-", input=json.dumps(configuration(f"https://127.0.0.1:{ports[0]}{PATH}"))
    )
    upper.kubectl("create", "namespace", "wh-cert")
    upper.kubectl("label", "namespace", "wh-cert", f"{NAMESPACE_LABEL}=yes")
    replicas: list[ManagedProcess] = []

    def published_bundle() -> bytes:
        webhooks = get_json(upper, "mutatingwebhookconfiguration", CONFIGURATION)["webhooks"]
        return base64.b64decode(webhooks[0]["clientConfig"]["caBundle"])

    try:
        made = webhook_cert(identity.kubeconfig)
        assert made.returncode == 0, made.stderr
        assert "new webhook CA" in made.stderr and "new webhook certificate" in made.stderr
        files = secret_files(federation, tmp_path / "certs")
        assert published_bundle() == files["ca.crt"]

        for index, port in enumerate(ports):
            replica = ManagedProcess(
                f"webhook-replica-{index}",
                [
                    sys.executable,
                    "-m",
                    "kubekit.cli",
                    "webhook",
                    f"--listen=127.0.0.1:{port}",
                    f"--tls-cert-file={tmp_path / 'certs' / 'tls.crt'}",
                    f"--tls-key-file={tmp_path / 'certs' / 'tls.key'}",
                ],
                tmp_path / f"replica-{index}.log",
            )
            replica.start()
            replicas.append(replica)
        first = x509.load_pem_x509_certificate(files["tls.crt"]).serial_number
        for port in ports:
            wait_for(partial(_serves, port, files["ca.crt"]), f"the replica on {port} to serve")
            assert served_serial(port, files["ca.crt"]) == first
        # The apiserver trusts what the job wrote, through either replica.
        assert admitted_with_stash(federation, "through-first")
        upper.kubectl(
            "patch",
            "mutatingwebhookconfiguration",
            CONFIGURATION,
            "--type=json",
            "-p",
            json.dumps(
                [
                    {
                        "op": "replace",
                        "path": "/webhooks/0/clientConfig/url",
                        "value": f"https://127.0.0.1:{ports[1]}{PATH}",
                    }
                ]
            ),
        )
        assert admitted_with_stash(federation, "through-second")

        # Run again: nothing is due, nothing is written.
        versions = {
            name: get_json(upper, "secret", "-n", keys.SYSTEM_NAMESPACE, name)["metadata"][
                "resourceVersion"
            ]
            for name in ("kubestrata-webhook-tls", "kubestrata-webhook-ca")
        }
        again = webhook_cert(identity.kubeconfig)
        assert again.returncode == 0 and "serves on" in again.stderr, again.stderr
        for name, version in versions.items():
            assert secret(federation, name)["metadata"]["resourceVersion"] == version

        # Renewal (due whenever it expires within 400 days): a new leaf, the same CA.
        renewed = webhook_cert(identity.kubeconfig, "--renew-before-days=400")
        assert renewed.returncode == 0, renewed.stderr
        assert (
            "new webhook certificate" in renewed.stderr and "new webhook CA" not in renewed.stderr
        )
        files = secret_files(federation, tmp_path / "certs")
        second = x509.load_pem_x509_certificate(files["tls.crt"]).serial_number
        assert second != first
        for port in ports:
            wait_for(
                partial(_serves, port, files["ca.crt"], second),
                f"the replica on {port} to serve the renewed certificate",
                timeout=30,
            )
            assert all(r.running() for r in replicas), "served without a restart"
        assert admitted_with_stash(federation, "after-renewal")

        # A new CA (due whenever it expires within 5,000 days): until the replicas load
        # the new certificate, they serve the one the old CA signed, which the bundle
        # still trusts (until 2026-11-28 the new CA alone: every admission failed).
        rotated = webhook_cert(identity.kubeconfig, "--renew-before-days=5000")
        assert rotated.returncode == 0, rotated.stderr
        assert "new webhook CA" in rotated.stderr
        assert served_serial(ports[1], files["ca.crt"]) == second, "not reloaded yet"
        assert admitted_with_stash(federation, "during-ca-rotation")
        files = secret_files(federation, tmp_path / "certs")
        third = x509.load_pem_x509_certificate(files["tls.crt"]).serial_number
        for port in ports:
            wait_for(
                partial(_serves, port, files["ca.crt"], third),
                f"the replica on {port} to serve the certificate of the new CA",
                timeout=30,
            )
        assert admitted_with_stash(federation, "after-ca-rotation")
        # Run again once it is served (a run within the overlap after its issue keeps
        # the old CA: a retry of a run that renewed it, say): the old CA leaves.
        kept = webhook_cert(identity.kubeconfig)
        assert kept.returncode == 0, kept.stderr
        assert len(x509.load_pem_x509_certificates(published_bundle())) == 2
        settled = webhook_cert(identity.kubeconfig, "--ca-overlap-minutes=0")
        assert settled.returncode == 0, settled.stderr
        assert published_bundle() == files["ca.crt"]
    finally:
        for replica in replicas:
            replica.stop()
        upper.kubectl("delete", "mutatingwebhookconfiguration", CONFIGURATION, "--ignore-not-found")
        upper.kubectl("delete", "namespace", "wh-cert", "--wait=false")
        upper.kubectl("delete", "clusterrolebinding,clusterrole", "kubestrata-webhook-cert-e2e")


def _serves(port: int, ca_pem: bytes, serial: int | None = None) -> bool:
    """Whether the replica on ``port`` answers TLS (with the certificate ``serial``)."""
    try:
        shown = served_serial(port, ca_pem)
    except OSError:
        return False
    return serial is None or shown == serial
