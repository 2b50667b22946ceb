"""The shape of a decoder-only transformer, independent of the file it was loaded from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ModelConfig:
    """Hyperparameters of the Llama/Qwen family (HF `config.json` names where they exist)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_scaling` dict (e.g. {"rope_type": "llama3", "factor": 8, ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # Qwen2 has biases on the Q/K/V projections.
    attention_bias: bool = False
    # Qwen3 normalises each query and key head (RMSNorm over head_dim) before RoPE.
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a parsed HF `config.json`."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", "default") == "default":
            rope_scaling = None
        return cls(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )
