"""The one layer tensor parallelism adds: an embedding split by vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runner.parallel.group import TensorParallel
from runner.parallel.sharding import vocab_shard


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token outside them looks up zeros, and the
    all-reduce adds the one rank's row that holds it (exact: the rest are zeros)."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.rows = vocab_shard(vocab, tp.rank, tp.world_size)
        self.weight = nn.Parameter(torch.empty(len(self.rows), hidden))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.rows.start) | (ids >= self.rows.stop)  # [T]
        local = (ids - self.rows.start).masked_fill_(outside, 0)
        x = F.embedding(local, self.weight)  # [T, hidden]
        x.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)
