"""round_robin: each healthy replica in turn, blind to load and cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from scheduling.routing.router import (
    LoadOnlyRouter,
    ReplicaLoad,
    RouteDecision,
    RouterContext,
    RouteRequest,
    count_routed,
    healthy,
)


class RoundRobinRouter(LoadOnlyRouter):
    """The next healthy replica after the last one picked, by index; skips the down ones."""

    name: ClassVar[str] = "round_robin"

    def __init__(self, context: RouterContext | None = None) -> None:
        super().__init__(context)
        self._last = -1

    def pick(self, req: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision:
        candidates = sorted(healthy(replicas), key=lambda r: r.index)
        chosen = next((r for r in candidates if r.index > self._last), candidates[0])
        self._last = chosen.index
        count_routed(chosen)
        return RouteDecision(chosen.index, "round_robin")
