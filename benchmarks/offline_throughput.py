"""Offline throughput: headrace's Engine vs transformers' static batching, same model and threads.

    python benchmarks/offline_throughput.py [--threads N] [--requests 64] [--output-len 128]
                                            [--dtype auto] [--quantization auto]

64 requests of ~64-token prompts, 128 output tokens each (ignore_eos), on the embedded
SmolLM2-135M-Instruct. headrace runs them through continuous batching with the platform's
choice of dtype and weight format (`--dtype float32 --quantization none` for the exact fp32
path); transformers runs `generate` in fp32, in static batches of 16. The script also
measures the machine's fp32 GEMM rate at the same thread count and reports which fraction of
it each engine reaches (in fp32-equivalent FLOPs).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from machine import cpu_description

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from runner.model_config import ModelConfig
from runner.model_source import resolve_model
from scheduling import SamplingParams


def gemm_gflops(n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


def flops_per_token(cfg: ModelConfig, context: float) -> float:
    """Matmul FLOPs of one token: 2 x weights it multiplies (lm_head included) + attention."""
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    weights = cfg.num_hidden_layers * per_layer + cfg.hidden_size * cfg.vocab_size
    attention = cfg.num_hidden_layers * 2 * 2 * cfg.q_size * context
    return 2 * weights + attention


def make_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40_000) for _ in range(length)] for _ in range(n)]


def run_headrace(loaded: LoadedModel, prompts: list[list[int]], output_len: int, threads: int):
    engine = Engine(EngineConfig(threads=threads, kv_cache_memory=1 << 30), loaded)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    t = time.perf_counter()
    out = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    assert all(len(c.token_ids) == output_len for c in out)
    return sum(len(c.token_ids) for c in out) / elapsed, [c.token_ids for c in out]


def run_transformers(prompts: list[list[int]], output_len: int, batch: int):
    from transformers import AutoModelForCausalLM

    src = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(
        src.path, gguf_file=src.gguf_file.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as on our side
    outputs = []
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False)
        t = time.perf_counter()
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            outputs += out[:, ids.shape[1] :].tolist()
        elapsed = time.perf_counter() - t
    return len(prompts) * output_len / elapsed, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    print(cpu_description())
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.requests, args.prompt_len)
    peak = gemm_gflops()
    loaded = LoadedModel.load(
        EngineConfig(device="cpu", dtype=args.dtype, quantization=args.quantization)
    )
    assert loaded.platform is not None
    print(loaded.platform.describe())
    weights = loaded.platform.weight_format
    ours, our_ids = run_headrace(loaded, prompts, args.output_len, args.threads)
    cfg = loaded.config
    del loaded
    theirs, their_ids = run_transformers(prompts, args.output_len, args.hf_batch)
    same = sum(a == b for a, b in zip(our_ids, their_ids))
    context = args.prompt_len + args.output_len / 2
    flops = flops_per_token(cfg, context)
    ours_frac, theirs_frac = (tok_s * flops / 1e9 / peak for tok_s in (ours, theirs))
    print(f"threads={args.threads} fp32 GEMM {peak:.1f} GFLOP/s, {flops / 1e6:.0f} MFLOP/token")
    print(f"headrace      {ours:8.1f} output tok/s  ({ours_frac:.0%} of the GEMM roofline)")
    print(
        f"transformers  {theirs:8.1f} output tok/s  ({theirs_frac:.0%}; "
        f"static batch {args.hf_batch})"
    )
    print(f"identical greedy outputs: {same}/{len(prompts)}")
    print(
        f"RESULT ratio={ours / theirs:.3f} headrace_tok_s={ours:.1f} "
        f"transformers_tok_s={theirs:.1f} "
        f"roofline_frac={ours_frac:.3f} transformers_roofline_frac={theirs_frac:.3f} "
        f"threads={args.threads} weights={weights}"
    )


if __name__ == "__main__":
    main()
