"""GGUF files through the `gguf` package, dequantised to fp32 at load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from runner.model_config import ModelConfig
from runner.parallel.sharding import Ranges, ShardPlan

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_TYPES = {
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K,
}  # fmt: skip
QUANTIZED_TYPES = SUPPORTED_TYPES - {Q.F32, Q.F16, Q.BF16}
# llama.cpp converts these with Q/K rows permuted for its interleaved RoPE.
PERMUTED_QK = {"llama", "mistral"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFModel:
    """An open GGUF file: its config, and its tensors on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = GGUFReader(self.path)
        self.arch = self._field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"{self.path.name}: unsupported GGUF architecture {self.arch!r} "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        for t in self.reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"{self.path.name}: tensor {t.name} uses unsupported quant type "
                    f"{t.tensor_type.name} (supported: "
                    f"{', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )

    def is_quantized(self) -> bool:
        """Whether any matrix is stored in a quantised type (Q4_1, Q8_0, ...)."""
        return any(t.tensor_type in QUANTIZED_TYPES for t in self.reader.tensors)

    def _field(self, key: str, default: object = None) -> object:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _vocab_size(self) -> int:
        # The token list's length without decoding 50k strings (contents() would).
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            return len(tokens.data)
        return int(self._field(f"{self.arch}.vocab_size"))

    def config(self) -> ModelConfig:
        a = self.arch
        heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        names = {t.name for t in self.reader.tensors}
        eos = self._field("tokenizer.ggml.eos_token_id")
        rope_scaling = None
        if "rope_freqs.weight" in names:
            factors = self._tensor("rope_freqs.weight").tolist()
            rope_scaling = {"rope_type": "freq_factors", "factors": factors}
        return ModelConfig(
            architecture=ARCHITECTURES[a],
            vocab_size=self._vocab_size(),
            hidden_size=hidden,
            intermediate_size=int(self._field(f"{a}.feed_forward_length")),
            num_hidden_layers=int(self._field(f"{a}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self._field(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(self._field(f"{a}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(self._field(f"{a}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
        )

    def _tensor(self, name: str) -> torch.Tensor:
        return _dequantize(next(t for t in self.reader.tensors if t.name == name))

    def weights(
        self, cfg: ModelConfig, shard: ShardPlan | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named fp32 tensors, with llama.cpp's Q/K row permutation undone. With `shard`
        each tensor is dequantised alone and cut to this rank's slice before the next one:
        a rank holds one whole fp32 tensor at a time, never the model."""
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                continue
            name = _hf_name(t.name)
            w = _dequantize(t)
            if self.arch in PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                w = unpermute_qk(w, heads)
            where = shard.select(name) if shard is not None else None
            yield name, (w if where is None else _cut(w, *where))


def _cut(w: torch.Tensor, dim: int, ranges: Ranges) -> torch.Tensor:
    return torch.cat([w.narrow(dim, a, b - a) for a, b in ranges], dim).contiguous()


def _dequantize(t: ReaderTensor) -> torch.Tensor:
    # np.array copies: the reader's arrays are read-only views of a memory map.
    return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), np.float32))


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{'.'.join(parts[3:])}"


def unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of Q/K rows.

    llama.cpp stores each head's rows as interleaved (re, im) pairs for its RoPE; HF's
    rotate_half wants the first half of the head's rows then the second half.
    """
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
