"""LoRA segments and the torch delta paths (padded batch, per segment) against the oracle."""

from __future__ import annotations

import pytest
import torch

from runner.lora.batch import LoRABatch
from runner.lora.manager import ResidentAdapters
from runner.lora.ops import add_lora, lora_reference

CPU = torch.device("cpu")


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


def test_resident_adapters_evict_least_recently_used_outside_the_step() -> None:
    table = ResidentAdapters(2)
    assert table.claim("a", {"a"}) == 0
    assert table.claim("b", {"b"}) == 1
    assert table.lookup("a") == 0  # a is now the most recent
    assert table.claim("c", {"c"}) == 1  # b was least recent
    assert table.resident() == ["a", "c"]
    with pytest.raises(RuntimeError, match="max-loras 2"):
        table.claim("d", {"a", "c", "d"})
