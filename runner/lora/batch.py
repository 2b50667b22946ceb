"""A step's LoRA segments: which rows run which resident adapter, built once per step.

One segment per adapter in the step holds all of its rows (its requests need not be
adjacent in the flattened batch). Base-model rows belong to no segment and get no delta.

```
rows      0 1 2 3 4 5 6 7 8        requests: r0 (3 rows, slot 1) r1 (1, base) r2 (2, slot 0)
slot      1 1 1 - 0 0 1 0 -                  r3 (1, slot 1) r4 (1, slot 0) r5 (1, base)
segments  slot 1: rows 0 1 2 6     slot 0: rows 4 5 7
```

The torch path runs short segments together: their rows padded to the longest, one
batched product for A and one for B (a decode step of many adapters costs the same few
ops as one); a long segment (a prompt chunk) runs alone instead of padding the others.
The Triton path reads the rows sorted by segment and runs every segment in one launch;
the C++ CPU kernel (runner/cpu_ops/lora.cpp) reads them the same way, in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Pad segments into one batched product while padding adds at most this many rows per
# real row; past it each segment runs on its own.
PAD_WASTE = 1.0


@dataclass(slots=True)
class PaddedSegments:
    """Every segment padded to the longest: rows [G, L] (padding repeats a real row of the
    segment, and `mask` zeroes its products so it adds nothing)."""

    slots: torch.Tensor | slice  # [G] int64, or a slice when the slots are consecutive
    index: torch.Tensor  # [G, L] int64 rows of the flattened batch
    mask: torch.Tensor | None  # [G, L, 1] 1 for real rows, 0 for padding; None if none


@dataclass(slots=True)
class KernelSegments:
    """The Triton kernel's view: rows sorted by segment, and each segment's extent."""

    rows: torch.Tensor  # [N] int32 rows of the flattened batch, segment after segment
    starts: torch.Tensor  # [G] int32 first position of each segment in `rows`
    lens: torch.Tensor  # [G] int32
    slots: torch.Tensor  # [G] int32
    max_len: int


@dataclass(slots=True)
class CpuSegments:
    """The C++ CPU kernel's view: rows sorted by segment, segment g at rows[starts[g]:
    starts[g + 1]] (int64 CPU tensors, built once per step for every layer's call)."""

    rows: torch.Tensor  # [N]
    starts: torch.Tensor  # [G + 1]
    slots: torch.Tensor  # [G]


@dataclass(slots=True)
class LoRABatch:
    """The step's segments, read by every adapted layer (runner/lora/layers.py)."""

    # The resident slot of each segment.
    slots: list[int]
    # Each segment's rows: a slice when they are contiguous, else an int64 index.
    rows: list[slice | torch.Tensor]
    padded: PaddedSegments | None = None
    kernel: KernelSegments | None = None
    cpu: CpuSegments | None = None

    @classmethod
    def build(
        cls,
        request_slots: Sequence[int],
        num_tokens: Sequence[int],
        device: torch.device,
        dtype: torch.dtype,
        use_kernel: bool = False,
        cpu_kernel: bool = False,
    ) -> LoRABatch | None:
        """From each request's slot (-1: the base model) and its rows this step, in
        flattened order. None when no row runs an adapter."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, n in zip(request_slots, num_tokens):
            if slot >= 0 and n:
                spans = ranges.setdefault(slot, [])
                if spans and spans[-1][1] == start:  # adjacent to its last span: merge
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        if not ranges:
            return None
        # In slot order: resident slots are mostly consecutive, and a slice of the stacked
        # weights is a view where an index would copy them.
        ranges = dict(sorted(ranges.items()))
        slots = list(ranges)
        rows_lists = [[r for s, e in spans for r in range(s, e)] for spans in ranges.values()]
        rows: list[slice | torch.Tensor] = [
            slice(*spans[0]) if len(spans) == 1 else _index(rl, device)
            for spans, rl in zip(ranges.values(), rows_lists)
        ]
        batch = cls(slots, rows)
        lens = [len(rl) for rl in rows_lists]
        if use_kernel:
            starts = [sum(lens[:i]) for i in range(len(lens))]
            batch.kernel = KernelSegments(
                _index([r for rl in rows_lists for r in rl], device, torch.int32),
                _index(starts, device, torch.int32),
                _index(lens, device, torch.int32),
                _index(slots, device, torch.int32),
                max(lens),
            )
        elif cpu_kernel:
            starts = [0]
            for n in lens:
                starts.append(starts[-1] + n)
            batch.cpu = CpuSegments(
                torch.tensor([r for rl in rows_lists for r in rl], dtype=torch.int64),
                torch.tensor(starts, dtype=torch.int64),
                torch.tensor(slots, dtype=torch.int64),
            )
        elif len(slots) > 1 and len(slots) * max(lens) <= (1 + PAD_WASTE) * sum(lens):
            batch.padded = _pad(slots, rows_lists, lens, device, dtype)
        return batch


def _index(values: list[int], device: torch.device, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _pad(
    slots: list[int],
    rows_lists: list[list[int]],
    lens: list[int],
    device: torch.device,
    dtype: torch.dtype,
) -> PaddedSegments:
    width = max(lens)
    index = [rl + [rl[0]] * (width - len(rl)) for rl in rows_lists]
    mask = None
    if min(lens) < width:
        mask = torch.tensor([[1] * n + [0] * (width - n) for n in lens], dtype=dtype)
        mask = mask.unsqueeze(-1).to(device, non_blocking=True)
    consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
    slot_index = slice(slots[0], slots[-1] + 1) if consecutive else _index(slots, device)
    return PaddedSegments(slot_index, torch.tensor(index).to(device), mask)
