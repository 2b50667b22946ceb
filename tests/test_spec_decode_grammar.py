"""Speculative decoding with structured output: drafts are checked against the grammar.

Runs on the tiny random Llama with SmolLM2's real tokenizer (tests/conftest.py `tiny`), so
xgrammar sees a real vocabulary. Each draft position gets its own bitmask row (the matcher
advanced through the drafts before it, then rolled back), and the matcher advances only
with the accepted tokens: greedy outputs must equal a run without speculation, also when a
small pool forces preemption and recompute.
"""

from __future__ import annotations

import re

from model_fixtures import engine_for

from daemon.engine.loaded_model import LoadedModel
from grammars import GrammarSpec
from scheduling import SamplingParams

PATTERN = "[a-z ]{1,48}\\."
CHOICES = ["the quick brown fox jumps", "the lazy dog sleeps", "a cat"]
GREEDY = SamplingParams(max_tokens=40, temperature=0)


def prompts(loaded: LoadedModel) -> list[list[int]]:
    tok = loaded.tokenizer
    text = "the quick brown fox jumps over the lazy dog and the quick brown fox jumps again "
    dog = "the lazy dog sleeps " * 4
    return [tok.encode(t) for t in (text * 3, dog, text, dog + text, text * 2)]


def grammars() -> list[GrammarSpec | None]:
    regex = GrammarSpec("regex", PATTERN)
    return [regex, GrammarSpec.choice(CHOICES), None, regex, None]


def run(loaded: LoadedModel, speculate: bool, **cfg: object) -> tuple[list[list[int]], object]:
    cfg.setdefault("kv_cache_memory", 4 << 20)
    if speculate:
        cfg.update(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
        cfg.update(speculative_adaptive=False)
    engine = engine_for(loaded, dtype="float32", quantization="none", **cfg)
    out = engine.generate(prompts(loaded), GREEDY, grammars())
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [c.token_ids for c in out], engine


def test_constrained_greedy_with_speculation_equals_without(tiny):
    want, _ = run(tiny, speculate=False)
    got, engine = run(tiny, speculate=True)
    assert got == want
    assert engine.scheduler.spec_stats.num_verified > 0
    text = tiny.tokenizer.decode(got[0], skip_special_tokens=True)
    assert re.fullmatch(PATTERN, text), text
    assert tiny.tokenizer.decode(got[1], skip_special_tokens=True) in CHOICES


def test_constrained_speculation_across_forced_preemption(tiny):
    cfg = dict(block_size=4, max_num_batched_tokens=24, long_prefill_token_threshold=8)
    per_block = 2 * 4 * tiny.config.kv_size * 4 * tiny.config.num_hidden_layers
    cfg["kv_cache_memory"] = 24 * per_block
    want, _ = run(tiny, speculate=False, **cfg)
    got, engine = run(tiny, speculate=True, **cfg)
    assert got == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.spec_stats.num_verified > 0
