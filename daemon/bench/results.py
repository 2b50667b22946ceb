"""Per-request records and the metric math over them: percentiles, TPOT, ITL, goodput.

Definitions follow vLLM's `bench serve` so that the two tools' result files can be compared:
TTFT is request start to the first content chunk; TPOT is (E2E - TTFT) / (output tokens - 1),
so the first token is excluded; ITL is every gap between successive content chunks; a request
meets the SLO when its TTFT and TPOT are both within their bounds (a bound not given is not
checked). Goodput counts only completed requests that meet their SLO.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class SLOSpec:
    """Latency bounds in milliseconds; None means not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLOSpec:
        """`ttft_ms=500,tpot_ms=50` (keys: ttft_ms, tpot_ms, e2el_ms)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in ("ttft_ms", "tpot_ms", "e2el_ms"):
                raise ValueError(f"--slo: {part!r} is not ttft_ms=, tpot_ms= or e2el_ms=<ms>")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"--slo: {key} needs a number of ms, got {value!r}") from None
            if values[key] <= 0:
                raise ValueError(f"--slo: {key} must be > 0")
        return cls(**values)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        checks = (
            (self.ttft_ms, record.ttft_s),
            (self.tpot_ms, record.tpot_s),
            (self.e2el_ms, record.e2el_s),
        )
        return all(bound is None or value * 1000 <= bound for bound, value in checks)

    def as_dict(self) -> dict[str, float]:
        return {
            k: v
            for k, v in (
                ("ttft_ms", self.ttft_ms),
                ("tpot_ms", self.tpot_ms),
                ("e2el_ms", self.e2el_ms),
            )
            if v is not None
        }


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times are seconds on the client's monotonic clock."""

    start: float
    prompt_tokens: int
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None
    output_tokens: int = 0
    error: str | None = None
    request_class: str = "default"
    tenant: str | None = None
    generated_text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and self.output_tokens > 0

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else math.nan

    @property
    def e2el_s(self) -> float:
        return (self.end or math.nan) - self.start

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; NaN with fewer than two tokens."""
        if self.output_tokens < 2 or not self.chunk_times:
            return math.nan
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def _stats(values_s: list[float], name: str) -> dict[str, float]:
    """mean/median/std/pNN in ms under vLLM's key names; zeros for an empty list."""
    arr = np.asarray([v for v in values_s if not math.isnan(v)], dtype=float) * 1000
    out: dict[str, float] = {}
    empty = arr.size == 0
    out[f"mean_{name}_ms"] = 0.0 if empty else float(arr.mean())
    out[f"median_{name}_ms"] = 0.0 if empty else float(np.median(arr))
    out[f"std_{name}_ms"] = 0.0 if empty else float(arr.std())
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = 0.0 if empty else float(np.percentile(arr, p))
    return out


def error_causes(records: list[RequestRecord]) -> dict[str, int]:
    return dict(Counter(r.error or "no output tokens" for r in records if not r.ok))


def summarize(
    records: list[RequestRecord], duration_s: float, slo: SLOSpec | None = None
) -> dict[str, object]:
    """The result-file metrics over `records` (vLLM's key names where they mean the same)."""
    done = [r for r in records if r.ok]
    duration_s = max(duration_s, 1e-9)
    inputs = sum(r.prompt_tokens for r in done)
    outputs = sum(r.output_tokens for r in done)
    out: dict[str, object] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": error_causes(records),
        "duration": duration_s,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(done) / duration_s,
        "output_throughput": outputs / duration_s,
        "total_token_throughput": (inputs + outputs) / duration_s,
    }
    if slo is not None:
        good = [r for r in done if slo.met_by(r)]
        out["slo"] = slo.as_dict()
        out["request_goodput"] = len(good) / duration_s
        out["output_goodput"] = sum(r.output_tokens for r in good) / duration_s
        out["goodput_fraction"] = len(good) / len(records) if records else 0.0
    out |= _stats([r.ttft_s for r in done], "ttft")
    out |= _stats([r.tpot_s for r in done], "tpot")
    out |= _stats([g for r in done for g in r.itls_s], "itl")
    out |= _stats([r.e2el_s for r in done], "e2el")
    return out


def output_rate_series(
    records: list[RequestRecord], t0: float, bin_s: float = 1.0
) -> tuple[list[float], list[float]]:
    """Output tokens/s in bins of `bin_s` from t0, spreading each request's tokens evenly
    over its content chunks (a chunk can carry several tokens)."""
    times: list[float] = []
    weights: list[float] = []
    for r in records:
        if not r.ok or not r.chunk_times:
            continue
        per_chunk = r.output_tokens / len(r.chunk_times)
        times.extend(t - t0 for t in r.chunk_times)
        weights.extend([per_chunk] * len(r.chunk_times))
    if not times:
        return [], []
    n = max(1, math.ceil(max(times) / bin_s))
    counts, edges = np.histogram(times, bins=n, range=(0, n * bin_s), weights=weights)
    return [float(e + bin_s / 2) for e in edges[:-1]], [float(c / bin_s) for c in counts]
