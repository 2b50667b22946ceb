"""The CPU's multiply-add peak, and how near the linears come to it.

    python benchmarks/mac_peak.py [--seconds 0.5] [--threads N]

First the peak: on every thread at once, eight independent chains of one instruction
(inline assembly, built here with gcc), in multiply-adds a second per core:
  fma_ymm     fp32 FMA, 8 lanes            (oneDNN's and MKL's fp32 GEMM)
  madd_ymm    int16 pairs into int32 + add (the AVX2 "dot" kernel)
  mix_ymm     four of each, interleaved    (whether the two use different ports)
  maddubs_ymm u8 x s8 pairs into int16 + add (32 multiplies an instruction)
  q4_ymm      eight maddubs + add, then one madd to widen (the "q4" kernel's block of 32)
  fma_zmm, dpbusd_zmm                      (AVX-512 and VNNI, where the CPU has them)
Then one of SmolLM2's linears (576 -> 3072) through each path the engine can take, as a
fraction of the peak of the instructions that path runs on: fp32 at prompt rows (oneDNN,
MKL), the int8 "dot" kernel at decode rows and the 4-bit "q4" kernel at both. A path near
1.0 has nothing left to gain from its kernel; only more multiply-adds a cycle (another
instruction) would.

RESULT gives the fractions first, then the peaks.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from machine import cpu_description

_ZERO = "".join(f"vpxor %%xmm{i},%%xmm{i},%%xmm{i}\\n" for i in range(16))


def _loop(name: str, body: list[str], zero: str = _ZERO) -> str:
    """A C function running `body` n times; the accumulators start at zero, operands too."""
    lines = "".join(f'"{line}\\n"' for line in body)
    return f"""
void {name}(long n) {{
  __asm__ volatile("{zero}" "1:\\n" {lines} "dec %0\\n jnz 1b\\n"
                   : "+r"(n) :: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7",
                     "xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15","cc");
}}"""


def _madd(acc: int, tmp: int) -> list[str]:
    return [f"vpmaddwd %%ymm14,%%ymm15,%%ymm{tmp}", f"vpaddd %%ymm{tmp},%%ymm{acc},%%ymm{acc}"]


def _maddubs(acc: int, tmp: int) -> list[str]:
    return [f"vpmaddubsw %%ymm14,%%ymm15,%%ymm{tmp}", f"vpaddw %%ymm{tmp},%%ymm{acc},%%ymm{acc}"]


# name: (C source, multiply-adds per iteration, lscpu flags it needs)
KERNELS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "fma_ymm": (
        _loop("fma_ymm", [f"vfmadd231ps %%ymm14,%%ymm15,%%ymm{i}" for i in range(8)]),
        8 * 8,
        ("avx2", "fma"),
    ),
    "madd_ymm": (
        _loop("madd_ymm", [x for i in range(8) for x in _madd(i, 8 + i % 4)]),
        8 * 16,
        ("avx2",),
    ),
    "mix_ymm": (
        _loop(
            "mix_ymm",
            [
                x
                for i in range(4)
                for x in [*_madd(i, 8 + i), f"vfmadd231ps %%ymm14,%%ymm15,%%ymm{4 + i}"]
            ],
        ),
        4 * 16 + 4 * 8,
        ("avx2", "fma"),
    ),
    "maddubs_ymm": (
        _loop("maddubs_ymm", [x for i in range(8) for x in _maddubs(i, 8 + i % 4)]),
        8 * 32,
        ("avx2",),
    ),
    "q4_ymm": (
        _loop(
            "q4_ymm",
            [
                *(x for i in range(8) for x in _maddubs(i % 4, 8 + i % 4)),
                "vpmaddwd %%ymm13,%%ymm0,%%ymm12",
                "vpaddd %%ymm12,%%ymm4,%%ymm4",
            ],
        ),
        8 * 32,
        ("avx2",),
    ),
    "fma_zmm": (
        _loop("fma_zmm", [f"vfmadd231ps %%zmm14,%%zmm15,%%zmm{i}" for i in range(8)]),
        8 * 16,
        ("avx512f",),
    ),
    "dpbusd_zmm": (
        _loop("dpbusd_zmm", [f"vpdpbusd %%zmm14,%%zmm15,%%zmm{i}" for i in range(8)]),
        8 * 64,
        ("avx512_vnni",),
    ),
}


def build(workdir: Path) -> ctypes.CDLL:
    src = workdir / "mac_peak.c"
    src.write_text("\n".join(source for source, _, _ in KERNELS.values()))
    lib = workdir / "mac_peak.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))


def peak(lib: ctypes.CDLL, name: str, macs: int, threads: int, seconds: float) -> float:
    """Multiply-adds a second per core, every thread running the chains at once (ctypes
    drops the GIL); the best of three runs."""
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_long]
    n = 1_000_000
    t = time.perf_counter()
    fn(n)
    n = max(n, int(n * seconds / (time.perf_counter() - t)))
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t = time.perf_counter()
            list(pool.map(fn, [n] * threads))
            best = min(best, time.perf_counter() - t)
    return n * macs / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=0.5, help="per peak run")
    ap.add_argument("--threads", type=int, default=0, help="default: torch's thread count")
    args = ap.parse_args()
    description = cpu_description()
    print(description)
    flags = set(
        next((line for line in description.splitlines() if line.startswith("Flags")), "").split()
    )

    import torch

    from runner.format_timing import best_of_interleaved
    from runner.layers.batched_int8 import BatchedInt8, batched_kernels
    from runner.layers.linear import Linear
    from runner.layers.q4_blocks import Q4Blocks, dequantize_blocks, quantize_blocks
    from runner.layers.weight_formats import Int8Weight, onednn_f32_available

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    peaks: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        for name, (_, macs, needs) in KERNELS.items():
            if all(f in flags for f in needs):
                peaks[name] = peak(lib, name, macs, threads, args.seconds)
    print(f"peak multiply-adds a second per core, {threads} threads at once:")
    for name, value in peaks.items():
        print(f"  {name:11s} {value / 1e9:7.2f} G")
    if "fma_ymm" not in peaks:
        raise SystemExit("needs an x86 CPU with AVX2 and FMA")
    fp32_peak = max(v for k, v in peaks.items() if k.startswith("fma"))

    n, k = 3072, 576
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    # name: (rows, the call, the peak of the instruction it runs on)
    paths: dict[str, tuple[int, Callable[[torch.Tensor], torch.Tensor], float]] = {}
    formats = ["float", "onednn_f32"] if onednn_f32_available() else ["float"]
    for fmt in formats:
        layer = Linear(k, n, bias=False)
        layer.weight.data.copy_(w)
        layer.pack(fmt)
        library = "mkl" if fmt == "float" else "onednn"
        for rows in (256, 2048):
            paths[f"{library}_fp32_r{rows}"] = (rows, layer, fp32_peak)
    isa = batched_kernels().get("dot", "")
    dot_peak = peaks.get({"avx2_madd": "madd_ymm", "avx512_vnni": "dpbusd_zmm"}.get(isa, ""))
    if dot_peak:
        q, scale = Int8Weight.quantize_rows(w)
        dot = BatchedInt8.from_rows(q, scale, "dot")
        for rows in (8, 32):
            paths[f"dot_{isa}_r{rows}"] = (rows, lambda x, dot=dot: dot(x, None), dot_peak)
    blocks = Q4Blocks.from_weight(dequantize_blocks(*quantize_blocks(w)))
    if blocks is not None and "q4_ymm" in peaks:
        for rows in (8, 32, 256, 2048):
            paths[f"q4_r{rows}"] = (rows, lambda x, b=blocks: b(x, None), peaks["q4_ymm"])
    print(f"linear {k} -> {n} (weights in cache after the first call), all {threads} threads:")
    runs = {name: partial(fn, torch.randn(rows, k)) for name, (rows, fn, _) in paths.items()}
    with torch.inference_mode():
        seconds = best_of_interleaved(runs, rounds=16)
    fractions = []
    for name, (rows, _, ref) in paths.items():
        rate = rows * n * k / seconds[name] / threads
        fractions.append(f"{name}_of_peak={rate / ref:.3f}")
        print(f"  {name:22s} {rate / 1e9:7.2f} G a core = {rate / ref:.0%} of its peak")
    figures = " ".join(f"{name}_g={value / 1e9:.2f}" for name, value in peaks.items())
    print(f"RESULT {' '.join(fractions)} {figures} threads={threads}")


if __name__ == "__main__":
    main()
