"""Run the real Scheduler and KVCacheManager against a step-cost model instead of a model.

Time is virtual: each step advances the clock by the cost model's prediction for the
step's shape, so policies can be compared on goodput without hardware.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache import KVCacheManager
from scheduling.config import SchedulerConfig
from scheduling.cost_model import StepCostModel
from scheduling.output import RunnerOutput, SchedulerOutput, StepStats
from scheduling.policy import Policy
from scheduling.request import SLO, Request
from scheduling.sampling_params import SamplingParams
from scheduling.scheduler import Scheduler
from scheduling.trace import TraceRequest


class SimClock:
    """The simulator's virtual clock, handed to the scheduler in place of time.monotonic."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class SimRecord:
    """Outcome of one trace request."""

    cls: str
    priority: int
    slo: SLO | None
    arrival: float
    output_len: int
    finish_reason: str
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    num_preemptions: int

    @property
    def met_slo(self) -> bool:
        if self.finish_reason not in ("stop", "length"):
            return False
        if self.slo is None:
            return True
        ttft_ok = self.slo.ttft_ms is None or (self.ttft_s or 0) * 1000 <= self.slo.ttft_ms
        tpot_ok = self.slo.tpot_ms is None or (self.tpot_s or 0) * 1000 <= self.slo.tpot_ms
        return ttft_ok and tpot_ok


@dataclass(slots=True)
class SimResult:
    """All records of a run, and the summary figures the CLI prints."""

    records: list[SimRecord]
    makespan_s: float
    num_steps: int
    num_preemptions: int
    output_tokens: int = 0
    summary: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ttft = [r.ttft_s for r in self.records if r.ttft_s is not None]
        tpot = [r.tpot_s for r in self.records if r.tpot_s is not None]
        self.summary = {
            "goodput": sum(r.met_slo for r in self.records) / max(1, len(self.records)),
            "tok_s": self.output_tokens / self.makespan_s if self.makespan_s else 0.0,
            "ttft_p50_ms": percentile(ttft, 50) * 1000,
            "ttft_p99_ms": percentile(ttft, 99) * 1000,
            "tpot_p50_ms": percentile(tpot, 50) * 1000,
            "tpot_p99_ms": percentile(tpot, 99) * 1000,
            "rejected": sum(r.finish_reason == "rejected" for r in self.records),
            "preemptions": self.num_preemptions,
        }

    def report(self, label: str = "") -> str:
        s = self.summary
        lines = [
            f"{label}requests={len(self.records)} steps={self.num_steps} "
            f"makespan={self.makespan_s:.2f}s preemptions={self.num_preemptions} "
            f"rejected={s['rejected']:.0f}",
            f"  throughput {s['tok_s']:.1f} output tok/s, goodput {s['goodput']:.3f}",
            f"  TTFT p50 {s['ttft_p50_ms']:.1f} ms  p99 {s['ttft_p99_ms']:.1f} ms",
            f"  TPOT p50 {s['tpot_p50_ms']:.1f} ms  p99 {s['tpot_p99_ms']:.1f} ms",
        ]
        for cls in sorted({r.cls for r in self.records}):
            rs = [r for r in self.records if r.cls == cls]
            ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
            lines.append(
                f"  class {cls or '-'}: n={len(rs)} goodput="
                f"{sum(r.met_slo for r in rs) / len(rs):.3f} "
                f"ttft_p99={percentile(ttft, 99) * 1000:.1f}ms"
            )
        return "\n".join(lines)

    def result_line(self) -> str:
        s = self.summary
        return (
            f"RESULT goodput={s['goodput']:.4f} tok_s={s['tok_s']:.1f} "
            f"ttft_p99_ms={s['ttft_p99_ms']:.1f} tpot_p99_ms={s['tpot_p99_ms']:.1f}"
        )


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile; 0 for an empty list."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, -(-len(ordered) * p // 100) - 1))
    return ordered[int(k)]


def simulate(
    trace: list[TraceRequest],
    policy: Policy,
    cost: StepCostModel | None = None,
    config: SchedulerConfig | None = None,
    num_blocks: int = 8192,
    block_size: int = 16,
    max_steps: int = 10_000_000,
    on_step: Callable[[Scheduler, SchedulerOutput], None] | None = None,
) -> SimResult:
    """Replay `trace` through a real Scheduler; every request ends finished or rejected.

    `on_step(scheduler, output)` sees each non-empty step right after it was scheduled
    (tests read per-step composition and the queues from it).
    """
    cost = cost or StepCostModel()
    clock = SimClock()
    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(config or SchedulerConfig(), kv, policy, clock)
    pending = deque(sorted(enumerate(trace), key=lambda it: it[1].arrival))
    requests: list[tuple[TraceRequest, Request]] = []
    num_steps = output_tokens = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][1].arrival <= clock.now:
            i, t = pending.popleft()
            req = _to_request(i, t)
            requests.append((t, req))
            sched.add_request(req)
        out = sched.schedule()
        if out.is_empty:
            sched.update(out, RunnerOutput())
            if not pending:
                if sched.has_unfinished_requests():
                    raise RuntimeError("simulation stalled: requests left, nothing schedulable")
                break
            clock.now = max(clock.now, pending[0][1].arrival)
            continue
        num_steps += 1
        if on_step is not None:
            on_step(sched, out)
        if num_steps > max_steps:
            raise RuntimeError(f"simulation exceeded {max_steps} steps")
        duration = cost.predict(out.shape)
        clock.now += duration
        # Every request that reached a sampling position samples one (dummy) token.
        sampled = {rid: [1] for rid in out.sampling_req_ids}
        output_tokens += len(sampled)
        sched.update(out, RunnerOutput(sampled))
        sched.observe_step(StepStats(out.shape, duration))
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked after the simulation"
    records = [_record(t, r) for t, r in requests]
    return SimResult(records, clock.now, num_steps, sched.num_preemptions, output_tokens)


def _to_request(index: int, t: TraceRequest) -> Request:
    # Distinct first tokens keep synthetic prompts from sharing cached prefixes.
    prompt = t.prompt_ids or [(index * 7919 + j) % 50_000 + 2 for j in range(t.prompt_len)]
    return Request(
        request_id=f"sim-{index}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=t.output_len, ignore_eos=True),
        arrival_time=t.arrival,
        priority=t.priority,
        slo=t.slo,
        tenant=t.tenant,
    )


def _record(t: TraceRequest, req: Request) -> SimRecord:
    times = req.token_times
    ttft = times[0] - req.arrival_time if times else None
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    e2e = req.finish_time - req.arrival_time if req.finish_time is not None else None
    return SimRecord(
        cls=t.cls,
        priority=t.priority,
        slo=t.slo,
        arrival=t.arrival,
        output_len=t.output_len,
        finish_reason=req.status.finish_reason or "unfinished",
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        num_preemptions=req.num_preemptions,
    )
