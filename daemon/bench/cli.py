"""The `headrace bench` sub-commands: serve, sweep, profile."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from typing import Any

from daemon.bench.client import Endpoint, check_loopback
from daemon.bench.results import SLOSpec, output_rate_series
from daemon.bench.serve import RunSpec, build_result, format_report, run_workload, write_result
from daemon.bench.tenants import TenantSpec, assign_tenants
from daemon.bench.workloads import (
    BenchRequest,
    PromptMaker,
    RequestClass,
    assign_classes,
    file_workload,
    prefix_workload,
    random_workload,
)


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return value


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by `bench serve` and `bench sweep`: workload, endpoint shape, bounds."""
    g = p.add_argument_group("endpoint")
    g.add_argument("--api", choices=("completions", "chat"), default="completions")
    g.add_argument("--model", help="model name to send (default: the first in /v1/models)")
    g.add_argument("--allow-remote", action="store_true", help="allow a non-loopback host")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("random", "prefix", "jsonl"), default="random")
    w.add_argument("--dataset-path", help="jsonl workload: JSON lines or a ShareGPT JSON file")
    w.add_argument("--num-prompts", type=int, default=64, help="requests to send (the count bound)")
    w.add_argument("--input-len", type=int, default=128, help="mean prompt length (tokens)")
    w.add_argument("--output-len", type=int, default=64, help="mean output length (tokens)")
    w.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in mean*(1±r)")
    w.add_argument("--prefix-len", type=int, default=512, help="prefix workload: shared tokens")
    w.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    w.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        metavar="NAME:SHARE[:PRIORITY[:TTFT_MS[:TPOT_MS]]]",
        help="a request class with its share of traffic, priority and SLO (repeatable)",
    )
    w.add_argument(
        "--tenants",
        metavar="NAME:SHARE,...",
        help="draw each request's tenant by these shares, sent as `user` (e.g. heavy:10,a:1,"
        "b:1,c:1); the report adds per-tenant figures and Jain's fairness index",
    )
    w.add_argument("--tokenizer", help="tokenizer (GGUF or HF dir) of the target; default embedded")
    w.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("arrivals and bounds")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson")
    a.add_argument("--max-duration", type=float, help="stop after this many seconds (time bound)")
    a.add_argument("--slo", help="goodput bounds, e.g. ttft_ms=500,tpot_ms=50")


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (headrace or a peer)",
        description="Serving benchmarks: bench serve (one run), bench sweep (curves over "
        "rates or concurrencies, several targets), bench profile (a --profile-steps log).",
    )
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    s = bsub.add_parser("serve", help="one bounded run against one endpoint")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--uds", help="Unix socket path of the server (instead of TCP)")
    s.add_argument("--request-rate", type=_rate, default=math.inf, help="req/s, or inf")
    s.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    s.add_argument("--result-file", help="write the result JSON here")
    s.add_argument("--plot", help="draw latency CDFs and throughput over time to this PNG")
    s.add_argument("--no-progress", action="store_true")
    add_load_arguments(s)
    from daemon.bench.sweep import add_sweep_arguments

    add_sweep_arguments(bsub.add_parser("sweep", help="latency-throughput curves, side by side"))
    pr = bsub.add_parser("profile", help="summarise a `headrace serve --profile-steps` log")
    pr.add_argument("log", help="the JSON-lines step log")


def load_bench_tokenizer(path: str | None) -> Any:
    from runner.model_source import resolve_model
    from runner.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(path))
    if tok is None:
        raise ValueError(f"--tokenizer: {path} has no tokenizer")
    return tok


def build_requests(
    args: argparse.Namespace, tokenizer: Any
) -> tuple[list[BenchRequest], list[RequestClass]]:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    maker = PromptMaker(tokenizer, args.seed)
    if args.workload == "random":
        reqs = random_workload(
            maker, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed
        )
    elif args.workload == "prefix":
        reqs = prefix_workload(
            maker,
            args.num_prompts,
            args.prefix_len,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.seed,
        )
    else:
        if not args.dataset_path:
            raise ValueError("--workload jsonl needs --dataset-path FILE")
        reqs = file_workload(args.dataset_path, maker, args.num_prompts, args.output_len, args.seed)
    classes = [RequestClass.parse(c) for c in args.classes]
    if len({c.name for c in classes}) != len(classes):
        raise ValueError("--class: class names must be unique")
    reqs = assign_tenants(reqs, tenant_specs(args), args.seed)
    return assign_classes(reqs, classes, args.seed), classes


def tenant_specs(args: argparse.Namespace) -> list[TenantSpec]:
    return TenantSpec.parse_list(args.tenants) if getattr(args, "tenants", None) else []


def make_endpoint(args: argparse.Namespace, base_url: str, uds: str | None) -> Endpoint:
    if not uds:
        check_loopback(base_url, args.allow_remote)
    return Endpoint(
        base_url="http://localhost" if uds else base_url,
        api=args.api,
        model=args.model,
        uds=uds,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout,
    )


def bench_once(
    args: argparse.Namespace,
    ep: Endpoint,
    requests: list[BenchRequest],
    classes: list[RequestClass],
    tokenizer: Any,
    rate: float,
    concurrency: int | None,
    progress: bool,
    offsets: list[float] | None = None,
) -> dict[str, Any]:
    """One run, summarised into a result dict (with the per-second output rate series).
    `offsets`: each request's send time, instead of times drawn from `rate`."""
    spec = RunSpec(
        request_rate=rate,
        burstiness=args.burstiness,
        max_concurrency=concurrency,
        max_duration_s=args.max_duration,
        seed=args.seed,
        progress=progress,
        offsets=None if offsets is None else tuple(offsets),
    )

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    outcome = asyncio.run(run_workload(ep, requests, spec, count))
    slo = SLOSpec.parse(args.slo) if args.slo else None
    meta = {"workload": args.workload, "tokenizer_id": args.tokenizer or "embedded"}
    result = build_result(outcome, spec, ep, slo, classes, meta, tenant_specs(args))
    result["output_rate_series"] = output_rate_series(outcome.records, outcome.t0)
    result["max_output_tokens_per_s"] = max(result["output_rate_series"][1], default=0.0)
    return result


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "profile":
        from daemon.bench.profile import summarize_log

        print(summarize_log(args.log))
        return 0
    if args.bench_command == "sweep":
        from daemon.bench.sweep import run_sweep

        return run_sweep(args)
    if args.slo:
        SLOSpec.parse(args.slo)  # fail before any work on a bad --slo
    if args.plot:
        from daemon.bench.plots import require_matplotlib

        require_matplotlib()
    tokenizer = load_bench_tokenizer(args.tokenizer)
    requests, classes = build_requests(args, tokenizer)
    ep = make_endpoint(args, args.base_url, args.uds)
    result = bench_once(
        args,
        ep,
        requests,
        classes,
        tokenizer,
        args.request_rate,
        args.max_concurrency,
        not args.no_progress,
    )
    print(format_report(result))
    if args.result_file:
        write_result(result, args.result_file)
        print(f"wrote {args.result_file}")
    if args.plot:
        from daemon.bench.plots import plot_run

        plot_run(result, result["output_rate_series"], args.plot)
        print(f"wrote {args.plot}")
    print(
        f"RESULT output_throughput={result['output_throughput']:.2f} "
        f"completed={result['completed']} failed={result['failed']} "
        f"median_ttft_ms={result['median_ttft_ms']:.1f} "
        f"median_tpot_ms={result['median_tpot_ms']:.1f}",
        file=sys.stdout,
    )
    return 0 if result["completed"] else 1
