"""An apiserver that says to come back later (429, or a 5xx with Retry-After to a read)
is asked again after the wait it names, as client-go's REST client does; any other
refusal, or one without the header, is the caller's at once."""

from pathlib import Path

import pytest
from aiohttp import web

from kubekit.client import RETRIES_WHEN_TOLD, ApiError, ClientSettings, KubeClient, Resource
from tests.unit.tlsserver import serving_over_tls

CONFIGMAPS = Resource("", "v1", "configmaps")


def refusing(refusals: list[tuple[int, dict[str, str]]]) -> tuple[web.Application, list[str]]:
    """An apiserver answering its creates with ``refusals`` in turn, then creating; the
    bodies it was sent are listed."""
    bodies: list[str] = []

    async def create(request: web.Request) -> web.Response:
        bodies.append(await request.text())
        if len(bodies) <= len(refusals):
            status, headers = refusals[len(bodies) - 1]
            return web.json_response(
                {"kind": "Status", "code": status, "reason": "TooManyRequests"},
                status=status,
                headers=headers,
            )
        if request.method == "GET":
            return web.json_response({"metadata": {"name": "a"}})
        return web.json_response(await request.json(), status=201)

    app = web.Application()
    app.router.add_post("/api/v1/namespaces/ns/configmaps", create)
    app.router.add_get("/api/v1/namespaces/ns/configmaps/a", create)
    return app, bodies


async def create_through(
    tmp_path: Path, refusals: list[tuple[int, dict[str, str]]], method: str = "POST"
) -> tuple[dict[str, object] | ApiError, list[str]]:
    app, bodies = refusing(refusals)
    async with serving_over_tls(tmp_path, app) as server:
        settings = ClientSettings(str(server.kubeconfig(tmp_path)))
        async with await KubeClient.connect(settings) as client:
            try:
                if method == "GET":
                    answer = await client.get(CONFIGMAPS, "a", "ns")
                else:
                    answer = await client.create(CONFIGMAPS, {"metadata": {"name": "a"}}, "ns")
            except ApiError as error:
                return error, bodies
    return answer, bodies


@pytest.mark.parametrize(
    ("method", "status"), [("POST", 429), ("GET", 429), ("GET", 503), ("GET", 504)]
)
async def test_told_to_come_back_the_client_sends_the_request_again(
    tmp_path: Path, method: str, status: int
) -> None:
    answer, bodies = await create_through(tmp_path, [(status, {"Retry-After": "0"})] * 2, method)
    assert answer == {"metadata": {"name": "a"}}
    assert len(bodies) == 3
    if method == "POST":
        assert bodies == ['{"metadata":{"name":"a"}}'] * 3


async def test_a_write_answered_with_a_server_error_is_not_sent_again(tmp_path: Path) -> None:
    """A 500 with Retry-After to a create may follow its storing (etcd slow to confirm):
    sent again, a create with generateName would make two objects."""
    answer, bodies = await create_through(tmp_path, [(500, {"Retry-After": "0"})])
    assert isinstance(answer, ApiError) and answer.status == 500
    assert len(bodies) == 1


@pytest.mark.parametrize(
    "refusal",
    [(429, {}), (500, {}), (409, {"Retry-After": "0"}), (403, {"Retry-After": "0"})],
    ids=["429 without Retry-After", "500 without", "409", "403"],
)
async def test_other_refusals_are_the_callers_at_once(
    tmp_path: Path, refusal: tuple[int, dict[str, str]]
) -> None:
    answer, bodies = await create_through(tmp_path, [refusal])
    assert isinstance(answer, ApiError) and answer.status == refusal[0]
    assert len(bodies) == 1


async def test_a_server_that_keeps_saying_later_is_asked_ten_more_times(tmp_path: Path) -> None:
    answer, bodies = await create_through(tmp_path, [(429, {"Retry-After": "0"})] * 20)
    assert isinstance(answer, ApiError) and answer.status == 429
    assert len(bodies) == 1 + RETRIES_WHEN_TOLD == 11


async def test_a_timeout_bounds_the_call_with_its_retries(tmp_path: Path) -> None:
    """A Lease renewal said to wait 10 s at most took 11 x (10 s + the wait) under an
    apiserver shedding load: no retry starts whose wait would end past the timeout."""
    app, bodies = refusing([(429, {"Retry-After": "1"})] * 20)
    async with serving_over_tls(tmp_path, app) as server:
        settings = ClientSettings(str(server.kubeconfig(tmp_path)))
        async with await KubeClient.connect(settings) as client:
            with pytest.raises(ApiError) as refused:
                await client.create(CONFIGMAPS, {"metadata": {"name": "a"}}, "ns", timeout=2.5)
    assert refused.value.status == 429
    assert len(bodies) == 3, "sent at 0, 1 and 2 s; a fourth would start at 3 s"


async def test_an_answer_that_is_not_json_is_a_bad_gateway_not_a_crash(tmp_path: Path) -> None:
    """A proxy in front of the apiserver answering 200 with its own HTML page: every
    caller retries an API error, and the virtual node's Lease loop had died on the
    decoding error instead."""

    async def maintenance(request: web.Request) -> web.Response:
        return web.Response(text="<html>down for maintenance</html>", content_type="text/html")

    app = web.Application()
    app.router.add_get("/version", maintenance)
    async with serving_over_tls(tmp_path, app) as server:
        settings = ClientSettings(str(server.kubeconfig(tmp_path)))
        async with await KubeClient.connect(settings) as client:
            with pytest.raises(ApiError) as refused:
                await client.request("GET", "/version")
    assert refused.value.status == 502
    assert "not JSON" in refused.value.message and "maintenance" in refused.value.message
