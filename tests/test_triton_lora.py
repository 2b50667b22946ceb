"""The segmented LoRA Triton kernel against the row-by-row torch reference.

Interpreted without a GPU (tests/conftest.py), compiled on one."""

from __future__ import annotations

import pytest
import torch

from runner.lora.batch import LoRABatch
from runner.lora.ops import add_lora, lora_reference
from runner.triton_ops import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _stacks(slots: int, width: int, k: int, n: int, dtype: torch.dtype):
    a = torch.randn(slots, width, k, device=DEVICE).to(dtype)
    b = torch.randn(slots, n, width, device=DEVICE).to(dtype)
    return a, b


@pytest.mark.parametrize(
    ("request_slots", "num_tokens"),
    [
        ([0, -1, 1, 0, 2, -1], [5, 3, 1, 1, 20, 2]),  # mixed: a chunk past one row block
        ([1] * 4, [1] * 4),  # one adapter, decode rows
        ([-1, 2], [3, 3]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(request_slots, num_tokens, dtype) -> None:
    torch.manual_seed(0)
    k, n, width = 40, 72, 24  # none a power of two: every mask is exercised
    a, b = _stacks(3, width, k, n, dtype)
    widths = [24, 16, 8]  # slots 1 and 2 use fewer columns; the rest is zero
    for slot, w in enumerate(widths):
        a[slot, w:] = 0
        b[slot, :, w:] = 0
    t = sum(num_tokens)
    x = torch.randn(t, k, device=DEVICE).to(dtype)
    y0 = torch.randn(t, n, device=DEVICE).to(dtype)
    batch = LoRABatch.build(request_slots, num_tokens, DEVICE, dtype, use_kernel=True)
    assert batch is not None and batch.kernel is not None
    got = add_lora(y0.clone(), x, a, b, widths, batch)
    token_slots = [s for s, m in zip(request_slots, num_tokens) for _ in range(m)]
    want = y0.float() + lora_reference(x, a, b, widths, token_slots)
    # bf16: one rounding of the sum on the way out
    tol = 1e-3 if dtype == torch.float32 else 2**-7 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=2e-2)
    base_rows = [i for i, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[base_rows], y0[base_rows])  # base rows untouched
