"""Slow readers, full queues and huge prompts: bounded memory, honest Retry-After, a live loop."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from reliability_fixtures import api_client, assert_pool_empty, make_engine, wait_idle

from daemon.engine.async_engine import AsyncEngine
from daemon.openai.options import APIOptions
from daemon.openai.overload import CapacityEstimate
from scheduling import SamplingParams


async def test_a_stream_nobody_reads_is_ended_at_the_pending_limit(tiny):
    engine = AsyncEngine(make_engine(tiny), overlap=False)
    engine.max_pending_deltas = 8
    try:
        stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        await wait_idle(engine)  # the consumer never reads; the engine must not wait on it
        assert stream.queue.qsize() <= 9
        deltas = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
        assert deltas[-1].finish_reason == "abort" and "did not read" in deltas[-1].stop_reason
        assert sum(len(d.new_token_ids) for d in deltas) <= 8
    finally:
        await engine.stop()
    assert_pool_empty(engine)


async def test_a_stalled_stream_times_out_and_frees_its_blocks(tiny, monkeypatch):
    original = web.StreamResponse.write
    writes = {"n": 0}

    async def write(self, data):
        writes["n"] += 1
        if writes["n"] > 2:
            await asyncio.sleep(3600)  # the client's window is full: the write never ends
        return await original(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    options = APIOptions(stream_timeout=0.3)
    async with api_client(tiny, options=options) as (client, api):
        body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        start = time.monotonic()
        r = await client.post("/v1/completions", json=body)
        await r.read()
        assert time.monotonic() - start < 30
        await wait_idle(api.engine)
        # Ended early: the request never ran to its 200 tokens.
        assert api.metrics.generation_tokens._value.get() < 200


def test_retry_after_follows_the_completion_rate():
    now = [0.0]
    est = CapacityEstimate(clock=lambda: now[0])
    assert est.retry_after(5) == 1  # no history: 1 s
    for _ in range(11):
        now[0] += 0.5  # 2 requests per second
        est.finished()
    assert est.retry_after(10) == 5
    assert est.retry_after(10_000) == 60  # capped


async def test_full_queue_answers_429_with_an_integer_retry_after(tiny):
    async with api_client(tiny, max_num_seqs=1, max_waiting=1) as (client, _):
        for _ in range(3):  # some history for the rate
            await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        # Long enough that the first two are still queued when the third arrives.
        long = {"prompt": "Hi", "max_tokens": 250, "ignore_eos": True}
        first = asyncio.create_task(client.post("/v1/completions", json=long))
        await asyncio.sleep(0.2)
        second = asyncio.create_task(client.post("/v1/completions", json=long))
        await asyncio.sleep(0.2)
        r = await client.post("/v1/completions", json=long)
        assert r.status == 429, await r.text()
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        assert (await r.json())["error"]["type"] == "rate_limit_exceeded"
        for task in (first, second):
            assert (await task).status == 200


async def test_a_huge_prompt_does_not_freeze_the_loop(tiny):
    """Tokenizing ~0.4 MB takes about a second; /health answers meanwhile (threaded)."""
    async with api_client(tiny) as (client, _):
        big = {"prompt": "lorem ipsum dolor sit amet " * 16_000, "max_tokens": 1}
        task = asyncio.create_task(client.post("/v1/completions", json=big))
        answered = 0
        while not task.done():
            r = await client.get("/health")
            assert r.status == 200
            answered += 1
            await asyncio.sleep(0.01)
        r = task.result()
        assert r.status == 400 and "max_model_len" in (await r.json())["error"]["message"]
        assert answered >= 5, answered
