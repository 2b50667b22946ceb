"""ReplicaSet: the EngineClient over N replicas, a router picking one per request.

```
APIServer --EngineClient--> ReplicaSet --router.pick--> replica i
                              | per replica: a channel (socketpair or Ray actor) and a
                              | supervisor task: connect -> read frames -> on loss: fail its
                              | streams, mark it down, reset its router mirror, back off, reconnect
```
Only the loop thread touches this object. A replica's streams end with finish_reason
"error" the moment its channel breaks (the API turns that into a 500 or an SSE error
event); the router never sees a down replica as a candidate.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from daemon.engine.admission import check_prompt, check_vocab
from daemon.engine.client import (
    AdapterInfo,
    EngineStats,
    KVConnectorStats,
    ModelInfo,
    ReplicaStatus,
    RouterTotals,
)
from daemon.engine.config import EngineConfig
from daemon.engine.delta_stream import QueuedDeltaStream
from daemon.engine.outputs import Delta
from daemon.replicas.adapters import ReplicaAdapters
from daemon.replicas.messages import (
    Abort,
    AdapterLoaded,
    Add,
    Deltas,
    FromReplica,
    Hello,
    Load,
    Rejected,
    Stop,
)
from daemon.replicas.prefill_decode import PDLayout, PrefillDecode
from daemon.replicas.replica import ReplicaSpec
from daemon.replicas.routing import ReplicaLoad, RouteRequest
from kvcache.block_hash import prefix_block_hashes, request_extra_keys
from scheduling import QueueFullError, SamplingParams, SpecDecodeStats

log = logging.getLogger("headrace.replicas")

BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
# A replica up this long has its backoff reset.
STABLE_S = 30.0


class Channel(Protocol):
    """The front door's end of one replica (a process's socket, a Ray actor)."""

    pid: int | None

    def send(self, message: Any) -> None: ...

    async def recv(self) -> FromReplica: ...

    def kill(self) -> None: ...

    async def close(self, timeout: float) -> None: ...


class Backend(Protocol):
    """Starts (or reaches) replica `spec.index` and returns its channel once it said Hello."""

    name: str

    async def connect(self, spec: ReplicaSpec) -> tuple[Channel, Hello]: ...

    async def shutdown(self) -> None: ...


@dataclass(slots=True)
class Replica:
    """The front door's state for one replica."""

    index: int
    channel: Channel | None = None
    healthy: bool = False
    restarts: int = 0
    up_since: float = 0.0
    load: EngineStats = field(default_factory=EngineStats)
    streams: dict[str, QueuedDeltaStream] = field(default_factory=dict)
    # Hand-once figures from the replica's Loads, kept until the next scrape.
    compile_seconds: list[float] = field(default_factory=list)
    tenant_seconds: list[tuple[str, float]] = field(default_factory=list)
    # Prefix-cache totals of its earlier lives (its own restart at zero).
    past_query_tokens: int = 0
    past_hit_tokens: int = 0
    # P/D: requests routed here whose prompt a producer still computes.
    reserved: int = 0

    def route_load(self) -> ReplicaLoad:
        # The front door's own count is current; the replica's report lags by a frame.
        in_flight = len(self.streams) + self.reserved
        running = min(self.load.running, in_flight)
        return ReplicaLoad(
            self.index, self.healthy, running, in_flight - running, self.load.kv_usage
        )


class ReplicaSet:
    """N engine replicas behind one EngineClient; see the module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        n: int,
        backend: Backend,
        router: Any,
        overlap: bool | None,
        pd: PDLayout | None = None,
        prefill_router: Any = None,
    ) -> None:
        """`pd`: prefill/decode mode (n == pd.num_replicas); `router` then picks among the
        consumers and `prefill_router` (another instance) among the producers."""
        self.config = config
        self.backend = backend
        self.router = router
        self.policy = getattr(router, "name", type(router).__name__)
        self.replicas = [Replica(i) for i in range(n)]
        self.overlap = overlap
        self.info: ModelInfo | None = None  # type: ignore[assignment]
        self.tokenizer: Any = None
        self.totals = RouterTotals()
        self.lora = ReplicaAdapters()
        self._ids = itertools.count()
        self._supervisors: list[asyncio.Task[None]] = []
        self._ready: list[asyncio.Event] = []
        self._catching_up: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.pd = PrefillDecode(self, pd, prefill_router) if pd is not None else None
        if self.pd is not None:
            self.totals.pd_prefills = self.pd.prefills  # the same counts, live
        if pd is not None and pd.num_replicas != n:
            raise ValueError(f"P/D layout of {pd.num_replicas} replicas for {n}")

    def _router_of(self, r: Replica) -> Any:
        return self.router if self.pd is None else self.pd.router_of(r.index)

    def _decoders(self) -> list[Replica]:
        return self.replicas if self.pd is None else self.pd.consumers()

    def _is_producer(self, r: Replica) -> bool:
        return self.pd is not None and self.pd.layout.is_producer(r.index)

    # -- lifecycle -----------------------------------------------------------------------

    async def open(self, tokenizer: Any) -> None:
        """Start every replica and wait until all have said Hello (the first start must work)."""
        self.tokenizer = tokenizer
        loop = asyncio.get_running_loop()
        self._ready = [asyncio.Event() for _ in self.replicas]
        first = await asyncio.gather(*(self._connect(r) for r in self.replicas))
        info = first[0].info
        self.info = replace(info, max_waiting=info.max_waiting * len(self._decoders()))
        self.lora.start_with(first[0].adapters)
        self._supervisors = [
            loop.create_task(self._supervise(r), name=f"replica-{r.index}") for r in self.replicas
        ]

    def start(self) -> None:
        """Replicas start in `open`; nothing more to do."""

    def end_all(self, why: str) -> int:
        """Abort every request in flight, handing each reader a last delta (finish "abort",
        stop reason `why`); returns how many were ended."""
        ended = 0
        for r in self.replicas:
            streams, r.streams = r.streams, {}
            if streams and r.channel is not None:
                r.channel.send(Abort(list(streams)))
            for rid, stream in streams.items():
                stream.put(Delta.ending(rid, "abort", why))
            ended += len(streams)
        if self.pd is not None:
            ended += self.pd.end_all(why)
        return ended

    async def stop(self, wait: bool = True) -> None:
        """Stop every replica (the caller drained first) and wait for them to exit. `wait`
        is the EngineClient's: replicas always get a bounded wait (their channel's close)."""
        self._stopping = True
        self.lora.lost()
        for r in self.replicas:
            if r.channel is not None:
                r.channel.send(Stop())
        for task in self._supervisors:
            task.cancel()
        for task in self._supervisors:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for r in self.replicas:
            if r.channel is not None:
                await r.channel.close(timeout=10.0)
                r.channel = None
        await self.backend.shutdown()
        if self.pd is not None:
            await self.pd.close()

    async def _connect(self, r: Replica) -> Hello:
        config = self.config
        if self.info is not None:  # a restart: the adapters served now, runtime ones too
            config = replace(config, lora_modules=self.lora.lora_modules())
        if self.pd is not None:
            config = self.pd.layout.engine_config(config, r.index)
        spec = ReplicaSpec(r.index, config, self.overlap)
        channel, hello = await self.backend.connect(spec)
        r.channel, r.healthy, r.up_since = channel, True, time.monotonic()
        r.load = EngineStats()
        self._router_of(r).on_replica_reset(r.index)
        if self.info is not None and self.lora.differs(hello.adapters):
            r.healthy = False  # routed to once it serves every adapter
            task = asyncio.get_running_loop().create_task(self._catch_up(r, channel, hello))
            self._catching_up.add(task)
            task.add_done_callback(self._catching_up.discard)
        log.info("replica %d up (pid %s, %d threads)", r.index, hello.pid, hello.threads)
        return hello

    async def _catch_up(self, r: Replica, channel: Channel, hello: Hello) -> None:
        """A replica back without the adapters served now (a Ray actor restarts with its
        first spec): load and unload until it matches, then route to it."""
        failed = await self.lora.catch_up(r, hello.adapters)
        if r.channel is not channel:
            return  # lost again meanwhile
        if failed:
            log.error("replica %d could not load adapters %s; serving without", r.index, failed)
        r.healthy = True

    async def _supervise(self, r: Replica) -> None:
        failures = 0
        while not self._stopping:
            if r.channel is None:
                try:
                    await self._connect(r)
                except (ConnectionError, OSError) as e:
                    log.error("replica %d failed to start: %s", r.index, e)
                    await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                    failures += 1
                    continue
            assert r.channel is not None
            try:
                while True:
                    self._receive(r, await r.channel.recv())
            except ConnectionError as e:
                if self._stopping:
                    return
                self._lost(r, str(e))
            if time.monotonic() - r.up_since > STABLE_S:
                failures = 0
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
            failures += 1
            r.restarts += 1

    def _lost(self, r: Replica, why: str) -> None:
        if self._is_producer(r):
            log.error(
                "producer replica %d lost (%s); consumers compute its %d prompts; restarting",
                r.index, why, len(r.streams),
            )  # fmt: skip
        else:
            log.error(
                "replica %d lost (%s); %d requests fail; restarting", r.index, why, len(r.streams)
            )
        r.healthy = False
        r.past_query_tokens += r.load.prefix_query_tokens
        r.past_hit_tokens += r.load.prefix_hit_tokens
        r.load = EngineStats()
        self.lora.lost(r.index)
        channel, r.channel = r.channel, None
        if channel is not None:
            channel.kill()
        self._router_of(r).on_replica_reset(r.index)
        streams, r.streams = r.streams, {}
        for rid, stream in streams.items():
            stream.put(Delta.ending(rid, "error", f"replica {r.index} failed: {why}"))

    def _receive(self, r: Replica, message: FromReplica) -> None:
        if isinstance(message, Deltas):
            if message.kv_events:
                self._router_of(r).on_kv_events(r.index, message.kv_events)
            for delta in message.deltas:
                stream = r.streams.get(delta.request_id)
                if stream is None:
                    continue
                if delta.finished:
                    del r.streams[delta.request_id]
                    # Per finished request: an index test, not a scan of the replicas.
                    if not self._is_producer(r):
                        self.totals.reported_cached_tokens += delta.num_cached_tokens
                stream.put(delta)
        elif isinstance(message, Load):
            r.load = message.stats
            r.compile_seconds.extend(message.stats.grammar_compile_seconds)
            r.tenant_seconds.extend(message.stats.tenant_queue_seconds)
            if message.kv_events:
                self._router_of(r).on_kv_events(r.index, message.kv_events)
        elif isinstance(message, Rejected):
            stream = r.streams.pop(message.request_id, None)
            if stream is not None:
                reason = "rejected" if message.kind == "queue_full" else "error"
                stream.put(Delta.ending(message.request_id, reason, message.message))
        elif isinstance(message, AdapterLoaded):
            self.lora.answered(message)

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, **options: Any
    ) -> QueuedDeltaStream:
        """Check, route and send a request; raises ValueError or QueueFullError at once."""
        assert self.info is not None, "ReplicaSet.open() first"
        ids = [int(t) for t in prompt_ids]
        check_prompt(ids, self.info.vocab_size)
        check_vocab(params, self.info.vocab_size)
        if options.get("grammar") is not None and params.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with structured output")
        rid = options.pop("request_id", None) or f"dp-{next(self._ids)}"
        candidates = [r.route_load() for r in self._decoders() if r.healthy]
        if not candidates:
            stream = QueuedDeltaStream(rid, lambda _: None)
            stream.put(Delta.ending(rid, "rejected", "no replica is serving"))
            return stream
        lora = options.get("lora")
        lora_id = self.lora.lora_id(lora) if lora is not None else None
        hashes: list[Any] = []
        if self.config.enable_prefix_caching:
            extra = request_extra_keys(options.get("cache_salt"), lora_id)
            hashes = prefix_block_hashes(
                ids, self.config.block_size, self.config.prefix_cache_hash, extra
            )
        decision = self.router.pick(RouteRequest(ids, hashes), candidates)
        r = self.replicas[decision.index]
        per_replica = self.info.max_waiting // len(self._decoders())
        if per_replica and r.route_load().waiting >= per_replica:
            raise QueueFullError(
                f"replica {r.index}: {per_replica} requests already waiting (--max-waiting)"
            )
        key = (self.policy, decision.reason)
        self.totals.decisions[key] = self.totals.decisions.get(key, 0) + 1
        self.totals.predicted_cached_tokens += decision.predicted_cached_tokens
        stream = QueuedDeltaStream(rid, self.abort)
        if self.pd is not None:
            self.pd.start(r, stream, ids, params, options, hashes)
            return stream
        r.streams[rid] = stream
        assert r.channel is not None
        r.channel.send(Add(rid, ids, params, options))
        return stream

    def abort(self, request_id: str) -> None:
        if self.pd is not None and self.pd.abort(request_id):
            return
        for r in self.replicas:
            if r.streams.pop(request_id, None) is not None and r.channel is not None:
                r.channel.send(Abort([request_id]))
                return

    def adapters(self) -> list[AdapterInfo]:
        return list(self.lora.served.values())

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load on every replica up (all or none); ValueError as one engine's."""
        assert self.info is not None
        if not self.info.lora_runtime_updates:
            raise ValueError("lora: runtime LoRA updates are off (--enable-lora-runtime-updates)")
        return await self.lora.load(name, path, self.info.name, self.replicas)

    def unload_adapter(self, name: str) -> None:
        self.lora.unload(name, self.replicas)

    @property
    def num_in_flight_requests(self) -> int:
        return len(self.in_flight_ids())

    def in_flight_ids(self) -> list[str]:
        """Every request a client waits on (a P/D prompt's pass on a producer is not one)."""
        ids = [rid for r in self._decoders() for rid in r.streams]
        return ids + list(self.pd.pending) if self.pd is not None else ids

    def stats(self) -> EngineStats:
        """The replicas' figures added up (prefix-cache totals over their restarts too),
        plus each one."""
        out = EngineStats(spec=SpecDecodeStats(), router=self.totals)
        for r in self.replicas:
            s = r.load
            queries = r.past_query_tokens + s.prefix_query_tokens
            hits = r.past_hit_tokens + s.prefix_hit_tokens
            out.running += s.running
            out.waiting += s.waiting
            out.kv_usage += s.kv_usage / len(self.replicas)
            out.prefix_query_tokens += queries
            out.prefix_hit_tokens += hits
            out.preemptions += s.preemptions
            out.interrupted_steps += s.interrupted_steps
            out.constrained_requests += s.constrained_requests
            out.grammar_cache_hits += s.grammar_cache_hits
            out.grammar_cache_misses += s.grammar_cache_misses
            out.grammar_compile_seconds += r.compile_seconds
            out.tenant_queue_seconds += r.tenant_seconds
            r.compile_seconds, r.tenant_seconds = [], []
            for name in ("num_proposed", "num_verified", "num_accepted", "num_verify_steps"):
                setattr(out.spec, name, getattr(out.spec, name) + getattr(s.spec, name))
            if s.kv_connector is not None:
                # NOTE: running totals of the replicas' current lives (a restarted one
                # starts again at 0, and counters only go up); latencies are not summed.
                out.kv_connector = out.kv_connector or KVConnectorStats()
                out.kv_connector.add(replace(s.kv_connector, load_seconds=[]))
            out.replicas.append(
                ReplicaStatus(
                    r.index,
                    r.healthy,
                    r.restarts,
                    s.running,
                    s.waiting,
                    s.kv_usage,
                    s.prefix_hit_rate,
                    queries,
                    hits,
                )
            )
        if out.prefix_query_tokens:
            out.prefix_hit_rate = out.prefix_hit_tokens / out.prefix_query_tokens
        return out
