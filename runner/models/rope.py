"""Rotary position embeddings (HF "rotate_half" layout), with llama3 frequency scaling."""

from __future__ import annotations

import math

import torch

from runner.model_config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, after the model's rope scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    if kind == "freq_factors":
        # llama.cpp ships llama3 scaling as a per-frequency divisor tensor (rope_freqs).
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(
        f"rope_scaling: unsupported rope type {kind!r} (supported: linear, llama3, freq_factors)"
    )


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to flattened [T, heads, head_dim] queries and keys at given positions.

    cos/sin are cached per position: cos(p * f) computed once equals the per-step value
    bit for bit, and a gather is cheaper than recomputing it every layer.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float32), inverse_frequencies(cfg)
        )
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        at = self.at(positions)
        return at.rotate(q), at.rotate(k)

    def at(self, positions: torch.Tensor) -> RopeAt:
        """The tables gathered at `positions`: once per forward, shared by every layer."""
        return RopeAt(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


class RopeAt:
    """cos/sin [T, 1, D] of one forward's positions."""

    __slots__ = ("cos", "sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """RoPE on [T, heads, head_dim] (any heads: Q and K may come as one tensor)."""
        return x * self.cos + _rotate_half(x) * self.sin

    def rotate_(self, x: torch.Tensor) -> None:
        """`rotate` in place, as one C++ op (runner/cpu_ops/; CPU tensors)."""
        torch.ops.headrace.rotary_(x, self.cos.squeeze(1), self.sin.squeeze(1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
