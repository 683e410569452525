import ipaddress
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kubekit import pki


def test_issued_serving_certificate_is_signed_by_the_ca_with_its_names(tmp_path: Path) -> None:
    ca = pki.create_ca(tmp_path, "test")
    pair = pki.issue(
        ca, tmp_path / "server", "kube-apiserver", server_names=("127.0.0.1", "localhost")
    )
    ca_cert, _ = ca.load()
    cert, key = pair.load()
    cert.verify_directly_issued_by(ca_cert)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert oct(pair.key_path.stat().st_mode & 0o777) == "0o600"


def test_client_certificate_carries_user_and_groups(tmp_path: Path) -> None:
    ca = pki.create_ca(tmp_path, "test")
    cert, _ = pki.issue(
        ca, tmp_path / "admin", "alice", organizations=("system:masters",), client=True
    ).load()
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "alice"
    assert (
        cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    )
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_kubeconfig_points_at_server_ca_and_client_certificate(tmp_path: Path) -> None:
    ca = pki.create_ca(tmp_path, "test")
    user = pki.issue(ca, tmp_path / "admin", "admin", client=True)
    path = pki.write_kubeconfig(
        tmp_path / "kubeconfig",
        cluster="c1",
        server="https://127.0.0.1:6443",
        ca=ca.cert_path,
        user=user,
    )
    config = yaml.safe_load(path.read_text())
    assert config["current-context"] == "c1"
    assert config["clusters"][0]["cluster"] == {
        "server": "https://127.0.0.1:6443",
        "certificate-authority": str(ca.cert_path),
    }
    assert config["users"][0]["user"]["client-certificate"] == str(user.cert_path)
