"""Start-up choice of the batched int8 kernel and of the row counts it serves.

Every linear of the loaded model holds a `BatchedInt8` copy (runner/layers/batched_int8.py);
this times, over all of the model's linears in turn (so the weights stream from memory as in
a real step; from `PROMPT_ROWS` one layer of each shape, the LM head left out), at each
candidate row count (decode steps' 8-64 and prompt chunks' 128-256:
where the float format is slow, prompts gain as much), the layer's own format, the
small-batch copy where it serves that many rows, and each of `AUTO_KERNELS` (the kernels
within the quality target) this build has. The kernel with the least total time is kept;
`batched_rows` is the end of the first unbroken run of row counts at which it beats the path
that would run otherwise (the own format by `margin`, the small copy outright). Where that
run starts inside `small_rows`, the small copy gives those rows up.

Where the kernel's activations are as exact as the small copy's (`FEW_ROW_ISAS`), it may
take the copy's remaining rows too: of the splits at 0, 1, 2, 4, ... `small_rows` (copy up
to it, kernel above), the one with the least total time over those row counts is kept; at 0
the copy is dropped. The "q4" kernel (int8 activations) never takes those rows: they are split
the same way between the copy and Q4_FALLBACK ("dot"), and "q4" serves from the next row.

Prompt steps run up to the step's token budget (2048 rows by default). Where the kernel wins
through the last candidate, one more point at the budget (the own format against the kept
kernel only, at the most rows a call can have, so a few repetitions suffice) decides whether
it serves every row count up to it: between 256 and 2048 rows the dot kernel's share of
oneDNN's time holds at 0.66-0.76 on Zen 5, so the two ends speak for the rows between.

Last, the LM head (one row per sequence, a shape like no other layer's) is timed alone at the
decode-sized candidates, its batched copy against its own format, and keeps the copy only up
to the last count where the copy is faster (`_head_rows`). Every other layer whose copy then
serves through the budget frees its own format, which no step would run (`drop_own_format`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from runner.format_timing import best_of_interleaved
from runner.layers.batched_int8 import AUTO_KERNELS, FEW_ROW_ISAS, Q4_FALLBACK, batched_kernels
from runner.layers.linear import Linear
from runner.layers.q4_blocks import Q4_KERNEL

log = logging.getLogger("headrace.platform")


@dataclass(frozen=True, slots=True)
class BatchedChoice:
    """What the measurement kept: `kernel` None (copies dropped) or the kernel serving
    `small_rows` < rows <= `batched_rows`; `times` are ms per sweep by rows and path."""

    kernel: str | None
    batched_rows: int
    small_rows: int
    times: dict[int, dict[str, float]] = field(default_factory=dict)
    # Under "q4": the rows up to which Q4_FALLBACK serves in its place (above `small_rows`).
    exact_rows: int = 0
    # The LM head's own `batched_rows` where it differs (0: it follows `batched_rows`).
    head_rows: int = 0
    # Layers whose own format was freed: the copy serves all their rows (`drop_own_format`).
    freed: int = 0
    # The LM head's own `small_rows` where it differs (None: it follows `small_rows`).
    head_small_rows: int | None = None

    def describe(self) -> str:
        if self.kernel is None:
            return "batched int8 weights: not faster here, dropped"
        isa = batched_kernels().get(self.kernel, "?")
        said = (
            f"batched int8 weights ({self.kernel}, {isa}) for "
            f"{max(self.small_rows, self.exact_rows) + 1}-{self.batched_rows} rows"
        )
        if self.exact_rows > self.small_rows:
            exact = f"{Q4_FALLBACK}, {batched_kernels().get(Q4_FALLBACK, '?')}"
            said += f" ({exact} for {self.small_rows + 1}-{self.exact_rows})"
        if self.head_rows:
            said += f"; the LM head's up to {self.head_rows} rows"
        if self.head_small_rows is not None:
            head_kernel = Q4_FALLBACK if self.kernel == Q4_KERNEL else self.kernel
            said += (
                f"; the LM head's small copy for <= {self.head_small_rows} rows"
                if self.head_small_rows
                else f"; the LM head on {head_kernel} from 1 row (its small copy freed)"
            )
        if self.freed:
            said += f"; the own format freed on {self.freed} layers (the copy serves all rows)"
        return said


def _sweep(
    layers: list[Linear], x: dict[int, torch.Tensor], kernel: str, batched: int, small: int
) -> Callable[[], None]:
    def run() -> None:
        for m in layers:
            m.small_rows, m.batched_rows = small, batched
            assert m.batched_int8 is not None
            m.batched_int8.kernel = kernel
            m(x[m.in_features])

    return run


def _time_paths(
    layers: list[Linear],
    dtype: torch.dtype,
    rows: int,
    paths: dict[str, tuple[str, int, int]],
    reps: int,
) -> dict[str, float]:
    """ms per sweep of `layers` at `rows`, by path ((kernel, batched_rows, small_rows) each)."""
    x = {k: torch.randn(rows, k, dtype=dtype) for k in {m.in_features for m in layers}}
    runs = {p: _sweep(layers, x, *settings) for p, settings in paths.items()}
    times = {p: t * 1e3 for p, t in best_of_interleaved(runs, reps).items()}
    log.info(
        "batched int8 at %d rows (ms per sweep of %d linears): %s",
        rows,
        len(layers),
        ", ".join(f"{p} {t:.2f}" for p, t in times.items()),
    )
    return times


def choose(
    times: dict[int, dict[str, float]], kernels: Sequence[str], small_rows: int, margin: float
) -> tuple[str | None, int, int]:
    """From times by rows and path ("own", "small" where it serves, each kernel): the
    kernel, `batched_rows` and `small_rows` (see the module doc); (None, 0, small_rows)
    where the batched copies lose."""
    if not times or not kernels:
        return None, 0, small_rows
    kernel = min(kernels, key=lambda k: sum(t[k] for t in times.values() if k in t))
    start, batched_rows = None, 0
    for rows, t in sorted(times.items()):
        win = t[kernel] < margin * t["own"] and t[kernel] < t.get("small", float("inf"))
        if win:
            start = start or rows
            batched_rows = rows
        elif rows > small_rows or start is not None:
            break
    if batched_rows < small_rows or start is None:
        # Nothing won, or the run ended where the small copy still serves the next rows
        # (it goes first, so it must keep them). A run that ends at small_rows itself takes
        # all of them (Zen 1: dot beat the copy at 8-32 rows, lost to sgemm at 64, and `<=`
        # here dropped it).
        return None, 0, small_rows
    if start <= small_rows:
        small_rows = start // 2  # candidates double: the one below the run
    return kernel, batched_rows, small_rows


def _split_few_rows(
    layers: list[Linear],
    dtype: torch.dtype,
    kernel: str,
    small_rows: int,
    reps: int,
    times: dict[int, dict[str, float]],
    prefix: str = "",
) -> int:
    """Where the small copy still serves 1..`small_rows`: the split with the least total time
    over the row counts 1, 2, 4, ..., `small_rows` (timed here where the candidates did not
    time both paths): the copy up to it, the kernel above. 0 gives every count to the kernel.

    One point does not decide: at 8 rows on Zen 1 the two were within noise (copy 72.2 and
    95.4 ms a sweep, dot 73.7 and 82.7, two start-ups), and when a run of wins had to start
    at the first candidate, one such point left a single stream on the copy. Over 1-8 rows
    dot (int16 madd) leads there (177 against 186 ms), and one stream on it generates
    1.04-1.34x the tok/s (benchmarks/few_rows.py, 8 rounds). `prefix` names the paths of a
    split timed apart (the LM head's).
    """
    counts = [1 << i for i in range(small_rows.bit_length())]
    small, own = prefix + "small", prefix + kernel
    for rows in counts:
        if not {small, own} <= times.get(rows, {}).keys():
            paths = {small: (kernel, 0, small_rows), own: (kernel, rows, 0)}
            times[rows] = times.get(rows, {}) | _time_paths(layers, dtype, rows, paths, reps)

    def total(split: int) -> float:
        return sum(times[r][small if r <= split else own] for r in counts)

    return min([0, *counts], key=total)


# From here on a call's rows are a prompt's: the step is compute bound and the LM head is
# not in it (it sees one row per sequence).
PROMPT_ROWS = 128


def _head_rows(
    head: Linear,
    dtype: torch.dtype,
    kernel: str,
    candidates: Sequence[int],
    batched_rows: int,
    reps: int,
    times: dict[int, dict[str, float]],
) -> int:
    """Up to how many rows the LM head keeps its batched copy: the candidate below the first
    decode-sized row count (up to `batched_rows`, the other layers' limit) where its own
    format is faster, else 0 (no limit of its own).

    The head sees one row per sequence, so only decode-sized counts matter, and its shape is
    like no other layer's: on Zen 1 SmolLM2's Q8_0 head (49152 x 576, "dot" under "q4") beat
    oneDNN fp32 at 8 and 16 rows (7.9 against 10.5 ms, 15.9 against 17.6) and lost from 32
    (31.2 against 29.1 ms, 61.8 against 53.6 at 64): compute bound there, and int16 madd
    multiplies no faster than FMA."""
    counts = sorted(r for r in candidates if r < PROMPT_ROWS and r <= batched_rows)
    for i, rows in enumerate(counts):
        paths = {"head_own": (kernel, 0, 0), "head_batched": (kernel, rows, 0)}
        timed = _time_paths([head], dtype, rows, paths, reps)
        times[rows] = times.get(rows, {}) | timed
        if timed["head_own"] < timed["head_batched"]:
            return counts[i - 1] if i else rows // 2  # candidates double: the one below
    return 0


def _prompt_layers(model: torch.nn.Module, layers: list[Linear]) -> list[Linear]:
    """One layer of each weight shape, the LM head left out: what the prompt-row points time.

    Compute bound, a layer of a shape speaks for its copies (each decoder layer has one of
    each shape, so the shares hold), and a sweep is ~30x shorter: with the whole model a
    one-thread start-up timed past a client's 180 s. The LM head decided the budget point
    when it was in it (Zen 1, "q4": 2048 rows of dot on SmolLM2's 49152-row head tied the
    sweep with oneDNN's, 7742 against 7778 ms; the other 120 linears alone ran 1.22x faster
    on q4, 5178 against 6322 ms)."""
    head = getattr(model, "lm_head", None)
    shapes: dict[tuple[int, int], Linear] = {}
    for m in layers:
        if m is not head:
            shapes.setdefault((m.out_features, m.in_features), m)
    return list(shapes.values()) or layers


def measure_batched_rows(
    model: torch.nn.Module,
    dtype: torch.dtype,
    candidates: Sequence[int] = (8, 16, 32, 64, 128, 256),
    # Best of 5, not 3: on Zen 5 dot and oneDNN are within 10-20% of each other and best of
    # 3 sweeps flipped the choice between start-ups (all rows, 16 rows, none).
    reps: int = 5,
    margin: float = 0.9,
    candidates_kernels: Sequence[str] = AUTO_KERNELS,
    step_rows: int = 0,
    step_reps: int = 3,
) -> BatchedChoice:
    """Choose and set the kernel, `batched_rows` and (maybe lowered) `small_rows` on every
    layer with a batched copy; drop the copies where no kernel wins. `step_rows` (the step's
    token budget) is timed last where the kernel won through the candidates (module doc)."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.batched_int8 is not None]
    small_rows = max((m.small_rows for m in layers if m.has_small_batch_int8), default=0)
    prompt_layers = _prompt_layers(model, layers)
    kernels = [k for k in candidates_kernels if k in batched_kernels()]
    if not any(m.batched_int8.q4 is not None for m in layers):  # type: ignore[union-attr]
        kernels = [k for k in kernels if k != Q4_KERNEL]  # no 4-bit blocks: it would be "dot"
    times: dict[int, dict[str, float]] = {}
    if layers and kernels:
        with torch.inference_mode():
            for rows in sorted(candidates):
                paths = {"own": (kernels[0], 0, 0)}
                if rows <= small_rows:
                    paths["small"] = (kernels[0], 0, small_rows)
                paths |= {k: (k, rows, 0) for k in kernels}
                swept = layers if rows < PROMPT_ROWS else prompt_layers
                times[rows] = _time_paths(swept, dtype, rows, paths, reps)
                # More rows only add arithmetic: once nothing beats the own format, stop.
                if min(times[rows][k] for k in kernels) >= margin * times[rows]["own"]:
                    break
    kernel, batched_rows, small_rows = choose(times, kernels, small_rows, margin)
    # "q4" rounds activations to int8: a single stream's rows (those the small copy serves)
    # stay on an exact kernel, the copy or Q4_FALLBACK, split as for a "dot" choice.
    exact = Q4_FALLBACK if kernel == Q4_KERNEL else kernel
    exact_rows = small_rows if kernel == Q4_KERNEL else 0
    head = getattr(model, "lm_head", None)
    head_small: int | None = None
    if exact is not None and batched_kernels()[exact] in FEW_ROW_ISAS and small_rows > 0:
        # The LM head splits apart: at a few rows the other layers may take the 4-bit
        # blocks (their small copy's own kernel), which the head (Q8_0 in SmolLM2's GGUF)
        # has not, so one split of all layers chose for the blocks and left the head on the
        # copy's widening GEMV: 1.13 against 0.62 ms for dot, one row on Zen 3.
        body = [m for m in layers if m is not head]
        with torch.inference_mode():
            if head in layers and head.has_small_batch_int8 and body:
                head_small = _split_few_rows([head], dtype, exact, small_rows, reps, times, "head_")
            small_rows = _split_few_rows(body or layers, dtype, exact, small_rows, reps, times)
    if kernel is not None and batched_rows == max(candidates) and step_rows > batched_rows:
        with torch.inference_mode():
            paths = {"own": (kernel, 0, 0), kernel: (kernel, step_rows, 0)}
            times[step_rows] = _time_paths(prompt_layers, dtype, step_rows, paths, step_reps)
        if times[step_rows][kernel] < margin * times[step_rows]["own"]:
            batched_rows = step_rows
    head_rows = 0
    if kernel is not None and head in layers:
        with torch.inference_mode():
            head_rows = _head_rows(head, dtype, kernel, candidates, batched_rows, reps, times)
    # A copy that serves through the token budget serves every call a step makes (the LM
    # head's rows are one a sequence, but its limit is its own): the own format goes.
    frees = kernel is not None and 0 < step_rows <= batched_rows
    freed = 0
    for m in layers:
        if m.has_small_batch_int8:
            m.small_rows = head_small if m is head and head_small is not None else small_rows
            if m.small_rows == 0:  # the kernel serves every row count: the copy is dead weight
                m.set_small_batch_int8(None)
        if kernel is None:
            m.set_batched_int8(None)
        else:
            assert m.batched_int8 is not None
            m.batched_int8.kernel, m.batched_int8.exact_rows = kernel, exact_rows
            m.batched_rows = head_rows if head_rows and m is head else batched_rows
            if frees and m is not head:
                m.drop_own_format()
                freed += 1
    if head_small == small_rows:
        head_small = None
    return BatchedChoice(
        kernel, batched_rows, small_rows, times, exact_rows, head_rows, freed, head_small
    )
