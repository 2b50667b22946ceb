"""Every policy on the real daemon: fcfs, priority and slo at ~1.2x its measured saturation;
fcfs and fair under a four-tenant load; priority's urgent TTFT loaded against idle.

    python benchmarks/policies_live.py                  # embedded model, everything
    python benchmarks/policies_live.py --requests 96 --load 1.2
    python benchmarks/policies_live.py --only tenants,urgent --tenant-requests 130

Steps, all in this one run on this machine:
1. start `headrace serve --policy fcfs`; measure the interactive class unloaded (one request at
   a time) and the saturation throughput (every request at once) in requests/s;
2. the SLOs: interactive TTFT/TPOT = --ttft-factor / --tpot-factor x its unloaded p50 (5x and
   4x: a full batch alone stretches TPOT, whatever the policy), batch 10x of both (so that
   goodput is about meeting latency under load, not about the machine's speed);
3. for each policy, a fresh daemon and the same Poisson workload at LOAD x saturation: 30%
   interactive (priority 0, tight SLO), 70% batch (priority 1, loose SLO).
4. tenants: for fcfs and fair, a fresh daemon and --tenant-requests sent at once, drawn to four
   tenants (heavy at 10x the requests of each of a, b, c; sent as `user`): per-tenant output
   tok/s while all four are backlogged, TTFT p50/p99, and Jain's index over those rates;
5. urgent: on a priority daemon, priority-0 requests one at a time (idle TTFT), the urgent
   requests of the mix below alone at their own send times (they still queue behind each
   other), the mix (--urgent-share of a Poisson stream at --urgent-load x saturation),
   the probe (the one-at-a-time urgent run again, inside the mix's priority-1 stream: it
   differs from the idle run by the load alone), then one at a time again (the machine's
   speed drifts);
   with --urgent-profile, each urgent request's steps from arrival to first token (how many,
   what each carried, its cap, its time: daemon/bench/first_token.py).
Prints the tables, and a RESULT line with the ratios slo/fcfs and priority/fcfs goodput, the
priority-0 p99 TTFT loaded/unloaded, Jain's index of fair and fcfs, and the urgent TTFT
loaded/idle (p50 and p99) under priority.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from daemon.bench.arrivals import arrival_offsets  # noqa: E402
from daemon.bench.cli import (  # noqa: E402
    bench_once,
    build_requests,
    load_bench_tokenizer,
    make_endpoint,
)
from daemon.bench.peers import LaunchedPeer, machine_description  # noqa: E402
from daemon.service.cli import build_parser  # noqa: E402


def bench_args(extra: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", "--no-progress", *extra])


def run(
    peer: LaunchedPeer,
    tok: object,
    argv: list[str],
    rate: float,
    conc: int | None,
    only_class: str | None = None,
) -> dict:
    """One bench run. `only_class`: send only that class's requests, each at the time the
    whole workload's schedule gives it (the class alone, arriving as it does in the mix)."""
    args = bench_args(argv)
    requests, classes = build_requests(args, tok)
    ep = make_endpoint(args, peer.url, None)
    offsets = None
    if only_class is not None:
        times = arrival_offsets(len(requests), rate, args.burstiness, args.seed)
        kept = [(r, t) for r, t in zip(requests, times) if r.request_class == only_class]
        requests, offsets = [r for r, _ in kept], [t for _, t in kept]
        classes = [c for c in classes if c.name == only_class]
    result = bench_once(args, ep, requests, classes, tok, rate, conc, False, offsets)
    if offsets:
        result["last_send_s"] = max(offsets)
    return result


def run_classes(
    a: argparse.Namespace, tok: object, shape: list[str], out_dir: Path, unloaded: dict, rate: float
) -> list[str]:
    """fcfs, priority and slo on two classes with SLOs at `rate` req/s: goodput, p0 p99 TTFT."""
    ttft0, tpot0 = unloaded["median_ttft_ms"], unloaded["median_tpot_ms"]
    print(f"classes: offered {rate:.2f} req/s")
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
    return [
        f"slo_over_fcfs_goodput={results['slo']['goodput_total'] / base:.3f}",
        f"priority_over_fcfs_goodput={results['priority']['goodput_total'] / base:.3f}",
        *(
            f"{pol}_p0_p99_ttft_loaded_over_unloaded="
            f"{r['classes']['interactive']['p99_ttft_ms'] / p0_unloaded:.2f}"
            for pol, r in results.items()
        ),
        f"offered_req_s={rate:.3f}",
    ]


def run_tenants(a: argparse.Namespace, tok: object, shape: list[str], out_dir: Path) -> list[str]:
    """fcfs and fair on the four-tenant load, all sent at once (every tenant backlogged)."""
    argv = [*shape, "--tenants", a.tenants, "--num-prompts", str(a.tenant_requests)]
    figures = []
    for policy in ("fcfs", "fair"):
        peer = LaunchedPeer("headrace", f"--policy {policy} {a.serve_args}", out_dir)
        try:
            peer.wait_ready(600)
            t = run(peer, tok, [*argv, "--seed", "11"], math.inf, None)["tenants"]
        finally:
            peer.stop()
        print(f"{policy}: all four backlogged for {t['window_s']:.1f} s")
        print(f"  {'tenant':<8}{'tok/s backlogged':>18}{'TTFT p50 ms':>13}{'p99 ms':>9}{'n':>5}")
        for name, x in t["per_tenant"].items():
            print(
                f"  {name:<8}{x['backlogged_output_throughput']:>18.1f}"
                f"{x['median_ttft_ms']:>13.0f}{x['p99_ttft_ms']:>9.0f}{x['completed']:>5}"
            )
        print(f"  Jain's index (backlogged): {t['jain_index']:.3f}")
        figures.append(f"{policy}_jain={t['jain_index']:.3f}")
    return figures


def run_urgent(
    a: argparse.Namespace, tok: object, shape: list[str], out_dir: Path, rate: float
) -> list[str]:
    """priority: urgent (priority-0) TTFT alone, then inside a saturating priority-1 stream."""
    wait = "" if a.urgent_wait is None else f" --urgent-wait {a.urgent_wait}"
    profile = out_dir / "urgent-steps.jsonl"
    if a.urgent_profile:  # every step of the priority daemon, for the urgent paths below
        profile.parent.mkdir(parents=True, exist_ok=True)
        profile.unlink(missing_ok=True)
        wait += f" --profile-steps {profile}"
    # The three runs below send the same prompts (one seed): with prefix caching on, a later
    # run would find an earlier one's prompts cached and its TTFT would not compare.
    flags = f"--policy priority --no-enable-prefix-caching {a.serve_args}{wait}"
    peer = LaunchedPeer("headrace", flags, out_dir)
    n = max(8, round(a.requests * a.urgent_share))
    # Each run's span on the machine's monotonic clock (the daemon logs its steps on it).
    phases: dict[str, tuple[float, float]] = {}
    try:
        peer.wait_ready(600)
        start = time.monotonic()
        one_by_one = [*shape, "--num-prompts", str(n), "--seed", "5"]
        idle = run(peer, tok, one_by_one, math.inf, 1)
        phases["idle"] = (start, start := time.monotonic())
        mix = ["--class", f"urgent:{a.urgent_share}:0", "--class", f"batch:{1 - a.urgent_share}:1"]
        argv = [*shape, *mix, "--num-prompts", str(round(n / a.urgent_share)), "--seed", "5"]
        # Urgent requests also queue behind each other (one that arrives during another's
        # prefill waits for it), which the one-at-a-time run never shows: the urgent stream
        # alone, at the times it arrives in the mix, is the baseline that differs only by load.
        alone = run(peer, tok, argv, rate, None, only_class="urgent")["classes"]["urgent"]
        phases["alone"] = (start, start := time.monotonic())
        result = run(peer, tok, argv, rate, None)
        phases["loaded"] = (start, start := time.monotonic())
        loaded = result["classes"]["urgent"]
        # The probe: one urgent request at a time, as in the idle run, while the priority-1
        # share of the mix runs at its own send times. Urgent requests never meet each other
        # here, so this differs from the idle run by the load alone.
        probe, background = run_probe(a, peer, tok, one_by_one, argv, rate)
        phases["probe"] = (start, start := time.monotonic())
        # Idle again: this machine's speed drifts within a run, so the idle baseline is
        # taken on both sides of the load.
        idle_after = run(peer, tok, one_by_one, math.inf, 1)
        phases["idle after"] = (start, time.monotonic())
    finally:
        peer.stop()
    if a.urgent_profile:
        from daemon.bench.first_token import describe_log, describe_phases

        # One line per urgent request: the steps from its arrival to its first token; then
        # the engine's side of each run on its own.
        print(describe_log(profile, priority=0))
        print(describe_phases(profile, phases, priority=0))

    def ratio(key: str, base: dict) -> float:
        return loaded[key] / (base[key] or math.nan)

    print(
        f"probe (one at a time inside the priority-1 load): urgent TTFT p50/p99 "
        f"{probe['median_ttft_ms']:.0f}/{probe['p99_ttft_ms']:.0f} ms (n={probe['completed']}, "
        f"sent {probe['span_s'][0]:.1f}-{probe['span_s'][1]:.1f} s into a load that sent its "
        f"last request at {background['last_send_s']:.1f} s and ended at "
        f"{background['duration']:.1f} s; "
        f"load {background['output_throughput']:.1f} output tok/s)"
    )
    print(
        f"urgent TTFT p50/p99: idle (one at a time) {idle['median_ttft_ms']:.0f}/"
        f"{idle['p99_ttft_ms']:.0f} ms, again after the load "
        f"{idle_after['median_ttft_ms']:.0f}/{idle_after['p99_ttft_ms']:.0f} ms; "
        f"the urgent stream alone {alone['median_ttft_ms']:.0f}/"
        f"{alone['p99_ttft_ms']:.0f} ms; under priority-1 load at {rate:.2f} req/s "
        f"{loaded['median_ttft_ms']:.0f}/{loaded['p99_ttft_ms']:.0f} ms "
        f"(n={loaded['completed']}); all classes {result['output_throughput']:.1f} output tok/s"
    )

    def probe_ratio(key: str, base: dict) -> float:
        return probe[key] / (base[key] or math.nan)

    return [
        f"priority_urgent_ttft_p50_loaded_over_idle={ratio('median_ttft_ms', idle):.2f}",
        f"priority_probe_ttft_p50_loaded_over_idle={probe_ratio('median_ttft_ms', idle):.2f}",
        f"priority_probe_ttft_p99_loaded_over_idle={probe_ratio('p99_ttft_ms', idle):.2f}",
        "priority_probe_ttft_p50_loaded_over_idle_after="
        f"{probe_ratio('median_ttft_ms', idle_after):.2f}",
        "priority_probe_ttft_p99_loaded_over_idle_after="
        f"{probe_ratio('p99_ttft_ms', idle_after):.2f}",
        f"priority_urgent_ttft_p99_loaded_over_idle={ratio('p99_ttft_ms', idle):.2f}",
        "priority_urgent_ttft_p50_loaded_over_idle_after="
        f"{ratio('median_ttft_ms', idle_after):.2f}",
        f"priority_urgent_ttft_p99_loaded_over_idle_after={ratio('p99_ttft_ms', idle_after):.2f}",
        f"priority_urgent_ttft_p50_loaded_over_alone={ratio('median_ttft_ms', alone):.2f}",
        f"priority_urgent_ttft_p99_loaded_over_alone={ratio('p99_ttft_ms', alone):.2f}",
        f"urgent_offered_req_s={rate:.3f}",
        f"urgent_load_output_tok_s={result['output_throughput']:.1f}",
    ]


def run_probe(
    a: argparse.Namespace,
    peer: LaunchedPeer,
    tok: object,
    one_by_one: list[str],
    mix: list[str],
    rate: float,
) -> tuple[dict, dict]:
    """The one-at-a-time urgent run inside the mix's priority-1 stream (sent at its own times
    from another thread), started --probe-delay s in so that the load has built up.
    Returns the probe's result (with `span_s`: its start and end, s after the load's) and the
    load's (with `last_send_s`); the probe should end before the load does (`duration`)."""
    background: dict = {}

    def load() -> None:
        background.update(run(peer, tok, mix, rate, None, only_class="batch"))

    thread = threading.Thread(target=load, name="priority-1 load")
    t0 = time.monotonic()
    thread.start()
    time.sleep(a.probe_delay)
    first = time.monotonic() - t0
    probe = run(peer, tok, one_by_one, math.inf, 1)
    probe["span_s"] = (first, time.monotonic() - t0)
    thread.join()
    return probe, background


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
    p.add_argument("--only", default="classes,tenants,urgent", help="which parts to run")
    p.add_argument("--tenant-requests", type=int, default=130, help="requests of the tenant load")
    p.add_argument("--tenants", default="heavy:10,a:1,b:1,c:1")
    p.add_argument("--urgent-share", type=float, default=0.1)
    p.add_argument("--urgent-load", type=float, default=1.5, help="offered load / saturation")
    p.add_argument("--urgent-wait", type=float, help="the priority daemon's --urgent-wait")
    p.add_argument(
        "--probe-delay", type=float, default=3.0, help="s into the load the urgent probe starts"
    )
    p.add_argument(
        "--urgent-profile",
        action="store_true",
        help="profile the priority daemon's steps; print each urgent request's steps",
    )
    a = p.parse_args()
    parts = set(a.only.split(","))
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
    print(
        f"unloaded: TTFT p50 {ttft0:.0f} ms, TPOT p50 {tpot0:.1f} ms; saturation "
        f"{saturation:.2f} req/s ({sat['output_throughput']:.1f} tok/s)"
    )
    figures: list[str] = [f"saturation_req_s={saturation:.3f}"]
    if "classes" in parts:
        figures += run_classes(a, tok, shape, out_dir, unloaded, a.load * saturation)
    if "tenants" in parts:
        figures += run_tenants(a, tok, shape, out_dir)
    if "urgent" in parts:
        figures += run_urgent(a, tok, shape, out_dir, a.urgent_load * saturation)
    # Ratios first, then the absolute figures they come from.
    figures.sort(key=lambda f: ("ratio" not in f and "over" not in f and "jain" not in f, f))
    print("RESULT " + " ".join(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
