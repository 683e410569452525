import gc
import logging
from pathlib import Path

import pytest

from kubekit.client import ApiError, ClientSettings, KubeClient
from kubekit.component import GC_YOUNG_THRESHOLD, run_component

log = logging.getLogger("test")


async def finishes() -> None:
    return None


async def fails() -> None:
    raise ApiError(503, "the apiserver is restarting", "GET", "/api")


def test_a_component_runs_with_fewer_young_collections_and_says_why_it_failed() -> None:
    before = gc.get_threshold()
    try:
        assert run_component(finishes(), log) == 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
        assert run_component(fails(), log) == 1
    finally:
        gc.set_threshold(*before)


KUBECONFIG_HEAD = (
    "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
    "contexts: [{name: c, context: {cluster: k, user: u}}]\nusers: [{name: u, user: {token: t}}]\n"
)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", "NoneType"),
        (b"[1, 2]", "list indices"),
        (b"clusters: [", "while parsing"),
        (b"\xff\xfe", "can't decode byte 0xff"),
        (b"apiVersion: v1\nkind: Config\n", "Expected key current-context"),
        (
            KUBECONFIG_HEAD.encode()
            + b"clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1', "
            + b"certificate-authority: /nonexistent/ca.crt}}]\n",
            "/nonexistent/ca.crt",
        ),
        (
            KUBECONFIG_HEAD.encode()
            + b"clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1', "
            + b"certificate-authority-data: bm90IGEgY2VydA==}}]\n",
            "no certificate",
        ),
    ],
)
def test_a_component_whose_kubeconfig_cannot_be_used_says_why_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, words: str
) -> None:
    """Not a traceback, nor (for a certificate file missing, an OSError) a connection
    failure tried again for ever."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_bytes(content)

    async def connects() -> None:
        await KubeClient.connect(ClientSettings(str(kubeconfig)))

    with caplog.at_level(logging.ERROR, logger="test"):
        assert run_component(connects(), log) == 1
    [record] = caplog.records
    assert record.getMessage().startswith(f"{kubeconfig}: ")
    assert words in record.getMessage()
    assert record.exc_info is None
