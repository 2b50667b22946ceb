"""--deterministic: a greedy request's tokens do not depend on what shares its steps."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import engine_for

from daemon.engine.config import EngineConfig
from daemon.engine.loaded_model import LoadedModel
from runner.batch_invariance import invariant_from, padded
from runner.layers.linear import Linear
from scheduling import SamplingParams

PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3,",
    "Explain why the sky is blue during the day and red at sunset, in two sentences.",
    "List three prime numbers:",
    "Translate 'good morning' into Spanish:",
    "What is 12 times 12?",
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox",
    "In 1492,",
    "Dear Sir or Madam,",
    "My favourite colour is",
    "A short tip for learning the guitar:",
    "SELECT * FROM",
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # A tiny random Llama (SmolLM2's vocabulary) in fp32, whose MKL GEMMs round 1, 2-3 and
    # 4+ rows differently on an AVX2 EPYC. A small token budget splits prompts into other
    # chunks together than alone.
    from reliability_fixtures import build_tiny_model_dir

    directory = build_tiny_model_dir(tmp_path_factory.mktemp("tiny-deterministic"))
    cfg = dict(model=str(directory), device="cpu", dtype="float32", deterministic=True)
    loaded = LoadedModel.load(EngineConfig(**cfg))  # type: ignore[arg-type]
    assert loaded.platform is not None and loaded.platform.min_rows
    return engine_for(loaded, max_num_batched_tokens=32, kv_cache_memory=16 << 20, **cfg)


def run(engine, prompts: list[str], params: SamplingParams) -> list[list]:
    """Each request's tokens with their logprobs (floats compared bit for bit: a greedy
    token can survive a rounding change, its logprob does not)."""
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out[d.request_id] += list(zip(d.new_token_ids, d.new_logprobs or [], strict=True))
    engine.release_finished()
    return [out[rid] for rid in ids]


def test_16_greedy_streams_together_equal_their_solo_runs(engine):
    assert engine.governor is None  # a fixed team
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    solo = [run(engine, [p], params)[0] for p in PROMPTS]
    together = run(engine, PROMPTS, params)
    assert all(len(s) == 6 for s in solo)
    assert together == solo
    # Pairs, in another order (other batch sizes, other chunk boundaries).
    assert run(engine, PROMPTS[::-1][:2], params) == solo[::-1][:2]


def test_small_calls_are_padded_to_the_kernel_of_large_ones():
    torch.manual_seed(0)
    layer = Linear(96, 64, bias=False)
    x = torch.randn(130, 96)
    r = invariant_from(layer, x)
    assert r is not None
    layer.min_rows = r
    alone = [layer(x[i : i + 1]) for i in (0, 5)]
    for m in (1, 2, 3, 7, 64, 130):
        y = layer(x[:m])
        assert torch.equal(y[0], alone[0][0])
        if m > 5:
            assert torch.equal(y[5], alone[1][0])
    assert torch.equal(padded(layer, x[:1], 8), layer(x[:1]))
