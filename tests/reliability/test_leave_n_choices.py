"""Clients that leave an n > 1 stream after a few chunks (issue 25 item 11): the choices'
pumps end with it (no "Task was destroyed but it is pending"), nothing leaks. On uvloop,
as `headrace serve` runs."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest
import uvloop
from reliability_fixtures import api_client, wait_idle


@pytest.mark.parametrize("n,chunks", [(2, 1), (2, 3), (3, 2)])
def test_leaving_an_n_choice_stream_leaves_no_pending_task(tiny, caplog, n, chunks):
    caplog.set_level(logging.ERROR, "asyncio")
    body = {"prompt": "Hi", "max_tokens": 200, "n": n, "stream": True, "ignore_eos": True}

    async def main() -> int:
        async with api_client(tiny) as (client, api):
            for _ in range(4):
                async with client.post("/v1/completions", json=body) as r:
                    assert r.status == 200
                    seen = 0
                    async for line in r.content:
                        seen += line.startswith(b"data: {")
                        if seen >= chunks:
                            break
                    r.close()  # leave: the connection closes mid-stream
            await wait_idle(api.engine)
            gc.collect()  # what only the cycle collector frees goes now, loop still running
            await asyncio.sleep(0.05)
            return api.metrics.finished.labels("abort")._value.get()

    aborted = uvloop.run(main())
    gc.collect()
    destroyed = [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]
    assert not destroyed, destroyed[0].getMessage()
    assert aborted == 4 * n
