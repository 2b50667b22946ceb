"""The 4-bit block linear (runner/cpu_ops/q4_linear.cpp, runner/layers/q4_blocks.py): the
kernel against torch for 1..64 rows, finding a GGUF's Q4_1 blocks again in its dequantised
floats (and only there), its place among the batched kernels, and SmolLM2's decode steps on
it."""

from __future__ import annotations

import copy
import dataclasses
import platform

import pytest
import torch
from act_rounding import round_groups

from runner.batched_rows import measure_batched_rows
from runner.cpu_ops import load_cpu_ops
from runner.layers.batched_int8 import FEW_ROW_ISAS, Q4_FALLBACK, BatchedInt8, batched_kernels
from runner.layers.linear import Linear, pack_linears
from runner.layers.q4_blocks import (
    Q4_KERNEL,
    Q4Blocks,
    dequantize_blocks,
    q4_kernels,
    quantize_blocks,
)
from runner.layers.weight_formats import Int8Weight
from runner.models.fused_decode import Q4
from scheduling import SamplingParams

pytestmark = pytest.mark.skipif(
    load_cpu_ops() is not None or Q4_KERNEL not in q4_kernels(), reason="no 4-bit kernel here"
)


def test_every_x86_build_has_it():
    # Every x86-64 build we make has AVX2 (maddubs), so it is one of the batched kernels.
    if platform.machine() == "x86_64":
        assert q4_kernels() == {"q4": "avx2_maddubs"}
        assert batched_kernels()["q4"] == "avx2_maddubs"


def on_grid(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A [n, k] weight as a Q4_1 GGUF's loader makes it: d * q + m per 32 inputs."""
    torch.manual_seed(seed)
    return dequantize_blocks(*quantize_blocks(torch.randn(n, k) * 0.05))


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, in float64: x rounded to int8 per row and 32 inputs."""
    xq, amax = round_groups(x.float().reshape(-1, 32), 127)
    y = (xq.double() * (amax.double() / 127)).reshape(x.shape) @ w.double().t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_matches_the_blocks_matmul(dtype):
    # Channels off the 24-channel blocks, one group and several, and a SmolLM2 shape.
    for n_dim, k_dim in ((70, 64), (24, 32), (33, 96), (192, 576)):
        w = on_grid(n_dim, k_dim)
        blocks = Q4Blocks.from_weight(w)
        assert blocks is not None and blocks.out_features == n_dim
        bias = torch.randn(n_dim)
        x = torch.randn(64, k_dim).to(dtype)
        x[5] = 0  # a zero row: scale 0, the output is the bias
        for rows in (*range(1, 14), 64):
            got = blocks(x[:rows], bias)
            assert got.dtype == dtype and got.shape == (rows, n_dim)
            want = reference(x[:rows].float(), w, bias)
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(got[5].float(), bias.to(dtype).float(), atol=tol, rtol=tol)
        # A row's answer is its own, whatever shares its batch (and bias is optional).
        assert torch.equal(blocks(x[:1], bias), got[:1])
        no_bias = blocks(x, None).double()
        torch.testing.assert_close(no_bias, want - bias.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kernel", [Q4_KERNEL, Q4_FALLBACK])
def test_prompt_sized_calls_cross_row_panels_and_keep_each_rows_answer(kernel):
    # 1536 inputs: a panel is 170 rows for q4 (int8 activations), fewer for dot (int16), so
    # 701 rows cross several panels, end in a partial one, and split between threads mid-panel.
    w = on_grid(70, 1536)
    x = torch.randn(701, 1536)
    q, scale = Int8Weight.quantize_rows(w)
    c = BatchedInt8.from_rows(q, scale, kernel)
    c.q4 = Q4Blocks.from_weight(w) if kernel == Q4_KERNEL else None
    got = c(x, None)
    for first, last in ((0, 1), (169, 171), (339, 345), (698, 701)):
        assert torch.equal(got[first:last], c(x[first:last], None)), (first, last)
    if kernel == Q4_KERNEL:
        torch.testing.assert_close(got.double(), reference(x, w, None), atol=2e-5, rtol=2e-5)


def test_it_errs_from_the_float_matmul_by_its_activation_rounding_only():
    # int8 activations per 32 inputs: ~1/127 of the answer at worst, well under it in norm.
    w = on_grid(192, 576)
    x = torch.randn(8, 576)
    exact = x.double() @ w.double().t()
    got = Q4Blocks.from_weight(w)(x, None).double()
    rel = ((got - exact).norm() / exact.norm()).item()
    assert 0 < rel < 2 / 127, rel


def test_the_blocks_are_found_again_only_on_a_4_bit_grid():
    w = on_grid(48, 64)
    q, d, m = quantize_blocks(w)
    assert q.dtype == torch.uint8 and int(q.max()) == 15 and int(q.min()) == 0
    torch.testing.assert_close(dequantize_blocks(q, d, m), w, atol=1e-7, rtol=1e-6)
    assert Q4Blocks.from_weight(w) is not None
    # The loader's floats rounded to bf16 are still the checkpoint's blocks.
    assert Q4Blocks.from_weight(w.bfloat16()) is not None
    # Weights that never were 4-bit are not made so; nor a width off the 32-input blocks.
    assert Q4Blocks.from_weight(torch.randn(48, 64)) is None
    assert Q4Blocks.from_weight(on_grid(48, 64)[:, :48]) is None
    # A block of equal values (d = 0) is on every grid.
    flat = w.clone()
    flat[0, :32] = 0.25
    blocks = Q4Blocks.from_weight(flat)
    assert blocks is not None
    torch.testing.assert_close(blocks(torch.ones(1, 64), None)[0, 0], flat[0].sum())


def test_pack_puts_two_inputs_in_a_byte():
    q = torch.randint(0, 16, (30, 32), dtype=torch.uint8)
    d, m = torch.rand(30, 1), torch.rand(30, 1)
    packed, scales = torch.ops.headrace.q4_pack(q, d, m)
    assert packed.shape == (2, 4, 24, 4) and scales.shape == (2, 1, 2, 24)
    padded = torch.zeros(48, 32, dtype=torch.uint8)
    padded[:30] = q
    steps = padded.view(2, 24, 4, 2, 4)  # block, channel, step pair, low/high, input
    want = steps[..., 0, :] | (steps[..., 1, :] << 4)
    assert torch.equal(packed, want.permute(0, 2, 1, 3))
    assert torch.equal(scales[0, 0, 0], d[:24, 0]) and torch.equal(scales[0, 0, 1], m[:24, 0])
    assert torch.equal(scales[1, 0, 0, :6], d[24:, 0]) and not scales[1, 0, :, 6:].any()


def test_bad_calls_are_refused():
    op, pack = torch.ops.headrace.q4_linear, torch.ops.headrace.q4_pack
    blocks = Q4Blocks.from_weight(on_grid(20, 64))
    assert blocks is not None
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        op(torch.zeros(1, 32), blocks.packed, blocks.scales, None, 20)
    with pytest.raises(RuntimeError, match="n does not match"):
        op(torch.zeros(1, 64), blocks.packed, blocks.scales, None, 200)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        op(torch.zeros(1, 64).half(), blocks.packed, blocks.scales, None, 20)
    with pytest.raises(RuntimeError, match="scales must come from q4_pack"):
        op(torch.zeros(1, 64), blocks.packed, blocks.scales[:, :1], None, 20)
    one = torch.ones(4, 1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        pack(torch.zeros(4, 48, dtype=torch.uint8), one, one)
    with pytest.raises(RuntimeError, match=r"0\.\.15"):
        pack(torch.full((4, 32), 16, dtype=torch.uint8), one, one)
    with pytest.raises(RuntimeError, match=r"\[N, K/32\]"):
        pack(torch.zeros(4, 64, dtype=torch.uint8), one, one)


def test_the_batched_copy_runs_the_blocks_or_else_dot():
    w = on_grid(40, 96)
    x = torch.randn(9, 96)
    q, scale = Int8Weight.quantize_rows(w)
    c = BatchedInt8.from_rows(q, scale, Q4_KERNEL)
    assert c.q4 is None  # from int8 rows alone: no blocks, so "q4" runs the fallback
    assert torch.equal(c(x, None), BatchedInt8.from_rows(q, scale, Q4_FALLBACK)(x, None))
    c.q4 = Q4Blocks.from_weight(w)
    assert torch.equal(c(x, None), c.q4(x, None))
    # A Linear packed with a batched copy keeps the blocks where its weight has them.
    on, off = Linear(96, 40), Linear(96, 40)
    with torch.no_grad():
        on.weight.copy_(w)
    for layer in (on, off):
        layer.pack("float", batched_int8="dot")
    assert on.batched_int8.q4 is not None and off.batched_int8.q4 is None


def test_the_measurement_offers_q4_only_where_some_layer_has_blocks(monkeypatch):
    import runner.batched_rows

    seen: list[tuple[str, ...]] = []
    monkeypatch.setattr(
        runner.batched_rows,
        "best_of_interleaved",
        lambda runs, reps: seen.append(tuple(runs)) or {p: 0.001 for p in runs},
    )
    model = torch.nn.Sequential(Linear(64, 32), Linear(32, 64))
    pack_linears(model, "float", batched_int8="dot")
    measure_batched_rows(model, torch.float32, candidates=(8,), reps=1)
    assert Q4_KERNEL not in seen[0]
    seen.clear()
    with torch.no_grad():
        model = torch.nn.Sequential(Linear(64, 32), Linear(32, 64))
        model[0].weight.copy_(on_grid(32, 64))
    pack_linears(model, "float", batched_int8="dot")
    measure_batched_rows(model, torch.float32, candidates=(8,), reps=1)
    assert Q4_KERNEL in seen[0]


def test_a_single_streams_rows_stay_on_an_exact_kernel(monkeypatch):
    import runner.batched_rows

    # q4 fastest at every count, dot faster than the small copy: q4 still serves only past
    # the copy's rows, which go to the copy or (where its activations are exact) dot.
    ms = {"own": 10.0, "small": 6.0, "dot": 5.0, "widen": 9.0, Q4_KERNEL: 2.0}
    monkeypatch.setattr(
        runner.batched_rows, "best_of_interleaved",
        lambda runs, reps: {p: ms[p] / 1e3 for p in runs},
    )  # fmt: skip
    layer = Linear(64, 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(on_grid(48, 64))
    layer.pack("float", small_batch_int8="rows", batched_int8="dot")
    layer.small_rows = 4
    choice = measure_batched_rows(torch.nn.Sequential(layer), torch.float32, reps=1)
    assert choice.kernel == Q4_KERNEL and choice.exact_rows == 4
    b = layer.batched_int8
    assert b.exact_rows == 4 and b.kernel_for(4) == Q4_FALLBACK and b.kernel_for(5) == Q4_KERNEL
    exact_dot = batched_kernels()[Q4_FALLBACK] in FEW_ROW_ISAS
    assert choice.small_rows == (0 if exact_dot else 4) == layer.small_rows
    x = torch.randn(5, 64)
    if exact_dot:  # one row: dot on the int8 copy; five: the blocks
        assert layer.kernel_for(1) == "batched"
        dot = torch.ops.headrace.batched_int8_linear(
            x[:1], b.packed, b.scale, None, 48, Q4_FALLBACK
        )
        assert torch.equal(layer(x[:1]), dot)
    assert torch.equal(layer(x), b.q4(x, None))
    # The copy's own rows are named only where dot serves them (its activations exact).
    assert ("dot" in choice.describe()) == exact_dot and "5-" in choice.describe()


def test_smollm2_decode_steps_run_its_own_4_bit_blocks(smollm, monkeypatch):
    from model_fixtures import engine_for, sixteen_chat_prompts

    prompts = sixteen_chat_prompts(smollm.tokenizer)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = [c.token_ids for c in engine_for(smollm).generate(prompts, params)]
    model = copy.deepcopy(smollm.model)
    pack_linears(model, "float", batched_int8="dot")
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.batched_int8]
    with_blocks = [m for m in layers if m.batched_int8.q4 is not None]
    # Every decoder linear of the Q4_1 GGUF is found on its grid (the LM head, the Q8_0
    # embedding, is not).
    assert len(with_blocks) == 4 * smollm.config.num_hidden_layers, len(with_blocks)
    for m in layers:
        m.batched_int8.kernel, m.batched_rows = Q4_KERNEL, 512
    calls: list[int] = []
    q4_call = Q4Blocks.__call__

    def counted(self, x, bias):
        calls.append(x.shape[0])
        return q4_call(self, x, bias)

    monkeypatch.setattr(Q4Blocks, "__call__", counted)
    fast = dataclasses.replace(smollm, model=model, platform=None)
    engine = engine_for(fast, max_num_seqs=16)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert max(calls) > 16  # the prompts went through the blocks
    # Decode steps run the layers as one C++ call, each decoder linear on its blocks.
    assert model.fused_decode is not None
    assert set(model.fused_decode.plan(16)[1]) == {Q4}
    # Sane greedy output: the answers start as the fp32 path's do.
    starts = [a[:3] == b[:3] for a, b in zip(ref, got)]
    assert sum(starts) >= 12, (ref, got)
    assert len(set(map(tuple, got))) > 4
