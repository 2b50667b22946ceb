"""Speculative decoding end to end on a tiny random Llama: exact greedy outputs, exact
sampled distribution, seeded reproducibility, logprobs, stops inside drafts, no leaks."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch
from model_fixtures import engine_for, make_tiny_hf_model

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from runner import rejection_sampler
from runner.model_source import resolve_model
from runner.spec_decode import PROPOSER_API_VERSION, DraftRequest
from runner.tokenizer import load_tokenizer
from scheduling import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[torch.nn.Module, LoadedModel]:
    directory = tmp_path_factory.mktemp("spec-llama")
    hf = make_tiny_hf_model("llama-plain", directory)
    return hf, LoadedModel.load(
        EngineConfig(model=str(directory), device="cpu", dtype="float32", quantization="none")
    )


class OracleProposer:
    """Drafts the tiny model's own greedy continuation, with every third draft wrong:
    plenty of accepted drafts, and rejections at every depth."""

    name: ClassVar[str] = "oracle"
    api_version: ClassVar[int] = PROPOSER_API_VERSION

    def __init__(self, hf: torch.nn.Module, corrupt: bool = True) -> None:
        self.hf, self.corrupt = hf, corrupt
        self.cache: dict[tuple[int, ...], int] = {}

    def next_token(self, context: tuple[int, ...]) -> int:
        if context not in self.cache:
            with torch.inference_mode():
                logits = self.hf(torch.tensor([context])).logits[0, -1]
            self.cache[context] = int(logits.argmax())
        return self.cache[context]

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            context, drafts = tuple(r.token_ids), []
            for j in range(r.max_drafts):
                token = self.next_token(context)
                if self.corrupt and (len(context) + j) % 3 == 2:
                    token = (token + 1) % 320
                drafts.append(token)
                context += (token,)
            out.append(drafts)
        return out


def plain_engine(loaded: LoadedModel, **cfg: object) -> Engine:
    # A small pool: the default (up to 1 GiB) costs more to zero than these tests run.
    cfg.setdefault("kv_cache_memory", 8 << 20)
    cfg.setdefault("max_waiting", 0)
    return engine_for(loaded, **cfg)


def spec_engine(tiny, proposer: str = "ngram", k: int = 3, **cfg: object) -> Engine:
    hf, loaded = tiny
    engine = plain_engine(loaded, speculative_method="ngram", num_speculative_tokens=k, **cfg)
    if proposer == "oracle":
        engine.runner.proposer = OracleProposer(hf)
    return engine


def mixed_prompts() -> list[list[int]]:
    rng = random.Random(7)
    para = [rng.randrange(3, 320) for _ in range(24)]
    return [
        para * 3,  # repeats itself: the ngram proposer finds matches
        [rng.randrange(3, 320) for _ in range(30)],  # does not repeat
        para + para[:9],
        [5, 6, 7, 8] * 6,
        para * 3,  # identical to the first: a prefix-cache hit
        [rng.randrange(3, 320) for _ in range(11)],
    ]


def assert_pool_clean(engine: Engine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


# Penalties make row j depend on the drafts before j: a runner that forgot them diverges.
GREEDY = SamplingParams(
    max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.3
)


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
def test_greedy_with_speculation_equals_without(tiny, proposer):
    ps = mixed_prompts()
    want = [c.token_ids for c in plain_engine(tiny[1]).generate(ps, GREEDY)]
    # min 1: a random model seldom repeats a 2-gram, but often a single prompt token.
    engine = spec_engine(tiny, proposer, prompt_lookup_min=1)
    got = [c.token_ids for c in engine.generate(ps, GREEDY)]
    assert got == want
    stats = engine.scheduler.spec_stats
    assert stats.num_verified > 0
    if proposer == "oracle":
        assert 0 < stats.num_accepted < stats.num_verified
    assert_pool_clean(engine)


def test_greedy_equal_across_preemption_chunked_prefill_and_a_small_budget(tiny):
    """A pool too small for the batch forces recompute; the budget cuts drafts short.

    Extend `constrained` cases here once grammars land (bitmask rows per position)."""
    _, loaded = tiny
    ps = mixed_prompts()
    cfg = dict(
        block_size=4,
        max_num_batched_tokens=20,
        long_prefill_token_threshold=7,
        kv_cache_memory=40 * 2 * 4 * loaded.config.kv_size * 4 * loaded.config.num_hidden_layers,
    )
    want = [c.token_ids for c in plain_engine(loaded, **cfg).generate(ps, GREEDY)]
    engine = spec_engine(tiny, "oracle", k=4, **cfg)
    got = [c.token_ids for c in engine.generate(ps, GREEDY)]
    assert got == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.spec_stats.num_accepted > 0
    assert_pool_clean(engine)


def test_per_request_opt_out_and_k_cap(tiny):
    engine = spec_engine(tiny, "oracle", k=4)
    base = dict(max_tokens=16, temperature=0, ignore_eos=True)
    off = engine.add_request([5, 6, 7], SamplingParams(num_speculative_tokens=0, **base))
    capped = engine.add_request([5, 6, 8], SamplingParams(num_speculative_tokens=1, **base))
    seen: dict[str, int] = {}
    while engine.has_unfinished_requests():
        so = engine.scheduler.schedule()
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            seen[rid] = max(seen.get(rid, 0), len(drafts))
        engine.process(so, engine.execute(so))
    assert off not in seen
    assert seen[capped] == 1
    engine.release_finished()
    assert_pool_clean(engine)


def test_max_tokens_is_never_overshot(tiny):
    engine = spec_engine(tiny, "oracle", k=4)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    out = engine.generate(mixed_prompts(), params)
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in out)


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(tiny):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=5, seed=11, ignore_eos=True)
    alone = spec_engine(tiny, "oracle").generate([[9, 8, 7, 6]], params)[0].token_ids
    engine = spec_engine(tiny, "oracle")
    others = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    rid = engine.add_request([9, 8, 7, 6], params)
    for p in mixed_prompts():
        engine.add_request(p, others)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() if d.request_id == rid for t in d.new_token_ids]
    assert tokens == alone
    assert engine.scheduler.spec_stats.num_accepted > 0


def test_logprobs_one_entry_per_emitted_token(tiny):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    plain = plain_engine(tiny[1])
    engine = spec_engine(tiny, "oracle")
    rids = [engine.add_request(p, params) for p in mixed_prompts()[:3]]
    want = {}
    for i, p in enumerate(mixed_prompts()[:3]):
        want[rids[i]] = [lp for d in _run(plain, [p], params) for lp in d.new_logprobs]
    got: dict[str, list] = {rid: [] for rid in rids}
    multi = False
    while engine.has_unfinished_requests():
        for d in engine.step():
            assert len(d.new_logprobs or []) == len(d.new_token_ids)
            multi |= len(d.new_token_ids) > 1
            got[d.request_id] += d.new_logprobs or []
    assert multi  # some steps emitted several tokens
    for rid in rids:
        assert len(got[rid]) == len(want[rid]) == 10
        for (lp, alts), (lp2, alts2) in zip(got[rid], want[rid]):
            assert math.isclose(lp, lp2, abs_tol=1e-4) and alts.keys() == alts2.keys()


def _run(engine: Engine, prompts, params):
    for p in prompts:
        engine.add_request(p, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    return deltas


def test_stop_token_and_stop_string_inside_drafts_end_at_the_right_token(tiny):
    _, loaded = tiny
    prompt = mixed_prompts()[0]
    base = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = plain_engine(loaded).generate([prompt], base)[0].token_ids
    # A stop token id: output ends right after its first occurrence.
    stop_id = full[6]
    cut = full[: full.index(stop_id) + 1]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    engine = spec_engine(tiny, "oracle", k=4)
    assert engine.generate([prompt], params)[0].token_ids == cut
    # A stop string (the embedded model's tokenizer decodes the tiny model's ids).
    tok = load_tokenizer(resolve_model(None))
    text = tok.decode(full)
    stop = tok.decode(full[5:7])
    assert stop and stop in text
    plain = plain_engine(loaded)
    engine = spec_engine(tiny, "oracle", k=4)
    plain.tokenizer = engine.tokenizer = tok
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    want = plain.generate([prompt], params)[0]
    got = engine.generate([prompt], params)[0]
    assert got.finish_reason == want.finish_reason == "stop"
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    assert len(got.token_ids) < len(full)
    assert_pool_clean(engine)


def test_aborts_mid_speculation_leak_nothing(tiny):
    engine = spec_engine(tiny, "oracle", k=4)
    params = SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True, seed=3)
    rids = [engine.add_request(p, params) for p in mixed_prompts()]
    for i in range(6):
        engine.step()
        engine.abort([rids[i]])
    assert not engine.has_unfinished_requests()
    engine.release_finished()
    assert engine.scheduler.spec_stats.num_verified > 0
    assert_pool_clean(engine)


# -- the sampled distribution, end to end -----------------------------------------------

SAMPLES = 400
TOP_K = 3


def exact_distribution(hf: torch.nn.Module, prompt: list[int], temp: float) -> dict:
    """p(t1, t2, t3) of top-k sampling, from transformers' logits of the same weights."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        nxt = {}
        for seq, p in dist.items():
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + list(seq)])).logits[0, -1] / temp
            top = logits.topk(TOP_K)
            for t, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
                nxt[(*seq, t)] = p * q
        dist = nxt
    return dist


def chi_square_excess(counts: Counter, expected: dict[tuple[int, ...], float], n: int) -> float:
    """In standard deviations; outcomes expecting < 5 samples are pooled into one bin."""
    big = {k: p for k, p in expected.items() if n * p >= 5}
    bins = [(counts[k], n * p) for k, p in big.items()]
    rest = n - sum(c for c, _ in bins), n * (1 - sum(big.values()))
    if rest[1] >= 1:
        bins.append(rest)
    stat = sum((c - e) ** 2 / e for c, e in bins)
    df = len(bins) - 1
    return (stat - df) / math.sqrt(2 * df)


def sampled_excess(tiny, engine: Engine) -> float:
    """Chi-square excess of `engine`'s 3-token samples against the exact distribution."""
    hf, _ = tiny
    prompt, temp = [11, 12, 13, 11, 12], 1.5
    rids = [
        engine.add_request(
            prompt,
            SamplingParams(max_tokens=3, temperature=temp, top_k=TOP_K, seed=s, ignore_eos=True),
        )
        for s in range(SAMPLES)
    ]
    seqs: dict[str, list[int]] = {rid: [] for rid in rids}
    while engine.has_unfinished_requests():
        for d in engine.step():
            seqs[d.request_id] += d.new_token_ids
    counts = Counter(tuple(s) for s in seqs.values())
    return chi_square_excess(counts, exact_distribution(hf, prompt, temp), SAMPLES)


def argmax_drafting_engine(tiny) -> Engine:
    engine = spec_engine(tiny, "oracle", k=2)
    engine.runner.proposer.corrupt = False  # argmax drafts: many accepted, some not
    return engine


def test_sampled_outputs_follow_the_target_distribution(tiny):
    assert sampled_excess(tiny, plain_engine(tiny[1])) < 8
    engine = argmax_drafting_engine(tiny)
    assert sampled_excess(tiny, engine) < 8
    stats = engine.scheduler.spec_stats
    assert 0 < stats.num_accepted < stats.num_verified


def test_the_end_to_end_check_catches_a_wrong_residual(tiny, monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_probs", lambda probs, ids: probs)
    assert sampled_excess(tiny, argmax_drafting_engine(tiny)) > 8


# -- the API extension, /metrics and the log line ----------------------------------------


def test_request_body_extension():
    from daemon.openai.protocol import APIError, parse_request

    def parse(spec: object) -> int | None:
        return parse_request(
            {"prompt": "x", "speculative": spec}, chat=False
        ).params.num_speculative_tokens

    assert parse(None) is None
    assert parse({"enabled": False}) == 0
    assert parse({"enabled": False, "num_speculative_tokens": 3}) == 0
    assert parse({"num_speculative_tokens": 2}) == 2
    for bad, param in (
        ({"k": 2}, "speculative.k"),
        ({"num_speculative_tokens": -1}, "speculative.num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "speculative.num_speculative_tokens"),
        ({"enabled": "no"}, "speculative.enabled"),
        ([1], "speculative"),
    ):
        with pytest.raises(APIError) as e:
            parse(bad)
        assert e.value.status == 400 and e.value.param == param


def test_metrics_and_log_fields_report_drafts(tiny):
    from daemon.openai.metrics import Metrics
    from daemon.openai.spec_metrics import spec_log_fields

    engine = spec_engine(tiny, "oracle")
    engine.add_request(mixed_prompts()[0], GREEDY)
    last = None
    while engine.has_unfinished_requests():
        for d in engine.step():
            last = d
    stats = engine.scheduler.spec_stats
    assert last is not None and last.spec_stats is not None
    assert last.spec_stats.num_accepted == stats.num_accepted > 0
    text = Metrics().render(engine.stats()).decode()
    assert f"headrace_spec_decode_draft_tokens_accepted_total {float(stats.num_accepted)}" in text
    assert f"headrace_spec_decode_draft_tokens_verified_total {float(stats.num_verified)}" in text
    assert "headrace_spec_decode_acceptance_rate" in text
    assert "headrace_spec_decode_mean_accepted_length" in text
    assert spec_log_fields(last.spec_stats) == (
        f" drafts={stats.num_accepted}/{stats.num_verified}"
        f" accept_len={stats.mean_accepted_length:.2f}"
    )
    assert spec_log_fields(None) == ""


async def test_async_engine_turns_the_overlap_off_and_streams_multi_token_deltas(tiny, caplog):
    from daemon.engine.async_engine import AsyncEngine

    engine = spec_engine(tiny, "oracle")
    with caplog.at_level("WARNING", logger="headrace.engine"):
        async_engine = AsyncEngine(engine, overlap=True)
    assert not async_engine.overlap and async_engine.depth == 1
    assert "overlap turned off" in caplog.text
    want = plain_engine(tiny[1]).generate([mixed_prompts()[0]], GREEDY)[0].token_ids
    try:
        deltas = [d async for d in async_engine.generate(mixed_prompts()[0], GREEDY)]
    finally:
        await async_engine.stop()
    assert [t for d in deltas for t in d.new_token_ids] == want
    assert any(len(d.new_token_ids) > 1 for d in deltas)
    assert_pool_clean(engine)


def test_detokenizer_finds_the_token_that_completes_a_stop_string():
    from daemon.engine.detokenizer import IncrementalDetokenizer

    tok = load_tokenizer(resolve_model(None))
    ids = tok.encode("one two three four five")
    three = next(i for i in range(len(ids)) if "three" in tok.decode(ids[: i + 1]))
    detok = IncrementalDetokenizer(tok, tok.encode("Count:"), SamplingParams(stop=["three"]))
    assert detok.add(ids) + detok.flush() == "one two "
    assert detok.stop_reason == "three" and detok.stop_token_count == three + 1 < len(ids)
