"""`headrace serve`: one uvloop process, TCP and/or a Unix socket, run well by systemd.

Lifecycle: load and warm up the model -> listen (inherited sockets under socket
activation) -> READY=1 -> serve -> SIGTERM: STOPPING=1, stop accepting, let in-flight
requests finish for up to --drain-timeout, abort the rest, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from daemon.engine.async_engine import AsyncEngine, runner_executor
from daemon.engine.client import EngineClient
from daemon.engine.engine import Engine
from daemon.engine.warmup import warm_up
from daemon.openai.api import APIServer
from daemon.openai.auth import load_api_keys
from daemon.openai.metrics import Metrics
from daemon.openai.options import APIOptions
from daemon.openai.tenant_limits import parse_rate_limits
from daemon.service.http_protocol import GuardedAppRunner
from daemon.service.serve_config import ServeConfig, ServerConfig
from daemon.service.shutdown import CLOSE_S, Stoppable, drain_and_stop
from daemon.service.systemd import Notifier, inherited_sockets

log = logging.getLogger("headrace.server")


def configure_logging(level: str, under_systemd: bool) -> None:
    # journald adds its own timestamps; a terminal wants them.
    fmt = "%(levelname)s %(name)s: %(message)s"
    if not under_systemd:
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)


def bind_unix_socket(path: str) -> socket.socket:
    """A listening Unix socket at `path`, mode 0660.

    An existing socket file is replaced only if nothing answers on it (a stale one from a
    crash); a live server or a file that is not a socket is left alone with an error.
    """
    p = Path(path)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise FileExistsError(f"uds: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            p.unlink(missing_ok=True)
        else:
            raise FileExistsError(f"uds: another server is listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The umask keeps the socket from being world-accessible between bind and chmod.
    old = os.umask(0o117)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    sock.listen(512)
    return sock


def api_options(server: ServerConfig) -> APIOptions:
    keys = load_api_keys(server.api_key, server.api_key_file)
    return APIOptions(
        max_request_bytes=server.max_request_bytes,
        api_key=next(iter(keys), None),
        api_keys=keys,
        tenant_rate_limits=parse_rate_limits(server.tenant_rate_limits),
        tenant_metrics_top_k=server.tenant_metrics_top_k,
        metrics_unix_only=server.metrics_unix_only,
        log_prompts=server.log_prompts,
        stream_timeout=server.stream_timeout,
        body_timeout=server.body_timeout,
    )


async def serve(config: ServeConfig) -> int:
    notifier = Notifier()
    configure_logging(config.server.log_level, notifier.enabled)
    loop = asyncio.get_running_loop()
    notifier.status("loading model")
    profiler = None
    watchdog: asyncio.Task[None] | None = None
    server = config.server
    if (
        server.data_parallel_size > 1
        or server.prefill_replicas
        or server.decode_replicas
        or server.distributed_backend != "local"
    ):
        from daemon.service.replicas import open_replicas

        if config.server.profile_steps:
            raise ValueError("profile_steps: not available with replicas (profile one engine)")
        async_engine: EngineClient = await open_replicas(config)
        watchdog = loop.create_task(_ping(notifier))
    else:
        async_engine, profiler = await _local_engine(config, notifier)
    name = config.server.served_model_name or async_engine.info.name
    api = APIServer(async_engine, name, Metrics(), api_options(config.server))
    runner = GuardedAppRunner(
        api.app(),
        config.server.max_connections,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=CLOSE_S,
        keepalive_timeout=config.server.keepalive_timeout,
    )
    await runner.setup()
    sites: list[web.BaseSite] = []
    uds_sock: socket.socket | None = None
    inherited = inherited_sockets()
    if inherited:
        sites = [web.SockSite(runner, sock) for sock in inherited]
    else:
        if config.server.host:
            sites.append(
                web.TCPSite(runner, config.server.host, config.server.port, reuse_address=True)
            )
        if config.server.uds:
            uds_sock = bind_unix_socket(config.server.uds)
            sites.append(web.SockSite(runner, uds_sock))
    if not sites:
        raise ValueError("host/uds: nothing to listen on (give --host, --uds, or sockets)")
    for site in sites:
        await site.start()
    where = ", ".join(_describe(site) for site in sites)
    log.info("serving %s on %s", name, where)
    notifier.ready(f"serving {name} on {where}")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    failures: list[str] = []
    if isinstance(async_engine, AsyncEngine):

        def engine_died(why: str) -> None:
            # Its requests have their errors already; exit non-zero so systemd (or whoever
            # runs us) restarts a daemon that can serve, instead of answering 503 forever.
            failures.append(why)
            stop.set()

        async_engine.on_failure = engine_died
    await stop.wait()

    await drain_and_stop(
        Stoppable(api, async_engine, runner, sites, notifier), config.server.drain_timeout
    )
    if watchdog is not None:
        watchdog.cancel()
    if isinstance(async_engine, AsyncEngine):  # replicas close their own engines
        async_engine.engine.close()  # the KV connector's last writes, its peer server
    if profiler is not None:
        profiler.close()
    if uds_sock is not None and config.server.uds:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.server.uds)
    if failures:
        log.error("stopped: %s", failures[0])
        return 1
    log.info("stopped")
    return 0


async def _local_engine(config: ServeConfig, notifier: Notifier) -> tuple[AsyncEngine, Any]:
    """The engine in this process (--data-parallel-size 1), warmed up."""
    loop = asyncio.get_running_loop()
    # Built on the thread that will run every step: libgomp keeps a thread pool per thread
    # that opens a parallel region, and with more pooled threads than cores it cuts its
    # workers' spinning to ~100 rounds, so each region would pay a futex wake-up.
    runner_thread = runner_executor()
    engine = await loop.run_in_executor(runner_thread, Engine, config.engine)
    overlap = config.server.overlap
    if overlap is None:
        overlap = engine.device.type == "cuda"
    async_engine = AsyncEngine(engine, overlap=overlap, executor=runner_thread)
    async_engine.on_iteration = notifier.watchdog
    if notifier.watchdog_interval is not None:
        async_engine.idle_timeout = notifier.watchdog_interval
    notifier.status("warming up")
    await warm_up(async_engine)
    log.info("batch-queue overlap %s", "on" if async_engine.overlap else "off")
    profiler = None
    if config.server.profile_steps:  # after warm-up: its steps would skew the profile
        from daemon.engine.step_profile import StepProfiler

        profiler = StepProfiler(config.server.profile_steps)
        profiler.attach(engine)
    return async_engine, profiler


async def _ping(notifier: Notifier) -> None:
    """The systemd watchdog with replicas: the front door's loop answers for itself."""
    interval = notifier.watchdog_interval
    while interval is not None:
        notifier.watchdog()
        await asyncio.sleep(interval / 2)


def _describe(site: web.BaseSite) -> str:
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    names = []
    for sock in sockets:
        addr = sock.getsockname()
        names.append(
            f"unix:{addr}" if sock.family == socket.AF_UNIX else f"http://{addr[0]}:{addr[1]}"
        )
    return ", ".join(names) or site.name


def run(config: ServeConfig) -> int:
    code = uvloop.run(serve(config))
    # NOTE: interpreter teardown after a clean stop (torch, tokenizers, xgrammar modules)
    # took 12 s on the busy 2-core test machine, past drain-timeout + 5 s; nothing is left
    # to save, so flush and leave without it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
