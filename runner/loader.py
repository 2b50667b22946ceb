"""Build a model from a ModelSource: config, architecture class, weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from runner.layers.linear import LinearShape, linear_shapes
from runner.loaders.hf_loader import HFDirectory
from runner.model_config import ModelConfig
from runner.model_source import ModelSource
from runner.models.decoder import DecoderForCausalLM
from runner.models.registry import apply_architecture_defaults, builtin_model_class
from runner.models.rope import RotaryEmbedding
from runner.parallel.group import TensorParallel
from runner.parallel.sharding import ShardPlan

if TYPE_CHECKING:
    from runner.loaders.gguf_loader import GGUFModel

ModelClassLookup = Callable[[str], type]


def open_checkpoint(source: ModelSource) -> GGUFModel | HFDirectory:
    if source.gguf_file:
        # The gguf package is needed for GGUF files only (a GPU box may lack it).
        from runner.loaders.gguf_loader import GGUFModel

        return GGUFModel(source.gguf_file)
    return HFDirectory(source.path)


def _architecture(
    checkpoint: GGUFModel | HFDirectory, lookup: ModelClassLookup | None
) -> tuple[ModelConfig, type]:
    cfg = apply_architecture_defaults(checkpoint.config())
    cls = builtin_model_class(cfg.architecture)
    if cls is None:
        if lookup is None:
            raise ValueError(f"unsupported model architecture {cfg.architecture!r}")
        cls = lookup(cfg.architecture)
    return cfg, cls


def _build(cls: type, cfg: ModelConfig, max_positions: int | None, tp: TensorParallel | None):
    if tp is None:
        return cls(cfg, max_positions)
    if not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(
            f"tensor_parallel_size: the {cfg.architecture} architecture ({cls.__name__}) "
            "does not support tensor parallelism"
        )
    return cls(cfg, max_positions, tp=tp)


def model_linears(
    checkpoint: GGUFModel | HFDirectory,
    lookup: ModelClassLookup | None = None,
    tp: TensorParallel | None = None,
) -> list[LinearShape]:
    """The model's (or this rank's shard's) linear layer shapes, from an instance on the
    meta device (no weights)."""
    cfg, cls = _architecture(checkpoint, lookup)
    with torch.device("meta"):
        return linear_shapes(_build(cls, cfg, None, tp))


def load_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    lookup: ModelClassLookup | None = None,
    max_positions: int | None = None,
    checkpoint: GGUFModel | HFDirectory | None = None,
    tp: TensorParallel | None = None,
) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Instantiate the architecture and load its weights. `lookup` resolves architectures
    that are not built in (the daemon passes the `headrace.models` plugin registry);
    `checkpoint` reuses a file the caller already opened; with `tp` only this rank's shard
    is built and read (runner/parallel/sharding.py)."""
    checkpoint = checkpoint or open_checkpoint(source)
    cfg, cls = _architecture(checkpoint, lookup)
    # Built on the meta device: no time is spent on a random init the weights overwrite.
    # Parameters are allocated once, on the device and in the target dtype; each checkpoint
    # tensor is converted as it is copied in, so no fp32 copy of the whole model exists.
    with torch.device("meta"):
        model = _build(cls, cfg, max_positions, tp).to(dtype)
    model = model.to_empty(device=device)
    # to_empty unties shared parameters and leaves computed buffers empty: redo both.
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings).to(device)
    shard = None if tp is None else ShardPlan(cfg, tp.rank, tp.world_size)
    model.load_weights(checkpoint.weights(cfg, shard) if shard else checkpoint.weights(cfg))
    return model.to(dtype).eval(), cfg  # the RoPE tables follow the activations' dtype
