"""Where a decode step goes: forward (linear, attention), metadata, sampling, the rest.

    python benchmarks/step_profile.py [--batch 1 32] [--threads N] [--dtype auto]
                                      [--quantization auto] [--steps 30]

For each batch size, starts that many requests (64-token prompts), prefills them, then
times `--steps` decode steps of the real Engine. Each part is timed by wrapping the function
that does it (wall clock, per step, median over steps); "python/other" is what is left of
the step: the scheduler, the runner's bookkeeping, detokenisation and glue.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from machine import cpu_description

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from runner.attention_backends import CpuKernelAttentionBackend, TorchAttentionBackend
from runner.layers.linear import Linear
from runner.model_runner import ModelRunner
from scheduling import SamplingParams

TIMES: dict[str, float] = collections.defaultdict(float)


def timed(name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t

    return wrapper


@contextlib.contextmanager
def instrumented() -> Iterator[None]:
    """Wrap the step's parts where they are looked up (the attention backend, the runner's
    sampling, the Linear class)."""
    patches = [
        (TorchAttentionBackend, "build_metadata", "build_metadata"),
        (TorchAttentionBackend, "write_kv", "write_kv"),
        (TorchAttentionBackend, "forward", "paged_attention"),
        (CpuKernelAttentionBackend, "forward", "paged_attention"),
        (CpuKernelAttentionBackend, "write_kv", "write_kv"),
        (ModelRunner, "_sample", "sample"),
        (Linear, "forward", "linear"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for (owner, attr, fn), (_, _, label) in zip(saved, patches, strict=True):
        setattr(owner, attr, timed(label, fn))
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def profile(loaded: LoadedModel, args: argparse.Namespace, batch: int) -> dict[str, float]:
    engine = Engine(
        EngineConfig(
            threads=args.threads,
            kv_cache_memory=512 << 20,
            max_num_seqs=batch,
            attention_backend=args.attention_backend,
        ),
        loaded,
    )
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + 13 * j) % 40_000 + 100 for j in range(64)] for i in range(batch)]
    for p in prompts:
        engine.add_request(p, params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) \
            or engine.scheduler.waiting:  # fmt: skip
        engine.step()
    engine.step()
    per_step: dict[str, list[float]] = collections.defaultdict(list)
    with instrumented():
        for _ in range(args.steps):
            TIMES.clear()
            t = time.perf_counter()
            engine.step()
            TIMES["step"] = time.perf_counter() - t
            for k, v in TIMES.items():
                per_step[k].append(v)
    engine.abort([r.request_id for r in list(engine.scheduler.running)])
    return {k: statistics.median(v) * 1e3 for k, v in per_step.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--attention-backend", default="auto", help="auto, torch or cpu")
    args = ap.parse_args()
    print(cpu_description())
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = LoadedModel.load(
        EngineConfig(device="cpu", dtype=args.dtype, quantization=args.quantization)
    )
    assert loaded.platform is not None
    print(loaded.platform.describe())
    print(f"attention backend: {args.attention_backend}")
    parts = ["linear", "paged_attention", "write_kv", "build_metadata", "sample"]
    result = []
    for batch in args.batch:
        t = profile(loaded, args, batch)
        other = t["step"] - sum(t.get(p, 0.0) for p in parts)
        print(f"batch {batch}: step {t['step']:.2f} ms (median of {args.steps})")
        for p in parts:
            print(f"  {p:16s} {t.get(p, 0.0):7.2f} ms  {t.get(p, 0.0) / t['step']:5.1%}")
        print(f"  {'python/other':16s} {other:7.2f} ms  {other / t['step']:5.1%}")
        result.append(
            f"bs{batch}_step_ms={t['step']:.2f} bs{batch}_tok_s={batch / t['step'] * 1e3:.1f}"
        )
    print(f"RESULT {' '.join(result)} threads={torch.get_num_threads()} "
          f"weights={loaded.platform.weight_format} dtype={loaded.dtype}")  # fmt: skip


if __name__ == "__main__":
    main()
