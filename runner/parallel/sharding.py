"""Which slice of each weight a tensor-parallel rank holds (Megatron-style). Torch-free.

```
qkv_proj, gate_up_proj   column-parallel: each rank computes its own output rows (its heads,
                         its share of the MLP), from the whole input; no communication
o_proj, down_proj        row-parallel: each rank multiplies its share of the input columns;
                         the partial sums are all-reduced (one all-reduce per block)
embed_tokens, lm_head    vocab-parallel: each rank holds ceil(V / N) vocabulary rows; the
                         embedding all-reduces, the LM head's logits are gathered to rank 0
norms, RoPE              replicated
```

KV heads: with at least N KV heads, each rank takes whole GQA groups (a KV head and the
query heads that read it), as evenly as the count allows: KVH / N each when it divides
(vLLM's rule), else some ranks one group more (SmolLM2's 3 KV heads over 2 ranks: 1 and 2).
With fewer KV heads than ranks the query heads split evenly and each rank holds the KV heads
they read (replicated, as vLLM does). Query heads are cut in runs of g' = gcd(group, first
head, count) that read one KV head each, so every rank's heads form uniform GQA groups,
which the attention kernels need. The MLP's intermediate rows split as evenly as they go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from runner.model_config import ModelConfig

# (start, stop) ranges of one dimension, concatenated in order.
Ranges = list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """The attention heads one rank holds."""

    q_heads: range
    # Original KV head of each local KV head, in order (repeats where heads are replicated).
    kv_heads: tuple[int, ...]

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world: int) -> HeadSplit:
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        group = heads // kv  # query heads per KV head
        if kv >= world:  # whole groups per rank
            groups = even_share(kv, rank, world)
            q = range(groups.start * group, groups.stop * group)
            return cls(q, tuple(groups))
        if heads < world:
            raise ValueError(
                f"tensor_parallel_size: {world} ranks exceed the {heads} attention heads"
            )
        q = even_share(heads, rank, world)
        run = math.gcd(group, q.start, len(q))
        return cls(q, tuple((q.start + j * run) // group for j in range(len(q) // run)))


def even_share(n: int, rank: int, world: int) -> range:
    """Rank `rank`'s contiguous share of n items, sizes differing by at most one."""
    return range(rank * n // world, (rank + 1) * n // world)


def max_kv_heads_per_rank(cfg: ModelConfig, world: int) -> int:
    """The most KV heads any rank holds: every rank allocates the same number of blocks."""
    return max(len(HeadSplit.of(cfg, r, world).kv_heads) for r in range(world))


def vocab_shard(vocab: int, rank: int, world: int) -> range:
    """The vocabulary rows rank `rank` holds: ceil(V / N) each, the last rank fewer."""
    per = -(-vocab // world)
    return range(min(vocab, rank * per), min(vocab, (rank + 1) * per))


def vocab_per_rank(vocab: int, world: int) -> int:
    return -(-vocab // world)


def local_config(cfg: ModelConfig, rank: int, world: int) -> ModelConfig:
    """The shape of one rank's layers: its heads, its share of the MLP (hidden size whole)."""
    split = HeadSplit.of(cfg, rank, world)
    return replace(
        cfg,
        num_attention_heads=len(split.q_heads),
        num_key_value_heads=len(split.kv_heads),
        intermediate_size=len(even_share(cfg.intermediate_size, rank, world)),
    )


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """For each HF-named checkpoint tensor, the dimension and ranges this rank loads.

    `select(name)` -> (dim, ranges), or None for a tensor every rank holds whole.
    """

    cfg: ModelConfig
    rank: int
    world: int

    def select(self, name: str) -> tuple[int, Ranges] | None:
        cfg, head = self.cfg, self.cfg.head_dim
        split = HeadSplit.of(cfg, self.rank, self.world)
        leaf = name.rsplit(".", 2)
        module, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", "")
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = vocab_shard(cfg.vocab_size, self.rank, self.world)
            return 0, [(rows.start, rows.stop)]
        if module == "q_proj":
            q = split.q_heads
            return 0, [(q.start * head, q.stop * head)]
        if module in ("k_proj", "v_proj"):
            return 0, [(h * head, (h + 1) * head) for h in split.kv_heads]
        share = even_share(cfg.intermediate_size, self.rank, self.world)
        mlp = (share.start, share.stop)
        if module in ("gate_proj", "up_proj"):
            return 0, [mlp]
        if module == "down_proj" and kind == "weight":
            return 1, [mlp]
        if module == "o_proj" and kind == "weight":
            q = split.q_heads
            return 1, [(q.start * head, q.stop * head)]
        return None


def cores_of_rank(cores: list[int], rank: int, world: int) -> list[int]:
    """Rank `rank`'s share of `cores` (contiguous, as even as the count allows)."""
    if len(cores) < world:
        return [cores[rank % len(cores)]]
    return cores[rank * len(cores) // world : (rank + 1) * len(cores) // world]
