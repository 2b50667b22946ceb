"""Fused RMSNorm (+ residual add) and in-place RoPE, one program per token.

Both match the torch definitions in runner/models/ op for op: RMSNorm normalises in fp32,
rounds to the activation dtype, then scales by the weight (as HF does); RoPE uses the
"rotate_half" layout with cos/sin tables gathered by position. Whether they pay off on a
GPU against torch's own kernels is measured by benchmarks/gpu_check.sh, not assumed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    eps,
    HIDDEN: tl.constexpr,
    H_PAD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, H_PAD)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # x + residual, rounded to the activation dtype (as torch adds), kept as the new residual.
        x = (x.to(tl.float32) + tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0)).to(
            x.dtype
        )
        tl.store(res_ptr + t * stride_r + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / HIDDEN + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x [T, hidden]. With `residual`, first residual += x (in place), then
    normalise the sum: the pre-norm decoder's `x = x + sublayer; norm(x)` in one pass."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    res = residual if residual is not None else x
    _rms_norm_kernel[(num_tokens,)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        eps,
        HIDDEN=hidden,
        H_PAD=triton.next_power_of_2(hidden),
        HAS_RESIDUAL=residual is not None,
    )
    return out


@triton.jit
def _rope_kernel(
    x_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_t,
    stride_h,
    stride_p,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    # cos/sin rows are [freqs, freqs]: the first half of a row holds every frequency.
    cos = tl.load(cos_ptr + pos * stride_p + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_p + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    mask = (offs_h[:, None] < HEADS) & d_mask[None, :]
    first = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


def apply_rope_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place by the cos/sin rows [P, head_dim] of positions."""
    num_tokens, heads, head_dim = x.shape
    if num_tokens == 0:
        return x
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("apply_rope_: x's head dimension and the cos/sin tables must be dense")
    _rope_kernel[(num_tokens,)](
        x,
        positions,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        HEADS=heads,
        HALF=head_dim // 2,
        H_PAD=triton.next_power_of_2(heads),
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
    )
    return x
