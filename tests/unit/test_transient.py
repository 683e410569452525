"""One classification of what goes wrong talking to an apiserver, and the loops that must
outlive it doing so."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import aiohttp
import pytest

from kubekit.client import API_ERRORS, LEASES, ApiError, Resource, _retry_after, is_transient
from virtual_node import nodecontroller
from virtual_node.node import NodeIdentity, NodeReport


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionRefusedError("refused"), True),
        (ConnectionResetError("reset"), True),
        (aiohttp.ServerDisconnectedError(), True),
        (aiohttp.ClientPayloadError("cut short"), True),
        (ssl.SSLEOFError("EOF in violation of protocol"), True),
        (TimeoutError(), True),
        (ApiError(429, {"reason": "TooManyRequests"}), True),
        (ApiError(500, {"reason": "InternalError"}), True),
        (ApiError(503, "etcd leader changed"), True),
        (ApiError(410, {"reason": "Expired"}), True),
        (ApiError(400, {"reason": "BadRequest"}), False),
        (ApiError(403, {"reason": "Forbidden"}), False),
        (ApiError(404, {"reason": "NotFound"}), False),
        (ApiError(409, {"reason": "Conflict"}), False),
        (ApiError(422, {"reason": "Invalid"}), False),
        (ValueError("a bug of ours"), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_what_is_worth_trying_again(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient
    assert isinstance(error, API_ERRORS) is (not isinstance(error, ValueError))


def test_retry_after_is_read_in_seconds() -> None:
    assert _retry_after("3") == 3.0
    assert _retry_after("-1") == 0.0
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert _retry_after(None) is None


class Provider:
    def __init__(self) -> None:
        self.changed = asyncio.Event()

    async def ping(self) -> bool:
        return True

    def report(self, reachable: bool) -> NodeReport:
        return NodeReport(ready=reachable, allocatable={"cpu": "8"})


class FlakyUpper:
    """An upper apiserver that hangs up on the first Lease renewal."""

    def __init__(self) -> None:
        self.renewals = 0

    async def patch(self, resource: Resource, name: str, body: Any, *args: Any, **kw: Any) -> Any:
        assert resource == LEASES
        self.renewals += 1
        if self.renewals == 1:
            raise aiohttp.ServerDisconnectedError()
        return {}


async def test_the_node_lease_loop_outlives_a_server_that_hangs_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nodecontroller, "LEASE_INTERVAL_SECONDS", 0.01)
    upper = FlakyUpper()
    controller = nodecontroller.NodeController(
        upper,  # type: ignore[arg-type]
        NodeIdentity("vk-lower-1", "lower-1", "10.1.2.3", 10250),
        Provider(),
    )
    loop = asyncio.create_task(controller._lease_loop())
    try:
        for _ in range(200):
            if upper.renewals >= 3:
                break
            await asyncio.sleep(0.01)
        assert not loop.done(), "the loop ended on a disconnect"
        assert upper.renewals >= 3
    finally:
        loop.cancel()
