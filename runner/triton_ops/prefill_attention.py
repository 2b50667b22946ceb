"""Prefill and chunked-prefill attention: varlen queries against paged keys, with a prefix.

A request with q new tokens and seq_len tokens in the cache (its new K/V already written)
has a cached prefix of ctx = seq_len - q tokens; its query j sits at position ctx + j and
sees keys 0 .. ctx + j. The prefix may be a prefix-cache hit or earlier chunks:

```
keys:     | cached prefix (ctx)          | this chunk (q)  |
query j:  |<--------- all visible ------>|<- causal: 0..j ->|
```
Grid (B_p, H, cdiv(max_query_len, BLOCK_M)): one program per tile of one head's queries,
streaming the keys in BLOCK_N tiles with an online softmax (flash-attention style). Tiles
past a request's own query length do no work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.triton_ops.kv_rows import load_rows
from runner.triton_ops.metadata import TritonAttentionMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    seqs_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    seq = tl.load(seqs_ptr + i)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [M, D]
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = ctx + offs_m
    # Keys this tile can see: up to its last query's position (none if the tile is empty).
    end = tl.where(mb * BLOCK_M < q_len, tl.minimum(seq_len, ctx + (mb + 1) * BLOCK_M), 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0)
        row = blk.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        # [N, D] in q's dtype (fp32 under DOT_FP32): int8 rows widened times their scales.
        k = load_rows(kv_ptr, row, offs_d, n_mask, d_mask, HEAD_DIM, KV_INT8, q.dtype)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale_log2  # [M, N]
        # Key 0 is visible to every row, so no row is all -inf after the first tile.
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = load_rows(kv_ptr + stride_c, row, offs_d, n_mask, d_mask, HEAD_DIM, KV_INT8, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: TritonAttentionMetadata,
    scale: float,
    out: torch.Tensor,
    block_m: int = 64,
    block_n: int = 64,
) -> None:
    """Attention of the prefill requests' rows of q [T, H, D], written into out [T, H, D]."""
    if meta.num_prefills == 0:
        return
    _, heads, head_dim = q.shape
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    # Smaller query tiles when every chunk is short: fewer wasted rows.
    block_m = min(block_m, max(16, triton.next_power_of_2(meta.max_query_len)))
    grid = (meta.num_prefills, heads, triton.cdiv(meta.max_query_len, block_m))
    _prefill_kernel[grid](
        q,
        kv_cache,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.prefill_seqs,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        meta.block_tables.stride(0),
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # NOTE: the interpreter (CPU tensors) multiplies bf16 dot operands as raw bits:
        # there the products run in fp32. Compiled kernels keep bf16 tensor-core products.
        DOT_FP32=q.device.type != "cuda",
        KV_INT8=kv_cache.dtype == torch.int8,
    )
