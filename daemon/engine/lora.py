"""LoRA serving for the engine: the adapters it serves (by name) and the runner's manager.

LoRA is on when `lora_modules` names adapters or runtime updates are enabled; otherwise
nothing is installed and the model runs exactly as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch
from torch import nn

from daemon.engine.client import AdapterInfo
from daemon.engine.config import EngineConfig
from runner.lora import LoRAAdapter, LoRABase, LoRAManager, LoRARegistry
from runner.model_config import ModelConfig

log = logging.getLogger("headrace.engine")


def lora_enabled(config: EngineConfig) -> bool:
    return bool(config.lora_modules) or config.enable_lora_runtime_updates


def parse_lora_modules(entries: Sequence[str]) -> list[tuple[str, str]]:
    """`name=path` entries -> (name, path); raises ValueError naming a malformed entry."""
    out: list[tuple[str, str]] = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: {entry!r} is not name=path")
        if any(name.strip() == seen for seen, _ in out):
            raise ValueError(f"lora_modules: the name {name.strip()!r} is given twice")
        out.append((name.strip(), path.strip()))
    return out


def setup_lora(
    model: nn.Module,
    model_config: ModelConfig,
    model_name: str,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[LoRARegistry, LoRAManager]:
    """Read and check every `lora_modules` adapter (a bad one fails start-up naming its
    file), then install the LoRA wrappers on `model`."""
    base = LoRABase.of(model, model_config)
    registry = LoRARegistry(base, config.max_lora_rank)
    for name, path in parse_lora_modules(config.lora_modules):
        if name == model_name:
            raise ValueError(f"lora_modules: {name!r} is the base model's own name")
        adapter = registry.load(name, path)
        log.info("LoRA adapter %s: %s, rank %d (%s)", name, path, adapter.rank, adapter.lora_id)
    manager = LoRAManager.attach(model, base, config.max_loras, config.max_lora_rank, device, dtype)
    return registry, manager


def adapter_info(adapter: LoRAAdapter) -> AdapterInfo:
    return AdapterInfo(adapter.name, str(adapter.path), adapter.rank, adapter.lora_id)


async def load_at_run_time(
    registry: LoRARegistry | None, model_name: str, name: str, path: str
) -> AdapterInfo:
    """Read and check an adapter off the event loop, then serve it; ValueError (LoRAError)
    names a bad name or file, and nothing changes."""
    if registry is None:
        raise ValueError("lora: runtime LoRA updates are off (--enable-lora-runtime-updates)")
    if name == model_name or name in registry:
        raise ValueError(f"lora_name: {name!r} is served already")
    adapter = await asyncio.to_thread(registry.read, name, path)
    registry.add(adapter)
    log.info("LoRA adapter %s loaded from %s (%s)", name, path, adapter.lora_id)
    return adapter_info(adapter)
