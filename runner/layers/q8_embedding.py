"""A token embedding kept as 8-bit blocks (GGUF's Q8_0 numbers) where the weights are on them.

GGUF files keep `token_embd` as Q8_0 (SmolLM2's too, its other weights Q4_1): per 32 values
of a row an fp16 scale d and int8 q, |q| <= 127. The loader hands the model the floats d * q,
a quarter of which is all the table needs. As with Q4_1 (q4_blocks.py) the blocks are found
again: Q8_0 maps a block's largest magnitude to |q| = 127, so d = amax / 127 and q = w / d.
d has 11 significant bits and q 8, so every d * q is exact in fp32: the table is kept as
blocks only where multiplying them back gives every weight bit for bit, and a lookup returns
the very floats of the dense table (49152 x 576 on SmolLM2: 32 MB against 113 MB).
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK = 32  # values per scale, as Q8_0


class Q8Embedding(nn.Module):
    """nn.Embedding's lookup over int8 blocks and their fp32 scales (`from_embedding`)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor) -> None:
        super().__init__()
        # Buffers: they are the weights, and state_dict (the KV layout's fingerprint) sees them.
        self.register_buffer("q", q)  # [V, H] int8
        self.register_buffer("d", d)  # [V, H / 32] fp32
        self.num_embeddings, self.embedding_dim = q.shape

    @classmethod
    def from_embedding(cls, emb: nn.Embedding) -> Q8Embedding | None:
        """The table as Q8_0 blocks, or None where some weight is not d * q of its block
        (not fp32, a width off the 32-value grid, or weights that never were Q8_0)."""
        w = emb.weight.detach()
        if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % BLOCK:
            return None
        blocks = w.reshape(w.shape[0], -1, BLOCK)
        d = blocks.abs().amax(dim=2) / 127
        q = (blocks / torch.where(d > 0, d, 1.0)[..., None]).round_()
        if not torch.equal(q * d[..., None], blocks):
            return None
        return cls(q.to(torch.int8).reshape(w.shape), d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, d = self.q[ids], self.d[ids]
        rows = q.shape[:-1]
        out = q.view(*rows, -1, BLOCK).to(torch.float32) * d.unsqueeze(-1)
        return out.view(*rows, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q8_0 blocks"


def compress_embedding(model: nn.Module) -> int:
    """Swap `model.embed_tokens` for its Q8_0 blocks where it is a plain nn.Embedding on
    them and no LM head still multiplies by its weight (a tied head in the float format);
    the bytes saved (0: kept as it was)."""
    emb = getattr(model, "embed_tokens", None)
    if type(emb) is not nn.Embedding:
        return 0
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(head, "weight", None) is emb.weight:
        return 0
    q8 = Q8Embedding.from_embedding(emb)
    if q8 is None:
        return 0
    model.embed_tokens = q8
    kept = sum(t.numel() * t.element_size() for t in (q8.q, q8.d))
    return emb.weight.numel() * emb.weight.element_size() - kept
