"""Adapters through the whole engine: greedy output equals peft's merged model, a batch that
mixes the base and two adapters equals each request alone (chunked prefill, preemption,
speculation), the prefix cache never crosses adapters, bad names and files fail clearly."""

from __future__ import annotations

import random

import pytest
from lora_fixtures import make_peft_adapter
from model_fixtures import engine_for, hf_greedy, make_tiny_hf_model

from daemon.engine.config import EngineConfig
from daemon.engine.loaded_model import LoadedModel
from runner.lora import LoRAError, UnknownAdapterError
from scheduling import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Llama, two peft adapters for it (different ranks and targets) and the three
    transformers oracles: the base and each merged model."""
    d = tmp_path_factory.mktemp("lora-engine")
    hf = make_tiny_hf_model("llama", d / "base")
    one = make_peft_adapter("llama", d / "one", seed=1, r=4)
    two = make_peft_adapter(
        "llama", d / "two", seed=2, r=8, targets=["q_proj", "v_proj", "up_proj"]
    )
    loaded = LoadedModel.load(EngineConfig(model=str(d / "base"), device="cpu", dtype="float32"))
    modules = (f"one={d / 'one'}", f"two={d / 'two'}")
    return d, loaded, modules, {None: hf, "one": one, "two": two}


def _engine(served, **cfg):
    _, loaded, modules, _ = served
    cfg.setdefault("kv_cache_memory", 8 << 20)
    return engine_for(loaded, lora_modules=modules, max_loras=2, max_lora_rank=8, **cfg)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


def test_greedy_through_an_adapter_equals_peft_merged_model(served) -> None:
    oracles = served[3]
    engine = _engine(served)
    prompts = _prompts(2)
    for name in ("one", "two", None):
        (c,) = engine.generate(prompts[:1], GREEDY, loras=[name])
        assert c.token_ids == hf_greedy(oracles[name], prompts[0], 10), name
    assert hf_greedy(oracles["one"], prompts[0], 10) != hf_greedy(oracles[None], prompts[0], 10)
    # On the CPU these steps ran the C++ kernel (tests/test_cpu_ops.py: it builds in CI).
    assert served[1].model.lora_manager.cpu_kernel


@pytest.mark.parametrize(
    "cfg",
    [
        # Prompt chunks of 7 beside decode rows, and a pool small enough to preempt.
        {"block_size": 4, "max_num_batched_tokens": 24, "long_prefill_token_threshold": 7},
        # min 1: a random model seldom repeats a 2-gram, but often a single prompt token.
        {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    ],
)
def test_mixed_batch_equals_each_request_alone(served, cfg) -> None:
    oracles = served[3]
    rng = random.Random(5)
    para = [rng.randrange(3, 320) for _ in range(12)]
    # Repeating prompts give the ngram proposer drafts to verify.
    prompts = [*_prompts(6, seed=3), para * 3, para * 2]
    names = ["one", None, "two", "one", "two", None, "one", "two"]
    if "block_size" in cfg:
        cfg["kv_cache_memory"] = 30 * 2 * 4 * served[1].config.kv_size * 4 * 2
    engine = _engine(served, **cfg)
    together = engine.generate(prompts, GREEDY, loras=names)
    if "block_size" in cfg:
        assert engine.scheduler.num_preemptions > 0  # the small pool forced recompute
    else:
        assert engine.scheduler.spec_stats.num_verified > 0  # drafts were verified
    for p, name, c in zip(prompts, names, together):
        assert c.token_ids == hf_greedy(oracles[name], p, 10), name
    alone = [engine.generate([p], GREEDY, loras=[n])[0].token_ids for p, n in zip(prompts, names)]
    assert alone == [c.token_ids for c in together]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_integrity()


def test_prefix_cache_hits_only_within_an_adapter(served) -> None:
    engine = _engine(served)
    prompt = list(range(40, 80))  # two full blocks of 16
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    assert engine.generate([prompt], params, loras=["one"])[0].cached_tokens == 0
    assert engine.generate([prompt], params, loras=[None])[0].cached_tokens == 0
    assert engine.generate([prompt], params, loras=["two"])[0].cached_tokens == 0
    assert engine.generate([prompt], params, loras=["one"])[0].cached_tokens == 32


def test_more_adapters_than_slots_take_turns(served, tmp_path) -> None:
    d, _, modules, oracles = served
    loaded = LoadedModel.load(EngineConfig(model=str(d / "base"), device="cpu", dtype="float32"))
    engine = engine_for(
        loaded, lora_modules=modules, max_loras=1, max_lora_rank=8, kv_cache_memory=8 << 20
    )
    prompts, names = _prompts(4, seed=9), ["one", "two", "one", "two"]
    out = engine.generate(prompts, GREEDY, loras=names)
    for p, name, c in zip(prompts, names, out):
        assert c.token_ids == hf_greedy(oracles[name], p, 10)


def test_unknown_adapter_is_named(served) -> None:
    engine = _engine(served)
    with pytest.raises(UnknownAdapterError, match="'three' does not exist"):
        engine.add_request([1, 2, 3], GREEDY, lora="three")
    assert not engine.has_unfinished_requests()


def test_bad_adapter_fails_start_up_naming_its_file(served, tmp_path) -> None:
    loaded = served[1]
    make_peft_adapter("llama", tmp_path / "big", seed=4, r=16)
    with pytest.raises(LoRAError, match=r"big: .*rank 16, above --max-lora-rank 8"):
        engine_for(loaded, lora_modules=(f"big={tmp_path / 'big'}",), max_loras=2, max_lora_rank=8)
    with pytest.raises(ValueError, match="'big' is not name=path"):
        engine_for(loaded, lora_modules=("big",), max_loras=2, max_lora_rank=8)
