"""`headrace bench sweep`: the same workload over several loads and several targets, drawn as
latency-throughput curves on one figure, with ratios to a reference.

By default each target runs all its levels alone, one target after another. With `--rounds N`
every target stays up and each level runs N times, the targets taking turns in an order rotated
each round, so a machine's drift over minutes (a noisy guest) falls on every engine alike and
each round gives a paired ratio."""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import signal
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from daemon.bench.client import Endpoint
from daemon.bench.peers import LaunchedPeer, machine_description


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    from daemon.bench.cli import add_load_arguments

    p.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a running endpoint (repeatable)",
    )
    p.add_argument(
        "--peers",
        help="comma list of engines to launch one at a time: headrace, vllm-cpu, vllm-cpu-bf16, "
        "llama-server, transformers (set up by benchmarks/peers/setup_*.sh)",
    )
    p.add_argument(
        "--headrace-args", default="", help="extra `headrace serve` flags for the headrace peer"
    )
    levels = p.add_mutually_exclusive_group()
    levels.add_argument("--concurrency", type=int, nargs="+", help="max concurrencies (rate inf)")
    levels.add_argument("--request-rates", type=float, nargs="+", help="request rates (req/s)")
    p.add_argument("--reference", help="target the ratios are taken against (default: the first)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with N > 1, keep every target up and run each level N times, the targets taking "
        "turns (order rotated each round); ratios are the median of the rounds' paired ratios",
    )
    p.add_argument(
        "--prompts-per-level",
        type=int,
        default=0,
        help="requests per level (default: max(--num-prompts, 2*level))",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds a launched peer may take to answer",
    )
    p.add_argument("--plot", help="latency-throughput figure (PNG)")
    p.add_argument("--result-dir", default="bench-results", help="per-point JSON and peer logs")
    p.add_argument("--markdown", help="also write the tables as Markdown here")
    add_load_arguments(p)


def _point(result: dict[str, Any], level: float) -> dict[str, Any]:
    keys = (
        "completed",
        "failed",
        "errors",
        "duration",
        "output_throughput",
        "request_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "median_e2el_ms",
        "request_goodput",
        "server",
    )
    return {"level": level} | {k: result[k] for k in keys if k in result}


# Rounds' seeds sit this far apart, past any sweep's count of levels.
_ROUND_SEED_STRIDE = 1000


def level_args(
    args: argparse.Namespace, index: int, level: float, level_name: str, round_: int = 0
) -> argparse.Namespace:
    """The arguments one level's requests are built from: its prompt count and its own seed."""
    n = args.prompts_per_level or max(
        args.num_prompts, 2 * int(level) if level_name == "concurrency" else args.num_prompts
    )
    # Each level and each round draws its own prompts (the same for every target): with one
    # seed for all, a run would find an earlier run's prompts in an engine's prefix cache, and
    # only an engine whose blocks are small enough to hit would gain (vLLM's CPU blocks are 128
    # tokens). Round 0 keeps the seeds a one-round sweep has always used.
    seed = args.seed + index + _ROUND_SEED_STRIDE * round_
    return argparse.Namespace(**{**vars(args), "num_prompts": n, "seed": seed})


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """Each round's order of targets, rotated by one a round: over the rounds every target runs
    first as often as the others, so a trend over minutes does not favour one of them."""
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(rounds)]


def paired_ratios(points: dict[str, Any], reference: dict[str, Any]) -> list[float]:
    """A target's output rate over the reference's, round by round (each round ran the two
    minutes apart at most, so a slow spell of the machine cancels in the ratio)."""
    return [
        p / r if r else math.nan
        for p, r in zip(points["round_tputs"], reference["round_tputs"], strict=True)
    ]


def combine_rounds(points: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's rounds as one point: the round with the median output rate stands for the
    latencies, with every round's rate kept and the failures summed."""
    ranked = sorted(points, key=lambda p: p["output_throughput"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    out["round_tputs"] = [p["output_throughput"] for p in points]
    out["failed"] = sum(p["failed"] for p in points)
    return out


def _fmt_hits(point: dict[str, Any]) -> str:
    """The prompt tokens the server found cached during the point, where its /metrics tells."""
    hit = (point.get("server") or {}).get("prefix_cache_hit_rate")
    return "-" if hit is None else f"{hit:.0%}"


def _fmt_level(level: float) -> str:
    return "inf" if math.isinf(level) else f"{level:g}"


def workload_description(args: argparse.Namespace) -> str:
    """The workload as the table's caption names it: a jsonl dataset brings its own lengths."""
    if args.workload == "jsonl":
        return (
            f"jsonl ({args.dataset_path}: the file's prompts, its output lengths where it "
            f"gives them, else {args.output_len} tokens)"
        )
    eos = " (ignore_eos)" if args.ignore_eos else ""
    return f"{args.workload}, input {args.input_len} tokens, output {args.output_len} tokens{eos}"


def tables(
    series: dict[str, list[dict[str, Any]]], reference: str, level_name: str
) -> tuple[str, str, list[str]]:
    """A Markdown table of every point, a table of ratios to the reference, and RESULT pairs."""
    rows = [
        f"| target | {level_name} | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
        "| ITL p50 (ms) | prefix hits | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, points in series.items():
        for p in points:
            rows.append(
                f"| {name} | {_fmt_level(p['level'])} | {p['output_throughput']:.1f} | "
                f"{p['median_ttft_ms']:.0f} / {p['p99_ttft_ms']:.0f} | "
                f"{p['median_tpot_ms']:.1f} / {p['p99_tpot_ms']:.1f} | {p['median_itl_ms']:.1f} | "
                f"{_fmt_hits(p)} | {p['failed']} |"
            )
    ref = {p["level"]: p for p in series.get(reference, [])}
    ratio_rows = [
        f"| target / {reference} | {level_name} | output tok/s | TTFT p50 | TPOT p50 "
        "| rounds (output tok/s) |",
        "|---|---|---|---|---|---|",
    ]
    pairs: list[str] = []
    for name, points in series.items():
        if name == reference:
            continue
        for p in points:
            r = ref.get(p["level"])
            if not r:
                continue

            def ratio(key: str, p: dict[str, Any] = p, r: dict[str, Any] = r) -> float:
                return p[key] / r[key] if r[key] else math.nan

            tput, ttft, tpot = (
                ratio("output_throughput"),
                ratio("median_ttft_ms"),
                ratio("median_tpot_ms"),
            )
            spread = "1"
            if len(p.get("round_tputs", ())) > 1 and len(r.get("round_tputs", ())) > 1:
                each = paired_ratios(p, r)
                tput = statistics.median(each)
                spread = f"{len(each)}: {min(each):.2f}-{max(each):.2f}x"
            ratio_rows.append(
                f"| {name} | {_fmt_level(p['level'])} | {tput:.2f}x | {ttft:.2f}x | {tpot:.2f}x "
                f"| {spread} |"
            )
            key = re.sub(r"[^A-Za-z0-9]+", "_", name)
            pairs.append(f"tput_ratio_{key}_{level_name[0]}{_fmt_level(p['level'])}={tput:.3f}")
    return "\n".join(rows), "\n".join(ratio_rows), pairs


_TARGET_ERRORS = (RuntimeError, TimeoutError, ConnectionError, OSError)


@contextlib.contextmanager
def _opened(
    name: str, url: str | None, args: argparse.Namespace, out_dir: Path
) -> Iterator[Endpoint]:
    """A target's endpoint: a running URL as given, or a peer launched here and stopped after."""
    from daemon.bench.cli import make_endpoint

    peer = None
    try:
        if url is None:
            print(f"[{name}] starting ...", flush=True)
            peer = LaunchedPeer(name, args.headrace_args, out_dir)
            peer.wait_ready(args.startup_timeout)
            url = peer.url
        ep = make_endpoint(args, url, None)
        if peer is not None and ep.ignore_eos and not peer.accepts_ignore_eos:
            print(f"[{name}] no ignore_eos support: outputs may end early", flush=True)
            ep.ignore_eos = False
        yield ep
    finally:
        if peer is not None:
            peer.stop()


def run_sweep(args: argparse.Namespace) -> int:
    # SIGTERM unwinds like Ctrl-C, so a launched peer is stopped, never left running.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _run_sweep(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_sweep(args: argparse.Namespace) -> int:
    from daemon.bench.cli import bench_once, build_requests, load_bench_tokenizer
    from daemon.bench.serve import write_result

    targets: list[tuple[str, str | None]] = []
    for t in args.target:
        name, sep, url = t.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--target: {t!r} is not NAME=URL")
        targets.append((name, url))
    if args.peers:
        targets += [(name.strip(), None) for name in args.peers.split(",") if name.strip()]
    if not targets:
        raise ValueError("bench sweep needs --target NAME=URL or --peers LIST")
    if len({n for n, _ in targets}) != len(targets):
        raise ValueError("bench sweep: target names must be unique")
    if args.request_rates:
        levels, level_name = [float(r) for r in args.request_rates], "rate"
    else:
        levels, level_name = [float(c) for c in (args.concurrency or [1, 8, 32])], "concurrency"
    reference = args.reference or targets[0][0]
    if reference not in {n for n, _ in targets}:
        raise ValueError(f"--reference: {reference} is not one of the targets")
    machine = machine_description()
    print(
        f"machine: {machine['cpu_model']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"ISA {' '.join(machine['isa_flags'])}"
    )
    tokenizer = load_bench_tokenizer(args.tokenizer)
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")

    def measure(name: str, ep: Endpoint, index: int, level: float, round_: int) -> dict[str, Any]:
        args_n = level_args(args, index, level, level_name, round_)
        requests, classes = build_requests(args_n, tokenizer)
        rate, conc = (level, None) if level_name == "rate" else (math.inf, int(level))
        result = bench_once(args_n, ep, requests, classes, tokenizer, rate, conc, False)
        result["machine"] = machine
        suffix = f"_round{round_}" if args.rounds > 1 else ""
        write_result(result, out_dir / f"{name}_{level_name}{_fmt_level(level)}{suffix}.json")
        print(
            f"[{name}] {level_name}={_fmt_level(level)}"
            f"{f' round {round_ + 1}/{args.rounds}' if args.rounds > 1 else ''}: "
            f"{result['output_throughput']:.1f} tok/s, "
            f"TTFT p50 {result['median_ttft_ms']:.0f} ms, "
            f"TPOT p50 {result['median_tpot_ms']:.1f} ms, "
            f"failed {result['failed']}",
            flush=True,
        )
        return _point(result, level)

    series: dict[str, list[dict[str, Any]]] = {}
    skipped: list[str] = []
    if args.rounds == 1:
        for name, url in targets:
            try:
                with _opened(name, url, args, out_dir) as ep:
                    series[name] = [
                        measure(name, ep, index, level, 0) for index, level in enumerate(levels)
                    ]
            except _TARGET_ERRORS as e:
                print(f"[{name}] skipped: {e}", file=sys.stderr, flush=True)
                skipped.append(name)
    else:
        with contextlib.ExitStack() as stack:
            # Started one at a time, so each engine's start-up measurements run on a quiet
            # machine; then all stay up, idle but for their turn.
            endpoints: dict[str, Endpoint] = {}
            for name, url in targets:
                try:
                    endpoints[name] = stack.enter_context(_opened(name, url, args, out_dir))
                except _TARGET_ERRORS as e:
                    print(f"[{name}] skipped: {e}", file=sys.stderr, flush=True)
                    skipped.append(name)
            rounds: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in endpoints}
            for index, level in enumerate(levels):
                for n in rounds:
                    rounds[n].append([])
                for round_, order in enumerate(round_orders(list(rounds), args.rounds)):
                    for name in order:
                        if name not in rounds:  # dropped earlier in this round
                            continue
                        try:
                            point = measure(name, endpoints[name], index, level, round_)
                        except _TARGET_ERRORS as e:
                            print(f"[{name}] dropped: {e}", file=sys.stderr, flush=True)
                            skipped.append(name)
                            del rounds[name]
                            continue
                        rounds[name][index].append(point)
            series = {
                n: [combine_rounds(pts) for pts in per_level] for n, per_level in rounds.items()
            }
    if not series:
        print("bench sweep: no target produced a result", file=sys.stderr)
        return 1
    if reference not in series:
        reference = next(iter(series))
    table, ratio_table, pairs = tables(series, reference, level_name)
    desc = (
        f"Machine: {machine['cpu_model']}, {machine['cores']} cores, "
        f"ISA {' '.join(machine['isa_flags'])}, "
        f"torch {machine['torch']}. Workload: {workload_description(args)}, streaming, "
        f"{args.api} API."
    )
    if skipped:
        desc += f" Skipped (not set up or failed to start): {', '.join(skipped)}."
    print(desc)
    print(table)
    print(ratio_table)
    (out_dir / "sweep.json").write_bytes(
        orjson.dumps(
            {"machine": machine, "reference": reference, "series": series},
            option=orjson.OPT_INDENT_2,
        )
    )
    if args.markdown:
        Path(args.markdown).write_text(f"{desc}\n\n{table}\n\n{ratio_table}\n")
    if args.plot:
        from daemon.bench.plots import plot_sweep

        plot_sweep(
            series,
            args.plot,
            f"{machine['cpu_model']}, {machine['cores']} cores; {args.output_len} output tokens",
        )
        print(f"wrote {args.plot}")
    tputs = [
        f"tput_{re.sub(r'[^A-Za-z0-9]+', '_', n)}_{level_name[0]}{_fmt_level(p['level'])}"
        f"={p['output_throughput']:.2f}"
        for n, pts in series.items()
        for p in pts
    ]
    failed = sum(p["failed"] for pts in series.values() for p in pts)
    tail = [f"failed={failed}"] + ([f"skipped={','.join(skipped)}"] if skipped else [])
    print("RESULT " + " ".join([*pairs, *tputs, *tail]))
    return 0
