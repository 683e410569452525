import asyncio
import shutil
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from cryptography import x509

from kubekit import pki
from kubekit.certreload import ReloadingContext


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while line := await reader.readline():
        writer.write(line)
        await writer.drain()
    writer.close()


@asynccontextmanager
async def serving(context: ssl.SSLContext) -> AsyncIterator[int]:
    server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def connect(port: int, ca: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int]:
    """A TLS connection trusting ``ca``, and the serial of the certificate it was shown."""
    client = ssl.create_default_context(cafile=str(ca))
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    ssl_object = writer.get_extra_info("ssl_object")
    serial = x509.load_der_x509_certificate(ssl_object.getpeercert(binary_form=True)).serial_number
    return reader, writer, serial


def serial(pair: pki.KeyPair) -> int:
    return pair.load()[0].serial_number


async def test_new_connections_get_the_renewed_pair_and_open_ones_carry_on(
    tmp_path: Path,
) -> None:
    ca = pki.create_ca(tmp_path, "test")
    first = pki.issue(ca, tmp_path / "first", "127.0.0.1", server_names=("127.0.0.1",))
    second = pki.issue(ca, tmp_path / "second", "127.0.0.1", server_names=("127.0.0.1",))
    live = pki.KeyPair(tmp_path / "tls.crt", tmp_path / "tls.key")
    shutil.copy(first.cert_path, live.cert_path)
    shutil.copy(first.key_path, live.key_path)
    reloading = ReloadingContext(live.cert_path, live.key_path)
    assert not reloading.reload_if_changed(), "nothing changed yet"
    async with serving(reloading.context) as port:
        reader, writer, shown = await connect(port, ca.cert_path)
        assert shown == serial(first)

        # The renewal lands as a certificate whose key is not there yet: kept as it was.
        shutil.copy(second.cert_path, live.cert_path)
        assert not reloading.reload_if_changed()
        assert (await connect(port, ca.cert_path))[2] == serial(first)
        shutil.copy(second.key_path, live.key_path)
        assert reloading.reload_if_changed()
        assert (await connect(port, ca.cert_path))[2] == serial(second)

        writer.write(b"still there?\n")
        assert await reader.readline() == b"still there?\n"
        writer.close()


async def test_watch_reloads_on_its_own(tmp_path: Path) -> None:
    ca = pki.create_ca(tmp_path, "test")
    first = pki.issue(ca, tmp_path / "first", "127.0.0.1", server_names=("127.0.0.1",))
    second = pki.issue(ca, tmp_path / "second", "127.0.0.1", server_names=("127.0.0.1",))
    reloading = ReloadingContext(first.cert_path, first.key_path)
    watching = asyncio.create_task(reloading.watch(interval=0.05))
    try:
        async with serving(reloading.context) as port:
            first.cert_path.write_bytes(second.cert_path.read_bytes())
            first.key_path.write_bytes(second.key_path.read_bytes())
            for _ in range(100):
                if (await connect(port, ca.cert_path))[2] == serial(second):
                    break
                await asyncio.sleep(0.05)
            assert (await connect(port, ca.cert_path))[2] == serial(second)
    finally:
        watching.cancel()


async def test_the_pair_loaded_is_the_pair_checked_however_the_files_change_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A certificate loaded with another key serves no handshake at all: what is loaded
    is the pair that was checked, not the files read once more."""
    ca = pki.create_ca(tmp_path, "test")
    first = pki.issue(ca, tmp_path / "first", "127.0.0.1", server_names=("127.0.0.1",))
    second = pki.issue(ca, tmp_path / "second", "127.0.0.1", server_names=("127.0.0.1",))
    third = pki.issue(ca, tmp_path / "third", "127.0.0.1", server_names=("127.0.0.1",))
    reloading = ReloadingContext(first.cert_path, first.key_path)
    first.cert_path.write_bytes(second.cert_path.read_bytes())
    first.key_path.write_bytes(second.key_path.read_bytes())
    checked = reloading.files.renewed

    def rewritten_after_the_check() -> tuple[bytes, bytes] | None:
        pair = checked()
        # The next renewal lands half-way: its certificate, the key still the last one.
        first.cert_path.write_bytes(third.cert_path.read_bytes())
        return pair

    monkeypatch.setattr(reloading.files, "renewed", rewritten_after_the_check)
    assert reloading.reload_if_changed()
    async with serving(reloading.context) as port:
        assert (await connect(port, ca.cert_path))[2] == serial(second)


async def accepted_as(port: int, ca: Path, client: pki.KeyPair) -> bool:
    """Whether a connection showing ``client``'s certificate is served."""
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(client.cert_path, client.key_path)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        writer.write(b"hello\n")
        answer = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
    except (OSError, ssl.SSLError):
        return False
    return answer == b"hello\n"


async def test_the_client_cas_trusted_are_those_of_the_file_as_it_is_now(tmp_path: Path) -> None:
    """A CA rotated in the cluster signs the apiserver's new client certificate: until
    a restart every call of it was refused at the handshake. A CA rotated out is no
    longer trusted (it stayed trusted until a restart)."""
    serving_ca = pki.create_ca(tmp_path, "serving")
    pair = pki.issue(serving_ca, tmp_path / "tls", "127.0.0.1", server_names=("127.0.0.1",))
    old_ca, new_ca = pki.create_ca(tmp_path, "old"), pki.create_ca(tmp_path, "new")
    old_client = pki.issue(old_ca, tmp_path / "old-client", "apiserver", client=True)
    new_client = pki.issue(new_ca, tmp_path / "new-client", "apiserver", client=True)
    client_ca = tmp_path / "client-ca.crt"
    client_ca.write_bytes(old_ca.cert_path.read_bytes())
    reloading = ReloadingContext(pair.cert_path, pair.key_path, client_ca)
    async with serving(reloading.context) as port:
        assert await accepted_as(port, serving_ca.cert_path, old_client)
        assert not await accepted_as(port, serving_ca.cert_path, new_client)
        client_ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nhalf")  # being written
        assert not reloading.reload_if_changed()
        # During the rotation the bundle holds both.
        client_ca.write_bytes(old_ca.cert_path.read_bytes() + new_ca.cert_path.read_bytes())
        assert reloading.reload_if_changed()
        assert not reloading.reload_if_changed(), "nothing changed since"
        assert await accepted_as(port, serving_ca.cert_path, new_client)
        assert await accepted_as(port, serving_ca.cert_path, old_client)
        client_ca.write_bytes(new_ca.cert_path.read_bytes())
        assert reloading.reload_if_changed()
        assert await accepted_as(port, serving_ca.cert_path, new_client)
        assert not await accepted_as(port, serving_ca.cert_path, old_client)


def resumed(port: int, ca: Path, client: pki.KeyPair, version: ssl.TLSVersion) -> bool:
    """Whether a second connection of ``client`` resumes the session of its first."""
    context = ssl.create_default_context(cafile=str(ca))
    context.maximum_version = version
    context.load_cert_chain(client.cert_path, client.key_path)
    session, reused = None, False
    for _ in range(2):
        with (
            socket.create_connection(("127.0.0.1", port)) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as tls,
        ):
            tls.sendall(b"hello\n")
            tls.recv(16)  # a TLS 1.3 ticket comes after the handshake
            reused, session = bool(tls.session_reused), tls.session
    return reused


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
async def test_no_session_is_resumed_past_the_client_certificates_check(
    tmp_path: Path, version: ssl.TLSVersion
) -> None:
    """A resumed session skips the check: a client of a CA since taken out of the file
    would still get in."""
    ca = pki.create_ca(tmp_path, "serving")
    pair = pki.issue(ca, tmp_path / "tls", "127.0.0.1", server_names=("127.0.0.1",))
    clients_ca = pki.create_ca(tmp_path, "clients")
    client = pki.issue(clients_ca, tmp_path / "client", "apiserver", client=True)
    reloading = ReloadingContext(pair.cert_path, pair.key_path, clients_ca.cert_path)
    async with serving(reloading.context) as port:
        assert not await asyncio.to_thread(resumed, port, ca.cert_path, client, version)
