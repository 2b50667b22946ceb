"""The embedded SmolLM2 end to end with int8 and bf16 linears, against its own fp32 path.

Floors (measured on 55 chat prompts by benchmarks/quality_int8.py; see README): greedy
decoding of a small model flips at near-ties, so these check agreement at the start of each
answer and the closeness of the next-token distribution, not whole answers.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from model_fixtures import engine_for

from daemon.engine.loaded_model import LoadedModel
from runner.layers.linear import Linear, pack_linears
from runner.layers.weight_formats import onednn_bf16_available
from runner.platform import select_platform
from scheduling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "How do I reverse a list in Python?",
    "Name five animals that live in the Arctic.",
    "What is the boiling point of water at sea level?",
]


@pytest.fixture(scope="module")
def fp32_greedy(smollm) -> list[list[int]]:
    return greedy(smollm)


def variant(base: LoadedModel, fmt: str) -> LoadedModel:
    """A copy of the fp32 model converted the way the platform would (no second load)."""
    model = copy.deepcopy(base.model)
    if fmt == "int8":
        platform = select_platform(torch.device("cpu"), "auto", "int8")
        platform.prepare(model)
        return dataclasses.replace(base, model=model, platform=platform)
    model.to(torch.bfloat16)
    pack_linears(model, fmt)
    return dataclasses.replace(base, model=model, dtype=torch.bfloat16, platform=None)


def chats(loaded: LoadedModel) -> list[str]:
    return [
        loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]


def greedy(loaded: LoadedModel, n: int = 12) -> list[list[int]]:
    engine = engine_for(loaded, dtype=str(loaded.dtype).removeprefix("torch."))
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    out = [c.token_ids for c in engine.generate(chats(loaded), params)]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return out


def prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("fmt", ["int8", "onednn"])
def test_fast_formats_agree_with_fp32(smollm, fp32_greedy, fmt):
    if fmt == "onednn" and not onednn_bf16_available():
        fmt = "float"  # bf16 through F.linear: the same dtype path, where oneDNN lacks bf16
    fast = variant(smollm, fmt)
    layers = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert {m.format for m in layers} >= {fmt}
    if fmt == "int8":
        # Every linear but the down projections (outlier inputs) runs int8, the LM head too.
        assert fast.model.lm_head.format == "int8"
        assert all(m.format == fast.platform.float_format for m in layers if not m.int8_inputs)
        # The table, kept as its Q8_0 blocks (runner/layers/q8_embedding.py), looks up the
        # very floats of the exact path's.
        ids = torch.arange(smollm.config.vocab_size)
        assert torch.equal(fast.model.embed_tokens(ids), smollm.model.embed_tokens(ids))
    ref, ours = fp32_greedy, greedy(fast)
    agree = [prefix(a, b) for a, b in zip(ref, ours)]
    assert sum(a >= 4 for a in agree) >= 3, agree  # floor: 3 of 4 answers start alike
    assert sum(agree) >= 0.5 * sum(len(r) for r in ref), agree
    print(f"{fmt}: tokens before the first divergence {agree}")
