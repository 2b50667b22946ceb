"""Linear weight formats (float, oneDNN bf16 and fp32, int8) against an fp32 reference, and the
platform's choice of dtype and format from CPU flags injected here (every branch, any CPU).

Tolerances (relative Frobenius error of the layer output vs fp32):
- bf16 weights and activations: 1% (8-bit mantissa, fp32 accumulation);
- int8 per-channel weights x per-token int8 activations: 2.5%.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from runner.layers.linear import Linear, LinearShape, linear_shapes, pack_linears
from runner.layers.weight_formats import (
    INT8_KERNELS,
    fbgemm_available,
    onednn_bf16_available,
    onednn_f32_available,
)
from runner.loaders.gguf_loader import GGUFModel
from runner.model_source import resolve_model
from runner.platform import CpuFeatures, select_platform

BF16_TOL, INT8_TOL = 0.01, 0.025
CPU = torch.device("cpu")
AMX = CpuFeatures.from_flags({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni"})
ZEN3 = CpuFeatures.from_flags({"avx2", "fma"})


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def packed_copy(src: Linear, fmt: str, dtype=torch.float32, kernel=None) -> Linear:
    layer = Linear(src.in_features, src.out_features, bias=src.bias is not None)
    layer.load_state_dict(src.state_dict())
    # As the platform packs it: fbgemm without VNNI sums u8 x s8 pairs in int16 and would
    # saturate on full-range weights, so it gets 7-bit activations (reduce_range).
    reduce_range = fmt == "int8" and kernel == "fbgemm" and not CpuFeatures.detect().vnni
    layer.to(dtype).pack(fmt, kernel, reduce_range)
    return layer


@pytest.fixture(scope="module")
def real_weight() -> torch.Tensor:
    """The embedded model's first gate projection (a Q4_1 tensor, dequantised), [1536, 576]."""
    return GGUFModel(resolve_model(None).gguf_file)._tensor("blk.0.ffn_gate.weight")


def int8_kernels() -> list[str]:
    # fbgemm ships with torch on x86; it is deprecated, so it may go: int_mm then carries on.
    return [k for k in INT8_KERNELS if k != "fbgemm" or fbgemm_available()]


@pytest.mark.parametrize("kernel", int8_kernels())
@pytest.mark.parametrize("source", ["random", "real"])
def test_int8_linear_close_to_fp32(kernel, source, request):
    torch.manual_seed(0)
    if source == "real":
        w = request.getfixturevalue("real_weight")
        ref_layer = Linear(w.shape[1], w.shape[0], bias=False)
        ref_layer.weight.data = w.clone()
    else:
        ref_layer = Linear(96, 160, bias=True)
    x = torch.randn(7, 3, ref_layer.in_features)  # any leading shape
    ref = ref_layer(x)
    layer = packed_copy(ref_layer, "int8", kernel=kernel)
    assert layer.weight is None and layer.format == "int8"
    y = layer(x)
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert rel_err(y, ref) < INT8_TOL


@pytest.mark.parametrize("kernel", int8_kernels())
def test_int8_activation_scales_are_per_token(kernel):
    # A per-tensor scale would crush the small row next to a huge one; per token it keeps
    # its own resolution, so batching does not change a request's result much.
    torch.manual_seed(1)
    layer = packed_copy(Linear(64, 48, bias=False), "int8", kernel=kernel)
    small = torch.randn(1, 64) * 0.01
    huge = torch.randn(1, 64) * 1000
    alone = layer(small)
    batched = layer(torch.cat([small, huge]))[:1]
    assert rel_err(batched, alone) < 0.02
    assert rel_err(alone, small @ layer._int8.dequantized().t()) < INT8_TOL


@pytest.mark.parametrize("source", ["random", "real"])
def test_bf16_linear_close_to_fp32(source, request):
    torch.manual_seed(0)
    if source == "real":
        w = request.getfixturevalue("real_weight")
        ref_layer = Linear(w.shape[1], w.shape[0], bias=False)
        ref_layer.weight.data = w.clone()
    else:
        ref_layer = Linear(96, 160, bias=True)
    x = torch.randn(5, ref_layer.in_features)
    ref = ref_layer(x)
    # F.linear in bf16 runs on every CPU (slowly where bf16 is emulated).
    plain = packed_copy(ref_layer, "float", torch.bfloat16)
    assert rel_err(plain(x.bfloat16()), ref) < BF16_TOL
    if onednn_bf16_available():
        fast = packed_copy(ref_layer, "onednn", torch.bfloat16)
        y = fast(x.bfloat16())
        assert y.dtype == torch.bfloat16 and fast.weight is None
        assert rel_err(y, ref) < BF16_TOL
    else:
        # Without oneDNN bf16 the platform never asks for this format (tested below).
        p = select_platform(CPU, "bfloat16", "none", features=AMX)
        assert p.weight_format == "float"


@pytest.mark.skipif(not onednn_f32_available(), reason="this torch build has no oneDNN")
def test_onednn_f32_computes_what_float_does():
    torch.manual_seed(0)
    ref_layer = Linear(96, 160, bias=True)
    fast = packed_copy(ref_layer, "onednn_f32")
    assert fast.weight is None and fast._onednn.dtype == torch.float32
    assert torch.equal(fast.float_weight(), ref_layer.weight)  # read back exactly
    for rows in (1, 7, 130):  # one row, a few, a prompt chunk
        x = torch.randn(2, rows, 96)
        y, ref = fast(x), ref_layer(x)
        assert y.shape == ref.shape and y.dtype == torch.float32
        # The same fp32 products, summed in another order: rounding only.
        assert rel_err(y, ref) < 1e-5
    assert fast(torch.randn(3, 96, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_pack_checks_its_input():
    with pytest.raises(ValueError, match="weight format 'int4'"):
        Linear(4, 4).pack("int4")
    layer = Linear(4, 4)
    layer.pack("int8", "int_mm")
    with pytest.raises(RuntimeError, match="already packed"):
        layer.pack("int8")


def test_tied_lm_head_quantised_embedding_exact():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.head = Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    before = model.embed.weight.detach().clone()
    assert pack_linears(model, "int8", "int_mm") == {"int8": 1}
    assert torch.equal(model.embed.weight, before)  # the lookup stays exact
    assert model.head.weight is None
    x = torch.randn(3, 16)
    assert rel_err(model.head(x), x @ before.t()) < INT8_TOL


# -- the platform's choice ------------------------------------------------------------


@pytest.fixture
def no_batched_copy(monkeypatch):
    """The float format keeps no batched int8 copy (as in a build without the batched
    kernels), so quantization auto times int8 against it."""
    import runner.platform as platform

    copies = platform._float_copies
    monkeypatch.setattr(platform, "_float_copies", lambda *a: (copies(*a)[0], None))


def test_dtype_auto_follows_the_cpu_flags():
    amx = select_platform(CPU, "auto", "none", features=AMX)
    assert amx.dtype == torch.bfloat16
    assert amx.weight_format == ("onednn" if onednn_bf16_available() else "float")
    avx512_bf16 = CpuFeatures.from_flags({"avx2", "avx512f", "avx512_bf16"})
    assert select_platform(CPU, "auto", "none", features=avx512_bf16).dtype == torch.bfloat16
    zen3 = select_platform(CPU, "auto", "none", features=ZEN3)
    assert (zen3.dtype, zen3.weight_format) == (torch.float32, "float")
    assert "no native bf16" in zen3.describe()
    forced = select_platform(CPU, "float32", "none", features=AMX)
    assert (forced.dtype, forced.weight_format) == (torch.float32, "float")


@pytest.mark.skipif(not onednn_f32_available(), reason="this torch build has no oneDNN")
def test_fp32_linears_take_onednn_where_it_timed_faster(no_batched_copy):
    asked = []

    def timed(answer: bool):
        return lambda: asked.append(answer) or answer

    kw = dict(features=ZEN3)
    won = select_platform(CPU, "auto", "auto", onednn_f32_faster=timed(True), **kw)
    assert (won.dtype, won.weight_format, won.float_format) == (
        torch.float32, "onednn_f32", "onednn_f32"
    )  # fmt: skip
    assert "fp32 linears -> oneDNN" in won.describe()
    lost = select_platform(CPU, "auto", "auto", onednn_f32_faster=timed(False), **kw)
    assert lost.weight_format == "float" and "not at least 5% faster" in lost.describe()
    # The layers an int8 model leaves float take it too, where bf16 is not native.
    int8 = select_platform(CPU, "auto", "auto", True, int8_faster=lambda *a: True,
                           onednn_f32_faster=timed(True), **kw)  # fmt: skip
    assert (int8.weight_format, int8.float_format) == ("int8", "onednn_f32")
    assert asked == [True, False, True]
    # bf16 models, quantization none (the exact reference path) and --deterministic (batch
    # invariance measured on F.linear) never ask.
    select_platform(CPU, "bfloat16", "auto", onednn_f32_faster=timed(True), **kw)
    none = select_platform(CPU, "float32", "none", onednn_f32_faster=timed(True), **kw)
    kept = select_platform(
        CPU, "float32", "auto", deterministic=True, onednn_f32_faster=timed(True), **kw
    )
    assert none.weight_format == kept.weight_format == "float" and asked == [True, False, True]


@pytest.mark.skipif(not onednn_f32_available(), reason="this torch build has no oneDNN")
def test_the_fp32_gemm_timing_runs_both_paths_on_the_models_shapes(caplog):
    import logging

    from runner.format_timing import onednn_f32_beats_float

    with caplog.at_level(logging.INFO, logger="headrace.platform"):
        won = onednn_f32_beats_float([LinearShape(48, 32, True, 2)], rows=(3, 9), reps=1)
    assert isinstance(won, bool)
    line = next(r.getMessage() for r in caplog.records if "fp32 GEMM" in r.getMessage())
    assert "rows [3, 9]" in line and "oneDNN" in line and "MKL" in line
    # An impossible margin can never be met, a generous one always is.
    assert not onednn_f32_beats_float([LinearShape(48, 32, True, 1)], rows=(3,), margin=0.0)
    assert onednn_f32_beats_float([LinearShape(48, 32, True, 1)], rows=(3,), margin=1e6)


@pytest.mark.parametrize("features", [AMX, ZEN3], ids=["amx", "zen3"])
def test_quantization_auto_needs_a_quantised_file_and_a_win(features, no_batched_copy):
    def faster(answer: bool):
        return lambda dtype, fmt: answer

    kw = dict(features=features, onednn_f32_faster=lambda: False)
    p = select_platform(CPU, "auto", "auto", True, int8_faster=faster(True), **kw)
    assert p.weight_format == "int8" and p.int8_kernel in INT8_KERNELS
    # fbgemm without VNNI needs 7-bit activations (int16 saturation); with VNNI it does not.
    assert p.int8_reduce_range == (p.int8_kernel == "fbgemm" and not features.vnni)
    lost = select_platform(CPU, "auto", "auto", True, int8_faster=faster(False), **kw)
    assert lost.weight_format != "int8" and "not at least 10% faster" in lost.describe()
    plain_file = select_platform(CPU, "auto", "auto", False, int8_faster=faster(True), **kw)
    assert plain_file.weight_format != "int8" and "not quantised" in plain_file.describe()
    forced = select_platform(CPU, "float32", "int8", False, **kw)
    assert forced.weight_format == "int8" and forced.dtype == torch.float32
    # int8 keeps fp32 activations; the layers left float use bf16 only where it is native.
    assert p.dtype == torch.float32
    native = features.native_bf16 and onednn_bf16_available()
    assert p.float_format == ("onednn" if native else "float")
    assert select_platform(CPU, "auto", "none", True, **kw).weight_format != "int8"
    explicit = select_platform(CPU, "bfloat16", "auto", True, int8_faster=faster(True), **kw)
    assert (explicit.dtype, explicit.weight_format) == (torch.bfloat16, "int8")
    # Weight-only int8 copies for few-row calls are tried only for a quantised file under
    # auto whose weights stay float (prepare() then measures whether they pay off).
    assert lost.small_batch_int8 and not p.small_batch_int8
    assert not plain_file.small_batch_int8 and not forced.small_batch_int8
    assert not select_platform(CPU, "auto", "none", True, **kw).small_batch_int8
    # The GEMV takes fp32 or bf16 activations only.
    assert not select_platform(
        CPU, "float16", "auto", True, int8_faster=faster(False), **kw
    ).small_batch_int8
    # AMX tiles where the CPU has AMX and the model runs in bf16 (and this build can use it:
    # the flags of the CPU under test are injected, the kernel's own check is not).
    amx_here = torch.ops.headrace.amx_usable()
    want = "amx" if features.amx_bf16 and lost.dtype == torch.bfloat16 and amx_here else "rows"
    assert lost.small_batch_int8 == want
    fp32 = select_platform(CPU, "float32", "auto", True, int8_faster=faster(False), **kw)
    assert fp32.small_batch_int8 == "rows"


def test_cuda_platform_and_bad_names():
    cuda = select_platform(torch.device("cuda"), "auto", "auto", True)
    assert (cuda.name, cuda.dtype, cuda.weight_format) == ("CudaPlatform", torch.bfloat16, "float")
    with pytest.raises(ValueError, match="no CUDA kernels"):
        select_platform(torch.device("cuda"), "auto", "int8")
    with pytest.raises(ValueError, match="dtype: 'fp8'"):
        select_platform(CPU, "fp8", "none")
    with pytest.raises(ValueError, match="quantization: 'int4'"):
        select_platform(CPU, "auto", "int4")


def test_cpu_features_from_flags():
    assert AMX.native_bf16 and AMX.vnni and AMX.names() == "avx2+avx512+avx512_bf16+amx_bf16+vnni"
    assert not ZEN3.native_bf16 and ZEN3.names() == "avx2"
    assert CpuFeatures.detect().avx2 == ("avx2" in Path("/proc/cpuinfo").read_text())


def test_serve_options_reach_the_engine_config():
    from daemon.service.serve_config import parse_serve_args

    cfg = parse_serve_args(["--dtype", "bfloat16", "--quantization", "int8"], environ={})
    assert (cfg.engine.dtype, cfg.engine.quantization) == ("bfloat16", "int8")
    env = parse_serve_args([], environ={"HEADRACE_QUANTIZATION": "none"})
    assert env.engine.quantization == "none"


def test_int8_keeps_outlier_layers_in_the_float_format():
    layer = Linear(8, 8, bias=False, int8_inputs=False)
    layer.to(torch.bfloat16)
    layer.pack("int8", float_format="float")
    assert layer.format == "float" and layer.weight is not None


def test_int8_micro_benchmark_times_every_model_shape_against_its_margin():
    from runner.format_timing import int8_beats_float
    from runner.layers.linear import LinearShape

    model = nn.Sequential(Linear(32, 96, int8_inputs=True), Linear(96, 32, int8_inputs=False))
    model.append(Linear(32, 96))
    shapes = sorted(linear_shapes(model), key=lambda s: s.out_features)
    assert shapes == [LinearShape(32, 96, False, 1), LinearShape(96, 32, True, 2)]
    # A layer called with a row per sequence (an LM head) is a shape of its own.
    model.append(Linear(32, 96, per_token=False))
    assert LinearShape(96, 32, True, 1, per_token=False) in linear_shapes(model)
    kw = dict(dtype=torch.float32, float_format="float", int8_dtype=torch.float32)
    # int8 can never take no time at all, and always takes less than a thousand times float.
    assert not int8_beats_float(**kw, linears=shapes, margin=0.0)
    assert int8_beats_float(**kw, linears=shapes, margin=1000.0)


def test_int8_is_timed_against_the_float_format_with_the_copies_it_would_keep(monkeypatch):
    import runner.platform as platform
    from runner.cpu_ops import load_cpu_ops
    from runner.layers.batched_int8 import BatchedInt8, batched_kernels
    from runner.layers.linear import LinearShape
    from runner.layers.weight_formats import SmallBatchInt8

    if load_cpu_ops() is not None or "dot" not in batched_kernels():
        pytest.skip("needs the CPU kernels with the batched dot kernel")
    used = []

    def spy(cls):
        call = cls.__call__

        def counted(self, x, bias):
            used.append((cls.__name__, x.shape[0]))
            return call(self, x, bias)

        monkeypatch.setattr(cls, "__call__", counted)

    spy(SmallBatchInt8)
    spy(BatchedInt8)
    kw = dict(dtype=torch.float32, float_format="float", int8_dtype=torch.float32)
    platform.int8_beats_float(**kw, linears=[LinearShape(64, 64, True, 1)], reps=1,
                              small_layout="rows", batched_kernel="dot")  # fmt: skip
    # One row on the GEMV copy, 32 on the batched copy, as a decode step would run them.
    assert {("SmallBatchInt8", 1), ("BatchedInt8", 32)} <= set(used), set(used)

    # Where the float format keeps both copies, select_platform does not time int8 at all:
    # the timing would miss the fused decode step those copies serve.
    seen = []
    monkeypatch.setattr(platform, "int8_beats_float", lambda *a: seen.append(a[4:]) or True)
    feats = CpuFeatures(avx2=True, avx512=True, avx512_bf16=True, vnni=True)
    chosen = select_platform(
        torch.device("cpu"), "float32", "auto", True, features=feats, onednn_f32_faster=lambda: True
    )
    assert seen == []
    assert chosen.weight_format == "onednn_f32" and "int8 copies" in chosen.describe()
    assert chosen.small_batch_int8 == "rows" and chosen.batched_int8 == "dot"
    # With one copy only (the AMX layout, no batched kernel) int8 is still timed, and the
    # measurement gets that copy.
    monkeypatch.setattr(platform, "_float_copies", lambda *a: ("amx", None))
    timed = select_platform(torch.device("cpu"), "float32", "auto", True, features=feats,
                            onednn_f32_faster=lambda: True)  # fmt: skip
    assert seen == [("amx", None)] and timed.weight_format == "int8"
