"""What bounds decode attention here: its read rate cold and hot, on one thread and on all.

    python benchmarks/decode_attention.py [--batch 32] [--keys 176 1024] [--dtype bfloat16]
    python benchmarks/decode_attention.py --contexts 4000 40 40 40 40 40 40 40
    python benchmarks/decode_attention.py --kv-int8 [--keys 176 1024]

A decode step of `batch` requests with `keys` cached keys each calls the kernel once per
layer over that layer's own cache (SmolLM2's shape: 9 query heads, 3 KV heads of 64, 30
layers, blocks of 16 scattered through the cache). "cold" walks the 30 layers' caches as a
step does, so the KV comes from memory; "hot" calls one layer's cache 30 times, so it comes
from L2 or L3 (by its size). Printed against the machine's read bandwidth
(a sum over 512 MB): a cold rate that doubles with the threads while staying under the
bandwidth is bound by each core's misses in flight, not by the arithmetic or the memory.

`--contexts` times one batch of requests with those context lengths instead (cold, all
threads): chat's mix of long and short contexts, where the threads' shares of the keys, not
of the work items, decide when the step ends.

`--kv-int8` times the int8 cache (--kv-cache-dtype int8, runner/kv_format.py) beside the
`--dtype` one, cold, all threads, alternating the two step by step: the ratio is what the
int8 rows (68 bytes where bf16 takes 128) save on the same keys.
"""

from __future__ import annotations

import argparse
import time

import torch
from machine import cpu_description, read_bandwidth

from runner import kv_format
from runner.cpu_ops import load_cpu_ops

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def step_seconds(
    contexts: list[int], dtype: torch.dtype, hot: bool, steps: int, kv_int8: bool = False
) -> float:
    """Median seconds of one step's 30 calls over requests of these context lengths."""
    batch, per = len(contexts), -(-max(contexts) // BLOCK)
    caches = [torch.randn(2, batch * per + 8, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
              for _ in range(1 if hot else LAYERS)]  # fmt: skip
    if kv_int8:
        caches = [kv_format.quantize_rows(c) for c in caches]
    tables = torch.randperm(batch * per + 8)[: batch * per].view(batch, per).contiguous()
    lens = torch.tensor(contexts, dtype=torch.int64)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
    attend = torch.ops.headrace.paged_decode_attention
    times = []
    for _ in range(steps + 2):  # the first two page the caches in
        t = time.perf_counter()
        for layer in range(LAYERS):
            attend(q, caches[0 if hot else layer], tables, lens, HEAD_DIM**-0.5)
        times.append(time.perf_counter() - t)
    return sorted(times[2:])[len(times[2:]) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--keys", type=int, nargs="+", default=[176, 1024])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--contexts", type=int, nargs="+", help="one batch of these context lengths")
    p.add_argument("--kv-int8", action="store_true", help="the int8 cache beside --dtype's")
    args = p.parse_args()
    print(cpu_description())
    reason = load_cpu_ops()
    assert reason is None, f"no CPU kernels: {reason}"
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({threads} threads)")
    figures = []
    if args.kv_int8:
        compare_int8(args.batch, args.keys, dtype, args.steps)
        return
    if args.contexts:
        read = sum(args.contexts) * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize * LAYERS
        s = step_seconds(args.contexts, dtype, False, args.steps)
        print(f"contexts {args.contexts}: {s * 1e3:.2f} ms a step, {read / s / 1e9:.1f} GB/s")
        print(f"RESULT mixed_cold_vs_bandwidth={read / s / bandwidth:.3f} "
              f"mixed_step_ms={s * 1e3:.2f} threads={threads} "
              f"read_gb_s={bandwidth / 1e9:.1f}")  # fmt: skip
        return
    for keys in args.keys:
        read = args.batch * keys * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize * LAYERS
        rates = {}
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            for hot in (False, True):
                s = step_seconds([keys] * args.batch, dtype, hot, args.steps)
                rates[(n, hot)] = read / s
                print(f"{args.batch} x {keys} keys, {n} thread(s), {'hot' if hot else 'cold'}: "
                      f"{s * 1e3:.2f} ms a step, {read / s / 1e9:.1f} GB/s")  # fmt: skip
        torch.set_num_threads(threads)
        cold, cold1 = rates[(threads, False)], rates[(1, False)]
        figures.append(f"k{keys}_cold_vs_bandwidth={cold / bandwidth:.3f} "
                       f"k{keys}_cold_threads_scaling={cold / cold1:.2f} "
                       f"k{keys}_hot_vs_cold={rates[(threads, True)] / cold:.2f}")  # fmt: skip
    print(f"RESULT {' '.join(figures)} threads={threads} read_gb_s={bandwidth / 1e9:.1f}")


def compare_int8(batch: int, key_counts: list[int], dtype: torch.dtype, steps: int) -> None:
    """Cold steps on the int8 cache against `dtype`'s, alternated, best of three medians."""
    figures = []
    for keys in key_counts:
        best = {"model": float("inf"), "int8": float("inf")}
        for _ in range(3):
            for name in best:
                s = step_seconds([keys] * batch, dtype, False, steps, name == "int8")
                best[name] = min(best[name], s)
        ratio = best["model"] / best["int8"]
        print(f"{batch} x {keys} keys, cold: {str(dtype).removeprefix('torch.')} cache "
              f"{best['model'] * 1e3:.2f} ms, int8 cache {best['int8'] * 1e3:.2f} ms a step "
              f"({ratio:.2f}x)")  # fmt: skip
        figures.append(f"int8_speedup_k{keys}={ratio:.3f}")
    print(f"RESULT {' '.join(figures)} batch={batch} threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
