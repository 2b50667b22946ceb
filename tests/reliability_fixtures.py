"""The API in-process on a tiny random model with the embedded model's real tokenizer.

The model is random (2 layers, width 64) but its vocabulary is SmolLM2's 49152 tokens and
its directory holds SmolLM2's tokenizer and chat template, so every route (text prompts,
chat, logprobs, /tokenize) works as on the real daemon, only much faster.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from model_fixtures import make_tiny_hf_model

from daemon.engine.async_engine import AsyncEngine
from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from daemon.openai.api import APIServer
from daemon.openai.metrics import Metrics
from daemon.openai.options import APIOptions
from runner.heap import resident_bytes
from runner.model_source import resolve_model
from runner.tokenizer import load_tokenizer


def build_tiny_model_dir(directory: Path, **overrides: Any) -> Path:
    """`overrides` replace config fields (max_position_embeddings for long streams)."""
    tokenizer = load_tokenizer(resolve_model(None))
    make_tiny_hf_model(
        "llama-plain",
        directory,
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )
    tokenizer.save_pretrained(directory)
    return directory


def load_tiny(directory: Path) -> LoadedModel:
    return LoadedModel.load(
        EngineConfig(model=str(directory), device="cpu", dtype="float32", quantization="none")
    )


def make_engine(loaded: LoadedModel, **cfg: Any) -> Engine:
    cfg.setdefault("threads", 1)
    cfg.setdefault("block_size", 4)
    cfg.setdefault("max_model_len", 256)
    cfg.setdefault("kv_cache_memory", 4 << 20)
    return Engine(EngineConfig(**cfg), loaded)


@contextlib.asynccontextmanager
async def api_client(
    loaded: LoadedModel, options: APIOptions | None = None, **engine_cfg: Any
) -> AsyncIterator[tuple[TestClient, APIServer]]:
    """An aiohttp test client on a fresh engine; on exit, asserts nothing leaked."""
    engine = AsyncEngine(make_engine(loaded, **engine_cfg), overlap=False)
    api = APIServer(engine, "tiny", Metrics(), options)
    client = TestClient(TestServer(api.app()))
    await client.start_server()
    try:
        yield client, api
    finally:
        await client.close()
        await wait_idle(engine)
        await engine.stop()
    assert_pool_empty(engine)


async def wait_idle(engine: AsyncEngine, timeout: float = 30.0) -> None:
    """Until no request is in flight or in the scheduler (aborts land at the next step)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.engine.has_unfinished_requests() or engine.num_in_flight_requests:
        if loop.time() > deadline:
            raise AssertionError(
                f"stuck: {len(engine.engine.scheduler.requests)} requests in the scheduler, "
                f"{engine.num_in_flight_requests} streams in flight"
            )
        await asyncio.sleep(0.02)


def assert_pool_empty(engine: AsyncEngine) -> None:
    kv = engine.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} leaked"
    assert not engine.engine.scheduler.requests
    assert not engine.engine.outputs


def rss_mb() -> float:
    """Current resident set size in MiB (runner/heap.py reads it; ru_maxrss is only the peak)."""
    return resident_bytes() / (1 << 20)
