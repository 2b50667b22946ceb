"""An example data-parallel router plugin: send each request where KV memory is freest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from scheduling.routing import (
    ROUTER_API_VERSION,
    LoadOnlyRouter,
    ReplicaLoad,
    RouteDecision,
    RouteRequest,
    healthy,
)


class LeastKVRouter(LoadOnlyRouter):
    """The healthy replica with the lowest KV usage; ties to the lower load score, then index."""

    name: ClassVar[str] = "least_kv"
    api_version: ClassVar[int] = ROUTER_API_VERSION

    def pick(self, req: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision:
        chosen = min(healthy(replicas), key=lambda r: (r.kv_usage, r.score, r.index))
        return RouteDecision(chosen.index, "least_kv")
