"""runner/layers/q8_embedding.py: the token table kept as its Q8_0 blocks, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.layers.linear import Linear
from runner.layers.q8_embedding import Q8Embedding, compress_embedding


def q8_table(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """The floats a GGUF loader makes of a Q8_0 table: fp16 d times int8 q, one |q| = 127 a
    block (as Q8_0 rounds its largest magnitude)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, width // 32, 32), generator=g).float()
    q[..., 0] = torch.where(torch.rand(rows, width // 32, generator=g) < 0.5, -127.0, 127.0)
    d = (torch.rand(rows, width // 32, generator=g) * 0.01 + 1e-4).half().float()
    return (q * d[..., None]).reshape(rows, width)


def test_lookups_return_the_dense_tables_floats_exactly():
    emb = nn.Embedding(300, 96)
    emb.weight.data = q8_table(300, 96)
    q8 = Q8Embedding.from_embedding(emb)
    assert q8 is not None and q8.q.dtype == torch.int8 and q8.d.shape == (300, 3)
    for ids in (torch.arange(300), torch.randint(0, 300, (4, 7)), torch.tensor([5])):
        assert torch.equal(q8(ids), emb(ids)), ids.shape
    assert set(dict(q8.named_buffers())) == {"q", "d"}  # in state_dict: the KV fingerprint


@pytest.mark.parametrize("why", ["not on the grid", "bf16", "width 40"])
def test_tables_not_on_q8_blocks_are_kept(why):
    emb = nn.Embedding(64, 40 if why == "width 40" else 64)
    if why == "not on the grid":
        emb.weight.data = q8_table(64, 64)
        emb.weight.data[3, 5] += 1e-5  # one weight off its block's grid
    elif why == "bf16":
        emb = emb.to(torch.bfloat16)
    assert Q8Embedding.from_embedding(emb) is None


def test_a_tied_head_still_reading_the_table_keeps_it():
    model = nn.Module()
    model.embed_tokens = nn.Embedding(256, 64)
    model.embed_tokens.weight.data = q8_table(256, 64)
    model.lm_head = Linear(64, 256, bias=False)
    model.lm_head.weight = model.embed_tokens.weight  # tied, float format: F.linear reads it
    assert compress_embedding(model) == 0 and type(model.embed_tokens) is nn.Embedding
    dense = model.embed_tokens
    model.lm_head.pack("int8")  # the head has its own copy now
    saved = compress_embedding(model)
    assert isinstance(model.embed_tokens, Q8Embedding)
    assert saved == 256 * 64 * 4 - (256 * 64 + 256 * 2 * 4)
    ids = torch.arange(256)
    assert torch.equal(model.embed_tokens(ids), dense(ids))


def test_smollm2s_table_is_its_q8_0_blocks(smollm):
    # The embedded GGUF keeps token_embd as Q8_0: every weight is found on its block's grid.
    emb = smollm.model.embed_tokens  # the exact path keeps the dense table (tied float head)
    assert type(emb) is nn.Embedding
    q8 = Q8Embedding.from_embedding(emb)
    assert q8 is not None
    ids = torch.arange(emb.num_embeddings)
    assert torch.equal(q8(ids), emb(ids))
