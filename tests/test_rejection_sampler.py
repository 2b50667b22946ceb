"""Draft verification is exact in distribution: a statistical test on a fixed tiny model.

A Markov "model" over a 4-token vocabulary gives the target distribution p(x | last
token). A deterministic proposer drafts two tokens; `verify_drafts` accepts or corrects
them. Over many seeded chains the empirical distribution of the first emitted token and of
the first three tokens must match the exact one (chi-square bound), and replacing the
residual step or the acceptance rule with a wrong one must fail the same bound.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from runner import rejection_sampler
from runner.rejection_sampler import verify_drafts
from runner.sampler import SamplingBatch
from scheduling import SamplingParams

V = 4
START = V  # row of P for the empty context
CHAINS = 20_000


def markov_table() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    raw = torch.rand(V + 1, V, generator=g)
    # Every entry >= 0.1, so each 3-token outcome expects >= 20 samples.
    return 0.6 * raw / raw.sum(-1, keepdim=True) + 0.4 / V  # [V + 1, V]


def propose(context: list[int]) -> list[int]:
    """Deterministic drafts: sometimes likely tokens, sometimes not."""
    last = context[-1] if context else START
    return [(last * 3 + 1) % V, (last + 2) % V]


def run_chains(table: torch.Tensor, n: int, length: int = 3) -> list[tuple[int, ...]]:
    """Sample `n` sequences of `length` tokens, verifying drafts all the way."""
    params = SamplingParams(temperature=1.0, max_tokens=length)
    outs: list[list[int]] = [[] for _ in range(n)]
    while True:
        live = [i for i in range(n) if len(outs[i]) < length]
        if not live:
            return [tuple(o[:length]) for o in outs]
        drafts = [propose(outs[i]) for i in live]
        rows, ids = [], []
        for i, d in zip(live, drafts):
            for j in range(len(d) + 1):
                ctx = outs[i] + d[:j]
                rows.append(ctx[-1] if ctx else START)
                ids.append([0, *ctx])
        logits = table[torch.tensor(rows)].log()
        batch = SamplingBatch(
            [params] * len(rows), ids, [1] * len(rows), [None] * len(rows), [[]] * len(rows)
        )
        tokens, _ = verify_drafts(logits, batch, drafts)
        for i, t in zip(live, tokens):
            assert 1 <= len(t) <= 3
            outs[i].extend(t)


def exact(table: torch.Tensor, length: int) -> dict[tuple[int, ...], float]:
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        probs = {
            (*seq, x): p * table[seq[-1] if seq else START, x].item()
            for seq, p in probs.items()
            for x in range(V)
        }
    return probs


def chi_square_excess(samples: list[tuple[int, ...]], expected: dict) -> float:
    """Chi-square statistic in standard deviations above its mean (df = outcomes - 1)."""
    counts = Counter(samples)
    n = len(samples)
    stat = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in expected.items())
    df = len(expected) - 1
    return (stat - df) / math.sqrt(2 * df)


def distances(samples: list[tuple[int, ...]], table: torch.Tensor) -> tuple[float, float]:
    first = chi_square_excess([s[:1] for s in samples], exact(table, 1))
    three = chi_square_excess(samples, exact(table, 3))
    return first, three


# A correct sampler exceeds 8 deviations with probability < 1e-4 (df = 3: chi2 > 22.6);
# the seed is fixed, so the test is deterministic. The broken ones land > 700 out.
BOUND = 8.0


def test_first_token_and_three_token_distributions_match_plain_sampling():
    table = markov_table()
    torch.manual_seed(0)
    first, three = distances(run_chains(table, CHAINS), table)
    assert first < BOUND and three < BOUND


def test_a_wrong_residual_step_is_caught(monkeypatch):
    # Resampling from p itself after a rejection over-weights the rejected draft.
    monkeypatch.setattr(rejection_sampler, "residual_probs", lambda probs, ids: probs)
    table = markov_table()
    torch.manual_seed(0)
    first, three = distances(run_chains(table, CHAINS), table)
    assert first > 50 * BOUND and three > 50 * BOUND


def test_a_wrong_acceptance_rule_is_caught(monkeypatch):
    # Accepting with sqrt(p(d)) instead of p(d) accepts drafts too often.
    monkeypatch.setattr(rejection_sampler, "accept_probability", torch.sqrt)
    table = markov_table()
    torch.manual_seed(0)
    first, three = distances(run_chains(table, CHAINS), table)
    assert first > 50 * BOUND and three > 50 * BOUND


def make_batch(params: SamplingParams, rows: int, gen=None) -> SamplingBatch:
    return SamplingBatch([params] * rows, [[1, 2]] * rows, [2] * rows, [gen] * rows, [[]] * rows)


def test_greedy_accepts_the_prefix_that_matches_the_argmax_plus_one():
    logits = torch.full((4, 8), -5.0)
    logits[0, 3] = logits[1, 5] = logits[2, 6] = logits[3, 1] = 5.0
    greedy = SamplingParams(temperature=0, logprobs=1)
    tokens, logprobs = verify_drafts(logits.clone(), make_batch(greedy, 4), [[3, 5, 6]])
    assert tokens == [[3, 5, 6, 1]]  # all accepted + bonus
    assert len(logprobs[0]) == 4 and logprobs[0][3][1].keys() == {1}
    tokens, logprobs = verify_drafts(logits.clone(), make_batch(greedy, 4), [[3, 4, 6]])
    assert tokens == [[3, 5]]  # second draft corrected, third dropped
    assert len(logprobs[0]) == 2
    # The runner hands over the LM head's own dtype; verification widens before it works.
    wide = verify_drafts(logits.clone(), make_batch(greedy, 4), [[3, 5, 6]])
    half = verify_drafts(logits.to(torch.bfloat16), make_batch(greedy, 4), [[3, 5, 6]])
    assert half == wide


def test_seeded_verification_is_reproducible():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=5)

    def run() -> list[list[int]]:
        gen = torch.Generator().manual_seed(5)
        return [verify_drafts(logits.clone(), make_batch(params, 4, gen), [[1, 2, 3]])[0][0]
                for _ in range(20)]  # fmt: skip

    assert run() == run()
    assert len({tuple(t) for t in run()}) > 1  # the generator advances between calls


def test_a_certain_draft_is_always_accepted_and_an_impossible_one_never():
    logits = torch.full((2, 6), -math.inf)
    logits[0, 2] = 0.0  # row 0: p(2) = 1
    logits[1, :] = 0.0
    params = SamplingParams(temperature=1.0)
    for _ in range(20):
        tokens, _ = verify_drafts(logits.clone(), make_batch(params, 2), [[2]])
        assert tokens[0][0] == 2 and len(tokens[0]) == 2
    logits[0, :] = 0.0
    logits[0, 4] = -math.inf  # p(4) = 0: rejected, and the residual never gives 4
    for _ in range(20):
        tokens, _ = verify_drafts(logits.clone(), make_batch(params, 2), [[4]])
        assert len(tokens[0]) == 1 and tokens[0][0] != 4


@pytest.mark.parametrize("top_k", [2])
def test_filters_apply_at_every_position(top_k):
    # With top_k the residual and the bonus both stay inside each row's top-k.
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0], [0.0, 1.0, 5.0, 4.5]])
    params = SamplingParams(temperature=1.0, top_k=top_k)
    seen = set()
    for _ in range(200):
        tokens, _ = verify_drafts(logits.clone(), make_batch(params, 2), [[3]])
        seen.add(tuple(tokens[0]))
    assert {t[0] for t in seen} <= {0, 1}
