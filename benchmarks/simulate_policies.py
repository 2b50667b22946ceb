"""Policies side by side in the simulator, on the two shipped traces.

    python benchmarks/simulate_policies.py

1. slo_mixed.jsonl: interactive (TTFT 1 s, TPOT 60 ms) and batch (TTFT 20 s, TPOT 200 ms)
   classes offered at ~1.2x the engine's saturated throughput. Goodput of `slo` vs `fcfs`.
2. priority_burst.jsonl: a saturating stream of priority-1 batch requests and occasional
   priority-0 ones with long prompts. p99 TTFT of the priority-0 requests under load,
   against their TTFT alone on an idle engine, for `priority` and `fcfs`.
"""

from __future__ import annotations

from pathlib import Path

from plugins import load_policy
from scheduling.config import SchedulerConfig
from scheduling.simulator import SimResult, percentile, simulate
from scheduling.trace import TraceRequest, load_trace

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
    print(
        f"RESULT goodput_ratio={slo.summary['goodput'] / max(fcfs.summary['goodput'], 1e-9):.3f} "
        f"urgent_ttft_ratio_priority={prio[2]:.3f} urgent_ttft_ratio_fcfs={fifo[2]:.3f} "
        f"goodput_slo={slo.summary['goodput']:.4f} goodput_fcfs={fcfs.summary['goodput']:.4f}"
    )


if __name__ == "__main__":
    main()
