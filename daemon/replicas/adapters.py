"""LoRA adapters over replicas: every replica serves the same set, the front door lists it.

```
load_adapter(name, path) --LoadAdapter(token)--> every replica up --AdapterLoaded(token)-->
    all loaded  -> served[name]              any error -> UnloadAdapter to those that loaded,
                                                          ValueError (the API's 400)
unload_adapter(name) --UnloadAdapter--> every replica up (served[name] is gone at once)
a replica (re)starting -> its spec's lora_modules = served now (start-up and runtime ones);
    a Ray actor restarted with its first spec catches up (loads / unloads) before it is
    routed to
```
The front door answers as one engine does: unknown names raise LookupError, a bad name or
file ValueError; a replica lost while loading is left out (it reloads the set when it
restarts).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any, Protocol

from daemon.engine.client import AdapterInfo
from daemon.replicas.messages import AdapterLoaded, LoadAdapter, UnloadAdapter


class _Reachable(Protocol):
    index: int
    healthy: bool
    channel: Any


class ReplicaAdapters:
    """The adapters the replicas serve, by name, and the runtime loads in progress."""

    def __init__(self) -> None:
        self.served: dict[str, AdapterInfo] = {}
        # token -> (replica index, its answer); None answers: the replica was lost.
        self._pending: dict[int, tuple[int, asyncio.Future[AdapterLoaded | None]]] = {}
        self._tokens = itertools.count()
        self._lock = asyncio.Lock()  # one runtime load at a time

    def start_with(self, adapters: Sequence[AdapterInfo]) -> None:
        """The adapters the first replica said it serves (its --lora-modules)."""
        self.served = {a.name: a for a in adapters}

    def lora_modules(self) -> tuple[str, ...]:
        """`name=path` for each adapter served now: what a restarting replica loads."""
        return tuple(f"{a.name}={a.path}" for a in self.served.values())

    def lora_id(self, name: str) -> str:
        """The served adapter's prefix-cache id; LookupError, as the engine's, if none."""
        adapter = self.served.get(name)
        if adapter is None:
            raise LookupError(f"the model {name!r} does not exist")
        return adapter.lora_id

    async def load(
        self, name: str, path: str, base_name: str, replicas: Sequence[_Reachable]
    ) -> AdapterInfo:
        async with self._lock:
            if name == base_name or name in self.served:
                raise ValueError(f"lora_name: {name!r} is served already")
            up = [r for r in replicas if r.healthy and r.channel is not None]
            if not up:
                raise ValueError("lora: no replica is serving; load the adapter once one is up")
            got = await asyncio.gather(*(self._ask(r, name, path) for r in up))
            errors = [a.error for a in got if a is not None and a.info is None]
            infos = [a.info for a in got if a is not None and a.info is not None]
            if errors:
                for r, a in zip(up, got, strict=True):
                    if a is not None and a.info is not None and r.channel is not None:
                        r.channel.send(UnloadAdapter(name))  # all or none
                raise ValueError(errors[0])
            if not infos:
                raise ValueError("lora: every replica was lost while loading; try again")
            self.served[name] = infos[0]
            return infos[0]

    def differs(self, adapters: Sequence[AdapterInfo]) -> bool:
        """Whether a replica serving `adapters` lacks one served or has one unloaded."""
        return {a.name for a in adapters} != set(self.served)

    async def catch_up(self, r: _Reachable, adapters: Sequence[AdapterInfo]) -> list[str]:
        """Bring a replica that serves `adapters` to the served set; the names it failed."""
        have = {a.name for a in adapters}
        for name in have - set(self.served):
            r.channel.send(UnloadAdapter(name))
        missing = [a for name, a in self.served.items() if name not in have]
        got = await asyncio.gather(*(self._ask(r, a.name, a.path) for a in missing))
        return [
            a.name for a, answer in zip(missing, got, strict=True) if not answer or answer.error
        ]

    def _ask(self, r: _Reachable, name: str, path: str) -> asyncio.Future[AdapterLoaded | None]:
        token = next(self._tokens)
        answer: asyncio.Future[AdapterLoaded | None] = asyncio.get_running_loop().create_future()
        self._pending[token] = (r.index, answer)
        r.channel.send(LoadAdapter(token, name, path))
        return answer

    def unload(self, name: str, replicas: Sequence[_Reachable]) -> None:
        if self.served.pop(name, None) is None:
            raise LookupError(f"the LoRA adapter {name!r} does not exist")
        for r in replicas:
            if r.channel is not None:
                r.channel.send(UnloadAdapter(name))

    def answered(self, message: AdapterLoaded) -> None:
        entry = self._pending.pop(message.token, None)
        if entry is not None and not entry[1].done():
            entry[1].set_result(message)

    def lost(self, replica: int | None = None) -> None:
        """Replica `replica` (None: every one) will not answer its loads."""
        for token, (index, answer) in list(self._pending.items()):
            if replica is None or index == replica:
                del self._pending[token]
                if not answer.done():
                    answer.set_result(None)
