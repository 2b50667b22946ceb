"""Taking back a step that was stopped before it ended (runner/step_interrupt.py).

`StepBuilder.build` moves each request's `num_computed_tokens` forward and adds an output
placeholder when the step is scheduled, and the KV manager registers the blocks the step
fills in the prefix cache right then. A step stopped between layers wrote only part of its
KV, so all three go back: the counters, the placeholders, and the blocks' cache entries
(else a later request would read half-written KV as a hit). Blocks stay allocated to their
requests (the next step writes them again), so the runner's block tables stay right, and
its counters are set from the scheduler's each step anyway.

Not every step can be taken back: one that verifies drafts (the drafter moved on), that
moves KV through a connector (its saves and loads are promised), or that admitted a request
whose prefix hit a block this same step registered (that request would keep a hit on KV
never written).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.block import KVCacheBlock
from kvcache.manager import KVCacheManager
from scheduling.output import SchedulerOutput
from scheduling.request import Request


def can_undo(so: SchedulerOutput, kv: KVCacheManager, registered: Sequence[KVCacheBlock]) -> bool:
    """Whether `so` (whose schedule registered `registered`) can be taken back whole."""
    if so.is_empty or so.scheduled_spec_decode_tokens or so.kv_connector_meta is not None:
        return False
    if not registered:
        return True
    fresh = {b.block_id for b in registered}
    for new in so.scheduled_new_reqs:
        hit_blocks = new.num_computed_tokens // kv.block_size
        if any(b in fresh for b in new.block_ids[:hit_blocks]):
            return False
    return True


def undo_step(
    so: SchedulerOutput,
    requests: dict[str, Request],
    kv: KVCacheManager,
    registered: Sequence[KVCacheBlock],
) -> None:
    """Put every request of `so` back where it was before the step was scheduled."""
    computed: dict[str, int] = {}
    for rid, n in so.num_scheduled_tokens.items():
        req = requests.get(rid)
        if req is None:
            continue  # aborted while the step ran: its blocks are free, uncached below
        req.num_computed_tokens -= n
        if rid in so.sampling_req_ids and req.num_output_placeholders:
            req.num_output_placeholders -= 1
        computed[rid] = req.num_computed_tokens
    kv.uncache_registered(registered, computed)
