"""The kubelet API's serving certificate: from files, or through a CSR with signer
``kubernetes.io/kubelet-serving`` that we approve ourselves, for our own node only, or
self-signed as a last resort (the apiserver verifies kubelets only when told to)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import enum
import ipaddress
import logging
import os
import secrets
import ssl
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from kubekit import pki
from kubekit.client import API_ERRORS, ApiError, KubeClient, Resource

log = logging.getLogger("virtual_node.kubeletapi")

CSRS = Resource("certificates.k8s.io", "v1", "certificatesigningrequests", namespaced=False)
SIGNER = "kubernetes.io/kubelet-serving"
USAGES = ("digital signature", "server auth")
ISSUE_TIMEOUT = 30.0
# Renewed at this share of its life, as the kubelet's certificate manager does (70-90 %).
RENEW_AT = 0.8
RENEW_RETRY_SECONDS = 60.0
PROVISIONAL_RETRY_CAP_SECONDS = 3600.0


def signing_request(node_name: str, names: Collection[str]) -> tuple[bytes, bytes]:
    """(CSR PEM, private key PEM) for the node's serving certificate."""
    key = pki.new_private_key()
    general: list[x509.GeneralName] = []
    for name in names:
        try:
            general.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            general.append(x509.DNSName(name))
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                    x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node_name}"),
                ]
            )
        )
        .add_extension(x509.SubjectAlternativeName(general), critical=False)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM), pki.private_key_pem(key)


def approvable(csr: Mapping[str, Any], node_name: str, names: Collection[str]) -> str:
    """Why this CSR must not be approved by us ("" when it may): only a kubelet-serving
    request for our node with exactly our names and usages."""
    spec = csr.get("spec") or {}
    if spec.get("signerName") != SIGNER:
        return f"signer is {spec.get('signerName')!r}, not {SIGNER}"
    if set(spec.get("usages") or ()) - {*USAGES, "key encipherment"}:
        return f"usages {spec.get('usages')} go beyond serving"
    try:
        request = x509.load_pem_x509_csr(base64.b64decode(spec.get("request", "")))
    except ValueError as error:
        return f"request is not a PEM CSR: {error}"
    subject = request.subject
    common = [a.value for a in subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    orgs = [a.value for a in subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    if common != [f"system:node:{node_name}"] or orgs != ["system:nodes"]:
        return f"subject {subject.rfc4514_string()} is not node {node_name}"
    try:
        san = request.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "no subject alternative names"
    requested = {str(n.value) for n in san}
    if requested != set(names) or len(requested) != len(list(san)):
        return f"names {sorted(requested)} are not {sorted(names)}"
    return ""


async def request_certificate(
    upper: KubeClient, node_name: str, names: Collection[str], directory: Path
) -> pki.KeyPair:
    """Creates, approves and waits for a kubelet-serving CSR; raises on any failure."""
    csr_pem, key_pem = signing_request(node_name, names)
    body = {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": f"kubestrata-{node_name}-{secrets.token_hex(4)}"},
        "spec": {
            "request": base64.b64encode(csr_pem).decode(),
            "signerName": SIGNER,
            "usages": list(USAGES),
        },
    }
    created = await upper.create(CSRS, body)
    name = created["metadata"]["name"]
    reason = approvable(created, node_name, names)
    if reason:
        raise ValueError(f"refusing to approve {name}: {reason}")
    created.setdefault("status", {})["conditions"] = [
        {
            "type": "Approved",
            "status": "True",
            "reason": "KubestrataVirtualNode",
            "message": f"serving certificate of virtual node {node_name}",
        }
    ]
    await upper.replace(CSRS, created, subresource="approval")
    issued = await _issued_certificate(upper, name)
    return _write_pair(directory, key_pem, issued)


async def _issued_certificate(upper: KubeClient, name: str) -> bytes:
    # The signer reports through the object only; a short poll is all there is to wait on.
    deadline = asyncio.get_running_loop().time() + ISSUE_TIMEOUT
    while asyncio.get_running_loop().time() < deadline:
        issued = (await upper.get(CSRS, name)).get("status", {}).get("certificate")
        if issued:
            return base64.b64decode(issued)
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{name} approved but not signed within {ISSUE_TIMEOUT:.0f} s")


def _issued_pair(directory: Path) -> pki.KeyPair:
    return pki.KeyPair(directory / "kubelet-serving.crt", directory / "kubelet-serving.key")


def kept_certificate(
    directory: Path, node_name: str, names: Collection[str], now: datetime.datetime
) -> pki.KeyPair | None:
    """A certificate an earlier CSR of this node got, still in ``directory``, for the same
    names and not expired: a virtual node that starts again (a restart, or leading again
    after its apiserver was away) serves it, as a kubelet keeps its certificate, rather
    than waiting on a new CSR that a signer just back may not sign. One due for renewal
    is renewed at once; refused at its due time, a CSR failing a moment put a
    self-signed pair over a certificate good for days."""
    pair = _issued_pair(directory)
    try:
        cert_pem = pair.cert_path.read_bytes()
        cert = x509.load_pem_x509_certificate(cert_pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return None
    if not _matches(pair):
        return None
    common = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if common != [f"system:node:{node_name}"] or {str(n.value) for n in san} != set(names):
        return None
    return pair if cert.not_valid_after_utc > now else None


def _matches(pair: pki.KeyPair) -> bool:
    """Whether the key file is the certificate's key (a write cut short between the
    two, and the next start served a pair TLS refuses, until the old one was due)."""
    try:
        ssl.create_default_context().load_cert_chain(pair.cert_path, pair.key_path)
    except (OSError, ssl.SSLError):
        return False
    return True


def _write_pair(directory: Path, key_pem: bytes, cert_pem: bytes) -> pki.KeyPair:
    directory.mkdir(parents=True, exist_ok=True)
    pair = _issued_pair(directory)
    for path, pem in ((pair.key_path, key_pem), (pair.cert_path, cert_pem)):
        # Each file whole or not at all: written beside, then moved over the old one.
        written = path.with_name(f".{path.name}.new")
        written.unlink(missing_ok=True)
        # Readable by its owner alone from the first byte.
        with os.fdopen(os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(pem)
        os.replace(written, path)
    return pair


class Renewal(enum.Enum):
    """Who renews the pair served: whoever gave its files (they are reloaded all the
    same), us at 80 % of its life (a CSR's), or us as soon as a CSR is signed (a
    self-signed pair served meanwhile)."""

    GIVEN = "given"
    DUE = "due"
    PROVISIONAL = "provisional"


async def serving_certificate(
    upper: KubeClient,
    node_name: str,
    names: Collection[str],
    directory: Path,
    files: tuple[Path, Path] | None,
) -> tuple[pki.KeyPair, Renewal]:
    """The pair to serve with, and who renews it."""
    if files is not None:
        return pki.KeyPair(*files), Renewal.GIVEN
    kept = kept_certificate(directory, node_name, names, datetime.datetime.now(datetime.UTC))
    if kept is not None:
        return kept, Renewal.DUE
    try:
        return await request_certificate(upper, node_name, names, directory), Renewal.DUE
    except _REQUEST_ERRORS as error:
        log.warning(
            "no kubelet-serving certificate from the upper cluster (%s); serving a "
            "self-signed one, which apiservers that verify kubelets refuse, until a CSR "
            "is signed (asked again in %.0f s, then ever more rarely)",
            error,
            RENEW_RETRY_SECONDS,
        )
        # Where a signed one will be written: the TLS context reloads it from there.
        own = pki.serving_pair(directory, node_name, tuple(names))
        pair = _write_pair(directory, own.key_path.read_bytes(), own.cert_path.read_bytes())
        return pair, Renewal.PROVISIONAL


# The API's failures, and a CSR we refuse to approve.
_REQUEST_ERRORS: tuple[type[Exception], ...] = (*API_ERRORS, ValueError)


def renewal_delay(cert_pem: bytes, now: datetime.datetime, share: float = RENEW_AT) -> float:
    """Seconds from ``now`` until the certificate has lived ``share`` of its life."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    begins, ends = cert.not_valid_before_utc, cert.not_valid_after_utc
    return max(0.0, (begins + (ends - begins) * share - now).total_seconds())


async def keep_renewed(
    upper: KubeClient,
    node_name: str,
    names: Collection[str],
    pair: pki.KeyPair,
    clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    provisional: bool = False,
) -> None:
    """Asks for a new kubelet-serving certificate whenever the one in ``pair``'s files has
    lived 80 % of its life, writing it over them (the kubelet API's TLS context reloads
    them); a failed request is tried again a minute later, while the old one still holds.
    A ``provisional`` pair (self-signed: the first CSR failed) is replaced as soon as a
    CSR is signed, asked for after a minute, then twice as long each time up to an hour
    (a signer away a moment at start left the apiservers that verify kubelets refusing
    every `kubectl logs` until a restart; each try leaves a CSR behind), and no more once
    the apiserver forbids the virtual node its CSRs."""
    backoff = RENEW_RETRY_SECONDS
    while True:
        delay = backoff if provisional else renewal_delay(pair.cert_path.read_bytes(), clock())
        await asyncio.sleep(delay)
        try:
            await request_certificate(upper, node_name, names, pair.cert_path.parent)
        except _REQUEST_ERRORS as error:
            if provisional and isinstance(error, ApiError) and error.status == 403:
                log.warning(
                    "no kubelet-serving certificate (%s): serving the self-signed one "
                    "until a restart",
                    error,
                )
                return
            wait = backoff * 2 if provisional else RENEW_RETRY_SECONDS
            log.warning(
                "kubelet-serving certificate not renewed (%s); trying again in %.0f s",
                error,
                min(wait, PROVISIONAL_RETRY_CAP_SECONDS),
            )
            if provisional:
                backoff = min(wait, PROVISIONAL_RETRY_CAP_SECONDS)
            else:
                await asyncio.sleep(RENEW_RETRY_SECONDS)
            continue
        provisional = False
        log.info("kubelet-serving certificate of %s renewed", node_name)
