"""JSON-Schema coverage under strict: compiled, refused (by keyword), leaks, compile time.

    python benchmarks/grammar_coverage.py [--walks 4] [--max-tokens 96]   (~1 min, 2 cores)

Over the collection in benchmarks/data/schemas.py (written for headrace: API payloads,
OpenAPI components, configs, tool parameters; nothing is downloaded) plus the tests' schema
corpus (tests/schema_corpus/), side by side:
- xgrammar alone: the schema as sent to xgrammar's own converter;
- headrace: the schema through grammars/schema/ (normalised, or refused naming a keyword).
Each compiled grammar is walked at random (a random model: any allowed token, stopping where
allowed) and every finished output is validated with jsonschema; an output that fails is a
leak. Compile time is normalisation plus xgrammar's compile, cold (no cache).
Ends with `RESULT refused_share=... leaks=... compile_p99_ms=...`.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import time
from pathlib import Path

import xgrammar as xgr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "data"))

from schemas import SCHEMAS  # noqa: E402

from grammars import GrammarCompiler, GrammarError, GrammarSpec  # noqa: E402
from grammars.schema.validation import output_errors  # noqa: E402
from runner.model_source import resolve_model  # noqa: E402
from runner.tokenizer import load_tokenizer  # noqa: E402
from tests.schema_corpus import CASES  # noqa: E402
from tests.schema_corpus.walk import STOP, VOCAB, random_walk  # noqa: E402


def leaks_of(compiled, schema, tokenizer, rng, walks: int, max_tokens: int) -> tuple[int, int]:
    """(outputs validated, outputs that failed validation)."""
    validated = leaks = 0
    for _ in range(walks):
        text = random_walk(compiled, tokenizer, rng, max_tokens)
        if text is None:
            continue
        validated += 1
        try:
            leaks += bool(output_errors(schema, json.loads(text)))
        except ValueError:
            leaks += 1
    return validated, leaks


def run(name: str, schemas: dict[str, dict], compile_one, tokenizer, args) -> dict:
    rng = random.Random(0)
    refused: collections.Counter[str] = collections.Counter()
    times, validated, leaks, leaked = [], 0, 0, []
    for key, schema in schemas.items():
        start = time.perf_counter()
        try:
            compiled = compile_one(schema)
        except (GrammarError, RuntimeError, ValueError) as e:
            refused[_keyword(str(e))] += 1
            continue
        times.append(time.perf_counter() - start)
        v, bad = leaks_of(compiled, schema, tokenizer, rng, args.walks, args.max_tokens)
        validated, leaks = validated + v, leaks + bad
        if bad:
            leaked.append(key)
    times.sort()
    return {
        "name": name,
        "compiled": len(times),
        "refused": sum(refused.values()),
        "by_keyword": dict(refused.most_common()),
        "validated": validated,
        "leaks": leaks,
        "leaked": leaked,
        "p50_ms": 1000 * statistics.median(times),
        "p99_ms": 1000 * times[min(len(times) - 1, int(0.99 * len(times)))],
    }


def _keyword(message: str) -> str:
    """The keyword a refusal names (`#/a/b/keyword: why`), else the compiler's complaint."""
    head = message.split(": ", 2)
    for part in head:
        if part.startswith("#"):
            return part.rsplit("/", 1)[-1] or "(unsatisfiable)"
    return "xgrammar: " + message.splitlines()[0][-50:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=4, help="random outputs per schema")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--no-corpus", action="store_true", help="the collection only")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the xgrammar-alone column (slow)"
    )
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model(None))
    schemas = dict(SCHEMAS)
    if not args.no_corpus:
        schemas.update({f"corpus/{c.name}": c.schema for c in CASES})

    compiler = GrammarCompiler(tokenizer, VOCAB, [STOP], cache_bytes=0)
    # The workers start with the daemon, not per request: keep their start out of the
    # compile times.
    compiler.compile(GrammarSpec("json"))

    def ours(schema):
        # Every schema differs from the one before: each compile is cold.
        return compiler.compile(GrammarSpec.json_schema(schema))

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[STOP])
    raw_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def raw(schema):
        return raw_compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    rows = [] if args.no_baseline else [run("xgrammar alone", schemas, raw, tokenizer, args)]
    rows.append(run("headrace", schemas, ours, tokenizer, args))
    total = len(schemas)
    print(f"{len(SCHEMAS)} collection schemas, {total - len(SCHEMAS)} corpus cases")
    print(f"{'':16s} {'compiled':>8s} {'refused':>8s} {'validated':>9s} {'leaks':>6s} "
          f"{'p50 ms':>7s} {'p99 ms':>7s}")  # fmt: skip
    for r in rows:
        print(f"{r['name']:16s} {r['compiled']:8d} {r['refused']:8d} {r['validated']:9d} "
              f"{r['leaks']:6d} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f}")  # fmt: skip
    for r in rows:
        print(f"{r['name']}: refused by keyword {r['by_keyword']}; leaked in {r['leaked']}")
    compiler.shutdown()
    ours_row = rows[-1]
    refused_real = sum(_refused(schema) for schema in SCHEMAS.values())
    share = refused_real / len(SCHEMAS)
    print(f"collection only (the corpus refuses on purpose): {refused_real}/{len(SCHEMAS)} refused")
    print(
        f"RESULT refused_share={share:.3f} leaks={ours_row['leaks']} "
        f"compile_p99_ms={ours_row['p99_ms']:.1f} compile_p50_ms={ours_row['p50_ms']:.1f} "
        f"validated={ours_row['validated']} compiled={ours_row['compiled']}"
        + ("" if args.no_baseline else f" xgrammar_alone_leaks={rows[0]['leaks']}")
    )


def _refused(schema) -> bool:
    try:
        GrammarSpec.json_schema(schema)
    except GrammarError:
        return True
    return False


if __name__ == "__main__":
    main()
