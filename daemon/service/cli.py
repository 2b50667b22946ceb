"""The `headrace` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from daemon.service.serve_config import add_serve_arguments, build_serve_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser(
        "simulate",
        help="replay a trace through the real scheduler against a step-cost model",
        description="Replay a JSON-lines trace through the real Scheduler and KV cache "
        "manager, timing steps with a cost model instead of a model.",
    )
    sim.add_argument("--policy", default="fcfs", help="scheduling policy (entry-point name)")
    sim.add_argument(
        "--tenant-weights",
        metavar="TENANT=WEIGHT,...",
        help="fair: each tenant's share (a trace line's `tenant`; synthetic traces: the class)",
    )
    sim.add_argument("--trace", help="trace file (JSON lines) to replay")
    sim.add_argument("--make-trace", metavar="OUT", help="write a synthetic trace to OUT and exit")
    sim.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        metavar="SPEC",
        help="with --make-trace: NAME:RATE:PROMPT_LEN:OUTPUT_LEN[:PRIORITY[:TTFT_MS[:TPOT_MS]]]"
        " (repeatable; each class is a Poisson stream)",
    )
    sim.add_argument("--duration", type=float, default=60.0, help="trace length in seconds")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sim.add_argument("--max-num-seqs", type=int, default=64)
    sim.add_argument("--long-prefill-token-threshold", type=int, default=0)
    sim.add_argument("--num-blocks", type=int, default=8192)
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument(
        "--cost",
        default="",
        metavar="BASE,PREFILL,DECODE,CONTEXT",
        help="step cost in seconds: base + per prefill token + per decode token + per context "
        "token (default: a small model on one GPU)",
    )
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP/SSE daemon",
        description="Serve a model over HTTP (TCP and/or a Unix socket) with the "
        "OpenAI-compatible API. Options come from flags, then HEADRACE_* environment "
        "variables, then a TOML file (--config), then defaults.",
    )
    add_serve_arguments(serve)
    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt, offline, and print it as it streams",
        description="Load the model (the embedded SmolLM2-135M-Instruct by default) and "
        "generate a completion for PROMPT. Nothing is downloaded.",
    )
    gen.add_argument("prompt")
    gen.add_argument("--model", help="GGUF file or HF directory (default: embedded SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--threads", type=int, help="torch intra-op threads (default: all cores)")
    gen.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    gen.add_argument("--quantization", default="auto", help="none, int8 or auto")
    gen.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is split across (worker processes + this one)",
    )
    gen.add_argument(
        "--raw", action="store_true", help="send PROMPT as is, without the chat template"
    )
    pd = sub.add_parser(
        "pd-front",
        help="prefill/decode front door: the prompt to a producer, the stream from a consumer",
        description="Relay each completion to a producer instance (--kv-connector peer "
        "--kv-role producer) with max_tokens 1, then to a consumer instance (--kv-role "
        "consumer), which pulls the prompt's KV from the producer and streams the answer.",
    )
    pd.add_argument("--producer", required=True, help="http://host:port or unix:/path.sock")
    pd.add_argument("--consumer", required=True, help="http://host:port or unix:/path.sock")
    pd.add_argument("--host", default="127.0.0.1")
    pd.add_argument("--port", type=int, default=8000)
    pd.add_argument("--uds", help="listen on this Unix socket instead of TCP")
    from daemon.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from daemon.engine.config import EngineConfig
    from daemon.engine.engine import Engine

    engine = Engine(
        EngineConfig(
            model=args.model,
            threads=args.threads,
            dtype=args.dtype,
            quantization=args.quantization,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    )
    try:
        return _generate(engine, args)
    finally:
        engine.close()  # the tensor-parallel workers


def _generate(engine, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    from scheduling import SamplingParams

    prompt = args.prompt
    template = getattr(engine.tokenizer, "chat_template", None)
    if not args.raw and template:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            print(delta.text, end="", flush=True)
    print()
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    from plugins import load_policy
    from scheduling.config import SchedulerConfig
    from scheduling.cost_model import StepCostModel
    from scheduling.policies.fair import parse_tenant_weights
    from scheduling.simulator import simulate
    from scheduling.trace import TraceClass, dump_trace, load_trace, make_trace

    if args.make_trace:
        if not args.classes:
            raise ValueError("--make-trace needs at least one --class")
        trace = make_trace([TraceClass.parse(c) for c in args.classes], args.duration, args.seed)
        dump_trace(trace, args.make_trace)
        print(f"wrote {len(trace)} requests to {args.make_trace}")
        return 0
    if not args.trace:
        raise ValueError("simulate needs --trace FILE (or --make-trace OUT)")
    if args.tenant_weights and args.policy != "fair":
        raise ValueError("--tenant-weights: only the fair policy has them")
    weights = parse_tenant_weights(args.tenant_weights)
    policy = load_policy(args.policy, **({"weights": weights} if weights else {}))
    cost = StepCostModel(*map(float, args.cost.split(","))) if args.cost else StepCostModel()
    config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=args.num_blocks * args.block_size,
    )
    result = simulate(
        load_trace(args.trace),
        policy,
        cost,
        config,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
    )
    print(result.report(f"policy={args.policy} "))
    print(result.result_line())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "simulate":
            return run_simulate(args)
        if args.command == "generate":
            return run_generate(args)
        if args.command == "bench":
            from daemon.bench.cli import run_bench

            return run_bench(args)
        if args.command == "pd-front":
            from daemon.service.pd_front import run as run_front

            run_front(args.producer, args.consumer, args.host, args.port, args.uds)
            return 0
        if args.command == "serve":
            from daemon.service.server import run

            return run(build_serve_config(args))
    except (ValueError, LookupError, OSError) as e:
        print(f"headrace: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
