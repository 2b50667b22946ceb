"""Every decoder layer of a decode step as one C++ call (runner/cpu_ops/fused_decode.cpp).

A decode step at batch 1 reads ~135 MB of int8 weights (~5.5 ms on two cores) and spent
~3 ms more in the Python between a layer's dozen ops. `FusedDecode` hands the whole stack
to `torch.ops.headrace.decode_layers`, which calls the same ops in the same order, each
linear through the kernel its `Linear.forward` would pick for that many rows, so the output
equals the layer-by-layer forward's bit for bit. It applies only where that forward would
itself take those ops:

- the `cpu` attention backend (fused norms, RoPE, KV write, in-place decode attention);
- Llama-style layers without tensor parallelism or per-head QK norm, every linear a plain
  `Linear` (LoRA wrappers keep the layer path);
- a step of one query per request, in flattened order, for whose row count every linear
  (`Linear.kernel_for`) takes a kernel decode_layers has: the int8 "rows" or AMX copies
  or their 4-bit blocks, the batched int8 copy, oneDNN (bf16 or fp32) or float weights
  (rows padded for `--deterministic` and the dynamic int8 format keep the layer path).

The weights and kernel kinds for a row count are gathered once and kept (a step's lookup
is a dict hit); `DecoderForCausalLM.refresh_fused_decode` starts over after anything that
changes the layers' kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from runner.attention import AttentionMetadata
from runner.layers.linear import ONEDNN_DTYPES, Linear
from runner.layers.q4_blocks import Q4_GEMV, Q4_KERNEL
from runner.models.rope import RopeAt
from runner.step_interrupt import StepInterrupt, StepInterrupted

# decode_layers' linear kinds (fused_decode.cpp's Kind).
ROWS, AMX, DOT, WIDEN, ONEDNN, DENSE, Q4, AMX_BF16, Q4_GEMV_KIND = range(9)
_EMPTY = torch.empty(0)


def _slots(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    """A linear's three weight slots (None: an empty tensor, "no bias")."""
    out = [_EMPTY if t is None else t.detach() for t in tensors]
    return out + [_EMPTY] * (3 - len(out))


def linear_plan(m: nn.Module, rows: int) -> tuple[int, list[torch.Tensor]] | None:
    """(kind, slots) of the kernel `m.forward` takes for `rows` rows, or None where that is
    not one decode_layers calls."""
    if type(m) is not Linear:
        return None
    kernel = m.kernel_for(rows)
    if kernel == "small":
        small = m.small_batch_copy
        assert small is not None
        if small.kernel_for(rows) == Q4_GEMV:
            assert small.q4 is not None
            return Q4_GEMV_KIND, _slots(small.q4.packed, m.bias)
        return ROWS if small.layout == "rows" else AMX, _slots(small.weight, small.scale, m.bias)
    if kernel == "batched":
        b = m._batched
        assert b is not None
        kernel = b.kernel_for(rows)
        if kernel == Q4_KERNEL:
            assert b.q4 is not None
            return Q4, _slots(b.q4.packed, b.q4.scales, m.bias)
        return DOT if kernel == "dot" else WIDEN, _slots(b.packed, b.scale, m.bias)
    if kernel in ONEDNN_DTYPES:
        return ONEDNN, _slots(m._onednn, m._onednn_bias)
    if kernel == "amx_bf16":
        assert m._amx is not None
        return AMX_BF16, _slots(m._amx.tiles, m._amx.bias)
    if kernel == "float":
        return DENSE, _slots(m.weight, m.bias)
    return None  # padded calls and the dynamic int8 format keep the layer path


class FusedDecode:
    """The layers decode_layers runs, with the weights and kernel kinds gathered per row
    count (None where some linear takes a kernel it lacks)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        first = self.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.intermediate = self.layers[0].mlp.down_proj.in_features
        self.eps, self.scale = self.layers[0].input_layernorm.eps, first.scale
        self._plans: dict[int, tuple[list[torch.Tensor], list[int]] | None] = {}

    @classmethod
    def build(cls, layers: Sequence[nn.Module]) -> FusedDecode | None:
        """The fused stack for these decoder layers, or None where a layer does not qualify."""
        if not layers or not hasattr(torch.ops.headrace, "decode_layers"):
            return None
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if attn.tp is not None or attn.q_norm is not None or not all(n.fused for n in norms):
                return None
            if not (mlp.fused and attn.fused_rope and attn.backend.name == "cpu"):
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(type(m) is not Linear for m in linears):
                return None  # LoRA wrappers add their deltas in Python
            if any(m.bias is not None for m in linears[1:]):
                return None  # decode_layers passes no bias there (no Llama-family model has one)
        return cls(layers)

    def plan(self, rows: int) -> tuple[list[torch.Tensor], list[int]] | None:
        """decode_layers' weights and kinds for a step of `rows` rows (kept per row count)."""
        if rows not in self._plans:
            self._plans[rows] = self._gather(rows)
        return self._plans[rows]

    def _gather(self, rows: int) -> tuple[list[torch.Tensor], list[int]] | None:
        weights: list[torch.Tensor] = []
        kinds: list[int] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights += [layer.input_layernorm.weight.detach(),
                        layer.post_attention_layernorm.weight.detach()]  # fmt: skip
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                got = linear_plan(m, rows)
                if got is None:
                    return None
                kinds.append(got[0])
                weights += got[1]
        return weights, kinds

    def takes(self, meta: AttentionMetadata) -> bool:
        """Whether this step is one it serves: decode rows only, with a plan for their count."""
        if len(meta.groups) != 1:
            return False
        group = meta.groups[0]
        if not group.covers_all or group.token_index.shape[1] != 1:
            return False
        return self.plan(meta.num_tokens) is not None

    def __call__(
        self,
        x: torch.Tensor,
        rope: RopeAt,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        stop: StepInterrupt | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, hidden] embeddings -> (last layer's MLP output, residual stream). Raises
        StepInterrupted when `stop` is set before a layer."""
        plan = self.plan(meta.num_tokens)
        assert plan is not None, "takes() said no"
        group = meta.groups[0]
        out, residual = torch.ops.headrace.decode_layers(
            x.contiguous(),
            plan[0],
            plan[1],
            kv_caches,
            rope.cos.squeeze(1),
            rope.sin.squeeze(1),
            meta.slot_mapping,
            group.block_tables,
            group.seq_lens,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.intermediate,
            self.eps,
            self.scale,
            stop.flag if stop is not None else None,
        )
        if out.shape[0] != x.shape[0]:  # the op saw `stop` set and gave up the step
            raise StepInterrupted
        return out, residual
