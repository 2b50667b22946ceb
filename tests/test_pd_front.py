"""P/D through HTTP: the front door's one SSE stream equals a colocated instance's."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from reliability_fixtures import assert_pool_empty, build_tiny_model_dir, load_tiny, make_engine

from daemon.engine.async_engine import AsyncEngine
from daemon.engine.loaded_model import LoadedModel
from daemon.openai.api import APIServer
from daemon.openai.metrics import Metrics
from daemon.service.pd_front import PDFrontDoor

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away " * 3
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    return load_tiny(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@contextlib.asynccontextmanager
async def instance(loaded: LoadedModel, **cfg) -> AsyncIterator[tuple[str, AsyncEngine]]:
    engine = AsyncEngine(make_engine(loaded, **cfg), overlap=False)
    server = TestServer(APIServer(engine, "tiny", Metrics()).app())
    await server.start_server()
    try:
        yield str(server.make_url("")), engine
    finally:
        await server.close()
        await engine.stop()
        engine.engine.close()
        assert_pool_empty(engine)


async def stream_text(client: TestClient, body: dict) -> tuple[str, int, list[dict]]:
    resp = await client.post("/v1/completions", json={**body, "stream": True,
                             "stream_options": {"include_usage": True}})  # fmt: skip
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    chunks = []
    for line in (await resp.text()).splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    usage = chunks[-1]["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return text, cached, chunks


async def test_front_door_streams_the_colocated_text_from_the_consumer(loaded, tmp_path):
    async with instance(loaded) as (url, _):
        alone = TestClient(TestServer(PDFrontDoor(url, url).app()))
        await alone.start_server()
        colocated, _, _ = await stream_text(alone, BODY)
        await alone.close()
    kv = str(tmp_path / "kv.sock")
    async with (
        instance(loaded, kv_connector="peer", kv_role="producer", kv_peer=kv) as (p_url, p),
        instance(loaded, kv_connector="peer", kv_role="consumer", kv_peer=kv) as (c_url, c),
    ):
        front = PDFrontDoor(p_url, c_url)
        client = TestClient(TestServer(front.app()))
        await client.start_server()
        text, cached, _ = await stream_text(client, BODY)
        assert text == colocated
        assert cached > 0
        assert c.engine.kv_connector.worker.num_loaded_blocks > 0
        assert p.engine.kv_connector.worker.num_saved_blocks > 0
        assert front.num_prefill_failures == 0
        await client.close()


async def test_dead_producer_still_answers_by_recomputing(loaded, tmp_path):
    kv = str(tmp_path / "gone.sock")
    async with instance(loaded, kv_connector="peer", kv_role="consumer", kv_peer=kv) as (c_url, _):
        front = PDFrontDoor("unix:" + str(tmp_path / "no-producer.sock"), c_url)
        client = TestClient(TestServer(front.app()))
        await client.start_server()
        text, cached, _ = await stream_text(client, BODY)
        assert text and cached == 0
        assert front.num_prefill_failures == 1
        resp = await client.get("/v1/models")
        assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "tiny"
        await client.close()
