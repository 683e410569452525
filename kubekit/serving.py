"""Flags the components share: for the HTTPS servers (webhook, multischeduler) where to
listen, and a serving certificate given as files or generated with a CA of its own; for
every client of the upper cluster, its kubeconfig."""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubekit import pki


@dataclass(frozen=True)
class Serving:
    host: str
    port: int
    cert_file: Path
    key_file: Path
    # The CA clients must trust when the certificate was generated, and the names that
    # certificate covers; None for given files.
    generated_ca: Path | None
    names: tuple[str, ...] | None = None


def host_port(address: str, port: int) -> str:
    """``address:port``, an IPv6 address in brackets (``[fd00::5]:10352``): bare, its
    colons run into the port's, and gRPC reads the whole as a host without a port."""
    if ":" in address and not address.startswith("["):
        return f"[{address}]:{port}"
    return f"{address}:{port}"


def add_serving_arguments(parser: argparse.ArgumentParser, generated_ca_help: str) -> None:
    parser.add_argument("--listen", default="0.0.0.0:8443", help="HOST:PORT (default %(default)s)")
    parser.add_argument("--tls-cert-file", type=Path, help="serving certificate (PEM)")
    parser.add_argument("--tls-key-file", type=Path, help="its private key (PEM)")
    parser.add_argument(
        "--cert-dir",
        type=Path,
        help=f"without --tls-cert-file: generate a CA ({generated_ca_help}) and a serving "
        "certificate here",
    )
    parser.add_argument(
        "--server-name",
        action="append",
        default=[],
        help="DNS name or IP the generated certificate covers (repeatable; default: the "
        "--listen host)",
    )


def listen_address(listen: str) -> tuple[str, str]:
    """``--listen``'s host and port text; an IPv6 host as written in brackets
    (``[::1]:8443``, as ``host_port`` gives it) without them, as a bind takes it."""
    host, _, port_text = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port_text


def check_serving_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses what cannot work before anything is written."""
    host, port_text = listen_address(args.listen)
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        parser.error(f"--listen must be HOST:PORT, not {args.listen!r}")
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        parser.error("--tls-cert-file and --tls-key-file go together")
    check_serving_pair(parser, args.tls_cert_file, args.tls_key_file)
    if args.tls_cert_file is None and args.cert_dir is None:
        parser.error("give --tls-cert-file/--tls-key-file or --cert-dir")


def check_serving_pair(
    parser: argparse.ArgumentParser, cert: Path | str | None, key: Path | str | None
) -> None:
    """``--tls-cert-file`` and ``--tls-key-file``, when given: files that load as a pair,
    or the start is refused naming them. Found at the first listen, a bad pair was an
    SSLError, an OSError the components retry as a connection's: the virtual node tried
    again for good, never registering its Node, and the others said only "PEM lib"."""
    for flag, path in (("--tls-cert-file", cert), ("--tls-key-file", key)):
        if path and not Path(path).is_file():
            parser.error(f"{flag}: no such file: {path}")
    if cert and key:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as error:
            parser.error(f"--tls-cert-file {cert} and --tls-key-file {key}: {error}")


def certificate_subject(peercert: Mapping[str, Any] | None) -> tuple[str, tuple[str, ...]]:
    """The common name ("" when none) and organizations of a verified client certificate,
    as ``SSLSocket.getpeercert()`` gives it (None or empty: no certificate)."""
    name = ""
    organizations = []
    for rdn in (peercert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                name = value
            elif key == "organizationName":
                organizations.append(value)
    return name, tuple(organizations)


def check_client_ca(parser: argparse.ArgumentParser, path: Path, flag: str) -> None:
    """A CA bundle for client certificates: PEM certificates that load, or the start is
    refused (at the first handshake it would be too late to say)."""
    try:
        ssl.create_default_context(cafile=str(path))
    except (OSError, ssl.SSLError) as error:
        parser.error(f"{flag}: {path}: {error}")


def serving(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> Serving:
    """The checked flags as a Serving; with --cert-dir, the certificate ``name`` there is
    generated (or reused while it covers the names), or the start refused saying why not
    (a directory that cannot be made or written: a read-only root)."""
    host, port_text = listen_address(args.listen)
    if args.tls_cert_file is not None:
        return Serving(host, int(port_text), args.tls_cert_file, args.tls_key_file, None)
    names = tuple(args.server_name) or (host,)
    try:
        pair = pki.serving_pair(args.cert_dir, name, names)
    except OSError as error:
        parser.error(f"--cert-dir {args.cert_dir}: {error}")
    return Serving(host, int(port_text), pair.cert_path, pair.key_path, pki.ca_path(pair), names)


def check_kubeconfig(
    parser: argparse.ArgumentParser, kubeconfig: str | None, flag: str = "--kubeconfig"
) -> None:
    """A component's ``--kubeconfig``: a file that exists, or none inside a cluster."""
    if kubeconfig is not None:
        if not Path(kubeconfig).is_file():
            parser.error(f"{flag}: no such file: {kubeconfig}")
    elif "KUBERNETES_SERVICE_HOST" not in os.environ:
        parser.error(f"{flag} is needed outside a cluster")
