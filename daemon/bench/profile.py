"""Summarise a `headrace serve --profile-steps` log (written by daemon/engine/step_profile.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson

_PARTS = ("schedule_ms", "prepare_ms", "forward_ms", "sample_ms", "process_ms")


def load_steps(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"profile log: {path} does not exist")
    steps = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            steps.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            raise ValueError(f"profile log: line {n} of {path} is not JSON") from None
    if not steps:
        raise ValueError(f"profile log: {path} holds no steps")
    return steps


def _kind(step: dict[str, Any]) -> str:
    if step["prefill_tokens"] and step["decode_tokens"]:
        return "mixed"
    return "prefill" if step["prefill_tokens"] else "decode"


def summarize_steps(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of step (prefill, decode, mixed, all): counts, mean ms per part, shares."""
    groups: dict[str, list[dict[str, Any]]] = {"all": steps}
    for s in steps:
        groups.setdefault(_kind(s), []).append(s)
    out: dict[str, Any] = {}
    for kind, group in groups.items():
        total = sum(s["step_ms"] for s in group)
        tokens = sum(s["prefill_tokens"] + s["decode_tokens"] for s in group)
        row: dict[str, Any] = {
            "steps": len(group),
            "mean_step_ms": total / len(group),
            "p50_step_ms": float(np.percentile([s["step_ms"] for s in group], 50)),
            "mean_seqs": sum(s["seqs"] for s in group) / len(group),
            "tokens_per_s": tokens / (total / 1e3) if total else 0.0,
        }
        for part in _PARTS:
            part_total = sum(s[part] for s in group)
            row[f"mean_{part}"] = part_total / len(group)
            row[f"share_{part[:-3]}"] = part_total / total if total else 0.0
        row["overhead_share"] = (
            sum(s["step_ms"] - s["forward_ms"] - s["sample_ms"] for s in group) / total
            if total
            else 0.0
        )
        out[kind] = row
    return out


def summarize_log(path: str | Path) -> str:
    summary = summarize_steps(load_steps(path))
    head = (
        f"{'steps':<8}{'n':>7}{'seqs':>7}{'step ms':>9}{'sched':>8}{'prep':>8}"
        f"{'forward':>9}{'sample':>8}{'process':>9}{'py share':>10}{'tok/s':>9}"
    )
    lines = [f"step profile of {path} (mean ms per step; py share = not forward/sample)", head]
    for kind in ("prefill", "decode", "mixed", "all"):
        r = summary.get(kind)
        if r is None:
            continue
        lines.append(
            f"{kind:<8}{r['steps']:>7}{r['mean_seqs']:>7.1f}{r['mean_step_ms']:>9.2f}"
            f"{r['mean_schedule_ms']:>8.2f}{r['mean_prepare_ms']:>8.2f}{r['mean_forward_ms']:>9.2f}"
            f"{r['mean_sample_ms']:>8.2f}{r['mean_process_ms']:>9.2f}"
            f"{r['overhead_share'] * 100:>9.1f}%{r['tokens_per_s']:>9.1f}"
        )
    a = summary["all"]
    lines.append(
        f"RESULT overhead_share={a['overhead_share']:.3f} forward_share={a['share_forward']:.3f} "
        f"sample_share={a['share_sample']:.3f} steps={a['steps']}"
    )
    return "\n".join(lines)
