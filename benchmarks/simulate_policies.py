"""Policies side by side in the simulator, on the two shipped traces.

    python benchmarks/simulate_policies.py

1. slo_mixed.jsonl: interactive (TTFT 1 s, TPOT 60 ms) and batch (TTFT 20 s, TPOT 200 ms)
   classes offered at ~1.2x the engine's saturated throughput. Goodput of `slo` vs `fcfs`.
2. priority_burst.jsonl: a saturating stream of priority-1 batch requests and occasional
   priority-0 ones with long prompts. p99 TTFT of the priority-0 requests under load,
   against their TTFT alone on an idle engine, for `priority` and `fcfs`.
3. four tenants (generated): one heavy tenant at 10x the request rate of three light ones,
   all overloaded. For `fair` and `fcfs`: each light tenant's service over its fair share
   while all four are backlogged, Jain's index of the four, the worst service gap between
   two backlogged tenants against VTC's bound 2U, and throughput.
"""

from __future__ import annotations

from pathlib import Path

from plugins import load_policy
from scheduling.config import SchedulerConfig
from scheduling.fairness import ServiceRecorder, jain_index
from scheduling.policies.fair import FairPolicy
from scheduling.simulator import SimResult, percentile, simulate
from scheduling.trace import TraceClass, TraceRequest, load_trace, make_trace

TRACES = Path(__file__).parent / "traces"

# Engine shape of each scenario (the trace is offered against it).
SCENARIOS = {
    "slo_mixed": dict(
        config=dict(max_num_batched_tokens=2048, max_num_seqs=32, max_model_len=4096),
        num_blocks=4096,
    ),
    "priority_burst": dict(
        config=dict(max_num_batched_tokens=4096, max_num_seqs=32, max_model_len=8192),
        num_blocks=4096,
    ),
}


def run(scenario: str, policy: str, trace: list[TraceRequest] | None = None) -> SimResult:
    spec = SCENARIOS[scenario]
    return simulate(
        trace if trace is not None else load_trace(TRACES / f"{scenario}.jsonl"),
        load_policy(policy),
        config=SchedulerConfig(**spec["config"]),
        num_blocks=spec["num_blocks"],
    )


def urgent_ttft_ratio(policy: str) -> tuple[float, float, float]:
    """(p99 TTFT loaded, p99 TTFT idle, p99 of per-request loaded/idle) of priority-0 requests.

    "Idle" replays the same priority-0 requests at the same times with no batch traffic, so
    two urgent requests that arrive together delay each other in both runs alike.
    """
    trace = load_trace(TRACES / "priority_burst.jsonl")
    loaded = run("priority_burst", policy, trace)
    idle = run("priority_burst", policy, [t for t in trace if t.priority == 0])
    ttft_loaded = [r.ttft_s or 0.0 for r in loaded.records if r.priority == 0]
    ttft_idle = [r.ttft_s or 0.0 for r in idle.records]
    ratios = [a / b for a, b in zip(ttft_loaded, ttft_idle)]
    return percentile(ttft_loaded, 99), percentile(ttft_idle, 99), percentile(ratios, 99)


TENANTS = ["heavy", "light0", "light1", "light2"]
TENANT_CONFIG = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, max_model_len=4096)


def four_tenants(policy: str) -> tuple[SimResult, ServiceRecorder]:
    classes = [TraceClass("heavy", 1000, 128, 16)]
    classes += [TraceClass(name, 100, 128, 16) for name in TENANTS[1:]]
    chosen = load_policy(policy)
    # Priced as `fair` prices service; its own instance when it runs (the bound uses its margin).
    recorder = ServiceRecorder(chosen if isinstance(chosen, FairPolicy) else FairPolicy())
    trace = make_trace(classes, 1.5, seed=1)
    return simulate(trace, chosen, config=TENANT_CONFIG, on_step=recorder), recorder


def main() -> None:
    slo = run("slo_mixed", "slo")
    fcfs = run("slo_mixed", "fcfs")
    print("== slo_mixed.jsonl (two SLO classes, ~1.2x saturation)")
    print(slo.report("policy=slo  "))
    print(fcfs.report("policy=fcfs "))
    prio = urgent_ttft_ratio("priority")
    fifo = urgent_ttft_ratio("fcfs")
    print("== priority_burst.jsonl (priority-0 TTFT under a saturating priority-1 stream)")
    for name, (load, idle, ratio) in (("priority", prio), ("fcfs", fifo)):
        print(
            f"  {name:8s} p99 TTFT loaded {load * 1000:8.1f} ms, idle {idle * 1000:6.1f} ms; "
            f"p99 of per-request loaded/idle {ratio:.2f}"
        )
    print("== four tenants (heavy at 10x each light one's rate, all backlogged)")
    tenants = {}
    for name in ("fair", "fcfs"):
        result, rec = four_tenants(name)
        shares = rec.shares(TENANTS)
        tenants[name] = (result, shares)
        print(
            f"  {name:5s} light shares {' '.join(f'{shares[t]:.3f}' for t in TENANTS[1:])} "
            f"(heavy {shares['heavy']:.3f}); Jain {jain_index(list(shares.values())):.3f}; "
            f"worst gap {rec.worst_interval_gap():.0f} vs 2U "
            f"{2 * rec.prices.counter_bound(TENANT_CONFIG):.0f}; "
            f"{result.summary['tok_s']:.0f} tok/s, {result.num_preemptions} preemptions"
        )
    fair_light = min(tenants["fair"][1][t] for t in TENANTS[1:])
    fair_tput = tenants["fair"][0].summary["tok_s"] / tenants["fcfs"][0].summary["tok_s"]
    print(
        f"RESULT goodput_ratio={slo.summary['goodput'] / max(fcfs.summary['goodput'], 1e-9):.3f} "
        f"urgent_ttft_ratio_priority={prio[2]:.3f} urgent_ttft_ratio_fcfs={fifo[2]:.3f} "
        f"fair_min_light_share={fair_light:.3f} fair_over_fcfs_tok_s={fair_tput:.3f} "
        f"goodput_slo={slo.summary['goodput']:.4f} goodput_fcfs={fcfs.summary['goodput']:.4f}"
    )


if __name__ == "__main__":
    main()
