"""Does torch.compile pay off on CPU? Eager vs inductor-compiled norms, MLP and RoPE.

    python benchmarks/compile_check.py [--threads 1] [--requests 64] [--output-len 48]

Same Engine, same 64 requests (64-token prompts, ignore_eos), first eager, then with the
element-wise-heavy modules compiled with dynamic shapes (token counts vary every step, so
static shapes would recompile per count). Reports throughput of both and the compile cost.
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


def run(cfg: EngineConfig, loaded: LoadedModel, prompts: list[list[int]], n: int):
    engine = Engine(cfg, loaded)
    t = time.perf_counter()
    engine.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    warm = time.perf_counter() - t
    t = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    tok_s = len(prompts) * n / (time.perf_counter() - t)
    return tok_s, warm, [c.token_ids for c in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(threads=args.threads, device="cpu", kv_cache_memory=512 << 20)
    loaded = LoadedModel.load(cfg)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40_000) for _ in range(64)] for _ in range(args.requests)]
    eager, eager_warm, eager_ids = run(cfg, loaded, prompts, args.output_len)
    for layer in loaded.model.layers:
        for module in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
            module.forward = torch.compile(module.forward, dynamic=True)
    loaded.model.rope.forward = torch.compile(loaded.model.rope.forward, dynamic=True)
    compiled, compiled_warm, compiled_ids = run(cfg, loaded, prompts, args.output_len)
    print(f"eager     {eager:7.1f} tok/s (warm-up {eager_warm:.1f} s)")
    print(f"compiled  {compiled:7.1f} tok/s (warm-up incl. compile {compiled_warm:.1f} s)")
    print(f"same greedy outputs: {eager_ids == compiled_ids}")
    print(
        f"RESULT compiled_vs_eager={compiled / eager:.3f} eager_tok_s={eager:.1f} "
        f"compiled_tok_s={compiled:.1f} compile_s={compiled_warm:.1f}"
    )


if __name__ == "__main__":
    main()
