"""One stream and a few: the small-batch int8 copy against the batched kernel, A/B in one process.

    python benchmarks/few_rows.py [--rounds 4] [--batch 1 8] [--small-rows 4]

Loads the embedded SmolLM2 as `headrace serve` does (dtype and quantization auto). Where the
start-up measurement gave the batched kernel the small copy's rows (runner/batched_rows.py;
on AVX2 without VNNI it drops the copy), the copy is built again from the float weights.
Then, each round and batch size, it generates 64 tokens (greedy, EOS ignored) for that many
fresh 128-token prompts twice: with the copy serving up to `--small-rows` rows ("small",
the choice before the split by total time) and with the kernel serving them ("kernel"),
in alternating order, so that the guest's drift falls on both. Figures are end to end
(prefill included) and only their ratio within a round compares. A batch above
`--small-rows` runs the same kernels both ways: an A/A control that shows the guest's noise.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from machine import cpu_description

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from runner.layers.linear import Linear
from runner.layers.weight_formats import SmallBatchInt8
from runner.models.fused_decode import FusedDecode
from scheduling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--small-rows", type=int, default=4)
    args = ap.parse_args()
    print(cpu_description())
    config = EngineConfig(device="cpu", dtype="auto", quantization="auto", max_num_seqs=64)
    loaded = LoadedModel.load(config)
    print(loaded.platform.describe() if loaded.platform else "no platform")
    layers = [m for m in loaded.model.modules() if isinstance(m, Linear) and m.batched_int8]
    weights = [m.float_weight() for m in layers]
    if not layers or any(w is None for w in weights):
        raise SystemExit("needs batched int8 copies on float weights (AVX2 or AVX-512, no AMX)")
    for m, w in zip(layers, weights, strict=True):
        if not m.has_small_batch_int8:
            m.set_small_batch_int8(SmallBatchInt8.from_weight(w, "rows"))
    engine = Engine(config, loaded)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)

    def serve_few_rows_on(path: str) -> None:
        for m in layers:
            m.small_rows = args.small_rows if path == "small" else 0
        fused = loaded.model.fused_decode
        if fused is not None:  # it keeps each row count's kernels: a fresh one chooses again
            loaded.model.fused_decode = FusedDecode(fused.layers)

    ratios: dict[int, list[float]] = {b: [] for b in args.batch}
    for r in range(args.rounds):
        for batch in args.batch:
            tok_s = {}
            for path in ("small", "kernel") if r % 2 == 0 else ("kernel", "small"):
                serve_few_rows_on(path)
                prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(batch)]
                t = time.perf_counter()
                done = engine.generate(prompts, params)
                tok_s[path] = sum(len(c.token_ids) for c in done) / (time.perf_counter() - t)
            ratios[batch].append(tok_s["kernel"] / tok_s["small"])
            print(
                f"round {r} batch {batch}: small {tok_s['small']:.1f} tok/s, "
                f"kernel {tok_s['kernel']:.1f} ({ratios[batch][-1]:.2f}x)",
                flush=True,
            )
    fields = [f"kernel_vs_small_b{b}={statistics.median(v):.3f}" for b, v in ratios.items()]
    print(f"RESULT {' '.join(fields)} small_rows={args.small_rows} rounds={args.rounds}")


if __name__ == "__main__":
    main()
