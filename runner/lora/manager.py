"""The runner's LoRA state: adapted layers, the resident-adapter table, the step's segments.

Touched on the runner thread only. Adapters live in host memory (runner/lora/registry.py);
`max_loras` of them are resident at a time, copied into the wrappers' slots when a step
needs one that is not. Eviction takes the least recently used slot that the step itself does
not use; the scheduler admits no more distinct adapters than slots (SchedulerConfig
.max_loras), so a step always finds room.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from runner.lora.adapter import LoRAAdapter, LoRABase
from runner.lora.batch import LoRABatch
from runner.lora.layers import install_lora

log = logging.getLogger("headrace.lora")


class ResidentAdapters:
    """`max_loras` slots, keyed by adapter id, least recently used first."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._slots: OrderedDict[str, int] = OrderedDict()  # lora_id -> slot, LRU first

    def lookup(self, lora_id: str) -> int | None:
        slot = self._slots.get(lora_id)
        if slot is not None:
            self._slots.move_to_end(lora_id)
        return slot

    def claim(self, lora_id: str, keep: set[str]) -> int:
        """A slot for `lora_id`: a free one, else the least recently used not in `keep`."""
        if len(self._slots) < self.max_loras:
            slot = min(set(range(self.max_loras)) - set(self._slots.values()))
        else:
            victim = next((lid for lid in self._slots if lid not in keep), None)
            if victim is None:
                raise RuntimeError(
                    f"a step needs more than --max-loras {self.max_loras} adapters at once"
                )
            slot = self._slots.pop(victim)
        self._slots[lora_id] = slot
        return slot

    def resident(self) -> list[str]:
        return list(self._slots)


class LoRAManager:
    """Installs the LoRA wrappers on `model` and feeds them each step's segments."""

    def __init__(
        self,
        model: nn.Module,
        base: LoRABase,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.base, self.max_rank = base, max_rank
        self.device, self.dtype = device, dtype
        self.table = ResidentAdapters(max_loras)
        # The fused Triton kernel on CUDA, the C++ kernel on a CPU where the CPU ops build;
        # torch's matmuls elsewhere.
        self.use_kernel = device.type == "cuda" and _triton_available()
        self.cpu_kernel = device.type == "cpu" and _cpu_kernel_available()
        self.context, self.layers = install_lora(
            model, base, max_loras, max_rank, device, dtype, transposed_b=self.cpu_kernel
        )

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        base: LoRABase,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> LoRAManager:
        """The model's manager, installed on first use: engines sharing one loaded model
        share its wrappers and so one resident table (they step one at a time)."""
        manager = getattr(model, "lora_manager", None)
        if manager is None:
            manager = cls(model, base, max_loras, max_rank, device, dtype)
            model.lora_manager = manager
        elif (manager.table.max_loras, manager.max_rank) != (max_loras, max_rank):
            raise ValueError(
                f"this model serves LoRA with max_loras {manager.table.max_loras} and "
                f"max_lora_rank {manager.max_rank} already"
            )
        return manager

    def begin_step(self, adapters: Sequence[LoRAAdapter | None], num_tokens: Sequence[int]) -> bool:
        """Make the step's adapters resident and publish its segments to every wrapper.
        False (and nothing published) when no request of the step runs an adapter."""
        self.context.batch = None
        if not any(adapters):
            return False
        keep = {ad.lora_id for ad in adapters if ad is not None}
        slots = [-1 if ad is None else self._slot(ad, keep) for ad in adapters]
        self.context.batch = LoRABatch.build(
            slots, num_tokens, self.device, self.dtype, self.use_kernel, self.cpu_kernel
        )
        return self.context.batch is not None

    def end_step(self) -> None:
        self.context.batch = None

    def _slot(self, adapter: LoRAAdapter, keep: set[str]) -> int:
        slot = self.table.lookup(adapter.lora_id)
        if slot is None:
            slot = self.table.claim(adapter.lora_id, keep)
            for layer in self.layers:
                layer.load_slot(slot, adapter)
            log.info("LoRA adapter %s is resident in slot %d", adapter.lora_id, slot)
        return slot


def _cpu_kernel_available() -> bool:
    from runner.cpu_ops import load_cpu_ops

    return load_cpu_ops() is None and hasattr(torch.ops.headrace, "lora_delta_")


def _triton_available() -> bool:
    from runner.triton_ops import triton_available

    return triton_available()
