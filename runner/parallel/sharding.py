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

KV heads: query heads split evenly (H % N == 0). A rank's Hl = H / N query heads are cut in
runs of g' = gcd(H / KVH, Hl) consecutive heads; each run reads one KV head, so a rank holds
Hl / g' KV heads. When KVH divides by N that is KVH / N heads each (nothing repeated); when
KVH < N each rank holds the one head its queries read (replicated, as vLLM does); when KVH
does not divide by N (KVH=3, N=2) the heads a rank's queries straddle are repeated so that
every rank's query heads still form uniform GQA groups, which the attention kernels need.
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
        if heads % world:
            raise ValueError(
                f"tensor_parallel_size: {world} does not divide the {heads} attention heads"
            )
        local = heads // world
        group = heads // kv  # query heads per KV head
        run = math.gcd(group, local)
        first = rank * local
        kv_heads = tuple((first + j * run) // group for j in range(local // run))
        return cls(range(first, first + local), kv_heads)


def vocab_shard(vocab: int, rank: int, world: int) -> range:
    """The vocabulary rows rank `rank` holds: ceil(V / N) each, the last rank fewer."""
    per = -(-vocab // world)
    return range(min(vocab, rank * per), min(vocab, (rank + 1) * per))


def vocab_per_rank(vocab: int, world: int) -> int:
    return -(-vocab // world)


def local_config(cfg: ModelConfig, rank: int, world: int) -> ModelConfig:
    """The shape of one rank's layers: its heads, its share of the MLP (hidden size whole)."""
    if cfg.intermediate_size % world:
        raise ValueError(
            f"tensor_parallel_size: {world} does not divide the intermediate size "
            f"{cfg.intermediate_size}"
        )
    split = HeadSplit.of(cfg, rank, world)
    return replace(
        cfg,
        num_attention_heads=len(split.q_heads),
        num_key_value_heads=len(split.kv_heads),
        intermediate_size=cfg.intermediate_size // world,
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
        share = cfg.intermediate_size // self.world
        mlp = (self.rank * share, (self.rank + 1) * share)
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
