"""The engine's KV connector (--kv-connector): built for its model, handed loads each step.

The engine owns both halves, so it is the one that carries finished loads from the runner
side to the scheduler side (`land_loads`, before each schedule) and new loads the other way
(`start_loads`, after it) — on the loop thread, whether or not the step runs anything.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from daemon.engine.client import KVConnectorStats
from daemon.engine.config import EngineConfig
from plugins import load_kv_connector
from runner.cache_dir import cache_dir
from runner.kv_connectors import KVConnector, KVConnectorContext, model_layout
from runner.model_config import ModelConfig
from scheduling import Scheduler, SchedulerOutput

log = logging.getLogger("headrace.engine")


def build_kv_connector(
    config: EngineConfig,
    model: torch.nn.Module,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> KVConnector | None:
    """The --kv-connector plugin built for this model's KV layout, or None."""
    if config.kv_connector == "none":
        return None
    if config.prefix_cache_hash != "sha256" or not config.enable_prefix_caching:
        raise ValueError("kv_connector: needs prefix caching with sha256 block hashes")
    if config.kv_commit_mb_per_step <= 0:
        raise ValueError(f"kv_commit_mb_per_step: must be > 0, got {config.kv_commit_mb_per_step}")
    layout = model_layout(model, model_config, dtype, config.block_size)
    ctx = KVConnectorContext(
        layout,
        dtype,
        device,
        config.kv_role,
        config.kv_peer,
        int(config.kv_store_gb * (1 << 30)),
        Path(config.kv_disk_dir) if config.kv_disk_dir else cache_dir() / "kv",
        int(config.kv_commit_mb_per_step * (1 << 20)),
        config.kv_peer_shm,
    )
    connector: Any = load_kv_connector(config.kv_connector, ctx)
    log.info(
        "kv connector %s (role %s), layout %s",
        config.kv_connector,
        config.kv_role or "-",
        layout.namespace,
    )
    return connector


def connector_stats(
    connector: KVConnector | None, scheduler: Scheduler, block_size: int
) -> KVConnectorStats | None:
    """The connector's figures for /metrics (a plugin's worker may lack some: they read 0)."""
    if connector is None:
        return None
    worker = connector.worker
    store = getattr(worker, "store", None)
    failures = Counter(getattr(store, "failures", {}))
    failures.update(getattr(worker, "failures", {}))
    drain = getattr(worker, "drain_load_seconds", None)
    saved_blocks = getattr(worker, "num_saved_blocks", 0)
    return KVConnectorStats(
        loaded_tokens=scheduler.kv_loads.num_loaded_tokens,
        saved_tokens=saved_blocks * block_size,
        loaded_blocks=getattr(worker, "num_loaded_blocks", 0),
        saved_blocks=saved_blocks,
        loaded_bytes=getattr(worker, "num_loaded_bytes", 0),
        saved_bytes=getattr(worker, "num_saved_bytes", 0),
        failures=dict(failures),
        transfers=dict(getattr(store, "transfers", {})),
        store_bytes=getattr(store, "num_bytes", 0),
        load_seconds=drain() if drain is not None else [],
    )


def land_loads(connector: KVConnector | None, scheduler: Scheduler) -> None:
    """Loads the runner side finished go to the scheduler; unwanted ones are dropped."""
    if connector is None:
        return
    done = connector.worker.poll_loads()
    if done:
        accepted = scheduler.kv_loads_landed(done)
        connector.worker.discard(set(done) - set(accepted))


def start_loads(connector: KVConnector | None, so: SchedulerOutput) -> None:
    """Loads the step's schedule started (they run off every thread that steps)."""
    if connector is not None and so.kv_connector_meta and so.kv_connector_meta.loads:
        connector.worker.start_loads(so.kv_connector_meta.loads)


def needs_runner(connector: KVConnector | None) -> bool:
    """Whether fetched KV waits for a runner step to copy it in (an empty step does)."""
    return connector is not None and connector.worker.needs_commit()


def wait_for_loads(connector: KVConnector | None, so: SchedulerOutput) -> None:
    """A script with nothing to run but loads in flight sleeps until one lands."""
    if connector is not None and so.is_empty and connector.worker.has_inflight():
        connector.worker.wait_any(0.05)
