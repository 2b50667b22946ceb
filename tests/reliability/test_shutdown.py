"""SIGTERM always ends: every stream gets an error event and [DONE], the process exits 0.

A real `headrace serve` on the tiny random model with a long context (its 20,000-token
streams are still running when the drain timeout passes), four streams, a non-streamed
request, and a client that sent its request and never reads. Exit must come within
drain-timeout + 5 s, and the watchdog pings must stop once STOPPING=1 is sent.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import orjson
from daemon_fixtures import Daemon
from reliability_fixtures import build_tiny_model_dir

DRAIN_S = 1.0
CONTEXT = 32768
LONG = {"prompt": "Tell a long story.", "max_tokens": 20000, "ignore_eos": True}


async def read_stream(h: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
    events: list[str] = []
    async with h.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        buffer = ""
        async for text in r.aiter_text():
            buffer += text
            *done, buffer = buffer.split("\n\n")
            events += done
            if events:
                started.set()
    return events


def stalled_client(port: int) -> socket.socket:
    """Sends a streamed request and never reads a byte of the answer."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = orjson.dumps({**LONG, "stream": True})
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock


def test_sigterm_ends_every_stream_and_exits_in_time(tmp_path):
    model = build_tiny_model_dir(tmp_path / "model", max_position_embeddings=CONTEXT)
    d = Daemon(
        tmp_path,
        *("--model", str(model), "--max-model-len", str(CONTEXT)),
        *("--drain-timeout", str(DRAIN_S)),
        env={"WATCHDOG_USEC": "400000"},
    )
    stalled = stalled_client(d.port)
    try:

        async def main() -> tuple[list[list[str]], httpx.Response, int, float]:
            async with httpx.AsyncClient(base_url=d.url, timeout=60) as h:
                started = [asyncio.Event() for _ in range(4)]
                streams = [asyncio.create_task(read_stream(h, s)) for s in started]
                plain = asyncio.create_task(h.post("/v1/completions", json=LONG))
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
                t0 = time.monotonic()
                d.proc.send_signal(15)
                code = await asyncio.to_thread(d.proc.wait, DRAIN_S + 30)
                elapsed = time.monotonic() - t0
                results = await asyncio.wait_for(asyncio.gather(*streams), 10)
                return results, await asyncio.wait_for(plain, 10), code, elapsed

        results, plain, code, elapsed = asyncio.run(main())
        log = d.log.read_text()
        assert code == 0, log[-3000:]
        assert elapsed <= DRAIN_S + 5, (elapsed, log[-3000:])
        for events in results:
            assert events[-1] == "data: [DONE]", events[-3:]
            error = orjson.loads(events[-2].removeprefix("data: "))["error"]
            assert error["code"] == 503 and "shutting down" in error["message"], error
        assert plain.status_code == 503, plain.text
        assert plain.json()["error"]["type"] == "unavailable"
        # No watchdog ping once stopping: systemd's stop timeout, not a ping, decides.
        messages = d.notify.messages
        stopping = next(i for i, m in enumerate(messages) if "STOPPING=1" in m.splitlines())
        assert not any("WATCHDOG=1" in m.splitlines() for m in messages[stopping + 1 :])
        assert "stopped" in log
    finally:
        stalled.close()
        d.stop()
