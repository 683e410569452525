"""A kubeconfig's token is read again while the client runs, as client-go does: read
once, it expired and every call was refused for good."""

from __future__ import annotations

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


@pytest.mark.usefixtures("refreshed_at_each_request")
async def test_an_exec_plugin_s_expired_token_is_fetched_again(tmp_path: Path) -> None:
    script = tmp_path / "plugin.py"
    script.write_text(PLUGIN)
    runs = tmp_path / "runs"
    app, seen = recording()
    async with serving_over_tls(tmp_path, app) as server:
        exec_user = {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": sys.executable,
                "args": [str(script), str(runs)],
                "interactiveMode": "Never",
            }
        }
        kubeconfig = with_user(server.kubeconfig(tmp_path), exec_user)
        async with await KubeClient.connect(ClientSettings(str(kubeconfig))) as client:
            for _ in range(2):
                await client.get(CONFIGMAPS, "a", "ns")
    assert seen == ["Bearer token-2", "Bearer token-3"]


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
            await client.get(CONFIGMAPS, "a", "ns")
            token.unlink()
            await client.get(CONFIGMAPS, "a", "ns")
    assert seen == ["Bearer first", "Bearer rotated", "Bearer rotated"]
