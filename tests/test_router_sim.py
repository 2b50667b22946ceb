"""benchmarks/router_sim.py on a small workload: virtual time, so the figures are exact."""

import sys
from pathlib import Path

from plugins import load_router
from scheduling.routing import RouterContext

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import router_sim

# 4 system prompts of 16 blocks; each replica's pool holds two of them and what is in flight.
WORKLOAD = router_sim.Workload(num_prefixes=4, prefix_len=256, users=8, turns=2, seed=1)
TIGHT = 4 * 16 // 2 + 24


def figures(name: str, num_blocks: int) -> dict[str, float]:
    context = RouterContext(2, router_sim.BLOCK)
    done, makespan = router_sim.run(load_router(name, context), WORKLOAD, 2, num_blocks)
    assert len(done) == WORKLOAD.users * WORKLOAD.turns
    return router_sim.figures(done, makespan)


def test_cache_aware_serves_more_from_cache_and_sooner_than_round_robin():
    ca, rr = figures("cache_aware", TIGHT), figures("round_robin", TIGHT)
    assert ca["cached_share"] > 1.5 * rr["cached_share"]
    assert ca["ttft_p50_ms"] < rr["ttft_p50_ms"]


def test_every_request_finishes_and_the_runs_repeat_exactly():
    assert figures("least_load", TIGHT) == figures("least_load", TIGHT)
