"""A Linear layer that knows its weight format, converted once at load.

Formats (`Linear.pack(fmt)`):

```
float    F.linear in the parameter's dtype (fp32 or bf16): the reference, exact vs transformers
onednn   bf16 weight reordered once into oneDNN's blocked layout (AMX / AVX512-BF16 kernels);
         inputs are cast to bf16 per call and outputs back to the activation dtype
int8     per-output-channel symmetric int8 weight; activations quantised per token at run time;
         int8 x int8 products accumulate in int32, then both scales are applied in fp32
```

The model code only builds `Linear`s; `pack_linears(model, fmt)` converts them all after the
weights are loaded, so the model definitions stay the same whatever the format.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FORMATS = ("float", "onednn", "int8")
INT8_KERNELS = ("fbgemm", "int_mm")


def onednn_bf16_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear and a bf16-capable CPU."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
        and bool(ops._is_mkldnn_bf16_supported())
    )


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

    @classmethod
    def quantize(cls, w: torch.Tensor, kernel: str, reduce_range: bool = False) -> Int8Weight:
        w = w.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [N]
        q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
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


class Linear(nn.Linear):
    """nn.Linear whose weight can be converted once to a faster format (see module doc)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, int8_inputs: bool = True
    ) -> None:
        super().__init__(in_features, out_features, bias)
        # False where the inputs carry outlier channels that per-token int8 crushes: the
        # layer then keeps the float format when the rest of the model goes int8.
        self.int8_inputs = int8_inputs
        self.format = "float"
        self._onednn: torch.Tensor | None = None
        self._onednn_bias: torch.Tensor | None = None
        self._int8: Int8Weight | None = None

    def pack(
        self,
        fmt: str,
        int8_kernel: str | None = None,
        reduce_range: bool = False,
        float_format: str = "float",
    ) -> None:
        """Convert the weight to `fmt`; the float weight is dropped from this module.

        A layer built with `int8_inputs=False` takes `float_format` when asked for int8.
        """
        if fmt not in FORMATS:
            raise ValueError(f"weight format {fmt!r} is not one of {', '.join(FORMATS)}")
        if self.format != "float":
            raise RuntimeError(f"linear already packed as {self.format}")
        if fmt == "int8" and not self.int8_inputs:
            fmt = float_format
        if fmt == "float":
            return
        w = self.weight.detach()
        if fmt == "onednn":
            # bf16 weights whatever the activations: inputs are cast per call.
            self._onednn = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), None)
            if self.bias is not None:
                self._onednn_bias = self.bias.detach().to(torch.bfloat16)
        else:
            kernel = int8_kernel or default_int8_kernel()
            self._int8 = Int8Weight.quantize(w, kernel, reduce_range)
        # Tied weights (LM head = embedding) keep the embedding's own exact copy.
        self.weight = None  # type: ignore[assignment]
        self.format = fmt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.format == "float":
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        if self.format == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(
                x2.to(torch.bfloat16), self._onednn, self._onednn_bias, "none", [], ""
            ).to(x.dtype)
        else:
            assert self._int8 is not None
            y = self._int8.matmul(x2)
            if self.bias is not None:
                y += self.bias
            y = y.to(x.dtype)
        return y.view(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.format}"


def pack_linears(
    model: nn.Module,
    fmt: str,
    int8_kernel: str | None = None,
    reduce_range: bool = False,
    float_format: str = "float",
) -> dict[str, int]:
    """Convert every `Linear` of `model` to `fmt`; returns how many took each format."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(fmt, int8_kernel, reduce_range, float_format)
            counts[module.format] = counts.get(module.format, 0) + 1
    return counts


@dataclass(frozen=True, slots=True)
class LinearShape:
    """A weight shape of a model's linear layers and how many layers share it."""

    out_features: int
    in_features: int
    int8_inputs: bool
    count: int


def linear_shapes(model: nn.Module) -> list[LinearShape]:
    """The model's `Linear`s grouped by shape (works on a meta-device model: no weights)."""
    counts = Counter(
        (m.out_features, m.in_features, m.int8_inputs)
        for m in model.modules()
        if isinstance(m, Linear)
    )
    return [LinearShape(o, i, q, n) for (o, i, q), n in counts.items()]
