"""PEFT's LoRA format: a directory with adapter_config.json and adapter_model.safetensors.

Tensors are named `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ([r,
in]) and `...lora_B.weight` ([out, r]). The scale of a module is `alpha / r` (`alpha /
sqrt(r)` with `use_rslora`), where `alpha_pattern` may override `lora_alpha` per module and
the rank is the tensors' own (`rank_pattern` shows in their shapes). Dropout is a training
matter and is ignored; variants that change the forward (DoRA, trained biases, extra saved
modules) are refused rather than served wrong.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import Any

import orjson
import torch
from safetensors.torch import load

from runner.lora.adapter import LoRAError, RawLoRA

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_NAME = re.compile(r"^(.*\blayers\.(\d+)\.\w+\.(\w+))\.lora_([AB])(?:\.default)?\.weight$")


def read_peft(directory: Path) -> RawLoRA:
    """The LoRA pairs of a PEFT adapter directory; raises LoRAError naming the problem."""
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file():
        raise LoRAError(f"{directory}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    if not weights_file.is_file():
        found = " (only safetensors load; adapter_model.bin is a pickle)"
        bin_there = (directory / "adapter_model.bin").is_file()
        raise LoRAError(f"{directory}: no {WEIGHTS_FILE}{found if bin_there else ''}")
    config_bytes, weights_bytes = config_file.read_bytes(), weights_file.read_bytes()
    try:
        config = orjson.loads(config_bytes)
    except orjson.JSONDecodeError as e:
        raise LoRAError(f"{config_file}: not valid JSON ({e})") from None
    _check_config(config_file, config)
    try:
        tensors = load(weights_bytes)
    except Exception as e:  # safetensors raises its own error types
        raise LoRAError(f"{weights_file}: not a safetensors file ({e})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    layers: dict[str, tuple[int, str]] = {}
    for key, tensor in tensors.items():
        match = _NAME.match(key)
        if match is None:
            raise LoRAError(
                f"{weights_file}: tensor {key!r} is not a LoRA A/B weight of a decoder layer "
                "(adapted embeddings, LM head or biases are not served)"
            )
        full, layer, module, which = match.groups()
        pairs.setdefault(full, {})[which] = tensor
        layers[full] = (int(layer), module)
    modules = {}
    for full, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise LoRAError(f"{weights_file}: {full} has no lora_{missing} weight")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        alpha = float(_pattern(config.get("alpha_pattern"), full, config.get("lora_alpha", 8)))
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[layers[full]] = (a.float(), b.float(), scale)
    digest = hashlib.sha256(config_bytes + weights_bytes).hexdigest()
    return RawLoRA(directory, digest, modules)


def _check_config(config_file: Path, config: Any) -> None:
    if not isinstance(config, dict):
        raise LoRAError(f"{config_file}: must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{config_file}: peft_type {peft_type!r} is not LORA")
    refusals = {
        "use_dora": "DoRA adapters are not served",
        "modules_to_save": "fully trained extra modules (modules_to_save) are not served",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style) weights are not served",
    }
    for key, why in refusals.items():
        if config.get(key):
            raise LoRAError(f"{config_file}: {key} is set: {why}")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{config_file}: bias {config['bias']!r}: trained biases are not served")


def _pattern(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's per-module override: a key matches a module whose name ends with it."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default
