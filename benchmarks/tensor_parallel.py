"""Tensor parallelism on the CPU: decode step time, TP=2 (one thread per rank) vs TP=1 (two
threads), and the time rank 0 spends in collectives per step.

    python benchmarks/tensor_parallel.py [--model PATH] [--batches 1,32] [--steps 40]
    python benchmarks/tensor_parallel.py --check --device cuda   (gpu_check.sh, 2+ GPUs)

Each configuration runs `batch` requests to their decode phase, then times `steps` decode
steps through the real Engine (fp32, no quantization). `comm` is rank 0's time inside
all-reduce and gather, waiting for the other rank included; on a 2-core box the two ranks
share a machine with everything else, so TP cannot win much here. On a two-socket server
each rank streams its half of the weights from its own socket's memory: a memory-bound
decode step then approaches half its time plus `comm`.
"""

from __future__ import annotations

import argparse
import time

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from scheduling import SamplingParams


def decode_steps(model: str | None, tp: int, threads: int, batch: int, steps: int) -> dict:
    engine = Engine(
        EngineConfig(
            model=model,
            device="cpu",
            dtype="float32",
            quantization="none",
            threads=threads,
            tensor_parallel_size=tp,
            max_num_seqs=max(batch, 1),
            kv_cache_memory=256 << 20,
        )
    )
    try:
        params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request([100 + i, 200, 300, 400, 500, 600, 700, 800], params)
        reqs = engine.scheduler.requests.values
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs()):
            engine.step()
        for _ in range(2):  # warm
            engine.step()
        group = engine.tp_driver.tp if engine.tp_driver else None
        comm0 = group.comm_s if group else 0.0
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = time.perf_counter() - start
        comm = (group.comm_s - comm0) if group else 0.0
        return {"step_ms": elapsed / steps * 1e3, "comm_ms": comm / steps * 1e3}
    finally:
        engine.close()


def check_greedy(model: str | None, device: str) -> None:
    """TP=2 greedy tokens equal TP=1's (fp32): the correctness check for two GPUs."""
    outs = []
    for tp in (1, 2):
        engine = Engine(EngineConfig(model=model, device=device, dtype="float32",
                                     quantization="none", tensor_parallel_size=tp,
                                     kv_cache_memory=256 << 20))  # fmt: skip
        try:
            prompts = [engine.tokenize(p) for p in ("The capital of France is", "def add(a, b):")]
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            outs.append([c.token_ids for c in engine.generate(prompts, params)])
        finally:
            engine.close()
    print(f"RESULT tp_greedy_equal={int(outs[0] == outs[1])} device={device}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="GGUF file or HF directory (default: embedded SmolLM2)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--check", action="store_true", help="only TP=2 vs TP=1 greedy tokens")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.check:
        check_greedy(args.model, args.device)
        return
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, float] = {}
    print(
        f"{'batch':>5} {'TP=1 x2 thr ms':>15} {'TP=2 x1 thr ms':>15} {'comm ms':>8} {'comm %':>7}"
    )
    for b in batches:
        one = decode_steps(args.model, 1, 2, b, args.steps)
        two = decode_steps(args.model, 2, 1, b, args.steps)
        share = two["comm_ms"] / two["step_ms"]
        print(f"{b:>5} {one['step_ms']:>15.2f} {two['step_ms']:>15.2f} "
              f"{two['comm_ms']:>8.2f} {share * 100:>6.1f}%")  # fmt: skip
        result[f"tp2_over_tp1_b{b}"] = two["step_ms"] / one["step_ms"]
        result[f"comm_share_b{b}"] = share
        result[f"tp1_step_ms_b{b}"] = one["step_ms"]
        result[f"tp2_step_ms_b{b}"] = two["step_ms"]
    # Ratios first, then the step times they come from.
    order = sorted(result, key=lambda k: ("_ms_" in k, k))
    print("RESULT " + " ".join(f"{k}={result[k]:.3f}" for k in order))


if __name__ == "__main__":
    main()
