"""Stock kubectl against the upper cluster reaching a pod that runs in a lower cluster,
through the virtual node's kubelet API (SPDY from the apiserver, WebSocket below)."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pty
import select
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.federation import Federation, virtual_node_name
from harness.localcluster import LocalCluster
from kubekit import keys, pki

from .helpers import apply, cluster_pod, get_json, namespace, wait_for

NS = "kapi"
POD = "shell"


@pytest.fixture(scope="module")
def pod(federation: Federation) -> Iterator[str]:
    """A pod of the upper cluster that runs in lower-1."""
    upper = federation.upper
    apply(upper, namespace(NS), cluster_pod(POD, NS, "lower-1"))
    try:
        upper.kubectl("wait", "--for=condition=Ready", f"pod/{POD}", "-n", NS, "--timeout=90s")
        yield POD
    finally:
        # A bare pod left on the node, even one that never got Ready, would stop other
        # tests' drains.
        upper.kubectl("delete", "pod", POD, "-n", NS, "--timeout=90s")
        upper.kubectl("delete", "namespace", NS, "--wait=false")


def lower(federation: Federation) -> LocalCluster:
    cluster = federation.clusters["lower-1"]
    assert isinstance(cluster, LocalCluster)
    return cluster


def logs(federation: Federation, *args: str) -> str:
    return federation.upper.kubectl("logs", "-n", NS, POD, *args).stdout


def test_logs_with_tail_timestamps_limit_and_since(federation: Federation, pod: str) -> None:
    cluster = lower(federation)
    old = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=2)).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ"
    )
    with cluster.pod_log_file.open("a") as log:
        log.write(f"{old} stdout F two-hours-old\n")
    cluster.append_pod_log("tail-1", "tail-2", "tail-3")
    assert logs(federation, "--tail=2").splitlines() == ["tail-2", "tail-3"]
    stamped = logs(federation, "--tail=1", "--timestamps").strip()
    stamp, _, text = stamped.partition(" ")
    assert text == "tail-3"
    assert datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).year >= 2024
    assert logs(federation, "--limit-bytes=7") == (logs(federation)[:7])
    recent = logs(federation, "--since=1h")
    assert "tail-3" in recent and "two-hours-old" not in recent
    assert "two-hours-old" in logs(federation)


def test_logs_follow_sees_lines_written_after_it_started(federation: Federation, pod: str) -> None:
    follower = federation.upper.kubectl_process(
        "logs",
        "-f",
        "--tail=0",
        "-n",
        NS,
        POD,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2)  # let the stream open before the line is written
        lower(federation).append_pod_log("written-after-follow-started")
        assert follower.stdout is not None
        ready, _, _ = select.select([follower.stdout], [], [], 30)
        assert ready, "no line within 30 s"
        assert follower.stdout.readline().strip() == "written-after-follow-started"
    finally:
        follower.kill()
        follower.wait()


def test_exec_stdout_stderr_stdin_and_exit_code(federation: Federation, pod: str) -> None:
    upper = federation.upper
    result = upper.kubectl(
        "exec", "-n", NS, POD, "--", "sh", "-c", "echo out; echo err >&2; exit 3", check=False
    )
    assert (result.returncode, result.stdout, result.stderr.splitlines()[0]) == (3, "out\n", "err")
    # kwok never closes a command's stdin (below), so the commands read what they expect.
    echoed = upper.kubectl(
        "exec", "-i", "-n", NS, POD, "--", "head", "-n", "2", input="piped\nstdin\n"
    )
    assert echoed.stdout == "piped\nstdin\n"
    counted = upper.kubectl(
        "exec",
        "-i",
        "-n",
        NS,
        POD,
        "--",
        "sh",
        "-c",
        "head -c 4000000 | sha256sum",
        input="x" * 4_000_000,
    )
    assert counted.stdout.split()[0] == hashlib.sha256(b"x" * 4_000_000).hexdigest()


def test_exec_with_a_terminal(federation: Federation, pod: str) -> None:
    controller, terminal = pty.openpty()
    process = federation.upper.kubectl_process(
        "exec",
        "-it",
        "-n",
        NS,
        POD,
        "--",
        "sh",
        "-c",
        # kwok drops terminal output of a command that exits at once.
        "test -t 0 && echo is-a-tty; sleep 1; exit 5",
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    output = b""
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 1)
        if ready:
            try:
                output += os.read(controller, 4096)
            except OSError:
                break
    process.wait(10)
    os.close(controller)
    assert b"is-a-tty" in output
    assert process.returncode == 5


def test_cp_of_a_multi_megabyte_file_from_the_pod(
    federation: Federation, pod: str, tmp_path: Path
) -> None:
    # kwok runs the pod's commands on this machine: the pod's files are local files.
    source = tmp_path / "in-pod" / "data.bin"
    source.parent.mkdir()
    source.write_bytes(os.urandom(5_000_000))
    target = tmp_path / "copied.bin"
    federation.upper.kubectl("cp", f"{NS}/{POD}:{source}", str(target))
    assert (
        hashlib.sha256(target.read_bytes()).digest() == hashlib.sha256(source.read_bytes()).digest()
    )


# kwok v0.8.0 copies a command's stdin into its pipe and never closes it (utils/exec
# Command with PipeStdin), also with kubectl talking to the lower cluster directly. tar
# reads 10 KiB records; with this size kubectl's archive (512-byte header, the data, two
# zero blocks) fills whole records, so tar sees the end of the archive without needing
# stdin EOF.
RECORD_ALIGNED_SIZE = 300 * 10240 - 512 - 1024


def test_cp_of_a_multi_megabyte_file_into_the_pod(
    federation: Federation, pod: str, tmp_path: Path
) -> None:
    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(RECORD_ALIGNED_SIZE))
    target = tmp_path / "in-pod"
    target.mkdir()
    federation.upper.kubectl("cp", str(source), f"{NS}/{POD}:{target}/data.bin", timeout=60)
    assert (
        hashlib.sha256((target / "data.bin").read_bytes()).digest()
        == hashlib.sha256(source.read_bytes()).digest()
    )


def wait_for_attached_output(
    federation: Federation, attached: subprocess.Popen[str], marker: str
) -> None:
    """Writes ``marker`` to the output kwok serves to attached clients, again each second
    (a client attaches a moment after it starts), until ``attached`` prints it."""
    assert attached.stdout is not None
    output = attached.stdout

    def seen() -> bool:
        lower(federation).append_pod_log(marker)
        ready, _, _ = select.select([output], [], [], 1)
        return bool(ready) and marker in output.readline()

    try:
        wait_for(seen, f"{marker} in the attached output", timeout=60, interval=0)
    finally:
        attached.kill()
        attached.wait()


def test_attach_streams_the_container_output(federation: Federation, pod: str) -> None:
    attach = federation.upper.kubectl_process(
        "attach",
        "-n",
        NS,
        POD,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    wait_for_attached_output(federation, attach, "seen-by-attach")


class UppercaseServer:
    """A TCP server on the port kwok forwards pod ports to: answers in upper case."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    @staticmethod
    def _answer(connection: socket.socket) -> None:
        with connection:
            while data := connection.recv(65536):
                connection.sendall(data.upper())

    def close(self) -> None:
        self.listener.close()


def test_port_forward_carries_data_both_ways(federation: Federation, pod: str) -> None:
    server = UppercaseServer(lower(federation).ports.pod_ports)
    forward = federation.upper.kubectl_process(
        "port-forward",
        "-n",
        NS,
        f"pod/{POD}",
        ":80",
        ":8080",
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert forward.stdout is not None
        local_ports: list[int] = []
        while len(local_ports) < 2:
            line = forward.stdout.readline()
            assert line, "port-forward ended early"
            if line.startswith("Forwarding from 127.0.0.1:"):
                local_ports.append(int(line.split(":")[1].split()[0]))
        payload = os.urandom(300_000).hex().encode()
        for local_port in local_ports * 2:  # several connections on each of two ports
            with socket.create_connection(("127.0.0.1", local_port), timeout=30) as client:
                client.sendall(payload)
                client.shutdown(socket.SHUT_WR)
                received = b""
                while len(received) < len(payload) and (chunk := client.recv(65536)):
                    received += chunk
            assert received == payload.upper()
    finally:
        forward.kill()
        forward.wait()
        server.close()


def kubelet_url(federation: Federation, path: str) -> str:
    node = get_json(federation.upper, "node", "vk-lower-1")
    port = node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"]
    return f"https://127.0.0.1:{port}{path}"


def call_kubelet(
    url: str, *, token: str | None = None, cert: pki.KeyPair | None = None
) -> tuple[int, Any]:
    """The status and the decoded JSON answer (a text one as it is), or for an error its
    plain-text message."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if cert is not None:
        context.load_cert_chain(cert.cert_path, cert.key_path)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), context=context, timeout=30
        ) as response:
            body = response.read()
            if response.headers.get_content_type() != "application/json":
                return response.status, body.decode()
            return response.status, json.loads(body)
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_unauthenticated_and_unauthorized_callers_are_refused(
    federation: Federation, pod: str, tmp_path: Path
) -> None:
    url = kubelet_url(federation, f"/containerLogs/{NS}/{POD}/app")
    assert call_kubelet(url)[0] == 401
    assert call_kubelet(url, token="not-a-token")[0] == 401
    upper = federation.upper
    upper.kubectl("create", "serviceaccount", "nobody", "-n", NS)
    token = upper.kubectl("create", "token", "nobody", "-n", NS).stdout.strip()
    status, body = call_kubelet(url, token=token)
    assert status == 403
    assert body.startswith("Forbidden (") and "subresource(s)=[proxy]" in body
    stranger = pki.issue(upper.ca, tmp_path / "stranger", "stranger", client=True)
    assert call_kubelet(url, cert=stranger)[0] == 403
    admin_status, pods = call_kubelet(kubelet_url(federation, "/pods"), cert=upper.admin_cert)
    assert admin_status == 200
    assert f"{NS}/{POD}" in {
        f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods["items"]
    }


def test_a_client_granted_nodes_pods_reads_pods_but_not_logs(
    federation: Federation, pod: str
) -> None:
    """A kubelet with KubeletFineGrainedAuthz (on by default since 1.33) lets a client
    granted only ``nodes/pods`` (a monitoring agent) list its pods: not its logs."""
    upper = federation.upper
    upper.kubectl("create", "serviceaccount", "pod-lister", "-n", NS)
    upper.kubectl(
        "create", "clusterrole", "node-pods-reader", "--verb=get", "--resource=nodes/pods"
    )
    upper.kubectl(
        "create",
        "clusterrolebinding",
        "node-pods-reader",
        "--clusterrole=node-pods-reader",
        f"--serviceaccount={NS}:pod-lister",
    )
    try:
        token = upper.kubectl("create", "token", "pod-lister", "-n", NS).stdout.strip()
        status, pods = call_kubelet(kubelet_url(federation, "/pods"), token=token)
        assert status == 200
        assert POD in {p["metadata"]["name"] for p in pods["items"]}
        assert call_kubelet(kubelet_url(federation, "/runningpods/"), token=token)[0] == 200
        status, body = call_kubelet(
            kubelet_url(federation, f"/containerLogs/{NS}/{POD}/app"), token=token
        )
        assert status == 403 and "subresource(s)=[proxy]" in body
    finally:
        upper.kubectl("delete", "clusterrolebinding,clusterrole", "node-pods-reader")


def test_running_pods_lists_the_pod_as_a_kubelet_does(federation: Federation, pod: str) -> None:
    status, listed = call_kubelet(
        kubelet_url(federation, "/runningpods/"), cert=federation.upper.admin_cert
    )
    assert status == 200 and listed["kind"] == "PodList"
    above = get_json(federation.upper, "pod", "-n", NS, POD)
    (entry,) = [
        p
        for p in listed["items"]
        if (p["metadata"]["namespace"], p["metadata"]["name"]) == (NS, POD)
    ]
    assert entry["metadata"]["uid"] == above["metadata"]["uid"]
    assert entry["spec"]["containers"] == [
        {"name": c["name"], "image": c["image"], "resources": {}}
        for c in above["status"]["containerStatuses"]
        if "running" in c["state"]
    ]


def test_bad_requests_get_clear_messages(federation: Federation, pod: str) -> None:
    admin = federation.upper.admin_cert
    status, body = call_kubelet(
        kubelet_url(federation, f"/containerLogs/{NS}/nope/app"), cert=admin
    )
    assert status == 404 and f"pod {NS}/nope not found" in body
    status, body = call_kubelet(
        kubelet_url(federation, f"/containerLogs/{NS}/{POD}/nope"), cert=admin
    )
    assert status == 404 and "container 'nope'" in body
    status, body = call_kubelet(
        kubelet_url(federation, f"/containerLogs/{NS}/{POD}/app?tailLines=-3"), cert=admin
    )
    assert status == 400 and body.startswith("tailLines")
    result = federation.upper.kubectl("logs", "-n", NS, POD, "-c", "nope", check=False)
    assert result.returncode != 0 and "nope" in result.stderr


def test_a_log_the_lower_cluster_refuses_reads_as_its_refusal(
    federation: Federation, pod: str
) -> None:
    """The apiserver gives kubectl a refused log's body as the message: through the
    virtual node it reads as the lower cluster's words, not as a JSON document."""
    args = ("logs", "-n", NS, POD, "-c", "app", "--previous")
    direct = lower(federation).kubectl(*args, check=False)
    via = federation.upper.kubectl(*args, check=False)
    assert direct.returncode != 0 and via.returncode != 0
    refusal = direct.stderr.strip().removeprefix("Error from server (BadRequest): ")
    assert via.stderr.strip() == f"Error from server (BadRequest): lower cluster: {refusal}"


def test_a_command_that_cannot_start_fails_with_the_words_it_fails_with_directly(
    federation: Federation, pod: str
) -> None:
    """Each apiserver wraps a kubelet's internal error once more; through the virtual
    node there is one apiserver more, whose wrapping is taken off again."""
    args = ("exec", "-n", NS, POD, "--", "no-such-command")
    direct = lower(federation).kubectl(*args, check=False)
    via = federation.upper.kubectl(*args, check=False)
    assert "executable file not found" in direct.stderr
    assert (via.returncode, via.stderr) == (direct.returncode, direct.stderr)


def test_stats_summary_names_each_pod_by_its_upper_uid(federation: Federation, pod: str) -> None:
    uid = get_json(federation.upper, "pod", "-n", NS, POD)["metadata"]["uid"]

    def listed() -> dict[str, Any] | None:
        status, summary = call_kubelet(
            kubelet_url(federation, "/stats/summary"), cert=federation.upper.admin_cert
        )
        assert status == 200, summary
        refs = [p["podRef"] for p in summary["pods"]]
        return next((r for r in refs if (r["namespace"], r["name"]) == (NS, POD)), None)

    # The lower metrics-server has the pod after its first scrapes.
    assert wait_for(listed, "the pod in the summary", timeout=120, interval=5) == {
        "name": POD,
        "namespace": NS,
        "uid": uid,
    }


def test_cadvisor_metrics_name_each_container_by_its_upper_pod_and_image(
    federation: Federation, pod: str
) -> None:
    """What Prometheus scrapes of every node (kubelet job, /metrics/cadvisor and
    /metrics) answers for a virtual node too, in the labels dashboards select on."""
    series = (
        'container_memory_working_set_bytes{container="app",'
        f'image="registry.k8s.io/pause:3.10",namespace="{NS}",pod="{POD}"}}'
    )

    def scraped() -> str:
        status, text = call_kubelet(
            kubelet_url(federation, "/metrics/cadvisor"), cert=federation.upper.admin_cert
        )
        assert status == 200, text
        return str(text) if series in text else ""

    # The lower metrics-server has the pod after its first scrapes.
    text = wait_for(scraped, "the pod's container in /metrics/cadvisor", timeout=120, interval=5)
    assert "# TYPE container_cpu_usage_seconds_total counter" in text
    cpu = series.replace("container_memory_working_set_bytes{", "")
    cpu = cpu.replace('container="app",', 'container="app",cpu="total",')
    assert f"container_cpu_usage_seconds_total{{{cpu}" in text
    status, own = call_kubelet(
        kubelet_url(federation, "/metrics"), cert=federation.upper.admin_cert
    )
    assert status == 200 and "# TYPE workqueue_adds_total counter" in own


def test_without_a_metrics_api_below_the_stats_say_so(federation: Federation) -> None:
    cluster = lower(federation)
    cluster.kubectl("delete", "apiservice", "v1beta1.metrics.k8s.io")
    try:
        for path in ("/stats/summary", "/metrics/resource", "/metrics/cadvisor"):
            status, body = call_kubelet(
                kubelet_url(federation, path), cert=federation.upper.admin_cert
            )
            assert status == 503 and "metrics.k8s.io" in body, body
    finally:
        cluster.register_metrics_api()


def test_the_serving_certificate_comes_from_an_approved_kubelet_serving_csr(
    federation: Federation, pod: str
) -> None:
    upper = federation.upper
    csrs = get_json(upper, "certificatesigningrequests")["items"]
    ours = [c for c in csrs if c["spec"]["signerName"] == "kubernetes.io/kubelet-serving"]
    # Asked for and approved by the virtual nodes' own ServiceAccount.
    assert {c["spec"]["username"] for c in ours} == {
        f"system:serviceaccount:{keys.SYSTEM_NAMESPACE}:kubestrata-virtual-node"
    }
    assert all(c["status"].get("certificate") for c in ours)
    # Signed by the upper cluster's signer, so an apiserver that verifies kubelets trusts it.
    context = ssl.create_default_context(cafile=str(upper.ca.cert_path))
    context.load_cert_chain(upper.admin_cert.cert_path, upper.admin_cert.key_path)
    with urllib.request.urlopen(kubelet_url(federation, "/healthz"), context=context) as answer:
        assert answer.read() == b"ok"


def test_kubectl_debug_adds_the_ephemeral_container_below(federation: Federation, pod: str) -> None:
    upper = federation.upper
    upper.kubectl(
        "debug", "-n", NS, POD, "--image=registry.k8s.io/pause:3.10", "--container=debugger"
    )

    def below() -> list[dict[str, Any]]:
        lower_pod = get_json(lower(federation), "pod", "-n", NS, POD)
        return list(lower_pod["spec"].get("ephemeralContainers") or [])

    (added,) = wait_for(below, "the ephemeral container in the lower pod")
    assert (added["name"], added["image"]) == ("debugger", "registry.k8s.io/pause:3.10")
    (above,) = get_json(upper, "pod", "-n", NS, POD)["spec"]["ephemeralContainers"]
    assert {k: added.get(k) for k in above} == above

    def running_above() -> list[str]:
        status = get_json(upper, "pod", "-n", NS, POD)["status"]
        return [
            c["name"]
            for c in status.get("ephemeralContainerStatuses") or []
            if "running" in c["state"]
        ]

    # Reported by the lower cluster (kwok, through the local federation's Stage).
    assert wait_for(running_above, "the ephemeral container running above") == ["debugger"]


def test_kubectl_debug_interactive_attaches_to_its_ephemeral_container(
    federation: Federation, pod: str
) -> None:
    """`kubectl debug -i` adds the container, waits for it to run and attaches to it,
    through the virtual node's kubelet API, as on any node."""
    debug = federation.upper.kubectl_process(
        "debug",
        "-i",
        "-n",
        NS,
        POD,
        "--image=registry.k8s.io/pause:3.10",
        "--container=debug-attached",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    wait_for_attached_output(federation, debug, "seen-by-debug")
    lower_pod = get_json(lower(federation), "pod", "-n", NS, POD)
    assert "debug-attached" in [c["name"] for c in lower_pod["spec"]["ephemeralContainers"]]


def test_probes_need_no_credentials_while_the_kubelet_api_does(federation: Federation) -> None:
    [port] = [
        argument.partition("=")[2]
        for argument in federation.components[virtual_node_name("lower-1")].argv
        if argument.startswith("--health-port=")
    ]
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            assert answer.read() == b"ok"
    assert call_kubelet(kubelet_url(federation, "/healthz"))[0] == 401
