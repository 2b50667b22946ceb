"""A Linear layer that knows its weight format, converted once at load.

Formats (`Linear.pack(fmt)`):

```
float    F.linear in the parameter's dtype (fp32 or bf16): the reference, exact vs transformers
onednn   bf16 weight reordered once into oneDNN's blocked layout (AMX / AVX512-BF16 kernels);
         inputs are cast to bf16 per call and outputs back to the activation dtype
onednn_f32  fp32 weight in oneDNN's blocked layout: the same numbers as float through
         oneDNN's own fp32 GEMM, which beat MKL's F.linear by 1.14-1.24x on prompt rows on
         Zen 1 (AMD); chosen by a start-up timing (runner/format_timing.py)
amx_bf16 bf16 weight in AMX tiles for runner/cpu_ops/amx_gemm.cpp: the same products as
         onednn, with the output channels split evenly over the threads at every row
         count (oneDNN's split idled one of two cores at some prompt row counts). Chosen
         where a start-up timing (AMX CPUs only, runner/format_timing.py) finds the tiles
         faster at every prompt row count; where they win only up to some count, an onednn
         layer keeps them beside its weight for calls of up to `amx_rows` rows. A gated
         layer (an MLP's gate/up) there gives silu(gate) * up in one pass (`silu_mul`)
int8     per-output-channel symmetric int8 weight; activations quantised per token at run time;
         int8 x int8 products accumulate in int32, then both scales are applied in fp32
```

Beside any of them a layer may keep a weight-only int8 copy for calls with few rows
(`small_rows`, set by the platform after measuring): a decode step of a few dozen requests
reads every weight once, so half the bytes is nearly half the time; activations stay float.
The copy is laid out for one of two C++ kernels (runner/cpu_ops): "rows" (int8 rows, an
AVX-512/AVX2 GEMV for a handful of rows) or "amx" (16 x 32 tiles widened to bf16 for AMX's
tile multiply, for bf16 activations and up to a few dozen rows).
Without AMX a layer may also keep a `BatchedInt8` copy (runner/layers/batched_int8.py) for
calls of more than `small_rows` and at most `batched_rows` rows (a decode step of 8-64).
Where that copy serves every call a step can make (its rows reach the token budget), the
measurement frees the own format: the layer's format is then "batched" (`drop_own_format`).

The weights of the int8 and amx_bf16 formats and the few-row copy are classes of their own
(runner/layers/weight_formats.py); this module chooses among them per call.

The model code only builds `Linear`s; `pack_linears(model, fmt)` converts them all after the
weights are loaded, so the model definitions stay the same whatever the format.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runner.layers.batched_int8 import BatchedInt8
from runner.layers.q4_blocks import Q4Blocks, find_blocks
from runner.layers.weight_formats import (
    AmxBf16Weight,
    Int8Weight,
    SmallBatchInt8,
    default_int8_kernel,
)

FORMATS = ("float", "onednn", "onednn_f32", "amx_bf16", "int8")
# The formats whose weight oneDNN holds, by the dtype it was reordered in.
ONEDNN_DTYPES = {"onednn": torch.bfloat16, "onednn_f32": torch.float32}


class Linear(nn.Linear):
    """nn.Linear whose weight can be converted once to a faster format (see module doc)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        int8_inputs: bool = True,
        per_token: bool = True,
        gated: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias)
        # False where the inputs carry outlier channels that per-token int8 crushes: the
        # layer then keeps the float format when the rest of the model goes int8.
        self.int8_inputs = int8_inputs
        # False for a layer a prompt step calls with one row per sequence, not one per token
        # (the LM head): the start-up timing of prompt-row GEMMs leaves it out, and it keeps
        # no AMX tiles for prompt rows it never gets.
        self.per_token = per_token
        # True for an MLP's gate/up: its output is [gate, up] halves, read only as
        # silu(gate) * up (`silu_mul`), which the AMX tiles and batched int8 kernels give in one
        # pass.
        self.gated = gated
        self.format = "float"
        self._onednn: torch.Tensor | None = None
        self._onednn_bias: torch.Tensor | None = None
        self._int8: Int8Weight | None = None
        self._amx: AmxBf16Weight | None = None
        # An onednn layer's calls of <= amx_rows rows (past the int8 copies) take the tiles.
        self.amx_rows = 0
        # Weight-only int8 copy used for calls of <= small_rows rows.
        self._small: SmallBatchInt8 | None = None
        self.small_rows = 0
        # Batched int8 copy used for calls of small_rows < rows <= batched_rows.
        self._batched: BatchedInt8 | None = None
        self.batched_rows = 0
        # --deterministic: calls of fewer rows are padded to this many (runner/batch_invariance)
        self.min_rows = 0

    def pack(
        self,
        fmt: str,
        int8_kernel: str | None = None,
        reduce_range: bool = False,
        float_format: str = "float",
        small_batch_int8: str | None = None,
        batched_int8: str | None = None,
        amx_rows: int = 0,
    ) -> None:
        """Convert the weight to `fmt`; the float weight is dropped from this module.

        A layer built with `int8_inputs=False` takes `float_format` when asked for int8.
        `small_batch_int8` (a layout, see `SmallBatchInt8`) also keeps a weight-only int8
        copy, unused until `small_rows` > 0; `batched_int8` (a kernel, see `BatchedInt8`) a
        batched int8 copy, unused until `batched_rows` > 0. `amx_rows` > 0 keeps AMX tiles
        beside an onednn weight for calls of up to that many rows.
        """
        if fmt not in FORMATS:
            raise ValueError(f"weight format {fmt!r} is not one of {', '.join(FORMATS)}")
        if self.format != "float":
            raise RuntimeError(f"linear already packed as {self.format}")
        # The checkpoint's 4-bit blocks, found once for both copies that read them.
        blocks = find_blocks(self.weight.detach()) if small_batch_int8 or batched_int8 else None
        if small_batch_int8:
            self._small = SmallBatchInt8.from_weight(self.weight.detach(), small_batch_int8, blocks)
        if batched_int8:
            q, scale = Int8Weight.quantize_rows(self.weight.detach())
            self._batched = BatchedInt8.from_rows(q, scale, batched_int8)
            self._batched.q4 = Q4Blocks.from_blocks(blocks)
        if fmt == "int8" and not self.int8_inputs:
            fmt = float_format
        if fmt == "float":
            return
        w = self.weight.detach()
        if fmt in ONEDNN_DTYPES:
            # The format's dtype whatever the activations: inputs are cast per call.
            dtype = ONEDNN_DTYPES[fmt]
            self._onednn = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
            if self.bias is not None:
                self._onednn_bias = self.bias.detach().to(dtype)
            if fmt == "onednn" and amx_rows > 0 and self.per_token:
                self._amx = AmxBf16Weight.from_weight(w, self.bias)
                self.amx_rows = amx_rows
        elif fmt == "amx_bf16":
            self._amx = AmxBf16Weight.from_weight(w, self.bias)
        else:
            kernel = int8_kernel or default_int8_kernel()
            self._int8 = Int8Weight.quantize(w, kernel, reduce_range)
        # Tied weights (LM head = embedding) keep the embedding's own exact copy.
        self.weight = None  # type: ignore[assignment]
        self.format = fmt

    def float_weight(self) -> torch.Tensor | None:
        """The [N, K] weight as floats where the format keeps them (oneDNN's reordered copy
        read back in its dtype); None for int8, which kept only its integers."""
        if self.format in ONEDNN_DTYPES:
            assert self._onednn is not None
            return self._onednn.to_dense()
        if self._amx is not None:
            return self._amx.dense()
        return None if self.weight is None else self.weight.detach()

    @property
    def has_small_batch_int8(self) -> bool:
        return self._small is not None

    @property
    def small_batch_copy(self) -> SmallBatchInt8 | None:
        return self._small

    @property
    def small_batch_layout(self) -> str | None:
        return self._small.layout if self._small is not None else None

    def set_small_batch_int8(self, copy: SmallBatchInt8 | None) -> None:
        """Attach a weight-only int8 copy (of this layer's shape), or drop it with None."""
        if copy is not None and copy.out_features != self.out_features:
            raise ValueError(f"copy has {copy.out_features} outputs, layer {self.out_features}")
        self._small = copy
        if copy is None:
            self.small_rows = 0

    def drop_small_batch_int8(self) -> None:
        self.set_small_batch_int8(None)

    @property
    def batched_int8(self) -> BatchedInt8 | None:
        return self._batched

    def set_batched_int8(self, copy: BatchedInt8 | None) -> None:
        """Attach a batched int8 copy (of this layer's shape), or drop it with None."""
        if copy is not None and copy.out_features != self.out_features:
            raise ValueError(f"copy has {copy.out_features} outputs, layer {self.out_features}")
        if copy is None and self.format == "batched":
            raise RuntimeError("the batched copy is this layer's only weight")
        self._batched = copy
        if copy is None:
            self.batched_rows = 0

    def drop_own_format(self) -> None:
        """Free the own format's weight and let the batched copy serve every row count past
        the small copy: for a layer whose copy serves the step's whole token budget, the own
        format is dead weight (on Zen 1 SmolLM2's decoder in oneDNN fp32: 424 MB)."""
        if self._batched is None:
            raise RuntimeError("no batched copy to serve in the own format's place")
        self._onednn = self._onednn_bias = self._int8 = self._amx = None
        self.weight = None  # type: ignore[assignment]
        self.format = "batched"

    def kernel_for(self, rows: int) -> str:
        """What a call of `rows` rows runs on: "padded" (fewer than `min_rows`), "small" (the
        weight-only int8 copy), "batched" (the batched int8 copy, or the format), "amx_bf16"
        (the AMX tiles: up to `amx_rows`, or the format), else the format. The fused decoder
        stack (runner/models/fused_decode.py) follows the same choice."""
        if rows < self.min_rows:
            return "padded"
        if self._small is not None and rows <= self.small_rows:
            return "small"
        if self._batched is not None and rows <= self.batched_rows:
            return "batched"
        if self._amx is not None and (self.format == "amx_bf16" or rows <= self.amx_rows):
            return "amx_bf16"
        return self.format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        kernel = self.kernel_for(x2.shape[0])
        if kernel == "padded":  # the same kernel as larger calls: zero rows padded
            pad = x2.new_zeros(self.min_rows - x2.shape[0], x2.shape[1])
            y = self.forward(torch.cat([x2, pad]))[: x2.shape[0]]
            return y.view(*lead, y.shape[-1])
        if kernel == "small":
            assert self._small is not None
            y = self._small(x2, self.bias)
            return y.view(*lead, y.shape[-1])
        if kernel == "batched":
            assert self._batched is not None
            y = self._batched(x2, self.bias)
            return y.view(*lead, y.shape[-1])
        if kernel == "amx_bf16":
            assert self._amx is not None
            y = self._amx(x2).to(x.dtype)
            return y.view(*lead, y.shape[-1])
        if self.format == "float":
            return F.linear(x, self.weight, self.bias)
        if self.format in ONEDNN_DTYPES:
            assert self._onednn is not None
            y = torch.ops.mkldnn._linear_pointwise(
                x2.to(self._onednn.dtype), self._onednn, self._onednn_bias, "none", [], ""
            ).to(x.dtype)
        else:
            assert self._int8 is not None
            y = self._int8.matmul(x2)
            if self.bias is not None:
                y += self.bias
            y = y.to(x.dtype)
        return y.view(*lead, y.shape[-1])

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's output halves [..., 2I] -> [..., I] (the CPU ops'
        silu_and_mul): one pass where the call takes the AMX tiles or the batched int8 copy,
        else the two steps."""
        x2 = x.reshape(-1, x.shape[-1])
        amx, batched, kernel = self._amx, self._batched, self.kernel_for(x2.shape[0])
        if amx is not None and amx.fuses_silu_mul and kernel == "amx_bf16":
            y = amx.silu_mul(x2).to(x.dtype)
        elif (
            batched is not None
            and kernel == "batched"
            and self.bias is None
            and batched.fuses_silu_mul(x2.shape[0])
        ):
            y = batched.silu_mul(x2)
        else:
            y = torch.ops.headrace.silu_and_mul(self(x2))
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.format}"


def pack_linears(
    model: nn.Module,
    fmt: str,
    int8_kernel: str | None = None,
    reduce_range: bool = False,
    float_format: str = "float",
    small_batch_int8: str | None = None,
    batched_int8: str | None = None,
    amx_rows: int = 0,
) -> dict[str, int]:
    """Convert every `Linear` of `model` to `fmt`; returns how many took each format."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(
                fmt,
                int8_kernel,
                reduce_range,
                float_format,
                small_batch_int8,
                batched_int8,
                amx_rows,
            )
            counts[module.format] = counts.get(module.format, 0) + 1
    return counts


@dataclass(frozen=True, slots=True)
class LinearShape:
    """A weight shape of a model's linear layers and how many layers share it."""

    out_features: int
    in_features: int
    int8_inputs: bool
    count: int
    per_token: bool = True  # as Linear.per_token
    gated: bool = False  # as Linear.gated


def linear_shapes(model: nn.Module) -> list[LinearShape]:
    """The model's `Linear`s grouped by shape (works on a meta-device model: no weights)."""
    counts = Counter(
        (m.out_features, m.in_features, m.int8_inputs, m.per_token, m.gated)
        for m in model.modules()
        if isinstance(m, Linear)
    )
    return [LinearShape(o, i, q, n, t, g) for (o, i, q, t, g), n in counts.items()]
