"""TritonAttentionBackend: the torch reference's interface on the Triton kernels."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runner.triton_ops import decode_attention, kv_write, prefill_attention
from runner.triton_ops.metadata import TritonAttentionMetadata, build_triton_metadata


class TritonAttentionBackend:
    """Paged attention with Triton kernels: decode rows through flash-decoding, the rest
    (prompt chunks, drafts) through the varlen prefill kernel, both into one output."""

    name = "triton"

    def __init__(self, kv_heads: int) -> None:
        self.kv_heads = kv_heads

    def build_metadata(
        self,
        num_computed: Sequence[int],
        num_new: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device,
    ) -> TritonAttentionMetadata:
        return build_triton_metadata(
            num_computed, num_new, block_tables, block_size, device, self.kv_heads
        )

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TritonAttentionMetadata,
    ) -> None:
        kv_write.write_kv(kv_cache, k, v, meta.slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)  # [T, H, D]; every row is written by one of the kernels
        decode_attention.decode_attention(q, kv_cache, meta, scale, out)
        prefill_attention.prefill_attention(q, kv_cache, meta, scale, out)
        return out
