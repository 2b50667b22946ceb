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
from runner.loader import load_model, model_linears, open_checkpoint
from runner.model_config import ModelConfig
from runner.model_source import resolve_model
from runner.models.decoder import DecoderForCausalLM
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

    @classmethod
    def load(cls, config: EngineConfig) -> LoadedModel:
        device = pick_device(config.device)
        source = resolve_model(config.model)
        checkpoint = open_checkpoint(source)
        platform = select_platform(
            device,
            config.dtype,
            config.quantization,
            checkpoint_quantized=checkpoint.is_quantized(),
            linears=model_linears(checkpoint, load_model_class),
            deterministic=config.deterministic,
        )
        t0 = time.perf_counter()
        model, model_config = load_model(
            source, device, platform.dtype, lookup=load_model_class, checkpoint=checkpoint
        )
        platform.prepare(model)
        log.info("%s", platform.describe())  # after prepare: it measures and adds reasons
        tokenizer = load_tokenizer(source)
        log.info("loaded %s in %.1fs", source.name, time.perf_counter() - t0)
        return cls(model, model_config, tokenizer, source.name, device, platform.dtype, platform)


def pick_device(name: str) -> torch.device:
    """`auto`: CUDA when torch sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
