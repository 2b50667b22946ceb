"""The scheduler side of a KV connector: a second source of prompt KV beyond the prefix cache.

```
scheduler (loop thread)                          runner side (IO threads, runner thread)
  admit req: local prefix hit = h tokens
  n = get_num_new_matched_tokens(req, h)  --->   (cheap look-up: file exists, peer configured)
  allocate blocks for h + n; req WAITING_FOR_KV
  update_state_after_alloc(req, first, n_blk)
  build_meta(step) -> KVConnectorMeta ---------> start_loads(meta.loads): IO off every thread
                                                 that steps; blocks staged in host memory
  each schedule(): loads_done() <--------------- poll_loads(): req -> leading blocks ready
  req WAITING again, num_computed = h + ready
  req scheduled (NewRequestData) -------------->  commit staged blocks into the paged cache,
                                                  then the forward that reads them
  after the forward ---------------------------> save(meta.saves): newly full prompt blocks
```
Everything here is plain Python (no torch): the scheduler and the simulator import it.
Blocks are named by the chained block hashes `kvcache/` already computes, so a block's
key covers its whole prefix (and cache salt); `KVLayout` adds what makes a block's bytes
differ between engines (model, dtype, block size, shape).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvcache.block_hash import BlockHash
from kvcache.manager import KVRequest

# Version of this interface (both sides); a plugin declares the one it targets.
KV_CONNECTOR_API_VERSION = 1


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a stored block's bytes depend on besides its tokens; part of every key."""

    # Identity of the weights (path, sizes, mtimes of the files) and the linear format.
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def key(self) -> str:
        """One line naming the layout; stored in each block's header to spot foreign files."""
        return (
            f"{self.model}|{self.dtype}|bs{self.block_size}|L{self.num_layers}"
            f"|H{self.num_kv_heads}|D{self.head_dim}"
        )

    @property
    def namespace(self) -> str:
        """Short digest of `key`: the folder (or peer channel) a layout's blocks live under."""
        return hashlib.sha256(self.key.encode()).hexdigest()[:24]

    def block_key(self, block_hash: BlockHash) -> str:
        """The store key of one block: its chained hash within this layout."""
        if not isinstance(block_hash, bytes):
            raise TypeError("KV connectors need sha256 block hashes (prefix_cache_hash=sha256)")
        return block_hash.hex()


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Blocks to fetch for one request: its block-table positions first .. first + len - 1."""

    req_id: str
    first_block: int
    keys: list[str]
    # The paged-cache blocks they go to (filled in by the scheduler, which allocated them):
    # the runner side copies a load in over several steps, before the request is scheduled.
    block_ids: tuple[int, ...] = ()
    # Where to load from, for a connector with several sources (a P/D consumer: the KV
    # address of the producer the request names); None: the connector's own store.
    source: str | None = None


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Newly full blocks of one request to store after this step's forward has written them."""

    req_id: str
    first_block: int
    keys: list[str]


@dataclass(slots=True)
class KVConnectorMeta:
    """The connector's part of one SchedulerOutput."""

    # Loads to start now (they run off the step; the request waits in WAITING_FOR_KV).
    loads: list[LoadSpec] = field(default_factory=list)
    # Saves the runner does right after this step's forward.
    saves: list[SaveSpec] = field(default_factory=list)


class KVConnectorScheduler(ABC):
    """Scheduler side: which prompt blocks an outside source can supply, and which to save.

    Called on the scheduler's thread only; must never block on IO that can be slow (a
    look-up may stat files, but transfers belong to the runner side).
    """

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._loads: list[LoadSpec] = []

    @abstractmethod
    def get_num_new_matched_tokens(self, req: KVRequest, num_computed_tokens: int) -> int:
        """Prompt tokens after the first `num_computed_tokens` (the local hit) it can supply.

        Whole blocks of `req.block_hashes`, except that the last prompt token is always left
        to compute (the step needs its logits): a prompt that ends on a block boundary may be
        supplied up to its last token, the block holding that token loaded too, so only one
        token is computed instead of a block. Side-effect free; 0 for none.
        """

    def update_state_after_alloc(self, req: KVRequest, first_block: int, num_blocks: int) -> None:
        """Blocks `first_block ..` of `req`'s table were allocated for those tokens (the last
        one maybe partly supplied, see above): load them."""
        hashes = req.block_hashes[first_block : first_block + num_blocks]
        keys = [self.layout.block_key(h) for h in hashes]
        self._loads.append(LoadSpec(req.request_id, first_block, keys, source=self.source(req)))

    def source(self, req: KVRequest) -> str | None:
        """Where `req`'s blocks load from (LoadSpec.source); None: the connector's store."""
        return None

    def saves_for(self, req: KVRequest, num_computed_before: int, num_computed_after: int,
                  num_prompt_tokens: int) -> SaveSpec | None:  # fmt: skip
        """The prompt blocks this step fills for `req`, to be saved; None when none or unwanted."""
        bs = self.layout.block_size
        first = num_computed_before // bs
        end = min(num_computed_after, num_prompt_tokens, len(req.block_hashes) * bs) // bs
        if end <= first or not self.wants_saves:
            return None
        keys = [self.layout.block_key(h) for h in req.block_hashes[first:end]]
        return SaveSpec(req.request_id, first, keys)

    @property
    def wants_saves(self) -> bool:
        """Whether computed prompt blocks go to this connector (a consumer only loads)."""
        return True

    def take_loads(self) -> list[LoadSpec]:
        """The loads recorded since the last call (they go out with the next step)."""
        loads, self._loads = self._loads, []
        return loads

    def request_finished(self, req_id: str) -> None:
        """`req_id` left the scheduler; forget any state kept for it."""
        self._loads = [spec for spec in self._loads if spec.req_id != req_id]
