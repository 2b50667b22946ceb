"""A model's KV layout key: what makes one engine's stored blocks usable by another."""

from __future__ import annotations

import hashlib

import torch

from kvcache.connectors import KVLayout
from runner import kv_format
from runner.model_config import ModelConfig

# Elements of each tensor that go into the weights' fingerprint.
_SAMPLE = 1024


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the loaded weights (names, shapes, dtypes and a sample of each tensor).

    NOTE: taken from the weights as loaded, so two engines agree exactly when they would
    compute the same KV: same checkpoint and the same weight format (int8 or not).
    """
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        sample = t.detach().reshape(-1)[:_SAMPLE].cpu().contiguous()
        try:
            h.update(sample.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):
            h.update(str(sample.tolist()).encode())
    return h.hexdigest()[:32]


def model_layout(
    model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype, block_size: int
) -> KVLayout:
    """The layout of a cache of `dtype` rows (the model's, or int8, whose rows carry their
    scale: `head_dim` is then the stored row's width, so a block's bytes follow from it)."""
    return KVLayout(
        model=f"{cfg.architecture}:{weights_fingerprint(model)}",
        dtype=str(dtype).removeprefix("torch."),
        block_size=block_size,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=kv_format.row_width(cfg.head_dim, dtype),
    )
