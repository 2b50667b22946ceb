"""`--data-parallel-size N`: the front door's ReplicaSet, built from the serve config."""

from __future__ import annotations

import asyncio
import logging

from daemon.replicas.replica_set import Backend, ReplicaSet
from daemon.replicas.routing import DEFAULT_ROUTER, make_router
from daemon.service.serve_config import ServeConfig
from runner.model_source import resolve_model
from runner.tokenizer import load_tokenizer

log = logging.getLogger("headrace.server")


def make_backend(config: ServeConfig, n: int) -> Backend:
    server = config.server
    if server.distributed_backend == "local":
        from daemon.replicas.local_backend import LocalBackend

        return LocalBackend(n, config.engine.threads, server.log_level)
    if server.distributed_backend == "ray":
        from daemon.replicas.ray_backend import RayBackend

        return RayBackend(n, config.engine.threads, server.ray_address)
    raise ValueError(
        f"distributed_backend: unknown backend {server.distributed_backend!r}; choose local or ray"
    )


async def open_replicas(config: ServeConfig) -> ReplicaSet:
    """Start the replicas (all must come up once) with the tokenizer loaded here."""
    n = config.server.data_parallel_size
    router_name = config.server.router or DEFAULT_ROUTER
    router = make_router(router_name, config.engine, n)
    backend = make_backend(config, n)
    loop = asyncio.get_running_loop()
    tokenizer = await loop.run_in_executor(
        None, lambda: load_tokenizer(resolve_model(config.engine.model))
    )
    replicas = ReplicaSet(config.engine, n, backend, router, config.server.overlap)
    log.info("starting %d replicas (%s backend, router %s)", n, backend.name, router_name)
    await replicas.open(tokenizer)
    return replicas
