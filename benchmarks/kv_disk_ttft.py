"""Disk tier: TTFT of a long shared system prompt, cold vs after a restart.

    python benchmarks/kv_disk_ttft.py [--prefix-len 3000] [--threads 1]
                                      [--dtype auto] [--quantization none]

An engine with `--kv-connector disk` over an empty cache directory answers one request
(system prompt + question 1, max_tokens 1): cold, the whole prompt is computed, and its
full blocks are written to the disk tier. Then the engine is closed, the model loaded again
and a new engine built over the same directory (a restarted daemon); it answers system
prompt + question 2. Its TTFT covers reading the prompt's blocks back and computing only
the question. Both engines warm up on a short unrelated prompt first. Target: restart TTFT
<= 0.2x cold for a >= 3,000-token prefix.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

from machine import cpu_description

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from scheduling import SamplingParams

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def engine(args: argparse.Namespace, kv_dir: str) -> Engine:
    config = EngineConfig(
        threads=args.threads,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_memory=256 << 20,
        kv_connector="disk",
        kv_disk_dir=kv_dir,
    )
    e = Engine(config, LoadedModel.load(config))
    e.generate([list(range(200, 264))], FIRST)  # warm-up: kernels, first-call costs
    return e


def ttft(e: Engine, prompt: list[int]) -> tuple[float, int, list[int]]:
    t = time.perf_counter()
    (done,) = e.generate([prompt], FIRST)
    return time.perf_counter() - t, done.cached_tokens, done.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix-len", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    # Pinned: "auto" decides int8 by a start-up micro-benchmark, and on a busy machine a
    # restart may decide otherwise; another weight format is another KV layout (no hits).
    ap.add_argument("--quantization", default="none")
    args = ap.parse_args()
    rng = random.Random(0)
    system = [rng.randrange(100, 40_000) for _ in range(args.prefix_len)]
    q1 = [rng.randrange(100, 40_000) for _ in range(24)]
    q2 = [rng.randrange(100, 40_000) for _ in range(24)]
    with tempfile.TemporaryDirectory() as cache:
        first = engine(args, cache)
        cold_s, cold_cached, _ = ttft(first, system + q1)
        first.close()
        stored = sum(len(f) for _, _, f in os.walk(cache))
        restarted = engine(args, cache)
        warm_s, warm_cached, _ = ttft(restarted, system + q2)
        restarted.close()
    print(cpu_description())
    print(f"prompt: {args.prefix_len} shared + 24 own tokens; {stored} block files written")
    print(f"{'':10} {'TTFT s':>8} {'cached tokens':>14}")
    print(f"{'cold':10} {cold_s:8.3f} {cold_cached:14d}")
    print(f"{'restarted':10} {warm_s:8.3f} {warm_cached:14d}")
    print(
        f"RESULT ttft_ratio={warm_s / cold_s:.3f} cold_ttft_s={cold_s:.3f} "
        f"restart_ttft_s={warm_s:.3f} cached_tokens={warm_cached} prefix_tokens={args.prefix_len}"
    )


if __name__ == "__main__":
    main()
