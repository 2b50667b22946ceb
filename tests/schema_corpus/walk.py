"""A random model for grammars: any token the matcher allows, ending where it may end."""

from __future__ import annotations

import random
from typing import Any

import torch

from grammars import GrammarState, allocate_bitmask

VOCAB = 49152  # SmolLM2's vocabulary (the tokenizer the corpus is compiled for)
STOP = 2


def random_walk(compiled: Any, tokenizer: Any, rng: random.Random, max_tokens: int) -> str | None:
    """One random output of `compiled`, or None when it did not finish within max_tokens."""
    state, mask, ids = GrammarState(compiled), allocate_bitmask(1, VOCAB), []
    for _ in range(max_tokens):
        state.fill(mask, 0)
        bits = ((mask[0].unsqueeze(-1) >> torch.arange(32)) & 1).flatten()[:VOCAB]
        allowed = torch.nonzero(bits).flatten().tolist()
        if STOP in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return tokenizer.decode(ids)
        token = rng.choice([t for t in allowed if t != STOP])
        assert state.accept_tokens([token]) == 1
        ids.append(token)
    return None
