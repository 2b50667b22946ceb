"""The Ray backend: each replica a Ray actor hosting the same ReplicaCore.

Ray places the actors by their CPU resources (one or more per node), and restarts one that
dies (`max_restarts`); the front door only reconnects, the same loop as a local restart.
Messages are the local backend's: `send` takes a front-door message, `events` is a
streaming generator of the replica's outgoing messages in batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import replace
from typing import Any

from daemon.replicas.messages import FromReplica, Hello, ToReplica
from daemon.replicas.replica import ReplicaCore, ReplicaSpec

log = logging.getLogger("headrace.replicas")

INSTALL_HINT = "distributed_backend: ray is not installed; pip install 'headrace[ray]'"
# Ray restarts a dead replica actor this many times (-1: always).
MAX_RESTARTS = -1


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(INSTALL_HINT) from None
    return ray


class ReplicaActor:
    """The actor body (wrapped by ray.remote in RayBackend): one engine, async methods."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.outbox: asyncio.Queue[FromReplica] = asyncio.Queue()
        self.core: ReplicaCore | None = None
        self._hello: Hello | None = None
        self._starting: asyncio.Lock | None = None

    async def hello(self) -> Hello:
        """Start the engine on first call (after a restart, the new process's first call)."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._hello is None:
                self.core = ReplicaCore(self.spec, self.outbox.put_nowait)
                self._hello = await self.core.start()
        return self._hello

    async def send(self, message: ToReplica) -> None:
        assert self.core is not None
        self.core.handle(message)
        if self.core.stopped.is_set():
            await self.core.stop()

    async def events(self) -> Any:
        """Outgoing messages, each yield all that queued since the last one."""
        while True:
            batch = [await self.outbox.get()]
            while not self.outbox.empty():
                batch.append(self.outbox.get_nowait())
            yield batch


class RayChannel:
    """The front door's end of one replica actor."""

    pid: int | None = None

    def __init__(self, ray: Any, actor: Any) -> None:
        self.ray = ray
        self.actor = actor
        self.events = actor.events.remote()
        self.buffer: deque[FromReplica] = deque()

    def send(self, message: ToReplica) -> None:
        self.actor.send.remote(message)

    async def recv(self) -> FromReplica:
        while not self.buffer:
            try:
                ref = await self.events.__anext__()
                self.buffer.extend(await ref)
            except (self.ray.exceptions.RayError, StopAsyncIteration) as e:
                raise ConnectionError(f"replica actor lost: {type(e).__name__}") from e
        return self.buffer.popleft()

    def kill(self) -> None:
        """Nothing: Ray restarts the actor; the supervisor reconnects."""

    async def close(self, timeout: float) -> None:
        """After Stop: the actor's engine has stopped; end the actor for good."""
        with contextlib.suppress(Exception):
            self.ray.kill(self.actor, no_restart=True)


class RayBackend:
    """Replica actors on a Ray cluster: `address` joins one, None starts a local one."""

    name = "ray"

    def __init__(self, n: int, threads: int | None, address: str | None, **init: Any) -> None:
        self.ray = ray = _ray()
        if not ray.is_initialized():
            if address:
                ray.init(address=address, **init)
            else:
                ray.init(include_dashboard=False, **init)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.threads = threads or max(1, cpus // n)
        self.remote_cls = ray.remote(max_restarts=MAX_RESTARTS, max_task_retries=0)(ReplicaActor)
        self.actors: dict[int, Any] = {}

    async def connect(self, spec: ReplicaSpec) -> tuple[RayChannel, Hello]:
        ray = self.ray
        actor = self.actors.get(spec.index)
        if actor is None:
            spec = replace(spec, engine=replace(spec.engine, threads=self.threads))
            actor = self.remote_cls.options(num_cpus=self.threads).remote(spec)
            self.actors[spec.index] = actor
        try:
            hello = await actor.hello.remote()
        except ray.exceptions.RayError as e:
            raise ConnectionError(f"replica {spec.index}: actor not ready: {e}") from e
        channel = RayChannel(ray, actor)
        channel.pid = hello.pid  # the actor's worker process (this life's)
        return channel, hello

    async def shutdown(self) -> None:
        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        self.actors.clear()
