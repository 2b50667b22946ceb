"""Structured-output overhead: 32 JSON-schema requests vs 32 unconstrained, side by side.

    python benchmarks/grammar_overhead.py [--threads N] [--requests 32] [--rounds 2]

Same model (the embedded SmolLM2-135M-Instruct, fp32), same prompts, same lengths: each
round first runs the constrained requests (temperature 0.7, a records schema of ~60-90
tokens), then the same prompts unconstrained with `ignore_eos` and max_tokens set to the
length each constrained output had. Output tokens/s of both; the target is constrained
within 10% of unconstrained. Then grammar compile time p50/p99 over the test suite's schema
set (tests/structured_cases.py), cold (fresh compiler) and cached. Ends with a RESULT line.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from structured_cases import ARITHMETIC, REGEXES, SCHEMAS, SQL

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from grammars import GrammarCompiler, GrammarSpec
from scheduling import SamplingParams

RECORDS = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 3,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99},
                    "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
                },
                "required": ["name", "age", "city"],
            },
        }
    },
    "required": ["people"],
}
# Progress shows at once when the output is piped.
print = functools.partial(print, flush=True)
TOPICS = ["a football team", "a book club", "a family", "a startup", "a choir", "a lab"]


def cpu_info() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "lscpu unavailable"
    keep = ("Model name", "CPU(s):", "Thread(s) per core", "Flags")
    lines = [ln for ln in out.splitlines() if ln.startswith(keep)]
    return "\n".join(ln if not ln.startswith("Flags") else ln[:400] + " ..." for ln in lines)


def prompts_for(loaded: LoadedModel, n: int) -> list[list[int]]:
    tok = loaded.tokenizer
    out = []
    for i in range(n):
        msg = [{"role": "user", "content": f"List three members of {TOPICS[i % len(TOPICS)]}."}]
        text = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
        out.append(tok.encode(text))
    return out


def timed(engine: Engine, prompts, params, grammars=None) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = engine.generate(prompts, params, grammars)
    elapsed = time.perf_counter() - start
    lengths = [len(c.token_ids) for c in out]
    return sum(lengths) / elapsed, lengths


def throughput(loaded: LoadedModel, n: int, rounds: int, threads: int) -> tuple[float, float]:
    engine = Engine(EngineConfig(threads=threads, kv_cache_memory=1 << 30), loaded)
    prompts = prompts_for(loaded, n)
    spec = GrammarSpec.json_schema(RECORDS)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2), [spec, None])  # warm-up, compile
    constrained, plain = [], []
    for r in range(rounds):
        params = [SamplingParams(max_tokens=256, temperature=0.7, seed=r * n + i) for i in range(n)]
        tok_s, lengths = timed(engine, prompts, params, [spec] * n)
        constrained.append(tok_s)
        same = [
            SamplingParams(max_tokens=length, temperature=0.7, seed=i, ignore_eos=True)
            for i, length in enumerate(lengths)
        ]
        plain_tok_s, plain_lengths = timed(engine, prompts, same)
        assert plain_lengths == lengths
        plain.append(plain_tok_s)
        print(
            f"round {r}: constrained {tok_s:7.1f} tok/s, unconstrained {plain_tok_s:7.1f} tok/s "
            f"({sum(lengths)} tokens, {min(lengths)}-{max(lengths)} per request)"
        )
    return statistics.median(constrained), statistics.median(plain)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def compile_times(loaded: LoadedModel) -> tuple[list[float], list[float]]:
    specs = [GrammarSpec.json_schema(s) for s in SCHEMAS]
    specs += [GrammarSpec("regex", r) for r in REGEXES]
    specs += [GrammarSpec("grammar", g) for g in (ARITHMETIC, SQL)]
    vocab = loaded.config.vocab_size
    compiler = GrammarCompiler(loaded.tokenizer, vocab, loaded.config.eos_token_ids)
    # The workers start (import xgrammar, read the vocabulary) with the daemon, not per
    # request: one warm-up compile keeps their start out of the cold figures.
    compiler.compile(GrammarSpec("json"))
    cold, cached = [], []
    for spec in specs:
        t = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - t)
    for spec in specs:
        t = time.perf_counter()
        compiler.compile(spec)
        cached.append(time.perf_counter() - t)
    assert compiler.stats.hits == len(specs)
    compiler.shutdown()
    return cold, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_info())
    loaded = LoadedModel.load(EngineConfig(device="cpu"))
    cold, cached = compile_times(loaded)
    con, plain = throughput(loaded, args.requests, args.rounds, args.threads)
    ratio = con / plain
    ms = {k: 1000 * v for k, v in {
        "cold_p50": percentile(cold, 0.5), "cold_p99": percentile(cold, 0.99),
        "cached_p50": percentile(cached, 0.5), "cached_p99": percentile(cached, 0.99),
    }.items()}  # fmt: skip
    print(f"threads={args.threads} requests={args.requests} rounds={args.rounds} (medians)")
    print(f"constrained   {con:8.1f} output tok/s")
    print(f"unconstrained {plain:8.1f} output tok/s  (constrained/unconstrained {ratio:.3f})")
    print(
        f"compile over {len(cold)} grammars: cold p50 {ms['cold_p50']:.2f} ms, "
        f"p99 {ms['cold_p99']:.2f} ms; cached p50 {ms['cached_p50']:.3f} ms, "
        f"p99 {ms['cached_p99']:.3f} ms"
    )
    print(
        f"RESULT ratio={ratio:.3f} within_10pct={ratio >= 0.9} constrained_tok_s={con:.1f} "
        f"unconstrained_tok_s={plain:.1f} compile_cold_p50_ms={ms['cold_p50']:.2f} "
        f"compile_cold_p99_ms={ms['cold_p99']:.2f} compile_cached_p50_ms={ms['cached_p50']:.3f} "
        f"compile_cached_p99_ms={ms['cached_p99']:.3f} threads={args.threads}"
    )


if __name__ == "__main__":
    main()
