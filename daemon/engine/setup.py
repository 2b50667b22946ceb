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
from runner.thread_governor import ThreadGovernor
from scheduling import Policy
from scheduling.policies.fair import parse_tenant_weights

if TYPE_CHECKING:
    from daemon.engine.engine import Engine


def thread_governor(config: EngineConfig) -> ThreadGovernor | None:
    """Sets torch's thread count; returns the governor when it should adapt it per step."""
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


def make_policy(config: EngineConfig) -> Policy:
    """The configured policy; `--tenant-weights` go to `fair`, the one policy that has them."""
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
        f"{engine.kv.num_blocks} KV blocks of {config.block_size} tokens, "
        f"{torch.get_num_threads()} threads (OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, thread governor "
        f"{'on' if engine.governor else 'off'}), speculative "
        f"{speculative.describe(engine.speculative)}, LoRA {lora}"
    )
