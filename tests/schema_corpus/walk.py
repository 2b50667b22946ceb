"""A random model for grammars: any token the matcher allows, ending where it may end."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from grammars import GrammarState, allocate_bitmask

VOCAB = 49152  # SmolLM2's vocabulary (the tokenizer the corpus is compiled for)
STOP = 2


def random_walk(compiled: Any, tokenizer: Any, rng: random.Random, max_tokens: int) -> str | None:
    """One random output of `compiled`, or None when it did not finish within max_tokens."""
    state, mask, ids = GrammarState(compiled), allocate_bitmask(1, VOCAB), []
    for _ in range(max_tokens):
        state.fill(mask, 0)
        # NOTE: numpy, not torch: torch's shift-and-mask unpacking took ~20 ms a step on a
        # busy 2-core machine (its thread pool), the whole of the coverage benchmark's time.
        bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:VOCAB]
        allowed = np.flatnonzero(bits)
        may_stop = bool(bits[STOP])
        if may_stop and (len(allowed) == 1 or rng.random() < 0.5):
            return tokenizer.decode(ids)
        others = allowed[allowed != STOP] if may_stop else allowed
        token = int(others[rng.randrange(len(others))])
        assert state.accept_tokens([token]) == 1
        ids.append(token)
    return None
