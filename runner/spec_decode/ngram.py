"""Prompt lookup: propose what followed the last time the context's tail appeared.

Copy-heavy outputs (edits of a given text, quoting, JSON echoing a schema) repeat spans of
the prompt or of themselves; when the last few tokens occurred before, the tokens after
that occurrence are a cheap, often right, guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from runner.spec_decode.config import SpeculativeConfig
from runner.spec_decode.proposer import PROPOSER_API_VERSION, DraftRequest


class NgramProposer:
    """Built-in proposer `ngram`: suffix match over prompt + output, numpy-vectorised.

    Among earlier positions whose preceding tokens match the context's last
    `prompt_lookup_min..prompt_lookup_max` tokens, it takes the longest match and, among
    equally long ones, the most recent; the drafts are the tokens that followed it.
    """

    name: ClassVar[str] = "ngram"
    api_version: ClassVar[int] = PROPOSER_API_VERSION

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.propose_one(np.asarray(r.token_ids), r.max_drafts) for r in requests]

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        """Drafts (at most `k`) for the context `tokens` [n]."""
        n = tokens.shape[0]
        if n <= self.min_n or k < 1:
            return []
        # Candidate ends: earlier positions holding the last token, with room for the
        # rest of a min-length match before them and one continuation token after.
        ends = np.flatnonzero(tokens[self.min_n - 1 : n - 1] == tokens[-1]) + self.min_n - 1
        if ends.size == 0:
            return []
        max_n = min(self.max_n, n - 1)
        # back[c, j] = tokens[end_c - j] == tokens[n - 1 - j], for j < max_n.   # [C, max_n]
        offsets = np.arange(max_n)
        before = ends[:, None] - offsets
        valid = before >= 0
        equal = (tokens[np.maximum(before, 0)] == tokens[n - 1 - offsets]) & valid
        lengths = np.cumprod(equal, axis=1).sum(axis=1)  # [C] match length of each candidate
        best = lengths.max()
        if best < self.min_n:
            return []
        # The most recent of the longest matches (ends ascend, so the last one).
        end = int(ends[np.flatnonzero(lengths == best)[-1]])
        return tokens[end + 1 : end + 1 + k].tolist()
