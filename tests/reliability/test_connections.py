"""Slow, idle and too many connections; protocol errors in the JSON shape
with nothing of the request in the log (issue 25 items 4, 9, 11)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import orjson
from aiohttp import web
from reliability_fixtures import make_engine

from daemon.engine.async_engine import AsyncEngine
from daemon.openai.api import APIServer
from daemon.openai.metrics import Metrics
from daemon.openai.options import APIOptions
from daemon.service.http_protocol import GuardedAppRunner

KEEPALIVE_S = 0.5
CAP = 4


@contextlib.asynccontextmanager
async def served(tiny):
    engine = AsyncEngine(make_engine(tiny), overlap=False)
    runner = GuardedAppRunner(
        APIServer(engine, "tiny", Metrics(), APIOptions(body_timeout=KEEPALIVE_S)).app(),
        CAP,
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=KEEPALIVE_S,
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield port
    finally:
        await runner.cleanup()
        await engine.stop()


async def request(port: int, raw: bytes) -> tuple[int, dict, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    data = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, orjson.loads(body) if body.startswith(b"{") else {}, head


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%s\r\n" % (path.encode(), extra)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except TimeoutError:
        return False


async def test_slow_and_idle_connections_are_closed_and_the_cap_answers_503(tiny):
    async with served(tiny) as port:
        # Partial headers, then nothing: closed by the timer (never answered).
        partial = await asyncio.open_connection("127.0.0.1", port)
        partial[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CAP - 1)]
        # Over the cap: a 503 in the JSON shape, the app never reached.
        status, body, _ = await request(port, get("/health"))
        assert status == 503 and body["error"]["type"] == "unavailable", body
        assert await closed_within(partial[0], 10 * KEEPALIVE_S + 5)
        for reader, _ in idle:
            assert await closed_within(reader, 10 * KEEPALIVE_S + 5)
        status, body, _ = await request(port, get("/health"))
        assert status == 200 and body == {"status": "ok"}


async def test_malformed_header_is_json_and_never_logged(tiny, caplog):
    caplog.set_level(logging.DEBUG)
    async with served(tiny) as port:
        status, body, head = await request(
            port, get("/v1/models", b"Authorization: Bearer secret\x00\r\n")
        )
    assert status == 400 and b"application/json" in head
    assert body["error"]["code"] == 400 and "secret" not in body["error"]["message"]
    assert "secret" not in caplog.text


async def test_slow_body_answers_408(tiny):
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
    )
    async with served(tiny) as port:
        status, body, _ = await request(port, raw)
    assert status == 408 and body["error"]["code"] == 408, body
