"""LoRA adapters for tests: built with peft on the tiny models, and GGUF copies of them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from model_fixtures import make_tiny_hf_model
from safetensors.torch import load_file
from test_gguf_loader import NAMES, llama_cpp_permute

from runner.attention import build_metadata
from runner.lora import LoRAManager

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    kind: str,
    directory: Path,
    seed: int,
    r: int = 4,
    targets: list[str] | None = None,
    alpha: float = 8.0,
    model_overrides: dict[str, object] | None = None,
    **lora_config: object,
) -> torch.nn.Module:
    """Save a random peft LoRA adapter for the tiny `kind` model (the same weights
    make_tiny_hf_model gives, with `model_overrides`) in `directory`; returns peft's merged
    model (the oracle)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        # Random A and B (peft's default zeroes B, an adapter that changes nothing).
        init_lora_weights=False,
        **lora_config,
    )
    base = make_tiny_hf_model(kind, **(model_overrides or {}))
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(directory)
    return peft_model.merge_and_unload().eval()


def write_gguf_lora(path: Path, peft_dir: Path, hf_config, alpha: float, arch="llama") -> None:
    """The peft adapter as llama.cpp's convert_lora_to_gguf.py lays it out: base tensor
    names + .lora_a/.lora_b, Q/K rows of B permuted for llama-family models."""
    tensors = load_file(str(peft_dir / "adapter_model.safetensors"))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key in sorted(tensors):
        if ".lora_A." not in key:
            continue
        module = key.split(".layers.")[1].removesuffix(".lora_A.weight")  # 0.self_attn.q_proj
        layer, rest = module.split(".", 1)
        a = tensors[key].float().numpy()
        b = tensors[key.replace("lora_A", "lora_B")].float().numpy()
        if arch in ("llama", "mistral") and rest.endswith(("q_proj", "k_proj")):
            heads = hf_config.num_attention_heads
            if rest.endswith("k_proj"):
                heads = hf_config.num_key_value_heads
            b = llama_cpp_permute(b, heads)
        name = f"blk.{layer}.{NAMES[rest]}.weight"
        w.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a))
        w.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def adapted_logits(
    model: torch.nn.Module, manager: LoRAManager | None, adapter, ids: list[int]
) -> torch.Tensor:
    """[T, vocab] logits of one prompt from position 0, through `adapter` (None: base)."""
    cfg = model.config
    caches = [torch.zeros(2, 8, 16, cfg.num_key_value_heads, cfg.head_dim) for _ in model.layers]
    meta = build_metadata([0], [len(ids)], [list(range(8))], 16, torch.device("cpu"))
    with torch.inference_mode():
        if manager is not None:
            manager.begin_step([adapter], [len(ids)])
        try:
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
        finally:
            if manager is not None:
                manager.end_step()
        return model.compute_logits(hidden)
