"""The router as the ReplicaSet uses it: loaded by name with the replicas' RouterContext."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from daemon.engine.config import EngineConfig
from plugins import load_router
from scheduling.routing import ReplicaLoad, RouteDecision, Router, RouterContext, RouteRequest

DEFAULT_ROUTER = "cache_aware"


def router_context(config: EngineConfig, num_replicas: int, **overrides: Any) -> RouterContext:
    """The replicas' count and KV layout (they hash blocks as `config` says), plus any
    threshold `overrides` (RouterContext fields)."""
    context = RouterContext(num_replicas, config.block_size, config.prefix_cache_hash)
    return replace(context, **overrides)


def make_router(name: str, config: EngineConfig, num_replicas: int, **overrides: Any) -> Router:
    """`name` from headrace.routers, built like every router: with the one RouterContext."""
    return load_router(name, router_context(config, num_replicas, **overrides))


__all__ = [
    "DEFAULT_ROUTER",
    "ReplicaLoad",
    "RouteDecision",
    "RouteRequest",
    "RouterContext",
    "make_router",
    "router_context",
]
