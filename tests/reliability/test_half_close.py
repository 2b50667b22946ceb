"""A client's EOF (issue 25 item 11): a half-closed streaming client gets its whole stream,
a streaming client that really closed is noticed within two writes, and a non-streamed
generation ends at EOF (the one case that cannot be told apart). On uvloop, as `headrace
serve` runs, through the same connection class."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator

import orjson
import uvloop
from aiohttp import web
from reliability_fixtures import assert_pool_empty, make_engine, wait_idle

from daemon.engine.async_engine import AsyncEngine
from daemon.openai.api import APIServer
from daemon.openai.metrics import Metrics
from daemon.service.http_protocol import GuardedAppRunner

MAX_TOKENS = 200


@contextlib.asynccontextmanager
async def served(tiny) -> AsyncIterator[tuple[int, AsyncEngine]]:
    engine = AsyncEngine(make_engine(tiny), overlap=False)
    runner = GuardedAppRunner(
        APIServer(engine, "tiny", Metrics()).app(), 0, handler_cancellation=True, access_log=None
    )
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1], engine
    finally:
        await wait_idle(engine)
        await runner.cleanup()
        await engine.stop()
        assert_pool_empty(engine)


def completion(stream: bool, max_tokens: int = MAX_TOKENS) -> bytes:
    payload = orjson.dumps(
        {"prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    )
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )


async def half_closed(port: int, raw: bytes) -> bytes:
    """Send `raw`, shutdown(SHUT_WR), read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    writer.write_eof()
    try:
        return await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()


def finishes(caplog) -> list[tuple[int, str]]:
    """(output tokens, finish reason) of each request the API logged."""
    lines = [r.getMessage() for r in caplog.records if r.name == "headrace.api"]
    found = (re.search(r"output=(\d+) .*finish=(\w+)", line) for line in lines)
    return [(int(m[1]), m[2]) for m in found if m]


def test_half_closed_streaming_client_gets_the_whole_stream(tiny, caplog):
    caplog.set_level(logging.INFO, "headrace.api")

    async def main() -> bytes:
        async with served(tiny) as (port, _):
            return await half_closed(port, completion(stream=True, max_tokens=12))

    data = uvloop.run(main())
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert data.rsplit(b"data: ", 1)[1].startswith(b"[DONE]\n\n"), data[-300:]
    assert finishes(caplog) == [(12, "length")]


def test_streaming_client_that_closed_is_aborted_within_two_writes(tiny, caplog):
    caplog.set_level(logging.INFO, "headrace.api")

    async def main() -> None:
        async with served(tiny) as (port, engine):
            # Send and close at once: an empty receive buffer, so the kernel sends a FIN,
            # exactly as a half-close would; the first write after it draws an RST.
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(completion(stream=True))
            sock.close()
            for _ in range(3000):
                if finishes(caplog):
                    break
                await asyncio.sleep(0.01)
            await wait_idle(engine)
            assert_pool_empty(engine)

    uvloop.run(main())
    [(output, reason)] = finishes(caplog)
    # Headers, then at most two chunks: the write after the RST fails.
    assert reason == "abort" and output <= 2, (output, reason)


def test_non_streamed_generation_ends_at_eof(tiny, caplog):
    caplog.set_level(logging.INFO, "headrace.api")

    async def main() -> bytes:
        async with served(tiny) as (port, engine):
            data = await half_closed(port, completion(stream=False))
            await wait_idle(engine)
            assert_pool_empty(engine)
            return data

    assert uvloop.run(main()) == b""  # closed without an answer
    [(output, reason)] = finishes(caplog)
    assert reason == "abort" and output < MAX_TOKENS


def test_quick_answers_reach_a_half_closed_client(tiny):
    async def main() -> bytes:
        async with served(tiny) as (port, _):
            return await half_closed(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")

    data = uvloop.run(main())
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b'{"status":"ok"}'), data
