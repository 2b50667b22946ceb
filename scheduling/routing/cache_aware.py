"""cache_aware: send a request where its prompt prefix is already cached, unless that
replica is much busier than the least-loaded one.

```
hits[r]  = leading prompt blocks replica r holds (CacheMirror, from its KV events)
holder   = argmax hits (ties: lower load score, then lower index)
hits == 0                                     -> most room           "no_hit"
holder.score - least.score > overload_margin  -> least loaded        "overloaded_holder"
otherwise                                     -> holder              "cache_hit"
```
"Most room": among replicas within overload_margin of the least-loaded one, the one whose
mirror holds the fewest blocks (as SGLang's router sends a miss to its smallest tree). A
new prefix then lands where it evicts least, so prefixes spread over the replicas' caches
instead of piling onto whichever was idle when they first came.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import ClassVar

from kvcache import KVEvent
from kvcache.block_hash import get_hash_fn
from scheduling.routing.mirror import CacheMirror
from scheduling.routing.router import (
    DEFAULT_OVERLOAD_MARGIN,
    ROUTER_API_VERSION,
    ReplicaLoad,
    RouteDecision,
    RouterContext,
    RouteRequest,
    count_routed,
    healthy,
    least_loaded,
)

__all__ = ["DEFAULT_OVERLOAD_MARGIN", "CacheAwareRouter"]


class CacheAwareRouter:
    """Longest cached prefix first, least load when the holder is overloaded or nobody holds it.

    From its RouterContext: `overload_margin`, how much higher (in load score) the holder's
    score may be than the least-loaded replica's before the request goes to the
    least-loaded one instead; `block_size` and `hash_algo`, the replicas' (the front door
    hashes prompts with them). The "builtin" hash is refused unless PYTHONHASHSEED fixes
    Python's hash seed for the front door and, by inheritance, every replica.
    """

    name: ClassVar[str] = "cache_aware"
    api_version: ClassVar[int] = ROUTER_API_VERSION

    def __init__(self, context: RouterContext | None = None) -> None:
        context = context or RouterContext()
        hash_algo = context.hash_algo
        get_hash_fn(hash_algo)
        if hash_algo == "builtin" and not os.environ.get("PYTHONHASHSEED", "").isdigit():
            raise ValueError(
                "router cache_aware: prefix_cache_hash 'builtin' is Python's hash, seeded per "
                "process, so the router cannot compute the replicas' block hashes; use "
                "'sha256' (the default) or set PYTHONHASHSEED to a fixed number"
            )
        self.context = context
        self.overload_margin = context.overload_margin
        self.block_size = context.block_size
        self.mirror = CacheMirror()

    def pick(self, req: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision:
        candidates = healthy(replicas)
        # The KV manager always leaves the prompt's last token to compute, so a prompt of
        # exactly k full blocks can hit at most k - 1 of them.
        usable = req.block_hashes[: (len(req.prompt_token_ids) - 1) // self.block_size]
        hits = {r.index: self.mirror.cached_prefix_blocks(r.index, usable) for r in candidates}
        holder = max(candidates, key=lambda r: (hits[r.index], -r.score, -r.index))
        least = least_loaded(candidates)
        if hits[holder.index] == 0:
            near = [r for r in candidates if r.score - least.score <= self.overload_margin]
            chosen = min(near, key=lambda r: (self.mirror.num_blocks(r.index), r.score, r.index))
            reason = "no_hit"
        elif holder.score - least.score > self.overload_margin:
            chosen, reason = least, "overloaded_holder"
        else:
            chosen, reason = holder, "cache_hit"
        count_routed(chosen)
        return RouteDecision(chosen.index, reason, hits[chosen.index] * self.block_size)

    def on_kv_events(self, replica: int, events: Sequence[KVEvent]) -> None:
        self.mirror.apply(replica, events)

    def on_replica_reset(self, replica: int) -> None:
        self.mirror.reset(replica)
