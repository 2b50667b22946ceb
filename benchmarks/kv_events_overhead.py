"""What recording KV events costs the KV manager, off vs on, side by side.

    python benchmarks/kv_events_overhead.py [--requests 400] [--rounds 7]

A prefix-cache-heavy loop (shared 128-token prefix, unique 128-token tails, a pool small
enough to evict): look up the cached prefix, allocate, cache the full blocks, free. With
record_events=False the manager uses the plain BlockPool, the code a single engine runs;
with True the recording subclass, plus a drain per request (a replica drains per step).
Rounds alternate off/on; the best of each is reported.
"""

from __future__ import annotations

import argparse
import time

from kvcache import KVCacheManager
from scheduling import Request, SamplingParams


def one_round(record: bool, num_requests: int) -> float:
    params = SamplingParams(max_tokens=1)
    base = list(range(128))
    reqs = [
        Request(f"r{i}", base + [1000 + i * 131 + j for j in range(128)], params, 0.0)
        for i in range(num_requests)
    ]
    kv = KVCacheManager(256, 16, record_events=record)
    start = time.perf_counter()
    for req in reqs:
        hits, num_hit = kv.get_computed_blocks(req)
        kv.allocate_slots(req, req.num_tokens - num_hit, hits)
        req.num_computed_tokens = req.num_tokens
        kv.free(req)
        if record:
            kv.drain_events()
    return (time.perf_counter() - start) / num_requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    best = {False: float("inf"), True: float("inf")}
    for _ in range(args.rounds):
        for record in (False, True):
            best[record] = min(best[record], one_round(record, args.requests))
    off, on = best[False] * 1e6, best[True] * 1e6
    print(f"per request: events off {off:.1f} us, on {on:.1f} us")
    print(f"RESULT on_vs_off={on / off:.3f} off_us={off:.1f} on_us={on:.1f}")


if __name__ == "__main__":
    main()
