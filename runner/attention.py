"""Paged attention over a flattened batch: metadata built once per step, used by every layer.

KV cache of one layer: `[2, num_blocks, block_size, kv_heads, head_dim]`; the slot of
token position p of a request is `block_ids[p // block_size] * block_size + p % block_size`.

The torch reference gathers each request's blocks into a padded `[B, K, kv_heads, D]`
view and runs one masked `scaled_dot_product_attention` per group. Requests are split into
two groups so a 512-token prompt chunk does not pad 64 decode rows to 512 queries:

```
decode group   (1 query each):   q [B_d, H, 1,  D]  x  kv [B_d, H, K_d, D]
prefill group  (chunks):         q [B_p, H, Qp, D]  x  kv [B_p, H, K_p, D]   causal mask
```
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    # [B, 1, Q, K] True where a query may attend a key.
    mask: torch.Tensor


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
    return AttentionGroup(
        token_index=index_t.to(device),
        valid=valid_t.to(device),
        out_index=index_t.reshape(-1)[valid_t].to(device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        mask=torch.stack(masks).unsqueeze(1).to(device),
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
    """Torch reference: [T, H, D] queries against the paged cache -> [T, H, D]."""
    num_tokens, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    out = q.new_empty(num_tokens, heads, head_dim)
    for g in meta.groups:
        b, q_len = g.token_index.shape
        qg = q[g.token_index].transpose(1, 2)  # [B, H, Q, D]
        k = kv_cache[0][g.block_tables].view(b, -1, kv_heads, head_dim).transpose(1, 2)
        v = kv_cache[1][g.block_tables].view(b, -1, kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qg, k, v, attn_mask=g.mask, scale=scale, enable_gqa=kv_heads != heads
        )  # [B, H, Q, D]
        o = o.transpose(1, 2).reshape(b * q_len, heads, head_dim)
        out[g.out_index] = o[g.valid]
    return out
