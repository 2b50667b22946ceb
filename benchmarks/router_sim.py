"""Data-parallel routers side by side, on simulated replicas (no model).

    python benchmarks/router_sim.py [--replicas 2] [--users 32] [--turns 4]

Each replica is the real Scheduler + KVCacheManager (record_events=True) stepping on the
simulator's cost model (scheduling/cost_model.py); the router sees live queue counts and
each replica's KV events after every step, as the front door would. The workload is
multi-turn chat: users over a few long system prompts, each turn's prompt the whole
history so far, the next turn sent a think time after the answer ends.

Two sizes of KV cache per replica:
1. tight: the system prompts together exceed one replica's cache but fit in two.
   Targets (issue 18): cache_aware vs round_robin cached-token share >= 2x, TTFT p50 <= 0.5x.
2. roomy: every prompt fits everywhere; cache_aware must be no worse on any figure.
"""

from __future__ import annotations

import argparse
import heapq
import random
from dataclasses import dataclass, field, replace

from kvcache import KVCacheManager, prefix_block_hashes
from plugins import load_policy, load_router
from scheduling import Request, RunnerOutput, SamplingParams, Scheduler, SchedulerConfig
from scheduling.cost_model import StepCostModel
from scheduling.output import SchedulerOutput
from scheduling.routing import ReplicaLoad, Router, RouterContext, RouteRequest
from scheduling.simulator import SimClock, percentile

BLOCK = 16
ROUTERS = ("cache_aware", "round_robin", "least_load")


@dataclass(slots=True)
class Workload:
    """Shape of the multi-turn shared-prefix chat workload."""

    num_prefixes: int = 4
    prefix_len: int = 1024
    users: int = 32
    turns: int = 4
    user_msg_len: int = 48
    output_len: int = 24
    # Mean think time between an answer and the next turn, and the users' start spread (s).
    think_s: float = 1.0
    ramp_s: float = 2.0
    seed: int = 0


@dataclass(slots=True)
class Conversation:
    """One user's history; its next prompt is history + a new user message.

    NOTE: its own random stream draws its messages, answers and think times, so every router
    is offered exactly the same conversations whatever order it serves them in.
    """

    user: int
    history: list[int]
    turns_left: int
    rng: random.Random


@dataclass(slots=True)
class SimReplica:
    """A replica: its own scheduler and KV cache, and the step it is running (if any)."""

    load: ReplicaLoad
    sched: Scheduler
    step: SchedulerOutput | None = None
    busy_until: float = 0.0
    owners: dict[str, Conversation] = field(default_factory=dict)

    def refresh(self) -> None:
        self.load.running = len(self.sched.running)
        self.load.waiting = len(self.sched.waiting)
        self.load.kv_usage = self.sched.kv.usage()


def make_replicas(n: int, num_blocks: int, clock: SimClock) -> list[SimReplica]:
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32, max_model_len=4096)
    return [
        SimReplica(
            ReplicaLoad(i, healthy=True),
            Scheduler(
                config,
                KVCacheManager(num_blocks, BLOCK, record_events=True),
                load_policy("fcfs"),
                clock,
            ),
        )
        for i in range(n)
    ]


def run(
    router: Router, w: Workload, num_replicas: int, num_blocks: int
) -> tuple[list[Request], float]:
    """Serve the whole workload; every request served, and the makespan."""
    rng = random.Random(w.seed)  # the system prompts only
    clock = SimClock()
    cost = StepCostModel()
    replicas = make_replicas(num_replicas, num_blocks, clock)
    prefixes = [
        [rng.randrange(2, 50_000) for _ in range(w.prefix_len)] for _ in range(w.num_prefixes)
    ]
    arrivals: list[tuple[float, int, Conversation]] = []
    for u in range(w.users):
        conv = Conversation(
            u, list(prefixes[u % w.num_prefixes]), w.turns, random.Random(f"{w.seed}-{u}")
        )
        heapq.heappush(arrivals, (conv.rng.uniform(0, w.ramp_s), u, conv))
    done: list[Request] = []
    seq = w.users
    while arrivals or any(r.step or r.sched.has_unfinished_requests() for r in replicas):
        busy = [r.busy_until for r in replicas if r.step is not None]
        clock.now = min([*busy, arrivals[0][0]] if arrivals else busy)
        for rep in replicas:
            if rep.step is not None and rep.busy_until <= clock.now:
                for conv, req in finish_step(rep):
                    done.append(req)
                    if conv.turns_left:
                        seq += 1
                        think = conv.rng.expovariate(1 / w.think_s)
                        heapq.heappush(arrivals, (clock.now + think, seq, conv))
                router.on_kv_events(rep.load.index, rep.sched.kv.drain_events())
        while arrivals and arrivals[0][0] <= clock.now:
            _, _, conv = heapq.heappop(arrivals)
            submit(router, replicas, conv, w, clock.now)
        for rep in replicas:
            if rep.step is None and rep.sched.has_unfinished_requests():
                out = rep.sched.schedule()
                if out.is_empty:
                    raise RuntimeError("simulation stalled: a replica cannot schedule")
                rep.step, rep.busy_until = out, clock.now + cost.predict(out.shape)
    return done, clock.now


def submit(
    router: Router,
    replicas: list[SimReplica],
    conv: Conversation,
    w: Workload,
    now: float,
) -> None:
    conv.history += [conv.rng.randrange(2, 50_000) for _ in range(w.user_msg_len)]
    conv.turns_left -= 1
    prompt = list(conv.history)
    for rep in replicas:
        rep.refresh()
    decision = router.pick(
        RouteRequest(prompt, prefix_block_hashes(prompt, BLOCK)), [r.load for r in replicas]
    )
    rep = replicas[decision.index]
    req = Request(
        request_id=f"u{conv.user}-t{w.turns - conv.turns_left}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=w.output_len, ignore_eos=True),
        arrival_time=now,
    )
    rep.sched.add_request(req)
    rep.owners[req.request_id] = conv


def finish_step(rep: SimReplica) -> list[tuple[Conversation, Request]]:
    """Apply the replica's finished step; the conversations whose turn ended."""
    out, rep.step = rep.step, None
    assert out is not None
    live = {rid: rep.sched.requests[rid] for rid in out.num_scheduled_tokens}
    sampled = {
        rid: [rep.owners[rid].rng.randrange(2, 50_000)]
        for rid in out.sampling_req_ids
        if rid in live
    }
    rep.sched.update(out, RunnerOutput(sampled))
    ended = []
    for rid, req in live.items():
        if req.is_finished:
            conv = rep.owners.pop(rid)
            conv.history += req.output_token_ids
            ended.append((conv, req))
    return ended


def figures(done: list[Request], makespan: float) -> dict[str, float]:
    """Cached-token share, TTFT percentiles and throughput over the requests of all seeds."""
    ttft = [r.token_times[0] - r.arrival_time for r in done]
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    return {
        "cached_share": sum(max(0, r.num_cached_tokens) for r in done) / prompt_tokens,
        "ttft_p50_ms": percentile(ttft, 50) * 1000,
        "ttft_p99_ms": percentile(ttft, 99) * 1000,
        "tok_s": sum(r.num_output_tokens for r in done) / makespan,
        "requests": len(done),
    }


def scenario(
    label: str, w: Workload, replicas: int, num_blocks: int, margin: int, seeds: int
) -> dict:
    print(
        f"{label}: {replicas} replicas x {num_blocks} blocks of {BLOCK} "
        f"({w.num_prefixes} prefixes x {w.prefix_len // BLOCK} blocks, {w.users} users x "
        f"{w.turns} turns, {seeds} seeds pooled)"
    )
    results = {}
    for name in ROUTERS:
        context = RouterContext(replicas, BLOCK, overload_margin=margin)
        pooled: list[Request] = []
        makespan = 0.0
        for seed in range(w.seed, w.seed + seeds):
            router = load_router(name, context)
            done, span = run(router, replace(w, seed=seed), replicas, num_blocks)
            pooled += done
            makespan += span
        fig = figures(pooled, makespan)
        results[name] = fig
        print(
            f"  {name:12s} cached {fig['cached_share']:6.1%}  TTFT p50 {fig['ttft_p50_ms']:7.1f} ms"
            f"  p99 {fig['ttft_p99_ms']:7.1f} ms  {fig['tok_s']:7.1f} tok/s"
        )
    return results


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--overload-margin", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--seeds", type=int, default=4, help="workloads drawn and pooled")
    args = ap.parse_args()
    w = Workload(args.prefixes, args.prefix_len, args.users, args.turns, seed=args.seed)
    prefix_blocks = args.prefixes * args.prefix_len // BLOCK
    # Tight: the prefixes need more than one replica's pool, half of them fit with room for
    # the conversations in flight. Roomy: every history fits on every replica.
    tight = prefix_blocks // 2 + 64
    history = args.turns * (w.user_msg_len + w.output_len) // BLOCK + 2
    roomy = 2 * (prefix_blocks + args.users * history)
    a = scenario("tight", w, args.replicas, tight, args.overload_margin, args.seeds)
    b = scenario("roomy", w, args.replicas, roomy, args.overload_margin, args.seeds)
    ca, rr = a["cache_aware"], a["round_robin"]
    cb, rb = b["cache_aware"], b["round_robin"]
    print(
        f"RESULT cached_share_ratio={ratio(ca['cached_share'], rr['cached_share']):.2f} "
        f"ttft_p50_ratio={ratio(ca['ttft_p50_ms'], rr['ttft_p50_ms']):.2f} "
        f"ttft_p99_ratio={ratio(ca['ttft_p99_ms'], rr['ttft_p99_ms']):.2f} "
        f"tok_s_ratio={ratio(ca['tok_s'], rr['tok_s']):.2f} "
        f"roomy_cached_share_ratio={ratio(cb['cached_share'], rb['cached_share']):.2f} "
        f"roomy_ttft_p50_ratio={ratio(cb['ttft_p50_ms'], rb['ttft_p50_ms']):.2f} "
        f"roomy_ttft_p99_ratio={ratio(cb['ttft_p99_ms'], rb['ttft_p99_ms']):.2f} "
        f"roomy_tok_s_ratio={ratio(cb['tok_s'], rb['tok_s']):.2f}"
    )


if __name__ == "__main__":
    main()
