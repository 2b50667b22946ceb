"""Time to first token of prompts, prefill only: SDPA's `is_causal` path against the explicit mask.

    python benchmarks/prompt_prefill.py [--shapes 16x128 4x512 1x2000] [--reps 3]

Each shape is B prompts of L tokens from position 0, added at once to an Engine on the
embedded model with `max_tokens=1` (prefix caching off), stepped until all have their token
(one or two steps under the default 2048-token budget). The same run times it twice,
interleaved: as the engine runs it (a prompt group that starts at position 0 takes SDPA's
own `is_causal`, no mask) and with that group forced onto the general path (an explicit
additive mask over the folded KV-head groups), which is what every prompt took before.
Median of `--reps`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from machine import cpu_description

from daemon.engine import Engine
from daemon.engine_config import EngineConfig
from daemon.loaded_model import LoadedModel
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
    config = EngineConfig(kv_cache_memory=1024 << 20, max_num_seqs=64, enable_prefix_caching=False)
    engine = Engine(config, loaded)
    fields = []
    for shape in args.shapes:
        batch, length = (int(x) for x in shape.split("x"))
        variants: dict[str, Callable] = {"causal": _group, "masked": masked_group}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(args.reps + 1):  # the first round warms up
            for name, group in variants.items():
                attention._group = group
                ms = prefill_ms(engine, batch, length, seed=rep * 1000 + len(name))
                if rep:
                    times[name].append(ms)
        attention._group = _group
        causal, masked = (statistics.median(times[n]) for n in ("causal", "masked"))
        print(f"{batch} x {length} tokens: first tokens after {causal:.0f} ms (is_causal) "
              f"vs {masked:.0f} ms (explicit mask): {masked / causal:.2f}x")  # fmt: skip
        fields.append(f"ratio_{shape}={masked / causal:.2f}")
    print(f"RESULT {' '.join(fields)}")


if __name__ == "__main__":
    main()
