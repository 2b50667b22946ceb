"""Victims' grammar compile latency while one client floods the compilers, and RSS after it.

    python benchmarks/grammar_fairness.py [--victims 30] [--heavy-kb 60] [--heavy-in-flight 4]
                                          [--workers 2] [--cache-mb 64]

A victim client compiles `--victims` distinct small JSON schemas one after another, first
alone (baseline), then while a heavy client keeps `--heavy-in-flight` distinct choice lists of
`--heavy-kb` KB queued at all times (each a new grammar: no cache hits). Prints p50/p99 of
the victim's compile latency (submit to result, queueing included) both ways, how many heavy
grammars compiled, and this process's RSS against the cache budget (grammars are counted by
xgrammar's memory figure). Ends with
`RESULT victim_p99_ratio=<flooded p99 / alone p99> victim_p50_ratio=... rss_mb=... cache_mb=...`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import threading
import time

from grammars import GrammarCompiler, GrammarSpec
from runner.heap import resident_bytes
from runner.model_source import resolve_model
from runner.tokenizer import load_tokenizer


def rss_mb() -> float:
    return resident_bytes() / 2**20


def schema(i: int) -> GrammarSpec:
    props = {f"field_{i}_{j}": {"type": ["string", "integer", "boolean"][j % 3]} for j in range(4)}
    return GrammarSpec.json_schema({"type": "object", "properties": props, "required": [*props]})


def victims(c: GrammarCompiler, n: int, offset: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        c.submit(schema(offset + i), client="victim").result()
        out.append(time.perf_counter() - t)
    return out


def flood(c: GrammarCompiler, kb: int, in_flight: int, stop: threading.Event) -> list[int]:
    rng, done, pending = random.Random(0), [0], []
    while not stop.is_set():
        while len(pending) < in_flight:
            choices = ["".join(rng.choices(string.ascii_letters, k=1000)) for _ in range(kb)]
            pending.append(c.submit(GrammarSpec.choice(choices), client="heavy"))
        pending[0].exception()  # wait for the oldest (errors count as done too)
        pending.pop(0)
        done[0] += 1
    for f in pending:
        c.release(f)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--victims", type=int, default=30)
    ap.add_argument("--heavy-kb", type=int, default=60)
    ap.add_argument("--heavy-in-flight", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cache-mb", type=float, default=64)
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model(None))
    c = GrammarCompiler(tok, 49152, [2], int(args.cache_mb * 2**20), args.workers, 60.0)
    c.compile(GrammarSpec("regex", "warm"))
    rss0 = rss_mb()
    alone = victims(c, args.victims, 0)
    stop = threading.Event()
    result: list[list[int]] = []
    heavy = threading.Thread(
        target=lambda: result.append(flood(c, args.heavy_kb, args.heavy_in_flight, stop))
    )
    heavy.start()
    time.sleep(1.0)  # the flood owns its share of the workers before the victim starts
    flooded = victims(c, args.victims, 10_000)
    stop.set()
    heavy.join()
    rss1 = rss_mb()
    c.shutdown()

    def p(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else xs[0]

    for name, xs in (("alone", alone), ("flooded", flooded)):
        print(f"victim {name:8s} p50 {p(xs, 50) * 1e3:8.1f} ms  p99 {p(xs, 99) * 1e3:8.1f} ms")
    print(f"heavy grammars compiled during the flood: {result[0][0] if result else 0}")
    print(f"RSS {rss0:.0f} -> {rss1:.0f} MiB; cache holds {c.cached_bytes() / 2**20:.1f} MiB")
    print(
        f"RESULT victim_p99_ratio={p(flooded, 99) / p(alone, 99):.2f} "
        f"victim_p50_ratio={p(flooded, 50) / p(alone, 50):.2f} rss_mb={rss1:.0f} "
        f"rss_growth_mb={rss1 - rss0:.0f} cache_mb={args.cache_mb:g}"
    )


if __name__ == "__main__":
    main()
