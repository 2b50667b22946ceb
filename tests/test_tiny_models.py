"""Tiny random Llama / Qwen2 / Qwen3 models built here: exact against transformers."""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import engine_for, hf_greedy, make_tiny_hf_model

from daemon.engine.config import EngineConfig
from daemon.engine.loaded_model import LoadedModel
from runner.attention import build_metadata
from scheduling import SamplingParams


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_hf_model(request.param, directory)
    loaded = LoadedModel.load(EngineConfig(model=str(directory), device="cpu", dtype="float32"))
    assert loaded.tokenizer is None  # token ids only
    return request.param, hf, loaded


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def test_config_carries_architecture_specifics(tiny):
    kind, _, loaded = tiny
    cfg = loaded.config
    assert cfg.attention_bias == (kind == "qwen2")
    assert cfg.qk_norm == (kind == "qwen3")
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if kind == "llama" else None)


def test_greedy_matches_transformers_with_chunks_and_preemption(tiny):
    _, hf, loaded = tiny
    ps = prompts(8)
    engine = engine_for(
        loaded,
        block_size=4,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=7,
        kv_cache_memory=28 * 2 * 4 * loaded.config.kv_size * 4 * loaded.config.num_hidden_layers,
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ours = engine.generate(ps, params)
    assert engine.scheduler.num_preemptions > 0  # the 28-block pool forced recompute
    for p, c in zip(ps, ours):
        assert c.token_ids == hf_greedy(hf, p, 12)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_integrity()


def test_mixed_batch_logits_match_transformers(tiny):
    _, hf, loaded = tiny
    model, cfg = loaded.model, loaded.config
    a, b, c = prompts(3, seed=1)
    a = a + [5] * max(0, 12 - len(a))
    bs = 4
    caches = [torch.zeros(2, 64, bs, cfg.num_key_value_heads, cfg.head_dim) for _ in model.layers]
    tables = [list(range(0, 16)), list(range(16, 32)), list(range(32, 48))]
    # Step 1: all of a but its last token.
    meta = build_metadata([0], [len(a) - 1], tables[:1], bs, torch.device("cpu"))
    with torch.inference_mode():
        model(torch.tensor(a[:-1]), torch.arange(len(a) - 1), caches, meta)
        # Step 2, mixed: a's last token (decode) + b's first chunk + all of c.
        chunk = min(len(b), 6)
        ids = [a[-1], *b[:chunk], *c]
        pos = [len(a) - 1, *range(chunk), *range(len(c))]
        meta = build_metadata(
            [len(a) - 1, 0, 0], [1, chunk, len(c)], tables, bs, torch.device("cpu")
        )
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), caches, meta))
        ref = [
            hf(torch.tensor([a])).logits[0, -1:],
            hf(torch.tensor([b[:chunk]])).logits[0],
            hf(torch.tensor([c])).logits[0],
        ]
    diff = (logits - torch.cat(ref)).abs().max().item()
    assert diff < 1e-3, diff


def test_bfloat16_path_runs_close_to_float32(tmp_path):
    # The CUDA default dtype, exercised on CPU: same code path, bf16 weights and KV cache.
    make_tiny_hf_model("llama", tmp_path)
    outs = {}
    for dtype in ("float32", "bfloat16"):
        loaded = LoadedModel.load(EngineConfig(model=str(tmp_path), device="cpu", dtype=dtype))
        engine = engine_for(loaded, block_size=4, dtype=dtype)
        assert engine.runner.kv_caches[0].dtype == getattr(torch, dtype)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outs[dtype] = [c.token_ids for c in engine.generate(prompts(4, seed=3), params)]
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    first_tokens = [(a[0], b[0]) for a, b in zip(outs["float32"], outs["bfloat16"])]
    assert sum(a == b for a, b in first_tokens) >= 3  # bf16 rounding may flip a near-tie


def test_fresh_prompts_take_sdpa_is_causal_and_match_the_masked_path():
    from runner.attention import paged_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 6, 2, 16, 4
    kv = torch.randn(2, 40, bs, kv_heads, dim)
    # Three prompts of uneven lengths from position 0, and one decode row beside them.
    done, new = [0, 0, 0, 9], [5, 17, 11, 1]
    tables = [[0, 1], [2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12]]
    meta = build_metadata(done, new, tables, bs, torch.device("cpu"))
    decode, prefill = meta.groups
    assert prefill.fresh and not decode.fresh
    q = torch.randn(sum(new), heads, dim)
    causal = paged_attention(q, kv, meta, dim**-0.5)
    assert not prefill._masks  # the fresh group never built a mask
    prefill.fresh = False  # the general path: explicit additive mask, folded GQA
    masked = paged_attention(q, kv, meta, dim**-0.5)
    torch.testing.assert_close(causal, masked, atol=1e-5, rtol=1e-5)
    # A chunk that continues a cached prefix is not fresh: it keeps the explicit mask.
    later = build_metadata([0, 4], [5, 6], tables[:2], bs, torch.device("cpu"))
    assert not later.groups[0].fresh
