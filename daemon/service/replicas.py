"""`--data-parallel-size N` (or `--prefill-replicas K --decode-replicas M`): the front door's
ReplicaSet, built from the serve config."""

from __future__ import annotations

import asyncio
import logging

from daemon.replicas.prefill_decode import PDLayout, make_layout
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


def pd_layout(config: ServeConfig) -> PDLayout | None:
    """The P/D layout the flags ask for (None: plain data parallel); ValueError if unsound."""
    server = config.server
    k, m = server.prefill_replicas, server.decode_replicas
    if k == 0 and m == 0:
        return None
    if k < 1 or m < 1:
        raise ValueError(
            f"prefill_replicas, decode_replicas: set both (>= 1) for P/D, got {k} and {m}"
        )
    if server.data_parallel_size != 1:
        raise ValueError(
            "data_parallel_size: with --prefill-replicas/--decode-replicas the replica count "
            "is their sum; leave --data-parallel-size at 1"
        )
    if server.distributed_backend != "local":
        raise ValueError("prefill_replicas: P/D replicas run on the local backend only")
    return make_layout(k, m, config.engine, server.pd_prefill_timeout)


async def open_replicas(config: ServeConfig) -> ReplicaSet:
    """Start the replicas (all must come up once) with the tokenizer loaded here."""
    pd = pd_layout(config)
    n = pd.num_replicas if pd is not None else config.server.data_parallel_size
    router_name = config.server.router or DEFAULT_ROUTER
    router = make_router(router_name, config.engine, n)
    prefill_router = make_router(router_name, config.engine, n) if pd is not None else None
    backend = make_backend(config, n)
    loop = asyncio.get_running_loop()
    tokenizer = await loop.run_in_executor(
        None, lambda: load_tokenizer(resolve_model(config.engine.model))
    )
    replicas = ReplicaSet(
        config.engine, n, backend, router, config.server.overlap, pd, prefill_router
    )
    if pd is not None:
        log.info(
            "starting %d prefill + %d decode replicas (KV sockets in %s, router %s)",
            pd.producers, pd.consumers, pd.kv_dir, router_name,
        )  # fmt: skip
    else:
        log.info("starting %d replicas (%s backend, router %s)", n, backend.name, router_name)
    await replicas.open(tokenizer)
    return replicas
