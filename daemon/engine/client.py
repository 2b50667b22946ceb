"""The seam between the API and an engine: what a front door may ask of any engine.

```
daemon.openai (HTTP)  --EngineClient-->  LocalEngine   (AsyncEngine, this process)
                                         ReplicaSet    (daemon/replicas: N engines in
                                                        their own processes or Ray actors)
```
The API layer depends on this Protocol only, never on an engine's scheduler, KV cache or
runner: each transport implements it, and everything it returns is plain data.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from daemon.engine.outputs import Delta
from scheduling import SamplingParams, SpecDecodeStats


class EngineDeadError(RuntimeError):
    """The engine loop died (a bug, not bad input): no request can be served (503)."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model as the front door needs to know it (limits it checks up front)."""

    name: str
    max_model_len: int
    vocab_size: int
    # The waiting-queue limit (--max-waiting); 0: unbounded.
    max_waiting: int = 0
    # A token id the warm-up request may send (EOS when the model has one).
    warmup_token_id: int = 0
    # Whether LoRA adapters may be loaded and unloaded at run time.
    lora_runtime_updates: bool = False


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A LoRA adapter served over the model; requests name it by `model`."""

    name: str
    # The file or directory it was read from.
    path: str
    rank: int
    # Its prefix-cache identity (name + weights digest): a router hashes the request's
    # blocks with it, as the engine does.
    lora_id: str = ""


@dataclass(slots=True)
class ReplicaStatus:
    """One data-parallel replica as the front door sees it (daemon/replicas)."""

    index: int
    healthy: bool
    restarts: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    # Prompt tokens looked up in its prefix cache and found there, since the front door
    # started (kept across the replica's restarts).
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0


@dataclass(slots=True)
class RouterTotals:
    """Running totals of a replica router: decisions per (policy, reason), cached tokens."""

    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    # Prompt tokens the router expected the picked replica to hold, and what it reported.
    predicted_cached_tokens: int = 0
    reported_cached_tokens: int = 0
    # P/D mode: prompts by what their producer pass did (ok, failed, none: no producer up).
    pd_prefills: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class KVConnectorStats:
    """A KV connector's figures (--kv-connector): running totals since start, a gauge, and
    load latencies handed out once."""

    loaded_tokens: int = 0
    saved_tokens: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    loaded_bytes: int = 0
    saved_bytes: int = 0
    # Loads that got less than asked, by kind: corrupt, missing, peer_down (or error).
    failures: dict[str, int] = field(default_factory=dict)
    # Peer replies that brought blocks, by the path they came: shm or socket (consumer).
    transfers: dict[str, int] = field(default_factory=dict)
    # Bytes the connector's store holds now (the disk tier's files, a producer's RAM).
    store_bytes: int = 0
    # Seconds from a load's start to its blocks in the paged cache, since the last read.
    load_seconds: list[float] = field(default_factory=list)

    def add(self, other: KVConnectorStats) -> None:
        """Add another engine's figures (the front door sums its replicas')."""
        for name in ("loaded_tokens", "saved_tokens", "loaded_blocks", "saved_blocks",
                     "loaded_bytes", "saved_bytes", "store_bytes"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.failures, other.failures), (self.transfers, other.transfers)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        self.load_seconds += other.load_seconds


@dataclass(slots=True)
class EngineStats:
    """Load and health figures at one moment (read at scrape and routing time)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    # Running totals since start (counters advance to them).
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    # Steps stopped between layers for an urgent arrival and taken back.
    interrupted_steps: int = 0
    constrained_requests: int = 0
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0
    # Compile times of grammars finished since the last read (each is handed out once).
    grammar_compile_seconds: list[float] = field(default_factory=list)
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # (tenant, seconds from arrival to first scheduled) of requests admitted since the last
    # read (each is handed out once).
    tenant_queue_seconds: list[tuple[str, float]] = field(default_factory=list)
    # Data-parallel serving only: each replica, and the router's totals (empty/None else).
    replicas: list[ReplicaStatus] = field(default_factory=list)
    router: RouterTotals | None = None
    # With a KV connector only.
    kv_connector: KVConnectorStats | None = None
    # Why the engine cannot serve (its loop died, a tensor-parallel rank was lost), else
    # None: /health answers 503 with it.
    failure: str | None = None


class DeltaStream(Protocol):
    """One request's deltas, in order, the last one finished. `close()` early aborts it."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    async def __anext__(self) -> Delta: ...

    def close(self) -> None: ...


class EngineClient(Protocol):
    """An engine as the API sees it: add a request, stream its deltas, abort, read load.

    `add_request` raises ValueError (bad input; the message starts with the field name),
    LookupError (its `lora` option names no served adapter) or scheduling.QueueFullError
    (come back later) at once, before any delta exists.
    """

    info: ModelInfo
    # The model's tokenizer (transformers), or None for a model served by token ids only.
    tokenizer: Any

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, **options: Any
    ) -> DeltaStream: ...

    def abort(self, request_id: str) -> None: ...

    def adapters(self) -> list[AdapterInfo]:
        """The LoRA adapters served now (empty when LoRA is off)."""
        ...

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Serve one more adapter; ValueError names a bad name or file (nothing changes)."""
        ...

    def unload_adapter(self, name: str) -> None:
        """Stop serving `name` (requests already using it finish); LookupError if unknown."""
        ...

    def stats(self) -> EngineStats: ...

    @property
    def num_in_flight_requests(self) -> int: ...

    def in_flight_ids(self) -> list[str]: ...

    def end_all(self, why: str) -> int:
        """Abort every request in flight, each reader handed a last delta saying `why`."""
        ...

    def start(self) -> None: ...

    async def stop(self, wait: bool = True) -> None: ...
