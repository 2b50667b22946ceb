"""AsyncEngine: the batch-queue loop gives the same greedy tokens as the plain step loop."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest
import torch
from model_fixtures import engine_for, make_tiny_hf_model

from daemon.engine.async_engine import AsyncEngine
from daemon.engine.client import EngineDeadError
from daemon.engine.config import EngineConfig
from daemon.engine.loaded_model import LoadedModel
from runner.model_runner import kv_bytes_per_block
from scheduling import SamplingParams


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_hf_model("llama", directory)
    return LoadedModel.load(EngineConfig(model=str(directory), device="cpu", dtype="float32"))


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    out: list[int] = []
    async for delta in engine.generate(prompt, params):
        out += delta.new_token_ids
    return out


@pytest.mark.parametrize("overlap", [True, False])
async def test_overlap_on_and_off_match_the_step_loop(tiny_llama, overlap):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ps = prompts(8)
    reference = [c.token_ids for c in engine_for(tiny_llama, block_size=4).generate(ps, params)]
    engine = AsyncEngine(
        engine_for(
            tiny_llama,
            block_size=4,
            max_num_batched_tokens=16,
            kv_cache_memory=24 * kv_bytes_per_block(tiny_llama.config, 4, torch.float32),
        ),
        overlap=overlap,
    )
    try:
        got = await asyncio.gather(*(collect(engine, p, params) for p in ps))
        assert got == reference
        assert engine.engine.scheduler.num_preemptions > 0  # small pool: recompute happened too
        kv = engine.engine.kv
        assert kv.num_free_blocks == kv.num_blocks
        # Once idle, the loop tells the runner to drop the last finished requests' state.
        for _ in range(200):
            if not engine.engine.runner.requests:
                break
            await asyncio.sleep(0.01)
        assert not engine.engine.runner.requests
    finally:
        await engine.stop()


async def test_leaving_the_stream_aborts_and_frees_blocks(tiny_llama):
    engine = AsyncEngine(engine_for(tiny_llama, block_size=4))
    try:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        stream = engine.generate(prompts(1)[0], params)
        async for _ in stream:
            break
        await stream.aclose()
        other = await collect(engine, prompts(2)[1], SamplingParams(max_tokens=3, temperature=0))
        assert len(other) <= 3
        kv = engine.engine.kv
        assert not engine.engine.scheduler.has_unfinished_requests()
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        await engine.stop()


async def test_bad_request_raises_before_streaming_and_loop_survives(tiny_llama):
    engine = AsyncEngine(engine_for(tiny_llama, max_model_len=64))
    try:
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate([5] * 100, SamplingParams()):
                pass
        with pytest.raises(ValueError, match="token ids"):
            async for _ in engine.generate([10**6], SamplingParams()):
                pass
        ok = await collect(engine, [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(ok) == 2
    finally:
        await engine.stop()


async def test_loop_pings_while_idle_and_stops_while_a_step_hangs(tiny_llama):
    engine = AsyncEngine(engine_for(tiny_llama))
    pings: list[float] = []
    engine.on_iteration = lambda: pings.append(time.monotonic())
    engine.idle_timeout = 0.02
    real_execute = engine.engine.execute

    def hanging_execute(so):
        if not so.is_empty:
            time.sleep(0.6)  # a forward pass that hangs (here: only for a while)
        return real_execute(so)

    engine.engine.execute = hanging_execute
    try:
        engine.start()
        await asyncio.sleep(0.2)
        assert len(pings) >= 5  # idle, yet the watchdog hook keeps being called
        await collect(engine, [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert max(gaps) >= 0.5  # no ping while the step hung: systemd would notice
    finally:
        await engine.stop()


async def test_a_failing_step_ends_its_requests_and_the_loop_goes_on(tiny_llama):
    engine = AsyncEngine(engine_for(tiny_llama))
    real_execute = engine.engine.execute
    calls = {"n": 0}

    def flaky_execute(so):
        if not so.is_empty:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("simulated kernel failure")
        return real_execute(so)

    engine.engine.execute = flaky_execute
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        deltas = [d async for d in engine.generate([5, 6, 7], params)]
        assert deltas[-1].finish_reason == "error"
        assert "simulated kernel failure" in str(deltas[-1].stop_reason)
        assert len(await collect(engine, [5, 6, 7], params)) == 3
        kv = engine.engine.kv
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        await engine.stop()


async def test_a_dying_loop_ends_every_stream_and_refuses_new_requests(tiny_llama):
    # A bug outside a step (here: the scheduler raising) used to kill the loop task
    # silently: every stream, the warm-up's included, waited forever.
    engine = AsyncEngine(engine_for(tiny_llama))
    told: list[str] = []
    engine.on_failure = told.append
    real_schedule = engine.engine.schedule
    calls = {"n": 0}

    def broken_schedule():
        calls["n"] += 1
        if calls["n"] == 3:
            raise NameError("simulated scheduler bug")
        return real_schedule()

    engine.engine.schedule = broken_schedule
    try:
        params = SamplingParams(max_tokens=50, ignore_eos=True)

        async def drain(prompt: list[int]) -> list:
            return [d async for d in engine.generate(prompt, params)]

        ends = await asyncio.wait_for(asyncio.gather(*map(drain, prompts(3))), timeout=30)
        for deltas in ends:
            assert deltas[-1].finish_reason == "error"
            assert "simulated scheduler bug" in str(deltas[-1].stop_reason)
        assert len(told) == 1 and "NameError" in told[0]
        assert engine.stats().failure == told[0]
        with pytest.raises(EngineDeadError, match="simulated scheduler bug"):
            engine.add_request([5, 6, 7], params)
    finally:
        await engine.stop()


def test_the_slo_policy_learns_step_costs_from_the_real_engine(tiny_llama):
    engine = engine_for(tiny_llama, policy="slo")
    policy = engine.scheduler.policy
    before = policy.cost.model.base_s
    engine.generate(prompts(6), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert policy.cost.num_observations >= 6
    assert policy.cost.model.base_s != before  # fitted to this machine, not the prior


def test_idle_check_reports_a_leaked_block(tiny_llama, caplog):
    engine = engine_for(tiny_llama, block_size=4)
    engine.generate(prompts(2), SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.check_idle()
    engine.kv.pool.get_new_blocks(1)  # a block nobody will ever give back
    assert not engine.check_idle()
    assert "KV cache check failed while idle" in caplog.text
