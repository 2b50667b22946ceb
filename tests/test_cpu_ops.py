"""The C++ CPU kernels (runner/cpu_ops/) against the torch reference.

CI has g++ and ninja: the kernels must build there (a build failure fails these tests
rather than skipping them). The engine falls back to the reference only where they cannot
build, which `test_a_failed_build_falls_back_to_the_reference` shows.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
from attention_fixtures import scattered_tables

from runner.attention_backends import (
    CpuKernelAttentionBackend,
    TorchAttentionBackend,
    select_attention_backend,
)
from runner.cpu_ops import load_cpu_ops

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert load_cpu_ops() is None, "the CPU kernels did not build"


def _step(reqs, heads, kv_heads, head_dim, block_size, dtype, num_blocks=64):
    """One step (done, new) per request through both backends: (reference, kernel)."""
    torch.manual_seed(len(reqs) * 131 + heads)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    done, new = [d for d, _ in reqs], [n for _, n in reqs]
    tables = scattered_tables([d + n for d, n in reqs], block_size, num_blocks)
    q = torch.randn(sum(new), heads, head_dim).to(dtype)
    k = torch.randn(sum(new), kv_heads, head_dim).to(dtype)
    v = torch.randn(sum(new), kv_heads, head_dim).to(dtype)
    outs = []
    for backend in (TorchAttentionBackend(), CpuKernelAttentionBackend()):
        cache = kv.clone()
        meta = backend.build_metadata(done, new, tables, block_size, CPU)
        backend.write_kv(cache, k, v, meta)
        outs.append(backend.forward(q, cache, meta, head_dim**-0.5))
    return outs


# (heads, kv_heads, head_dim, block_size): SmolLM2 (9/3, 64), a Llama-1B head (32/8, 64),
# a 128-wide head, a width with no vector path (the generic loop), and blocks of 6 tokens
# (decode reads a block in pieces of 4: a piece of 2 ends each block).
SHAPES = [(9, 3, 64, 16), (32, 8, 64, 32), (8, 2, 128, 16), (6, 3, 24, 16), (9, 3, 64, 6)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_rows_match_the_reference(heads, kv_heads, head_dim, block_size, dtype):
    # Decode-only step: lengths 1, one block exactly, odd block counts, a longer context.
    reqs = [(0, 1), (block_size - 1, 1), (2 * block_size, 1), (37, 1), (300, 1)]
    want, got = _step(reqs, heads, kv_heads, head_dim, block_size, dtype, num_blocks=64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_chunks_match_the_reference(heads, kv_heads, head_dim, block_size, dtype):
    # Whole prompts and chunks after a cached prefix, of lengths around the kernel's 16-row
    # and 32-key tiles, beside a decode row. bf16 with head dims of 32k goes through the AMX
    # kernel where the CPU has AMX (fp32 and other widths: the reference).
    reqs = [(0, 40), (0, 100), (50, 37), (3, 1), (0, 17), (129, 64)]
    want, got = _step(reqs, heads, kv_heads, head_dim, block_size, dtype, num_blocks=128)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert CpuKernelAttentionBackend().amx == torch.ops.headrace.amx_usable()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_contexts_match_the_reference(dtype):
    # A 600-token prompt and a chunk after 700 cached keys: mostly key chunks every row sees
    # whole (the AMX kernel's unmasked softmax); a decode row past 512 keys (splits merged),
    # whose bf16 scores come from bf16 pair products (vdpbf16ps) where the CPU has them.
    reqs = [(0, 600), (700, 48), (1100, 1), (515, 1)]
    want, got = _step(reqs, 9, 3, 64, 16, dtype, num_blocks=192)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_prefill_kernel_refuses_what_it_cannot_do():
    op = torch.ops.headrace.paged_prefill_attention_
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    kv = torch.zeros(2, 4, 16, 1, 64, dtype=torch.bfloat16)
    one = torch.ones(1, dtype=torch.long)
    args = (kv, one.view(1, 1) * 0, one * 4, one * 0, one * 4, 0.125)
    if not torch.ops.headrace.amx_usable():
        with pytest.raises(RuntimeError, match="no usable AMX"):
            op(torch.empty_like(q), q, *args)
        return
    with pytest.raises(RuntimeError, match="bf16 q and out"):
        op(torch.empty_like(q.float()), q.float(), *args)
    with pytest.raises(RuntimeError, match="query rows out of range"):
        op(torch.empty_like(q), q, kv, one.view(1, 1) * 0, one * 4, one * 2, one * 4, 0.125)
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(torch.empty_like(q), q, kv, one.view(1, 1) * 9, one * 4, one * 0, one * 4, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_step_matches_the_reference(dtype):
    # Prompt chunks (after a cached prefix too) beside decode rows: the decode rows go
    # through the decode kernel and are scattered back between the chunk rows.
    reqs = [(0, 7), (20, 1), (33, 1), (16, 5), (0, 1), (45, 1)]
    want, got = _step(reqs, 9, 3, 64, 16, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_row_does_not_depend_on_its_batch():
    # Batch invariance: one request's output is bit-identical alone and among others.
    torch.manual_seed(0)
    kv = torch.randn(2, 32, 16, 3, 64)
    q = torch.randn(4, 9, 64)
    tables = torch.arange(32).view(4, 8)
    lens = torch.tensor([100, 7, 128, 33])
    op = torch.ops.headrace.paged_decode_attention
    together = op(q, kv, tables, lens, 0.125)
    for i in range(4):
        alone = op(q[i : i + 1], kv, tables[i : i + 1], lens[i : i + 1], 0.125)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 16), (64, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_contexts_are_attended_in_splits_that_merge_exactly(head_dim, block_size, dtype):
    # Past 512 keys a request's context is cut into splits of whole blocks, attended as units
    # of their own and merged: lengths on both sides of a split and of a block, beside short
    # rows, against the reference; and each row alone equals it in the batch, bit for bit
    # (the splits follow a row's own length, never the batch's).
    torch.manual_seed(head_dim + block_size)
    lens = [1, 512, 513, 700, 1100, 2049]
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    tables = scattered_tables(lens, block_size, num_blocks)
    kv = torch.randn(2, num_blocks, block_size, 3, head_dim).to(dtype)
    q = torch.randn(len(lens), 9, head_dim).to(dtype)
    meta = TorchAttentionBackend().build_metadata(
        [n - 1 for n in lens], [1] * len(lens), tables, block_size, CPU
    )
    want = TorchAttentionBackend().forward(q.float(), kv.float(), meta, head_dim**-0.5)
    (rows,) = meta.groups  # one decode group, in order: its padded tables and lengths
    padded, lengths = rows.block_tables, rows.seq_lens
    op = torch.ops.headrace.paged_decode_attention
    got = op(q, kv, padded, lengths, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    for i in range(len(lens)):
        alone = op(q[i : i + 1], kv, padded[i : i + 1], lengths[i : i + 1], head_dim**-0.5)
        assert torch.equal(alone[0], got[i])


def test_threads_share_the_keys_not_the_rows():
    # One long context beside short rows: each thread takes a run of work items holding an
    # even share of the keys, so the runs' cuts move with the thread count. Every count must
    # attend every row once, the same bits, and match the reference.
    torch.manual_seed(7)
    lens = [2100, 40, 3, 40, 1300, 17, 40, 40]
    num_blocks = sum(-(-n // 16) for n in lens) + 3
    tables = scattered_tables(lens, 16, num_blocks)
    kv = torch.randn(2, num_blocks, 16, 3, 64).to(torch.bfloat16)
    q = torch.randn(len(lens), 9, 64).to(torch.bfloat16)
    meta = TorchAttentionBackend().build_metadata(
        [n - 1 for n in lens], [1] * len(lens), tables, 16, CPU
    )
    want = TorchAttentionBackend().forward(q.float(), kv.float(), meta, 0.125)
    (rows,) = meta.groups
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            outs.append(torch.ops.headrace.paged_decode_attention(
                q, kv, rows.block_tables, rows.seq_lens, 0.125))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0].float(), want, atol=2e-2, rtol=2e-2)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_prompt_chunks_are_the_same_bits_at_every_thread_count():
    # A chunk after a long cached prefix beside short prompts: the prompt kernel packs each
    # (request, KV head)'s keys in runs cut by their length and attends tiles in runs cut by
    # their causal work, so the cuts move with the thread count; no row may move with them.
    reqs = [(1200, 40), (0, 17), (0, 3), (5, 20), (0, 1)]
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            outs.append(_step(reqs, 9, 3, 64, 16, torch.bfloat16, num_blocks=96))
    finally:
        torch.set_num_threads(threads)
    want, got = outs[0]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    for _, other in outs[1:]:
        assert torch.equal(other, got)


def test_bad_tables_and_lengths_are_refused_not_read():
    kv = torch.zeros(2, 4, 16, 3, 64)
    q = torch.zeros(1, 9, 64)
    op = torch.ops.headrace.paged_decode_attention
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(q, kv, torch.tensor([[7]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="seq_lens out of range"):
        op(q, kv, torch.tensor([[0]]), torch.tensor([17]), 1.0)
    with pytest.raises(RuntimeError, match="must have q's dtype, or be int8"):
        op(q.bfloat16(), kv, torch.tensor([[0]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(q, kv.transpose(2, 3), torch.tensor([[0]]), torch.tensor([5]), 1.0)


def test_backend_choice():
    assert select_attention_backend(CPU, 3).name == "cpu"
    assert select_attention_backend(CPU, 3, "cpu").name == "cpu"
    assert select_attention_backend(CPU, 3, "torch").name == "torch"
    with pytest.raises(ValueError, match="'cpu' runs on the CPU"):
        select_attention_backend(torch.device("cuda"), 3, "cpu")


def test_every_source_and_header_is_built_and_keys_the_build():
    # A header missing from the key (tile_driver.h was) lets an edit load a stale library.
    from pathlib import Path

    from runner import cpu_ops

    here = Path(cpu_ops.__file__).parent
    assert set(cpu_ops.SOURCES) == {p.name for p in here.glob("*.cpp")}
    assert set(cpu_ops.HEADERS) == {p.name for p in here.glob("*.h")}
    assert "tile_driver.h" in cpu_ops.HEADERS


def test_a_failed_build_falls_back_to_the_reference(monkeypatch, tmp_path, caplog):
    import runner.cpu_ops as cpu_ops

    # A fresh build directory and a compiler that does not exist: the build fails and says
    # why; auto then keeps the reference, and asking for the kernels by name is an error.
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    reason = cpu_ops.build_and_load(tmp_path / "0123456789abcdef")
    assert reason is not None
    assert "CPU kernels unavailable" in caplog.text
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda: reason)
    assert select_attention_backend(CPU, 3).name == "torch"
    with pytest.raises(ValueError, match="'cpu' kernels did not build here"):
        select_attention_backend(CPU, 3, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k_dim", [576, 40, 23], ids=["k576", "k40", "k23"])
def test_int8_weight_linear_matches_the_dequantised_matmul(dtype, k_dim):
    from runner.layers.weight_formats import Int8Weight

    torch.manual_seed(k_dim)
    w = torch.randn(70, k_dim) * 0.05
    bias = torch.randn(70)
    q, scale = Int8Weight.quantize_rows(w)
    dequant = q.float() * scale[:, None]
    op = torch.ops.headrace.int8_weight_linear
    # 1..11 rows cover the 8-, 4-, 2- and 1-row register tiles and their combinations.
    for rows in range(1, 12):
        x = torch.randn(rows, k_dim).to(dtype)
        want = x.float() @ dequant.t() + bias
        got = op(x, q, scale, bias)
        assert got.dtype == dtype and got.shape == (rows, 70)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(op(x, q, scale, None).float(), op(x, q, scale, torch.zeros(70)).float())
    with pytest.raises(RuntimeError, match="disagree on K"):
        op(torch.zeros(1, k_dim + 1), q, scale, None)
    with pytest.raises(RuntimeError, match="contiguous int8"):
        op(x, q.float(), scale, None)


def test_amx_pack_int8_lays_out_pair_interleaved_tiles():
    # Tile (n, k): 16 rows of k pairs, each 16 channels x 2 inputs; edges zero padded.
    q = torch.randint(-127, 128, (37, 70), dtype=torch.int8)
    tiles = torch.ops.headrace.amx_pack_int8(q)
    assert tiles.shape == (3, 3, 512)
    padded = torch.zeros(48, 96, dtype=torch.int8)
    padded[:37, :70] = q
    want = padded.view(3, 16, 3, 16, 2).permute(0, 2, 3, 1, 4).reshape(3, 3, 512)
    assert torch.equal(tiles, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_amx_int8_linear_matches_the_dequantised_matmul_or_says_why_not(dtype):
    from runner.layers.weight_formats import Int8Weight

    op = torch.ops.headrace.amx_int8_linear
    torch.manual_seed(1)
    # Channel and input counts off the 16 x 32 tile grid, as well as the model's own.
    for n_dim, k_dim in ((70, 40), (960, 576), (33, 1536)):
        w = torch.randn(n_dim, k_dim) * 0.05
        bias = torch.randn(n_dim)
        q, scale = Int8Weight.quantize_rows(w)
        tiles = torch.ops.headrace.amx_pack_int8(q)
        dequant = q.float() * scale[:, None]
        if not torch.ops.headrace.amx_usable():
            # A build or CPU without AMX: a clear error, never a wrong answer.
            with pytest.raises(RuntimeError, match="no usable AMX"):
                op(torch.zeros(1, k_dim, dtype=dtype), tiles, scale, bias, n_dim)
            continue
        # 1..17 cover one and two row tiles with ragged edges; 40 and 70 the row chunks.
        for rows in (*range(1, 18), 32, 40, 70):
            x = torch.randn(rows, k_dim).to(dtype)
            # AMX multiplies bf16: the reference sees the activations rounded the same way.
            want = x.to(torch.bfloat16).float() @ dequant.t() + bias
            got = op(x, tiles, scale, bias, n_dim)
            assert got.dtype == dtype and got.shape == (rows, n_dim)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
            # Each row's answer is its own, whatever shares its batch.
            assert torch.equal(op(x[:1], tiles, scale, bias, n_dim), got[:1])
        no_bias = op(x, tiles, scale, None, n_dim).float()
        torch.testing.assert_close(no_bias, want - bias, atol=tol, rtol=tol)
        # A view whose rows are strided (a narrow of a wider output) is read in place.
        wide = torch.randn(3, k_dim + 8).to(dtype)
        view = wide[:, :k_dim]
        torch.testing.assert_close(
            op(view, tiles, scale, bias, n_dim), op(view.contiguous(), tiles, scale, bias, n_dim)
        )
        with pytest.raises(RuntimeError, match="columns, the tiles were packed for"):
            op(torch.zeros(1, k_dim + 32, dtype=dtype), tiles, scale, bias, n_dim)
        with pytest.raises(RuntimeError, match="n does not match"):
            op(x, tiles, scale, bias, n_dim + 16)


def test_amx_int8_linear_leaves_nothing_of_an_earlier_call_in_a_row():
    # Rows off the 16-row tile grid are staged in a buffer reused between calls. A call of
    # 64 inputs leaves NaNs where a call of 40 inputs has its pad columns (which meet the
    # weights' zero padding) and its pad rows: neither may reach an output.
    from runner.layers.weight_formats import Int8Weight

    op = torch.ops.headrace.amx_int8_linear
    torch.manual_seed(3)
    packed = {}
    for k_dim in (64, 40):
        q, scale = Int8Weight.quantize_rows(torch.randn(48, k_dim) * 0.05)
        packed[k_dim] = (torch.ops.headrace.amx_pack_int8(q), scale, q.float() * scale[:, None])
    nan = torch.full((15, 64), float("nan"), dtype=torch.bfloat16)
    if not torch.ops.headrace.amx_usable():
        with pytest.raises(RuntimeError, match="no usable AMX"):
            op(nan, packed[64][0], packed[64][1], None, 48)
        return
    assert op(nan, packed[64][0], packed[64][1], None, 48).isnan().all()
    x = torch.randn(3, 40).to(torch.bfloat16)
    got = op(x, packed[40][0], packed[40][1], None, 48)
    torch.testing.assert_close(got.float(), x.float() @ packed[40][2].t(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout", ["rows", "amx"])
def test_linear_uses_its_int8_copy_only_up_to_small_rows(layout):
    from runner.layers.linear import Linear
    from runner.layers.weight_formats import SmallBatchInt8

    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)
    ref = torch.nn.functional.linear
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack("float", small_batch_int8=layout)
    assert layer.small_batch_layout == layout
    with pytest.raises(ValueError, match="copy has 3 outputs, layer 48"):
        layer.set_small_batch_int8(SmallBatchInt8.from_weight(torch.randn(3, 64), layout))
    layer.small_rows = 2
    few, many = torch.randn(2, 64), torch.randn(3, 64)
    if layout == "amx" and not torch.ops.headrace.amx_usable():
        with pytest.raises(RuntimeError, match="no usable AMX"):
            layer(few)
        return
    # Few rows: the weight-only int8 copy (close to, not equal to, the float result).
    out_few = layer(few)
    assert not torch.equal(out_few, ref(few, w, b))
    torch.testing.assert_close(out_few, ref(few, w, b), atol=2e-2, rtol=2e-2)
    # More rows: the layer's own format, exactly.
    assert torch.equal(layer(many), ref(many, w, b))
    layer.drop_small_batch_int8()
    assert torch.equal(layer(few), ref(few, w, b))


def test_small_rows_is_measured_on_the_model_and_dropped_when_it_loses():
    from runner.format_timing import measure_small_rows
    from runner.layers.linear import Linear, pack_linears

    model = torch.nn.Sequential(Linear(256, 512), Linear(512, 256))
    pack_linears(model, "float", small_batch_int8="rows")
    rows = measure_small_rows(model, torch.float32, reps=1)
    assert rows in (0, 1, 2, 4, 8, 16, 32, 64)
    assert all(m.small_rows == rows for m in model)
    # A margin nothing can meet: the copies are dropped, not kept unused.
    assert measure_small_rows(model, torch.float32, reps=1, margin=0.0) == 0
    assert all(not m.has_small_batch_int8 and m.small_rows == 0 for m in model)


def test_small_rows_takes_a_count_lost_in_one_timing_if_it_wins_the_second(monkeypatch):
    import runner.format_timing as ft
    from runner.layers.linear import Linear, pack_linears

    model = torch.nn.Sequential(Linear(64, 64))
    pack_linears(model, "float", small_batch_int8="rows")
    # (copies' time, own format's time) per timing: 1 row wins at once, 2 rows loses then
    # wins (a slow first timing), 4 rows loses twice.
    scripted = iter([(1.0, 2.0), (3.0, 2.0), (1.0, 2.0), (3.0, 2.0), (2.5, 2.0)])
    timed = []

    def best_of(sweeps, reps):
        copies, own = next(scripted)
        rows = max(sweeps)
        timed.append(rows)
        return {rows: copies, 0: own}

    monkeypatch.setattr(ft, "best_of_interleaved", best_of)
    assert ft.measure_small_rows(model, torch.float32, candidates=(1, 2, 4, 8)) == 2
    assert timed == [1, 2, 2, 4, 4] and model[0].small_rows == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_elementwise_ops_match_the_eager_formulas(dtype):
    from runner.models.decoder import RMSNorm
    from runner.models.rope import RopeAt

    torch.manual_seed(1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    # Odd widths: no vector tile covers them exactly.
    for rows, width in ((1, 576), (5, 40), (33, 23)):
        norm = RMSNorm(width, 1e-5).to(dtype)
        norm.weight.data = torch.randn(width).to(dtype)
        x, res = torch.randn(rows, width).to(dtype), torch.randn(rows, width).to(dtype)
        want = norm(x)
        want_h, want_res = norm.add_forward(x.clone(), res.clone())
        norm.fused = True
        torch.testing.assert_close(norm(x), want, **tol)
        got_h, got_res = norm.add_forward(x.clone(), res.clone())
        assert torch.equal(got_res, want_res)  # the residual sum is rounded the same way
        torch.testing.assert_close(got_h, want_h, **tol)

        gate_up = (torch.randn(rows, 2 * width) * 4).to(dtype)
        gate, up = gate_up.split(width, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(torch.ops.headrace.silu_and_mul(gate_up), want, **tol)

    # RoPE in place on a strided view (Q and K inside the fused QKV output).
    tokens, heads, dim = 7, 12, 64
    qkv = torch.randn(tokens, (heads + 3) * dim).to(dtype)
    cos, sin = torch.randn(tokens, 1, dim).to(dtype), torch.randn(tokens, 1, dim).to(dtype)
    rope = RopeAt(cos, sin)
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)
    want = rope.rotate(qk)
    v_before = qkv[:, heads * dim :].clone()
    rope.rotate_(qk)
    torch.testing.assert_close(qk, want, **tol)
    assert torch.equal(qkv[:, heads * dim :], v_before)  # nothing outside the view moved


def test_fused_ops_refuse_bad_shapes():
    with pytest.raises(RuntimeError, match="gate_up"):
        torch.ops.headrace.silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="rms_norm"):
        torch.ops.headrace.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.headrace.silu_and_mul(torch.zeros(2, 4, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_matches_index_copy_from_strided_views(dtype):
    torch.manual_seed(2)
    tokens, heads, kv_heads, dim = 9, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(40 * 16)[:tokens]
    want, got = (
        torch.zeros(2, 40, 16, kv_heads, dim).to(dtype),
        torch.zeros(2, 40, 16, kv_heads, dim).to(dtype),
    )
    TorchAttentionBackend().write_kv(want, k, v, type("Meta", (), {"slot_mapping": slots}))
    torch.ops.headrace.write_kv_(got, k, v, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.headrace.write_kv_(got, k, v, slots.clone().fill_(40 * 16))
    with pytest.raises(RuntimeError, match="one per token"):
        torch.ops.headrace.write_kv_(got, k, v, slots[:3])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AVX flags exist only on x86-64")
def test_the_avx2_build_passes_these_tests_too(isa_build):
    # The kernels have AVX-512, AVX2 and scalar paths; CI's CPU builds one of the first two.
    # Here the same tests (and the LoRA kernel's, the fused decoder's, row_argmax's and the
    # int8 KV cache's and the 4-bit GEMV's) run in a fresh process on a build without AVX-512.
    if (built := isa_build("-mno-avx512f")) is None:
        return  # this CPU has nothing to narrow: the suite's own build is that one (checked)
    env, cache = built
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         __file__.replace("test_cpu_ops.py", "test_lora_ops.py"),
         __file__.replace("test_cpu_ops.py", "test_fused_decode.py"),
         __file__.replace("test_cpu_ops.py", "test_row_argmax.py"),
         __file__.replace("test_cpu_ops.py", "test_kv_int8_kernels.py"),
         __file__.replace("test_cpu_ops.py", "test_q4_gemv.py"),
         # The embedded model's check loads SmolLM2 again (~15 s) for what the kernel tests
         # above already cover on this build.
         "-k", "not avx2_build and not embedded_models"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
    assert any(cache.glob("cpu_ops/*/built.ok"))  # the build it loaded


# The sources with ISA branches (#if __AVX512...__, AVX-VNNI, AMX), compiled as two units:
# the others hold none, and paged_attention.cpp shares names with vec_attention.cpp.
_ISA_UNITS = (
    ("batched_int8", "int8_linear", "lora", "vec_attention", "amx_linear", "amx_attention",
     "argmax"),
    ("paged_attention",),
    ("q4_gemv",),
)  # fmt: skip


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AVX flags exist only on x86-64")
@pytest.mark.parametrize(
    "march,defines",
    [
        ("sapphirerapids", ("__AVX512BF16__", "__AVX512VNNI__", "__AMX_TILE__")),
        ("alderlake", ("__AVXVNNI__", "__AVX2__")),
        # AVX-512 without VNNI or BF16: the branches that widen with madd.
        ("skylake-avx512", ("__AVX512BW__", "__AVX512F__")),
    ],
)
def test_the_kernels_compile_for_cpu_kinds_other_than_this_one(march, defines, tmp_path):
    # -march=native compiles only this CPU's branches. A type test that took bf16 bits
    # (uint16_t) for int16 activations broke every AVX512-BF16 build for two sessions
    # unseen: every CI run since was on an AVX2-only machine, which never compiles them. A
    # syntax check per CPU kind costs ~13 s.
    from pathlib import Path

    from torch.utils.cpp_extension import include_paths

    src = Path(__file__).resolve().parents[1] / "runner" / "cpu_ops"
    flags = ["g++", "-std=c++17", "-fopenmp", f"-march={march}", f"-I{src}"]
    flags += [f"-I{p}" for p in include_paths()]
    macros = subprocess.run(
        [*flags, "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True
    )
    assert macros.returncode == 0, macros.stderr[-2000:]
    assert all(f"#define {d} 1" in macros.stdout for d in defines), f"{march} lacks {defines}"
    for i, names in enumerate(_ISA_UNITS):
        unit = tmp_path / f"isa_unit{i}.cpp"
        unit.write_text("".join(f'#include "{name}.cpp"\n' for name in names))
        done = subprocess.run(
            [*flags, "-w", "-fsyntax-only", str(unit)], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
