"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3).

The forward takes the flattened batch: `input_ids[T]`, `positions[T]` and the step's
attention metadata; prompt chunks and decode tokens of different requests share one call,
with no padding. Q/K/V and gate/up projections are fused: fewer, larger matmuls, since on a
CPU the per-op overhead of 30 small layers costs more than their arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from runner.attention import AttentionMetadata
from runner.attention_backends import AttentionBackend, TorchAttentionBackend
from runner.layers.linear import Linear
from runner.model_config import ModelConfig
from runner.models.fused_decode import FusedDecode
from runner.models.rope import RopeAt, RotaryEmbedding
from runner.parallel.group import TensorParallel
from runner.parallel.layers import VocabParallelEmbedding
from runner.parallel.sharding import local_config
from runner.step_interrupt import StepInterrupt


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, as HF does; `fused` runs it as one C++ op (runner/cpu_ops/)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            return torch.ops.headrace.rms_norm(flat, self.weight, self.eps).view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). Fused, both are computed in place: x and
        residual must be tensors this forward owns."""
        if self.fused:
            torch.ops.headrace.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    """GQA self-attention with fused QKV and optional per-head QK norm (Qwen3). Under tensor
    parallelism `cfg` is this rank's share (its heads) and o_proj's output is all-reduced."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        # Set for all layers by DecoderForCausalLM.set_attention_backend (the runner's choice).
        self.backend: AttentionBackend = TorchAttentionBackend()
        self.fused_rope = False

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeAt,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_width = self.q_size + self.kv_size
        v = qkv[:, qk_width:].view(t, self.kv_heads, self.head_dim)  # [T, KVH, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, :qk_width].split([self.q_size, self.kv_size], dim=-1)
            q = rope.rotate(self.q_norm(q.view(t, self.heads, self.head_dim)))  # [T, H, D]
            k = rope.rotate(self.k_norm(k.view(t, self.kv_heads, self.head_dim)))  # [T, KVH, D]
        else:
            # Q and K rotate as one [T, H + KVH, D] tensor: half the RoPE ops of a layer.
            qk = qkv[:, :qk_width].view(t, self.heads + self.kv_heads, self.head_dim)
            if self.fused_rope:
                rope.rotate_(qk)
            else:
                qk = rope.rotate(qk)
            q, k = qk.split([self.heads, self.kv_heads], dim=1)
        # Every new token's K/V is written before any query reads: a chunk attends to itself,
        # and a prefix block filled in this step is already readable by its other users.
        self.backend.write_kv(kv_cache, k, v, meta)
        out = self.backend.forward(q, kv_cache, meta, self.scale)  # [T, H, D]
        out = self.o_proj(out.reshape(t, self.q_size))  # [T, hidden]
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    """SwiGLU feed-forward with one fused gate/up matmul; under tensor parallelism `cfg` is
    this rank's share of the intermediate size and down_proj's output is all-reduced."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.inter = cfg.intermediate_size
        # NOTE: both MLP inputs carry outlier channels that per-token int8 crushes, so both
        # layers keep the float format under int8. Perplexity on 4096 tokens of English
        # (benchmarks/quality_int8.py, SmolLM2): int8 everywhere +6%, down_proj float +2.7%,
        # both float +1.2% (the target is +2%).
        self.gate_up_proj = Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, int8_inputs=False, gated=True
        )
        self.down_proj = Linear(
            cfg.intermediate_size, cfg.hidden_size, bias=False, int8_inputs=False
        )

        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up_proj = self.gate_up_proj
        if self.fused and isinstance(gate_up_proj, Linear):
            out = self.down_proj(gate_up_proj.silu_mul(x))
        elif self.fused:  # a LoRA wrapper adds its delta to gate/up before the activation
            out = self.down_proj(torch.ops.headrace.silu_and_mul(gate_up_proj(x)))
        else:
            gate, up = gate_up_proj(x).split(self.inter, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeAt,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream): the layer's output is their sum, which the next
        norm adds (one fused op instead of an add and a norm)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class DecoderForCausalLM(nn.Module):
    """The whole model. Parameter names follow HF so checkpoints load by name.

    With `tp` it is one rank's shard (runner/parallel/sharding.py): `config` stays the whole
    model's shape, `local_config` is this rank's (its heads, its share of the MLP)."""

    api_version = 1
    # Built as a shard when given `tp` (third-party architectures say so to get TP).
    supports_tensor_parallel = True

    def __init__(
        self, cfg: ModelConfig, max_positions: int | None = None, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        local = cfg if tp is None else local_config(cfg, tp.rank, tp.world_size)
        self.local_config = local
        if tp is None:
            self.embed_tokens: nn.Module = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(local, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        vocab_rows = self.embed_tokens.weight.shape[0]
        self.lm_head = Linear(cfg.hidden_size, vocab_rows, bias=False, per_token=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)
        # Decode-only steps as one C++ call, where every layer qualifies (set with the
        # attention backend: runner/models/fused_decode.py).
        self.fused_decode: FusedDecode | None = None
        # Set by the runner where a step may be stopped between layers (step_interrupt.py).
        self.interrupt: StepInterrupt | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[T] token ids at [T] positions -> [T, hidden] final hidden states."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.at(positions)
        stop = self.interrupt
        if self.fused_decode is not None and self.fused_decode.takes(meta):
            x, residual = self.fused_decode(x, rope, kv_caches, meta, stop)
            return self.norm.add_forward(x, residual)[0]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            if stop is not None:
                stop.check()
            x, residual = layer(x, residual, rope, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Every layer's attention runs on `backend`, whose metadata the runner builds. The
        `cpu` backend also brings the fused elementwise C++ ops (norms, SiLU-and-mul, RoPE);
        every other backend keeps the eager reference formulas."""
        fused = backend.name == "cpu"
        for layer in self.layers:
            layer.self_attn.backend = backend
            layer.self_attn.fused_rope = fused
            layer.mlp.fused = fused
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fused = fused
        self.refresh_fused_decode()

    def refresh_fused_decode(self) -> None:
        """Decide again whether decode-only steps run as one C++ call: after anything that
        changes the layers' kernels (formats, small-batch copies, LoRA wrappers)."""
        self.fused_decode = FusedDecode.build(list(self.layers))

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32 logits, only for the rows that sample (`widen`
        False: in the model's dtype, for the sampler, which widens what it processes).
        Under tensor parallelism every rank computes its vocabulary rows and rank 0 gets
        them all, in fp32 (the other ranks get None)."""
        logits = self.lm_head(hidden)  # [N, V or V_local]
        if widen or self.tp is not None:
            logits = logits.float()
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up into their packed parameters."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip
        seen = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.split(".")
            target, shard = name, None
            for i, part in enumerate(parts):
                if part in fused:
                    packed, shard = fused[part]
                    target = ".".join([*parts[:i], packed, *parts[i + 1 :]])
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    param[self._shard_rows(target, shard)].copy_(tensor)
            seen.add((target, shard))
        missing = {n for n in params if not any(t == n for t, _ in seen)}
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {sorted(missing)[:5]}")

    def lora_targets(self) -> dict[str, tuple[str, slice]]:
        """The HF module names a LoRA adapter may target -> (the module of a decoder layer
        that computes it, its output rows there): q/k/v share qkv_proj, gate/up gate_up_proj."""
        cfg = self.config
        hidden = slice(0, cfg.hidden_size)
        targets = {"o_proj": ("self_attn.o_proj", hidden), "down_proj": ("mlp.down_proj", hidden)}
        for packed, names in (
            ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
            ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
        ):
            for shard, name in enumerate(names):
                targets[name] = (packed, self._shard_rows(packed, shard))
        return targets

    def _shard_rows(self, target: str, shard: int) -> slice:
        cfg = self.local_config
        if "qkv_proj" in target:
            sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])
