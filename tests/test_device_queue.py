"""The device-side batch queue's bookkeeping (runner/device_queue.py), run on CPU tensors.

On CUDA greedy ids stay on the GPU and the next step's placeholder rows are filled there;
the same code runs here with CPU tensors, so the placeholder fills, the late settling of
the runner's token lists and the forgetting of preempted requests are all checked in CI.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from model_fixtures import engine_for, make_tiny_hf_model

from daemon.engine.async_engine import AsyncEngine
from daemon.engine.config import EngineConfig
from daemon.engine.loaded_model import LoadedModel
from runner.device_queue import DeviceTokens, PendingOutput, plain_greedy
from runner.model_runner import kv_bytes_per_block
from scheduling import SamplingParams


class CountingTokens(DeviceTokens):
    def __init__(self) -> None:
        super().__init__()
        self.num_steps = 0

    def record(self, *args, **kwargs) -> PendingOutput:
        self.num_steps += 1
        return super().record(*args, **kwargs)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_hf_model("llama", directory)
    return LoadedModel.load(
        EngineConfig(model=str(directory), device="cpu", dtype="float32", quantization="none")
    )


def test_only_plain_greedy_stays_on_the_device() -> None:
    assert plain_greedy(SamplingParams(temperature=0))
    assert not plain_greedy(SamplingParams(temperature=0.5))
    assert not plain_greedy(SamplingParams(temperature=0, logprobs=2))
    assert not plain_greedy(SamplingParams(temperature=0, repetition_penalty=1.2))
    assert not plain_greedy(SamplingParams(temperature=0, min_tokens=3))


@pytest.mark.parametrize("overlap", [True, False])
async def test_device_ids_give_the_step_loop_tokens(tiny_llama, overlap: bool) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randrange(2, 30))] for _ in range(8)]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True)
    params = [seeded if i == 5 else greedy for i in range(8)]
    cfg = dict(
        block_size=4,
        max_num_batched_tokens=16,
        kv_cache_memory=24 * kv_bytes_per_block(tiny_llama.config, 4, torch.float32),
    )
    reference = engine_for(tiny_llama, **cfg)
    expected = [c.token_ids for c in reference.generate(prompts[:5], greedy)]
    expected += [reference.generate([prompts[5]], seeded)[0].token_ids]
    expected += [c.token_ids for c in reference.generate(prompts[6:], greedy)]

    engine = engine_for(tiny_llama, **cfg)
    engine.runner.device_tokens = tokens = CountingTokens()
    async_engine = AsyncEngine(engine, overlap=overlap)

    async def one(p: list[int], sp: SamplingParams) -> list[int]:
        return [t async for d in async_engine.generate(p, sp) for t in d.new_token_ids]

    try:
        got = await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
    finally:
        await async_engine.stop()
    assert got == expected
    assert tokens.num_steps > 0  # greedy-only steps left their ids "on the device"
    assert engine.scheduler.num_preemptions > 0  # preempted requests' ids were forgotten
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
