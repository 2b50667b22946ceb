"""The batched int8 linears without AMX (runner/cpu_ops/batched_int8.cpp) against torch.

Both kernels of each build against the matmul of the dequantised weights, for 1..64 rows
and shapes off the vector and block grids; the layer's dispatch; an engine step of 16
requests on the embedded SmolLM2 (the start-up choice: tests/test_batched_rows.py). The
AVX2 builds (with and without AVX-VNNI) run the kernel tests again in a fresh process each.
"""

from __future__ import annotations

import copy
import dataclasses
import platform
import subprocess
import sys

import pytest
import torch
from act_rounding import round_groups

from runner.cpu_ops import load_cpu_ops
from runner.layers.batched_int8 import BatchedInt8, batched_kernels
from runner.layers.linear import Linear, pack_linears
from runner.layers.q4_blocks import Q4_KERNEL
from runner.layers.weight_formats import Int8Weight, SmallBatchInt8
from runner.models.fused_decode import DOT, WIDEN, FusedDecode
from runner.platform import read_cpu_flags
from scheduling import SamplingParams

X86 = platform.machine() == "x86_64"
# The largest activation integer of each "dot" build: madd multiplies int16 activations.
DOT_QMAX = {"avx512_vnni": 127, "avx_vnni": 127, "avx2_madd": 32767}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert load_cpu_ops() is None, "the CPU kernels did not build"


def kernels() -> list[str]:
    """The kernels of the int8 copy ("q4" reads 4-bit blocks: tests/test_q4_linear.py)."""
    found = sorted(k for k in batched_kernels() if k != Q4_KERNEL)
    if X86:  # every x86-64 build we make has AVX2 at least: both kernels
        assert found == ["dot", "widen"], batched_kernels()
    return found


def reference(kernel: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias):
    """What the kernel computes, in float64: for "dot" activations scaled per row and per
    group of 32 inputs to int8 (VNNI) or int16 (AVX2 madd); for "widen" the activations as
    the build multiplies them (bf16 pairs or fp32)."""
    xf = x.float()
    if kernel == "dot":
        qmax = DOT_QMAX[batched_kernels()["dot"]]
        y = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64)
        for k0 in range(0, x.shape[1], 32):
            xq, amax = round_groups(xf[:, k0 : k0 + 32], qmax)
            y += (xq.double() @ q[:, k0 : k0 + 32].double().t()) * (amax / qmax).double()
        y = y * scale.double()
    else:
        if batched_kernels()["widen"] == "avx512_bf16":
            xf = xf.bfloat16().float()
        y = xf.double() @ (q.double() * scale.double()[:, None]).t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_match_the_dequantised_matmul(dtype):
    torch.manual_seed(0)
    # Channels and inputs off the 16/64-channel blocks and the 4-input groups, and a
    # SmolLM2 shape.
    for n_dim, k_dim in ((70, 40), (33, 23), (192, 576)):
        w = torch.randn(n_dim, k_dim) * 0.05
        bias = torch.randn(n_dim)
        q, scale = Int8Weight.quantize_rows(w)
        copy = {k: BatchedInt8.from_rows(q, scale, k) for k in kernels()}
        x = torch.randn(64, k_dim).to(dtype)
        x[5] = 0  # a zero row: scale 0, the output is the bias
        for kernel, c in copy.items():
            for rows in range(1, 65):
                got = c(x[:rows], bias)
                assert got.dtype == dtype and got.shape == (rows, n_dim)
                want = reference(kernel, x[:rows], q, scale, bias).float()
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
            # A row's answer is its own, whatever shares its batch (and bias is optional).
            assert torch.equal(c(x[:1], bias), got[:1])
            torch.testing.assert_close(
                c(x, None).float(), (want - bias).float(), atol=tol, rtol=tol
            )


def test_dot_errs_from_weight_only_int8_by_its_activation_rounding_only():
    # int16 activations (AVX2 madd) leave the weight-only int8 answer to ~1e-5; int8 ones
    # (VNNI) to ~1e-3: the bound is 2 / the largest activation integer either way.
    torch.manual_seed(0)
    w = torch.randn(192, 576) * 0.05
    q, scale = Int8Weight.quantize_rows(w)
    x = torch.randn(8, 576)
    exact = x.double() @ (q.double() * scale.double()[:, None]).t()
    got = BatchedInt8.from_rows(q, scale, "dot")(x, None).double()
    rel = ((got - exact).norm() / exact.norm()).item()
    qmax = DOT_QMAX[batched_kernels()["dot"]]
    assert rel < 2 / qmax, (rel, batched_kernels())


def test_pack_lays_out_blocks_of_channels_by_four_inputs():
    bn = torch.ops.headrace.batched_int8_block()
    assert bn in (16, 64)
    q = torch.randint(-127, 128, (bn + 5, 10), dtype=torch.int8)
    packed = torch.ops.headrace.batched_int8_pack(q)
    assert packed.shape == (2, 3, bn, 4)
    padded = torch.zeros(2 * bn, 12, dtype=torch.int8)
    padded[: bn + 5, :10] = q
    assert torch.equal(packed, padded.view(2, bn, 3, 4).permute(0, 2, 1, 3))


def test_bad_calls_are_refused():
    op = torch.ops.headrace.batched_int8_linear
    q, scale = Int8Weight.quantize_rows(torch.randn(20, 16))
    c = BatchedInt8.from_rows(q, scale, kernels()[0])
    with pytest.raises(RuntimeError, match="the weight was packed for 16"):
        op(torch.zeros(1, 20), c.packed, c.scale, None, 20, "dot")
    with pytest.raises(RuntimeError, match="n does not match"):
        op(torch.zeros(1, 16), c.packed, c.scale, None, 200, "dot")
    with pytest.raises(RuntimeError, match="kernel 'amx' is not in this build"):
        op(torch.zeros(1, 16), c.packed, c.scale, None, 20, "amx")
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        op(torch.zeros(1, 16).half(), c.packed, c.scale, None, 20, "dot")
    gated = torch.ops.headrace.batched_int8_silu_mul
    with pytest.raises(RuntimeError, match="halves of whole blocks"):
        gated(torch.zeros(1, 16), c.packed, c.scale, 20, "dot")
    with pytest.raises(ValueError, match="'amx' is not in this build"):
        BatchedInt8.from_rows(q, scale, "amx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_calls_match_the_linear_then_silu_and_mul(dtype, monkeypatch):
    # gate/up's silu(gate) * up in the kernel's way out: the same bits as the two steps, for
    # a lone row, a ragged row tile, and rows past one panel; K off the 4-input grid.
    torch.manual_seed(3)
    block = torch.ops.headrace.batched_int8_block()
    n, k = 4 * block, 70
    q, scale = Int8Weight.quantize_rows(torch.randn(n, k))
    for kernel in kernels():
        c = BatchedInt8.from_rows(q, scale, kernel)
        assert c.fuses_silu_mul(8)
        for rows in (1, 7, 300):
            x = torch.randn(rows, k).to(dtype)
            got = torch.ops.headrace.batched_int8_silu_mul(x, c.packed, c.scale, n, kernel)
            want = torch.ops.headrace.silu_and_mul(c(x, None))
            assert got.dtype == dtype and got.shape == (rows, n // 2)
            assert torch.equal(got, want), (kernel, rows)
    # The layer takes it for a gated call on the batched copy, and gives the same bits.
    layer = Linear(k, n, bias=False, gated=True)
    layer.pack("float", batched_int8=kernels()[0])
    layer.batched_rows = 64
    fused = []
    real = BatchedInt8.silu_mul
    monkeypatch.setattr(BatchedInt8, "silu_mul", lambda self, x: fused.append(1) or real(self, x))
    x = torch.randn(2, 5, k)
    got = layer.silu_mul(x)
    assert fused and got.shape == (2, 5, n // 2)
    assert torch.equal(got, torch.ops.headrace.silu_and_mul(layer(x).view(10, n)).view(2, 5, -1))


def test_linear_takes_small_then_batched_then_its_own_format():
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack("float", small_batch_int8="rows", batched_int8="dot")
    layer.small_rows, layer.batched_rows = 2, 8
    assert layer.batched_int8 is not None and layer.batched_int8.kernel == "dot"
    small = SmallBatchInt8.from_weight(w, "rows")
    q, scale = Int8Weight.quantize_rows(w)
    batched = BatchedInt8.from_rows(q, scale, "dot")
    for rows, want in ((2, small), (3, batched), (8, batched), (9, None)):
        x = torch.randn(rows, 64)
        expect = torch.nn.functional.linear(x, w, b) if want is None else want(x, b)
        assert torch.equal(layer(x), expect), rows
    with pytest.raises(ValueError, match="copy has 48 outputs, layer 12"):
        Linear(64, 12).set_batched_int8(batched)
    # Its own format freed, the copy takes the rows past `batched_rows` too, and stays.
    layer.drop_own_format()
    assert layer.format == "batched" and layer.weight is None
    for rows, want in ((2, small), (9, batched), (40, batched)):
        x = torch.randn(rows, 64)
        assert torch.equal(layer(x), want(x, b)), rows
    with pytest.raises(RuntimeError, match="only weight"):
        layer.set_batched_int8(None)
    with pytest.raises(RuntimeError, match="no batched copy"):
        Linear(64, 12).drop_own_format()
    layer = Linear(64, 48, bias=True)
    layer.pack("float", batched_int8="dot")
    layer.set_batched_int8(None)
    assert layer.batched_rows == 0
    # Layers whose inputs carry outlier channels (the MLP's) take "dot" too: its scales are
    # per group of 32 inputs (next test).
    down = Linear(64, 48, int8_inputs=False)
    down.pack("float", batched_int8="dot")
    assert down.batched_int8 is not None and down.batched_int8.kernel == "dot"


def test_an_outlier_channel_coarsens_only_its_own_group_of_inputs():
    torch.manual_seed(0)
    n_dim, k_dim = 128, 576
    w = torch.randn(n_dim, k_dim) * 0.05
    q, scale = Int8Weight.quantize_rows(w)
    dot = BatchedInt8.from_rows(q, scale, "dot")
    x = torch.randn(16, k_dim)
    x[:, 7] = 60.0  # one outlier channel, as the MLP inputs of real models have
    exact = x.double() @ (q.double() * scale.double()[:, None]).t()  # int8 weights, float x
    amax = x.abs().amax(dim=1, keepdim=True)  # what one scale per row would give
    per_row = ((x * (127 / amax)).round().clamp(-127, 127) * (amax / 127)).double()
    per_row_err = (per_row @ (q.double() * scale.double()[:, None]).t() - exact).norm()
    dot_err = (dot(x, None).double() - exact).norm()
    # The outlier's group errs as the whole row did; the other 17 keep their own fine scales
    # (errors add in quadrature: ~sqrt(18) = 4x less).
    assert dot_err < per_row_err / 3, (dot_err, per_row_err)


def test_a_decode_step_of_16_requests_takes_the_batched_path(smollm, monkeypatch):
    from model_fixtures import engine_for, sixteen_chat_prompts

    prompts = sixteen_chat_prompts(smollm.tokenizer)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = [c.token_ids for c in engine_for(smollm).generate(prompts, params)]
    model = copy.deepcopy(smollm.model)
    pack_linears(model, "float", batched_int8="dot")
    for m in model.modules():
        if isinstance(m, Linear):
            m.batched_rows = 64
    rows: list[tuple[str, int]] = []
    call = BatchedInt8.__call__

    def counted(self, x, bias):
        rows.append((self.kernel, x.shape[0]))
        return call(self, x, bias)

    monkeypatch.setattr(BatchedInt8, "__call__", counted)
    # Decode-only steps run the layers as one C++ call (runner/models/fused_decode.py), which
    # takes each Linear's kernel from C++: their kinds are counted from its plan.
    fused_call = FusedDecode.__call__
    names = {DOT: "dot", WIDEN: "widen"}

    def fused_counted(self, x, rope, kv_caches, meta, stop=None):
        kinds = self.plan(meta.num_tokens)[1]
        rows.extend((names[k], x.shape[0]) for k in set(kinds) if k in names)
        return fused_call(self, x, rope, kv_caches, meta, stop)

    monkeypatch.setattr(FusedDecode, "__call__", fused_counted)
    fast = dataclasses.replace(smollm, model=model, platform=None)
    engine = engine_for(fast, max_num_seqs=16)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    # Decode steps of all 16 requests went through "dot", every layer (the MLP's too).
    assert ("dot", 16) in set(rows) and not any(k == "widen" for k, _ in rows), sorted(set(rows))
    # Sane greedy output: the answers start as the fp32 path's do.
    starts = [a[:3] == b[:3] for a, b in zip(ref, got)]
    assert sum(starts) >= 12, (ref, got)
    assert len(set(map(tuple, got))) > 4  # not one answer for every prompt


@pytest.mark.skipif(not X86, reason="AVX flags exist only on x86-64")
@pytest.mark.parametrize(
    "flags", ["-mno-avx512f", "-mno-avx512f -mno-avxvnni"], ids=["avx_vnni", "avx2_madd"]
)
def test_the_avx2_builds_pass_the_kernel_tests(isa_build, flags):
    if (built := isa_build(flags)) is None:
        return  # this CPU has nothing to narrow: the suite's own build is that one (checked)
    env, cache = built
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", __file__,
         "-k", "match_the or activation_rounding or pack_lays or refused or print_isa"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
    assert any(cache.glob("cpu_ops/*/built.ok"))  # the build it loaded
    # -march=native keeps AVX-VNNI only where the CPU has it (Sapphire Rapids, Zen 5; not
    # Zen 1-4): elsewhere both builds fall back to madd.
    has_vnni = "avx_vnni" in read_cpu_flags() and "avxvnni" not in flags
    want = "avx_vnni" if has_vnni else "avx2_madd"
    assert f"dot:{want}" in done.stdout and "widen:avx2_fma" in done.stdout


def test_print_isa():
    # Read by the AVX2 build tests above: which instructions this build's kernels use.
    print(" ".join(torch.ops.headrace.batched_int8_kernels()))
    assert kernels()
