"""The messages between the front door and a replica: plain dataclasses, pickled.

Front door -> replica: `Add`, `Abort`, `Stop`. Replica -> front door: `Hello` (once, when
ready), `Deltas` (a step's outputs for any of its requests), `Rejected` (an add the engine
refused), `Load` (live load plus the KV events since the last one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from daemon.engine.client import EngineStats, ModelInfo
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
class Stop:
    """Stop the engine and exit (the front door drained first)."""


@dataclass(slots=True)
class Hello:
    """The replica is loaded, warmed up and serving."""

    info: ModelInfo
    pid: int
    threads: int


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


ToReplica = Add | Abort | Stop
FromReplica = Hello | Deltas | Rejected | Load
