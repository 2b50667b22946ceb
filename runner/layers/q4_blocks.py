"""A linear's weight as 4-bit blocks (GGUF's Q4_1 numbers) for the AVX2 maddubs kernel.

Per 32 inputs of an output channel the weight is `d * q + m`, q in 0..15: how a Q4_1 GGUF
stores it. The loader hands the model dequantised floats; `Q4Blocks.from_weight` finds the
blocks again (the least and largest value of a Q4_1 block are its q = 0 and q = 15, so a
block's min and range give back m and d) and keeps them only where the weight is on such a
grid, so the copy is the checkpoint's own numbers, never a new rounding of other weights.

The kernel (runner/cpu_ops/q4_linear.cpp) rounds the activations to int8 per 32 inputs, as
llama.cpp's Q4_1 x Q8_1 dot does, and multiplies with maddubs: twice the multiply-adds a
cycle of the int8 copy's int16 madd. It is one of the batched kernels the start-up
measurement may choose (runner/batched_rows.py, kernel "q4").

`Q4Gemv` holds the same blocks for runner/cpu_ops/q4_gemv.cpp: a decode step of a few rows,
activations rounded to int16 (as exact as the int8 copies'), fp16 d and m beside the nibbles
so a block streams as one read. It lives in the small-batch copy (weight_formats.py), which
serves its rows up to a measured `q4_rows` (runner/format_timing.py, `measure_q4_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q4_KERNEL = "q4"
Q4_GEMV = "q4_gemv"
BLOCK = 32  # inputs per (d, m) pair, as Q4_1
CHANNELS = 24  # output channels per packed block (the kernel's three 8-lane vectors)
# How far off the 4-bit grid, in steps d, a weight may be and still count as on it: the
# float the loader made of d * q + m, rounded to the model's dtype (bf16 keeps 8 bits: at
# most ~0.03 d), is on it; weights that never were 4-bit are off by up to 0.5 d.
GRID_TOLERANCE = 0.1


def q4_kernels() -> dict[str, str]:
    """This build's 4-bit kernel and the instructions it uses ({} where none, or no build)."""
    from runner.cpu_ops import kernel_isas

    return kernel_isas("q4_kernels")


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float (K a multiple of 32) -> q [N, K] uint8 in 0..15, d and m [N, K/32] fp32,
    as Q4_1 quantises: m the block's least value, d its range / 15."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    low = blocks.amin(dim=2)
    d = (blocks.amax(dim=2) - low) / 15
    steps = (blocks - low[..., None]) / d.clamp_min(1e-30)[..., None]
    q = steps.round_().clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), d, low


def dequantize_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The [N, K] fp32 weight the blocks hold."""
    n, k = q.shape
    blocks = q.reshape(n, k // BLOCK, BLOCK).float() * d[..., None] + m[..., None]
    return blocks.reshape(n, k)


# A weight's (q [N, K] uint8, d [N, K/32] fp32, m [N, K/32] fp32), as `quantize_blocks`.
Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def find_blocks(w: torch.Tensor) -> Blocks | None:
    """The (q, d, m) blocks of a weight already on a 4-bit grid per 32 inputs; None where it
    is not (or K is not a multiple of 32), so a copy is never a new rounding of a weight."""
    if w.dim() != 2 or w.shape[1] % BLOCK:
        return None
    q, d, m = quantize_blocks(w)
    off = (dequantize_blocks(q, d, m) - w.float()).abs().reshape(*d.shape, BLOCK)
    if (off > GRID_TOLERANCE * d[..., None]).any():
        return None
    return q, d, m


@dataclass(slots=True)
class Q4Blocks:
    """An [N, K] weight as packed 4-bit blocks and their (d, m) scales, for `q4_linear`."""

    packed: torch.Tensor  # [ceil(N/24), K/8, 24, 4] uint8, two inputs a byte
    scales: torch.Tensor  # [ceil(N/24), K/32, 2, 24] fp32: d then m
    out_features: int

    @classmethod
    def from_blocks(cls, blocks: Blocks | None) -> Q4Blocks | None:
        """From `find_blocks`' result; None where there are none or this build has no
        kernel."""
        if blocks is None or Q4_KERNEL not in q4_kernels():
            return None
        packed, scales = torch.ops.headrace.q4_pack(*blocks)
        return cls(packed, scales, blocks[0].shape[0])

    @classmethod
    def from_weight(cls, w: torch.Tensor) -> Q4Blocks | None:
        return cls.from_blocks(find_blocks(w))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[M, K] fp32 or bf16 -> [M, N] in x's dtype."""
        return torch.ops.headrace.q4_linear(x, self.packed, self.scales, bias, self.out_features)


def q4_gemv_kernels() -> dict[str, str]:
    """This build's few-row 4-bit kernel and its instructions ({} where none, or no build)."""
    from runner.cpu_ops import kernel_isas

    return kernel_isas("q4_gemv_kernels")


@dataclass(slots=True)
class Q4Gemv:
    """An [N, K] weight as 4-bit blocks laid out for `q4_gemv` (a few rows)."""

    packed: torch.Tensor  # [ceil(N/16), K/32, 320] uint8: nibbles, then fp16 d and m
    out_features: int

    @classmethod
    def from_blocks(cls, blocks: Blocks | None) -> Q4Gemv | None:
        """From `find_blocks`' result; None where there are none, this build has no kernel,
        or a scale is past fp16's range."""
        if blocks is None or Q4_GEMV not in q4_gemv_kernels():
            return None
        q, d, m = blocks
        if max(d.abs().max().item(), m.abs().max().item()) > torch.finfo(torch.float16).max:
            return None
        return cls(torch.ops.headrace.q4_gemv_pack(q, d, m), q.shape[0])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[M, K] fp32 or bf16 -> [M, N] in x's dtype."""
        return torch.ops.headrace.q4_gemv(x, self.packed, bias, self.out_features)
