"""Decode attention over the paged KV cache, split over the context (flash-decoding).

One query token per sequence. A batch of 8 decodes with 8 KV heads is only 64 programs,
too few to fill an H200's 132 SMs if each walks a long context alone, so the context is
cut into `num_splits` pieces that run in parallel; a second kernel merges them:

```
split kernel   grid (B_d, kv_heads, S):  the g query heads of one KV head, keys of split s
                                           -> partial out [B_d, H, S, D], log2-sum-exp [B_d, H, S]
reduce kernel  grid (B_d, H):             out = sum_s exp2(lse_s - max) * out_s / sum_s exp2(..)
```
GQA: a program loads its KV head's keys once and scores all g query heads that share it
(one [g, D] x [D, N] product), so K and V are read once per KV head, not once per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.triton_ops.kv_rows import load_rows
from runner.triton_ops.metadata import TritonAttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    seqs_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_c,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seqs_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)
    tok = tl.load(query_start_ptr + seq).to(tl.int64)
    # Each split takes a whole number of tiles; trailing splits of a short context are empty.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G, D]
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0)
        row = blk.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        # [N, D] in q's dtype (fp32 under DOT_FP32): int8 rows widened times their scales.
        k = load_rows(kv_ptr, row, offs_d, n_mask, d_mask, HEAD_DIM, KV_INT8, q.dtype)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale_log2  # [G, N], log2 domain
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = load_rows(kv_ptr + stride_c, row, offs_d, n_mask, d_mask, HEAD_DIM, KV_INT8, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new
    has_keys = l_sum > 0
    lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l_sum, 1.0)), float("-inf"))
    out = acc / tl.where(has_keys, l_sum, 1.0)[:, None]
    part = (i * NUM_HEADS + heads) * NUM_SPLITS + split  # [G] rows of [B_d, H, S]
    tl.store(part_lse_ptr + part, lse, mask=g_mask)
    tl.store(
        part_out_ptr + part[:, None] * D_PAD + offs_d[None, :],
        out,
        mask=g_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_ptr,
    seqs_ptr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    tok = tl.load(query_start_ptr + tl.load(seqs_ptr + i)).to(tl.int64)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    row = (i * NUM_HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty sequence (padding) -> zeros
    w = tl.exp2(lse - top)  # [S]; empty splits weigh 0
    part = tl.load(
        part_out_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + tok * stride_ot + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: TritonAttentionMetadata,
    scale: float,
    out: torch.Tensor,
    block_n: int = 64,
) -> None:
    """Attention of the decode requests' query rows of q [T, H, D], written into out [T, H, D]."""
    if meta.num_decodes == 0:
        return
    _, heads, head_dim = q.shape
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = heads // kv_heads
    splits = meta.num_decode_splits
    d_pad = max(16, triton.next_power_of_2(head_dim))
    part_out = torch.empty(
        meta.num_decodes, heads, splits, d_pad, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(meta.num_decodes, heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(meta.num_decodes, kv_heads, splits)](
        q,
        kv_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.decode_seqs,
        part_out,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        meta.block_tables.stride(0),
        GROUP=group,
        # tl.dot wants every dimension >= 16 on the GPU: small groups are padded (masked).
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        NUM_HEADS=heads,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        # NOTE: the interpreter (CPU tensors) multiplies bf16 dot operands as raw bits:
        # there the products run in fp32. Compiled kernels keep bf16 tensor-core products.
        DOT_FP32=q.device.type != "cuda",
        KV_INT8=kv_cache.dtype == torch.int8,
    )
    _decode_reduce_kernel[(meta.num_decodes, heads)](
        out,
        part_out,
        part_lse,
        meta.query_start_loc,
        meta.decode_seqs,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        NUM_HEADS=heads,
        NUM_SPLITS=splits,
        S_PAD=max(2, triton.next_power_of_2(splits)),
    )
