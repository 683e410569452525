"""Certificates and kubeconfigs for local control planes, made with ``cryptography``."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, as PEM files on disk."""

    cert_path: Path
    key_path: Path

    def load(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return cert, key


def new_private_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    # "EC PRIVATE KEY" rather than PKCS#8: kube-apiserver reads service-account public
    # keys from the private key file and only understands this form there.
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def create_ca(directory: Path, common_name: str) -> KeyPair:
    key = new_private_key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY * 10)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    pair = KeyPair(directory / f"{common_name}-ca.crt", directory / f"{common_name}-ca.key")
    _write(pair.cert_path, cert.public_bytes(serialization.Encoding.PEM))
    _write(pair.key_path, private_key_pem(key), private=True)
    return pair


def issue(
    ca: KeyPair,
    path_prefix: Path,
    common_name: str,
    *,
    organizations: tuple[str, ...] = (),
    server_names: tuple[str, ...] = (),
    client: bool = False,
) -> KeyPair:
    """Signs a leaf certificate; ``server_names`` (DNS names or IP addresses) make it a
    serving certificate, ``client`` a client one."""
    ca_cert, ca_key = ca.load()
    key = new_private_key()
    now = datetime.datetime.now(datetime.UTC)
    usages = []
    if server_names:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if server_names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in server_names]), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    pair = KeyPair(path_prefix.with_suffix(".crt"), path_prefix.with_suffix(".key"))
    _write(pair.cert_path, cert.public_bytes(serialization.Encoding.PEM))
    _write(pair.key_path, private_key_pem(key), private=True)
    return pair


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def create_service_account_key(path: Path) -> Path:
    _write(path, private_key_pem(new_private_key()), private=True)
    return path


def write_kubeconfig(path: Path, *, cluster: str, server: str, ca: Path, user: KeyPair) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": cluster, "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [
            {
                "name": f"{cluster}-admin",
                "user": {
                    "client-certificate": str(user.cert_path),
                    "client-key": str(user.key_path),
                },
            }
        ],
        "contexts": [
            {"name": cluster, "context": {"cluster": cluster, "user": f"{cluster}-admin"}}
        ],
        "current-context": cluster,
    }
    _write(path, yaml.safe_dump(config).encode(), private=True)
    return path


def serving_pair(directory: Path, common_name: str, server_names: tuple[str, ...]) -> KeyPair:
    """A serving certificate for ``server_names`` signed by a CA of its own, both kept in
    ``directory`` (the CA as ``<common_name>-ca.crt``, the bundle clients must trust). An
    existing pair is reused while it covers the names and is valid for another day."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = KeyPair(directory / f"{common_name}-ca.crt", directory / f"{common_name}-ca.key")
    prefix = directory / common_name
    pair = KeyPair(prefix.with_suffix(".crt"), prefix.with_suffix(".key"))
    if ca.cert_path.exists() and pair.cert_path.exists() and pair.key_path.exists():
        cert = x509.load_pem_x509_certificate(pair.cert_path.read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        covered = {str(n.value) for n in names}
        fresh = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
        if set(server_names) <= covered and fresh > datetime.timedelta(days=1):
            return pair
    if not (ca.cert_path.exists() and ca.key_path.exists()):
        ca = create_ca(directory, common_name)
    # A leaf named like its CA would look self-signed to OpenSSL clients.
    return issue(ca, prefix, server_names[0], server_names=server_names)


def ca_path(pair: KeyPair) -> Path:
    """The CA certificate next to a pair made by ``serving_pair``."""
    return pair.cert_path.with_name(pair.cert_path.stem + "-ca.crt")


def server_ssl_context(
    cert_file: Path, key_file: Path, client_ca: Path | bytes | None = None
) -> ssl.SSLContext:
    """TLS 1.2+ for our HTTPS servers; with ``client_ca`` (a file, or its PEM), asking for
    (not requiring) a client certificate: token callers have none."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if isinstance(client_ca, bytes):
        context.load_verify_locations(cadata=client_ca.decode())
    elif client_ca is not None:
        context.load_verify_locations(cafile=str(client_ca))
    if client_ca is not None:
        context.verify_mode = ssl.CERT_OPTIONAL
        # No session is resumed: a resumed one skips the client certificate's check, so
        # a certificate of a CA since taken out of the trusted ones would still get in.
        context.options |= ssl.OP_NO_TICKET
        context.num_tickets = 0
    return context
