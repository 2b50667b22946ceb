"""Time to first token of prompts, prefill only, through each prompt-attention path.

    python benchmarks/prompt_prefill.py [--shapes 16x128 4x512 1x2000] [--reps 3]
                                        [--chunks 64 256 1024]

Each shape is B prompts of L tokens from position 0, added at once to an Engine on the
embedded model with `max_tokens=1` (prefix caching off), stepped until all have their token
(one or two steps under the default 2048-token budget). The same run times the paths for
prompt chunks, interleaved, on one Engine with the default C++ attention backend (decode
rows and the fused ops stay the same):

    amx      where the CPU has AMX (bf16): runner/cpu_ops/amx_attention.cpp
    vec      the vector kernel (AVX-512 / AVX2): runner/cpu_ops/vec_attention.cpp
    causal   the torch reference: SDPA with `is_causal` for prompts from position 0
    masked   the torch reference forced onto its general path: an explicit additive mask
             over the folded KV-head groups (what every prompt took before `is_causal`)

Then one attention call (one layer, the model's heads and dtype) per chunk size: the vector
kernel against SDPA for a fresh prompt of L tokens and for L tokens after L cached.

Median of `--reps`; the RESULT line gives the SDPA paths' times over the vector kernel's
(engine, then attention alone; > 1: the kernel is faster), and over AMX's where it exists.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from machine import cpu_description

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from runner import attention
from runner.attention_backends import CpuKernelAttentionBackend
from runner.cpu_prefill import time_prefill_step
from scheduling import SamplingParams

_group = attention._group


def masked_group(*args, **kwargs) -> attention.AttentionGroup:
    group = _group(*args, **kwargs)
    group.fresh = False
    return group


def prefill_ms(engine: Engine, batch: int, length: int, seed: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + 13 * j + seed) % 40_000 + 100 for j in range(length)], params)
    t = time.perf_counter()
    while engine.scheduler.waiting or engine.scheduler.running:
        engine.step()
    return (time.perf_counter() - t) * 1e3


def attention_ms(
    loaded: LoadedModel, chunk: int, cached: int, block_size: int
) -> tuple[float, float]:
    """(vector kernel, SDPA) ms for one layer's attention over one chunk."""
    cfg = loaded.config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shape = (heads, kv_heads, dim, loaded.dtype, block_size, 5)
    kernel, sdpa = time_prefill_step([cached], [chunk], *shape)
    return kernel * 1e3, sdpa * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["16x128", "4x512", "1x2000"])
    ap.add_argument("--chunks", nargs="+", type=int, default=[64, 256, 1024])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(cpu_description())
    loaded = LoadedModel.load(EngineConfig(device="cpu"))
    assert loaded.platform is not None
    print(loaded.platform.describe())

    # No prefix cache: every round must compute its prompts, not find the last round's.
    config = EngineConfig(kv_cache_memory=512 << 20, max_num_seqs=64, enable_prefix_caching=False)
    engine = Engine(config, loaded)
    backend = engine.runner.attn_backend
    if not isinstance(backend, CpuKernelAttentionBackend):
        raise SystemExit(f"no CPU kernels here (backend {backend.name}): nothing to compare")
    amx_here = backend.amx
    # (AMX kernel on, vector kernel on, how the reference builds groups)
    variants: dict[str, tuple[bool, bool, Callable]] = {
        "vec": (False, True, _group), "causal": (False, False, _group),
        "masked": (False, False, masked_group),
    }  # fmt: skip
    if amx_here:
        variants = {"amx": (True, False, _group), **variants}
    fields, attn_fields = [], []
    for shape in args.shapes:
        batch, length = (int(x) for x in shape.split("x"))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(args.reps + 1):  # the first round warms up
            for name, (amx, vec, group) in variants.items():
                backend.amx, backend.vec_prefill, attention._group = amx, vec, group
                ms = prefill_ms(engine, batch, length, seed=rep * 1000 + len(name))
                if rep:
                    times[name].append(ms)
        backend.amx, backend.vec_prefill, attention._group = amx_here, None, _group
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"{batch} x {length} tokens, first tokens after: " + ", ".join(
            f"{name} {ms:.0f} ms" for name, ms in med.items()))  # fmt: skip
        fields += [f"{name}_over_vec_{shape}={med[name] / med['vec']:.2f}"
                   for name in ("causal", "masked")]  # fmt: skip
        if amx_here:
            fields += [f"{name}_over_amx_{shape}={med[name] / med['amx']:.2f}"
                       for name in ("vec", "causal", "masked")]  # fmt: skip
    cfg = loaded.config
    print(f"one layer's attention ({cfg.num_attention_heads}/{cfg.num_key_value_heads} heads x "
          f"{cfg.head_dim}, {str(loaded.dtype).removeprefix('torch.')}):")  # fmt: skip
    for chunk in args.chunks:
        for cached, kind in ((0, "fresh"), (chunk, "after_cached")):
            vec, sdpa = attention_ms(loaded, chunk, cached, config.block_size)
            print(f"  chunk {chunk} {kind}: vec {vec:.3f} ms, SDPA {sdpa:.3f} ms")
            attn_fields.append(f"attn_sdpa_over_vec_{kind}_{chunk}={sdpa / vec:.2f}")
    print(f"RESULT {' '.join(fields + attn_fields)}")


if __name__ == "__main__":
    main()
