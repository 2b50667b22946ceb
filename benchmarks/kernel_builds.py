"""Builds of the CPU kernels against each other: the batched int8 "dot" kernel at a few rows.

    python benchmarks/kernel_builds.py --variant NAME=CFLAGS [--variant ...] \
        [--rows 1 2 4 8 32] [--rounds 3]

e.g. `--variant no_prefetch=-DHR_PREFETCH_BYTES=0 --variant ahead4k=-DHR_PREFETCH_BYTES=4096`.
The compiler flags are part of a build's cache key (HEADRACE_CPU_OPS_CFLAGS appends them), so
each variant is its own library; two cannot share a process (one op namespace), so every
round runs each build in a process of its own, the order rotated each round, and only
ratios within a round compare. The baseline is the default build.

A process times sweeps of all of SmolLM2's linear shapes (121 linears, random int8 weights,
135 MB: they stream from memory as in a decode step) through the "dot" kernel, median of 15
sweeps per row count. RESULT gives baseline / variant (> 1: the variant is faster), the
median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from machine import cpu_description

# SmolLM2-135M: hidden 576, MLP 1536, 30 layers, vocabulary 49152 (fused QKV and gate/up).
_H, _I, _L, _V = 576, 1536, 30, 49152
SHAPES = [(960, _H), (_H, _H), (2 * _I, _H), (_H, _I)] * _L + [(_V, _H)]


def child(rows: list[int]) -> dict[int, float]:
    """ms a sweep at each row count, in this process's build."""
    import torch

    from runner.cpu_ops import load_cpu_ops

    why = load_cpu_ops()
    if why is not None:
        raise SystemExit(f"the CPU kernels did not build: {why}")
    torch.manual_seed(0)
    weights = []
    for n, k in SHAPES:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        weights.append((torch.ops.headrace.batched_int8_pack(q), torch.rand(n) * 0.01, n, k))
    out = {}
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (_H, _I)}

        def sweep(xs: dict[int, torch.Tensor] = xs) -> None:
            for packed, scale, n, k in weights:
                torch.ops.headrace.batched_int8_linear(xs[k], packed, scale, None, n, "dot")

        sweep()
        times = []
        for _ in range(15):
            t = time.perf_counter()
            sweep()
            times.append(time.perf_counter() - t)
        out[m] = 1e3 * statistics.median(times)
    return out


def run_build(cflags: str, rows: list[int]) -> dict[int, float]:
    env = {**os.environ, "HEADRACE_CPU_OPS_CFLAGS": cflags}
    cmd = [sys.executable, __file__, "--child", "--rows", *map(str, rows)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"build {cflags!r} failed:\n{done.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=CFLAGS")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.rows)))
        return
    builds = {"baseline": os.environ.get("HEADRACE_CPU_OPS_CFLAGS", "")}
    for v in args.variant:
        name, sep, flags = v.partition("=")
        if not sep or not name or name in builds:
            raise SystemExit(f"--variant: {v!r} is not a new NAME=CFLAGS")
        builds[name] = f"{builds['baseline']} {flags}".strip()
    print(cpu_description())
    print("builds:", ", ".join(f"{n} [{f or 'default'}]" for n, f in builds.items()))
    for flags in builds.values():  # first builds (minutes each) outside the timed rounds
        run_build(flags, [1])
    names = list(builds)
    ratios: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        got = {name: run_build(builds[name], args.rows) for name in order}
        for name in names:
            line = "  ".join(f"{m} rows {got[name][m]:7.2f} ms" for m in args.rows)
            print(f"round {r + 1} {name:>14}: {line}", flush=True)
            if name != "baseline":
                for m in args.rows:
                    ratios.setdefault((name, m), []).append(got["baseline"][m] / got[name][m])
    print("baseline / variant (> 1: the variant is faster), each round:")
    pairs = []
    for (name, m), each in ratios.items():
        med = statistics.median(each)
        print(f"  {name} at {m} rows: {' '.join(f'{x:.2f}x' for x in each)} -> median {med:.2f}x")
        pairs.append(f"speedup_{name}_r{m}={med:.3f}")
    print("RESULT " + " ".join(pairs))


if __name__ == "__main__":
    main()
