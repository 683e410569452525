"""A server's TLS context that takes its certificate files again when they change (a
renewed Secret, a renewed kubelet-serving certificate): connections made after the
change get the new pair, open ones carry on with theirs."""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

from aiohttp import web

from kubekit import pki

log = logging.getLogger(__name__)

RELOAD_SECONDS = 10.0


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

    def renewed(self) -> bool:
        """Whether the files changed since last asked and now hold a pair that goes
        together; a half-written pair is left for the next time."""
        try:
            current = self._read()
            if current == self._seen:
                return False
            pki.server_ssl_context(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as error:
            log.warning("certificate %s not reloaded yet: %s", self.cert_file, error)
            return False
        self._seen = current
        log.info("serving with the renewed certificate %s", self.cert_file)
        return True


class ReloadingContext:
    """A server SSLContext that loads its files again once they are renewed: connections
    made after that get the new pair, open ones carry on with theirs. (The pair is tried
    on a scratch context first: a key that does not match would leave the live one with
    the new certificate and the old key.)"""

    def __init__(self, cert_file: Path, key_file: Path, client_ca: Path | None = None) -> None:
        self.files = CertificateFiles(cert_file, key_file)
        self.context = pki.server_ssl_context(cert_file, key_file, client_ca)

    def reload_if_changed(self) -> bool:
        if not self.files.renewed():
            return False
        try:
            self.context.load_cert_chain(self.files.cert_file, self.files.key_file)
        except (OSError, ssl.SSLError) as error:
            # Written again between the check and the load: looked at again next time
            # (the watch must not end on it, or no renewal would be taken again).
            self.files.forget()
            log.warning("certificate %s not reloaded yet: %s", self.files.cert_file, error)
            return False
        return True

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
