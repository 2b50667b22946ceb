"""The few-row 4-bit GEMV (runner/cpu_ops/q4_gemv.cpp, `Q4Gemv` in runner/layers/q4_blocks.py):
the kernel against torch, a row's result whatever shares its call, the refusals, the
small-batch copy's choice between its blocks and its int8 weights, the start-up measurement's
decision, and the embedded SmolLM2's own Q4_1 weights reproduced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner.cpu_ops import load_cpu_ops
from runner.format_timing import measure_q4_rows
from runner.layers.linear import Linear, pack_linears
from runner.layers.q4_blocks import (
    Q4_GEMV,
    Q4Gemv,
    dequantize_blocks,
    find_blocks,
    q4_gemv_kernels,
    quantize_blocks,
)
from runner.layers.weight_formats import SmallBatchInt8

pytestmark = pytest.mark.skipif(
    load_cpu_ops() is not None or Q4_GEMV not in q4_gemv_kernels(),
    reason="no few-row 4-bit kernel here",
)


def on_grid(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A [n, k] weight as a Q4_1 GGUF's loader makes it: d * q + m per 32 inputs."""
    torch.manual_seed(seed)
    return dequantize_blocks(*quantize_blocks(torch.randn(n, k) * 0.05))


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float64: x rounded to int16 per row and 32 inputs (in
    fp32, as act_quant.h rounds: times 32767 / amax, to nearest even), d and m to fp16 (as
    the packed blocks keep them)."""
    q, d, m = quantize_blocks(w)
    weight = dequantize_blocks(q, d.half().float(), m.half().float()).double()
    groups = x.float().reshape(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))
    steps = (groups * inv).round().clamp(-32767, 32767).double()
    xq = steps * (amax / 32767).double()
    y = xq.reshape(x.shape) @ weight.T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_matches_torch(n, k, rows, dtype, bias):
    w = on_grid(n, k)
    copy = Q4Gemv.from_blocks(find_blocks(w))
    assert copy is not None and copy.packed.shape == (-(-n // 16), k // 32, 320)
    torch.manual_seed(1)
    x = torch.randn(rows, k).to(dtype)
    x[0, :32] = 0.0  # an all-zero group has scale 0, not a division by it
    b = torch.randn(n) if bias else None
    got = copy(x, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = reference(x, w, b)
    scale = want.abs().max().item()
    if dtype == torch.float32:  # fp32 sums over the groups
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * scale)
    else:  # the output rounded to bf16
        torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-3 * scale)


def test_a_rows_result_does_not_depend_on_what_shares_its_call():
    # Tiles of 2 rows take 2 blocks at a time, single rows 4: each row's sums still run in
    # the same order, so a stream's tokens do not change with the batch it lands in.
    w = on_grid(200, 576)
    copy = Q4Gemv.from_blocks(find_blocks(w))
    assert copy is not None
    x = torch.randn(5, 576)
    together = copy(x, None)
    for i in range(5):
        assert torch.equal(copy(x[i : i + 1], None), together[i : i + 1])


def test_bad_arguments_are_refused():
    q, d, m = quantize_blocks(on_grid(32, 64))
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        torch.ops.headrace.q4_gemv_pack(q[:, :48], d, m)
    with pytest.raises(RuntimeError, match=r"q must be in 0\.\.15"):
        torch.ops.headrace.q4_gemv_pack(q + 16, d, m)
    with pytest.raises(RuntimeError, match=r"d and m must be \[N, K/32\] fp32"):
        torch.ops.headrace.q4_gemv_pack(q, d[:, :1], m)
    packed = torch.ops.headrace.q4_gemv_pack(q, d, m)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        torch.ops.headrace.q4_gemv(torch.randn(1, 32), packed, None, 32)
    with pytest.raises(RuntimeError, match="n does not match"):
        torch.ops.headrace.q4_gemv(torch.randn(1, 64), packed, None, 33)
    with pytest.raises(RuntimeError, match="fp32 or bf16 inputs only"):
        torch.ops.headrace.q4_gemv(torch.randn(1, 64).half(), packed, None, 32)
    with pytest.raises(RuntimeError, match="one bias per output channel"):
        torch.ops.headrace.q4_gemv(torch.randn(1, 64), packed, torch.zeros(3), 32)


def test_blocks_are_kept_only_for_weights_on_the_grid_within_fp16():
    assert find_blocks(torch.randn(32, 64)) is None  # never 4-bit: no copy is a new rounding
    assert Q4Gemv.from_blocks(None) is None
    assert Q4Gemv.from_blocks(find_blocks(on_grid(32, 64) * 1e6)) is None  # d past fp16
    assert Q4Gemv.from_blocks(find_blocks(on_grid(32, 64).bfloat16())) is not None


def test_the_small_copy_serves_its_first_rows_from_the_blocks():
    w = on_grid(48, 64)
    copy = SmallBatchInt8.from_weight(w, "rows", find_blocks(w))
    assert copy.q4 is not None and copy.kernel_for(1) == "rows"  # q4_rows 0 until measured
    copy.q4_rows = 2
    assert [copy.kernel_for(r) for r in (1, 2, 3)] == [Q4_GEMV, Q4_GEMV, "rows"]
    x = torch.randn(3, 64)
    assert torch.equal(copy(x[:2], None), copy.q4(x[:2], None))
    int8 = torch.ops.headrace.int8_weight_linear(x, copy.weight, copy.scale, None)
    assert torch.equal(copy(x, None), int8)
    assert SmallBatchInt8.from_weight(w, "rows").q4 is None  # no blocks given: none kept


def test_an_int8_copy_the_blocks_cover_is_freed_and_the_output_stays():
    w = on_grid(48, 64)
    copy = SmallBatchInt8.from_weight(w, "rows", find_blocks(w))
    copy.q4_rows = 2
    assert copy.free_int8(4) == 0 and copy.weight is not None  # rows 3-4 still need it
    x = torch.randn(2, 64)
    before = copy(x, None)
    assert copy.free_int8(2) == 48 * 64 and copy.weight is None
    assert copy.kernel_for(2) == Q4_GEMV and torch.equal(copy(x, None), before)
    no_blocks = SmallBatchInt8.from_weight(torch.randn(48, 64), "rows")
    assert no_blocks.free_int8(1) == 0 and no_blocks.weight is not None


def test_the_platform_frees_the_int8_copies_its_blocks_cover():
    from runner.platform import _free_covered_int8

    model = _model_with_copies()  # small_rows 4
    for m in model:
        m.small_batch_copy.q4_rows = 2
    assert _free_covered_int8(model) == 0
    for m in model:
        m.small_batch_copy.q4_rows = 4
    assert _free_covered_int8(model) == 64 * 96 + 96 * 64
    x = torch.randn(3, 64)
    with torch.inference_mode():
        y = model(x)  # both layers on their blocks alone
    assert y.shape == (3, 64) and all(m.small_batch_copy.weight is None for m in model)


def _model_with_copies() -> torch.nn.Module:
    model = torch.nn.Sequential(Linear(64, 96, bias=False), Linear(96, 64, bias=False))
    with torch.no_grad():
        for i, m in enumerate(model):
            m.weight.copy_(on_grid(m.out_features, m.in_features, seed=i))
    pack_linears(model, "float", small_batch_int8="rows")
    for m in model:
        m.small_rows = 4
    return model


def test_the_measurement_keeps_the_blocks_only_where_they_win():
    model = _model_with_copies()
    # A margin nothing meets: the blocks go, the int8 copies stay.
    assert measure_q4_rows(model, torch.float32, margin=0.0) == 0
    assert all(m.small_batch_copy.q4 is None for m in model)
    assert all(m.small_batch_copy is not None for m in model)
    model = _model_with_copies()
    # One everything meets: every candidate up to the copies' own rows (4, not 8).
    assert measure_q4_rows(model, torch.float32, margin=1e9) == 4
    assert all(m.small_batch_copy.q4_rows == 4 for m in model)


def test_the_embedded_models_q4_1_weights_are_reproduced(smollm):
    # The embedded GGUF's decoder linears are Q4_1: the blocks are found in every one of them,
    # and the kernel gives what F.linear gives on the loader's floats, within int16
    # activations' rounding (~1e-4 of the output's scale). A misread nibble or scale is off
    # by a step d, far more.
    torch.manual_seed(0)
    layer = smollm.model.layers[3]
    for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
              layer.mlp.down_proj):  # fmt: skip
        w = m.weight.detach()
        copy = Q4Gemv.from_blocks(find_blocks(w))
        assert copy is not None, m
        x = torch.randn(1, m.in_features)
        want = F.linear(x, w)
        err = (copy(x, None) - want).abs().max() / want.abs().max()
        assert err < 1e-3, (m, err)
    assert find_blocks(smollm.model.lm_head.weight.detach()) is None  # Q8_0: int8 copy only
