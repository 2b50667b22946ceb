"""Per-step attention metadata for the Triton kernels: built once per step, read by all layers.

Requests sit back to back in the flattened batch, in scheduler order:

```
tokens:           | req 0: 5 prompt tokens | req 1: 1 | req 2: 1 | req 3: 3-token chunk |
query_start_loc:  0                        5          6          7                     10
seq_lens:         5                        40         17         35   (cached + new tokens)
decode_seqs:      [1, 2]      (requests with one new token: the flash-decoding kernel)
prefill_seqs:     [0, 3]      (the rest: the varlen prefill kernel, causal within the chunk)
```
All integer tables travel in one host->device copy: they are packed into one int32 buffer
and split into views on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Most splits of one sequence's context in the flash-decoding kernel.
MAX_DECODE_SPLITS = 32
# Keys per split below which splitting further only adds reduction work.
MIN_TOKENS_PER_SPLIT = 256


@dataclass(slots=True)
class TritonAttentionMetadata:
    """Device tensors (int32 unless noted) and host ints describing one step."""

    # [T]: cache slot of each new token (-1: a padding token, not written).
    slot_mapping: torch.Tensor
    # [B + 1]: request i's new tokens are rows query_start_loc[i] : query_start_loc[i + 1].
    query_start_loc: torch.Tensor
    # [B]: tokens in the cache after this step's write (prefix + new tokens).
    seq_lens: torch.Tensor
    # [B, max_blocks]: block ids (padding repeats block 0, never read past seq_lens).
    block_tables: torch.Tensor
    # [B_d]: batch indices of requests with exactly one new token.
    decode_seqs: torch.Tensor
    # [B_p]: batch indices of the others (prompt chunks, drafts).
    prefill_seqs: torch.Tensor
    num_tokens: int
    num_decodes: int
    num_prefills: int
    max_query_len: int
    max_seq_len: int
    # Context splits of the decode kernel; fixed per CUDA graph, so it is part of the metadata.
    num_decode_splits: int


def decode_splits(num_seqs: int, kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Splits per sequence so that enough programs run to fill the GPU, but each split
    still reads at least MIN_TOKENS_PER_SPLIT keys (short contexts are not split)."""
    by_length = max(1, -(-max_seq_len // MIN_TOKENS_PER_SPLIT))
    by_occupancy = max(1, -(-2 * num_sms // max(1, num_seqs * kv_heads)))
    return min(MAX_DECODE_SPLITS, by_length, by_occupancy)


def build_triton_metadata(
    num_computed: Sequence[int],
    num_new: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
    kv_heads: int = 1,
    num_decode_splits: int | None = None,
) -> TritonAttentionMetadata:
    """Metadata for requests laid out back to back, in this order (as build_metadata)."""
    batch = len(num_new)
    query_start = [0]
    slots: list[int] = []
    for done, n, blocks in zip(num_computed, num_new, block_tables):
        query_start.append(query_start[-1] + n)
        for p in range(done, done + n):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
    seq_lens = [done + n for done, n in zip(num_computed, num_new)]
    max_blocks = max((-(-s // block_size) for s in seq_lens), default=1) or 1
    table = [list(b[:max_blocks]) + [0] * (max_blocks - len(b[:max_blocks])) for b in block_tables]
    decodes = [i for i, n in enumerate(num_new) if n == 1]
    prefills = [i for i, n in enumerate(num_new) if n != 1]
    max_seq_len = max(seq_lens, default=0)
    if num_decode_splits is None:
        num_decode_splits = decode_splits(len(decodes), kv_heads, max_seq_len)
    # One host buffer, one copy: [query_start | seq_lens | decodes | prefills | slots | tables].
    packed = torch.tensor(
        query_start + seq_lens + decodes + prefills + slots + [b for row in table for b in row],
        dtype=torch.int32,
    )
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    qs, sl, dec, pre, sm, bt = packed.split(
        [batch + 1, batch, len(decodes), len(prefills), len(slots), batch * max_blocks]
    )
    return TritonAttentionMetadata(
        slot_mapping=sm,
        query_start_loc=qs,
        seq_lens=sl,
        block_tables=bt.view(batch, max_blocks),
        decode_seqs=dec,
        prefill_seqs=pre,
        num_tokens=query_start[-1],
        num_decodes=len(decodes),
        num_prefills=len(prefills),
        max_query_len=max(num_new, default=0),
        max_seq_len=max_seq_len,
        num_decode_splits=num_decode_splits,
    )
