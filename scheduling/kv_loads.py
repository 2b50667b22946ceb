"""Requests whose prompt KV comes from a KV connector, between allocation and their first step.

```
WAITING --(connector supplies n tokens; blocks for hit + n allocated)--> WAITING_FOR_KV
WAITING_FOR_KV --(runner side: k leading blocks landed and copied in)--> WAITING (holds blocks,
                  num_computed_tokens = min(hit + k * block_size, num_tokens - 1); the rest is
                  computed as usual)
```
A loading request holds its blocks but is never scheduled, and uses no step budget, so
others go on. Its blocks are not prefix-cached until it is scheduled: only then are they
filled (the runner commits the staged KV before that step's forward).
"""

from __future__ import annotations

from dataclasses import replace

from kvcache import KVCacheManager
from kvcache.connectors import KVConnectorMeta, KVConnectorScheduler, LoadSpec
from scheduling.request import Request, RequestStatus


class KVLoads:
    """The scheduler's bookkeeping for one connector (or none: every call is then a no-op)."""

    def __init__(self, connector: KVConnectorScheduler | None, kv: KVCacheManager) -> None:
        if connector is not None and not kv.enable_prefix_caching:
            raise ValueError("kv_connector: needs prefix caching (blocks are named by hashes)")
        self.connector = connector
        self.kv = kv
        self.loading: dict[str, Request] = {}
        # Landed, holding blocks, not yet scheduled.
        self.landed: set[str] = set()
        self.num_loaded_tokens = 0

    def try_start(self, req: Request, hits: list, num_hit_tokens: int, reserve: int) -> bool:
        """Allocate blocks and start a load if the connector can supply more of `req`'s prompt.

        False (nothing changed) when it cannot, or when the blocks do not fit: `req` is then
        admitted the ordinary way.
        """
        if self.connector is None or req.request_id in self.kv.req_to_blocks:
            return False
        n = self.connector.get_num_new_matched_tokens(req, num_hit_tokens)
        if n <= 0:
            return False
        # NOTE: the loaded tokens ride as lookahead: their slots are allocated but not
        # prefix-cached, since their KV is not there yet.
        if self.kv.allocate_slots(req, 0, hits, n, reserve_blocks=reserve) is None:
            return False
        bs = self.kv.block_size
        # n may end one token short of a block: the prompt's last token, always computed.
        self.connector.update_state_after_alloc(req, num_hit_tokens // bs, -(-n // bs))
        req.status = RequestStatus.WAITING_FOR_KV
        req.num_computed_tokens = num_hit_tokens
        self.loading[req.request_id] = req
        return True

    def land(self, done: dict[str, int]) -> list[str]:
        """Loads the runner side finished (req id -> leading blocks ready); the ids accepted.

        An id not accepted belongs to a request that ended meanwhile: drop its staged KV.
        """
        accepted = []
        for rid, num_blocks in done.items():
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            before = req.num_computed_tokens
            req.num_computed_tokens = min(
                before + num_blocks * self.kv.block_size, req.num_tokens - 1
            )
            self.num_loaded_tokens += req.num_computed_tokens - before
            req.status = RequestStatus.WAITING
            self.landed.add(rid)
            accepted.append(rid)
        return accepted

    def _block_ids(self, spec: LoadSpec) -> list[int]:
        ids = self.kv.get_block_ids(spec.req_id)
        return ids[spec.first_block : spec.first_block + len(spec.keys)]

    def admitted(self, req: Request) -> None:
        self.landed.discard(req.request_id)

    def finished(self, req: Request) -> None:
        self.loading.pop(req.request_id, None)
        self.landed.discard(req.request_id)
        if self.connector is not None:
            self.connector.request_finished(req.request_id)

    def holders(self) -> set[str]:
        """Waiting requests allowed to hold blocks."""
        return set(self.loading) | self.landed

    def build_meta(self, scheduled: list[tuple[Request, int]]) -> KVConnectorMeta | None:
        """Loads to start and the saves of this step (progress counters already advanced)."""
        if self.connector is None:
            return None
        # The runner side copies loads in before the request is scheduled: it needs the blocks.
        loads = [
            replace(spec, block_ids=tuple(self._block_ids(spec)))
            for spec in self.connector.take_loads()
        ]
        meta = KVConnectorMeta(loads=loads)
        if self.connector.wants_saves:
            for req, n in scheduled:
                before = req.num_computed_tokens - n
                spec = self.connector.saves_for(
                    req, before, req.num_computed_tokens, req.num_prompt_tokens
                )
                if spec is not None:
                    meta.saves.append(spec)
        return meta
