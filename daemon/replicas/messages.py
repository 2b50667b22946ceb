"""The messages between the front door and a replica: plain dataclasses, pickled.

Front door -> replica: `Add`, `Abort`, `LoadAdapter`, `UnloadAdapter`, `Stop`. Replica ->
front door: `Hello` (once, when ready), `Deltas` (a step's outputs for any of its requests),
`Rejected` (an add the engine refused), `Load` (live load plus the KV events since the last
one), `AdapterLoaded` (the answer to one `LoadAdapter`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from daemon.engine.client import AdapterInfo, EngineStats, ModelInfo
from daemon.engine.outputs import Delta
from scheduling import SamplingParams


@dataclass(slots=True)
class Add:
    """Queue a request (its id is the front door's, unique across replicas)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Abort:
    """End requests early (their client left)."""

    request_ids: list[str]


@dataclass(slots=True)
class LoadAdapter:
    """Serve one more LoRA adapter (runtime updates); answered by `AdapterLoaded(token)`."""

    token: int
    name: str
    path: str


@dataclass(slots=True)
class UnloadAdapter:
    """Stop serving an adapter (no answer: the front door forgot it already)."""

    name: str


@dataclass(slots=True)
class Stop:
    """Stop the engine and exit (the front door drained first)."""


@dataclass(slots=True)
class Hello:
    """The replica is loaded, warmed up and serving."""

    info: ModelInfo
    pid: int
    threads: int
    # The LoRA adapters it serves (its spec's lora_modules).
    adapters: list[AdapterInfo] = field(default_factory=list)


@dataclass(slots=True)
class Deltas:
    """Outputs for requests of this replica, in order, and the KV events before them (the
    router's mirror holds a finished prompt's blocks before its client hears the end)."""

    deltas: list[Delta]
    kv_events: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class Rejected:
    """`Add` failed in the engine: `kind` is "bad_request" or "queue_full"."""

    request_id: str
    kind: str
    message: str


@dataclass(slots=True)
class Load:
    """Load figures now, and the KV events since the previous `Load` (in order)."""

    stats: EngineStats
    kv_events: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class AdapterLoaded:
    """The answer to `LoadAdapter(token)`: the adapter served, or `error` saying why not."""

    token: int
    info: AdapterInfo | None
    error: str = ""


ToReplica = Add | Abort | LoadAdapter | UnloadAdapter | Stop
FromReplica = Hello | Deltas | Rejected | Load | AdapterLoaded
