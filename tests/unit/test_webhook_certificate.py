import base64
import datetime
from pathlib import Path

from cryptography import x509

from kubekit import pki
from webhook.certificate import (
    ca_bundle,
    ca_bundle_patch,
    ca_due,
    leaf_due,
    secret,
    secret_data,
    service_names,
)

NAMES = service_names("kubestrata-webhook", "kubestrata-system")
RENEW = datetime.timedelta(days=30)


def now() -> datetime.datetime:
    # At the test, not at collection: certificates made in a test begin 5 minutes before.
    return datetime.datetime.now(datetime.UTC)


def test_the_service_is_named_as_the_apiserver_reaches_it_first() -> None:
    assert NAMES[0] == "kubestrata-webhook.kubestrata-system.svc"
    assert "kubestrata-webhook.kubestrata-system.svc.cluster.local" in NAMES


def test_a_new_ca_is_due_when_missing_or_expiring(tmp_path: Path) -> None:
    ca = pki.create_ca(tmp_path, "webhook")
    data = {"ca.crt": ca.cert_path.read_bytes(), "ca.key": ca.key_path.read_bytes()}
    assert ca_due({}, now(), RENEW) == "no CA yet"
    assert ca_due(data, now(), RENEW) == ""
    assert ca_due(data, now() + datetime.timedelta(days=3640), RENEW).startswith("the CA expires")
    assert ca_due({**data, "ca.crt": b"junk"}, now(), RENEW) == "the CA certificate does not parse"


def test_a_new_leaf_is_due_unless_this_ca_signed_it_for_these_names_for_long_enough(
    tmp_path: Path,
) -> None:
    ca = pki.create_ca(tmp_path, "webhook")
    other = pki.create_ca(tmp_path, "other")
    good = pki.issue(ca, tmp_path / "good", NAMES[0], server_names=NAMES)
    foreign = pki.issue(other, tmp_path / "foreign", NAMES[0], server_names=NAMES)
    narrow = pki.issue(ca, tmp_path / "narrow", NAMES[0], server_names=NAMES[:1])

    def data(pair: pki.KeyPair) -> dict[str, bytes]:
        return {"tls.crt": pair.cert_path.read_bytes(), "tls.key": pair.key_path.read_bytes()}

    ca_pem = ca.cert_path.read_bytes()
    assert leaf_due({}, ca_pem, NAMES, now(), RENEW) == "no serving certificate yet"
    assert leaf_due(data(good), ca_pem, NAMES, now(), RENEW) == ""
    assert "does not verify" in leaf_due(data(foreign), ca_pem, NAMES, now(), RENEW)
    assert leaf_due(data(narrow), ca_pem, NAMES, now(), RENEW).startswith(
        "the serving certificate lacks kubestrata-webhook,"
    )
    later = now() + datetime.timedelta(days=340)
    assert leaf_due(data(good), ca_pem, NAMES, later, RENEW).startswith(
        "the serving certificate expires on"
    )


def test_secrets_carry_their_data_encoded_and_read_back() -> None:
    tls = secret("s", "ns", {"tls.key": b"k", "tls.crt": b"c"}, "kubernetes.io/tls")
    assert tls["type"] == "kubernetes.io/tls"
    assert tls["data"] == {"tls.crt": "Yw==", "tls.key": "aw=="}
    assert secret_data(tls) == {"tls.crt": b"c", "tls.key": b"k"}
    assert secret_data(None) == {}


def test_the_ca_bundle_is_written_only_where_it_differs() -> None:
    encoded = base64.b64encode(b"CA").decode()
    configuration = {
        "webhooks": [
            {"clientConfig": {"service": {}}},
            {"clientConfig": {"caBundle": encoded}},
            {"clientConfig": {"caBundle": "old"}},
        ]
    }
    assert ca_bundle_patch(configuration, b"CA") == [
        {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": encoded},
        {"op": "replace", "path": "/webhooks/2/clientConfig/caBundle", "value": encoded},
    ]
    assert ca_bundle_patch({"webhooks": [{"clientConfig": {"caBundle": encoded}}]}, b"CA") == []


def test_a_new_ca_is_published_beside_the_one_of_the_certificate_served_until_reloaded(
    tmp_path: Path,
) -> None:
    """With the new CA alone in the bundle, the apiserver refused the replicas' old
    certificate until they loaded the renewed Secret, and with failurePolicy Fail every
    federated pod's creation meanwhile."""
    old_ca, new_ca = pki.create_ca(tmp_path, "old"), pki.create_ca(tmp_path, "new")
    old_leaf = pki.issue(old_ca, tmp_path / "old-tls", NAMES[0], server_names=NAMES)
    new_leaf = pki.issue(new_ca, tmp_path / "new-tls", NAMES[0], server_names=NAMES)
    old_pem, new_pem = old_ca.cert_path.read_bytes(), new_ca.cert_path.read_bytes()
    served = old_leaf.cert_path.read_bytes()
    # The CA expiring: the old one is still in its Secret.
    both = ca_bundle(new_pem, served, [old_pem], now())
    assert x509.load_pem_x509_certificates(both) == [
        x509.load_pem_x509_certificate(new_pem),
        x509.load_pem_x509_certificate(old_pem),
    ]
    # Its Secret lost: the old CA is found in the bundle published now.
    assert ca_bundle(new_pem, served, [b"", b"not pem"], now()) == new_pem
    assert ca_bundle(new_pem, served, [b"not pem", old_pem], now()) == both
    # Run again at once (the first run's publishing failed): the new certificate is in
    # the Secret, but the replicas may not serve it yet: the old CA stays.
    assert ca_bundle(new_pem, new_leaf.cert_path.read_bytes(), [both], now()) == both
    # A later run, the new certificate served for long enough: the old CA goes.
    later_run = now() + datetime.timedelta(minutes=11)
    assert ca_bundle(new_pem, new_leaf.cert_path.read_bytes(), [both], later_run) == new_pem
    # Nothing served yet, or an old CA that has ended: the new one alone.
    assert ca_bundle(new_pem, None, [old_pem], now()) == new_pem
    later = now() + datetime.timedelta(days=3651 * 2)
    assert ca_bundle(new_pem, served, [old_pem], later) == new_pem
