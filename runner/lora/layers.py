"""The one LoRA hook in the model: a wrapper around each adaptable Linear.

```
y = base(x)                                   # any weight format (float, onednn, int8, ...)
for each adapter segment of the step:         # rows that run one resident adapter
    y[rows] += x[rows] @ A[slot]^T @ B[slot]^T   # B carries the adapter's scale
```

Each wrapper holds every resident slot's weights stacked, `A [S, W, in]` and `B [S, out,
W]`, where W = max rank x the HF modules fused into this one (q, k and v share qkv_proj:
their A rows stack, their B is block-diagonal). `width[slot]` is how many of the W columns
the slot's adapter fills (0: it does not touch this module). With no adapter in the step
the wrapper costs one attribute read. For the C++ CPU kernel `B` is stored transposed,
`[S, W, out]`, and `b` is its transposed view: the expand reads `out` contiguous values
per rank column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runner.lora.adapter import LoRAAdapter, LoRABase
from runner.lora.batch import LoRABatch
from runner.lora.ops import add_lora


@dataclass(slots=True)
class LoRAContext:
    """Shared by every wrapper: the step's segments, or None when no row runs an adapter."""

    batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """A Linear plus the deltas of the resident adapters that this step's rows ask for."""

    def __init__(
        self,
        base: nn.Module,
        layer: int,
        parts: list[tuple[str, slice]],
        context: LoRAContext,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        transposed_b: bool = False,
    ) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        # (HF module name, its output rows in this module), in A/B column order.
        self.parts = parts
        self.context = context
        width = max_rank * len(parts)
        self.in_features, self.out_features = base.in_features, base.out_features
        # Plain attributes, not buffers: the model's state dict stays the base's.
        self.a = torch.zeros(max_loras, width, self.in_features, device=device, dtype=dtype)
        if transposed_b:
            bt = torch.zeros(max_loras, width, self.out_features, device=device, dtype=dtype)
            self.b = bt.transpose(1, 2)
        else:
            self.b = torch.zeros(max_loras, self.out_features, width, device=device, dtype=dtype)
        self.width = [0] * max_loras

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.context.batch
        if batch is None:
            return y
        return add_lora(y, x, self.a, self.b, self.width, batch)

    def load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter`'s pairs for this module into `slot` (zeros where it has none)."""
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        col = 0
        for name, rows in self.parts:
            pair = adapter.weights.get((self.layer, name))
            if pair is None:
                continue
            lora_a, lora_b = pair
            r = lora_a.shape[0]
            a[col : col + r].copy_(lora_a)
            b[rows, col : col + r].copy_(lora_b)
            col += r
        self.width[slot] = col


def install_lora(
    model: nn.Module,
    base: LoRABase,
    max_loras: int,
    max_rank: int,
    device: torch.device,
    dtype: torch.dtype,
    transposed_b: bool = False,
) -> tuple[LoRAContext, list[LoRALinear]]:
    """Wrap every adaptable Linear of `model` in place; returns the shared context and the
    wrappers. Call after the weights are loaded and packed (the wrapper reads `base`).
    `transposed_b`: store B as the C++ CPU kernel reads it."""
    context = LoRAContext()
    by_module: dict[str, list[tuple[str, slice]]] = {}
    for name, target in base.targets.items():
        by_module.setdefault(target.module, []).append((name, target.rows))
    wrappers = []
    for i, layer in enumerate(model.layers):
        for module, parts in by_module.items():
            parent_name, _, leaf = module.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            linear = getattr(parent, leaf)
            if isinstance(linear, LoRALinear):
                raise RuntimeError(f"layer {i} {module}: LoRA is installed already")
            parts = sorted(parts, key=lambda p: p[1].start)
            wrapper = LoRALinear(
                linear, i, parts, context, max_loras, max_rank, device, dtype, transposed_b
            )
            setattr(parent, leaf, wrapper)
            wrappers.append(wrapper)
    return context, wrappers
