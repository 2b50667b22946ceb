import math

import pytest
import torch

from runner.sampler import (
    SamplingBatch,
    apply_token_bitmask,
    sample,
)
from scheduling import SamplingParams

V = 8


def batch(params, token_ids=None, prompt_len=1, seeds=None, blocked=None):
    n = len(params)
    gens = [
        torch.Generator().manual_seed(s) if s is not None else None for s in seeds or [None] * n
    ]
    return SamplingBatch(
        params=params,
        token_ids=token_ids or [[0]] * n,
        num_prompt_tokens=[prompt_len] * n,
        generators=gens,
        min_tokens_blocked=blocked or [[]] * n,
    )


def logits_from_probs(probs):
    return torch.tensor([math.log(p) if p > 0 else -1e9 for p in probs]).repeat(1, 1)


def test_greedy_and_top_k_one_pick_the_argmax():
    logits = torch.randn(4, V)
    expected = logits.argmax(-1).tolist()
    greedy = sample(logits.clone(), batch([SamplingParams(temperature=0)] * 4)).token_ids
    topk1 = sample(logits.clone(), batch([SamplingParams(top_k=1)] * 4)).token_ids
    assert greedy == expected == topk1


def test_bf16_logits_give_the_fp32_choices_on_both_paths():
    # The runner hands plain greedy steps their logits unwidened; any other batch that gets
    # bf16 logits is widened before processing, so penalties and softmax run in fp32.
    logits = torch.randn(4, 300).to(torch.bfloat16)
    wide = logits.float()
    greedy = [SamplingParams(temperature=0)] * 4
    assert sample(logits.clone(), batch(greedy)).token_ids == wide.argmax(-1).tolist()
    mixed = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=1.0, seed=7)]
    seeds = [None, 7]
    got = sample(logits[:2].clone(), batch(mixed, seeds=seeds))
    want = sample(wide[:2].clone(), batch(mixed, seeds=seeds))
    assert got.token_ids == want.token_ids
    assert got.logprobs[0] == want.logprobs[0]


def test_seeded_row_ignores_its_batch_mates():
    logits = torch.randn(3, V)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = sample(logits[1:2].clone(), batch([p], seeds=[42])).token_ids[0]
    others = [SamplingParams(temperature=1.0)] * 2
    together = sample(logits.clone(), batch([others[0], p, others[1]], seeds=[None, 42, None]))
    assert together.token_ids[1] == alone


def frequencies(probs, params, n=3000):
    logits = logits_from_probs(probs).repeat(n, 1)
    ids = sample(logits, batch([params] * n)).token_ids
    return [ids.count(i) / n for i in range(len(probs))]


def test_random_sampling_follows_the_distribution():
    torch.manual_seed(0)
    freq = frequencies([0.6, 0.3, 0.1], SamplingParams(temperature=1.0))
    assert freq == pytest.approx([0.6, 0.3, 0.1], abs=0.04)


def test_top_p_and_min_p_cut_the_tail():
    torch.manual_seed(1)
    assert frequencies([0.5, 0.3, 0.2], SamplingParams(top_p=0.6))[2] == 0
    assert frequencies([0.6, 0.35, 0.05], SamplingParams(min_p=0.5))[2] == 0
    low_temp = frequencies([0.6, 0.4], SamplingParams(temperature=0.1))
    assert low_temp[0] > 0.95


def test_logit_bias_min_tokens_and_penalties():
    flat = torch.zeros(1, V)
    forced = sample(flat.clone(), batch([SamplingParams(temperature=0, logit_bias={5: 100})]))
    assert forced.token_ids == [5]
    eos_first = torch.zeros(1, V)
    eos_first[0, 2] = 10
    held = SamplingParams(temperature=0, min_tokens=2)
    assert sample(eos_first.clone(), batch([held], blocked=[[2]])).token_ids != [2]
    assert sample(eos_first.clone(), batch([SamplingParams(temperature=0)])).token_ids == [2]
    logits = torch.tensor([[5.0, 4.9, 0, 0, 0, 0, 0, 0]])
    rep = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sample(logits.clone(), batch([rep], token_ids=[[0]])).token_ids == [1]
    freq = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert sample(logits.clone(), batch([freq], token_ids=[[9, 0]])).token_ids == [1]
    no_output_yet = sample(logits.clone(), batch([freq], token_ids=[[0]])).token_ids
    assert no_output_yet == [0]  # frequency/presence count outputs only, not the prompt


def test_logprobs_are_log_softmax_with_top_n():
    logits = torch.randn(2, V)
    expected = logits.log_softmax(-1)
    out = sample(
        logits.clone(), batch([SamplingParams(temperature=0, logprobs=3), SamplingParams()])
    )
    token_lp, top = out.logprobs[0]
    assert token_lp == pytest.approx(expected[0].max().item(), abs=1e-5)
    assert list(top) == expected[0].topk(3).indices.tolist()
    assert out.logprobs[1] is None


def test_bitmask_allows_only_set_bits():
    logits = torch.randn(2, 40)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 3  # token 3
    mask[1, 1] = 1 << 2  # token 34
    apply_token_bitmask(logits, mask)
    assert logits[0].argmax().item() == 3 and torch.isinf(logits[0]).sum() == 39
    assert logits[1].argmax().item() == 34
    masked = batch([SamplingParams()] * 2)
    masked.bitmask = mask
    assert sample(torch.randn(2, 40), masked).token_ids == [3, 34]


def test_row_argmax_is_argmax_with_first_index_on_ties():
    from runner.sampler import row_argmax

    x = torch.randn(16, 1000)
    x[:, 7] = x.max() + 1
    x[:5, 500] = x[:5, 7]  # a tie later in the row: the first index wins
    x[10, :] = 0.0  # every entry tied
    assert torch.equal(row_argmax(x), x.argmax(-1))
    assert row_argmax(x)[:5].tolist() == [7] * 5 and row_argmax(x)[10].item() == 0
