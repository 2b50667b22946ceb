"""One replica: a full Engine + AsyncEngine serving `messages` over any transport.

The same class runs in a local replica process (daemon/replicas/worker.py) and inside a Ray
actor (daemon/replicas/ray_backend.py): the transport hands it inbound messages and takes
what it `emit`s. It publishes a `Load` (EngineStats plus the KV events drained since the
last one) whenever a step ran, at most every LOAD_INTERVAL_S, and a heartbeat otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from daemon.engine.async_engine import AsyncEngine, runner_executor
from daemon.engine.config import EngineConfig
from daemon.engine.delta_stream import QueuedDeltaStream
from daemon.engine.engine import Engine
from daemon.engine.warmup import warm_up
from daemon.replicas.messages import (
    Abort,
    AdapterLoaded,
    Add,
    Deltas,
    FromReplica,
    Hello,
    Load,
    LoadAdapter,
    Rejected,
    Stop,
    ToReplica,
    UnloadAdapter,
)
from scheduling import QueueFullError

log = logging.getLogger("headrace.replica")

LOAD_INTERVAL_S = 0.02
HEARTBEAT_S = 0.5


@dataclass(slots=True)
class ReplicaSpec:
    """How to build replica `index` (sent to the replica process as its first frame)."""

    index: int
    engine: EngineConfig
    overlap: bool | None = None


class ReplicaCore:
    """Hosts one engine and speaks the replica messages; `emit` sends one to the front door."""

    def __init__(self, spec: ReplicaSpec, emit: Callable[[FromReplica], None]) -> None:
        self.spec = spec
        self.emit = emit
        self.engine: AsyncEngine | None = None
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._outgoing: list = []
        self._flush_scheduled = False
        self._load_task: asyncio.Task[None] | None = None
        self._adapter_loads: set[asyncio.Task[None]] = set()
        self.stopped = asyncio.Event()
        self.failure: str | None = None

    async def start(self) -> Hello:
        """Load the model on the runner thread, warm up, start publishing load."""
        loop = asyncio.get_running_loop()
        runner_thread = runner_executor()
        cfg = self.spec.engine
        engine = await loop.run_in_executor(
            runner_thread, lambda: Engine(cfg, record_kv_events=True)
        )
        overlap = self.spec.overlap
        if overlap is None:
            overlap = engine.device.type == "cuda"
        self.engine = AsyncEngine(engine, overlap=overlap, executor=runner_thread)
        self.engine.on_failure = self._engine_died
        await warm_up(self.engine)
        self._drain_events()  # warm-up blocks are the replica's own; the router starts empty
        self._load_task = loop.create_task(self._publish_load(), name="replica-load")
        threads = cfg.threads or torch.get_num_threads()
        return Hello(engine.info, os.getpid(), threads, self.engine.adapters())

    def _engine_died(self, why: str) -> None:
        # Its streams got their error deltas; the replica exits and the front door
        # restarts it (the same path as a crashed replica process).
        self.failure = why
        self.stopped.set()

    def handle(self, message: ToReplica) -> None:
        assert self.engine is not None
        if isinstance(message, Add):
            self._add(message)
        elif isinstance(message, Abort):
            for rid in message.request_ids:
                pump = self._pumps.pop(rid, None)
                if pump is not None:
                    pump.cancel()
                self.engine.abort(rid)
        elif isinstance(message, LoadAdapter):
            task = asyncio.get_running_loop().create_task(self._load_adapter(message))
            self._adapter_loads.add(task)
            task.add_done_callback(self._adapter_loads.discard)
        elif isinstance(message, UnloadAdapter):
            with contextlib.suppress(LookupError):  # an adapter it never loaded
                self.engine.unload_adapter(message.name)
        elif isinstance(message, Stop):
            self.stopped.set()

    async def stop(self) -> None:
        for pump in self._pumps.values():
            pump.cancel()
        if self._load_task is not None:
            self._load_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._load_task
        if self.engine is not None:
            await self.engine.stop()
            self.engine.engine.close()  # the KV connector's last writes, if one is set

    # -- requests ------------------------------------------------------------------------

    def _add(self, m: Add) -> None:
        assert self.engine is not None
        try:
            stream = self.engine.add_request(
                m.prompt_ids, m.params, request_id=m.request_id, **m.options
            )
        except QueueFullError as e:
            self.emit(Rejected(m.request_id, "queue_full", str(e)))
            return
        except (ValueError, LookupError) as e:  # LookupError: its adapter was just unloaded
            self.emit(Rejected(m.request_id, "bad_request", str(e)))
            return
        task = asyncio.get_running_loop().create_task(self._pump(stream))
        self._pumps[m.request_id] = task

    async def _load_adapter(self, m: LoadAdapter) -> None:
        assert self.engine is not None
        try:
            info = await self.engine.load_adapter(m.name, m.path)
        except Exception as e:  # any failure is an answer: the front door must not wait
            self.emit(AdapterLoaded(m.token, None, str(e) or type(e).__name__))
            return
        self.emit(AdapterLoaded(m.token, info))

    async def _pump(self, stream: QueuedDeltaStream) -> None:
        try:
            async for delta in stream:
                self._outgoing.append(delta)
                if not self._flush_scheduled:
                    # One frame for every delta of this step: the other pumps run first.
                    self._flush_scheduled = True
                    asyncio.get_running_loop().call_soon(self._flush)
        finally:
            self._pumps.pop(stream.request_id, None)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._outgoing:
            out, self._outgoing = self._outgoing, []
            self.emit(Deltas(out, self._drain_events()))

    # -- load and KV events --------------------------------------------------------------

    def _drain_events(self) -> list:
        assert self.engine is not None
        return self.engine.engine.kv.drain_events()

    async def _publish_load(self) -> None:
        assert self.engine is not None
        seen_steps, last = -1, 0.0
        while True:
            await asyncio.sleep(LOAD_INTERVAL_S)
            now = time.monotonic()
            steps = self.engine.num_steps
            if steps == seen_steps and now - last < HEARTBEAT_S:
                continue
            seen_steps, last = steps, now
            self.emit(Load(self.engine.stats(), self._drain_events()))
