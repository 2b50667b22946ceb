"""The activation rounding the integer kernels do, in torch (the references of
tests/test_batched_int8.py and tests/test_q4_linear.py)."""

from __future__ import annotations

import torch


def round_groups(g: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, n] fp32, one group a row -> (its integers as fp32, amax [M, 1]):
    q = round(g * qmax / amax), nearest even, as runner/cpu_ops/act_quant.h rounds.

    The division is a true one, as the kernels': torch's `qmax / amax` multiplies by the
    reciprocal, an ulp off, which moves an exact tie (98.5) to the other integer once in some
    10^6 inputs (and at qmax 32767 more often)."""
    amax = g.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, 0.0)
    return (g * inv).round().clamp(-qmax, qmax), amax
