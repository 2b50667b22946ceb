"""Per-request fault isolation for the sampling half of a step.

A sampling batch mixes many requests. When the batched call raises, the fault usually
belongs to one request (a parameter the validation missed, a logits processor, later its
grammar), and ending every request of the step for it would let any client break everyone
else's generation. So the batch is sampled again one request at a time: the rows whose
own call still raises are the culprits and fail alone; the others get their tokens.

Kept apart from runner/sampler.py, which several features edit (fast paths, rejection
sampling, grammar bitmasks): whatever `sample` becomes, this wrapper stays the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from runner.rejection_sampler import LogprobEntry
from runner.sampler import SamplingBatch, is_plain_greedy, sample

log = logging.getLogger("headrace.runner")

VerifyFn = Callable[
    [torch.Tensor, SamplingBatch, Sequence[Sequence[int]]],
    tuple[list[list[int]], list[list[LogprobEntry]]],
]


@dataclass(slots=True)
class PerRequest:
    """Per request: emitted tokens and their logprobs; failed request index -> why."""

    tokens: list[list[int]]
    logprobs: list[list[LogprobEntry]]
    failed: dict[int, str] = field(default_factory=dict)


def sample_one_each(
    logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[list[LogprobEntry]]]:
    """`sample` shaped like draft verification, for steps without drafts (one row each)."""
    result = sample(logits, batch)
    lps = [[lp] if lp is not None else [] for lp in result.logprobs]
    return [[t] for t in result.token_ids], lps


def sample_isolated(
    verify_fn: VerifyFn,
    logits: torch.Tensor,
    batch: SamplingBatch,
    drafts: Sequence[Sequence[int]],
    groups: list[range],
) -> PerRequest:
    """`verify_fn` over the whole batch; on an exception, again per request.

    `groups` are the row ranges of each request (a request with drafts owns several rows).
    The general sampler modifies `logits` in place, so a pristine copy is kept for the
    retry; the plain-greedy path only reads them, and the hot greedy step copies nothing.
    """
    read_only = verify_fn is sample_one_each and is_plain_greedy(batch)
    pristine = logits if read_only else logits.clone()
    # Seeded generators may have drawn before the fault: rewind them for the retry so a
    # seeded request's tokens do not depend on a neighbour's failure.
    states = [None if g is None else g.get_state() for g in batch.generators]
    try:
        return PerRequest(*verify_fn(logits, batch, drafts))
    except Exception:
        log.warning("batched sampling raised; sampling each request alone", exc_info=True)
    for g, state in zip(batch.generators, states):
        if g is not None and state is not None:
            g.set_state(state)
    out = PerRequest([[0] for _ in groups], [[] for _ in groups])
    for i, rows in enumerate(groups):
        try:
            tokens, lps = verify_fn(
                pristine[rows.start : rows.stop].clone(), _rows(batch, rows), [drafts[i]]
            )
        except Exception as e:  # any fault of this request ends it alone
            out.failed[i] = f"sampling failed: {type(e).__name__}: {e}"
            continue
        out.tokens[i], out.logprobs[i] = tokens[0], lps[0]
    return out


def _rows(batch: SamplingBatch, rows: range) -> SamplingBatch:
    """The sub-batch of the given rows (same per-row fields, sliced)."""
    sl = slice(rows.start, rows.stop)
    bitmask, bitmask_rows = None, None
    if batch.bitmask is not None:
        # The mask covers only the constrained rows (`bitmask_rows`, or all when None).
        covered = batch.bitmask_rows or range(batch.bitmask.shape[0])
        mine = [(m, r - rows.start) for m, r in enumerate(covered) if r in rows]
        if mine:
            bitmask = batch.bitmask[[m for m, _ in mine]]
            bitmask_rows = [r for _, r in mine]
    return SamplingBatch(
        params=batch.params[sl],
        token_ids=batch.token_ids[sl],
        num_prompt_tokens=batch.num_prompt_tokens[sl],
        generators=batch.generators[sl],
        min_tokens_blocked=batch.min_tokens_blocked[sl],
        bitmask=bitmask,
        bitmask_rows=bitmask_rows,
    )
