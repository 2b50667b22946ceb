"""Prompt chunks without AMX: the vector kernel or torch's SDPA, chosen by measurement.

```
choose_vec_prefill(heads, kv_heads, head_dim, dtype, block_size) -> PrefillChoice   (cached)
wants_vec_prefill(setting, q, kv_cache, meta) -> bool                    per layer, per step
```
`torch.ops.headrace.paged_prefill_attention_vec_` (runner/cpu_ops/vec_attention.cpp) reads
the paged blocks in place; the reference gathers them and runs SDPA (`is_causal` for prompts
from position 0, an explicit mask for chunks after cached tokens). Which is faster depends on
the CPU, the head shape and the dtype, so each attention shape is timed once, both ways, on
a representative step of each kind, best of interleaved rounds, and the choice is logged. A
step's chunks differ in length (the scheduler packs several requests), and the reference
pads every chunk of a group to the longest chunk and context: so the steps timed are mixed
ones (fresh prompts of 384, 96 and 32 tokens; 256, 64 and 32 tokens after 512, 96 and 1,024
cached). Timed on one chunk of 256 after 512, the old kernel lost to SDPA (2.05 against 1.67
ms, AMX-masked Xeon) and served chat prompts through the padded reference, which took 4.43
ms where that kernel took 2.67 on the mixed step. The engine's start-up warm-up
prompt makes the first measurement, so a served engine has chosen before its first request.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from runner import attention
from runner.format_timing import best_of_interleaved

log = logging.getLogger("headrace.cpu_prefill")

HEAD_DIMS = (64, 128)
DTYPES = (torch.float32, torch.bfloat16)
# Query heads per KV head the kernel's tiles hold (kMaxRows in vec_attention.cpp).
MAX_GROUP = 64
# The steps timed, (cached, new) tokens per request: mixed lengths, as the scheduler packs them.
FRESH_STEP = ([0, 0, 0], [384, 96, 32])
CONTINUED_STEP = ([512, 96, 1024], [256, 64, 32])


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """Whether the vector kernel takes prompt chunks, per kind of prefill step."""

    fresh: bool  # prompts from position 0 (against SDPA with is_causal)
    continued: bool  # chunks after cached tokens (against masked SDPA)


def kernel_supports(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    return (
        dtype in DTYPES
        and head_dim in HEAD_DIMS
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and hasattr(torch.ops.headrace, "paged_prefill_attention_vec_")
    )


def time_prefill_step(
    done: list[int], new: list[int], heads: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype, block_size: int, rounds: int,
) -> tuple[float, float]:  # fmt: skip
    """(kernel, reference) seconds for one attention call of this step, best of `rounds`."""
    cpu = torch.device("cpu")
    per = [-(-(d + n) // block_size) for d, n in zip(done, new)]
    order = torch.randperm(sum(per)).tolist()
    tables, at = [], 0
    for count in per:
        tables.append(order[at : at + count])
        at += count
    kv = torch.randn(2, sum(per), block_size, kv_heads, head_dim).to(dtype)
    q = torch.randn(sum(new), heads, head_dim).to(dtype)
    meta = attention.build_metadata(done, new, tables, block_size, cpu)
    kernel = torch.ops.headrace.paged_prefill_attention_vec_
    scale = head_dim**-0.5
    runs = {
        "kernel": lambda: attention.paged_attention(q, kv, meta, scale, None, kernel),
        "sdpa": lambda: attention.paged_attention(q, kv, meta, scale),
    }
    with torch.inference_mode():
        for run in runs.values():  # warm: first calls page in and build the mask
            run()
        best = best_of_interleaved(runs, rounds)
    return best["kernel"], best["sdpa"]


@functools.cache
def choose_vec_prefill(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
    rounds: int = 3,
) -> PrefillChoice:  # fmt: skip
    """Time the kernel against SDPA for this shape (once per process); log and return it."""
    shape = f"{heads}/{kv_heads} heads x {head_dim}, {str(dtype).removeprefix('torch.')}"
    if not kernel_supports(heads, kv_heads, head_dim, dtype):
        log.info("prompt attention (%s): SDPA (no vector kernel for this shape)", shape)
        return PrefillChoice(False, False)
    torch.manual_seed(0)
    try:
        shape_args = (heads, kv_heads, head_dim, dtype, block_size, rounds)
        fresh = time_prefill_step(*FRESH_STEP, *shape_args)
        continued = time_prefill_step(*CONTINUED_STEP, *shape_args)
    except RuntimeError as e:  # e.g. a build without AVX2: the op says why
        log.warning("prompt attention (%s): SDPA (vector kernel unusable: %s)", shape, e)
        return PrefillChoice(False, False)
    choice = PrefillChoice(fresh[0] < fresh[1], continued[0] < continued[1])
    log.info(
        "prompt attention (%s): fresh 384+96+32 kernel %.2f ms vs SDPA %.2f ms -> %s; "
        "256+64+32 after 512/96/1024 cached kernel %.2f ms vs SDPA %.2f ms -> %s",
        shape,
        fresh[0] * 1e3,
        fresh[1] * 1e3,
        "kernel" if choice.fresh else "SDPA",
        continued[0] * 1e3,
        continued[1] * 1e3,
        "kernel" if choice.continued else "SDPA",
    )
    return choice


def wants_vec_prefill(
    setting: bool | None, q: torch.Tensor, kv_cache: torch.Tensor, meta: Any
) -> bool:
    """Whether this step's prompt chunks take the kernel: `setting` True/False forces it
    (where the shape allows), None follows the measured choice for the step's kind."""
    _, heads, head_dim = q.shape
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if setting is False or kv_cache.dtype not in (q.dtype, torch.int8):
        return False
    if not kernel_supports(heads, kv_heads, head_dim, q.dtype):
        return False
    if setting:
        return True
    # build_metadata makes at most one group of chunks a step.
    chunks = next((g for g in meta.groups if g.token_index.shape[1] > 1), None)
    if chunks is None:
        return False
    choice = choose_vec_prefill(heads, kv_heads, head_dim, q.dtype, block_size)
    return choice.fresh if chunks.fresh else choice.continued
