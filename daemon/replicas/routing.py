"""The router seam as daemon/replicas uses it (scheduling/routing/ and plugins.load_router).

STAND-IN: until the `router` branch lands, the names come from the minimal local
definitions below (round_robin and least_load only). Merging `router` makes the first
import succeed and this fallback dead; it is then deleted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

try:
    from plugins import load_router  # type: ignore[attr-defined]
    from scheduling.routing import ReplicaLoad, RouteDecision, RouteRequest  # type: ignore

    HAVE_ROUTERS = True
except ImportError:
    HAVE_ROUTERS = False

    @dataclass(slots=True)
    class ReplicaLoad:  # type: ignore[no-redef]
        """The router's view of one replica, refreshed live."""

        index: int
        healthy: bool
        running: int = 0
        waiting: int = 0
        kv_usage: float = 0.0

    @dataclass(slots=True)
    class RouteRequest:  # type: ignore[no-redef]
        """What the router sees of a request."""

        prompt_token_ids: list[int]
        block_hashes: list[Any]

    @dataclass(frozen=True, slots=True)
    class RouteDecision:  # type: ignore[no-redef]
        """The picked replica and why."""

        index: int
        reason: str
        predicted_cached_tokens: int = 0

    class _RoundRobin:
        name: ClassVar[str] = "round_robin"
        api_version: ClassVar[int] = 1

        def __init__(self) -> None:
            self.next = 0

        def pick(self, req: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision:
            r = replicas[self.next % len(replicas)]
            self.next += 1
            return RouteDecision(r.index, "round_robin")

        def on_kv_events(self, replica: int, events: Sequence[Any]) -> None:
            pass

        def on_replica_reset(self, replica: int) -> None:
            pass

    class _LeastLoad(_RoundRobin):
        name: ClassVar[str] = "least_load"

        def pick(self, req: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision:
            r = min(replicas, key=lambda r: (4 * r.waiting + r.running, r.index))
            return RouteDecision(r.index, "least_load")

    _STANDIN = {"round_robin": _RoundRobin, "least_load": _LeastLoad}

    def load_router(name: str, **options: Any) -> Any:  # type: ignore[no-redef]
        """Stand-in for plugins.load_router (round_robin, least_load)."""
        if name not in _STANDIN:
            raise ValueError(f"router: unknown router {name!r}; installed: {sorted(_STANDIN)}")
        return _STANDIN[name](**options)


DEFAULT_ROUTER = "cache_aware" if HAVE_ROUTERS else "least_load"

__all__ = [
    "DEFAULT_ROUTER",
    "HAVE_ROUTERS",
    "ReplicaLoad",
    "RouteDecision",
    "RouteRequest",
    "load_router",
]
