"""least_load: the replica with the lowest 4 x waiting + running (vLLM's DP coordinator)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from scheduling.routing.router import (
    LoadOnlyRouter,
    ReplicaLoad,
    RouteDecision,
    RouteRequest,
    count_routed,
    healthy,
    least_loaded,
)


class LeastLoadRouter(LoadOnlyRouter):
    """Lowest `ReplicaLoad.score` among healthy replicas; ties to the lowest index."""

    name: ClassVar[str] = "least_load"

    def pick(self, req: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision:
        chosen = least_loaded(healthy(replicas))
        count_routed(chosen)
        return RouteDecision(chosen.index, "least_load")
