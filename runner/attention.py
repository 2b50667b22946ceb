"""Paged attention over a flattened batch: metadata built once per step, used by every layer.

KV cache of one layer: `[2, num_blocks, block_size, kv_heads, head_dim]`; the slot of
token position p of a request is `block_ids[p // block_size] * block_size + p % block_size`.

The torch reference gathers each request's blocks into a padded `[B, kv_heads, K, D]`
copy and runs one masked `scaled_dot_product_attention` per group. Requests are split into
two groups so a 512-token prompt chunk does not pad 64 decode rows to 512 queries:

```
decode group   (1 query each):   q [B_d, KVH, g,      D]  x  kv [B_d, KVH, K_d, D]
prefill group  (chunks):         q [B_p, KVH, g * Qp, D]  x  kv [B_p, KVH, K_p, D]  causal
```
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionGroup:
    """Requests that share one padded attention call."""

    # [B, Q] indices into the flattened tokens (padding points at token 0).
    token_index: torch.Tensor
    # [B * Q] which padded rows are real tokens.
    valid: torch.Tensor
    # [N] flattened token indices of the valid rows, in order.
    out_index: torch.Tensor
    # [B, max_blocks] block ids (padding repeats block 0; masked out).
    block_tables: torch.Tensor
    # [B, 1, Q, K] additive mask: 0 where a query may attend a key, -inf elsewhere.
    mask: torch.Tensor
    # The mask repeated for the g query heads of a KV head, made once per step.
    _group_masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def group_mask(self, group: int) -> torch.Tensor:
        """[B, 1, g * Q, K], matching queries folded as (head in group, position)."""
        if group not in self._group_masks:
            b, _, q_len, k_len = self.mask.shape
            self._group_masks[group] = self.mask.expand(b, group, q_len, k_len).reshape(
                b, 1, group * q_len, k_len
            )
        return self._group_masks[group]


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    # [T] cache slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    num_tokens: int


def build_metadata(
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for requests laid out back to back in the flattened batch, in this order."""
    starts, slots = [], []
    t = 0
    for done, n, blocks in zip(num_computed, num_new, block_tables):
        starts.append(t)
        t += n
        for p in range(done, done + n):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
    decode = [i for i, n in enumerate(num_new) if n == 1]
    prefill = [i for i, n in enumerate(num_new) if n > 1]
    groups = [
        _group(idx, starts, num_computed, num_new, block_tables, block_size, device)
        for idx in (decode, prefill)
        if idx
    ]
    return AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), groups, t)


def _group(
    idx: list[int],
    starts: list[int],
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> AttentionGroup:
    q_len = max(num_new[i] for i in idx)
    max_blocks = max(-(-(num_computed[i] + num_new[i]) // block_size) for i in idx)
    k_len = max_blocks * block_size
    q_pos = torch.arange(q_len)
    k_pos = torch.arange(k_len)
    token_index, valid, tables, masks = [], [], [], []
    for i in idx:
        n, done = num_new[i], num_computed[i]
        token_index.append([starts[i] + j if j < n else 0 for j in range(q_len)])
        valid.append(q_pos < n)
        blocks = list(block_tables[i][:max_blocks])
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        # Query j sits at position done + j and sees keys 0..done + j (causal).
        mask = k_pos[None, :] <= (done + q_pos)[:, None]
        # Padding rows see key 0 only, so softmax stays finite; their output is dropped.
        mask[n:] = k_pos[None, :] == 0
        masks.append(mask)
    valid_t = torch.stack(valid).reshape(-1)
    index_t = torch.tensor(token_index, dtype=torch.long)
    # Additive float mask: SDPA's CPU kernel runs faster with it than with a bool mask.
    bias = torch.zeros(len(idx), 1, q_len, k_len).masked_fill_(
        ~torch.stack(masks).unsqueeze(1), float("-inf")
    )
    return AttentionGroup(
        token_index=index_t.to(device),
        valid=valid_t.to(device),
        out_index=index_t.reshape(-1)[valid_t].to(device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        mask=bias.to(device),
    )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys and values [T, kv_heads, D] at their slots."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Torch reference: [T, H, D] queries against the paged cache -> [T, H, D].

    NOTE: GQA without repeating K/V: the g query heads that share a KV head are folded into
    the query-length axis, so each KV head is read once ([B, KVH, g * Q, D] queries).
    """
    num_tokens, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    group = heads // kv_heads
    out = q.new_empty(num_tokens, heads, head_dim)
    for g in meta.groups:
        b, q_len = g.token_index.shape
        # One gather for K and V: [2, B * blocks, block, KVH, D] -> [2, B, KVH, K, D]
        kv = kv_cache.index_select(1, g.block_tables.reshape(-1))
        kv = kv.view(2, b, -1, kv_heads, head_dim).transpose(2, 3)
        qg = q[g.token_index].view(b, q_len, kv_heads, group, head_dim)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * q_len, head_dim)
        o = F.scaled_dot_product_attention(
            qg, kv[0], kv[1], attn_mask=g.group_mask(group), scale=scale
        )
        o = o.view(b, kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
        out[g.out_index] = o.reshape(b * q_len, heads, head_dim)[g.valid]
    return out
