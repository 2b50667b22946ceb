"""LoRA segments, the torch delta paths (padded batch, per segment) and the C++ CPU kernel
against the row-by-row oracle (tests/test_cpu_ops.py runs this file on the AVX2 build too)."""

from __future__ import annotations

import pytest
import torch

from runner.cpu_ops import load_cpu_ops
from runner.lora.batch import LoRABatch
from runner.lora.manager import ResidentAdapters
from runner.lora.ops import add_lora, lora_reference

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert load_cpu_ops() is None, "the CPU kernels did not build"
    assert hasattr(torch.ops.headrace, "lora_delta_")


def test_segments_gather_each_adapters_rows() -> None:
    # r0 3 rows slot 1 | r1 1 base | r2 2 slot 0 | r3 1 slot 1 | r4 1 slot 0 | r5 1 base
    batch = LoRABatch.build([1, -1, 0, 1, 0, -1], [3, 1, 2, 1, 1, 1], CPU, torch.float32)
    assert batch is not None
    assert batch.slots == [0, 1]  # in slot order
    assert batch.rows[0].tolist() == [4, 5, 7]
    assert batch.rows[1].tolist() == [0, 1, 2, 6]
    assert batch.padded is not None  # 2 x 4 padded rows for 7 real ones
    assert batch.padded.slots == slice(0, 2)  # consecutive: a view of the stacked weights
    assert batch.padded.index.tolist() == [[4, 5, 7, 4], [0, 1, 2, 6]]
    assert batch.padded.mask.squeeze(-1).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_adjacent_requests_of_one_adapter_make_one_slice() -> None:
    batch = LoRABatch.build([2, 2, -1], [4, 1, 3], CPU, torch.float32)
    assert batch is not None and batch.slots == [2]
    assert batch.rows == [slice(0, 5)]
    assert batch.padded is None


def test_no_adapter_rows_means_no_batch() -> None:
    assert LoRABatch.build([-1, -1], [3, 1], CPU, torch.float32) is None


def test_a_long_segment_is_not_padded_against_short_ones() -> None:
    batch = LoRABatch.build([0, 1, 2], [64, 1, 1], CPU, torch.float32)
    assert batch is not None and batch.padded is None  # 3 x 64 rows would be mostly padding


@pytest.mark.parametrize(
    ("request_slots", "num_tokens"),
    [
        ([1, -1, 0, 1, 0, -1], [3, 1, 2, 1, 1, 1]),  # padded path, slots 0..1 a slice
        ([2, 0, 2, 0], [1, 2, 1, 1]),  # padded path, slots 0 and 2 by index
        ([0, 1, -1, 2], [30, 1, 2, 1]),  # per-segment path, a slice and index rows
        ([2, 2], [1, 1]),  # one slice
    ],
)
def test_torch_paths_match_row_by_row_reference(request_slots, num_tokens) -> None:
    torch.manual_seed(0)
    k, n, width = 24, 40, 12
    a, b = torch.randn(3, width, k), torch.randn(3, n, width)
    widths = [12, 8, 0]  # slot 2's adapter does not touch this module
    a[1, 8:], b[1, :, 8:] = 0, 0
    a[2], b[2] = 0, 0
    t = sum(num_tokens)
    x, y0 = torch.randn(t, k), torch.randn(t, n)
    batch = LoRABatch.build(request_slots, num_tokens, CPU, torch.float32)
    assert batch is not None
    got = add_lora(y0.clone(), x, a, b, widths, batch)
    token_slots = [s for s, m in zip(request_slots, num_tokens) for _ in range(m)]
    torch.testing.assert_close(got, y0 + lora_reference(x, a, b, widths, token_slots))


def _kernel_case(request_slots, num_tokens, k, n, widths, dtype, seed=0):
    """Stacked slots with B stored as the kernel reads it ([S, W, N], `b` its view), zeros
    past each slot's width, and a batch of the given requests."""
    gen = torch.Generator().manual_seed(seed)
    w = max(max(widths), 1)
    a = torch.randn(len(widths), w, k, generator=gen).to(dtype)
    bt = torch.randn(len(widths), w, n, generator=gen).to(dtype)
    for s, r in enumerate(widths):
        a[s, r:], bt[s, r:] = 0, 0
    t = sum(num_tokens)
    x = torch.randn(t, k, generator=gen).to(dtype)
    y0 = torch.randn(t, n, generator=gen).to(dtype)
    batch = LoRABatch.build(request_slots, num_tokens, CPU, dtype, cpu_kernel=True)
    token_slots = [s for s, m in zip(request_slots, num_tokens) for _ in range(m)]
    return a, bt.transpose(1, 2), x, y0, batch, token_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("request_slots", "num_tokens", "k", "n", "widths"),
    [
        # mixed lengths, non-contiguous rows, base rows, a slot of width 0, a partial width
        ([1, -1, 0, 1, 0, -1, 2], [3, 1, 2, 1, 5, 1, 2], 24, 40, [12, 8, 0]),
        # decode-like: 32 rows dealt round-robin over 4 slots, SmolLM2's qkv shape
        ([i % 4 for i in range(32)], [1] * 32, 576, 960, [48, 48, 48, 48]),
        # a prompt chunk and single rows; sizes off every vector width (tails everywhere)
        ([0, 1, 2, 1], [37, 1, 6, 2], 53, 77, [5, 16, 3]),
        # one row, one slot of width 1
        ([0], [1], 16, 16, [1]),
    ],
)
def test_cpu_kernel_matches_the_reference(request_slots, num_tokens, k, n, widths, dtype):
    a, b, x, y0, batch, token_slots = _kernel_case(request_slots, num_tokens, k, n, widths, dtype)
    assert batch is not None and batch.cpu is not None and batch.padded is None
    got = add_lora(y0.clone(), x, a, b, widths, batch)
    want = y0.float() + lora_reference(x, a, b, widths, token_slots)
    base = [i for i, s in enumerate(token_slots) if s < 0 or widths[s] == 0]
    assert torch.equal(got[base], y0[base])  # rows without a delta are left alone
    # fp32 sums in another order; bf16 rounds y once (the reference never rounds)
    tol = {"atol": 1e-3, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.01}
    torch.testing.assert_close(got.float(), want, **tol)
    if dtype == torch.float32:  # (bf16 torch rounds x @ A^T to bf16: further off)
        # The torch path on the same step (either layout of b) agrees too.
        torch_batch = LoRABatch.build(request_slots, num_tokens, CPU, dtype)
        ref = add_lora(y0.clone(), x, a, b.contiguous(), widths, torch_batch)
        torch.testing.assert_close(got, ref, **tol)


def test_cpu_kernel_reads_strided_rows_in_place() -> None:
    # x a column slice of a wider tensor (as a fused projection's output would be)
    a, b, x, y0, batch, token_slots = _kernel_case(
        [0, 1, 0], [2, 3, 1], 32, 48, [8, 4], torch.float32
    )
    wide = torch.randn(x.shape[0], 80)
    wide[:, 16:48] = x
    got = add_lora(y0.clone(), wide[:, 16:48], a, b, [8, 4], batch)
    want = y0 + lora_reference(x, a, b, [8, 4], token_slots)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_cpu_kernel_falls_back_where_it_cannot_run() -> None:
    # B stored [S, N, W] (the Triton layout): the kernel cannot read it, the torch loop does.
    a, b, x, y0, batch, token_slots = _kernel_case([0, 1], [2, 2], 16, 24, [4, 4], torch.float32)
    got = add_lora(y0.clone(), x, a, b.contiguous(), [4, 4], batch)
    torch.testing.assert_close(got, y0 + lora_reference(x, a, b, [4, 4], token_slots))


def test_cpu_kernel_refuses_bad_segments() -> None:
    a, b, x, y0, batch, _ = _kernel_case([0, 1], [2, 2], 16, 24, [4, 4], torch.float32)
    op, bt = torch.ops.headrace.lora_delta_, b.transpose(1, 2)
    cpu = batch.cpu
    with pytest.raises(RuntimeError, match="out of range"):
        op(y0, x, a, bt, torch.tensor([0, 1, 2, 9]), cpu.starts, cpu.slots, [4, 4])
    with pytest.raises(RuntimeError, match="two segments"):
        op(y0, x, a, bt, torch.tensor([0, 1, 1, 2]), cpu.starts, cpu.slots, [4, 4])
    with pytest.raises(RuntimeError, match="slot 5 out of range"):
        op(y0, x, a, bt, cpu.rows, cpu.starts, torch.tensor([0, 5]), [4, 4])
    with pytest.raises(RuntimeError, match="width 9"):
        op(y0, x, a, bt, cpu.rows, cpu.starts, cpu.slots, [4, 9])
    with pytest.raises(RuntimeError, match="one dtype"):
        op(y0, x.bfloat16(), a, bt, cpu.rows, cpu.starts, cpu.slots, [4, 4])


def test_resident_adapters_evict_least_recently_used_outside_the_step() -> None:
    table = ResidentAdapters(2)
    assert table.claim("a", {"a"}) == 0
    assert table.claim("b", {"b"}) == 1
    assert table.lookup("a") == 0  # a is now the most recent
    assert table.claim("c", {"c"}) == 1  # b was least recent
    assert table.resident() == ["a", "c"]
    with pytest.raises(RuntimeError, match="max-loras 2"):
        table.claim("d", {"a", "c", "d"})
