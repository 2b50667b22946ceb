"""The device side of the batch queue (CUDA only): sampled ids stay on the GPU.

On CUDA a plain greedy step (no logprobs, penalties, bias, min_tokens or drafts) samples
with an argmax on the device and does not wait for it:

```
runner thread:  launch N: inputs, forward, argmax -> ids_N (GPU) -> async copy to pinned, event
                launch N+1: a decode whose token N is still sampling gets a 0 in its input row,
                            then input[row] = ids_N[i] on the GPU: no host round trip
loop:           await N's event on a waiter thread, read the pinned ids -> scheduler.update
```
The runner's own token lists learn the ids later (`settle`, on the runner thread, once the
copy is done), so runner state stays on the runner thread. A step that needs host-side
sampling first settles everything (waiting if it must) and runs the CPU sampler as before.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from scheduling import RunnerOutput, SamplingParams


def to_device(
    values: list[int], device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """A host list as a device tensor without waiting for the GPU.

    NOTE: `torch.tensor(values, device="cuda")` copies from pageable memory, which waits for
    every kernel queued before it: the runner would stall on the step in flight. A pinned
    copy is asynchronous (the caching host allocator keeps the buffer until it is done).
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HasTokenIds(Protocol):
    token_ids: list[int]


def plain_greedy(params: SamplingParams) -> bool:
    """True when the argmax of the raw logits is exactly what the CPU sampler would pick."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.logit_bias
        and params.min_tokens == 0
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
    )


class _Done:
    """A completed event, for ids that were never on a GPU."""

    def synchronize(self) -> None:
        pass


@dataclass(slots=True)
class PendingOutput:
    """One step's sampled ids on their way into pinned host memory."""

    req_ids: list[str]
    # [N] int64 device ids: the next step reads its placeholders from here.
    device_ids: torch.Tensor
    # [N] int64 pinned host copy, valid once `done` has completed.
    host_ids: torch.Tensor
    done: torch.cuda.Event | _Done
    started: float
    # req id -> row, for settling; requests that finish or are preempted are dropped here.
    rows: dict[str, int] = field(default_factory=dict)

    def result(self) -> RunnerOutput:
        """Wait for this step only (safe on any thread), then its ids as a RunnerOutput."""
        self.done.synchronize()
        ids = self.host_ids.tolist()
        out = RunnerOutput({rid: [ids[i]] for i, rid in enumerate(self.req_ids)})
        out.duration_s = time.perf_counter() - self.started
        return out


class DeviceTokens:
    """Steps whose sampled ids the runner's token lists do not hold yet, oldest first."""

    def __init__(self) -> None:
        self.pending: deque[PendingOutput] = deque()

    def record(self, device_ids: torch.Tensor, req_ids: list[str], started: float) -> PendingOutput:
        if device_ids.is_cuda:
            host = torch.empty(device_ids.shape, dtype=torch.long, pin_memory=True)
            host.copy_(device_ids, non_blocking=True)
            done: torch.cuda.Event | _Done = torch.cuda.Event()
            done.record()
        else:  # CPU tensors (tests of this bookkeeping): the ids are already there
            host, done = device_ids.clone(), _Done()
        step = PendingOutput(req_ids, device_ids, host, done, started)
        step.rows = {rid: i for i, rid in enumerate(req_ids)}
        self.pending.append(step)
        return step

    def settle(self, requests: dict[str, HasTokenIds], keep_latest: bool) -> None:
        """Append finished steps' ids to the token lists; all but the newest step when
        `keep_latest` (waiting for older ones, which are done in practice), else all."""
        while len(self.pending) > (1 if keep_latest else 0):
            step = self.pending.popleft()
            step.done.synchronize()
            ids = step.host_ids.tolist()
            for rid, row in step.rows.items():
                if rid in requests:
                    requests[rid].token_ids.append(ids[row])

    def forget(self, rid: str) -> None:
        """A finished or preempted request: its in-flight ids must not reach a later copy."""
        for step in self.pending:
            step.rows.pop(rid, None)

    def latest_row(self, rid: str) -> int | None:
        """Row of rid's not-yet-settled id in the newest step (after settle(keep_latest))."""
        return self.pending[-1].rows.get(rid) if self.pending else None
