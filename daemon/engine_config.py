"""Every knob of the engine, with defaults a user can reason about."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    """What model to run, where, and under which budgets."""

    # GGUF file or HF directory; None serves the embedded SmolLM2-135M-Instruct.
    model: str | None = None
    # "cpu", "cuda", "cuda:1", or "auto" (CUDA when available).
    device: str = "auto"
    # "auto": float32 on CPU (bf16 matmuls are ~1 GFLOP/s without AVX-512/AMX), bfloat16 on CUDA.
    dtype: str = "auto"
    block_size: int = 16
    # Bytes of KV cache; None: a quarter of available RAM on CPU (at most 2 GiB), or
    # gpu_memory_utilization of the free device memory after loading the weights.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    # None: the model's context length, capped at 8192 tokens.
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0
    max_waiting: int = 0
    enable_prefix_caching: bool = True
    prefix_cache_hash: str = "sha256"
    policy: str = "fcfs"
    # torch intra-op threads; None: all cores but one on CPU, so the event loop, tokenizer
    # and HTTP keep a core and never stall a libgomp team (which spins when a core is taken).
    threads: int | None = None


def default_threads() -> int:
    return max(1, (os.cpu_count() or 1) - 1)
