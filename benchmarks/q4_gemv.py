"""The few-row 4-bit GEMV against the int8 copies it replaces, on SmolLM2's decoder shapes.

    python benchmarks/q4_gemv.py [--rows 1 2 4 8] [--copies 1] [--rounds 7]

Each of SmolLM2's four decoder linear shapes (QKV 960x576, o_proj 576x576, gate/up
3072x576, down 576x1536) x 30 layers x `--copies`, weights on a Q4_1 grid as the GGUF's
loader leaves them, each layer called once in turn (so the weights stream from memory, as in
a decode step), best of `--rounds` interleaved sweeps: the blocks (runner/cpu_ops/q4_gemv.cpp)
against the int8 row GEMV and, where this CPU has AMX, the AMX int8 tiles. `--copies 4` makes
the working set several times the L3 a guest reports, to check that the gain is bytes read
from memory rather than a cache effect.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from machine import cpu_description

from runner.cpu_ops import load_cpu_ops
from runner.format_timing import best_of_interleaved
from runner.layers.q4_blocks import Q4Gemv, dequantize_blocks, find_blocks, quantize_blocks
from runner.layers.weight_formats import SmallBatchInt8

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _sweep(layers: list, xs: dict[int, torch.Tensor], pick: Callable) -> Callable[[], None]:
    """Every layer once, in order, through the copy `pick(blocks, int8_copies)` names."""

    def run() -> None:
        for k, blocks, copies in layers:
            pick(blocks, copies)(xs[k], None)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--copies", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    print(cpu_description())
    if load_cpu_ops() is not None:
        raise SystemExit("the CPU kernels did not build")
    dtype = getattr(torch, args.dtype)
    layouts = ["rows"] + (["amx"] if torch.ops.headrace.amx_usable() else [])
    torch.manual_seed(0)
    layers = []
    for n, k in SHAPES * (30 * args.copies):
        w = dequantize_blocks(*quantize_blocks(torch.randn(n, k) * 0.05))
        blocks = Q4Gemv.from_blocks(find_blocks(w))
        assert blocks is not None, "no few-row 4-bit kernel in this build"
        layers.append((k, blocks, {lay: SmallBatchInt8.from_weight(w, lay) for lay in layouts}))
    mb = sum(b.packed.numel() for _, b, _ in layers) / 1e6
    int8_mb = sum(c["rows"].weight.numel() for _, _, c in layers) / 1e6
    print(f"{len(layers)} linears: blocks {mb:.1f} MB, int8 {int8_mb:.1f} MB; dtype {args.dtype}")
    print("| rows | blocks (ms) | " + " | ".join(f"int8 {lay} (ms)" for lay in layouts) + " |")
    print("|---" * (2 + len(layouts)) + "|")
    ratios = []
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k).to(dtype) for k in {k for k, _, _ in layers}}
            runs = {"blocks": _sweep(layers, xs, lambda b, c: b)}
            for lay in layouts:
                runs[lay] = _sweep(layers, xs, lambda b, c, lay=lay: c[lay])
            best = best_of_interleaved(runs, args.rounds)
            fastest_int8 = min(best[lay] for lay in layouts)
            ratios.append(f"int8_over_blocks_r{rows}={fastest_int8 / best['blocks']:.3f}")
            cells = " | ".join(f"{best[lay] * 1e3:.2f}" for lay in layouts)
            print(f"| {rows} | {best['blocks'] * 1e3:.2f} | {cells} |")
    print(
        f"RESULT {' '.join(ratios)} blocks_mb={mb:.1f} int8_mb={int8_mb:.1f} copies={args.copies}"
    )


if __name__ == "__main__":
    main()
