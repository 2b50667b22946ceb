"""The router plug-in point: which data-parallel replica serves a request.

The front door (daemon/replicas/) keeps one `ReplicaLoad` per replica, refreshed from the
replicas' live stats, and asks its Router to `pick` one for every new request. Routers
that model the replicas' prefix caches also get each replica's KV events. Every router is
built the same way: `cls(context)`, one `RouterContext`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from kvcache import DEFAULT_BLOCK_SIZE, BlockHash, KVEvent

# Bumped when the Router protocol changes incompatibly; plugins declare the one they target.
# 2: routers are constructed with one RouterContext (1 took keyword options).
ROUTER_API_VERSION = 2

# vLLM's DP coordinator weighs a waiting request four times a running one: a waiting
# request still has its whole prefill ahead of it.
WAITING_WEIGHT = 4


# In load-score units (4 x waiting + running): 16 is four more waiting requests than the
# least-loaded replica. Past that, queueing behind the holder costs more than the prefill
# a hit saves (benchmarks/router_sim.py sweeps it).
DEFAULT_OVERLOAD_MARGIN = 16


class NoHealthyReplicaError(LookupError):
    """Every replica is down: the front door answers 503."""


@dataclass(frozen=True, slots=True)
class RouterContext:
    """What the front door tells every router it constructs: the one constructor argument.

    A router reads what it needs and ignores the rest, so a field added later (with a
    default) breaks no plugin.
    """

    # Replicas behind the front door (indexes 0..num_replicas-1).
    num_replicas: int = 1
    # The replicas' KV layout (--block-size, --prefix-cache-hash): a router that hashes
    # prompts must hash them as the replicas' KV managers do.
    block_size: int = DEFAULT_BLOCK_SIZE
    hash_algo: str = "sha256"
    # How much higher (load score) a preferred replica's score may be than the least-loaded
    # one's before a router gives up its preference (cache_aware's holder).
    overload_margin: int = DEFAULT_OVERLOAD_MARGIN

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.overload_margin < 0:
            raise ValueError(f"overload_margin must be >= 0, got {self.overload_margin}")


@dataclass(slots=True)
class ReplicaLoad:
    """The router's view of one replica, refreshed live by the front door.

    NOTE: `pick` may add the request it routes to `waiting` of the chosen replica, so a
    burst between two refreshes spreads out; the next refresh overwrites it.
    """

    index: int
    # False while the replica is down or restarting: never a candidate.
    healthy: bool
    running: int = 0
    waiting: int = 0
    # Fraction of its KV blocks in use, 0..1.
    kv_usage: float = 0.0

    @property
    def score(self) -> int:
        """vLLM's load score: 4 x waiting + running; lower is less loaded."""
        return WAITING_WEIGHT * self.waiting + self.running


@dataclass(slots=True)
class RouteRequest:
    """What the router sees of a request."""

    prompt_token_ids: list[int]
    # Chained hashes of the prompt's full blocks, computed by the front door with
    # kvcache.prefix_block_hashes (the replicas' own hasher, salt included).
    block_hashes: list[BlockHash] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request goes, and why (the reason labels a metric)."""

    index: int
    # "round_robin", "least_load", "cache_hit", "no_hit", "overloaded_holder".
    reason: str
    # Prompt tokens the router expects the replica to serve from its prefix cache.
    predicted_cached_tokens: int = 0


@runtime_checkable
class Router(Protocol):
    """Picks a replica per request.

    Contract: the front door constructs every router (plugins.load_router) as
    `cls(context)` with one RouterContext (replica count, KV layout, thresholds).
    `pick` chooses among the replicas with `healthy` set and raises
    NoHealthyReplicaError when there is none; it runs on the front door's event loop, so
    it must be quick (no I/O). `on_kv_events` gets each replica's events in the order the
    replica drained them; `on_replica_reset` says the replica restarted with an empty cache.
    """

    name: ClassVar[str]
    api_version: ClassVar[int]

    def pick(self, req: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision: ...

    def on_kv_events(self, replica: int, events: Sequence[KVEvent]) -> None: ...

    def on_replica_reset(self, replica: int) -> None: ...


class LoadOnlyRouter:
    """Convenience base for routers that ignore KV events. Subclasses define `pick`."""

    name: ClassVar[str] = "base"
    api_version: ClassVar[int] = ROUTER_API_VERSION

    def __init__(self, context: RouterContext | None = None) -> None:
        self.context = context or RouterContext()

    def pick(self, req: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision:
        raise NotImplementedError

    def on_kv_events(self, replica: int, events: Sequence[KVEvent]) -> None:
        return None

    def on_replica_reset(self, replica: int) -> None:
        return None


def healthy(replicas: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    """The candidates: healthy replicas; raises NoHealthyReplicaError when there are none."""
    candidates = [r for r in replicas if r.healthy]
    if not candidates:
        raise NoHealthyReplicaError(f"no healthy replica among {len(replicas)}")
    return candidates


def least_loaded(candidates: Sequence[ReplicaLoad]) -> ReplicaLoad:
    """The candidate with the lowest score; ties go to the lowest index."""
    return min(candidates, key=lambda r: (r.score, r.index))


def count_routed(replica: ReplicaLoad) -> None:
    """Count a just-routed request as waiting there until the next load refresh."""
    replica.waiting += 1
