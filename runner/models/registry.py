"""Built-in architectures, by their HF `architectures` name."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from runner.model_config import ModelConfig
from runner.models.decoder import DecoderForCausalLM

# Bumped when the model interface (constructor, forward, compute_logits, load_weights)
# changes incompatibly; third-party architectures declare the one they target.
MODEL_API_VERSION = 1

# Per-architecture facts that a config.json does not spell out.
BUILTIN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


def apply_architecture_defaults(cfg: ModelConfig) -> ModelConfig:
    return replace(cfg, **BUILTIN_ARCHITECTURES.get(cfg.architecture, {}))


def builtin_model_class(architecture: str) -> type[DecoderForCausalLM] | None:
    return DecoderForCausalLM if architecture in BUILTIN_ARCHITECTURES else None
