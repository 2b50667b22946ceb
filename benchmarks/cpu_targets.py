"""Issue 26's CPU targets on this machine in one run, each against its peer side by side.

    python benchmarks/cpu_targets.py [--rounds 2] [--vllm auto] [--headrace-args "..."]
        [--only vllm_c1,chat,...] [--result-dir bench-results/cpu-targets]

Each check is a `headrace bench sweep` that serves one engine at a time, the rounds taking
turns (so a slow spell of the machine lands on both sides of a ratio), plus
step_profile.py for the batch-1 step. The peers come from benchmarks/peers/setup_*.sh.

| check | workload | goal |
|---|---|---|
| vllm_c1, vllm_c8, vllm_c32 | 128 tokens in, 64 out (EOS ignored), c=1/8/32 | >= 1.5x vLLM |
| chat | chat_workload.py's 48 prompts of varied lengths, c=8 | >= 1.2x vLLM |
| llama_c1 | one stream, 128 in, 64 out | >= 1.2x llama-server |
| bs1_roofline | step_profile.py's batch-1 decode step | >= 50% of the roofline |

vLLM runs in its fastest dtype here (`--vllm auto`): bf16 where the CPU has AVX512-BF16,
fp32 where it does not. A figure is the median of the rounds' paired ratios; the table also
gives each round's. Only ratios count: this machine's speed drifts over an hour.

Beside each throughput ratio the table gives the peer's TPOT over headrace's (decode steps
alone) and the requests each side failed: a peer that drops requests (llama-server dropped
about one in eight at c=1 here) loses their tokens from its rate, which the ratio alone hides.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from machine import cpu_description

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["--input-len", "128", "--output-len", "64", "--ignore-eos", "--num-prompts", "8"]


@dataclass(frozen=True)
class Check:
    """One target: the sweep that measures it and the ratio it must reach."""

    name: str
    peer: str  # "vllm" (resolved by --vllm) or a bench peer name
    level: int  # the concurrency whose ratio counts
    goal: float
    sweep: tuple[str, ...]  # the sweep's workload arguments


def checks(chat_file: Path) -> list[Check]:
    sweep_short = ("--concurrency", "1", "8", "32", *SHORT)
    chat = ("--concurrency", "8", "--api", "chat", "--workload", "jsonl", "--dataset-path",
            str(chat_file), "--num-prompts", "48")  # fmt: skip
    return [
        Check("vllm_c1", "vllm", 1, 1.5, sweep_short),
        Check("vllm_c8", "vllm", 8, 1.5, sweep_short),
        Check("vllm_c32", "vllm", 32, 1.5, sweep_short),
        Check("chat", "vllm", 8, 1.2, chat),
        Check("llama_c1", "llama-server", 1, 1.2, ("--concurrency", "1", *SHORT)),
    ]


def vllm_peer(choice: str) -> str:
    """vLLM's fastest dtype here: bf16 needs AVX512-BF16 (without it vLLM emulates bf16)."""
    if choice != "auto":
        return choice
    flags = Path("/proc/cpuinfo").read_text().split()
    return "vllm-cpu-bf16" if "avx512_bf16" in flags else "vllm-cpu"


def headrace_args(extra: str) -> str:
    """`extra` plus the KV cache vLLM gets (benchmarks/peers/run_vllm_cpu.sh gives it
    VLLM_CPU_KVCACHE_SPACE, 2 GiB unless set), unless `extra` sizes it.

    NOTE: headrace's own default on the CPU is at most 1 GiB. In fp32 (the AVX2 stand-in)
    that holds 23,296 tokens, and the chat workload's first round leaves ~43,000: its warm
    round found nothing cached (TTFT p50 1.9 s against vLLM's 0.47 s) and read 0.97x vLLM,
    which held every prompt in its 2 GiB. A side-by-side run gives both the same bytes.
    """
    if "--kv-cache-memory" in extra:
        return extra
    gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    return f"{extra} --kv-cache-memory {int(gib * (1 << 30))}".strip()


def run_sweep(peer: str, sweep: tuple[str, ...], args: argparse.Namespace, out: Path) -> dict:
    """Serve headrace and `peer` in turns over the workload; the sweep's JSON (or {} on failure)."""
    cmd = [sys.executable, "-m", "daemon.service.cli", "bench", "sweep",
           "--peers", f"headrace,{peer}", "--rounds", str(args.rounds),
           "--result-dir", str(out), *sweep]  # fmt: skip
    cmd += ["--headrace-args", headrace_args(args.headrace_args)]
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, check=False)
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("|", "["))))
    path = out / "sweep.json"
    if done.returncode != 0 or not path.exists():
        print(done.stderr[-2000:], file=sys.stderr)
        return {}
    return json.loads(path.read_text())


def round_ratios(sweep: dict, peer: str, level: int) -> list[float]:
    """headrace's output rate over the peer's at `level`, round by round ([] if either is
    missing: a peer that was not set up or failed to start)."""
    series = sweep.get("series", {})
    if "headrace" not in series or peer not in series:
        return []
    ours = next((p for p in series["headrace"] if p["level"] == level), None)
    theirs = next((p for p in series[peer] if p["level"] == level), None)
    if ours is None or theirs is None:
        return []
    # A one-round sweep keeps no per-round list: its one rate is the round.
    a, b = (p.get("round_tputs", [p["output_throughput"]]) for p in (ours, theirs))
    return [x / y for x, y in zip(a, b, strict=True) if y]


def side_by_side(sweep: dict, peer: str, level: int) -> str:
    """The peer's TPOT p50 over headrace's at `level` (the sweep's median round) and each
    side's failed requests over all rounds, for the table; "-" where either is missing."""
    series = sweep.get("series", {})
    points = [next((p for p in series.get(name, []) if p["level"] == level), None)
              for name in ("headrace", peer)]  # fmt: skip
    if None in points:
        return "- | -"
    ours, theirs = points
    tpot = f"{theirs['median_tpot_ms'] / ours['median_tpot_ms']:.2f}x"
    return f"{tpot} | {ours.get('failed', 0)} / {theirs.get('failed', 0)}"


def step_roofline(args: argparse.Namespace) -> float | None:
    """step_profile.py's batch-1 step as a fraction of its memory roofline."""
    dtype = re.search(r"--dtype[ =](\S+)", args.headrace_args)
    cmd = [sys.executable, "benchmarks/step_profile.py", "--batch", "1"]
    cmd += ["--dtype", dtype.group(1)] if dtype else []
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, check=False)
    found = re.search(r"bs1_roofline_frac=([0-9.]+)", done.stdout)
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("batch", " "))))
    return float(found.group(1)) if found else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vllm", default="auto", help="auto, vllm-cpu (fp32) or vllm-cpu-bf16")
    p.add_argument("--headrace-args", default="", help="extra `headrace serve` flags")
    p.add_argument("--only", default="", help="comma list of checks (default: all)")
    p.add_argument("--result-dir", default="bench-results/cpu-targets")
    args = p.parse_args()
    print(cpu_description(), flush=True)
    out = ROOT / args.result_dir
    out.mkdir(parents=True, exist_ok=True)
    chat_file = out / "chat.jsonl"
    with chat_file.open("w") as f:
        subprocess.run([sys.executable, "benchmarks/chat_workload.py"], cwd=ROOT, check=True,
                       stdout=f)  # fmt: skip
    wanted = set(filter(None, args.only.split(",")))
    vllm = vllm_peer(args.vllm)
    rows: list[tuple[str, str, float, list[float], str]] = []
    sweeps: dict[tuple[str, tuple[str, ...]], dict] = {}
    for check in checks(chat_file):
        if wanted and check.name not in wanted:
            continue
        peer = vllm if check.peer == "vllm" else check.peer
        key = (peer, check.sweep)
        if key not in sweeps:  # c=1, 8 and 32 against vLLM are one sweep
            sweeps[key] = run_sweep(peer, check.sweep, args, out / f"{check.name}-{peer}")
        rows.append((check.name, f">= {check.goal}x {peer}", check.goal,
                     round_ratios(sweeps[key], peer, check.level),
                     side_by_side(sweeps[key], peer, check.level)))  # fmt: skip
    if not wanted or "bs1_roofline" in wanted:
        frac = step_roofline(args)
        rows.append(("bs1_roofline", ">= 50% of the roofline", 0.5, [frac] if frac else [],
                     "- | -"))  # fmt: skip
    print("\n| check | goal | by round | median | met | peer TPOT / ours | failed (ours / peer) |"
          "\n|---|---|---|---|---|---|---|")  # fmt: skip
    figures, met = [], 0
    for name, goal_text, goal, ratios, beside in rows:
        if not ratios:
            print(f"| {name} | {goal_text} | not measured (peer not set up?) | - | no | {beside} |")
            continue
        median = statistics.median(ratios)
        met += median >= goal
        by_round = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"| {name} | {goal_text} | {by_round} | **{median:.2f}** | "
              f"{'yes' if median >= goal else 'NO'} | {beside} |")  # fmt: skip
        figures.append(f"{name}={median:.3f}")
    print(f"RESULT {' '.join(figures)} met={met}/{len(rows)} vllm={vllm}")
    return 0 if met == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
