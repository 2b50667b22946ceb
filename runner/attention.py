"""Paged attention over a flattened batch: metadata built once per step, used by every layer.

KV cache of one layer: `[2, num_blocks, block_size, kv_heads, head_dim]` (rows of head_dim
+ 4 in the int8 cache, runner/kv_format.py); the slot of token position p of a request is
`block_ids[p // block_size] * block_size + p % block_size`.

The torch reference gathers each request's blocks into a padded `[B, kv_heads, K, D]`
copy and runs one masked `scaled_dot_product_attention` per group. Requests are split into
two groups so a 512-token prompt chunk does not pad 64 decode rows to 512 queries:

```
decode group   (1 query each):   q [B_d, KVH, g,      D]  x  kv [B_d, KVH, K_d, D]
prefill group  (chunks):         q [B_p, KVH, g * Qp, D]  x  kv [B_p, KVH, K_p, D]  causal
```

A prefill group whose requests all start at position 0 (`fresh`: whole prompts, first
chunks) needs no mask: SDPA's own `is_causal` on `q [B_p, H, Qp, D]` with `enable_gqa`. The
masks are built on first use, so a kernel that reads the paged cache itself never pays for
them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from runner import kv_format


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
    # [B] keys each request attends after this step (cached + new tokens).
    seq_lens: torch.Tensor
    # [B] tokens already cached and [B] new tokens per request: what the mask is made of.
    done: np.ndarray
    new: np.ndarray
    # [B] each request's first row in the flattened tokens, and [B] its new tokens (int64).
    query_starts: torch.Tensor
    query_lens: torch.Tensor
    # Keys in the padded gather (max_blocks * block_size).
    k_len: int
    # True when the group is every token of the step, one query each, in flattened order.
    covers_all: bool = False
    # True when every request starts at position 0 (whole prompts or first chunks): the
    # causal mask is then SDPA's own top-left `is_causal`, and right padding never reaches a
    # real row.
    fresh: bool = False
    # Masks, built on first use: kernels that read the paged cache never need them.
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, Q, K] additive mask: 0 where a query may attend a key, -inf elsewhere."""
        if 0 not in self._masks:
            q_len = self.token_index.shape[1]
            q_pos, k_pos = np.arange(q_len), np.arange(self.k_len)
            valid = q_pos[None, :] < self.new[:, None]  # [B, Q]
            # Query j of a request sits at position done + j and sees keys 0..done + j
            # (causal); padding rows see key 0 only, so softmax stays finite (their output
            # is dropped).
            see = k_pos[None, None, :] <= (self.done[:, None] + q_pos[None, :])[:, :, None]
            see = np.where(valid[:, :, None], see, k_pos[None, None, :] == 0)  # [B, Q, K]
            # Additive float mask: SDPA's CPU kernel runs faster with it than with a bool one.
            bias = np.where(see, np.float32(0), np.float32(-np.inf))[:, None]
            self._masks[0] = torch.from_numpy(bias).to(self.token_index.device)
        return self._masks[0]

    def group_mask(self, group: int) -> torch.Tensor:
        """[B, 1, g * Q, K], matching queries folded as (head in group, position)."""
        if group not in self._masks:
            b, _, q_len, k_len = self.mask.shape
            self._masks[group] = self.mask.expand(b, group, q_len, k_len).reshape(
                b, 1, group * q_len, k_len
            )
        return self._masks[group]


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
    """Metadata for requests laid out back to back in the flattened batch, in this order.

    Vectorised with numpy: one pass per request to copy its block table, none per token.
    """
    done = np.asarray(num_computed, dtype=np.int64)  # [B]
    new = np.asarray(num_new, dtype=np.int64)  # [B]
    starts = np.cumsum(new) - new  # [B] first flattened token of each request
    num_tokens = int(new.sum())
    tables = _pad_tables(block_tables)  # [B, max_blocks]
    req = np.repeat(np.arange(len(new)), new)  # [T] request of each token
    pos = np.arange(num_tokens) - starts[req] + done[req]  # [T] position of each token
    slots = tables[req, pos // block_size] * block_size + pos % block_size
    groups = []
    for idx in (np.flatnonzero(new == 1), np.flatnonzero(new > 1)):  # decode, prefill
        if len(idx):
            groups.append(_group(idx, starts, done, new, tables, block_size, num_tokens, device))
    return AttentionMetadata(torch.from_numpy(slots).to(device), groups, num_tokens)


def _pad_tables(block_tables: Sequence[Sequence[int]]) -> np.ndarray:
    width = max((len(b) for b in block_tables), default=0) or 1
    out = np.zeros((len(block_tables), width), dtype=np.int64)
    for i, blocks in enumerate(block_tables):
        out[i, : len(blocks)] = blocks
    return out


def _group(
    idx: np.ndarray,
    starts: np.ndarray,
    done: np.ndarray,
    new: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    num_tokens: int,
    device: torch.device,
) -> AttentionGroup:
    done, new, starts = done[idx], new[idx], starts[idx]  # [B]
    q_len = int(new.max())
    max_blocks = int((-(-(done + new) // block_size)).max())
    k_len = max_blocks * block_size
    q_pos = np.arange(q_len)  # [Q]
    valid = q_pos[None, :] < new[:, None]  # [B, Q]
    token_index = np.where(valid, starts[:, None] + q_pos[None, :], 0)  # [B, Q]
    index_t = torch.from_numpy(token_index)
    valid_t = torch.from_numpy(valid.reshape(-1))
    out_index = index_t.reshape(-1)[valid_t]
    return AttentionGroup(
        token_index=index_t.to(device),
        valid=valid_t.to(device),
        out_index=out_index.to(device),
        block_tables=torch.from_numpy(np.ascontiguousarray(tables[idx, :max_blocks])).to(device),
        seq_lens=torch.from_numpy(done + new).to(device),
        done=done,
        new=new,
        query_starts=torch.from_numpy(starts).to(device),
        query_lens=torch.from_numpy(new).to(device),
        k_len=k_len,
        # A decode-only step covers every token once, in order: no gather or scatter needed.
        covers_all=q_len == 1 and len(idx) == num_tokens,
        fresh=q_len > 1 and not done.any(),
    )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys and values [T, kv_heads, D] at their slots (quantised into an int8
    cache)."""
    if kv_cache.dtype == torch.int8:
        k, v = kv_format.quantize_rows(k), kv_format.quantize_rows(v)
    _, num_blocks, block_size, kv_heads, width = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads, width)
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


# (q [B, H, D], kv_cache, block_tables [B, max_blocks], seq_lens [B], scale) -> [B, H, D]
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
# (out [T, H, D], q [T, H, D], kv_cache, block_tables, seq_lens, query_starts, query_lens,
#  scale): writes the group's rows of out.
PrefillKernel = Callable[..., None]


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_kernel: DecodeKernel | None = None,
    prefill_kernel: PrefillKernel | None = None,
) -> torch.Tensor:
    """Torch reference: [T, H, D] queries against the paged cache -> [T, H, D].

    `decode_kernel`, when given, takes the group of one-query requests instead (it reads the
    paged cache in place); `prefill_kernel` likewise the group of chunks (it writes their
    rows of the output itself).

    NOTE: GQA without repeating K/V: the g query heads that share a KV head are folded into
    the query-length axis, so each KV head is read once ([B, KVH, g * Q, D] queries).
    """
    num_tokens, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    group = heads // kv_heads
    out = q.new_empty(num_tokens, heads, head_dim)
    for g in meta.groups:
        b, q_len = g.token_index.shape
        if decode_kernel is not None and q_len == 1:
            qd = q if g.covers_all else q[g.out_index]
            o = decode_kernel(qd, kv_cache, g.block_tables, g.seq_lens, scale)
            if g.covers_all:
                return o
            out[g.out_index] = o
            continue
        if prefill_kernel is not None:
            prefill_kernel(
                out, q, kv_cache, g.block_tables, g.seq_lens, g.query_starts, g.query_lens, scale
            )
            continue
        # One gather for K and V: [2, B * blocks, block, KVH, D] -> [2, B, KVH, K, D]
        kv = kv_cache.index_select(1, g.block_tables.reshape(-1))
        if kv.dtype == torch.int8:
            kv = kv_format.dequantize_rows(kv, q.dtype)
        kv = kv.view(2, b, -1, kv_heads, head_dim).transpose(2, 3)
        qg = q if g.covers_all else q[g.token_index]
        if g.fresh:
            # Prompts from position 0: SDPA's own causal mask skips the upper half of the
            # scores and reads no mask (a 2000-token prompt: 10 ms a layer here, against 25
            # masked); the KV heads are shared through enable_gqa.
            qg = qg.view(b, q_len, heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qg, kv[0, :, :, :q_len], kv[1, :, :, :q_len],
                is_causal=True, scale=scale, enable_gqa=True,
            )  # fmt: skip
            o = o.transpose(1, 2)  # [B, Q, H, D]
        else:
            qg = qg.view(b, q_len, kv_heads, group, head_dim)
            qg = qg.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * q_len, head_dim)
            o = F.scaled_dot_product_attention(
                qg, kv[0], kv[1], attn_mask=g.group_mask(group), scale=scale
            )
            o = o.view(b, kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
        if g.covers_all:
            return o.reshape(num_tokens, heads, head_dim)
        out[g.out_index] = o.reshape(b * q_len, heads, head_dim)[g.valid]
    return out
