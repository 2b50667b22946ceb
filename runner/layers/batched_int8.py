"""A weight-only int8 copy of a linear's weight for batches of a few dozen rows, without AMX.

The C++ kernel (runner/cpu_ops/batched_int8.cpp) reads the int8 weight once per call and
multiplies it into register tiles of several rows, one of two ways:

```
dot     activations quantised per row and per group of 32 inputs (dynamic scales), integer
        dot products in int32: int8 activations on AVX-512 VNNI and AVX-VNNI, int16 ones on
        AVX2 madd (which cannot saturate; as exact as weight-only int8)
widen   int8 weights widened in registers: bf16 pairs (AVX512-BF16) or fp32 FMA
```

Both read the same packed weight, so the kernel can be switched after packing: the start-up
measurement (runner/batched_rows.py) times the `AUTO_KERNELS` on the model's own layers and
keeps the fastest. A third, "q4", reads the checkpoint's 4-bit blocks where a layer has them
(runner/layers/q4_blocks.py, a copy beside the int8 one) and "dot" where it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.layers.q4_blocks import Q4_KERNEL, Q4Blocks, q4_kernels

BATCHED_KERNELS = ("dot", "widen")
# The kernels the start-up measurement may choose: all are within the +2% perplexity target
# on SmolLM2 (benchmarks/quality_int8.py; the per-layer figures are in docs/performance.md;
# "q4" as `auto` chose it on Zen 1: +0.30%). "dot" scales activations per group of 32
# inputs: per row, as it first did, an outlier channel coarsened the whole row and it cost
# +2.5%, so the MLP layers widened instead.
AUTO_KERNELS = ("dot", "widen", Q4_KERNEL)
# What "q4" runs on a layer without 4-bit blocks (the LM head of a Q8_0 embedding).
Q4_FALLBACK = "dot"
# The builds whose kernel multiplies activations as exactly as the small-batch copy (fp32, or
# int16 per group of 32 inputs): only these may take a single stream's rows from it. VNNI
# "dot" rounds activations to int8 and bf16 "widen" to 8 significant bits, within the target
# for batches, but with int8 activations at one row greedy SmolLM2 lost "Paris" (Zen 1).
FEW_ROW_ISAS = frozenset({"avx2_madd", "avx2_fma", "avx512_fma"})


def batched_kernels() -> dict[str, str]:
    """This build's kernels and the instructions each uses ({} where none, or no build)."""
    from runner.cpu_ops import kernel_isas  # cached: builds or loads the kernels once

    kernels = kernel_isas("batched_int8_kernels")
    if Q4_FALLBACK in kernels:
        kernels |= q4_kernels()
    return kernels


@dataclass(slots=True)
class BatchedInt8:
    """An [N, K] weight as int8 (per-output-channel fp32 scales) packed for the batched
    kernel."""

    packed: torch.Tensor  # [ceil(N/BN), ceil(K/4), BN, 4] int8
    scale: torch.Tensor  # [N] fp32
    out_features: int
    kernel: str
    # The checkpoint's 4-bit blocks, for kernel "q4" (None where the weight is not on them).
    q4: Q4Blocks | None = None
    # Under "q4", calls of at most this many rows run Q4_FALLBACK: a single stream's rows
    # stay on a kernel as exact as the small copy (runner/batched_rows.py sets it).
    exact_rows: int = 0

    @classmethod
    def from_rows(cls, q: torch.Tensor, scale: torch.Tensor, kernel: str) -> BatchedInt8:
        """From int8 rows and their scales (`Int8Weight.quantize_rows`)."""
        available = batched_kernels()
        if kernel not in available:
            raise ValueError(
                f"batched int8 kernel {kernel!r} is not in this build "
                f"(it has: {', '.join(available) or 'none'})"
            )
        packed = torch.ops.headrace.batched_int8_pack(q)
        return cls(packed, scale.float().contiguous(), q.shape[0], kernel)

    def kernel_for(self, rows: int) -> str:
        """The kernel a call of `rows` rows runs: "q4" only with blocks and past
        `exact_rows`, else Q4_FALLBACK in its place."""
        if self.kernel != Q4_KERNEL:
            return self.kernel
        return Q4_KERNEL if self.q4 is not None and rows > self.exact_rows else Q4_FALLBACK

    def fuses_silu_mul(self, rows: int) -> bool:
        """Whether batched_int8_silu_mul takes a call of `rows` rows (no bias assumed): the
        "dot" and "widen" kernels, halves of whole packed blocks."""
        block = self.packed.shape[2]
        return self.kernel_for(rows) in ("dot", "widen") and self.out_features % (2 * block) == 0

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] -> [M, N/2] in x's dtype: silu(gate) * up of the output's halves, the same
        bits as this product then silu_and_mul."""
        return torch.ops.headrace.batched_int8_silu_mul(
            x, self.packed, self.scale, self.out_features, self.kernel_for(x.shape[0])
        )

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[M, K] fp32 or bf16 -> [M, N] in x's dtype."""
        kernel = self.kernel_for(x.shape[0])
        if kernel == Q4_KERNEL:
            assert self.q4 is not None
            return self.q4(x, bias)
        return torch.ops.headrace.batched_int8_linear(
            x, self.packed, self.scale, bias, self.out_features, kernel
        )
