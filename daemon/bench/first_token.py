"""Where a request's time to first token went, step by step, from a --profile-steps log.

For every request whose first token a step sampled (the log's `first_tokens`), its *path*
is the steps that were still running when it arrived or started after it, up to and
including that step:

```
arrival        scheduled_at(own)            done_at(own)
   |--- wait: steps in flight, loop ---|--- own step: its prefill (+ what rode along) ---|
```
`wait_ms` is arrival to the start of scheduling its own step, `own_ms` that step's whole
wall time (schedule, execute, process), `engine_ttft_ms` their sum. What the client
measures on top is HTTP, tokenising and the SSE write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from daemon.bench.profile import load_steps


def first_token_paths(
    steps: list[dict[str, Any]], priority: int | None = None
) -> list[dict[str, Any]]:
    """One path per first token (of `priority` only, when given), in log order."""
    if steps and "first_tokens" not in steps[0]:
        raise ValueError("profile log: no first_tokens (written by an older headrace)")
    paths = []
    for k, own in enumerate(steps):
        for rid, prio, arrival in own["first_tokens"]:
            if priority is not None and prio != priority:
                continue
            j = k
            while j > 0 and steps[j - 1]["done_at"] > arrival:
                j -= 1
            paths.append(
                {
                    "id": rid,
                    "priority": prio,
                    "arrival": arrival,
                    "engine_ttft_ms": (own["done_at"] - arrival) * 1e3,
                    "wait_ms": max(0.0, own["scheduled_at"] - arrival) * 1e3,
                    "own_ms": (own["done_at"] - own["scheduled_at"]) * 1e3,
                    "steps": [_shape(s) for s in steps[j : k + 1]],
                }
            )
    return paths


def _shape(step: dict[str, Any]) -> dict[str, Any]:
    return {
        "prefill_tokens": step["prefill_tokens"],
        "decode_tokens": step["decode_tokens"],
        "seqs": step["seqs"],
        "threads": step["threads"],
        "cap": step.get("policy_cap"),
        "wall_ms": (step["done_at"] - step["scheduled_at"]) * 1e3,
        "execute_ms": step["execute_ms"],
    }


def summarize_paths(paths: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p99 of the parts, how many steps a path held, and the own step's composition."""
    if not paths:
        return {"requests": 0}
    out: dict[str, Any] = {"requests": len(paths)}
    for key in ("engine_ttft_ms", "wait_ms", "own_ms"):
        values = [p[key] for p in paths]
        out[f"p50_{key}"] = float(np.percentile(values, 50))
        out[f"p99_{key}"] = float(np.percentile(values, 99))
    counts = [len(p["steps"]) for p in paths]
    out["steps_per_path"] = {n: counts.count(n) for n in sorted(set(counts))}
    own = [p["steps"][-1] for p in paths]
    out["mean_own_decode_tokens"] = sum(s["decode_tokens"] for s in own) / len(own)
    out["mean_own_prefill_tokens"] = sum(s["prefill_tokens"] for s in own) / len(own)
    out["own_single_thread"] = sum(s["threads"] == 1 for s in own)
    before = [s for p in paths for s in p["steps"][:-1]]
    if before:
        out["mean_before_tokens"] = sum(
            s["prefill_tokens"] + s["decode_tokens"] for s in before
        ) / len(before)
        out["mean_before_wall_ms"] = sum(s["wall_ms"] for s in before) / len(before)
    return out


def describe_log(path: str | Path, priority: int | None = None) -> str:
    """A line per request (its path's steps as prefill+decode@threads/cap:ms), then the
    summary."""
    paths = first_token_paths(load_steps(path), priority)
    lines = []
    for p in paths:
        shapes = " | ".join(
            f"{s['prefill_tokens']}p+{s['decode_tokens']}d@{s['threads']}t/{s['cap']}:"
            f"{s['wall_ms']:.1f}"
            for s in p["steps"]
        )
        lines.append(
            f"{p['id']} prio {p['priority']}: ttft {p['engine_ttft_ms']:.1f} ms = wait "
            f"{p['wait_ms']:.1f} + own {p['own_ms']:.1f}; steps {shapes}"
        )
    s = summarize_paths(paths)
    lines.append("SUMMARY " + " ".join(f"{k}={_fmt(v)}" for k, v in s.items()))
    return "\n".join(lines)


def describe_phases(
    path: str | Path, phases: dict[str, tuple[float, float]], priority: int | None = None
) -> str:
    """The summary of the requests that arrived in each phase (name -> (start, end) on
    the daemon's monotonic clock, which is the machine's), a line each."""
    paths = first_token_paths(load_steps(path), priority)
    lines = []
    for name, (start, end) in phases.items():
        s = summarize_paths([p for p in paths if start <= p["arrival"] < end])
        lines.append(f"PHASE {name} " + " ".join(f"{k}={_fmt(v)}" for k, v in s.items()))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value).replace(" ", "")


if __name__ == "__main__":
    import sys

    print(describe_log(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None))
