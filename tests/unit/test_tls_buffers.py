"""Smaller TLS read buffers: connections opened afterwards use them, bodies much larger
than one buffer still cross intact both ways, and a stream's connection gets the large
buffer back."""

import asyncio.sslproto
import os
import ssl
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kubekit.client import (
    STREAM_TLS_READ_BUFFER_BYTES,
    TLS_READ_BUFFER_BYTES,
    _read_in_bulk,
    shrink_tls_read_buffers,
)
from tests.unit.tlsserver import serving_over_tls


async def test_large_bodies_cross_a_tls_connection_with_small_read_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Restored after the test: the setting is process-wide.
    monkeypatch.setattr(asyncio.sslproto.SSLProtocol, "max_size", 256 * 1024)
    shrink_tls_read_buffers()

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=(await request.read())[::-1])

    app = web.Application(client_max_size=8 * 2**20)
    app.router.add_post("/", echo)
    body = os.urandom(3 * 2**20 + 17)
    async with serving_over_tls(tmp_path, app) as server:
        client_context = ssl.create_default_context(cafile=server.ca.cert_path)
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{server.url}/", data=body, ssl=client_context) as response,
        ):
            transport = response.connection.transport  # type: ignore[union-attr]
            buffer = transport._ssl_protocol._ssl_buffer  # type: ignore[union-attr]
            assert len(buffer) == TLS_READ_BUFFER_BYTES
            assert response.status == 200
            # A stream's connection reads in bulk again, from its next read on.
            _read_in_bulk(transport)
            assert await response.read() == body[::-1]
            assert len(transport._ssl_protocol._ssl_buffer) == STREAM_TLS_READ_BUFFER_BYTES  # type: ignore[union-attr]
