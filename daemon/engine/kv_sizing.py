"""How many KV blocks an engine gets: its memory budget over one block's bytes.

The budget is `--kv-cache-memory`, else a fraction of free device memory on CUDA (less the
decode graphs' pool), else min(available RAM / 4, 1 GiB) on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from daemon.engine.config import EngineConfig
from runner.model_config import ModelConfig
from runner.model_runner import kv_bytes_per_block
from runner.models.decoder import DecoderForCausalLM
from runner.parallel.sharding import max_kv_heads_per_rank


def uses_cuda_graphs(config: EngineConfig, device: torch.device) -> bool:
    """CUDA graphs need CUDA and the Triton backend, one rank; --enforce-eager turns them off."""
    from runner.triton_ops import triton_available

    # Under tensor parallelism every forward is a collective the workers replay eagerly.
    if config.enforce_eager or device.type != "cuda" or config.tensor_parallel_size > 1:
        return False
    backend = config.attention_backend
    return backend == "triton" or (backend == "auto" and triton_available())


def num_kv_blocks(
    config: EngineConfig,
    model: DecoderForCausalLM,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    max_model_len: int,
) -> int:
    """Blocks for the cache's rows of `kv_dtype` (the model's `dtype`, or int8)."""
    # Under tensor parallelism every rank holds the same blocks of its own KV heads: the
    # budget is per rank, sized for the rank that holds the most heads.
    local = model_config
    if config.tensor_parallel_size > 1:
        heads = max_kv_heads_per_rank(model_config, config.tensor_parallel_size)
        local = replace(model_config, num_key_value_heads=heads)
    per_block = kv_bytes_per_block(local, config.block_size, kv_dtype)
    budget = config.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.gpu_memory_utilization)
            if uses_cuda_graphs(config, device):
                budget -= _graph_memory(config, model, model_config, device, dtype, max_model_len)
        else:
            budget = min(available_ram() // 4, 1 << 30)
    if budget < per_block:
        raise ValueError(
            f"kv_cache_memory: {budget} bytes holds no block ({per_block} bytes per block)"
        )
    return budget // per_block


def _graph_memory(
    config: EngineConfig,
    model: DecoderForCausalLM,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> int:
    """The decode graphs' pool, measured on a throwaway cache before the real one exists."""
    from runner.attention_backends import select_attention_backend
    from runner.cuda_graphs import estimate_graph_memory

    cfg = model_config
    backend = select_attention_backend(device, cfg.num_key_value_heads, config.attention_backend)
    model.set_attention_backend(backend)
    shape = (2, 1, config.block_size, cfg.num_key_value_heads, cfg.head_dim)
    return estimate_graph_memory(model, shape, dtype, config.max_num_seqs, max_model_len, device)


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
