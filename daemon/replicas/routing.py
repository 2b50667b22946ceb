"""The router as the ReplicaSet uses it: loaded by name, told the engines' block layout."""

from __future__ import annotations

from typing import Any

from daemon.engine.config import EngineConfig
from plugins import load_router
from scheduling.routing import ReplicaLoad, RouteDecision, Router, RouteRequest

DEFAULT_ROUTER = "cache_aware"


def make_router(name: str, config: EngineConfig, **options: Any) -> Router:
    """`name` from headrace.routers; cache_aware hashes blocks as the replicas' engines do."""
    if name == "cache_aware":
        options = {
            "block_size": config.block_size,
            "hash_algo": config.prefix_cache_hash,
            **options,
        }
    return load_router(name, **options)


__all__ = ["DEFAULT_ROUTER", "ReplicaLoad", "RouteDecision", "RouteRequest", "make_router"]
