"""Figures people can read: latency CDFs and throughput over time for a run, and the
latency-throughput curves of a sweep. matplotlib is the optional `headrace[bench]` extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def require_matplotlib() -> None:
    """Fail before a long run, not after it, when the figure cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LookupError("--plot needs matplotlib: pip install 'headrace[bench]'") from None


def _pyplot() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_x(ax: Any, axis: str = "x") -> None:
    """Log scale with tick labels written as plain numbers (200, 1000), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    getattr(ax, f"set_{axis}scale")("log")
    which = ax.xaxis if axis == "x" else ax.yaxis
    which.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    which.set_minor_formatter(NullFormatter())


def _cdf(ax: Any, values_ms: list[float], label: str) -> None:
    vals = np.sort(np.asarray([v for v in values_ms if v is not None and v == v]))
    if vals.size == 0:
        return
    ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=label)


def plot_run(
    result: dict[str, Any],
    rate_series: tuple[list[float], list[float]],
    out: str | Path,
    title: str = "",
) -> None:
    """Four panels: TTFT and E2E CDFs, ITL and TPOT CDFs, output tok/s and requests in flight
    over time."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ttfts = [t * 1000 for t in result["ttfts"] if t is not None]
    e2els = [t * 1000 for t in result["e2els"] if t is not None]
    itls = [g * 1000 for gaps in result["itls"] for g in gaps]
    tpots = []
    for t, e, n in zip(result["ttfts"], result["e2els"], result["output_lens"]):
        if t is not None and e is not None and n > 1:
            tpots.append((e - t) / (n - 1) * 1000)
    ax = axes[0][0]
    _cdf(ax, ttfts, "TTFT")
    _cdf(ax, e2els, "end-to-end")
    ax.set(xlabel="latency (ms)", ylabel="fraction of requests", title="Request latency CDF")
    _plain_log_x(ax)
    ax = axes[0][1]
    _cdf(ax, itls, "inter-token latency (per gap)")
    _cdf(ax, tpots, "TPOT (per request)")
    ax.set(xlabel="latency (ms)", ylabel="cumulative fraction", title="Token latency CDF")
    _plain_log_x(ax)
    for a in axes[0]:
        a.grid(True, which="both", alpha=0.3)
        a.legend(loc="lower right")
    ax = axes[1][0]
    centres, rates = rate_series
    ax.plot(centres, rates, marker=".")
    ax.axhline(result["output_throughput"], color="grey", ls="--", label="run mean")
    ax.set(
        xlabel="time since start (s)", ylabel="output tokens/s", title="Output throughput over time"
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax = axes[1][1]
    flight = result.get("in_flight") or []
    if flight:
        xs, ys = zip(*flight)
        ax.step(xs, ys, where="post")
    ax.set(
        xlabel="time since start (s)", ylabel="requests in flight", title="Concurrency over time"
    )
    ax.grid(True, alpha=0.3)
    head = title or f"{result.get('model_id') or 'model'} @ {result.get('base_url', '')}"
    fig.suptitle(
        f"{head}: {result['completed']} ok / {result['failed']} failed, "
        f"{result['output_throughput']:.1f} output tok/s"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_sweep(series: dict[str, list[dict[str, Any]]], out: str | Path, title: str) -> None:
    """p50/p99 TTFT and TPOT against output tok/s, one line per target, all on one figure."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    panels = [
        ("median_ttft_ms", "p50 TTFT (ms)"),
        ("p99_ttft_ms", "p99 TTFT (ms)"),
        ("median_tpot_ms", "p50 TPOT (ms)"),
        ("p99_tpot_ms", "p99 TPOT (ms)"),
    ]
    for ax, (key, label) in zip(axes.flat, panels):
        for name, points in series.items():
            xs = [p["output_throughput"] for p in points]
            ys = [p[key] for p in points]
            ax.plot(xs, ys, marker="o", label=name)
            for p, x, y in zip(points, xs, ys):
                ax.annotate(
                    f"{p['level']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8
                )
        ax.set(xlabel="output throughput (tokens/s)", ylabel=label, title=f"{label} vs throughput")
        _plain_log_x(ax, "y")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title + "  (point labels: concurrency or request rate)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
