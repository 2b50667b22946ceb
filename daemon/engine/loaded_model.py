"""A model ready to serve: weights in their platform's format, shape and tokenizer.

Loaded once; engines share one `LoadedModel` (weights are read-only).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from daemon.engine.config import EngineConfig
from plugins import load_model_class
from runner.heap import trim_heap
from runner.loader import load_model, model_linears, open_checkpoint
from runner.model_config import ModelConfig
from runner.model_source import ModelSource, resolve_model
from runner.models.decoder import DecoderForCausalLM
from runner.parallel.driver import TensorParallelDriver, ring_slot_bytes
from runner.parallel.group import TensorParallel
from runner.platform import Platform, select_platform
from runner.tokenizer import load_tokenizer

log = logging.getLogger("headrace.engine")


@dataclass(slots=True)
class LoadedModel:
    """Weights, shape and tokenizer of a model; engines can share one (weights are read-only)."""

    model: DecoderForCausalLM
    config: ModelConfig
    tokenizer: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    platform: Platform | None = None
    # Tensor parallelism: rank 0's handle on the workers (the model is its shard).
    tp_driver: TensorParallelDriver | None = None

    @classmethod
    def load(cls, config: EngineConfig) -> LoadedModel:
        device = pick_device(config.device)
        source = resolve_model(config.model)
        checkpoint = open_checkpoint(source)
        world = config.tensor_parallel_size
        if world < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, not {world}")
        # Rank 0's shard shapes decide the platform (the int8 micro-benchmark times them).
        shape_of = TensorParallel(0, world) if world > 1 else None
        platform = select_platform(
            device,
            config.dtype,
            config.quantization,
            checkpoint_quantized=checkpoint.is_quantized(),
            linears=model_linears(checkpoint, load_model_class, tp=shape_of),
            deterministic=config.deterministic,
        )
        t0 = time.perf_counter()
        driver = _start_workers(config, source, platform) if world > 1 else None
        try:
            model, model_config = load_model(
                source,
                device,
                platform.dtype,
                lookup=load_model_class,
                checkpoint=checkpoint,
                tp=driver.tp if driver else None,
            )
        except Exception:
            if driver is not None:
                driver.close()
            raise
        platform.prepare(model, config.max_num_batched_tokens)
        log.info("%s", platform.describe())  # after prepare: it measures and adds reasons
        log.info("returned %.0f MB of heap the load freed", trim_heap() / 1e6)
        tokenizer = load_tokenizer(source)
        log.info("loaded %s in %.1fs", source.name, time.perf_counter() - t0)
        return cls(
            model, model_config, tokenizer, source.name, device, platform.dtype, platform, driver
        )


def _start_workers(
    config: EngineConfig, source: ModelSource, platform: Platform
) -> TensorParallelDriver:
    """Spawn ranks 1..N-1; they load their shards while this process loads rank 0's."""
    if config.lora_modules or config.enable_lora_runtime_updates:
        raise ValueError("tensor_parallel_size: LoRA adapters are not served under TP yet")
    if config.kv_connector != "none":
        raise ValueError("tensor_parallel_size: KV connectors do not run under TP yet")
    # The longest block table a step may carry: the model length bounds it (131072 when
    # the configured one is not known before the model is read).
    blocks = -(-(config.max_model_len or 131072) // config.block_size)
    slot = ring_slot_bytes(config.max_num_batched_tokens, config.max_num_seqs, blocks)
    return TensorParallelDriver(
        config.tensor_parallel_size,
        source,
        platform,
        load_model_class,
        config.tensor_parallel_timeout,
        slot,
        threads=config.threads,
    )


def pick_device(name: str) -> torch.device:
    """`auto`: CUDA when torch sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
