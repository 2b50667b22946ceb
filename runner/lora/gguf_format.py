"""llama.cpp's LoRA files: a GGUF of `general.type = adapter`, `adapter.type = lora`.

Tensors are the base's names plus `.lora_a` ([r, in] in torch's order) and `.lora_b`
([out, r]); `adapter.lora.alpha` gives the scale `alpha / r` (llama.cpp's rule: 1 when
alpha is 0). llama.cpp's converter permutes the Q/K rows of Llama-family models for its
interleaved RoPE, and for an adapter that permutation lands on B (A maps inputs, which are
not permuted): B is unpermuted here exactly as the GGUF loader unpermutes the base's
weights, so the pair matches the HF layout every loaded base has.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from gguf import GGUFReader

from runner.loaders.gguf_loader import (
    ARCHITECTURES,
    PERMUTED_QK,
    _dequantize,
    _hf_name,
    unpermute_qk,
)
from runner.lora.adapter import LoRAError, RawLoRA
from runner.model_config import ModelConfig

# llama.cpp converts Mistral checkpoints with the llama architecture: one family.
_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama"}


def read_gguf_lora(path: Path, base: ModelConfig) -> RawLoRA:
    """The LoRA pairs of a GGUF adapter file; raises LoRAError naming the problem."""
    if not path.is_file():
        raise LoRAError(f"{path}: no such adapter file")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises plain ValueErrors and struct errors
        raise LoRAError(f"{path}: not a GGUF file ({e})") from None

    def field(key: str) -> object:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        kinds = f"general.type {field('general.type')!r}, adapter.type {field('adapter.type')!r}"
        raise LoRAError(f"{path}: a GGUF file, but not a LoRA adapter ({kinds})")
    arch = str(field("general.architecture"))
    if arch not in ARCHITECTURES:
        raise LoRAError(f"{path}: adapter for unsupported architecture {arch!r}")
    base_family = _FAMILY.get(base.architecture, base.architecture)
    if _FAMILY.get(ARCHITECTURES[arch], ARCHITECTURES[arch]) != base_family:
        raise LoRAError(f"{path}: adapter for a {arch} model, the base is {base.architecture}")
    alpha = float(field("adapter.lora.alpha") or 0.0)
    pairs: dict[str, dict[str, object]] = {}
    for t in reader.tensors:
        stem, _, which = t.name.rpartition(".")
        if which not in ("lora_a", "lora_b"):
            raise LoRAError(f"{path}: tensor {t.name!r} is not a LoRA A/B weight")
        pairs.setdefault(stem, {})[which] = t
    modules = {}
    for stem, pair in pairs.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise LoRAError(
                f"{path}: {stem} lacks its {'lora_b' if 'lora_a' in pair else 'lora_a'}"
            )
        try:
            hf = _hf_name(stem)  # layers.{i}.self_attn.q_proj.weight
        except ValueError:
            raise LoRAError(
                f"{path}: {stem} is not a decoder-layer weight headrace adapts"
            ) from None
        _, layer, *_, module, _ = hf.split(".")
        a, b = _dequantize(pair["lora_a"]), _dequantize(pair["lora_b"])  # type: ignore[arg-type]
        if arch in PERMUTED_QK and module in ("q_proj", "k_proj") and b.ndim == 2:
            heads = base.num_attention_heads if module == "q_proj" else base.num_key_value_heads
            if b.shape[0] % (2 * heads) == 0:  # else check_adapter names the wrong shape
                b = unpermute_qk(b, heads)
        rank = a.shape[0] if a.ndim == 2 else 1
        modules[int(layer), module] = (a, b, alpha / rank if alpha else 1.0)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return RawLoRA(path, digest, modules)
