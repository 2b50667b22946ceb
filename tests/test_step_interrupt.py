"""Stopping a CPU step between layers and taking it back (runner/step_interrupt.py,
scheduling/step_undo.py): the greedy tokens stay those of an uninterrupted run, no block
leaks, no half-written KV is ever a prefix-cache hit, and an urgent arrival on the live
loop stops the background step in flight."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from model_fixtures import engine_for, make_tiny_hf_model

from conftest import make_request
from daemon.engine.async_engine import AsyncEngine
from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from runner.cpu_ops import load_cpu_ops
from runner.step_interrupt import StepInterrupted
from scheduling import SamplingParams
from scheduling.policies.priority import PriorityPolicy

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Two full blocks of 4 shared by every prompt, then each its own tail.
SHARED = [11, 12, 13, 14, 15, 16, 17, 18]
PROMPTS = [[*SHARED, 40 + i, 50 + i, 60 + i] for i in range(4)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> LoadedModel:
    directory = tmp_path_factory.mktemp("llama")
    make_tiny_hf_model("llama", directory)
    return LoadedModel.load(EngineConfig(model=str(directory), device="cpu", dtype="float32"))


def engine(loaded: LoadedModel, backend: str, **cfg: object) -> Engine:
    cfg.setdefault("max_num_batched_tokens", 16)
    return engine_for(loaded, block_size=4, attention_backend=backend, **cfg)


def run(eng: Engine, prompts: list[list[int]], stop_every: int) -> tuple[list[list[int]], int]:
    """Greedy tokens per prompt; every `stop_every`-th step that can be taken back is
    stopped before it runs and undone first (0: none). Returns (tokens, steps undone)."""
    return drain(eng, [eng.add_request(p, GREEDY) for p in prompts], stop_every)


def drain(eng: Engine, ids: list[str], stop_every: int) -> tuple[list[list[int]], int]:
    """`run` for requests already added."""
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    n = undone = 0
    while eng.has_unfinished_requests():
        so = eng.schedule()
        n += 1
        if stop_every and n % stop_every == 0 and eng.scheduler.can_undo(so):
            eng.arm_interrupt()
            eng.runner.interrupt.request()
            with pytest.raises(StepInterrupted):
                eng.execute(so)
            eng.undo_step(so)
            undone += 1
            continue
        eng.arm_interrupt()
        for delta in eng.process(so, eng.execute(so)):
            out[delta.request_id] += delta.new_token_ids
    eng.release_finished()
    eng.scheduler.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return [out[rid] for rid in ids], undone


BACKENDS = ["torch"] + (["cpu"] if load_cpu_ops() is None else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stop_every", [2, 3])
def test_undone_steps_leave_the_greedy_tokens_unchanged(tiny_llama, backend, stop_every):
    reference, _ = run(engine(tiny_llama, backend), PROMPTS, 0)
    eng = engine(tiny_llama, backend)
    if backend == "cpu":  # decode-only steps go through the fused C++ stack and its `stop`
        assert eng.runner.model.fused_decode is not None
    got, undone = run(eng, PROMPTS, stop_every)
    assert undone >= 3
    assert got == reference
    assert eng.scheduler.num_undone_steps == undone


def test_an_undone_prefill_leaves_no_prefix_cache_hit(tiny_llama):
    """The first prompt's step registers its two full blocks; stopped before any KV is
    written and taken back, a later prompt with the same prefix must not hit them."""
    eng = engine(tiny_llama, "torch")
    first = eng.add_request(PROMPTS[0], GREEDY)
    so = eng.schedule()
    assert so.num_scheduled_tokens == {first: len(PROMPTS[0])}
    assert len(eng.kv.cached_block_hashes()) == 2
    eng.arm_interrupt()
    eng.runner.interrupt.request()
    with pytest.raises(StepInterrupted):
        eng.execute(so)
    eng.undo_step(so)
    assert eng.kv.cached_block_hashes() == set()
    req = eng.scheduler.requests[first]
    assert (req.num_computed_tokens, req.num_output_placeholders) == (0, 0)
    second = eng.add_request(PROMPTS[1], GREEDY)
    assert eng.kv.get_computed_blocks(eng.scheduler.requests[second])[1] == 0
    # Run on: both finish as on an engine that never stopped a step.
    reference, _ = run(engine(tiny_llama, "torch"), PROMPTS[:2], 0)
    assert drain(eng, [first, second], 0)[0] == reference


def test_a_step_whose_admission_hit_its_own_fresh_blocks_is_not_taken_back(tiny_llama):
    eng = engine(tiny_llama, "torch", max_num_batched_tokens=64)
    eng.add_request(PROMPTS[0], GREEDY)
    eng.add_request(PROMPTS[1], GREEDY)  # hits the blocks the first registers this step
    so = eng.schedule()
    assert so.scheduled_new_reqs[1].num_computed_tokens == len(SHARED)
    assert not eng.scheduler.can_undo(so)


def test_an_abort_during_the_stopped_step_uncaches_its_blocks(tiny_llama):
    eng = engine(tiny_llama, "torch")
    rid = eng.add_request(PROMPTS[0], GREEDY)
    so = eng.schedule()
    eng.arm_interrupt()
    eng.runner.interrupt.request()
    with pytest.raises(StepInterrupted):
        eng.execute(so)
    eng.abort([rid])  # the client left while the step ran
    eng.undo_step(so)
    assert eng.kv.cached_block_hashes() == set()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_priority_interrupts_less_urgent_work_where_its_own_class_only_decodes():
    policy = PriorityPolicy()
    urgent, background = make_request(priority=0), make_request(priority=1)
    decoding = make_request(priority=0)
    decoding.append_output_token(5, 0.0)
    assert policy.interrupts(urgent, [background, make_request(priority=2)])
    assert policy.interrupts(urgent, [background, decoding])  # it loses part of a step
    assert not policy.interrupts(urgent, [decoding])  # nothing less urgent to stop
    # A prompt of its own class ranks ahead of it: stopping would only redo its work.
    assert not policy.interrupts(urgent, [background, make_request(priority=0)])
    assert not policy.interrupts(background, [background, urgent])


async def test_an_urgent_arrival_stops_the_background_step_in_flight(tiny_llama):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reference = [c.token_ids for c in engine(tiny_llama, "torch").generate(PROMPTS, params)]
    eng = engine(tiny_llama, "torch", policy="priority", enable_prefix_caching=False)
    entered = threading.Event()
    steps = [0]
    execute = eng.runner.execute

    def counted(so):
        steps[0] += not so.is_empty
        return execute(so)

    def slow_first_step(module, args):
        # Each layer of the first step takes 0.3 s: long enough to arrive in, on any
        # machine; stopped before its second layer, the urgent prompt waits one, not two.
        if steps[0] == 1:
            entered.set()
            time.sleep(0.3)

    eng.runner.execute = counted
    for layer in eng.runner.model.layers:
        layer.register_forward_pre_hook(slow_first_step)
    loop = AsyncEngine(eng, overlap=False)

    async def collect(prompt: list[int], priority: int) -> tuple[list[int], float]:
        tokens, first = [], 0.0
        start = time.monotonic()
        async for delta in loop.generate(prompt, params, priority=priority):
            if not tokens and delta.new_token_ids:
                first = time.monotonic() - start
            tokens += delta.new_token_ids
        return tokens, first

    try:
        background = [asyncio.create_task(collect(p, 1)) for p in PROMPTS[1:]]
        assert await asyncio.to_thread(entered.wait, 10)
        urgent, ttft = await collect(PROMPTS[0], 0)
        got = [urgent] + [t for t, _ in await asyncio.gather(*background)]
        assert loop.stats().interrupted_steps >= 1
        # It waited for the layer it arrived in (<= 0.3 s), not for the second too.
        assert ttft < 0.5
        assert got == reference
        kv = eng.kv
        await asyncio.sleep(0.05)
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        await loop.stop()


@pytest.mark.parametrize("overlap", [False, True])
def test_steps_stop_only_on_the_one_step_at_a_time_loop(tiny_llama, overlap):
    eng = engine(tiny_llama, "torch", policy="priority")
    AsyncEngine(eng, overlap=overlap)
    assert eng.stops_steps is not overlap
    eng.add_request(PROMPTS[1], GREEDY, priority=1)
    so = eng.schedule()
    urgent = eng.add_request(PROMPTS[0], GREEDY, priority=0)
    assert eng.interrupt_for(so, urgent) is not overlap


def test_no_interrupt_where_a_step_cannot_stop(tiny_llama):
    """Speculative decoding (the drafter moves with each step) keeps every step whole."""
    eng = engine(tiny_llama, "torch", speculative_method="ngram", num_speculative_tokens=2)
    assert eng.runner.interrupt is None
    rid = eng.add_request(PROMPTS[0], GREEDY)
    so = eng.schedule()
    assert not eng.interrupt_for(so, rid)
