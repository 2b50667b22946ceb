"""The C++ CPU kernels (runner/cpu_ops/) against what they replace, same process.

    python benchmarks/cpu_kernels.py [--threads N] [--rows 1 8 16 32 64] [--rounds 4]

1. Decode attention over the paged cache: the kernel (reads blocks in place) against the
   torch reference (gathers each request's blocks, then SDPA), SmolLM2 heads (9 / 3 x 64),
   bf16, blocks scattered over a 1500-block cache.
2. Weight-only int8 linears against oneDNN bf16 on prepacked weights, summed over all of the
   embedded model's linears in turn (weights stream from memory as in a real step): the
   "rows" GEMV at 1-16 rows and, where the CPU has AMX, the "amx" tile kernel at 1-64 rows.
3. Batched int8 linears without AMX (runner/cpu_ops/batched_int8.cpp), same sweep, per
   `--rows`: each kernel of this build ("dot" int8 products, "widen" bf16/fp32) against
   oneDNN bf16 and the "rows" int8 GEMV, with the GB/s of weights each streams (int8: 1 byte
   a weight, bf16: 2). Target (issue 26): at 32 rows the chosen kernel reads half the bytes,
   so it should approach 2x oneDNN bf16 where the step is bound by memory.
4. Fused elementwise ops against the eager formulas they replace, bf16, 32 rows.

Each figure is the best of several rounds (a busy neighbour only adds time).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from machine import cpu_description

from daemon.engine.config import EngineConfig
from daemon.engine.loaded_model import LoadedModel
from runner import attention
from runner.cpu_ops import load_cpu_ops
from runner.layers.batched_int8 import BatchedInt8, batched_kernels
from runner.layers.linear import Linear
from runner.layers.weight_formats import Int8Weight, SmallBatchInt8
from runner.models.decoder import RMSNorm
from runner.models.rope import RopeAt


def best_ms(fn: Callable[[], object], reps: int = 20, rounds: int = 5) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def decode_attention(batch: int, context: int) -> tuple[float, float]:
    torch.manual_seed(0)
    blocks, block_size, kv_heads, dim, heads = 1500, 16, 3, 64, 9
    kv = torch.randn(2, blocks, block_size, kv_heads, dim).bfloat16()
    per = -(-context // block_size)
    order = torch.randperm(blocks)[: batch * per].view(batch, per).tolist()
    meta = attention.build_metadata(
        [context - 1] * batch, [1] * batch, order, block_size, torch.device("cpu")
    )
    q = torch.randn(batch, heads, dim).bfloat16()
    kernel = torch.ops.headrace.paged_decode_attention
    ref = best_ms(lambda: attention.paged_attention(q, kv, meta, 0.125))
    fast = best_ms(lambda: attention.paged_attention(q, kv, meta, 0.125, kernel))
    return ref, fast


def linear_sweep(layers: list[Linear], rows: int) -> tuple[float, float]:
    inputs = {k: torch.randn(rows, k).bfloat16() for k in {m.in_features for m in layers}}

    def sweep() -> None:
        for m in layers:
            m(inputs[m.in_features])

    times = {}
    for use in (0, rows):
        for m in layers:
            m.small_rows = use
        times[use] = best_ms(sweep, reps=2, rounds=4)
    return times[0], times[rows]


def batched_sweeps(
    layers: list[Linear], row_counts: list[int], rounds: int
) -> tuple[list[str], list[str]]:
    """Lines to print and RESULT fields: ms per sweep and weight GB/s of every path."""
    kernels = sorted(batched_kernels())
    weights = sum(m.in_features * m.out_features for m in layers)
    for m in layers:
        w = torch.randn(m.out_features, m.in_features) * 0.05
        q, scale = Int8Weight.quantize_rows(w)
        m.set_small_batch_int8(SmallBatchInt8.from_weight(w, "rows"))
        m.set_batched_int8(BatchedInt8.from_rows(q, scale, kernels[0]))
    lines, fields = [f"batched int8 kernels here: {batched_kernels()}"], []
    lines.append("all linears in turn, ms per sweep (weight GB/s): onednn bf16 | rows | kernels")
    for rows in row_counts:
        x = {k: torch.randn(rows, k).bfloat16() for k in {m.in_features for m in layers}}

        def sweep(
            small: int, batched: int, kernel: str, x: dict[int, torch.Tensor] = x
        ) -> Callable[[], None]:
            def run() -> None:
                for m in layers:
                    m.small_rows, m.batched_rows = small, batched
                    m.batched_int8.kernel = kernel  # type: ignore[union-attr]
                    m(x[m.in_features])

            return run

        paths = {"onednn": (sweep(0, 0, kernels[0]), 2), "rows": (sweep(rows, 0, kernels[0]), 1)}
        paths |= {k: (sweep(0, rows, k), 1) for k in kernels}
        ms = {name: best_ms(fn, reps=2, rounds=rounds) for name, (fn, _) in paths.items()}
        gbs = {name: weights * per / (ms[name] * 1e6) for name, (_, per) in paths.items()}
        best = min(kernels, key=ms.get)
        lines.append(
            f"  {rows:2d} rows: "
            + " | ".join(f"{n} {ms[n]:.2f} ({gbs[n]:.1f})" for n in paths)
            + f"  -> {best} {ms['onednn'] / ms[best]:.2f}x onednn, "
            f"{ms['rows'] / ms[best]:.2f}x rows"
        )
        fields.append(f"batched_r{rows}_vs_onednn={ms['onednn'] / ms[best]:.2f}")
        fields.append(f"batched_r{rows}_vs_rows={ms['rows'] / ms[best]:.2f}")
        fields.append(f"batched_r{rows}_kernel={best}")
        fields += [f"{n}_r{rows}_gbs={gbs[n]:.1f}" for n in paths]
    for m in layers:
        m.set_small_batch_int8(None)
        m.set_batched_int8(None)
    return lines, fields


def elementwise() -> dict[str, tuple[float, float]]:
    torch.manual_seed(0)
    rows, hidden, inter, dim = 32, 576, 1536, 64
    out = {}
    norm = RMSNorm(hidden, 1e-5).bfloat16()
    x, res = torch.randn(rows, hidden).bfloat16(), torch.randn(rows, hidden).bfloat16()
    eager = best_ms(lambda: norm.add_forward(x.clone(), res.clone()))
    norm.fused = True
    out["add_rms_norm"] = (eager, best_ms(lambda: norm.add_forward(x.clone(), res.clone())))
    gate_up = torch.randn(rows, 2 * inter).bfloat16()

    def silu_mul() -> torch.Tensor:
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up

    fused = best_ms(lambda: torch.ops.headrace.silu_and_mul(gate_up))
    out["silu_and_mul"] = (best_ms(silu_mul), fused)
    qk = torch.randn(rows, 12, dim).bfloat16()
    rope = RopeAt(torch.randn(rows, 1, dim).bfloat16(), torch.randn(rows, 1, dim).bfloat16())
    out["rope"] = (best_ms(lambda: rope.rotate(qk)), best_ms(lambda: rope.rotate_(qk.clone())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64],
                    help="row counts of the batched int8 section")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=4, help="best of this many (batched section)")
    args = ap.parse_args()
    print(cpu_description())
    if args.threads:
        torch.set_num_threads(args.threads)
    missing = load_cpu_ops()
    if missing is not None:
        raise SystemExit(f"the CPU kernels did not build here: {missing}")
    fields = []
    print(f"threads {torch.get_num_threads()}")
    print("decode attention, bf16, SmolLM2 heads: torch reference vs kernel (ms)")
    with torch.inference_mode():
        for batch, context in ((1, 160), (32, 160), (1, 2000), (8, 2000)):
            ref, fast = decode_attention(batch, context)
            ratio = ref / fast
            print(f"  batch {batch:2d} x {context:4d} keys: {ref:.3f} vs {fast:.3f} ({ratio:.2f}x)")
            fields.append(f"attn_b{batch}_k{context}={ref / fast:.2f}")
        loaded = LoadedModel.load(EngineConfig(device="cpu", dtype="bfloat16", quantization="none"))
        layers = [m for m in loaded.model.modules() if isinstance(m, Linear)]
        sweeps = {"rows": (1, 4, 8, 16)}
        if torch.ops.headrace.amx_usable():
            sweeps["amx"] = (1, 4, 8, 16, 32, 64)
        for layout, row_counts in sweeps.items():
            for m in layers:
                # int8 copies of the right shapes (random: the speed does not depend on the
                # values).
                w = torch.randn(m.out_features, m.in_features) * 0.05
                m.set_small_batch_int8(SmallBatchInt8.from_weight(w, layout))
            print(f"all linears of the model in turn: oneDNN bf16 vs int8 {layout} (ms per sweep)")
            for rows in row_counts:
                ref, fast = linear_sweep(layers, rows)
                print(f"  {rows:2d} rows: {ref:.2f} vs {fast:.2f} ({ref / fast:.2f}x)")
                fields.append(f"{layout}_r{rows}={ref / fast:.2f}")
        if batched_kernels():
            lines, batched_fields = batched_sweeps(layers, args.rows, args.rounds)
            print("\n".join(lines))
            fields = batched_fields + fields
        print("fused elementwise ops, bf16, 32 rows: eager vs fused (ms)")
        for name, (ref, fast) in elementwise().items():
            print(f"  {name:14s} {ref:.4f} vs {fast:.4f} ({ref / fast:.2f}x)")
            fields.append(f"{name}={ref / fast:.2f}")
    print(f"RESULT {' '.join(fields)} threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
