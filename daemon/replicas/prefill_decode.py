"""P/D as a mode of the ReplicaSet: prefill replicas compute prompts, decode replicas decode.

```
headrace serve --prefill-replicas K --decode-replicas M
  replicas 0..K-1     --kv-connector peer --kv-role producer --kv-peer <run dir>/kv-<i>.sock
  replicas K..K+M-1   --kv-connector peer --kv-role consumer  (each request names its producer)

add_request  consumer c = router.pick(consumers)                 (429 at once: c's queue full)
             producer p = prefill_router.pick(producers)
  task       Add(<rid>/prefill, prompt, max_tokens 1) --> p ... its last delta (text dropped)
             Add(<rid>, prompt, params, kv_source = p's KV address) --> c --> client's stream
```
The client's stream exists from the start and carries only the consumer's deltas. The
producer's answer is a signal that its blocks are stored (a producer saves them before a
step's results go out). A producer that fails (down, restarted, queue full, an error) costs
only speed: the request goes to the consumer naming no producer and the consumer computes
the prompt; a producer that dies after its answer makes the consumer's fetch fail, and it
computes the prompt then. Producers and consumers each have their own router instance (the
`--router` policy), so round robin turns and cache-aware mirrors stay per kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from daemon.engine.config import EngineConfig
from daemon.engine.delta_stream import QueuedDeltaStream
from daemon.engine.outputs import Delta
from daemon.replicas.messages import Abort, Add
from daemon.replicas.routing import RouteRequest
from scheduling import SamplingParams

if TYPE_CHECKING:
    from daemon.replicas.replica_set import Replica, ReplicaSet

log = logging.getLogger("headrace.replicas")

# The prompt's pass on a producer: one greedy token, thrown away.
PREFILL = SamplingParams(max_tokens=1, temperature=0.0)
# Request options that change a prompt's KV (or who it is computed for) go to the producer
# too; the rest (grammar, SLO) concern the answer only.
_PREFILL_OPTIONS = ("lora", "cache_salt", "priority", "tenant")


@dataclass(frozen=True, slots=True)
class PDLayout:
    """Which replicas produce and which consume, and where each producer serves its KV."""

    producers: int
    consumers: int
    # Folder of the producers' KV sockets (private to this front door).
    kv_dir: str
    # Seconds a prompt may take on its producer before the consumer computes it itself (a
    # producer that hangs without dying would otherwise hold the request forever).
    prefill_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.prefill_timeout_s <= 0:
            raise ValueError(f"pd_prefill_timeout: must be > 0, got {self.prefill_timeout_s}")
        if self.producers < 1 or self.consumers < 1:
            raise ValueError(
                "prefill_replicas, decode_replicas: P/D needs at least one of each, got "
                f"{self.producers} and {self.consumers}"
            )

    @property
    def num_replicas(self) -> int:
        return self.producers + self.consumers

    def is_producer(self, index: int) -> bool:
        return index < self.producers

    def kv_address(self, index: int) -> str:
        return os.path.join(self.kv_dir, f"kv-{index}.sock")

    def engine_config(self, base: EngineConfig, index: int) -> EngineConfig:
        """Replica `index`'s engine: `base` with its side of the peer connector."""
        if self.is_producer(index):
            return replace(
                base, kv_connector="peer", kv_role="producer", kv_peer=self.kv_address(index)
            )
        return replace(base, kv_connector="peer", kv_role="consumer", kv_peer=None)


def make_layout(
    producers: int, consumers: int, config: EngineConfig, prefill_timeout_s: float = 300.0
) -> PDLayout:
    """The layout, its socket folder made now (0700: only this user reaches the KV)."""
    if config.kv_connector not in ("none", "peer"):
        raise ValueError(
            f"kv_connector: P/D replicas use the peer connector, got {config.kv_connector!r}"
        )
    if not config.enable_prefix_caching or config.prefix_cache_hash != "sha256":
        raise ValueError("prefill_replicas: P/D needs prefix caching with sha256 block hashes")
    base = os.environ.get("RUNTIME_DIRECTORY") or None  # systemd's, else the temp folder
    if prefill_timeout_s <= 0:
        raise ValueError(f"pd_prefill_timeout: must be > 0, got {prefill_timeout_s}")
    kv_dir = tempfile.mkdtemp(prefix="headrace-pd-", dir=base)
    return PDLayout(producers, consumers, kv_dir, prefill_timeout_s)


@dataclass(slots=True)
class _Pending:
    """A request whose prompt a producer is computing; no consumer has it yet."""

    stream: QueuedDeltaStream
    consumer: Replica
    producer: Replica | None = None
    prefill_id: str = ""
    task: asyncio.Task[None] | None = None


class PrefillDecode:
    """The ReplicaSet's P/D mode (see the module docstring). Loop thread only."""

    def __init__(self, replicas: ReplicaSet, layout: PDLayout, prefill_router: Any) -> None:
        self.rs = replicas
        self.layout = layout
        self.prefill_router = prefill_router
        self.pending: dict[str, _Pending] = {}
        # Prompts by outcome: ok (computed by a producer), failed (it failed or died),
        # timeout (it took longer than prefill_timeout_s), none (no producer was up).
        self.prefills: dict[str, int] = {"ok": 0, "failed": 0, "timeout": 0, "none": 0}

    def producers(self) -> list[Replica]:
        return self.rs.replicas[: self.layout.producers]

    def consumers(self) -> list[Replica]:
        return self.rs.replicas[self.layout.producers :]

    def router_of(self, index: int) -> Any:
        return self.prefill_router if self.layout.is_producer(index) else self.rs.router

    def start(
        self,
        consumer: Replica,
        stream: QueuedDeltaStream,
        ids: list[int],
        params: SamplingParams,
        options: dict[str, Any],
        hashes: Sequence[Any],
    ) -> None:
        """The prompt to a producer, then (in a task) the request to `consumer`."""
        rid = stream.request_id
        pending = _Pending(stream, consumer)
        candidates = [r.route_load() for r in self.producers() if r.healthy]
        if candidates:
            decision = self.prefill_router.pick(RouteRequest(ids, list(hashes)), candidates)
            p = self.rs.replicas[decision.index]
            assert p.channel is not None
            pending.producer, pending.prefill_id = p, f"{rid}/prefill"
            prefill = QueuedDeltaStream(pending.prefill_id, lambda _: None)
            p.streams[pending.prefill_id] = prefill
            kept = {k: v for k, v in options.items() if k in _PREFILL_OPTIONS}
            p.channel.send(Add(pending.prefill_id, ids, PREFILL, kept))
        else:
            prefill = None
        consumer.reserved += 1
        self.pending[rid] = pending
        pending.task = asyncio.get_running_loop().create_task(
            self._run(pending, prefill, ids, params, options), name=f"pd-{rid}"
        )

    async def _run(
        self,
        pending: _Pending,
        prefill: QueuedDeltaStream | None,
        ids: list[int],
        params: SamplingParams,
        options: dict[str, Any],
    ) -> None:
        outcome, source = "none", None
        if prefill is not None and pending.producer is not None:
            try:
                outcome = await asyncio.wait_for(
                    self._prefilled(prefill), self.layout.prefill_timeout_s
                )
            except TimeoutError:
                outcome = "timeout"
                p = pending.producer
                if p.streams.get(pending.prefill_id) is prefill and p.channel is not None:
                    p.channel.send(Abort([pending.prefill_id]))
            finally:
                pending.producer.streams.pop(pending.prefill_id, None)
            if outcome == "ok":
                source = self.layout.kv_address(pending.producer.index)
            else:
                log.warning(
                    "producer replica %d did not compute %s; its consumer will",
                    pending.producer.index,
                    pending.stream.request_id,
                )
        if self.pending.pop(pending.stream.request_id, None) is None:
            return  # aborted meanwhile
        pending.consumer.reserved -= 1
        self.prefills[outcome] += 1
        self._decode(pending, ids, params, {**options, "kv_source": source} if source else options)

    @staticmethod
    async def _prefilled(prefill: QueuedDeltaStream) -> str:
        async for delta in prefill:
            if delta.finished:
                return "ok" if delta.finish_reason in ("length", "stop") else "failed"
        return "failed"

    def _decode(
        self, pending: _Pending, ids: list[int], params: SamplingParams, options: dict[str, Any]
    ) -> None:
        rid, c = pending.stream.request_id, pending.consumer
        if not c.healthy or c.channel is None:  # lost while its prompt was computed
            candidates = [r.route_load() for r in self.consumers() if r.healthy]
            if not candidates:
                pending.stream.put(Delta.ending(rid, "rejected", "no replica is serving"))
                return
            c = self.rs.replicas[self.rs.router.pick(RouteRequest(ids), candidates).index]
        assert c.channel is not None
        c.streams[rid] = pending.stream
        c.channel.send(Add(rid, ids, params, options))

    def abort(self, rid: str) -> bool:
        """End `rid` if it is still at its prefill; False when it is not here."""
        pending = self.pending.pop(rid, None)
        if pending is None:
            return False
        pending.consumer.reserved -= 1
        if pending.task is not None:
            pending.task.cancel()
        p = pending.producer
        computing = p is not None and p.streams.pop(pending.prefill_id, None) is not None
        if computing and p is not None and p.channel is not None:
            p.channel.send(Abort([pending.prefill_id]))
        return True

    def end_all(self, why: str) -> int:
        """Abort every request at its prefill, with a last delta saying `why`."""
        ended = list(self.pending.values())
        for pending in ended:
            self.abort(pending.stream.request_id)
            pending.stream.put(Delta.ending(pending.stream.request_id, "abort", why))
        return len(ended)

    async def close(self) -> None:
        for pending in list(self.pending.values()):
            if pending.task is not None:
                pending.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending.task
        shutil.rmtree(self.layout.kv_dir, ignore_errors=True)
