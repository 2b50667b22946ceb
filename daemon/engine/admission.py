"""Checks a request must pass before the engine queues it (the API has checked the rest)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduling import SamplingParams


def check_prompt(prompt_ids: Sequence[int], vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise ValueError(f"prompt: token ids must be in [0, {vocab_size})")


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in the sampling parameters must exist in the model's vocabulary.

    Checked at admission: an id beyond the vocabulary would otherwise raise inside the
    batched sampler (fault isolation would then end the request, but a 400 is the answer).
    """
    for name, ids in (
        ("logit_bias", list(params.logit_bias)),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
