"""Write each new token's K and V into the paged cache at its slot.

Cache of one layer: `[2, num_blocks, block_size, kv_heads, head_dim]` (int8 rows of
head_dim + 4: quantised on the way, runner/triton_ops/kv_rows.py); slot s lives in block
s // block_size at offset s % block_size. One program per token copies all its KV heads at
once; a slot of -1 (a padding row of a CUDA graph) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.triton_ops.kv_rows import store_int8_rows


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kv_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c,  # K -> V half of the cache
    stride_cb,  # block
    stride_cs,  # offset in block
    stride_ch,  # kv head
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_INT8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    # The slot test as a per-head vector: a scalar in a tile mask trips the interpreter.
    live = (offs_h < KV_HEADS) & (tl.zeros([H_PAD], tl.int64) + slot >= 0)
    mask = live[:, None] & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    base = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs_h * stride_ch
    if KV_INT8:
        store_int8_rows(kv_ptr, base, k, offs_d, mask, live, HEAD_DIM)
        store_int8_rows(kv_ptr + stride_c, base, v, offs_d, mask, live, HEAD_DIM)
    else:
        dst = base[:, None] + offs_d[None, :]
        tl.store(kv_ptr + dst, k, mask=mask)
        tl.store(kv_ptr + stride_c + dst, v, mask=mask)


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store keys and values [T, kv_heads, D] at slot_mapping [T] (int32 or int64)."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("write_kv: the head dimension of k, v and the cache must be contiguous")
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        KV_INT8=kv_cache.dtype == torch.int8,
    )
