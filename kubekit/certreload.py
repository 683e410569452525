"""A server's TLS context that takes its certificate files again when they change (a
renewed Secret, a renewed kubelet-serving certificate): connections made after the
change get the new pair, open ones carry on with theirs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

from aiohttp import web

from kubekit import pki

log = logging.getLogger(__name__)

RELOAD_SECONDS = 10.0


def file_version(path: str | Path) -> tuple[int, int, int]:
    """What tells a file from the same one written again (replaced, or rewritten in
    place), without reading it."""
    status = os.stat(path)
    return status.st_ino, status.st_mtime_ns, status.st_size


class CertificateFiles:
    """A certificate and key file pair, watched for a change that holds together."""

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self._seen = self._read()

    def _read(self) -> bytes:
        return self.cert_file.read_bytes() + self.key_file.read_bytes()

    def forget(self) -> None:
        """The next ``renewed`` compares with nothing: the files count as changed."""
        self._seen = b""

    def renewed(self) -> tuple[bytes, bytes] | None:
        """The certificate and key, when the files changed since last asked and now hold
        a pair that goes together; None otherwise (a half-written pair is left for the
        next time). The bytes are those checked: the files may change again meanwhile,
        and a certificate loaded with another key serves no handshake at all."""
        try:
            cert, key = self.cert_file.read_bytes(), self.key_file.read_bytes()
            if cert + key == self._seen:
                return None
            with written_pair(cert, key) as (cert_file, key_file):
                pki.server_ssl_context(cert_file, key_file)
        except (OSError, ssl.SSLError) as error:
            log.warning("certificate %s not reloaded yet: %s", self.cert_file, error)
            return None
        self._seen = cert + key
        log.info("serving with the renewed certificate %s", self.cert_file)
        return cert, key


@contextlib.contextmanager
def written_pair(cert: bytes, key: bytes) -> Iterator[tuple[Path, Path]]:
    """A certificate and key written to files of a private directory, for the APIs that
    load from files only; removed on exit."""
    with tempfile.TemporaryDirectory(prefix="kubestrata-cert-") as directory:
        cert_file, key_file = Path(directory) / "tls.crt", Path(directory) / "tls.key"
        cert_file.write_bytes(cert)
        key_file.write_bytes(key)
        yield cert_file, key_file


class ReloadingContext:
    """A server SSLContext whose new handshakes use the files as they are now: a change of
    the pair or of the client CA file builds a context afresh, which each handshake
    switches to from the first one's SNI callback (OpenSSL calls it for every
    ClientHello, a server name in it or not); open connections carry on with theirs. The
    pair is tried on a scratch context first: a key that does not match serves no
    handshake. The client CAs are those of the file as it is now, so a CA rotated out is
    no longer trusted (until 2026-11-28 the CAs of a changed file were added to the one
    context, and one taken out stayed trusted until a restart)."""

    def __init__(self, cert_file: Path, key_file: Path, client_ca: Path | None = None) -> None:
        self.files = CertificateFiles(cert_file, key_file)
        self.client_ca = client_ca
        self._pair = (cert_file.read_bytes(), key_file.read_bytes())
        self._trusted = client_ca.read_bytes() if client_ca is not None else None
        self.context = pki.server_ssl_context(cert_file, key_file, self._trusted)
        self.context.sni_callback = self._to_serving
        self._serving = self.context

    def _to_serving(
        self, connection: ssl.SSLObject, _server_name: str | None, _context: ssl.SSLContext
    ) -> None:
        if self._serving is not self.context:
            connection.context = self._serving

    def reload_if_changed(self) -> bool:
        pair, trusted = self.files.renewed(), self._changed_client_cas()
        if pair is None and trusted is None:
            return False
        try:
            with written_pair(*(pair or self._pair)) as (cert_file, key_file):
                context = pki.server_ssl_context(
                    cert_file, key_file, trusted if trusted is not None else self._trusted
                )
        except (OSError, ValueError, ssl.SSLError) as error:
            # No room for the scratch files, say: looked at again next time (the watch
            # must go on, or no renewal would be taken again).
            self.files.forget()
            log.warning("certificate %s not reloaded: %s", self.files.cert_file, error)
            return False
        self._serving = context
        self._pair = pair or self._pair
        if trusted is not None:
            self._trusted = trusted
            log.info("trusting the client CAs of %s as they are now", self.client_ca)
        return True

    def _changed_client_cas(self) -> bytes | None:
        """The client CA file's certificates when they changed and read whole; None
        otherwise (a half-written file is looked at again next time)."""
        if self.client_ca is None:
            return None
        try:
            bundle = self.client_ca.read_bytes()
            if bundle == self._trusted:
                return None
            ssl.create_default_context(cadata=bundle.decode())
        except (OSError, ValueError, ssl.SSLError) as error:
            log.warning("client CA %s not reloaded yet: %s", self.client_ca, error)
            return None
        return bundle

    async def watch(self, interval: float = RELOAD_SECONDS) -> None:
        while True:
            await asyncio.sleep(interval)
            self.reload_if_changed()


async def start_https_site(
    runner: web.AppRunner,
    host: str,
    port: int,
    cert_file: Path,
    key_file: Path,
    client_ca: Path | None = None,
) -> asyncio.Task[None]:
    """Starts an HTTPS site whose certificate follows its files; returns the task that
    watches them, to cancel when the site goes."""
    reloading = ReloadingContext(cert_file, key_file, client_ca)
    await web.TCPSite(runner, host, port, ssl_context=reloading.context).start()
    return asyncio.create_task(reloading.watch(), name=f"certificate {cert_file}")
