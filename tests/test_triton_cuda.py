"""CUDA-only: decode graphs and the bf16 engine. Skipped without a GPU (CI has none);
benchmarks/gpu_check.sh runs them on one."""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import engine_for, make_tiny_hf_model

from daemon.engine.config import EngineConfig
from daemon.engine.loaded_model import LoadedModel
from runner.cuda_graphs import batch_ladder
from scheduling import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_batch_ladder_ends_at_max_num_seqs() -> None:
    assert batch_ladder(1) == [1]
    assert batch_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert batch_ladder(32) == [1, 2, 4, 8, 16, 24, 32]


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def loaded_cuda(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_hf_model("llama", directory)
    return LoadedModel.load(EngineConfig(model=str(directory), device="cuda", dtype="float32"))


@needs_cuda
def test_decode_graphs_match_eager(loaded_cuda) -> None:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    cfg = dict(max_num_seqs=12, kv_cache_memory=64 << 20)
    eager = engine_for(loaded_cuda, enforce_eager=True, **cfg)
    assert eager.runner.graphs is None
    expected = [c.token_ids for c in eager.generate(_prompts(9), params)]
    graphed = engine_for(loaded_cuda, **cfg)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.sizes[-1] == 12
    got = [c.token_ids for c in graphed.generate(_prompts(9), params)]
    assert graphed.runner.graphs.num_replays > 0
    assert got == expected


@needs_cuda
def test_bf16_engine_runs_triton_and_frees_blocks(tmp_path) -> None:
    make_tiny_hf_model("qwen3", tmp_path)
    loaded = LoadedModel.load(EngineConfig(model=str(tmp_path), device="cuda"))
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    engine = engine_for(loaded, kv_cache_memory=64 << 20, max_num_seqs=8)
    assert engine.runner.attn_backend.name == "triton"
    assert engine.runner.kv_caches[0].dtype == torch.bfloat16
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = engine.generate(_prompts(5), params)
    assert all(len(c.token_ids) == 8 for c in outs)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@needs_cuda
@pytest.mark.parametrize("overlap", [True, False])
async def test_device_batch_queue_matches_step_loop(loaded_cuda, overlap: bool) -> None:
    """Greedy ids stay on the GPU between steps (PendingOutput); sampled requests mixed in
    take the host sampler. Both give the plain step loop's tokens."""
    import asyncio

    from daemon.engine.async_engine import AsyncEngine
    from runner.device_queue import PendingOutput

    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    prompts = _prompts(6)
    params = [greedy if i % 3 else seeded for i in range(6)]
    reference = engine_for(loaded_cuda, kv_cache_memory=64 << 20)
    reference.runner.device_tokens = None  # every step samples on the host
    expected = []
    for p, sp in zip(prompts, params):
        expected.append(reference.generate([p], sp)[0].token_ids)
    eng = engine_for(loaded_cuda, kv_cache_memory=64 << 20)
    async_engine = AsyncEngine(eng, overlap=overlap)

    async def one(p: list[int], sp: SamplingParams) -> list[int]:
        return [t async for d in async_engine.generate(p, sp) for t in d.new_token_ids]

    got = await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
    await async_engine.stop()
    assert got == expected
    eng.add_request(prompts[0], greedy)
    assert isinstance(eng.launch(eng.scheduler.schedule()), PendingOutput)
