"""Request traces for the simulator: JSON lines, one request a line, and a generator."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import orjson

from scheduling.request import DEFAULT_TENANT, SLO


@dataclass(slots=True)
class TraceRequest:
    """One line of a trace: `{"arrival": s, "prompt_len": n, "output_len": n, ...}`."""

    arrival: float
    prompt_len: int
    output_len: int
    priority: int = 0
    slo: SLO | None = None
    # Free-form class label, used to break results down (e.g. "interactive").
    cls: str = ""
    # Who sent it (the `fair` policy's unit of sharing); synthetic traces use the class name.
    tenant: str = DEFAULT_TENANT
    # Exact prompt tokens; when absent the simulator makes unique ones (no prefix hits).
    prompt_ids: list[int] | None = None

    def to_json(self) -> dict:
        out: dict = {
            "arrival": round(self.arrival, 6),
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "priority": self.priority,
        }
        if self.slo is not None:
            out["slo"] = {"ttft_ms": self.slo.ttft_ms, "tpot_ms": self.slo.tpot_ms}
        if self.cls:
            out["class"] = self.cls
        if self.tenant != DEFAULT_TENANT:
            out["tenant"] = self.tenant
        if self.prompt_ids is not None:
            out["prompt_ids"] = self.prompt_ids
        return out


def parse_trace_line(obj: dict, where: str) -> TraceRequest:
    try:
        prompt_ids = obj.get("prompt_ids")
        prompt_len = len(prompt_ids) if prompt_ids is not None else int(obj["prompt_len"])
        slo = obj.get("slo")
        req = TraceRequest(
            arrival=float(obj["arrival"]),
            prompt_len=prompt_len,
            output_len=int(obj["output_len"]),
            priority=int(obj.get("priority", 0)),
            slo=SLO(slo.get("ttft_ms"), slo.get("tpot_ms")) if slo else None,
            cls=str(obj.get("class", "")),
            tenant=str(obj.get("tenant", DEFAULT_TENANT)),
            prompt_ids=[int(t) for t in prompt_ids] if prompt_ids is not None else None,
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: {e}") from None
    if req.prompt_len < 1 or req.output_len < 1 or req.arrival < 0:
        raise ValueError(f"{where}: prompt_len and output_len must be >= 1, arrival >= 0")
    return req


def load_trace(path: str | Path) -> list[TraceRequest]:
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            out.append(parse_trace_line(orjson.loads(line), f"{path}:{lineno}"))
    return sorted(out, key=lambda r: r.arrival)


def dump_trace(trace: list[TraceRequest], path: str | Path) -> None:
    Path(path).write_bytes(b"".join(orjson.dumps(r.to_json()) + b"\n" for r in trace))


@dataclass(slots=True)
class TraceClass:
    """A request class of a synthetic trace: Poisson arrivals at `rate` per second."""

    name: str
    rate: float
    prompt_len: int
    output_len: int
    priority: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @classmethod
    def parse(cls, spec: str) -> TraceClass:
        """`NAME:RATE:PROMPT_LEN:OUTPUT_LEN[:PRIORITY[:TTFT_MS[:TPOT_MS]]]`."""
        parts = spec.split(":")
        if not 4 <= len(parts) <= 7:
            raise ValueError(
                f"--class {spec!r}: expected NAME:RATE:PROMPT_LEN:OUTPUT_LEN"
                "[:PRIORITY[:TTFT_MS[:TPOT_MS]]]"
            )
        opt = [float(p) if p else None for p in parts[5:]] + [None, None]
        return cls(
            parts[0],
            float(parts[1]),
            int(parts[2]),
            int(parts[3]),
            int(parts[4]) if len(parts) > 4 and parts[4] else 0,
            opt[0],
            opt[1],
        )


def make_trace(
    classes: list[TraceClass], duration_s: float, seed: int = 0, jitter: float = 0.5
) -> list[TraceRequest]:
    """Merge independent Poisson streams, one per class, over `duration_s` seconds.

    Lengths are uniform in mean * [1 - jitter, 1 + jitter].
    """
    rng = random.Random(seed)
    out = []
    for c in classes:
        t = rng.expovariate(c.rate)
        while t < duration_s:
            slo = SLO(c.ttft_ms, c.tpot_ms) if c.ttft_ms or c.tpot_ms else None
            out.append(
                TraceRequest(
                    arrival=t,
                    prompt_len=_jittered(rng, c.prompt_len, jitter),
                    output_len=_jittered(rng, c.output_len, jitter),
                    priority=c.priority,
                    slo=slo,
                    cls=c.name,
                    tenant=c.name,
                )
            )
            t += rng.expovariate(c.rate)
    return sorted(out, key=lambda r: r.arrival)


def _jittered(rng: random.Random, mean: int, jitter: float) -> int:
    return max(1, round(mean * rng.uniform(1 - jitter, 1 + jitter)))
