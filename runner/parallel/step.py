"""One step's model input as rank 0 sends it to the workers: flat int32 arrays, no pickle.

```
int32 words:  [kind, T, B, S, total_blocks]            header
              input_ids[T] positions[T]                the flattened batch
              num_computed[B] num_new[B] block_counts[B] block_ids[total_blocks]
              sample_rows[S]                           rows whose logits rank 0 samples
```
A worker builds the same attention metadata from it and runs the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STEP, STOP, CACHE = 1, 2, 3
_HEADER = 5


@dataclass(slots=True)
class StepInput:
    """What every rank needs to run one forward (the scheduler's output made concrete)."""

    input_ids: list[int]
    positions: list[int]
    num_computed: list[int]
    num_new: list[int]
    block_tables: list[list[int]]
    # Flattened rows whose logits are gathered to rank 0 (empty: no LM head this step).
    sample_rows: list[int]

    def encode(self) -> np.ndarray:
        counts = [len(t) for t in self.block_tables]
        flat = [b for t in self.block_tables for b in t]
        header = [STEP, len(self.input_ids), len(counts), len(self.sample_rows), len(flat)]
        parts = (header, self.input_ids, self.positions, self.num_computed, self.num_new,
                 counts, flat, self.sample_rows)  # fmt: skip
        return np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])

    @classmethod
    def decode(cls, words: np.ndarray) -> StepInput:
        kind, t, b, s, nblocks = (int(x) for x in words[:_HEADER])
        if kind != STEP:
            raise ValueError(f"not a step message (kind {kind})")
        sizes = [t, t, b, b, b, nblocks, s]
        ids, pos, done, new, counts, flat, rows = np.split(
            words[_HEADER : _HEADER + sum(sizes)], np.cumsum(sizes)[:-1]
        )
        bounds = np.cumsum(counts)
        tables = [t.tolist() for t in np.split(flat, bounds[:-1])] if b else []
        return cls(ids.tolist(), pos.tolist(), done.tolist(), new.tolist(), tables, rows.tolist())


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Sent once, after rank 0 has sized its KV cache: every rank allocates the same blocks
    (of its own KV heads) and takes rank 0's attention backend and measured linear figures."""

    num_blocks: int
    block_size: int
    backend: str
    small_rows: int
    min_rows: int | None
    deterministic: bool
    # int8 rows (runner/kv_format.py), else rows of the model's dtype.
    kv_int8: bool = False
    # Up to how many rows the small copies' 4-bit blocks serve (Platform.q4_rows).
    q4_rows: int = 0

    def encode(self, backends: tuple[str, ...]) -> np.ndarray:
        min_rows = -1 if self.min_rows is None else self.min_rows
        fields = [CACHE, self.num_blocks, self.block_size, backends.index(self.backend)]
        flags = [int(self.deterministic), int(self.kv_int8)]
        return np.array([*fields, self.small_rows, min_rows, *flags, self.q4_rows], np.int32)

    @classmethod
    def decode(cls, words: np.ndarray, backends: tuple[str, ...]) -> CacheSpec:
        kind, blocks, size, backend, small, min_rows, det, int8, q4 = (int(x) for x in words[:9])
        if kind != CACHE:
            raise ValueError(f"not a cache message (kind {kind})")
        return cls(blocks, size, backends[backend], small, None if min_rows < 0 else min_rows,
                   bool(det), bool(int8), q4)  # fmt: skip


def stop_message() -> np.ndarray:
    return np.array([STOP, 0, 0, 0, 0], dtype=np.int32)


def message_kind(words: np.ndarray) -> int:
    return int(words[0])
