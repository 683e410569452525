"""The kubelet-serving certificate renewed while the kubelet API serves: a federation of
its own whose controller-manager signs for 90 s, so the virtual node renews within the
test; a `kubectl logs -f` opened before the renewal keeps streaming after it, and new
connections get the renewed certificate."""

from __future__ import annotations

import dataclasses
import datetime
import select
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from harness.federation import Federation, FederationSpec, virtual_node_name
from harness.localcluster import LocalCluster
from harness.toolchain import Toolchain

from .helpers import apply, cluster_pod, namespace, wait_for

SIGNING = "90s"
# What it signs lives its 90 s and the few minutes the signer backdates it by: far from
# the year the signer gives by default.
SHORT_LIVED = datetime.timedelta(minutes=10)


@pytest.fixture(scope="module")
def short_lived(
    tmp_path_factory: pytest.TempPathFactory, toolchain: Toolchain
) -> Iterator[Federation]:
    upper, *lowers = FederationSpec(lower=1, nodes_per_lower=1).clusters()
    federation = Federation(
        tmp_path_factory.mktemp("short-lived"),
        [dataclasses.replace(upper, signing_duration=SIGNING), *lowers],
        toolchain,
    )
    federation.start()
    try:
        federation.start_virtual_nodes()
        yield federation
    finally:
        federation.stop()


def served_certificate(port: int) -> x509.Certificate:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def kubelet_port(federation: Federation) -> int:
    (port,) = [
        int(a.split("=", 1)[1])
        for a in federation.components[virtual_node_name("lower-1")].argv
        if a.startswith("--kubelet-port=")
    ]
    return port


def test_a_renewed_certificate_is_served_to_new_connections_while_open_ones_go_on(
    short_lived: Federation, tmp_path: Path
) -> None:
    upper, lower = short_lived.upper, short_lived.clusters["lower-1"]
    assert isinstance(lower, LocalCluster)
    apply(upper, namespace("rot"), cluster_pod("shell", "rot", "lower-1"))
    upper.kubectl("wait", "--for=condition=Ready", "pod/shell", "-n", "rot", "--timeout=90s")
    first = served_certificate(kubelet_port(short_lived))
    assert first.not_valid_after_utc - first.not_valid_before_utc < SHORT_LIVED

    follower = upper.kubectl_process(
        "logs", "-f", "--tail=0", "-n", "rot", "shell", stdout=subprocess.PIPE, text=True
    )
    try:
        renewed = wait_for(
            lambda: (
                cert
                if (cert := served_certificate(kubelet_port(short_lived))).serial_number
                != first.serial_number
                else None
            ),
            "the virtual node to serve a renewed certificate",
            timeout=180,
            interval=2,
        )
        assert renewed is not None
        assert renewed.issuer == first.issuer, "signed by the cluster's CA again"
        # The stream opened before the renewal carries on.
        lower.append_pod_log("written-after-the-renewal")
        assert follower.stdout is not None
        ready, _, _ = select.select([follower.stdout], [], [], 30)
        assert ready, "the open stream went quiet"
        assert follower.stdout.readline().strip() == "written-after-the-renewal"
        assert follower.poll() is None
    finally:
        follower.kill()
        follower.wait()
    # A new connection, through the apiserver, with the renewed certificate.
    assert "written-after-the-renewal" in upper.kubectl("logs", "-n", "rot", "shell").stdout
