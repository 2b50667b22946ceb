"""Speculative decoding (n-gram prompt lookup) on the embedded model: speed and acceptance.

    python benchmarks/specdec.py [--threads N] [--k 4] [--quick]

Two workloads of chat prompts to SmolLM2-135M-Instruct, greedy:
- copy: repeat or lightly edit a given paragraph or code block (the output echoes the prompt);
- open: open-ended writing (little to copy).
Each runs at concurrency 1 (requests one after another) and 16 (all at once), with
speculation off and with `--speculative-method ngram`, side by side in the same process.
Decode tokens/s is per request: the tokens after its first one over the time from its
first token to its last, averaged over requests (what a client sees); `agg x` is the ratio
of whole-wave throughput, which at concurrency 16 the slowest request bounds. Greedy
outputs must be identical with and without speculation (the script checks). It also
times the proposer against whole decode steps at batch 32.
The last line is `RESULT key=value ...`, ratios first.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from dataclasses import dataclass, field

import torch

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from scheduling import SamplingParams

PARAGRAPHS = [
    "The river rose slowly through the night, and by morning the low fields behind the mill "
    "were a single sheet of brown water. The miller's daughter walked the dyke at dawn, "
    "counting the fence posts that still showed above the flood, and wrote the number in "
    "the ledger beside the date, as her grandmother had done in every wet year before her.",
    "A good bug report says what you did, what you expected, and what happened instead. It "
    "names the version, the operating system and the exact command. It leaves out guesses "
    "about the cause unless they are marked as guesses, and it attaches the smallest input "
    "that still shows the problem, so that whoever reads it can reproduce it in a minute.",
    "Bread needs four things: flour, water, salt and time. Mix the flour and water and let "
    "them rest for half an hour before adding the salt and the yeast. Fold the dough every "
    "thirty minutes for two hours, shape it gently, and let it rise overnight in a cold "
    "room. Bake it in a very hot oven with steam for the first twenty minutes.",
    "The committee met on Tuesday to review the budget for the new library wing. Members "
    "agreed to postpone the decision on the roof until the second survey is complete, to "
    "approve the purchase of shelving for the reading room, and to ask the architect for a "
    "revised plan of the entrance that keeps the old stone arch in place.",
]
CODE = [
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    out = []\n"
    "    total = 0.0\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            out.append(total / window)\n"
    "    return out\n",
    "class Counter:\n"
    "    def __init__(self):\n"
    "        self.counts = {}\n"
    "\n"
    "    def add(self, key):\n"
    "        self.counts[key] = self.counts.get(key, 0) + 1\n"
    "\n"
    "    def most_common(self, n):\n"
    "        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)\n"
    "        return items[:n]\n",
    "function parseQuery(query) {\n"
    "  const result = {};\n"
    "  for (const part of query.replace(/^\\?/, '').split('&')) {\n"
    "    if (!part) continue;\n"
    "    const [key, value = ''] = part.split('=');\n"
    "    result[decodeURIComponent(key)] = decodeURIComponent(value);\n"
    "  }\n"
    "  return result;\n"
    "}\n",
    "SELECT customers.name, COUNT(orders.id) AS order_count\n"
    "FROM customers\n"
    "LEFT JOIN orders ON orders.customer_id = customers.id\n"
    "WHERE customers.created_at >= '2024-01-01'\n"
    "GROUP BY customers.name\n"
    "HAVING COUNT(orders.id) > 2\n"
    "ORDER BY order_count DESC;\n",
]
COPY_INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy this text back to me unchanged, then stop:\n\n{}",
]
CODE_INSTRUCTIONS = [
    "Repeat this code exactly:\n\n```\n{}```",
    "Add a short comment line at the top of this code and return the whole code:\n\n```\n{}```",
]
TOPICS = [
    "a lighthouse keeper who finds a message in a bottle",
    "why the sky is blue",
    "a robot learning to paint",
    "the history of the bicycle",
    "a city built on the back of a giant turtle",
    "how vaccines train the immune system",
    "a chess game between two old friends",
    "what makes a good teacher",
    "a journey across a desert at night",
    "how bees communicate",
    "a dragon who is afraid of fire",
    "the first day at a new school",
    "how a compiler works",
    "a village where it always snows",
    "the life of a tree over a hundred years",
    "a detective who solves crimes with smells",
]


def copy_prompts() -> list[str]:
    out = [i.format(p) for p in PARAGRAPHS for i in COPY_INSTRUCTIONS]
    out += [i.format(c) for c in CODE for i in CODE_INSTRUCTIONS]
    return out  # 16


def open_prompts() -> list[str]:
    return [
        f"Write a story about {t}." if i % 2 == 0 else f"Explain {t} in a few paragraphs."
        for i, t in enumerate(TOPICS)
    ]


@dataclass
class Run:
    decode_tokens: int = 0
    decode_time: float = 0.0
    # Each request's own decode rate, (tokens - 1) / (last token - first token).
    per_request: list[float] = field(default_factory=list)
    outputs: list[list[int]] | None = None
    proposed: int = 0
    verified: int = 0
    accepted: int = 0
    verify_steps: int = 0
    steps: int = 0

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else 0.0

    @property
    def per_request_tok_s(self) -> float:
        return sum(self.per_request) / len(self.per_request) if self.per_request else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0


def chat_ids(loaded: LoadedModel, text: str) -> list[int]:
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return loaded.tokenizer.encode(prompt)


def run_wave(engine: Engine, prompts: list[list[int]], max_tokens: int, into: Run) -> None:
    """Run `prompts` together to the end; decode time is first token -> last token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    stats = engine.scheduler.spec_stats
    before = (stats.num_proposed, stats.num_verified, stats.num_accepted, stats.num_verify_steps)
    rids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished_requests():
        deltas = engine.step()
        into.steps += 1
        now = time.perf_counter()
        for d in deltas:
            if d.new_token_ids:
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                tokens[d.request_id] += d.new_token_ids
    engine.release_finished()
    into.decode_tokens += sum(len(t) - 1 for t in tokens.values())
    into.per_request += [
        (len(tokens[r]) - 1) / (last[r] - first[r]) for r in rids if last[r] > first[r]
    ]
    into.decode_time += max(last.values()) - min(first.values())
    into.outputs += [tokens[rid] for rid in rids]  # type: ignore[operator]
    into.proposed += stats.num_proposed - before[0]
    into.verified += stats.num_verified - before[1]
    into.accepted += stats.num_accepted - before[2]
    into.verify_steps += stats.num_verify_steps - before[3]


def run_pair(
    engines: dict[str, Engine], prompts: list[list[int]], concurrency: int, max_tokens: int
) -> tuple[Run, Run]:
    """Waves of `concurrency` requests, each run without and then with speculation, so the
    two sides see the same moments of a shared machine."""
    off, on = Run(outputs=[]), Run(outputs=[])
    for w in range(0, len(prompts), concurrency):
        wave = prompts[w : w + concurrency]
        run_wave(engines["off"], wave, max_tokens, off)
        run_wave(engines["ngram"], wave, max_tokens, on)
    return off, on


def proposer_cost(engine: Engine, prompts: list[list[int]], steps: int = 30) -> tuple[float, float]:
    """(proposer ms per step, whole step ms) over `steps` decode steps at len(prompts)."""
    proposer = engine.runner.proposer
    spent = [0.0]
    original = proposer.propose

    def timed(requests):
        t = time.perf_counter()
        out = original(requests)
        spent[0] += time.perf_counter() - t
        return out

    proposer.propose = timed
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # prefill
    spent[0] = 0.0
    t = time.perf_counter()
    n = 0
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    elapsed = time.perf_counter() - t
    engine.release_finished()
    proposer.propose = original
    return spent[0] / n * 1000, elapsed / n * 1000


def cpu_info() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    keep = ("Model name", "CPU(s):", "Thread(s) per core", "Flags")
    return "\n".join(line for line in out.splitlines() if line.startswith(keep))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--serial", type=int, default=4, help="requests run one by one at c=1")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.serial = 64, 2
    print(cpu_info())
    loaded = LoadedModel.load(EngineConfig(device="cpu"))
    common = dict(threads=args.threads, kv_cache_memory=512 << 20, enable_prefix_caching=False)
    engines = {
        "off": Engine(EngineConfig(**common), loaded),  # type: ignore[arg-type]
        "ngram": Engine(
            EngineConfig(speculative_method="ngram", num_speculative_tokens=args.k, **common),  # type: ignore[arg-type]
            loaded,
        ),
    }
    workloads = {
        "copy": [chat_ids(loaded, p) for p in copy_prompts()],
        "open": [chat_ids(loaded, p) for p in open_prompts()],
    }
    for e in engines.values():  # warm-up
        e.generate(workloads["open"][:2], SamplingParams(max_tokens=4, temperature=0))
    print(f"\nthreads={torch.get_num_threads()} k={args.k} max_tokens={args.max_tokens}")
    print(f"{'workload':8} {'conc':>4} {'off tok/s':>10} {'ngram tok/s':>12} {'speed-up':>9} "
          f"{'agg x':>6} {'accept':>7} {'acc.len':>7} {'identical':>9}")  # fmt: skip
    figures: dict[str, float] = {}
    identical = True
    for name, prompts in workloads.items():
        for conc in (1, 16):
            batch = prompts[: args.serial] if conc == 1 else prompts[:16]
            off, on = run_pair(engines, batch, conc, args.max_tokens)
            same = off.outputs == on.outputs
            identical &= same
            speedup = on.per_request_tok_s / off.per_request_tok_s
            agg = on.tok_s / off.tok_s
            acc_len = 1 + on.accepted / on.verify_steps if on.verify_steps else 1.0
            key = f"{name}_c{conc}"
            figures[f"{key}_speedup"] = speedup
            figures[f"{key}_agg_speedup"] = agg
            figures[f"{key}_acceptance"] = on.acceptance
            figures[f"{key}_accepted_length"] = acc_len
            figures[f"{key}_off_tok_s"] = off.per_request_tok_s
            figures[f"{key}_ngram_tok_s"] = on.per_request_tok_s
            print(f"{name:8} {conc:>4} {off.per_request_tok_s:>10.1f} "
                  f"{on.per_request_tok_s:>12.1f} {speedup:>8.2f}x {agg:>5.2f}x "
                  f"{on.acceptance:>7.2f} {acc_len:>7.2f} {same!s:>9}")  # fmt: skip
    cost_ms, step_ms = proposer_cost(engines["ngram"], (workloads["copy"] * 2)[:32])
    print(f"\nngram proposer at batch 32: {cost_ms:.2f} ms per step of {step_ms:.1f} ms "
          f"({100 * cost_ms / step_ms:.1f}%)")  # fmt: skip
    print(
        "RESULT "
        f"copy_c1_speedup={figures['copy_c1_speedup']:.2f} "
        f"copy_c16_speedup={figures['copy_c16_speedup']:.2f} "
        f"open_c1_speedup={figures['open_c1_speedup']:.2f} "
        f"open_c16_speedup={figures['open_c16_speedup']:.2f} "
        f"copy_c16_agg_speedup={figures['copy_c16_agg_speedup']:.2f} "
        f"open_c16_agg_speedup={figures['open_c16_agg_speedup']:.2f} "
        f"copy_c1_acceptance={figures['copy_c1_acceptance']:.2f} "
        f"copy_c1_accepted_length={figures['copy_c1_accepted_length']:.2f} "
        f"open_c1_acceptance={figures['open_c1_acceptance']:.2f} "
        f"ngram_cost_pct_b32={100 * cost_ms / step_ms:.2f} "
        f"copy_c1_ngram_tok_s={figures['copy_c1_ngram_tok_s']:.1f} "
        f"copy_c1_off_tok_s={figures['copy_c1_off_tok_s']:.1f} "
        f"greedy_identical={str(identical).lower()}"
    )


if __name__ == "__main__":
    main()
