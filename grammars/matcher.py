"""Per-request grammar state and the packed token bitmask the sampler applies.

Bitmask layout: int32 `[rows, ceil(vocab / 32)]`; bit `t % 32` of word `t // 32` set means
token t is allowed at that row's position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask of `rows` rows (int32 [rows, ceil(vocab / 32)])."""
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """-inf, in place, on every logit of `logits[rows[i]]` whose bit in `bitmask[i]` is 0.

    logits: fp32 [N, V] on the CPU; bitmask: int32 [len(rows), ceil(V / 32)].
    """
    vocab = logits.shape[-1]
    rows = list(rows)
    if rows == list(range(logits.shape[0])):
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
        return
    # NOTE: xgrammar's `indices` index the mask and the logits alike; ours are dense.
    index = torch.tensor(rows, dtype=torch.long)
    picked = logits.index_select(0, index)  # [M, V]
    xgr.apply_token_bitmask_inplace(picked, bitmask, vocab_size=vocab)
    logits.index_copy_(0, index, picked)


class GrammarState:
    """One request's position in its grammar; lives on the runner thread.

    Invariant: the matcher has accepted exactly the output tokens the request keeps. A
    resumed (preempted) request gets a fresh state that replays its kept output.
    """

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        # Tokens accepted, so rollbacks are bounded by what was accepted.
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        """The stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The grammar may end here (a stop token is allowed)."""
        return self._matcher.is_completed()

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance through `token_ids` until one is refused; how many were accepted."""
        n = 0
        for t in token_ids:
            if self._matcher.is_terminated() or not self._matcher.accept_token(t):
                break
            n += 1
        self.num_accepted += n
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (all allowed once terminated).

        NOTE: with the batch queue a step may still sample for a request that ended in the
        step before; its token is discarded, so any row will do.
        """
        if self._matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_with_drafts(
        self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]
    ) -> None:
        """Fill rows `first_row .. first_row + len(drafts)` for a 1 + k speculative step.

        Row j allows what may follow the kept output plus drafts[:j]. The matcher advances
        tentatively through the drafts and is rolled back, so its state is unchanged. Rows
        after a draft the grammar refuses are left all-allowed: verification rejects that
        draft (its row forbids it), so the positions after it are never used.
        """
        self.fill(bitmask, first_row)
        advanced = 0
        for j, draft in enumerate(drafts, start=1):
            if self.accept_tokens([draft]) != 1:
                bitmask[first_row + j : first_row + len(drafts) + 1].fill_(-1)
                break
            advanced += 1
            self.fill(bitmask, first_row + j)
        self.rollback(advanced)
