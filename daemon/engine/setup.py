"""The parts of an engine's construction that are choices, not wiring: its thread team, its
policy, and the line it logs at start-up."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from daemon.engine import speculative
from daemon.engine.config import EngineConfig, default_threads
from daemon.engine.loaded_model import pick_device
from plugins import load_policy
from runner.parallel.step import CacheSpec
from runner.thread_governor import ThreadGovernor
from scheduling import Policy
from scheduling.policies.fair import parse_tenant_weights

if TYPE_CHECKING:
    from daemon.engine.engine import Engine
    from daemon.engine.loaded_model import LoadedModel


def thread_governor(config: EngineConfig) -> ThreadGovernor | None:
    """Sets torch's thread count; returns the governor when it should adapt it per step.
    Under tensor parallelism each rank takes its share of the cores (runner/parallel)."""
    if config.tensor_parallel_size > 1:
        return None
    if not (config.threads or pick_device(config.device).type == "cpu"):
        return None
    threads = config.threads or default_threads()
    torch.set_num_threads(threads)
    governor = ThreadGovernor(threads)
    # A PASSIVE team sleeps instead of spinning: it never waits on a lost core.
    passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    # --deterministic: a fixed team (the kernels' split of the work follows it).
    governed = config.thread_governor and not config.deterministic
    return governor if governed and governor.enabled and not passive else None


def tp_cache_spec(engine: Engine, num_blocks: int, loaded: LoadedModel) -> CacheSpec:
    """What the tensor-parallel workers need to mirror rank 0's cache and linear paths."""
    platform = loaded.platform
    return CacheSpec(
        num_blocks,
        engine.config.block_size,
        engine.runner.attn_backend.name,
        platform.small_rows if platform else 0,
        platform.min_rows if platform else None,
        engine.config.deterministic,
        engine.kv_dtype == torch.int8,
        platform.q4_rows if platform else 0,
    )


def make_policy(config: EngineConfig) -> Policy:
    """The configured policy; `--tenant-weights` go to `fair`, `--urgent-wait` to
    `priority`, the policies that have them."""
    if config.urgent_wait is not None:
        if config.policy != "priority":
            raise ValueError(f"urgent_wait: only the priority policy has it, not {config.policy!r}")
        return load_policy("priority", urgent_wait=config.urgent_wait)
    if not config.tenant_weights:
        return load_policy(config.policy)
    if config.policy != "fair":
        raise ValueError(f"tenant_weights: only the fair policy has them, not {config.policy!r}")
    return load_policy("fair", weights=parse_tenant_weights(config.tenant_weights))


def describe(engine: Engine) -> str:
    """The start-up line: what runs where, with which budgets."""
    config = engine.config
    loras = engine.loras
    lora = (
        f"{len(loras)} adapter(s), {config.max_loras} slots of rank <= {config.max_lora_rank}"
        if loras is not None
        else "off"
    )
    return (
        f"engine: {engine.model_name} ({engine.model_config.architecture}) on "
        f"{engine.device}/{engine.dtype}, attention {engine.runner.attn_backend.name}, "
        f"{engine.kv.num_blocks} KV blocks of {config.block_size} tokens "
        f"({str(engine.kv_dtype).removeprefix('torch.')} rows), "
        f"{torch.get_num_threads()} threads (OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, thread governor "
        f"{'on' if engine.governor else 'off'}), speculative "
        f"{speculative.describe(engine.speculative)}, LoRA {lora}"
        + (f", tensor parallel {config.tensor_parallel_size}" if engine.tp_driver else "")
    )
