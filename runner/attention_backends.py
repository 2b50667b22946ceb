"""Attention backends behind one interface, and the choice of one for a device.

```
backend.build_metadata(num_computed, num_new, block_tables, block_size, device)  once a step
backend.write_kv(kv_cache, k, v, meta)       per layer: the step's new K/V into the cache
backend.forward(q, kv_cache, meta, scale)    per layer: [T, H, D] -> [T, H, D]
```
`torch` (runner/attention.py) is exact on every device and is the oracle the kernels are
tested against; `cpu` is the reference with decode rows on the C++ kernel that reads the
paged cache in place (runner/cpu_ops/); `triton` (runner/triton_ops/) is the CUDA path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from runner import attention
from runner.cpu_prefill import wants_vec_prefill
from runner.triton_ops import triton_available

BACKENDS = ("auto", "torch", "cpu", "triton")


class AttentionBackend(Protocol):
    """What the decoder and the runner call; metadata is whatever the backend builds."""

    name: str

    def build_metadata(
        self,
        num_computed: Sequence[int],
        num_new: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device,
    ) -> Any: ...

    def write_kv(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any
    ) -> None: ...

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float
    ) -> torch.Tensor: ...


class TorchAttentionBackend:
    """The torch reference: gathered blocks and masked SDPA (runner/attention.py)."""

    name = "torch"

    def build_metadata(
        self,
        num_computed: Sequence[int],
        num_new: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device,
    ) -> attention.AttentionMetadata:
        return attention.build_metadata(num_computed, num_new, block_tables, block_size, device)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> None:
        attention.write_kv(kv_cache, k, v, meta.slot_mapping)

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float
    ) -> torch.Tensor:
        return attention.paged_attention(q, kv_cache, meta, scale)


class CpuKernelAttentionBackend(TorchAttentionBackend):
    """The reference, with one-query (decode) rows on the in-place paged C++ kernel, prompt
    chunks on the AMX kernel where the CPU has AMX (bf16, head dims of 32k), else on the
    vector kernel where it measured faster than SDPA, and K/V written by one C++ op."""

    name = "cpu"

    def __init__(self) -> None:
        self.amx = bool(torch.ops.headrace.amx_usable())
        # --deterministic: prompt tokens as decode rows (runner/batch_invariance.py).
        self.per_token_prompts = False
        # Prompt chunks without AMX: the vector kernel where it measured faster than SDPA
        # for the shape (runner/cpu_prefill.py); True or False forces it.
        self.vec_prefill: bool | None = None

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> None:
        torch.ops.headrace.write_kv_(kv_cache, k, v, meta.slot_mapping)

    def forward(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float
    ) -> torch.Tensor:
        prefill, dim = None, q.shape[-1]
        if self.amx and q.dtype == torch.bfloat16 and dim % 32 == 0 and dim <= 256:
            prefill = torch.ops.headrace.paged_prefill_attention_
        elif wants_vec_prefill(self.vec_prefill, q, kv_cache, meta):
            prefill = torch.ops.headrace.paged_prefill_attention_vec_
        decode = torch.ops.headrace.paged_decode_attention
        if self.per_token_prompts:
            from runner.batch_invariance import prompt_tokens_as_decode

            prefill = prompt_tokens_as_decode(decode)
        return attention.paged_attention(q, kv_cache, meta, scale, decode, prefill)


def select_attention_backend(
    device: torch.device, kv_heads: int, choice: str = "auto"
) -> AttentionBackend:
    """`auto`: Triton on CUDA when triton imports; on the CPU the C++ kernels when they
    build here; the torch reference everywhere else."""
    if choice not in BACKENDS:
        raise ValueError(f"attention_backend: {choice!r} is not one of {', '.join(BACKENDS)}")
    if device.type == "cpu" and choice in ("auto", "cpu"):
        from runner.cpu_ops import load_cpu_ops

        missing = load_cpu_ops()
        if missing is None:
            return CpuKernelAttentionBackend()
        if choice == "cpu":
            raise ValueError(f"attention_backend: 'cpu' kernels did not build here ({missing})")
        return TorchAttentionBackend()
    if choice == "cpu":
        raise ValueError(f"attention_backend: 'cpu' runs on the CPU, not on {device.type}")
    want_triton = choice == "triton" or (
        choice == "auto" and device.type == "cuda" and triton_available()
    )
    if not want_triton:
        return TorchAttentionBackend()
    if not triton_available():
        raise ValueError("attention_backend: 'triton' needs the triton package")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend: 'triton' on {device.type} runs only in triton's interpreter "
            "(TRITON_INTERPRET=1, for tests); use 'torch' or 'auto'"
        )
    from runner.triton_ops.backend import TritonAttentionBackend

    return TritonAttentionBackend(kv_heads)
