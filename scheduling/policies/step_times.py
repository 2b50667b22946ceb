"""Step times the `priority` policy's cap is priced with, measured from finished steps.

The cap needs three figures: how long an urgent prompt takes (the urgent TTFT it
protects), how long a step takes per token it carries (to turn a time into tokens), and
the fixed cost of a step (below which capping buys nothing). A least-squares fit of
base + prefill + decode + context costs gave all three live, and got them wrong for
seconds at a time: after an idle phase (one-token decodes and whole prompts only) base and
per-decode costs cannot be told apart, and on a busy 2-core machine the fitted
coefficients swung from 0 to 7 ms a decode row between consecutive steps, the cap with
them (2203 tokens, then 1551, 140, 73, 35, 15 in the first steps of a load). Measured
directly, each figure is a ratio of the steps' own times, and the median of the last
few keeps one slow step (a first call, a neighbour's burst) from moving it.
"""

from __future__ import annotations

from collections import deque

from scheduling.output import StepStats

# Steps each figure is the median of: enough that one outlier never decides it, few enough
# that it follows a change of load within a handful of steps.
WINDOW = 7


class Recent:
    """The median of the last `WINDOW` values (None before the first)."""

    def __init__(self) -> None:
        self._values: deque[float] = deque(maxlen=WINDOW)

    def add(self, value: float) -> None:
        self._values.append(value)

    @property
    def value(self) -> float | None:
        if not self._values:
            return None
        return sorted(self._values)[len(self._values) // 2]


class StepTimes:
    """Per priority class, seconds per prompt token of the steps that ran its prompts; and
    over the other steps, seconds per token carried and the time of a one-token step."""

    def __init__(self) -> None:
        self._prompt_token_s: dict[int, Recent] = {}
        # Steps mix prompt tokens with decode rows, ~3x dearer on a CPU: a cap priced at
        # a mixed rate let decode steps run ~1.5x over. Priced at the decode-led steps'
        # rate (once there are any), it holds for decode rows and errs short for chunks.
        self._token_s = Recent()
        self._decode_token_s = Recent()
        self._single_s = Recent()

    def observe(self, stats: StepStats, urgent: int | None) -> None:
        """`urgent`: the class whose prompts this step may have run (None: the most urgent
        class in the step, as while only one class is about)."""
        shape = stats.shape
        tokens = shape.num_prefill_tokens + shape.num_decode_tokens
        if tokens <= 0 or stats.duration_s <= 0 or not shape.priority_tokens:
            return
        klass = min(shape.priority_tokens) if urgent is None else urgent
        own = shape.priority_tokens.get(klass)
        if own is not None and own.prefill:
            # The whole step over its prompt tokens: what such a prompt's TTFT costs,
            # with whatever rode along.
            self._prompt_token_s.setdefault(klass, Recent()).add(stats.duration_s / own.prefill)
            return
        self._token_s.add(stats.duration_s / tokens)
        if shape.num_decode_tokens >= shape.num_prefill_tokens:
            self._decode_token_s.add(stats.duration_s / tokens)
        if tokens == 1:
            self._single_s.add(stats.duration_s)

    def prompt_time(self, klass: int, num_tokens: int) -> float | None:
        """Seconds a step that runs a `num_tokens` prompt of `klass` takes, if measured."""
        per = self._prompt_token_s.get(klass)
        return None if per is None or per.value is None else per.value * num_tokens

    @property
    def token_s(self) -> float | None:
        """Seconds per token of the steps that ran no prompt of the urgent class: of those
        led by decode rows where there are any."""
        decode = self._decode_token_s.value
        return decode if decode is not None else self._token_s.value

    @property
    def single_step_s(self) -> float | None:
        """A one-token step's time: the fixed cost of a step, near enough."""
        return self._single_s.value
