"""The whole decoder stack as one C++ call for few-row decode steps (runner/models/fused_decode.py):
bit for bit the layer-by-layer forward, and only where that forward takes the same ops."""

from __future__ import annotations

import pytest
import torch

from runner import kv_format
from runner.attention_backends import CpuKernelAttentionBackend, TorchAttentionBackend
from runner.cpu_ops import load_cpu_ops
from runner.layers.batched_int8 import batched_kernels
from runner.layers.linear import Linear, pack_linears
from runner.layers.q4_blocks import (
    CHANNELS,
    Q4_GEMV,
    Q4_KERNEL,
    dequantize_blocks,
    q4_gemv_kernels,
    q4_kernels,
    quantize_blocks,
)
from runner.layers.weight_formats import onednn_bf16_available, onednn_f32_available
from runner.model_config import ModelConfig
from runner.models.decoder import DecoderForCausalLM
from runner.models.fused_decode import AMX, DENSE, DOT, ONEDNN, Q4, Q4_GEMV_KIND, ROWS, WIDEN

pytestmark = pytest.mark.skipif(load_cpu_ops() is not None, reason="CPU kernels did not build")

CPU = torch.device("cpu")
BLOCK = 16


def build(dtype: torch.dtype, head_dim: int = 64, bias: bool = False, qk_norm: bool = False,
          small_rows: int = 4, fmt: str = "float", layout: str = "rows",
          batched: str | None = None, grid4: bool = False) -> DecoderForCausalLM:  # fmt: skip
    torch.manual_seed(0)
    heads, kv = 4, 2
    cfg = ModelConfig("LlamaForCausalLM", 512, heads * head_dim, 320, 3, heads, kv, head_dim,
                      attention_bias=bias, qk_norm=qk_norm)  # fmt: skip
    model = DecoderForCausalLM(cfg, max_positions=256)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
        for layer in model.layers:
            layer.input_layernorm.weight.add_(1.0)
            layer.post_attention_layernorm.weight.add_(1.0)
        if grid4:  # as a Q4_1 GGUF's loader leaves the linears: on 4-bit blocks
            for m in model.modules():
                if isinstance(m, Linear):
                    m.weight.copy_(dequantize_blocks(*quantize_blocks(m.weight)))
    model = model.to(dtype)
    pack_linears(model, fmt, small_batch_int8=layout, batched_int8=batched)
    for m in model.modules():
        if isinstance(m, Linear):
            m.small_rows = small_rows if m.has_small_batch_int8 else 0
            m.batched_rows = 8 if m.batched_int8 is not None else 0
    model.set_attention_backend(CpuKernelAttentionBackend())
    return model


def caches(model: DecoderForCausalLM, dtype: torch.dtype) -> list[torch.Tensor]:
    """The model's caches of `dtype` rows (the model's dtype, or int8: kv_format's rows)."""
    cfg = model.config
    return kv_format.allocate(
        cfg.num_hidden_layers, 32, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype, CPU
    )


def step(model, kv, done: list[int], new: list[int], tables: list[list[int]]) -> torch.Tensor:
    backend = model.layers[0].self_attn.backend
    meta = backend.build_metadata(done, new, tables, BLOCK, CPU)
    positions = torch.cat([torch.arange(d, d + n) for d, n in zip(done, new)])
    ids = (positions * 7 + 3) % model.config.vocab_size
    with torch.no_grad():
        return model(ids, positions, kv, meta)


def prefilled(model, dtype, lens: list[int]) -> tuple[list[torch.Tensor], list[list[int]]]:
    kv = caches(model, dtype)  # dtype: the cache's
    tables = [[2 * i + 1, 2 * i + 2, 20 + i] for i in range(len(lens))]  # scattered blocks
    step(model, kv, [0] * len(lens), lens, tables)
    return kv, tables


def equal_steps(model: DecoderForCausalLM, dtype: torch.dtype, batch: int) -> list[int]:
    """Checks one decode step fused against the layer path; returns the kinds it ran.
    `dtype`: the KV cache's (the model's, or torch.int8)."""
    assert model.fused_decode is not None
    plan = model.fused_decode.plan(batch)
    assert plan is not None
    lens = [5 + 7 * i for i in range(batch)]  # most requests' keys cross a block boundary
    kv, tables = prefilled(model, dtype, lens)
    kv_ref = [c.clone() for c in kv]
    fused = step(model, kv, lens, [1] * batch, tables)
    saved, model.fused_decode = model.fused_decode, None
    ref = step(model, kv_ref, lens, [1] * batch, tables)
    model.fused_decode = saved
    assert torch.equal(fused, ref)
    assert all(torch.equal(a, b) for a, b in zip(kv, kv_ref))  # the same K/V written
    assert fused.abs().sum() > 0
    return sorted(set(plan[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,bias,batch", [(64, False, 1), (64, True, 3), (32, False, 4)])
def test_fused_decode_equals_the_layer_by_layer_forward(dtype, head_dim, bias, batch):
    assert equal_steps(build(dtype, head_dim, bias), dtype, batch) == [ROWS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_kv_cache_is_written_and_read_fused_too(dtype):
    # The fused step writes quantised rows and attends them as the layer path does.
    assert equal_steps(build(dtype), torch.int8, 3) == [ROWS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_past_the_int8_copies_take_the_float_weights_fused_too(dtype):
    assert equal_steps(build(dtype), dtype, 6) == [DENSE]


@pytest.mark.skipif(not onednn_bf16_available(), reason="no oneDNN bf16 on this CPU")
def test_onednn_weights_fused():
    model = build(torch.bfloat16, fmt="onednn")
    assert equal_steps(model, torch.bfloat16, 6) == [ONEDNN]
    assert equal_steps(model, torch.bfloat16, 2) == [ROWS]


@pytest.mark.skipif(not onednn_f32_available(), reason="this torch build has no oneDNN")
def test_onednn_f32_weights_fused():
    model = build(torch.float32, fmt="onednn_f32")
    assert equal_steps(model, torch.float32, 6) == [ONEDNN]


@pytest.mark.parametrize("kernel", ["dot", "widen"])
def test_batched_int8_copies_fused(kernel):
    if kernel not in batched_kernels():
        pytest.skip(f"this build has no {kernel!r} batched kernel")  # AVX2-only CPUs lack dot
    kinds = equal_steps(build(torch.bfloat16, batched=kernel), torch.bfloat16, 6)
    # Every layer takes the chosen kernel, the MLP's (int8_inputs False) too.
    assert kinds == ([DOT] if kernel == "dot" else [WIDEN])


@pytest.mark.skipif(Q4_KERNEL not in q4_kernels(), reason="no 4-bit kernel (AVX2) here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_4_bit_blocks_fused(dtype):
    model = build(dtype, batched="dot", grid4=True)
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.batched_int8]
    assert all(m.batched_int8.q4 is not None for m in linears)
    for m in linears:
        m.batched_int8.kernel = Q4_KERNEL
    # Every N here (512, 256, 640) is off the 24-channel blocks: the op takes N from the
    # model's shape, not from the padded blocks.
    assert all(m.out_features % CHANNELS for m in linears)
    assert equal_steps(model, dtype, 6) == [Q4]


@pytest.mark.skipif(Q4_GEMV not in q4_gemv_kernels(), reason="no few-row 4-bit kernel here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_small_copies_4_bit_blocks_fused(dtype):
    model = build(dtype, grid4=True)
    copies = [m.small_batch_copy for m in model.modules() if isinstance(m, Linear)]
    assert copies and all(c is not None and c.q4 is not None for c in copies)
    for c in copies:
        c.q4_rows = 2
    model.refresh_fused_decode()
    assert equal_steps(model, dtype, 2) == [Q4_GEMV_KIND]
    assert equal_steps(model, dtype, 3) == [ROWS]  # past q4_rows: the int8 weights


@pytest.mark.skipif(
    load_cpu_ops() is not None or not torch.ops.headrace.amx_usable(), reason="no AMX here"
)
def test_amx_int8_copies_fused():
    assert equal_steps(build(torch.bfloat16, layout="amx"), torch.bfloat16, 2) == [AMX]


def test_it_serves_only_few_row_decode_steps():
    model = build(torch.float32)
    calls = []
    fused = model.fused_decode

    class Spy:
        def takes(self, meta):
            return fused.takes(meta)

        def __call__(self, *args):
            calls.append(args[0].shape[0])
            return fused(*args)

    model.fused_decode = Spy()
    kv, tables = prefilled(model, torch.float32, [6] * 5)
    assert calls == []  # a prompt step takes the layers
    step(model, kv, [6] * 4, [1] * 4, tables[:4])
    assert calls == [4]
    step(model, kv, [7] * 5, [1] * 5, tables)  # past the int8 copies: float weights, fused
    step(model, kv, [8, 8], [1, 2], tables[:2])  # a mixed step
    assert calls == [4, 5]


def test_layers_that_take_other_kernels_keep_the_layer_path():
    assert build(torch.float32, qk_norm=True).fused_decode is None  # Qwen3's per-head norms
    model = build(torch.float32, fmt="int8")  # the dynamic int8 format: no fused kernel
    assert model.fused_decode.plan(2) is not None and model.fused_decode.plan(6) is None
    model = build(torch.float32)
    model.layers[1].mlp.down_proj.min_rows = 8  # --deterministic pads calls
    model.refresh_fused_decode()
    assert model.fused_decode.plan(1) is None
    model = build(torch.float32)
    model.set_attention_backend(TorchAttentionBackend())
    assert model.fused_decode is None
    model = build(torch.float32)
    # A module around a Linear (as LoRA's wrappers are) computes in Python: no fusing.
    model.layers[1].self_attn.o_proj = torch.nn.Sequential(model.layers[1].self_attn.o_proj)
    model.refresh_fused_decode()
    assert model.fused_decode is None


def test_bad_arguments_are_refused():
    model = build(torch.float32)
    weights, kinds = model.fused_decode.plan(1)
    kv = caches(model, torch.float32)
    with pytest.raises(RuntimeError, match="weights and 4 kinds per layer"):
        torch.ops.headrace.decode_layers(
            torch.zeros(1, 256), weights[:-1], kinds, kv, torch.zeros(1, 64), torch.zeros(1, 64),
            torch.zeros(1, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
            torch.ones(1, dtype=torch.long), 4, 2, 64, 320, 1e-6, 0.125,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="unknown linear kind 9"):
        torch.ops.headrace.decode_layers(
            torch.zeros(1, 256), weights, [9] * len(kinds), kv, torch.zeros(1, 64),
            torch.zeros(1, 64), torch.zeros(1, dtype=torch.long),
            torch.zeros(1, 3, dtype=torch.long), torch.ones(1, dtype=torch.long),
            4, 2, 64, 320, 1e-6, 0.125,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.headrace.decode_layers(
            torch.zeros(1, 256), weights, kinds, kv, torch.zeros(1, 64), torch.zeros(1, 64),
            torch.zeros(1, dtype=torch.long), torch.full((1, 3), 99, dtype=torch.long),
            torch.ones(1, dtype=torch.long), 4, 2, 64, 320, 1e-6, 0.125,
        )  # fmt: skip
