"""A kubeconfig's token is read again while the client runs, as client-go does: read
once, it expired and every call was refused for good."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from kubekit import client as kubeclient
from kubekit.client import ClientSettings, KubeClient, Resource
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
    # The runs given up end on their own: before the test's loop, which reaps them.
    await asyncio.sleep(1.5)


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
