"""Verification of speculative drafts: greedy matching and rejection sampling.

Each request with drafts d_1..d_k has k + 1 logits rows from one forward: row j scores the
token after the context plus d_1..d_j (row 0: after the context alone). Every row is
processed exactly as a plain sampling row (bias, min_tokens, penalties that count
d_1..d_j as output, the grammar bitmask row, temperature, top-k/top-p/min-p), giving the
target distribution p_j.

- Greedy: d_j is accepted while it equals argmax p_{j-1}; the first mismatch emits the
  argmax instead; if all match, the argmax of the last row is a bonus token.
- Sampled: the proposer is deterministic, so its draft distribution q is one-hot on d_j.
  Accept d_j with probability min(1, p(d_j) / q(d_j)) = p(d_j); on rejection emit a
  sample of the residual max(0, p - q), normalised — p with d_j removed. Each emitted token
  is then distributed exactly as p (Leviathan et al., 2023): the output does not depend
  on the drafts, only the speed does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runner.sampler import SamplingBatch, _filter, process_logits, row_argmax

LogprobEntry = tuple[float, dict[int, float]]


def accept_probability(p_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) for a one-hot q: just p(d). A separate function so tests can
    swap in a wrong rule and see the distribution test catch it."""
    return p_draft


def residual_probs(probs: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) for one-hot q at `draft_ids` [N]; unnormalised (the race below
    normalises). probs [N, V]."""
    return probs.scatter(1, draft_ids[:, None], 0.0)


def _draws(
    batch: SamplingBatch, has_draft: list[bool], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row a uniform (rows that judge a draft) and V exponentials; seeded rows from
    their own generator.

    NOTE: a row without a draft draws exactly what `sampler.sample` draws for it, so a
    seeded request's tokens do not depend on whether others in its batch have drafts.
    """
    num_rows = len(has_draft)
    uniform = torch.rand(num_rows)
    noise = torch.empty(num_rows, vocab).exponential_()
    for i, g in enumerate(batch.generators):
        if g is not None:
            if has_draft[i]:
                uniform[i] = torch.rand((), generator=g)
            noise[i].exponential_(generator=g)
    return uniform, noise


def verify_drafts(
    logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[list[LogprobEntry]]]:
    """Emitted tokens (accepted drafts + one) and their logprobs, per request.

    logits: fp32 [R, V] with R = sum(len(d) + 1), rows grouped by request in `drafts`
    order (modified in place). `batch` has one row per logits row; its `bitmask`, when
    given, holds a row per position too (the grammar engine fills rows for d_1..d_j).
    """
    num_rows, vocab = logits.shape
    logits = process_logits(logits.float(), batch)  # .float(): a no-op on fp32 logits
    log_rows = [i for i, p in enumerate(batch.params) if p.logprobs is not None]
    logprobs_all = logits[log_rows].log_softmax(-1) if log_rows else None
    target = row_argmax(logits)  # [R] the greedy choice at every row
    # draft_at[r]: the draft row r judges (the next row's input); -1 on a bonus row.
    draft_at = torch.full((num_rows,), -1, dtype=torch.long)
    r = 0
    for d in drafts:
        draft_at[r : r + len(d)] = torch.tensor(list(d), dtype=torch.long)
        r += len(d) + 1
    greedy = [p.greedy for p in batch.params]
    if all(greedy):
        accepted_rows = (target == draft_at).tolist()
        emitted = target.tolist()
    else:
        probs = _filter(logits, batch).softmax(-1)  # [R, V] p_j
        has_draft = draft_at >= 0
        uniform, noise = _draws(batch, has_draft.tolist(), vocab)
        safe_draft = draft_at.clamp(min=0)
        p_draft = probs.gather(1, safe_draft[:, None]).squeeze(1)  # [R]
        accept = (uniform < accept_probability(p_draft)) & has_draft
        residual = torch.where(has_draft[:, None], residual_probs(probs, safe_draft), probs)
        # Exponential race: argmax(w / E), E ~ Exp(1), samples from w / sum(w).
        recovered = (residual / noise).argmax(-1)
        greedy_t = torch.tensor(greedy)
        accepted_rows = torch.where(greedy_t, target == draft_at, accept).tolist()
        emitted = torch.where(greedy_t, target, torch.where(accept, draft_at, recovered)).tolist()
    tokens: list[list[int]] = []
    logprobs: list[list[LogprobEntry]] = []
    r = 0
    for d in drafts:
        n = len(d)
        out = []
        for j in range(n + 1):
            out.append(emitted[r + j])
            if j == n or not accepted_rows[r + j]:
                break
        tokens.append(out)
        logprobs.append(_logprobs(batch, log_rows, logprobs_all, r, out))
        r += n + 1
    return tokens, logprobs


def _logprobs(
    batch: SamplingBatch,
    log_rows: list[int],
    logprobs_all: torch.Tensor | None,
    first_row: int,
    tokens: list[int],
) -> list[LogprobEntry]:
    """One entry per emitted token, from the row that chose it."""
    if logprobs_all is None or batch.params[first_row].logprobs is None:
        return []
    k = batch.params[first_row].logprobs or 0
    start = log_rows.index(first_row)
    out = []
    for j, token in enumerate(tokens):
        row = logprobs_all[start + j]
        top = row.topk(k) if k else None
        alts = dict(zip(top.indices.tolist(), top.values.tolist())) if top else {}
        out.append((row[token].item(), alts))
    return out
