"""A LoRA adapter's weights, checked against the base model they are served over.

An adapter adds `scale * B @ A` to chosen weight matrices: `A [r, in]`, `B [out, r]`. The
readers (peft_format.py, gguf_format.py) turn a file into HF-named pairs in HF's row layout
(llama.cpp's Q/K permutation undone); `check_adapter` validates every pair against the
base's shapes and `--max-lora-rank`, and folds the scale into B, so serving multiplies
`x @ A^T @ B^T` and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from runner.model_config import ModelConfig


class LoRAError(ValueError):
    """An adapter that cannot be served over this base: the message names file and cause."""


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """Where one HF module's delta lands: a module of every decoder layer, and its output
    rows there (a shard of a fused projection such as qkv_proj)."""

    module: str
    rows: slice
    in_features: int

    @property
    def out_features(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass(frozen=True, slots=True)
class LoRABase:
    """What an adapter must match: the base's config and its adaptable modules."""

    config: ModelConfig
    # HF module name ("q_proj") -> where it lives in this model.
    targets: dict[str, LoRATarget]

    @classmethod
    def of(cls, model: nn.Module, config: ModelConfig) -> LoRABase:
        if not hasattr(model, "lora_targets") or not len(model.layers):
            raise LoRAError(f"{type(model).__name__} does not take LoRA adapters")
        layer = model.layers[0]
        targets = {}
        for name, (module, rows) in model.lora_targets().items():
            linear = layer.get_submodule(module)
            targets[name] = LoRATarget(module, rows, linear.in_features)
        return cls(config, targets)


@dataclass(slots=True)
class RawLoRA:
    """An adapter as a reader found it, not yet checked against a base."""

    path: Path
    # sha256 of the files read: with the name, the adapter's identity in the prefix cache.
    digest: str
    # (layer, HF module name) -> (A [r, in], B [out, r], scale), fp32, HF row layout.
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


@dataclass(frozen=True, slots=True, eq=False)
class LoRAAdapter:
    """One adapter, ready to be copied into a resident slot (runner/lora/slots.py)."""

    name: str
    # name + digest of the weights: the prefix-cache key and the --max-loras identity. A
    # different file loaded under the same name gets a different id.
    lora_id: str
    path: Path
    # The largest rank among its modules.
    rank: int
    # (layer, HF module name) -> (A [r, in], B [out, r] with the scale folded in), fp32 CPU.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def merged_delta(self, layer: int, module: str) -> torch.Tensor | None:
        """[out, in] fp32: what this adapter adds to that weight (tests compare with it)."""
        pair = self.weights.get((layer, module))
        return None if pair is None else pair[1] @ pair[0]


def check_adapter(name: str, raw: RawLoRA, base: LoRABase, max_rank: int) -> LoRAAdapter:
    """Validate every pair of `raw` against `base`; raises LoRAError naming the problem."""
    where = raw.path
    if not raw.modules:
        raise LoRAError(f"{where}: the adapter holds no LoRA weights")
    num_layers = base.config.num_hidden_layers
    weights = {}
    for (layer, module), (a, b, scale) in sorted(raw.modules.items()):
        label = f"layers.{layer}.{module}"
        target = base.targets.get(module)
        if target is None:
            raise LoRAError(
                f"{where}: {label} is not a module headrace adapts "
                f"(supported: {', '.join(sorted(base.targets))})"
            )
        if not 0 <= layer < num_layers:
            raise LoRAError(
                f"{where}: {label} is past the base's {num_layers} layers (an adapter for "
                "another base model?)"
            )
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(
                f"{where}: {label} has A {list(a.shape)} and B {list(b.shape)}, which are not "
                "a rank-r pair [r, in] and [out, r]"
            )
        rank = a.shape[0]
        want = (target.in_features, target.out_features)
        if (a.shape[1], b.shape[0]) != want:
            raise LoRAError(
                f"{where}: {label} maps {a.shape[1]} -> {b.shape[0]} features, the base's "
                f"{module} maps {want[0]} -> {want[1]} (an adapter for another base model?)"
            )
        if rank > max_rank:
            raise LoRAError(f"{where}: {label} has rank {rank}, above --max-lora-rank {max_rank}")
        weights[layer, module] = (a.float().contiguous(), (b.float() * scale).contiguous())
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(name, f"{name}:{raw.digest[:16]}", raw.path, rank, weights)


def load_adapter(name: str, path: str | Path, base: LoRABase, max_rank: int) -> LoRAAdapter:
    """Read a PEFT directory (adapter_config.json + adapter_model.safetensors) or a llama.cpp
    GGUF LoRA file, and check it against `base`."""
    path = Path(path)
    if path.is_dir() or path.name == "adapter_config.json":
        from runner.lora.peft_format import read_peft

        raw = read_peft(path if path.is_dir() else path.parent)
    elif path.suffix == ".gguf":
        from runner.lora.gguf_format import read_gguf_lora

        raw = read_gguf_lora(path, base.config)
    elif not path.exists():
        raise LoRAError(f"{path}: no such adapter file or directory")
    else:
        raise LoRAError(
            f"{path}: not a LoRA adapter (a PEFT directory with adapter_config.json, or a "
            ".gguf LoRA file)"
        )
    return check_adapter(name, raw, base, max_rank)
