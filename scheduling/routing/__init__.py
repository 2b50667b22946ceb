"""Data-parallel routing: which replica serves a request (torch-free, no I/O).

Built-ins register under the `headrace.routers` entry-point group, as a plugin would;
load one with `plugins.load_router(name, RouterContext(...))`.
"""

from scheduling.routing.cache_aware import CacheAwareRouter
from scheduling.routing.least_load import LeastLoadRouter
from scheduling.routing.mirror import CacheMirror
from scheduling.routing.round_robin import RoundRobinRouter
from scheduling.routing.router import (
    DEFAULT_OVERLOAD_MARGIN,
    ROUTER_API_VERSION,
    WAITING_WEIGHT,
    LoadOnlyRouter,
    NoHealthyReplicaError,
    ReplicaLoad,
    RouteDecision,
    Router,
    RouterContext,
    RouteRequest,
    healthy,
    least_loaded,
)

__all__ = [
    "DEFAULT_OVERLOAD_MARGIN",
    "ROUTER_API_VERSION",
    "WAITING_WEIGHT",
    "CacheAwareRouter",
    "CacheMirror",
    "LeastLoadRouter",
    "LoadOnlyRouter",
    "NoHealthyReplicaError",
    "ReplicaLoad",
    "RoundRobinRouter",
    "RouteDecision",
    "RouteRequest",
    "Router",
    "RouterContext",
    "healthy",
    "least_loaded",
]
