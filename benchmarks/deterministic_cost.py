"""What --deterministic costs, and what it buys: decode throughput and batch invariance.

    python benchmarks/deterministic_cost.py [--concurrency 1 8 32] [--output-len 64]
                                            [--prompt-len 128] [--threads N] [--model PATH]

For the default engine and for `--deterministic` (each with the platform's own dtype and
weight-format choices on the embedded SmolLM2 unless --model), c greedy requests run
together (Engine.generate, ignore_eos) at each concurrency c: output tokens per second, and
how many of the c outputs differ from the same request run alone. Ends with
`RESULT det_over_default_cN=<throughput ratio> ... mismatches_default=<n> mismatches_det=<n>`.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from scheduling import SamplingParams


def run(cfg: EngineConfig, args: argparse.Namespace) -> dict[int, tuple[float, int]]:
    loaded = LoadedModel.load(cfg)
    if loaded.platform is not None:
        print(f"  {loaded.platform.describe()}", flush=True)
    engine = Engine(cfg, loaded)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    out = {}
    for c in args.concurrency:
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(c)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm
        t = time.perf_counter()
        together = engine.generate(prompts, params)
        seconds = time.perf_counter() - t
        solo = [engine.generate([p], params)[0].token_ids for p in prompts] if c > 1 else []
        mismatches = sum(a.token_ids != b for a, b in zip(together, solo))
        out[c] = (c * args.output_len / seconds, mismatches)
        print(f"  c={c:3d}: {out[c][0]:8.1f} tok/s, {mismatches}/{c} differ from solo", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    figures = {}
    for name, det in (("default", False), ("deterministic", True)):
        print(f"{name}:", flush=True)
        cfg = EngineConfig(model=args.model, threads=args.threads, deterministic=det)
        figures[name] = run(cfg, args)
    ratios = " ".join(
        f"det_over_default_c{c}={figures['deterministic'][c][0] / figures['default'][c][0]:.3f}"
        for c in args.concurrency
    )
    mis = {k: sum(m for _, m in v.values()) for k, v in figures.items()}
    print(
        f"RESULT {ratios} mismatches_default={mis['default']} "
        f"mismatches_det={mis['deterministic']} threads={args.threads}"
    )


if __name__ == "__main__":
    main()
