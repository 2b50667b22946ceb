"""The segmented LoRA delta: `y[rows] += x[rows] @ A[slot]^T @ B[slot]^T` per segment.

The torch path (the CPU fallback, and the reference the kernels are tested against) uses
plain matmuls; the Triton path (runner/triton_ops/lora.py) runs all segments in one launch,
and so does the C++ CPU kernel (runner/cpu_ops/lora.cpp) where the CPU ops are built.
"""

from __future__ import annotations

import torch

from runner.lora.batch import LoRABatch


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    width: list[int],
    batch: LoRABatch,
) -> torch.Tensor:
    """Add each segment's delta to y [T, N] in place (and return it). x [T, K]; a [S, W, K]
    and b [S, N, W] the stacked slots; width[s] the columns slot s fills. The CPU kernel
    needs b to be the transposed view of a contiguous [S, W, N] (LoRALinear's CPU layout)."""
    w = max(width[s] for s in batch.slots)
    if w == 0:  # no adapter of this step touches this module
        return y
    x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    if batch.kernel is not None:
        from runner.triton_ops.lora import lora_segmented

        lora_segmented(y2, x2, a[:, :w], b[:, :, :w], batch.kernel)
        return y
    cpu = batch.cpu
    if cpu is not None and _kernel_takes(y2, x2, a, b):
        torch.ops.headrace.lora_delta_(
            y2, x2, a, b.transpose(1, 2), cpu.rows, cpu.starts, cpu.slots, width
        )
        return y
    padded = batch.padded
    if padded is not None:
        xs = x2[padded.index]  # [G, L, K]
        s = torch.bmm(xs, a[padded.slots, :w].transpose(1, 2))  # [G, L, w]
        if padded.mask is not None:
            s.mul_(padded.mask)
        d = torch.bmm(s, b[padded.slots, :, :w].transpose(1, 2))  # [G, L, N]
        y2.index_add_(0, padded.index.view(-1), d.view(-1, d.shape[-1]))
        return y
    for slot, rows in zip(batch.slots, batch.rows):
        if not width[slot]:
            continue
        r = width[slot]
        d = (x2[rows] @ a[slot, :r].t()) @ b[slot, :, :r].t()  # [n, K] -> [n, r] -> [n, N]
        if isinstance(rows, slice):
            y2[rows] += d
        else:
            y2.index_add_(0, rows, d)
    return y


def _kernel_takes(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """The C++ kernel's cases; anything else (an fp16 model, a base whose output dtype
    differs) takes the per-segment torch loop."""
    return (
        y.dtype == x.dtype == a.dtype == b.dtype
        and y.dtype in (torch.float32, torch.bfloat16)
        and x.stride(-1) == 1
        and y.stride(-1) == 1
        and b.transpose(1, 2).is_contiguous()
    )


def lora_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    width: list[int],
    token_slots: list[int],
) -> torch.Tensor:
    """[T, N] deltas one row at a time from each row's slot (-1: none): the oracle of tests."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for t, slot in enumerate(token_slots):
        if slot >= 0 and width[slot]:
            r = width[slot]
            out[t] = (x[t].float() @ a[slot, :r].float().t()) @ b[slot, :, :r].float().t()
    return out
