"""`headrace bench` workloads: arrival times (drawn or given), length distributions, request
classes, and the random, prefix and file workloads' prompts."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from daemon.bench.arrivals import arrival_offsets
from daemon.bench.results import SLOSpec
from daemon.bench.serve import RunSpec, spec_offsets
from daemon.bench.workloads import (
    BenchRequest,
    RequestClass,
    assign_classes,
    sample_lengths,
)

# -- arrivals and lengths ------------------------------------------------------------------


def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps():
    offsets = arrival_offsets(4000, rate=10.0, burstiness=1.0, seed=1)
    gaps = np.diff([0.0, *offsets])
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.06)  # CV of an exponential
    assert offsets == arrival_offsets(4000, 10.0, 1.0, seed=1)  # seeded
    assert offsets != arrival_offsets(4000, 10.0, 1.0, seed=2)


def test_gamma_burstiness_changes_the_spread_not_the_rate():
    for shape, cv in ((4.0, 0.5), (0.25, 2.0)):
        gaps = np.diff([0.0, *arrival_offsets(6000, 5.0, shape, seed=3)])
        assert gaps.mean() == pytest.approx(0.2, rel=0.08)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_fail():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="request-rate"):
        arrival_offsets(5, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(5, 1.0, burstiness=0)


def test_explicit_send_times_replace_the_drawn_ones_and_must_match_the_requests():
    drawn = RunSpec(request_rate=4.0, seed=2)
    assert spec_offsets(drawn, 6) == arrival_offsets(6, 4.0, 1.0, seed=2)
    given = RunSpec(request_rate=4.0, offsets=(0.5, 1.25, 3.0))
    assert spec_offsets(given, 3) == [0.5, 1.25, 3.0]
    with pytest.raises(ValueError, match="3 send times for 4 requests"):
        spec_offsets(given, 4)


def test_length_distribution_bounds_and_mean():
    rng = np.random.default_rng(0)
    lens = sample_lengths(100, 0.5, 5000, rng)
    assert min(lens) >= 50 and max(lens) <= 150
    assert np.mean(lens) == pytest.approx(100, rel=0.02)
    assert sample_lengths(64, 0.0, 10, rng) == [64] * 10
    with pytest.raises(ValueError, match="range-ratio"):
        sample_lengths(10, 1.5, 1, rng)


def test_classes_parse_and_take_their_share_of_traffic():
    chat = RequestClass.parse("chat:0.25:0:500:80")
    batch = RequestClass.parse("batch:0.75:2")
    assert (chat.priority, chat.slo.ttft_ms, chat.slo.tpot_ms) == (0, 500.0, 80.0)
    assert batch.slo == SLOSpec()
    reqs = [BenchRequest("x", None, 1, 4) for _ in range(4000)]
    assign_classes(reqs, [chat, batch], seed=0)
    share = sum(r.request_class == "chat" for r in reqs) / len(reqs)
    assert share == pytest.approx(0.25, abs=0.03)
    assert {r.priority for r in reqs if r.request_class == "batch"} == {2}
    assert {str(r.slo) for r in reqs if r.request_class == "chat"} == {
        str({"ttft_ms": 500.0, "tpot_ms": 80.0})
    }
    with pytest.raises(ValueError, match="--class"):
        RequestClass.parse("chat:lots")


class WordTokenizer:
    """One token per word: lengths in tokens are easy to check by hand."""

    all_special_ids = [0]

    def __init__(self) -> None:
        words = ["<s>", *(f"w{chr(97 + i)}{chr(97 + j)}" for i in range(26) for j in range(26))]
        self.vocab = {w: i for i, w in enumerate(words)}
        self.words = words

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.get(w, 1) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def test_random_and_prefix_workloads_have_exact_token_lengths():
    from daemon.bench.workloads import PromptMaker, prefix_workload, random_workload

    maker = PromptMaker(WordTokenizer(), seed=0)
    reqs = random_workload(maker, 50, input_len=40, output_len=8, range_ratio=0.25, seed=0)
    assert all(30 <= r.prompt_tokens <= 50 and 6 <= r.max_tokens <= 10 for r in reqs)
    assert all(len(r.prompt.split()) == r.prompt_tokens for r in reqs)
    shared = prefix_workload(
        maker, 4, prefix_len=100, input_len=10, output_len=4, range_ratio=0, seed=0
    )
    systems = {r.messages[0]["content"] for r in shared}
    assert len(systems) == 1 and len(next(iter(systems)).split()) == 100
    assert len({r.messages[1]["content"] for r in shared}) == 4
    assert all(r.prompt_tokens == 110 for r in shared)


def test_each_sweep_level_draws_its_own_prompts_the_same_for_every_target():
    # One seed for every level let a level hit the level before's prompts in a prefix cache
    # with small blocks (headrace's), never in one with 128-token blocks (vLLM's CPU build).
    import argparse

    from daemon.bench.cli import build_requests
    from daemon.bench.sweep import level_args

    args = argparse.Namespace(
        workload="random", num_prompts=4, prompts_per_level=None, input_len=12, output_len=3,
        range_ratio=0.0, seed=0, classes=[], tenants=None, tenant_weights=None,
    )  # fmt: skip

    def prompts(index: int, level: float) -> list[str]:
        level_ns = level_args(args, index, level, "concurrency")
        return [r.prompt for r in build_requests(level_ns, WordTokenizer())[0]]

    first, second = prompts(0, 1), prompts(1, 8)
    assert len(first) == 4 and len(second) == 16  # at least two prompts a slot
    assert not set(first) & set(second)
    assert prompts(1, 8) == second  # the next target is sent the same prompts

    # With --rounds, each round of a level draws afresh too, the same for every target.
    def round_prompts(round_: int) -> list[str]:
        level_ns = level_args(args, 1, 8, "concurrency", round_)
        return [r.prompt for r in build_requests(level_ns, WordTokenizer())[0]]

    assert round_prompts(0) == second
    again = round_prompts(1)
    assert again == round_prompts(1) and not set(again) & (set(first) | set(second))


def test_jsonl_and_sharegpt_files_load(tmp_path):
    from daemon.bench.workloads import PromptMaker, file_workload

    maker = PromptMaker(WordTokenizer(), seed=0)
    lines = tmp_path / "p.jsonl"
    lines.write_text(
        '{"prompt": "waa wab", "output_len": 5}\n'
        '{"messages": [{"role": "user", "content": "wac wad wae"}]}\n'
    )
    reqs = file_workload(lines, maker, 2, default_out=7, seed=0)
    assert sorted((r.prompt_tokens, r.max_tokens) for r in reqs) == [(2, 5), (3, 7)]
    share = tmp_path / "sharegpt.json"
    human, gpt = {"from": "human", "value": "waa wab wac"}, {"from": "gpt", "value": "wad wae"}
    convo = [{"conversations": [human, gpt]}, {"conversations": [gpt, human]}]
    share.write_text(orjson.dumps(convo).decode())
    reqs = file_workload(share, maker, 3, default_out=7, seed=0)  # sampled with replacement
    assert [(r.prompt_tokens, r.max_tokens) for r in reqs] == [(3, 2)] * 3
    assert reqs[0].messages == [{"role": "user", "content": "waa wab wac"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt, messages or conversations"):
        file_workload(bad, maker, 1, 7, 0)
    with pytest.raises(FileNotFoundError, match="dataset-path"):
        file_workload(tmp_path / "missing.jsonl", maker, 1, 7, 0)
