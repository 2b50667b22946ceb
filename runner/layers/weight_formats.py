"""The weight formats a `Linear` keeps beside (or instead of) its float parameter.

`Int8Weight` (the "int8" format: int8 x int8 products through fbgemm or `torch._int_mm`),
`AmxBf16Weight` (the "amx_bf16" format: bf16 AMX tiles) and `SmallBatchInt8` (a weight-only
int8 copy for calls of few rows), with the probes that say which of torch's kernels this build
has. `runner/layers/linear.py` chooses among them per call; `BatchedInt8` and `Q4Blocks` live
in their own modules beside this one.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from runner.layers.q4_blocks import Q4_GEMV, Blocks, Q4Gemv

INT8_KERNELS = ("fbgemm", "int_mm")
SMALL_BATCH_LAYOUTS = ("rows", "amx")


def onednn_f32_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (fp32 needs no CPU feature)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def onednn_bf16_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear and a bf16-capable CPU."""
    return onednn_f32_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def fbgemm_available() -> bool:
    """fbgemm's dynamic int8 linear (deprecated in torch, so checked, never assumed)."""
    engines = torch.backends.quantized.supported_engines
    return hasattr(torch.ops.quantized, "linear_dynamic") and (
        "fbgemm" in engines or "x86" in engines
    )


def default_int8_kernel() -> str:
    return "fbgemm" if fbgemm_available() else "int_mm"


@dataclass(slots=True)
class Int8Weight:
    """A [N, K] weight as int8 rows with one fp32 scale per row (output channel)."""

    qweight: torch.Tensor  # [N, K] int8, |q| <= 127
    scale: torch.Tensor  # [N] fp32
    kernel: str
    # fbgemm's packed copy of the same numbers (kernel "fbgemm" only).
    packed: object = None
    # fbgemm without VNNI saturates int16 sums of u8 x s8 pairs: 7-bit activations avoid it.
    reduce_range: bool = False

    @staticmethod
    def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, K] float -> int8 rows and one fp32 scale per row (symmetric, |q| <= 127)."""
        w = w.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [N]
        return (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale

    @classmethod
    def quantize(cls, w: torch.Tensor, kernel: str, reduce_range: bool = False) -> Int8Weight:
        q, scale = cls.quantize_rows(w)
        packed = None
        if kernel == "fbgemm":
            with warnings.catch_warnings():
                # quantize_per_channel is deprecated; the layer falls back to int_mm when gone.
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(
                    q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
                )
                packed = torch.ops.quantized.linear_prepack(qw, None)
        elif kernel != "int_mm":
            raise ValueError(f"int8 kernel {kernel!r} is not one of {', '.join(INT8_KERNELS)}")
        return cls(q, scale, kernel, packed, reduce_range)

    @staticmethod
    def _pin_row(k: int) -> torch.Tensor:
        row = torch.zeros(1, k)
        row[0, 0], row[0, -1] = 1.0, -1.0
        return row

    def dequantized(self) -> torch.Tensor:
        """[N, K] fp32: the weight as the int8 kernels see it."""
        return self.qweight.float() * self.scale[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] float -> [M, N] fp32, with per-token activation scales."""
        x = x.float()
        # Per-token scale: each row is divided by its own max |x| (the fbgemm kernel then
        # quantises a batch whose rows all span [-1, 1], i.e. per token), and multiplied back.
        amax = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)  # [M, 1]
        if self.kernel == "fbgemm":
            # fbgemm picks one asymmetric grid from the batch's min and max; a last row
            # holding +1 and -1 pins that grid to [-1, 1], so a row's result does not depend
            # on what else shares its batch (the grid is then symmetric per token).
            xn = torch.cat([x / amax, self._pin_row(x.shape[1])])  # [M + 1, K]
            y = torch.ops.quantized.linear_dynamic(xn, self.packed, self.reduce_range)
            return y[:-1].mul_(amax)
        xq = (x * (127 / amax)).round_().to(torch.int8)  # [M, K]
        acc = torch._int_mm(xq, self.qweight.t())  # [M, N] int32
        return acc.float().mul_(amax / 127).mul_(self.scale)


@dataclass(slots=True)
class AmxBf16Weight:
    """A [N, K] weight as bf16 AMX tiles (amx_pack_bf16's layout) and an fp32 bias."""

    tiles: torch.Tensor  # [ceil(N/16), ceil(K/32), 512] bf16
    bias: torch.Tensor | None  # [N] fp32
    out_features: int
    in_features: int

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None) -> AmxBf16Weight:
        tiles = torch.ops.headrace.amx_pack_bf16(w.detach().to(torch.bfloat16))
        b = None if bias is None else bias.detach().float()
        return cls(tiles, b, w.shape[0], w.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] float -> [M, N] bf16 (inputs rounded to bf16, as oneDNN's bf16 format)."""
        return torch.ops.headrace.amx_bf16_linear(
            x.to(torch.bfloat16), self.tiles, self.bias, self.out_features
        )

    @property
    def fuses_silu_mul(self) -> bool:
        """Whether amx_bf16_silu_mul takes this weight: no bias, halves of whole tile pairs."""
        return self.bias is None and self.out_features % 32 == 0

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] float -> [M, N/2] bf16: silu(gate) * up of the output's halves, the same
        bits as this product then silu_and_mul."""
        return torch.ops.headrace.amx_bf16_silu_mul(
            x.to(torch.bfloat16), self.tiles, self.out_features
        )

    def dense(self) -> torch.Tensor:
        """[N, K] bf16: the tiles read back (tile rows hold 16 channels x 2 inputs)."""
        nt, kt, _ = self.tiles.shape
        w = self.tiles.view(nt, kt, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(nt * 16, kt * 32)
        return w[: self.out_features, : self.in_features].contiguous()


@dataclass(slots=True)
class SmallBatchInt8:
    """A weight-only int8 copy of a [N, K] weight (per-channel scales, activations stay
    float), laid out for the "rows" GEMV or the "amx" tile kernel; beside it, where the
    weight is on a 4-bit grid, the blocks for the 4-bit GEMV (`q4`), serving calls of up to
    `q4_rows` rows (measured: runner/format_timing.py)."""

    # [N, K] int8 ("rows") or [N/16, K/32, 512] int8 tiles ("amx"); None once freed, where
    # the blocks serve every row the copy is given (`free_int8`).
    weight: torch.Tensor | None
    scale: torch.Tensor  # [N] fp32
    out_features: int
    layout: str
    q4: Q4Gemv | None = None
    q4_rows: int = 0

    @classmethod
    def from_weight(
        cls, w: torch.Tensor, layout: str, blocks: Blocks | None = None
    ) -> SmallBatchInt8:
        """`blocks` (`find_blocks(w)`, found once by the caller) adds the 4-bit copy."""
        if layout not in SMALL_BATCH_LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {', '.join(SMALL_BATCH_LAYOUTS)}")
        q, scale = Int8Weight.quantize_rows(w)
        if layout == "amx":
            q = torch.ops.headrace.amx_pack_int8(q)
        return cls(q, scale, w.shape[0], layout, Q4Gemv.from_blocks(blocks))

    def kernel_for(self, rows: int) -> str:
        """The kernel a call of `rows` rows takes: the 4-bit GEMV ("q4_gemv") up to
        `q4_rows` rows or once the int8 weight is freed, else the layout's."""
        if self.q4 is not None and (rows <= self.q4_rows or self.weight is None):
            return Q4_GEMV
        return self.layout

    def free_int8(self, rows: int) -> int:
        """Free the int8 weight where the blocks serve all the `rows` rows the layer gives
        this copy (its `small_rows`); the bytes freed (0: kept)."""
        if self.q4 is None or self.weight is None or not 0 < rows <= self.q4_rows:
            return 0
        freed = self.weight.numel() * self.weight.element_size()
        self.weight = None
        return freed

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[M, K] fp32 or bf16 -> [M, N] in x's dtype."""
        kernel = self.kernel_for(x.shape[0])
        if kernel == Q4_GEMV:
            assert self.q4 is not None
            return self.q4(x, bias)
        assert self.weight is not None  # kernel_for takes the blocks once it is freed
        if kernel == "amx":
            return torch.ops.headrace.amx_int8_linear(
                x, self.weight, self.scale, bias, self.out_features
            )
        return torch.ops.headrace.int8_weight_linear(x, self.weight, self.scale, bias)
