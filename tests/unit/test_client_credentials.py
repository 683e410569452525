"""A kubeconfig's token is read again while the client runs, as client-go does: read
once, it expired and every call was refused for good."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from kubekit import client as kubeclient
from kubekit import pki
from kubekit.client import ApiError, ClientSettings, KubeClient, KubeconfigError, Resource
from tests.unit.tlsserver import serving_over_tls

CONFIGMAPS = Resource("", "v1", "configmaps")

# An exec plugin that gives a new token at each run, already expired.
PLUGIN = """
import json, pathlib, sys
runs = pathlib.Path(sys.argv[1])
count = int(runs.read_text() or "0") + 1 if runs.exists() else 1
runs.write_text(str(count))
print(json.dumps({
    "apiVersion": "client.authentication.k8s.io/v1",
    "kind": "ExecCredential",
    "status": {"token": f"token-{count}", "expirationTimestamp": "2020-01-01T00:00:00Z"},
}))
"""


def recording() -> tuple[web.Application, list[str]]:
    """An apiserver that lists the Authorization header of each request."""
    seen: list[str] = []

    async def get(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"metadata": {"name": "a"}})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns/configmaps/a", get)
    return app, seen


def with_user(kubeconfig: Path, user: Mapping[str, object]) -> Path:
    config = yaml.safe_load(kubeconfig.read_text())
    config["users"][0]["user"] = user
    kubeconfig.write_text(yaml.safe_dump(config))
    return kubeconfig


@pytest.fixture
def refreshed_at_each_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kubeclient, "CREDENTIALS_REFRESH_SECONDS", 0.0)


async def tokens_until(client: KubeClient, seen: list[str], wanted: str, tries: int = 100) -> None:
    """Requests until one carries ``wanted``: a read goes on beside the requests."""
    for _ in range(tries):
        await client.get(CONFIGMAPS, "a", "ns")
        if seen[-1] == wanted:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never sent {wanted}: {seen}")


@pytest.mark.usefixtures("refreshed_at_each_request")
async def test_an_exec_plugin_s_expired_token_is_fetched_again(tmp_path: Path) -> None:
    script = tmp_path / "plugin.py"
    script.write_text(PLUGIN)
    runs = tmp_path / "runs"
    app, seen = recording()
    async with serving_over_tls(tmp_path, app) as server:
        kubeconfig = with_user(server.kubeconfig(tmp_path), exec_user(script, runs))
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            await client.get(CONFIGMAPS, "a", "ns")
            assert seen == ["Bearer token-1"], "the token held, while it is read again"
            await tokens_until(client, seen, "Bearer token-2")


async def test_an_exec_plugin_s_token_refused_before_it_expires_is_fetched_again(
    tmp_path: Path,
) -> None:
    script = tmp_path / "plugin.py"
    script.write_text(PLUGIN.replace("2020-01-01", "2100-01-01"))
    seen: list[str] = []

    async def get(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        if seen[-1] == "Bearer token-1":  # revoked
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        return web.json_response({"metadata": {"name": "a"}})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns/configmaps/a", get)
    async with serving_over_tls(tmp_path, app) as server:
        kubeconfig = with_user(server.kubeconfig(tmp_path), exec_user(script, tmp_path / "runs"))
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            with pytest.raises(ApiError) as refused:
                await client.get(CONFIGMAPS, "a", "ns")
            assert refused.value.status == 401
            for _ in range(100):
                with contextlib.suppress(ApiError):
                    await client.get(CONFIGMAPS, "a", "ns")
                    break
                await asyncio.sleep(0.05)
            assert seen[-1] == "Bearer token-2"
            assert (tmp_path / "runs").read_text() == "2", "run once more, not at each 401"


def exec_user(script: Path, *args: Path) -> dict[str, object]:
    return {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(script), *map(str, args)],
            "interactiveMode": "Never",
        }
    }


@pytest.mark.usefixtures("refreshed_at_each_request")
async def test_a_plugin_that_hangs_holds_no_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request waiting on the plugin was cut by its own deadline (a Lease renewal's),
    and the next one started the plugin again, for good."""
    monkeypatch.setattr(kubeclient, "CREDENTIALS_READ_TIMEOUT", 0.2)
    script = tmp_path / "plugin.py"
    script.write_text(PLUGIN)
    runs, hang = tmp_path / "runs", tmp_path / "hang"
    script.write_text(
        "import pathlib, sys, time\n"
        "if pathlib.Path(sys.argv[2]).exists():\n    time.sleep(1)\n" + PLUGIN
    )
    app, seen = recording()
    async with serving_over_tls(tmp_path, app) as server:
        kubeconfig = with_user(server.kubeconfig(tmp_path), exec_user(script, runs, hang))
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            hang.touch()
            for _ in range(3):
                async with asyncio.timeout(2):
                    await client.get(CONFIGMAPS, "a", "ns")
    assert seen == ["Bearer token-1"] * 3, "the token held, the plugin's run beside"
    assert runs.read_text() == "1", "given up before it finished"


@pytest.mark.usefixtures("refreshed_at_each_request")
async def test_a_token_file_is_read_again_and_the_token_is_kept_when_it_is_gone(
    tmp_path: Path,
) -> None:
    token = tmp_path / "token"
    token.write_text("first")
    app, seen = recording()
    async with serving_over_tls(tmp_path, app) as server:
        kubeconfig = with_user(server.kubeconfig(tmp_path), {"tokenFile": str(token)})
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            await client.get(CONFIGMAPS, "a", "ns")
            token.write_text("rotated")
            await tokens_until(client, seen, "Bearer rotated")
            token.unlink()
            for _ in range(3):
                await client.get(CONFIGMAPS, "a", "ns")
                await asyncio.sleep(0.05)
    assert seen[0] == "Bearer first" and seen[-1] == "Bearer rotated"


# A plugin that hangs once the file its second argument names exists, in a shell that
# waits on a command of its own, as wrappers of cloud CLIs do; it writes both their pids.
HANGING_PLUGIN = """#!/bin/sh
if [ -e "$2" ]; then
    sleep 600 &
    echo "$$ $!" > "$1.tmp" && mv "$1.tmp" "$1"
    wait
fi
echo '{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
       "status": {"token": "shell", "expirationTimestamp": "2020-01-01T00:00:00Z"}}'
"""


def hanging_user(tmp_path: Path) -> tuple[dict[str, object], Path, Path]:
    """The user of a ``HANGING_PLUGIN``, the file its pids go to, and the file that
    makes it hang."""
    script = tmp_path / "plugin.sh"
    script.write_text(HANGING_PLUGIN)
    script.chmod(0o755)
    pids, hang = tmp_path / "pids", tmp_path / "hang"
    user = exec_user(script, pids, hang)
    user["exec"]["command"] = str(script)  # type: ignore[index]
    user["exec"]["args"] = [str(pids), str(hang)]  # type: ignore[index]
    return user, pids, hang


def running(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie counts as gone (an orphan's reaper is the
    container's init, which may never reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


@contextlib.contextmanager
def killed_after(pids: Path) -> Iterator[None]:
    """Kills what the plugin left running when the test failed, rather than leave it
    for ten minutes."""
    try:
        yield
    finally:
        for pid in pids_in(pids):
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def pids_in(pids: Path) -> list[int]:
    return [int(pid) for pid in pids.read_text().split()] if pids.exists() else []


async def assert_killed(pids: Path, within: float = 5.0) -> None:
    plugin, child = pids_in(pids)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while running(plugin) or running(child):
        assert loop.time() < deadline, "the plugin given up still runs"
        await asyncio.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.kill(plugin, 0)  # reaped, not left a zombie


@pytest.mark.usefixtures("refreshed_at_each_request")
async def test_a_plugin_given_up_is_killed_with_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library left it running: read again every minute, a plugin that hung left a
    process a minute for good."""
    monkeypatch.setattr(kubeclient, "CREDENTIALS_READ_TIMEOUT", 0.5)
    user, pids, hang = hanging_user(tmp_path)
    app, seen = recording()
    with killed_after(pids):
        async with serving_over_tls(tmp_path, app) as server:
            kubeconfig = with_user(server.kubeconfig(tmp_path), user)
            async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
                hang.touch()
                await requests_until_it_hangs(client, pids)
                await assert_killed(pids)
                pids.unlink()
                await requests_until_it_hangs(client, pids)
            await assert_killed(pids)  # by the client's closing
        assert set(seen) == {"Bearer shell"}, "the token held meanwhile"


async def requests_until_it_hangs(client: KubeClient, pids: Path) -> None:
    for _ in range(100):
        await client.get(CONFIGMAPS, "a", "ns")
        if pids_in(pids):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the plugin never ran")


async def test_a_plugin_that_hangs_at_the_start_fails_the_client_and_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It hung the component's start for good, saying nothing."""
    monkeypatch.setattr(kubeclient, "CREDENTIALS_READ_TIMEOUT", 0.5)
    user, pids, hang = hanging_user(tmp_path)
    hang.touch()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(kubeconfig_of(user)))
    with killed_after(pids):
        with pytest.raises(KubeconfigError, match=r"credentials not read in 0\.5 s"):
            async with asyncio.timeout(10):
                await KubeClient.connect(ClientSettings(str(kubeconfig)))
        await assert_killed(pids)


def kubeconfig_of(user: Mapping[str, object]) -> dict[str, object]:
    """A kubeconfig of an apiserver that is never called."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }


@pytest.mark.usefixtures("refreshed_at_each_request")
async def test_a_plugin_s_answer_is_read_as_the_library_did(tmp_path: Path) -> None:
    """Its arguments and environment, what it is told of the request, and a token not
    near expiring kept without running it again."""
    script = tmp_path / "plugin.py"
    script.write_text(
        "import json, os, pathlib, sys\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "runs = pathlib.Path(sys.argv[1])\n"
        "runs.write_text(str(int(runs.read_text()) + 1) if runs.exists() else '1')\n"
        "token = '-'.join([os.environ['GIVEN'], sys.argv[2], info['kind'],\n"
        "                  str(type(info['spec']['interactive']).__name__)])\n"
        "print(json.dumps({'apiVersion': info['apiVersion'], 'kind': 'ExecCredential',\n"
        "                  'status': {'token': token,\n"
        "                             'expirationTimestamp': '2999-01-01T00:00:00Z'}}))\n"
    )
    runs = tmp_path / "runs"
    user = exec_user(script, runs, Path("argument"))
    user["exec"]["env"] = [{"name": "GIVEN", "value": "env"}]  # type: ignore[index]
    app, seen = recording()
    async with serving_over_tls(tmp_path, app) as server:
        kubeconfig = with_user(server.kubeconfig(tmp_path), user)
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            for _ in range(5):
                await client.get(CONFIGMAPS, "a", "ns")
                await asyncio.sleep(0.05)
    assert set(seen) == {"Bearer env-argument-ExecCredential-bool"}
    assert runs.read_text() == "1", "run again while its token was far from expiring"


async def test_a_plugin_that_fails_at_the_start_says_why(tmp_path: Path) -> None:
    script = tmp_path / "plugin.py"
    script.write_text("import sys\nsys.exit('no cloud in reach')\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(kubeconfig_of(exec_user(script))))
    with pytest.raises(KubeconfigError, match=r"process returned 1\. no cloud in reach"):
        await KubeClient.connect(ClientSettings(str(kubeconfig)))


async def test_what_a_plugin_that_answered_left_running_is_killed(tmp_path: Path) -> None:
    """Run again every minute, a plugin leaving a process behind (a cache refresher, a
    `sleep`) added one a run."""
    script = tmp_path / "plugin.sh"
    script.write_text(
        "#!/bin/sh\n"
        'sleep 600 >/dev/null 2>&1 </dev/null &\necho "$!" > "$1"\n'
        """echo '{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
       "status": {"token": "left", "expirationTimestamp": "2999-01-01T00:00:00Z"}}'\n"""
    )
    script.chmod(0o755)
    pids = tmp_path / "pids"
    user = exec_user(script)
    user["exec"]["command"] = str(script)  # type: ignore[index]
    user["exec"]["args"] = [str(pids)]  # type: ignore[index]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(kubeconfig_of(user)))
    with killed_after(pids):
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))):
            (left,) = pids_in(pids)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while running(left):
                assert loop.time() < deadline, "what the plugin left still runs"
                await asyncio.sleep(0.05)


def common_names() -> tuple[web.Application, list[str]]:
    """An apiserver that lists the name in the client certificate of each request."""
    seen: list[str] = []

    async def get(request: web.Request) -> web.Response:
        assert request.transport is not None
        subject = dict(pair[0] for pair in request.transport.get_extra_info("peercert")["subject"])
        seen.append(subject["commonName"])
        return web.json_response({"metadata": {"name": "a"}})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns/configmaps/a", get)
    return app, seen


@pytest.mark.usefixtures("refreshed_at_each_request")
async def test_a_client_certificate_rewritten_in_place_is_presented_on_new_connections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kubeclient, "OLD_CERTIFICATE_CONNECTIONS_SECONDS", 0.05)
    app, seen = common_names()
    async with serving_over_tls(tmp_path, app, client_certificates=True) as server:
        kubeconfig = server.kubeconfig(tmp_path)
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            await client.get(CONFIGMAPS, "a", "ns")
            assert seen == ["user"]
            # Rotated where the kubeconfig names it, as a kubelet or cert-manager does; the
            # connection the first request left in the pool is not used any more.
            first_pool = client.api.rest_client.pool_manager
            rotated = pki.issue(server.ca, tmp_path / "next", "user-rotated", client=True)
            # The certificate written, its key not yet: the old pair is kept whole (loaded
            # into the context in use, the new certificate went with no key, and new
            # connections presented none).
            (tmp_path / "user.crt").write_bytes(rotated.cert_path.read_bytes())
            await client.get(CONFIGMAPS, "a", "ns")
            await asyncio.sleep(0.1)  # the read beside it
            # At once, so that all but one make a connection of their own.
            await asyncio.gather(*(client.get(CONFIGMAPS, "a", "ns") for _ in range(4)))
            assert seen[-4:] == ["user"] * 4
            (tmp_path / "user.key").write_bytes(rotated.key_path.read_bytes())
            await tokens_until(client, seen, "user-rotated")
            for _ in range(3):
                await client.get(CONFIGMAPS, "a", "ns")
            assert seen[-4:] == ["user-rotated"] * 4
            await asyncio.sleep(0.3)
            assert first_pool.closed, "its connections were made with the old certificate"
