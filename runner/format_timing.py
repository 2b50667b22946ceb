"""Start-up timings that choose a linear's format: oneDNN's fp32 GEMM against MKL's, the
AMX tile GEMM against oneDNN's bf16 one, int8 against the float format, and up to how many
rows the small-batch int8 copies serve (`small_rows`) and their 4-bit blocks
(`q4_rows`). runner/platform.py decides with
them; runner/batched_rows.py and runner/cpu_prefill.py time their own choices with
`best_of_interleaved`."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from runner.layers.linear import Linear, LinearShape

log = logging.getLogger("headrace.platform")

# Timed when the caller has no model shapes (a model with no `Linear`): an MLP-sized one.
_FALLBACK_SHAPES = (LinearShape(3072, 576, True, 1),)


def best_of_interleaved(runs: dict[Any, Callable[[], object]], rounds: int) -> dict[Any, float]:
    """Seconds of each run, best of `rounds` rounds that take every run in turn: a busy
    neighbour only ever adds time, so the minimum is the figure least disturbed by the
    machine's other work, and interleaving spreads a drift over all runs alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for key, run in runs.items():
            t = time.perf_counter()
            run()
            best[key] = min(best[key], time.perf_counter() - t)
    return best


def _calls(layer: Linear, inputs: list[torch.Tensor], gated: bool = False) -> Callable[[], None]:
    """A layer's calls; `gated`: through `silu_mul`, as the MLP calls a gate/up layer."""
    call = layer.silu_mul if gated else layer

    def run() -> None:
        for x in inputs:
            call(x)

    return run


def _set_small_rows(m: Linear, rows: int) -> None:
    m.small_rows = rows


def _set_q4_rows(m: Linear, rows: int) -> None:
    copy = m.small_batch_copy
    assert copy is not None
    copy.q4_rows = rows


def _sweep(
    layers: list[Linear],
    inputs: dict[int, torch.Tensor],
    rows: int,
    set_rows: Callable[[Linear, int], None] = _set_small_rows,
) -> Callable[[], None]:
    """Every layer once, in model order, with `set_rows(layer, rows)` first: by default its
    int8 copy used up to `rows` rows (`_set_q4_rows`: the copy's 4-bit blocks)."""

    def run() -> None:
        for m in layers:
            set_rows(m, rows)
            m(inputs[m.in_features])

    return run


def _forward_totals(
    shapes: Sequence[LinearShape],
    runs: Callable[[LinearShape, torch.Tensor], dict[Any, Callable[[], None]]],
    reps: int,
) -> dict[Any, float]:
    """Seconds each variant's linears take in one forward: every shape's runs (built by
    `runs` from one random weight) timed interleaved, best of `reps`, times its layer count."""
    torch.manual_seed(0)
    totals: dict[Any, float] = {}
    with torch.inference_mode():
        for shape in shapes:
            weight = torch.randn(shape.out_features, shape.in_features) * 0.05
            for name, t in best_of_interleaved(runs(shape, weight), reps).items():
                totals[name] = totals.get(name, 0.0) + t * shape.count
    return totals


def _own_format_totals(
    shapes: Sequence[LinearShape], formats: Sequence[str], dtype: torch.dtype,
    rows: Sequence[int], reps: int, gated: bool = False,
) -> dict[tuple[str, int], float]:  # fmt: skip
    """Seconds one forward's linears take in each of `formats` at each of `rows`, keyed
    (format, rows); each shape's layers are packed once for all row counts. `gated`: the
    gated shapes' calls include silu(gate) * up, as the MLP makes them."""

    def runs(shape: LinearShape, weight: torch.Tensor) -> dict[Any, Callable[[], None]]:
        inputs = {n: torch.randn(n, shape.in_features, dtype=dtype) for n in rows}
        out = {}
        for name in formats:
            layer = Linear(shape.in_features, shape.out_features, bias=False, gated=shape.gated)
            layer.weight.data = weight.to(dtype).clone()
            layer.pack(name)
            for n, x in inputs.items():
                out[(name, n)] = _calls(layer, [x], gated and shape.gated)
        return out

    return _forward_totals(shapes, runs, reps)


def onednn_f32_beats_float(
    linears: Sequence[LinearShape] = (),
    rows: Sequence[int] = (64, 256),
    reps: int = 3,
    margin: float = 0.95,
) -> bool:
    """Micro-benchmark at start-up (~2 s on SmolLM2, most of it the LM head): the model's
    linear shapes at prompt-chunk row counts, fp32 through F.linear (MKL) and through
    oneDNN's prepacked GEMM; oneDNN must take `margin` of the time or less. Decode rows
    mostly take the int8 copies, so prompt rows are what the float format is left to serve.

    NOTE: on Zen 1 (AVX2, AMD) oneDNN ran the model's shapes at 64-72 GFLOPS, MKL at 52-65,
    and 1.5-1.9x faster at 65-128 rows (1.3x at 1 row, 2.6x at 8 with the weights streaming
    from memory); on other CPUs either may win, hence the timing.
    """
    shapes = list(linears) or _FALLBACK_SHAPES
    by_rows = _own_format_totals(shapes, ("float", "onednn_f32"), torch.float32, rows, reps)
    totals = {name: sum(by_rows[name, n] for n in rows) for name in ("float", "onednn_f32")}
    log.info(
        "fp32 GEMM micro-benchmark (%d layer shapes, rows %s): oneDNN %.2f ms, MKL %.2f ms",
        len(shapes),
        list(rows),
        totals["onednn_f32"] * 1e3,
        totals["float"] * 1e3,
    )
    return totals["onednn_f32"] <= margin * totals["float"]


# The prompt-chunk row counts the AMX tiles are timed at (up to the default step budget).
AMX_GEMM_ROWS = (128, 256, 512, 1024, 2048)


def amx_gemm_rows(
    linears: Sequence[LinearShape] = (),
    rows: Sequence[int] = AMX_GEMM_ROWS,
    reps: int = 3,
    margin: float = 0.95,
) -> int:
    """Micro-benchmark at start-up (~0.3 s on SmolLM2): the model's decoder linear shapes at
    each prompt-chunk row count in bf16, through oneDNN's prepacked GEMM and through the AMX
    tile kernel (amx_bf16). Returns the largest count up to which oneDNN never took `margin`
    of the tiles' time or less (0: it did at the first). A count oneDNN wins is timed again
    and judged on the best of both timings.

    NOTE: on a Sapphire Rapids-class guest (2 cores) oneDNN ran SmolLM2's shapes at 2.2-2.9
    TFLOP/s at some row counts and at ~1.2 (one core's rate) at others: QKV at 768-1024
    rows, o_proj at 512, down at 256-1280. The tiles ran ~2.0-2.5 at every count: 1.2-1.4x
    oneDNN's speed up to 1024 rows, 0.6-1.1x at 2048 (0.6x in the tenth session's timings).

    NOTE: the tiles were once asked to win by 5%, timed once. At 2048 rows on that guest
    they took 0.42-0.83 of oneDNN's time in eight server starts and 0.95 in two (238 against
    251 ms, 268 against 281), which sent 2048-row chunks to oneDNN's bimodal split and kept
    both weights (+212 MB): a restart could change the served speed. A near tie now keeps
    the steadier kernel and the smaller footprint, and a single slow timing cannot decide.
    """
    # The shapes called with a row per token: the LM head takes one row per sequence in a
    # prompt step, not the chunk's rows; timed at these rows it was 98% of the timing on
    # SmolLM2 (714 ms) and hid the decoder's shapes.
    shapes = [s for s in linears if s.per_token] or _FALLBACK_SHAPES

    def timed(counts: Sequence[int]) -> dict[tuple[str, int], float]:
        # The gate/up shape is timed with its activation: the tiles give it in the same
        # pass, oneDNN's output takes silu_and_mul's pass over memory after (at 2,048 rows
        # on SmolLM2, its weight in cache: 2.5 against 3.9 ms, where silu_and_mul alone
        # took 1.2).
        formats = ("onednn", "amx_bf16")
        return _own_format_totals(shapes, formats, torch.bfloat16, counts, reps, gated=True)

    def onednn_wins(n: int, timing: int) -> bool:
        tiles, onednn = totals["amx_bf16", n], totals["onednn", n]
        log.info(
            "bf16 GEMM micro-benchmark (%d layer shapes, %d rows, timing %d): AMX tiles "
            "%.2f ms, oneDNN %.2f ms",
            len(shapes),
            n,
            timing,
            tiles * 1e3,
            onednn * 1e3,
        )
        return onednn <= margin * tiles

    totals = timed(rows)
    served = 0
    for n in rows:
        if onednn_wins(n, 1):
            again = timed([n])
            totals = {key: min(t, again.get(key, t)) for key, t in totals.items()}
            if onednn_wins(n, 2):
                break
        served = n
    return served


def int8_beats_float(
    dtype: torch.dtype,
    float_format: str,
    int8_dtype: torch.dtype,
    linears: Sequence[LinearShape] = (),
    small_layout: str | None = None,
    batched_kernel: str | None = None,
    rows: Sequence[int] = (1, 32),
    reps: int = 5,
    margin: float = 0.9,
) -> bool:
    """Micro-benchmark at start-up (under a second): the model's linear layers, once as
    the float path runs them (`dtype`, `float_format`) and once as the int8 path would (int8
    where a layer takes int8 inputs, `float_format` elsewhere, `int8_dtype` activations), at
    decode batch sizes; int8 must be `margin` of the float time or less. The float side keeps
    the int8 copies it would serve those rows with (`small_layout`, `batched_kernel`; the
    int8 format keeps none).

    NOTE: timed without the copies, fbgemm won on a Sapphire Rapids guest with AMX masked
    (AVX512-BF16 + VNNI, as Zen 4), where the float format with its copies ran decode steps
    2.4x (8 rows) and 1.9x (32 rows) faster and fbgemm cost +2.1% perplexity, over the target.

    NOTE: a single-layer comparison flipped between runs on a Sapphire Rapids guest (LM head
    int8 2.46 vs bf16 2.65 ms) while whole decode steps were 12-30% slower in int8 there: the
    layers int8 leaves float then take fp32 inputs. Timing every shape at its real dtype, with
    a margin, keeps that near-tie from choosing int8.
    """
    shapes = list(linears) or _FALLBACK_SHAPES

    def runs(shape: LinearShape, weight: torch.Tensor) -> dict[str, Callable[[], None]]:
        out = {}
        for name, act in (("float", dtype), ("int8", int8_dtype)):
            layer = Linear(shape.in_features, shape.out_features, bias=False,
                           int8_inputs=shape.int8_inputs)  # fmt: skip
            layer.weight.data = weight.to(act)
            if name == "float":
                layer.pack(float_format, small_batch_int8=small_layout,
                           batched_int8=batched_kernel)  # fmt: skip
                # The small copy serves one row, the batched (or AMX) one the rest.
                layer.small_rows = 64 if small_layout == "amx" else 1
                layer.batched_rows = 64
            else:
                layer.pack("int8", float_format=float_format)
            out[name] = _calls(layer, [torch.randn(n, shape.in_features, dtype=act) for n in rows])
        return out

    totals = _forward_totals(shapes, runs, reps)
    log.info(
        "int8 micro-benchmark (%d layer shapes, rows %s): int8 %.2f ms, %s %.2f ms per forward",
        len(shapes),
        list(rows),
        totals["int8"] * 1e3,
        float_format,
        totals["float"] * 1e3,
    )
    return totals["int8"] < margin * totals["float"]


def measure_small_rows(
    model: torch.nn.Module,
    dtype: torch.dtype,
    candidates: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    reps: int = 3,
    margin: float = 0.9,
) -> int:
    """Largest row count at which the weight-only int8 copies beat the layers' own format by
    `margin`, timed over all of the model's linears in turn (a count they lose is timed
    again, and the best of both timings decides); sets it on every layer.

    NOTE: a single layer stays in cache between calls and flatters the bigger format: the
    bf16 copies of all layers (270 MB for SmolLM2) stream from memory in a real step.
    """
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.has_small_batch_int8]
    best_rows = _largest_winning_rows(
        layers, dtype, candidates, _sweep, reps, margin, "small-batch int8 %s ms vs %s ms"
    )
    for m in layers:
        if best_rows:
            m.small_rows = best_rows
        else:
            m.drop_small_batch_int8()
    return best_rows


def measure_q4_rows(
    model: torch.nn.Module,
    dtype: torch.dtype,
    candidates: Sequence[int] = (1, 2, 4, 8),
    reps: int = 3,
    margin: float = 1.0,
) -> int:
    """Largest row count (up to each layer's `small_rows`) at which the small copies' 4-bit
    blocks take less than `margin` of their int8 weights' time at that count and every
    smaller one, timed as `measure_small_rows` times (all of the model's linears in turn, a
    loss timed again); sets it on every copy, and drops the blocks at 0.

    No margin to clear (1.0): the blocks are the checkpoint's own numbers, which the int8
    copies round again (perplexity -0.02% of fp32 against +0.73%), so a tie goes to them. The
    sweep's per-call Python also flatters neither side: at 4 rows on AMX it timed the blocks
    6.81-7.35 against 7.27-7.41 ms, where served steps of 4 streams ran 1.16x on them, and a
    5% margin kept them for 4 rows or for 2 by the start-up.

    Why measured, not assumed: the blocks read 0.625 bytes a weight against 1.0, but unpack
    nibbles and round activations per call; at one row on a Sapphire Rapids guest they swept
    SmolLM2's decoder 1.7x faster than the AMX int8 tiles, 1.4x at two rows, even at four.
    """
    layers = [
        m
        for m in model.modules()
        if isinstance(m, Linear)
        and (copy := m.small_batch_copy) is not None
        and copy.q4 is not None
    ]
    limit = min((m.small_rows for m in layers), default=0)
    best_rows = _largest_winning_rows(
        layers, dtype, [r for r in candidates if r <= limit],
        functools.partial(_sweep, set_rows=_set_q4_rows), reps, margin,
        "4-bit blocks %s ms vs int8 %s ms",
    )  # fmt: skip
    for m in layers:
        copy = m.small_batch_copy
        assert copy is not None
        copy.q4_rows = best_rows
        if not best_rows:
            copy.q4 = None
    return best_rows


def _largest_winning_rows(
    layers: list[Linear],
    dtype: torch.dtype,
    candidates: Sequence[int],
    sweep: Callable[..., Callable[[], None]],
    reps: int,
    margin: float,
    what: str,
) -> int:
    """The last of `candidates` (in order) up to which, at every count, `sweep(..., rows)`
    (the new path up to that many rows) takes less than `margin` times `sweep(..., 0)` (the
    path it would replace); 0 where the first loses. `what` logs a timing (its two %s: the
    ms of each).

    A count the new path loses is timed again, and the best of both timings decides: one
    timing beside a busy neighbour had stopped the int8 copies at 2 rows, where they serve 32.
    """
    best_rows = 0
    with torch.inference_mode():
        for rows in candidates:
            inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {m.in_features for m in layers}}
            runs = {use: sweep(layers, inputs, use) for use in (0, rows)}
            times = dict.fromkeys(runs, float("inf"))
            for timing in (1, 2):
                again = best_of_interleaved(runs, reps)
                times = {use: min(t, again[use]) for use, t in times.items()}
                label = what % (f"{times[rows] * 1e3:.2f}", f"{times[0] * 1e3:.2f}")
                log.info(
                    "%s per sweep of %d linears at %d rows (timing %d)",
                    label, len(layers), rows, timing,
                )  # fmt: skip
                if times[rows] < margin * times[0]:
                    break
            if times[rows] >= margin * times[0]:
                break
            best_rows = rows
    return best_rows
