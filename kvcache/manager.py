"""Per-request block tables on top of the block pool."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvcache.block import KVCacheBlock
from kvcache.block_hash import BlockHash, get_hash_fn, hash_request_blocks
from kvcache.block_pool import BlockPool
from kvcache.events import EventRecordingBlockPool, KVEvent


class KVRequest(Protocol):
    """What the KV manager reads from a request (scheduling.Request satisfies it)."""

    request_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]
    cache_salt: str | None
    # The LoRA adapter the request runs with (None: the base model); part of the block hash.
    lora_id: str | None

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters, in tokens, since start."""

    queries: int = 0
    hits: int = 0

    def record(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_queried_tokens
        self.hits += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates blocks to requests and shares cached prefix blocks between them.

    The single place where a request's blocks are taken (`allocate_slots`) and given back
    (`free`); `None` from `allocate_slots` means "does not fit, nothing changed".
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        record_events: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = get_hash_fn(hash_algo)
        # Recording is a different pool class, so an engine without a router pays nothing.
        self.record_events = record_events
        pool_cls = EventRecordingBlockPool if record_events else BlockPool
        self.pool = pool_cls(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are already registered in the cache map.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        # When a list: every block registered in the cache map is appended, so that a step
        # given back before its KV was written can take its blocks out again (the scheduler
        # keeps one per step: scheduling/step_undo.py).
        self.registered: list[KVCacheBlock] | None = None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of KV blocks in use, 0..1."""
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, req: KVRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of `req` as (blocks, number of tokens they hold).

        At least the last token is always left to compute, so the step has logits to sample.
        The blocks are not yet owned: pass them to `allocate_slots`. Counted in
        `prefix_stats` by the caller once the request is admitted, not on every look-up.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_hashes(req)
        if self.req_to_blocks.get(req.request_id):
            return [], 0  # it holds blocks already (a KV connector filled them)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        req: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
        reserve_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `req`; return the new blocks.

        ```
        | computed (owned) | new computed (hits) | new tokens | lookahead (spec) |
        |<-- req.num_computed_tokens -->|
        ```
        `reserve_blocks` must stay free afterwards (the admission watermark). Returns None,
        changing nothing, when that many blocks are not free.
        """
        owned = self.req_to_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens + num_lookahead_tokens
        num_new_blocks = max(
            0, cdiv(total, self.block_size) - len(owned) - len(new_computed_blocks)
        )
        # A hit on a block with no owner takes it out of the free queue, so it cannot be counted
        # as free too.
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + reserve_blocks > self.pool.num_free_blocks - evictable_hits:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        self.cache_full_blocks(req, num_computed + num_new_tokens)
        return new_blocks

    def cache_full_blocks(self, req: KVRequest, num_tokens: int) -> None:
        """Register the blocks that `num_tokens` tokens of `req` fill completely.

        Draft (speculative) tokens are never cached: only tokens in `all_token_ids` count.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(req)
        blocks = self.req_to_blocks[req.request_id]
        fresh = [b for b in blocks[start:num_full] if b.block_hash is None]
        self.pool.cache_blocks(blocks, req.block_hashes[:num_full], start)
        self._num_cached_blocks[req.request_id] = num_full
        if self.registered is not None:
            # Another block may have held the hash already: only those now mapped count.
            self.registered.extend(b for b in fresh if b.block_hash is not None)

    def uncache_registered(self, blocks: Sequence[KVCacheBlock], computed: dict[str, int]) -> None:
        """Take `blocks` (registered by a step that never ran to the end) out of the cache
        map, and step each request in `computed` (request id -> tokens it has computed
        now) back to the blocks those tokens fill, so they are registered again once
        their KV is really written."""
        self.pool.uncache(blocks)
        for rid, num_tokens in computed.items():
            if rid in self._num_cached_blocks:
                full = num_tokens // self.block_size
                self._num_cached_blocks[rid] = min(self._num_cached_blocks[rid], full)

    def free(self, req: KVRequest, trusted: bool = True) -> None:
        """Give back every block of `req` (safe to call when it holds none).

        `trusted=False` (the step that wrote them failed) also drops their prefix-cache
        entries, so no later request reads half-written KV as a hit.
        """
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self._num_cached_blocks.pop(req.request_id, None)
        if not trusted:
            self.pool.uncache(blocks)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def drain_events(self) -> list[KVEvent]:
        """The KV events since the last drain (record_events=True), each handed out once."""
        if not isinstance(self.pool, EventRecordingBlockPool):
            raise RuntimeError("drain_events: this KVCacheManager has record_events=False")
        return self.pool.drain_events()

    def cached_block_hashes(self) -> set[BlockHash]:
        """Every hash the prefix cache holds now (what replaying the events must give)."""
        return set(self.pool.cached)

    def _update_hashes(self, req: KVRequest) -> None:
        hash_request_blocks(
            self.hash_fn,
            self.block_size,
            req.all_token_ids,
            req.block_hashes,
            req.cache_salt,
            req.lora_id,
        )

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_cnt equals the tables that hold it."""
        self.pool.check_integrity()
        owners = Counter(b.block_id for blocks in self.req_to_blocks.values() for b in blocks)
        for blocks in self.req_to_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks), "block twice in one table"
        for block in self.pool.blocks:
            assert block.ref_cnt == owners[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != owners "
                f"{owners[block.block_id]}"
            )
            if block.ref_cnt > 1:
                assert block.block_hash is not None, "uncached block shared by two requests"
