"""Segmented LoRA matmuls (punica's SGMV shape): every adapter segment in one launch.

```
shrink   s[p]     = x[rows[p]] @ A[slot(p)]^T       s [N, W]  fp32, p = position in `rows`
expand   y[rows[p]] += s[p] @ B[slot(p)]^T           y [T, Nout]
```
`rows` lists the step's adapted rows segment after segment (runner/lora/batch.py
KernelSegments); program (g, m) covers rows m*BM.. of segment g, so each output row is
written by one program and no atomics are needed. Base-model rows are in no segment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.lora.batch import KernelSegments

BLOCK_M = 16


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, s_ptr, rows_ptr, starts_ptr, lens_ptr, slots_ptr,
    K, W,
    stride_xt, stride_as, stride_aw, stride_ak, stride_sp,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, W_PAD: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    m = tl.program_id(1)
    start = tl.load(starts_ptr + g)
    n = tl.load(lens_ptr + g)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    live = offs_m < n
    rows = tl.load(rows_ptr + start + offs_m, mask=live, other=0).to(tl.int64)
    offs_w = tl.arange(0, W_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, W_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        xk = tl.load(
            x_ptr + rows[:, None] * stride_xt + k[None, :],
            mask=live[:, None] & (k[None, :] < K),
            other=0.0,
        )  # [BM, BK]
        ak = tl.load(
            a_ptr + slot * stride_as + offs_w[None, :] * stride_aw + k[:, None] * stride_ak,
            mask=(offs_w[None, :] < W) & (k[:, None] < K),
            other=0.0,
        )  # [BK, W]
        acc += tl.dot(xk.to(tl.float32), ak.to(tl.float32))
    dst = s_ptr + (start + offs_m)[:, None].to(tl.int64) * stride_sp + offs_w[None, :]
    tl.store(dst, acc, mask=live[:, None] & (offs_w[None, :] < W))


@triton.jit
def _expand_kernel(
    s_ptr, b_ptr, y_ptr, rows_ptr, starts_ptr, lens_ptr, slots_ptr,
    N, W,
    stride_sp, stride_bs, stride_bn, stride_bw, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W_PAD: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    m = tl.program_id(1)
    nb = tl.program_id(2)
    start = tl.load(starts_ptr + g)
    n = tl.load(lens_ptr + g)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    live = offs_m < n
    rows = tl.load(rows_ptr + start + offs_m, mask=live, other=0).to(tl.int64)
    offs_w = tl.arange(0, W_PAD)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(
        s_ptr + (start + offs_m)[:, None].to(tl.int64) * stride_sp + offs_w[None, :],
        mask=live[:, None] & (offs_w[None, :] < W),
        other=0.0,
    )  # [BM, W]
    b = tl.load(
        b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_w[:, None] * stride_bw,
        mask=(offs_n[None, :] < N) & (offs_w[:, None] < W),
        other=0.0,
    )  # [W, BN]
    d = tl.dot(s, b.to(tl.float32))  # [BM, BN]
    mask = live[:, None] & (offs_n[None, :] < N)
    dst = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    y = tl.load(dst, mask=mask, other=0.0)
    tl.store(dst, (y.to(tl.float32) + d).to(y_ptr.dtype.element_ty), mask=mask)


def lora_segmented(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: KernelSegments
) -> None:
    """y [T, N] += per segment x[rows] @ a[slot]^T @ b[slot]^T, in place.

    x [T, K]; a [S, W, K] and b [S, N, W] (strided views are fine, the last dims of x and y
    must be contiguous). The shrink result stays in fp32 between the two kernels.
    """
    num_rows, groups = seg.rows.shape[0], seg.slots.shape[0]
    if num_rows == 0:
        return
    if x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError("lora_segmented: the last dimension of x and y must be contiguous")
    k, n, w = x.shape[1], y.shape[1], a.shape[1]
    w_pad = max(16, triton.next_power_of_2(w))
    s = torch.empty(num_rows, w, dtype=torch.float32, device=x.device)
    m_blocks = triton.cdiv(seg.max_len, BLOCK_M)
    _shrink_kernel[(groups, m_blocks)](
        x, a, s, seg.rows, seg.starts, seg.lens, seg.slots,
        k, w,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), s.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_K=64 if k >= 64 else max(16, triton.next_power_of_2(k)),
        W_PAD=w_pad,
    )  # fmt: skip
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    _expand_kernel[(groups, m_blocks, triton.cdiv(n, block_n))](
        s, b, y, seg.rows, seg.starts, seg.lens, seg.slots,
        n, w,
        s.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, W_PAD=w_pad,
    )  # fmt: skip
