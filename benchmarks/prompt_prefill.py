"""Time to first token of prompts, prefill only, through each prompt-attention path.

    python benchmarks/prompt_prefill.py [--shapes 16x128 4x512 1x2000] [--reps 3]

Each shape is B prompts of L tokens from position 0, added at once to an Engine on the
embedded model with `max_tokens=1` (prefix caching off), stepped until all have their token
(one or two steps under the default 2048-token budget). The same run times three paths for
prompt chunks, interleaved, on one Engine with the default C++ attention backend (decode
rows and the fused ops stay the same):

    amx      the default where the CPU has AMX: runner/cpu_ops/amx_attention.cpp
    causal   the torch reference: SDPA with `is_causal` for prompts from position 0 (the
             default without AMX)
    masked   the torch reference forced onto its general path: an explicit additive mask
             over the folded KV-head groups (what every prompt took before `is_causal`)

Median of `--reps`; the RESULT line gives the reference paths' times over the AMX kernel's.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["16x128", "4x512", "1x2000"])
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
    if not getattr(backend, "amx", False):
        raise SystemExit(f"no AMX prompt kernel here (backend {backend.name}): nothing to compare")
    # (prompt kernel on, how the reference builds groups)
    variants: dict[str, tuple[bool, Callable]] = {
        "amx": (True, _group), "causal": (False, _group), "masked": (False, masked_group)
    }  # fmt: skip
    fields = []
    for shape in args.shapes:
        batch, length = (int(x) for x in shape.split("x"))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(args.reps + 1):  # the first round warms up
            for name, (amx, group) in variants.items():
                backend.amx, attention._group = amx, group
                ms = prefill_ms(engine, batch, length, seed=rep * 1000 + len(name))
                if rep:
                    times[name].append(ms)
        backend.amx = True
        attention._group = _group
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"{batch} x {length} tokens, first tokens after: " + ", ".join(
            f"{name} {ms:.0f} ms" for name, ms in med.items()))  # fmt: skip
        fields += [f"{name}_over_amx_{shape}={med[name] / med['amx']:.2f}"
                   for name in ("causal", "masked")]  # fmt: skip
    print(f"RESULT {' '.join(fields)}")


if __name__ == "__main__":
    main()
