"""The kubelet-serving certificate is asked for again at 80 % of its life."""

import asyncio
import datetime
import shutil
from collections.abc import Collection
from pathlib import Path

import pytest

from kubekit import pki
from kubekit.client import ApiError, KubeClient
from virtual_node.kubeletapi import certificates
from virtual_node.kubeletapi.certificates import keep_renewed, renewal_delay


def lifetime(pair: pki.KeyPair) -> tuple[datetime.datetime, datetime.timedelta]:
    cert, _ = pair.load()
    return cert.not_valid_before_utc, cert.not_valid_after_utc - cert.not_valid_before_utc


def test_renewal_is_due_at_80_percent_of_the_life(tmp_path: Path) -> None:
    ca = pki.create_ca(tmp_path, "test")
    pair = pki.issue(ca, tmp_path / "serving", "vk-1", server_names=("127.0.0.1",))
    begins, life = lifetime(pair)
    pem = pair.cert_path.read_bytes()
    assert renewal_delay(pem, begins + life / 2) == pytest.approx((life * 0.3).total_seconds())
    assert renewal_delay(pem, begins + life * 0.9) == 0


async def test_a_due_certificate_is_renewed_and_a_failed_request_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = pki.create_ca(tmp_path, "test")
    live = pki.issue(ca, tmp_path / "kubelet-serving", "vk-1", server_names=("127.0.0.1",))
    fresh = pki.issue(ca, tmp_path / "fresh", "vk-1", server_names=("127.0.0.1",))
    begins, life = lifetime(live)
    requests: list[Path] = []
    renewed = asyncio.Event()

    async def request(
        _upper: KubeClient, node_name: str, names: Collection[str], directory: Path
    ) -> pki.KeyPair:
        requests.append(directory)
        if len(requests) == 1:
            raise ApiError(503, {"reason": "ServiceUnavailable"})
        shutil.copy(fresh.cert_path, live.cert_path)
        shutil.copy(fresh.key_path, live.key_path)
        renewed.set()
        return live

    monkeypatch.setattr(certificates, "request_certificate", request)
    monkeypatch.setattr(certificates, "RENEW_RETRY_SECONDS", 0.01)
    # At 85 % of the first certificate's life; then the fresh one is far from due.
    times = iter([begins + life * 0.85, begins + life * 0.85])
    renewing = asyncio.create_task(
        keep_renewed(
            None,  # type: ignore[arg-type]
            "vk-1",
            ["127.0.0.1"],
            live,
            clock=lambda: next(times, datetime.datetime.now(datetime.UTC)),
        )
    )
    try:
        await asyncio.wait_for(renewed.wait(), 5)
        await asyncio.sleep(0.05)
        assert requests == [tmp_path, tmp_path], "one failure, one renewal, then nothing due"
        assert live.load()[0].serial_number == fresh.load()[0].serial_number
    finally:
        renewing.cancel()


def test_a_kept_certificate_is_served_again_until_it_expires(tmp_path: Path) -> None:
    """A virtual node that starts again serves the certificate its last CSR got, due
    for renewal or not (renewed at once then: a CSR failing a moment replaced a good
    certificate with a self-signed one)."""
    ca = pki.create_ca(tmp_path, "test")
    names = ("127.0.0.1",)
    assert (
        certificates.kept_certificate(tmp_path, "vk-1", names, datetime.datetime.now(datetime.UTC))
        is None
    )
    kept = pki.issue(ca, tmp_path / "kubelet-serving", "system:node:vk-1", server_names=names)
    begins, life = lifetime(kept)
    assert certificates.kept_certificate(tmp_path, "vk-1", names, begins + life / 2) == kept
    assert certificates.kept_certificate(tmp_path, "vk-1", names, begins + life * 0.9) == kept
    assert certificates.renewal_delay(kept.cert_path.read_bytes(), begins + life * 0.9) == 0
    assert certificates.kept_certificate(tmp_path, "vk-1", names, begins + life * 1.01) is None
    assert certificates.kept_certificate(tmp_path, "vk-2", names, begins) is None
    assert certificates.kept_certificate(tmp_path, "vk-1", ("10.0.0.1",), begins) is None


def test_a_kept_certificate_whose_key_is_another_is_not_served(tmp_path: Path) -> None:
    """A write cut short between the key and the certificate left a pair TLS refuses: a
    new CSR is filed rather than a crash at every start until the old one is due."""
    ca = pki.create_ca(tmp_path, "test")
    names = ("127.0.0.1",)
    kept = pki.issue(ca, tmp_path / "kubelet-serving", "system:node:vk-1", server_names=names)
    begins, life = lifetime(kept)
    other = pki.issue(ca, tmp_path / "other", "system:node:vk-1", server_names=names)
    shutil.copy(other.key_path, kept.key_path)
    assert certificates.kept_certificate(tmp_path, "vk-1", names, begins + life / 2) is None
    kept.key_path.unlink()
    assert certificates.kept_certificate(tmp_path, "vk-1", names, begins + life / 2) is None


def test_a_pair_is_written_whole_over_the_old_one(tmp_path: Path) -> None:
    ca = pki.create_ca(tmp_path, "test")
    names = ("127.0.0.1",)
    old = pki.issue(ca, tmp_path / "kubelet-serving", "system:node:vk-1", server_names=names)
    new = pki.issue(ca, tmp_path / "new", "system:node:vk-1", server_names=names)
    written = certificates._write_pair(
        tmp_path, new.key_path.read_bytes(), new.cert_path.read_bytes()
    )
    assert written == old
    assert old.load()[0].serial_number == new.load()[0].serial_number
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert oct(old.key_path.stat().st_mode & 0o777) == "0o600"


def test_a_write_that_fails_leaves_the_file_it_was_to_replace_whole(tmp_path: Path) -> None:
    """The new key cannot be written (here its scratch name is taken by a directory; a
    full disk alike): the key served until then is intact, where a write in place left
    part of a key that no start could serve."""
    ca = pki.create_ca(tmp_path, "test")
    names = ("127.0.0.1",)
    old = pki.issue(ca, tmp_path / "kubelet-serving", "system:node:vk-1", server_names=names)
    before = old.key_path.read_bytes(), old.cert_path.read_bytes()
    new = pki.issue(ca, tmp_path / "new", "system:node:vk-1", server_names=names)
    (tmp_path / f".{old.key_path.name}.new").mkdir()
    with pytest.raises(OSError):
        certificates._write_pair(tmp_path, new.key_path.read_bytes(), new.cert_path.read_bytes())
    assert (old.key_path.read_bytes(), old.cert_path.read_bytes()) == before


async def test_a_self_signed_pair_served_while_the_signer_is_away_is_replaced_once_signed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first CSR failed (the signer away a moment at start): a self-signed pair is
    served from where a signed one will be written, and a CSR is asked for again until
    one is signed, not at 80 % of the self-signed pair's year."""
    ca = pki.create_ca(tmp_path, "test")
    signed = pki.issue(ca, tmp_path / "signed", "system:node:vk-1", server_names=("127.0.0.1",))
    attempts: list[Path] = []
    renewed = asyncio.Event()

    async def request(
        _upper: KubeClient, node_name: str, names: Collection[str], directory: Path
    ) -> pki.KeyPair:
        attempts.append(directory)
        if len(attempts) < 3:
            raise ApiError(503, {"reason": "ServiceUnavailable"})
        pair = certificates._write_pair(
            directory, signed.key_path.read_bytes(), signed.cert_path.read_bytes()
        )
        renewed.set()
        return pair

    monkeypatch.setattr(certificates, "request_certificate", request)
    monkeypatch.setattr(certificates, "RENEW_RETRY_SECONDS", 0.01)
    directory = tmp_path / "serving"
    pair, renewal = await certificates.serving_certificate(
        None,  # type: ignore[arg-type]
        "vk-1",
        ["127.0.0.1"],
        directory,
        None,
    )
    assert renewal is certificates.Renewal.PROVISIONAL
    assert pair == certificates._issued_pair(directory)
    assert pair.load()[0].issuer != signed.load()[0].issuer, "self-signed meanwhile"
    renewing = asyncio.create_task(
        keep_renewed(None, "vk-1", ["127.0.0.1"], pair, provisional=True)  # type: ignore[arg-type]
    )
    try:
        await asyncio.wait_for(renewed.wait(), 5)
        await asyncio.sleep(0.05)
    finally:
        renewing.cancel()
    assert len(attempts) == 3, "asked again until signed, then not before it is due"
    assert pair.load()[0].serial_number == signed.load()[0].serial_number


async def test_a_provisional_pair_is_asked_for_ever_more_rarely_and_not_once_forbidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each try leaves a CSR behind: after a minute, then twice as long each time up to an
    hour; none after the apiserver forbids the virtual node its CSRs."""
    failures: list[BaseException] = [ApiError(503, {"reason": "ServiceUnavailable"})] * 8
    failures.append(ApiError(403, {"reason": "Forbidden"}))
    slept: list[float] = []

    async def request(*_args: object) -> pki.KeyPair:
        raise failures.pop(0)

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(certificates, "request_certificate", request)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    pair = certificates._issued_pair(tmp_path)
    await keep_renewed(None, "vk-1", ["127.0.0.1"], pair, provisional=True)  # type: ignore[arg-type]
    assert slept == [60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]
    assert failures == []
