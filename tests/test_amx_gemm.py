"""The bf16 AMX tile GEMM (runner/cpu_ops/amx_gemm.cpp) and the "amx_bf16" Linear format:
the op against the float product, the format's layer path and fused decode path, and the
platform's timed choice of it over oneDNN."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F
from test_fused_decode import build, equal_steps
from test_linear_formats import AMX, CPU, ZEN3

from runner.cpu_ops import load_cpu_ops
from runner.format_timing import AMX_GEMM_ROWS, amx_gemm_rows
from runner.layers.linear import Linear, LinearShape
from runner.layers.weight_formats import AmxBf16Weight, onednn_bf16_available
from runner.models.fused_decode import AMX_BF16
from runner.platform import select_platform

AMX_HERE = load_cpu_ops() is None and bool(torch.ops.headrace.amx_usable())
needs_amx = pytest.mark.skipif(not AMX_HERE, reason="no usable AMX here")


@contextlib.contextmanager
def two_threads():
    """The kernels' split of rows over threads depends on the count: pin the CI machine's."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_pack_lays_out_pair_interleaved_bf16_tiles():
    w = torch.randn(37, 70).bfloat16()
    tiles = torch.ops.headrace.amx_pack_bf16(w)
    assert tiles.shape == (3, 3, 512) and tiles.dtype == torch.bfloat16
    padded = torch.zeros(48, 96, dtype=torch.bfloat16)
    padded[:37, :70] = w
    # Tile (n, k), row p: channels n*16.. each with inputs k*32 + 2p and + 2p + 1.
    want = padded.view(3, 16, 3, 16, 2).permute(0, 2, 3, 1, 4).reshape(3, 3, 512)
    assert torch.equal(tiles, want)


def test_the_op_computes_the_bf16_product_or_says_why_not():
    op = torch.ops.headrace.amx_bf16_linear
    torch.manual_seed(2)
    # SmolLM2's shapes (K = 576 in one slice of inputs, 1536 in three), edges off the tile
    # grid, and one channel.
    for n_dim, k_dim in ((960, 576), (576, 1536), (70, 40), (1, 96)):
        w = torch.randn(n_dim, k_dim).bfloat16()
        bias = torch.randn(n_dim)
        tiles = torch.ops.headrace.amx_pack_bf16(w)
        if not AMX_HERE:
            with pytest.raises(RuntimeError, match="no usable AMX"):
                op(torch.zeros(1, k_dim, dtype=torch.bfloat16), tiles, bias, n_dim)
            continue
        # Ragged row tiles and 32-row steps; on two threads past 512 rows the threads split
        # the rows, not the channels (600: its second thread's share ends in a ragged tile).
        for rows in (1, 15, 16, 17, 33, 100, 300, 600):
            wide = torch.randn(rows, k_dim + 8).bfloat16()
            x = wide[:, 3 : 3 + k_dim]  # rows apart by more than K: read in place
            want = x.float() @ w.float().t() + bias
            with two_threads():
                got = op(x, tiles, bias, n_dim)
                assert torch.equal(op(x.contiguous(), tiles, bias, n_dim), got)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n_dim)
            torch.testing.assert_close(got.float(), want, atol=3e-2 * want.abs().max(), rtol=2e-2)
            # A row's answer is its own whatever shares its call and however it is split.
            assert torch.equal(op(x[:1], tiles, bias, n_dim), got[:1])
            assert torch.equal(op(x[-3:], tiles, bias, n_dim), got[-3:])
        no_bias = op(x, tiles, None, n_dim).float()
        torch.testing.assert_close(no_bias, (got.float() - bias), atol=0.1, rtol=2e-2)
        with pytest.raises(RuntimeError, match="columns, the tiles were packed for"):
            op(torch.zeros(1, k_dim + 32, dtype=torch.bfloat16), tiles, bias, n_dim)
        with pytest.raises(RuntimeError, match="n does not match"):
            op(x, tiles, bias, n_dim + 16)
        with pytest.raises(RuntimeError, match="x \\[M, K\\] bf16"):
            op(x.float(), tiles, bias, n_dim)


def test_silu_mul_is_the_product_then_silu_and_mul_bit_for_bit_or_says_why_not():
    op = torch.ops.headrace.amx_bf16_silu_mul
    torch.manual_seed(3)
    # SmolLM2's gate/up (2 x 1536 from 576) and a small one whose K is off the tile grid.
    for inter, k_dim in ((1536, 576), (48, 40)):
        w = torch.randn(2 * inter, k_dim).bfloat16()
        tiles = torch.ops.headrace.amx_pack_bf16(w)
        if not AMX_HERE:
            with pytest.raises(RuntimeError, match="no usable AMX"):
                op(torch.zeros(1, k_dim, dtype=torch.bfloat16), tiles, 2 * inter)
            continue
        for rows in (1, 17, 100, 600):  # 600: the rows split over two threads
            x = torch.randn(rows, k_dim).bfloat16()
            with two_threads():
                gate_up = torch.ops.headrace.amx_bf16_linear(x, tiles, None, 2 * inter)
                got = op(x, tiles, 2 * inter)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
            assert torch.equal(got, torch.ops.headrace.silu_and_mul(gate_up))
            gate, up = gate_up.float().split(inter, dim=1)
            torch.testing.assert_close(got.float(), F.silu(gate) * up, atol=2e-2, rtol=2e-2)
            assert torch.equal(op(x[-1:], tiles, 2 * inter), got[-1:])
    if not AMX_HERE:
        return
    # Gate channel p's up partner is tile p + n_tiles / 2 only where the halves are whole
    # pairs of tiles; the op says so rather than pair the wrong channels.
    tiles = torch.ops.headrace.amx_pack_bf16(torch.randn(48, 32).bfloat16())
    with pytest.raises(RuntimeError, match="must be a multiple of 32"):
        op(torch.zeros(2, 32, dtype=torch.bfloat16), tiles, 48)
    with pytest.raises(RuntimeError, match="n does not match"):
        op(torch.zeros(2, 32, dtype=torch.bfloat16), tiles, 64)


@needs_amx
@pytest.mark.skipif(not onednn_bf16_available(), reason="no oneDNN bf16 on this CPU")
def test_a_gated_layer_fuses_its_activation_where_its_call_takes_the_tiles():
    torch.manual_seed(0)
    layer = Linear(64, 128, bias=False, gated=True).to(torch.bfloat16)
    layer.pack("onednn", amx_rows=16)
    x = torch.randn(20, 64).bfloat16()
    calls = []
    own = layer._amx

    class Spy:
        tiles, bias, out_features, fuses_silu_mul = own.tiles, None, 128, True

        def silu_mul(self, rows):
            calls.append(rows.shape[0])
            return own.silu_mul(rows)

    layer._amx = Spy()
    fused = layer.silu_mul(x[:16])
    assert calls == [16] and fused.shape == (16, 64)
    assert torch.equal(fused, torch.ops.headrace.silu_and_mul(own(x[:16])))
    # 20 rows take oneDNN, then silu_and_mul; leading dimensions are kept either way.
    assert torch.equal(layer.silu_mul(x), torch.ops.headrace.silu_and_mul(layer(x)))
    assert torch.equal(layer.silu_mul(x.view(2, 10, 64)).view(20, 64), layer.silu_mul(x))
    assert torch.equal(layer.silu_mul(x[:16].view(2, 8, 64)).view(16, 64), fused)
    assert calls == [16, 16]
    # A bias, or halves that are not whole tile pairs: the two steps, whatever the rows.
    biased = Linear(64, 128, bias=True, gated=True).to(torch.bfloat16)
    biased.pack("amx_bf16")
    assert not biased._amx.fuses_silu_mul
    y = biased.silu_mul(x)
    assert torch.equal(y, torch.ops.headrace.silu_and_mul(biased(x)))
    odd = Linear(64, 80, bias=False, gated=True).to(torch.bfloat16)  # halves of 2.5 tiles
    odd.pack("amx_bf16")
    assert not odd._amx.fuses_silu_mul and odd.silu_mul(x).shape == (20, 40)


@needs_amx
def test_the_format_serves_its_rows_and_reads_its_weight_back():
    torch.manual_seed(0)
    ref = Linear(96, 160, bias=True)
    layer = Linear(96, 160, bias=True)
    layer.load_state_dict(ref.state_dict())
    layer.to(torch.bfloat16).pack("amx_bf16")
    assert layer.weight is None and layer.format == "amx_bf16"
    assert torch.equal(layer.float_weight(), ref.weight.bfloat16())  # read back exactly
    for rows in (1, 7, 130):
        x = torch.randn(2, rows, 96)
        y = layer(x)  # fp32 in, rounded to bf16 for the tiles, back to fp32
        assert y.shape == (2, rows, 160) and y.dtype == torch.float32
        want = torch.ops.headrace.amx_bf16_linear(
            x.reshape(-1, 96).bfloat16(), layer._amx.tiles, layer._amx.bias, 160
        )
        assert torch.equal(y.reshape(-1, 160), want.float())
        torch.testing.assert_close(y, ref(x), atol=5e-2, rtol=2e-2)


@needs_amx
@pytest.mark.skipif(not onednn_bf16_available(), reason="no oneDNN bf16 on this CPU")
def test_an_onednn_layer_keeps_the_tiles_for_its_first_rows():
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=True).to(torch.bfloat16)
    layer.pack("onednn", amx_rows=64)
    assert layer.format == "onednn" and layer.amx_rows == 64
    assert layer.kernel_for(64) == "amx_bf16" and layer.kernel_for(65) == "onednn"
    x = torch.randn(65, 96).bfloat16()
    tiles = torch.ops.headrace.amx_bf16_linear(x, layer._amx.tiles, layer._amx.bias, 160)
    calls = []
    own = layer._amx

    class Spy:
        tiles, bias = own.tiles, own.bias

        def __call__(self, rows):
            calls.append(rows.shape[0])
            return own(rows)

    layer._amx = Spy()
    assert torch.equal(layer(x[:64]), tiles[:64]) and calls == [64]
    torch.testing.assert_close(layer(x), tiles, atol=5e-2, rtol=2e-2)
    assert calls == [64]  # 65 rows went to oneDNN
    # Without amx_rows (or in another format) no tiles are kept.
    plain = Linear(96, 160).to(torch.bfloat16)
    plain.pack("onednn")
    assert plain._amx is None and plain.kernel_for(1000) == "onednn"
    # Nor in a layer called with one row per sequence (the LM head), whatever amx_rows says.
    head = Linear(96, 160, bias=False, per_token=False).to(torch.bfloat16)
    head.pack("onednn", amx_rows=64)
    assert head._amx is None and head.amx_rows == 0 and head.kernel_for(32) == "onednn"


@needs_amx
def test_amx_bf16_weights_fused():
    # Past the int8 copies' 4 rows the tiles serve, bit for bit the layer path's answer.
    assert equal_steps(build(torch.bfloat16, fmt="amx_bf16"), torch.bfloat16, 6) == [AMX_BF16]
    if not onednn_bf16_available():
        return
    # Tiles kept beside oneDNN's weight for up to 8 rows: 6 rows take them, fused too.
    model = build(torch.bfloat16, fmt="onednn")
    for m in model.modules():
        if isinstance(m, Linear):
            m._amx = AmxBf16Weight.from_weight(m.float_weight(), m.bias)
            m.amx_rows = 8
    assert equal_steps(model, torch.bfloat16, 6) == [AMX_BF16]


def test_bf16_linears_take_the_tiles_up_to_the_rows_where_they_timed_faster():
    asked = []

    def timed(rows: int):
        return lambda: asked.append(rows) or rows

    kw = dict(features=AMX, onednn_f32_faster=lambda: False)
    every = select_platform(CPU, "auto", "auto", amx_gemm_timing=timed(2048), **kw)
    some = select_platform(CPU, "auto", "auto", amx_gemm_timing=timed(512), **kw)
    none = select_platform(CPU, "auto", "auto", amx_gemm_timing=timed(0), **kw)
    if not (AMX_HERE and onednn_bf16_available()):
        # Without AMX kernels here the timing is never asked: oneDNN's bf16 or F.linear.
        assert asked == [] and every.weight_format != "amx_bf16" and every.amx_rows == 0
        return
    assert (every.dtype, every.weight_format, every.amx_rows) == (torch.bfloat16, "amx_bf16", 0)
    assert "bf16 linears -> AMX tiles (oneDNN not 5% faster at any row count)" in every.describe()
    assert (some.weight_format, some.amx_rows) == ("onednn", 512)
    assert "AMX tiles up to 512 rows, oneDNN past" in some.describe()
    assert (none.weight_format, none.amx_rows) == ("onednn", 0)
    assert "oneDNN (5% faster than the AMX tiles, in two timings)" in none.describe()
    # The exact path, --deterministic, fp32 models and CPUs without AMX never ask.
    select_platform(CPU, "auto", "none", amx_gemm_timing=timed(1), **kw)
    select_platform(CPU, "auto", "auto", deterministic=True, amx_gemm_timing=timed(1), **kw)
    select_platform(CPU, "float32", "auto", amx_gemm_timing=timed(1), **kw)
    select_platform(CPU, "auto", "auto", amx_gemm_timing=timed(1), **dict(kw, features=ZEN3))
    assert asked == [2048, 512, 0]


@needs_amx
@pytest.mark.skipif(not onednn_bf16_available(), reason="no oneDNN bf16 on this CPU")
def test_the_bf16_gemm_timing_stops_at_the_first_row_count_the_tiles_lose(caplog, monkeypatch):
    shapes = [
        LinearShape(48, 32, True, 2),
        LinearShape(64, 32, False, 1, gated=True),
        LinearShape(50_000, 32, True, 1, per_token=False),
    ]
    gated = []
    own = Linear.silu_mul
    monkeypatch.setattr(Linear, "silu_mul", lambda m, x: gated.append(m.format) or own(m, x))
    with caplog.at_level(logging.INFO, logger="headrace.platform"):
        rows = amx_gemm_rows(shapes, rows=(3, 40), reps=1)
    assert rows in (0, 3, 40)
    # The gate/up shape is timed with its activation, in both formats.
    assert {"onednn", "amx_bf16"} <= set(gated)
    lines = [r.getMessage() for r in caplog.records if "bf16 GEMM" in r.getMessage()]
    # One line per count timed, on the decoder's shapes only (the LM head's is left out).
    assert "2 layer shapes, 3 rows, timing 1" in lines[0] and "AMX tiles" in lines[0]
    timings = {n: sum(f"shapes, {n} rows," in line for line in lines) for n in (3, 40)}
    # A count oneDNN wins is timed a second time; one it wins twice ends the timing.
    if rows == 0:
        assert timings == {3: 2, 40: 0}
    else:
        assert timings[3] in (1, 2) and timings[40] in ((2,) if rows == 3 else (1, 2))
    # oneDNN never takes none of the tiles' time; it always takes less than 1e6 times it.
    assert amx_gemm_rows(shapes, rows=(3, 40), margin=0.0) == 40
    assert amx_gemm_rows(shapes, rows=(3, 40), margin=1e6) == 0


def test_one_slow_timing_does_not_send_a_row_count_to_onednn(monkeypatch):
    """A count oneDNN wins once is timed again; the best of both timings decides."""
    import runner.format_timing as ft

    timings = iter(
        [
            # first timing: the tiles win at 128, lose at 2048 (a slow first call)
            {("amx_bf16", 128): 1.0, ("onednn", 128): 2.0,
             ("amx_bf16", 2048): 3.0, ("onednn", 2048): 2.0},
            # the second timing of 2048 rows: the tiles win
            {("amx_bf16", 2048): 1.5, ("onednn", 2048): 2.1},
        ]
    )  # fmt: skip
    counts = []

    def scripted(shapes, formats, dtype, rows, reps, gated=False):
        counts.append(list(rows))
        return next(timings)

    monkeypatch.setattr(ft, "_own_format_totals", scripted)
    assert amx_gemm_rows(rows=(128, 2048)) == 2048
    assert counts == [[128, 2048], [2048]]

    # oneDNN winning both timings of a count takes it and every count past it.
    timings = iter(
        [
            {("amx_bf16", 128): 1.0, ("onednn", 128): 0.9,
             ("amx_bf16", 2048): 3.0, ("onednn", 2048): 2.0},
            {("amx_bf16", 128): 1.2, ("onednn", 128): 0.8},
        ]
    )  # fmt: skip
    counts.clear()
    assert amx_gemm_rows(rows=(128, 2048)) == 0
    assert counts == [[128, 2048], [128]]
    assert AMX_GEMM_ROWS[-1] == 2048  # up to the default step budget
