"""Threads and OpenMP wait settings: decode step time per setting, each in its own process.

    python benchmarks/threads_check.py [--batch 1 8] [--busy]

For threads in {1, all cores} x the OpenMP wait settings below, a fresh process loads the
embedded model (--dtype/--quantization as given, default auto), prefills `batch` requests and
times 20 decode steps (median). `--busy` also runs a pure-Python busy loop on one core
meanwhile, as a neighbour would. "governed" is the engine's default: libgomp spinning, with
runner/thread_governor.py dropping to one thread while a core is taken. It should never be
far from the best row, quiet or busy.

    passive     OMP_WAIT_POLICY=PASSIVE: idle workers sleep at once (a futex wake per region)
    spin        libgomp's default: spin ~300k rounds, then sleep (governor off)
    short-spin  GOMP_SPINCOUNT=10000: spin through the gaps between a forward's ops only
    governed    spin, with the thread governor on (the engine's default)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from machine import cpu_description

CHILD = r"""
import statistics, sys, time, torch
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from daemon.engine.config import EngineConfig
from scheduling import SamplingParams
threads, batch, dtype, quant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
governed = sys.argv[5] == "1"
cfg = EngineConfig(device="cpu", threads=threads, dtype=dtype, quantization=quant,
                   kv_cache_memory=256 << 20, thread_governor=governed)
engine = Engine(cfg, LoadedModel.load(cfg))
params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
for i in range(batch):
    engine.add_request([(7 * i + 13 * j) % 40000 + 100 for j in range(64)], params)
for _ in range(3):
    engine.step()
times = []
for _ in range(20):
    t = time.perf_counter(); engine.step(); times.append(time.perf_counter() - t)
print(statistics.median(times) * 1e3)
"""


# name -> (environment, governor on)
SETTINGS: dict[str, tuple[dict[str, str], bool]] = {
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, False),
    "spin": ({}, False),
    "short-spin": ({"GOMP_SPINCOUNT": "10000"}, False),
    "governed": ({}, True),
}


def busy_loop(seconds: float) -> subprocess.Popen:
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--busy", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    print(cpu_description())
    cores = len(os.sched_getaffinity(0))
    rows = []
    for batch in args.batch:
        for threads in sorted({1, cores}):
            for setting, (extra, governed) in SETTINGS.items():
                if governed and threads == 1:
                    continue
                env = dict(os.environ)
                for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
                    env.pop(var, None)
                env.update(extra)
                neighbour = busy_loop(600) if args.busy else None
                t = time.perf_counter()
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(threads), str(batch), args.dtype,
                     args.quantization, str(int(governed))],
                    env=env, capture_output=True, text=True, check=True,
                )  # fmt: skip
                if neighbour:
                    neighbour.kill()
                step_ms = float(out.stdout.split()[-1])
                rows.append((batch, threads, setting, step_ms))
                print(
                    f"batch {batch:3d} threads {threads} {setting:10s}"
                    f" step {step_ms:8.2f} ms  ({time.perf_counter() - t:.0f} s)",
                    flush=True,
                )
    fields = [f"b{b}_t{t}_{p.replace('-', '_')}_ms={ms:.2f}" for b, t, p, ms in rows]
    print(f"RESULT busy={int(args.busy)} cores={cores} {' '.join(fields)}")


if __name__ == "__main__":
    main()
