"""What a served model keeps resident: headrace as it serves, against its own baseline side by side.

    python benchmarks/serve_memory.py [--rounds 2] [--threads 2]

Each round loads the embedded SmolLM2 as `headrace serve` does (dtype and quantization
auto, a 1 GiB KV pool) in a fresh process twice, in alternating order:

```
headrace   as shipped: a layer whose batched copy serves the whole token budget frees its own
           format (runner/batched_rows.py), the token table is kept as its Q8_0 blocks
           (runner/layers/q8_embedding.py), and the heap the load freed goes back to the OS
           (runner/heap.py)
baseline   all three undone in that process: every own format and the dense table kept, no
           heap trim
```

and reports the resident set at the load's peak (sampled every 5 ms), after loading and after
a warm-up of 8 requests (128-token prompts, 32 tokens each, greedy), the KV pool and what is
resident besides it, and the warm-up's tokens/s (the same kernels serve both: a control, not
a speed claim).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time

from machine import cpu_description

VARIANTS = ("headrace", "baseline")


def child(variant: str, threads: int) -> dict[str, float]:
    import daemon.engine.loaded_model as loaded_model
    import runner.platform
    from daemon.engine.config import EngineConfig
    from daemon.engine.engine import Engine
    from runner.heap import resident_bytes
    from runner.layers.linear import Linear
    from scheduling import SamplingParams

    if variant == "baseline":
        Linear.drop_own_format = lambda self: None  # type: ignore[method-assign]
        loaded_model.trim_heap = lambda: 0  # type: ignore[attr-defined]
        runner.platform.compress_embedding = lambda model: 0  # type: ignore[attr-defined]
    # The peak, sampled: the kernel's VmHWM lagged the load's peak by hundreds of MB here.
    peak, loading = [0], threading.Event()

    def sample() -> None:
        while not loading.wait(0.005):
            peak[0] = max(peak[0], resident_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    engine = Engine(EngineConfig(device="cpu", threads=threads))
    loading.set()
    sampler.join()
    loaded = resident_bytes()
    kv = sum(t.numel() * t.element_size() for t in engine.runner.kv_caches)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(8)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    warm = resident_bytes()
    return {
        "load_peak_mb": peak[0] / 1e6,
        "loaded_mb": loaded / 1e6,
        "warm_mb": warm / 1e6,
        "kv_mb": kv / 1e6,
        "besides_kv_mb": (warm - kv) / 1e6,
        "tok_s": tokens / seconds,
    }


def run_child(variant: str, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, "--threads", str(threads)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads)))
        return
    print(cpu_description())
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            runs[variant].append(run_child(variant, args.threads))
            fig = runs[variant][-1]
            print(f"round {r + 1} {variant:9s} " + " ".join(f"{k} {v:.0f}" for k, v in fig.items()))
    keys = list(runs["headrace"][0])
    med = {v: {k: statistics.median(f[k] for f in runs[v]) for k in keys} for v in VARIANTS}
    print(f"\n{'median':12s}" + "".join(f"{k:>15s}" for k in keys))
    for v in VARIANTS:
        print(f"{v:12s}" + "".join(f"{med[v][k]:15.1f}" for k in keys))
    h, b = med["headrace"], med["baseline"]
    print(
        f"RESULT warm_ratio={h['warm_mb'] / b['warm_mb']:.3f} "
        f"besides_kv_ratio={h['besides_kv_mb'] / b['besides_kv_mb']:.3f} "
        f"tok_s_ratio={h['tok_s'] / b['tok_s']:.3f} "
        f"warm_mb={h['warm_mb']:.0f} baseline_warm_mb={b['warm_mb']:.0f} "
        f"besides_kv_mb={h['besides_kv_mb']:.0f} baseline_besides_kv_mb={b['besides_kv_mb']:.0f} "
        f"load_peak_mb={h['load_peak_mb']:.0f} baseline_load_peak_mb={b['load_peak_mb']:.0f} "
        f"rounds={args.rounds}"
    )


if __name__ == "__main__":
    main()
