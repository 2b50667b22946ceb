"""fcfs, priority and slo side by side on the real daemon, at ~1.2x its measured saturation.

    python benchmarks/policies_live.py                  # embedded model, 2 request classes
    python benchmarks/policies_live.py --requests 96 --load 1.2

Steps, all in this one run on this machine:
1. start `headrace serve --policy fcfs`; measure the interactive class unloaded (one request at
   a time) and the saturation throughput (every request at once) in requests/s;
2. the SLOs: interactive TTFT/TPOT = --ttft-factor / --tpot-factor x its unloaded p50 (5x and
   4x: a full batch alone stretches TPOT, whatever the policy), batch 10x of both (so that
   goodput is about meeting latency under load, not about the machine's speed);
3. for each policy, a fresh daemon and the same Poisson workload at LOAD x saturation: 30%
   interactive (priority 0, tight SLO), 70% batch (priority 1, loose SLO).
Prints a table of goodput and priority-0 p99 TTFT per policy, and a RESULT line with the ratios
slo/fcfs and priority/fcfs goodput and the priority-0 p99 TTFT loaded/unloaded.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from daemon.bench.cli import (  # noqa: E402
    bench_once,
    build_requests,
    load_bench_tokenizer,
    make_endpoint,
)
from daemon.bench.sweep import LaunchedPeer, machine_description  # noqa: E402
from daemon.service.cli import build_parser  # noqa: E402


def bench_args(extra: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", "--no-progress", *extra])


def run(peer: LaunchedPeer, tok: object, argv: list[str], rate: float, conc: int | None) -> dict:
    args = bench_args(argv)
    requests, classes = build_requests(args, tok)
    ep = make_endpoint(args, peer.url, None)
    return bench_once(args, ep, requests, classes, tok, rate, conc, False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--load", type=float, default=1.2, help="offered load / saturation")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--serve-args", default="--max-num-seqs 16", help="extra headrace serve flags")
    p.add_argument("--result-dir", default="bench-results/policies")
    p.add_argument("--ttft-factor", type=float, default=5.0, help="interactive TTFT SLO / unloaded")
    p.add_argument("--tpot-factor", type=float, default=4.0, help="interactive TPOT SLO / unloaded")
    a = p.parse_args()
    m = machine_description()
    print(f"machine: {m['cpu_model']}, {m['cores']} cores, ISA {' '.join(m['isa_flags'])}")
    tok = load_bench_tokenizer(None)
    shape = ["--input-len", str(a.input_len), "--output-len", str(a.output_len), "--ignore-eos"]
    out_dir = Path(a.result_dir)

    fcfs = LaunchedPeer("headrace", f"--policy fcfs {a.serve_args}", out_dir)
    try:
        fcfs.wait_ready(600)
        unloaded = run(fcfs, tok, [*shape, "--num-prompts", "8"], math.inf, 1)
        sat = run(fcfs, tok, [*shape, "--num-prompts", str(a.requests)], math.inf, None)
    finally:
        fcfs.stop()
    saturation = sat["request_throughput"]
    ttft0, tpot0 = unloaded["median_ttft_ms"], unloaded["median_tpot_ms"]
    rate = a.load * saturation
    print(
        f"unloaded: TTFT p50 {ttft0:.0f} ms, TPOT p50 {tpot0:.1f} ms; saturation "
        f"{saturation:.2f} req/s ({sat['output_throughput']:.1f} tok/s); offered {rate:.2f} req/s"
    )
    classes = [
        "--class", f"interactive:0.3:0:{a.ttft_factor * ttft0:.0f}:{a.tpot_factor * tpot0:.1f}",
        "--class", f"batch:0.7:1:{10 * ttft0:.0f}:{10 * tpot0:.1f}",
    ]  # fmt: skip
    results = {}
    for policy in ("fcfs", "priority", "slo"):
        peer = LaunchedPeer("headrace", f"--policy {policy} {a.serve_args}", out_dir)
        try:
            peer.wait_ready(600)
            argv = [*shape, *classes, "--num-prompts", str(a.requests), "--seed", "7"]
            results[policy] = run(peer, tok, argv, rate, None)
        finally:
            peer.stop()
    print(f"{'policy':<10}{'goodput req/s':>15}{'interactive ok':>16}{'p0 p99 TTFT ms':>16}"
          f"{'batch ok':>10}{'out tok/s':>11}")  # fmt: skip
    for policy, r in results.items():
        inter, batch = r["classes"]["interactive"], r["classes"]["batch"]
        goodput = inter["request_goodput"] + batch["request_goodput"]
        r["goodput_total"] = goodput
        print(
            f"{policy:<10}{goodput:>15.3f}{inter['goodput_fraction']:>16.2f}"
            f"{inter['p99_ttft_ms']:>16.0f}{batch['goodput_fraction']:>10.2f}"
            f"{r['output_throughput']:>11.1f}"
        )
    base = results["fcfs"]["goodput_total"] or math.nan
    p0_unloaded = unloaded["p99_ttft_ms"] or math.nan
    print(
        f"RESULT slo_over_fcfs_goodput={results['slo']['goodput_total'] / base:.3f} "
        f"priority_over_fcfs_goodput={results['priority']['goodput_total'] / base:.3f} "
        + " ".join(
            f"{pol}_p0_p99_ttft_loaded_over_unloaded="
            f"{r['classes']['interactive']['p99_ttft_ms'] / p0_unloaded:.2f}"
            for pol, r in results.items()
        )
        + f" saturation_req_s={saturation:.3f} offered_req_s={rate:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
