"""Where a decode step goes: forward (linear, attention), metadata, sampling, the rest.

    python benchmarks/step_profile.py [--batch 1 32] [--threads N] [--dtype auto]
                                      [--quantization auto] [--steps 30] [--rounds 3]

For each batch size, starts that many requests (64-token prompts), prefills them, then
times `--steps` decode steps of the real Engine. Each part is timed by wrapping the function
that does it (wall clock, per step, median over steps); "python/other" is what is left of
the step: the scheduler, the runner's bookkeeping, detokenisation and glue.

Each batch size runs twice, side by side: layer by layer (`layers`, every op called from
Python) and with the decoder stack as one C++ call where the step qualifies (`fused`,
runner/models/fused_decode.py; its time is "fused_layers"). The memory roofline is the
bytes a step must read (each linear's weights in the format it takes at that batch size,
plus the KV cache the step attends) over this machine's measured read bandwidth; the
fraction printed is roofline / step.

The fused step runs `--rounds` times, each right after its own read test: on a shared host
the bandwidth a test sees swung 24-37 GB/s between runs minutes apart (Zen 3), and a step
timed at another moment than its test made the fraction swing 0.43-0.76. The table shows the
round with the median fraction, and RESULT that median.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from machine import cpu_description, read_bandwidth

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from runner import kv_format
from runner.attention_backends import CpuKernelAttentionBackend, TorchAttentionBackend
from runner.layers.linear import ONEDNN_DTYPES, Linear
from runner.layers.q4_blocks import Q4_GEMV
from runner.model_runner import ModelRunner
from runner.models.fused_decode import FusedDecode
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
        (FusedDecode, "__call__", "fused_layers"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for (owner, attr, fn), (_, _, label) in zip(saved, patches, strict=True):
        setattr(owner, attr, timed(label, fn))
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def weight_bytes(m: Linear, rows: int) -> int:
    """The bytes of weights `m` reads for a call of `rows` rows (the copy it takes then)."""
    kernel = m.kernel_for(max(rows, m.min_rows))  # padded calls read what larger ones do
    small = m.small_batch_copy
    if kernel == "small" and small is not None:
        if small.kernel_for(rows) == Q4_GEMV and small.q4 is not None:
            return small.q4.packed.numel()
        return small.weight.numel() + small.scale.numel() * 4
    if kernel == "batched" and m._batched is not None:
        return m._batched.packed.numel() + m._batched.scale.numel() * 8
    if kernel in ONEDNN_DTYPES:
        return m.out_features * m.in_features * ONEDNN_DTYPES[kernel].itemsize
    if kernel == "int8":
        return m.out_features * m.in_features
    if kernel == "amx_bf16" and m._amx is not None:
        return m._amx.tiles.numel() * 2
    return m.weight.numel() * m.weight.element_size()


def step_bytes(loaded: LoadedModel, batch: int, context: int) -> int:
    """Weights plus the KV cache a decode step of `batch` requests of `context` keys reads."""
    model = loaded.model
    weights = sum(weight_bytes(m, batch) for m in model.modules() if isinstance(m, Linear))
    cfg = model.config
    int8_auto = loaded.platform is not None and loaded.platform.int8_kv
    kv_dtype = kv_format.cache_dtype("auto", loaded.dtype, int8_auto)  # what the engine takes
    row = kv_format.row_width(cfg.head_dim, kv_dtype) * kv_dtype.itemsize
    kv = batch * context * 2 * cfg.num_key_value_heads * row * cfg.num_hidden_layers
    return weights + kv


def profile(
    loaded: LoadedModel, args: argparse.Namespace, batch: int, fused: bool
) -> dict[str, float]:
    engine = Engine(
        EngineConfig(
            threads=args.threads,
            kv_cache_memory=512 << 20,
            max_num_seqs=batch,
            attention_backend=args.attention_backend,
        ),
        loaded,
    )
    # The runner decided with its backend (set_attention_backend); `layers` overrides it.
    if not fused:
        loaded.model.fused_decode = None
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
    ap.add_argument("--rounds", type=int, default=3, help="fused runs, each with a read test")
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
    parts = ["fused_layers", "linear", "paged_attention", "write_kv", "build_metadata", "sample"]
    ratios, figures = [], []
    for batch in args.batch:
        runs = {"layers": profile(loaded, args, batch, False)}
        # Keys attended, averaged over the timed steps: the 64-token prompt plus the decodes.
        read = step_bytes(loaded, batch, 64 + 1 + args.steps // 2)
        rounds = []  # (fraction of the roofline, read bandwidth, fused profile)
        for _ in range(args.rounds):
            bandwidth = read_bandwidth()
            fused_run = profile(loaded, args, batch, True)
            rounds.append((read / bandwidth * 1e3 / fused_run["step"], bandwidth, fused_run))
        _, bandwidth, runs["fused"] = sorted(rounds, key=lambda r: r[0])[len(rounds) // 2]
        roofline = read / bandwidth * 1e3
        print(f"batch {batch}: reads {read / 1e6:.1f} MB a step -> roofline {roofline:.2f} ms "
              f"at {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")  # fmt: skip
        print(
            "  rounds (fraction of the roofline at that round's read test): "
            + ", ".join(f"{f:.3f} at {b / 1e9:.1f} GB/s" for f, b, _ in rounds)
        )
        print(f"  {'ms a step':16s} {'layers':>16s} {'fused':>16s}")
        for name in [*parts, "python/other", "step"]:
            cells = []
            for t in runs.values():
                other = t["step"] - sum(t.get(p, 0.0) for p in parts)
                v = other if name == "python/other" else t.get(name, 0.0)
                cells.append(f"{v:7.2f} {v / t['step']:6.1%}  ")
            print(f"  {name:16s} {''.join(cells)}")
        layers, fused = runs["layers"]["step"], runs["fused"]["step"]
        print(f"  of the roofline: layers {roofline / layers:.1%}, fused {roofline / fused:.1%}")
        ratios.append(f"bs{batch}_fused_vs_layers={layers / fused:.3f} "
                      f"bs{batch}_roofline_frac={roofline / fused:.3f}")  # fmt: skip
        figures.append(f"bs{batch}_step_ms={fused:.2f} bs{batch}_layers_step_ms={layers:.2f} "
                       f"bs{batch}_tok_s={batch / fused * 1e3:.1f} "
                       f"bs{batch}_roofline_ms={roofline:.2f}")  # fmt: skip
    print(f"RESULT {' '.join(ratios)} {' '.join(figures)} threads={torch.get_num_threads()} "
          f"read_gb_s={bandwidth / 1e9:.1f} weights={loaded.platform.weight_format} "
          f"dtype={loaded.dtype}")  # fmt: skip


if __name__ == "__main__":
    main()
