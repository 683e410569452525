"""The webhook's one serving certificate, shared by every replica (pure): when a new CA or
a new leaf is due, and the Secrets that carry them. ``kubestrata webhook-cert`` (a Job and
a daily CronJob of the manifests) applies these; the replicas mount the TLS Secret and
reload it when it is renewed."""

from __future__ import annotations

import base64
import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

JSON = dict[str, Any]

TLS_SECRET = "kubestrata-webhook-tls"
CA_SECRET = "kubestrata-webhook-ca"
SERVICE = "kubestrata-webhook"
RENEW_BEFORE = datetime.timedelta(days=30)


def service_names(service: str, namespace: str) -> tuple[str, ...]:
    """The names the apiserver may reach a Service by; the first is what it verifies."""
    return (
        f"{service}.{namespace}.svc",
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc.cluster.local",
    )


def secret_data(secret: Mapping[str, Any] | None) -> dict[str, bytes]:
    return {
        key: base64.b64decode(value)
        for key, value in ((secret or {}).get("data") or {}).items()
        if isinstance(value, str)
    }


def _expiring(
    cert: x509.Certificate, now: datetime.datetime, renew_before: datetime.timedelta
) -> bool:
    return cert.not_valid_after_utc - now < renew_before


def ca_due(
    data: Mapping[str, bytes], now: datetime.datetime, renew_before: datetime.timedelta
) -> str:
    """Why a new CA is needed (empty: the one in ``data`` serves on)."""
    if "ca.crt" not in data or "ca.key" not in data:
        return "no CA yet"
    try:
        cert = x509.load_pem_x509_certificate(data["ca.crt"])
    except ValueError:
        return "the CA certificate does not parse"
    if _expiring(cert, now, renew_before):
        return f"the CA expires on {cert.not_valid_after_utc:%Y-%m-%d}"
    return ""


def leaf_due(
    data: Mapping[str, bytes],
    ca_pem: bytes,
    names: tuple[str, ...],
    now: datetime.datetime,
    renew_before: datetime.timedelta,
) -> str:
    """Why a new serving certificate is needed (empty: the one in ``data`` serves on): none
    yet, not issued by this CA for these names, or expiring within ``renew_before``."""
    if "tls.crt" not in data or "tls.key" not in data:
        return "no serving certificate yet"
    try:
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError:
        return "the serving certificate does not parse"
    verifier = (
        PolicyBuilder().store(Store([ca])).time(now).build_server_verifier(x509.DNSName(names[0]))
    )
    try:
        verifier.verify(cert, [])
    except VerificationError as error:
        return f"the serving certificate does not verify for {names[0]}: {error}"
    covered = {
        str(name.value)
        for name in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    }
    if not set(names) <= covered:
        return f"the serving certificate lacks {', '.join(sorted(set(names) - covered))}"
    if _expiring(cert, now, renew_before):
        return f"the serving certificate expires on {cert.not_valid_after_utc:%Y-%m-%d}"
    return ""


# How long after the serving certificate in the Secret was issued the CAs published
# beside ours stay: the replicas serve the one they loaded until the kubelet has synced
# the Secret (a minute or more) and they have reloaded it.
CA_OVERLAP = datetime.timedelta(minutes=10)
# pki backdates a certificate's notBefore by this much for clocks a little behind.
_BACKDATED = datetime.timedelta(minutes=5)


def ca_bundle(
    ca_pem: bytes,
    served_before: bytes | None,
    known: Iterable[bytes],
    now: datetime.datetime,
    overlap: datetime.timedelta = CA_OVERLAP,
) -> bytes:
    """The CA bundle to publish: ``ca_pem``, and, found among the ``known`` PEM bundles and
    still valid, the CA of the certificate in the Secret before (``served_before``) when
    another one signed it, and every other CA when that certificate is new. The replicas
    serve the certificate they loaded until they load the renewed Secret: with the new CA
    alone in the bundle, the apiserver refused them meanwhile, and with failurePolicy Fail
    every federated pod's creation. Published again later, the old CAs go. A run that
    renewed the certificate but failed to publish, then ran again at once, found the new
    certificate "served before" and dropped the old CA before the replicas had it."""
    try:
        served = x509.load_pem_x509_certificate(served_before) if served_before else None
        new_ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError:
        return ca_pem
    if served is None:
        return ca_pem
    recent = now - served.not_valid_before_utc < _BACKDATED + overlap
    kept: list[bytes] = []
    for bundle in known:
        try:
            candidates = x509.load_pem_x509_certificates(bundle)
        except ValueError:
            continue
        for candidate in candidates:
            pem = candidate.public_bytes(serialization.Encoding.PEM)
            if (
                candidate.issuer == candidate.subject
                and candidate != new_ca
                and candidate.not_valid_after_utc > now
                and (recent or _signed_by(served, candidate))
                and pem not in kept
            ):
                kept.append(pem)
    return b"".join([ca_pem.rstrip(b"\n") + b"\n", *kept]) if kept else ca_pem


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def secret(name: str, namespace: str, data: Mapping[str, bytes], kind: str = "Opaque") -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": kind,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "kubestrata"},
        },
        "data": {key: base64.b64encode(value).decode() for key, value in sorted(data.items())},
    }


def ca_bundle_patch(configuration: Mapping[str, Any], ca_pem: bytes) -> list[JSON]:
    """The JSON patch that puts ``ca_pem`` into every webhook of the configuration; empty
    when every one has it already, so the configuration is written once."""
    encoded = base64.b64encode(ca_pem).decode()
    return [
        {
            "op": "replace" if "caBundle" in webhook["clientConfig"] else "add",
            "path": f"/webhooks/{index}/clientConfig/caBundle",
            "value": encoded,
        }
        for index, webhook in enumerate(configuration.get("webhooks") or [])
        if webhook["clientConfig"].get("caBundle") != encoded
    ]
