"""Output throughput of a batch spread over N LoRA adapters, against the base model alone.

    python benchmarks/lora.py [--batch 32] [--adapters 1 4 16] [--rank 16] [--max-tokens 64]

On the embedded SmolLM2, random adapters of `--rank` on every projection (q, k, v, o, gate,
up, down) are written in PEFT's format to a temporary directory and served by one Engine
(`--max-loras` = the largest N). Each case runs `--batch` greedy requests together, the
requests dealt round-robin over N adapters (N = 0: the base model through the same engine,
wrappers installed but no adapter in the step); `plain` is the base on a second copy of the
model with no LoRA installed at all, the path every non-LoRA deployment takes. Cases are
interleaved `--reps` times after a warm-up; the median is reported.

The RESULT line gives each case's tok/s over the plain base (1.0 = free; the issue's
target: 4 adapters of rank 16 at batch 32 >= 0.75), then the absolute figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import orjson
import torch
from machine import cpu_description
from safetensors.torch import save_file

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from scheduling import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, loaded: LoadedModel, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter for every projection of the loaded model."""
    cfg = loaded.config
    shapes = {
        "q_proj": (cfg.hidden_size, cfg.q_size),
        "k_proj": (cfg.hidden_size, cfg.kv_size),
        "v_proj": (cfg.hidden_size, cfg.kv_size),
        "o_proj": (cfg.q_size, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            group = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": TARGETS}
    (directory / "adapter_config.json").write_bytes(orjson.dumps(config))


def tok_s(engine: Engine, batch: int, names: list[str | None], args: argparse.Namespace) -> float:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prompts = [
        [(31 * i + 7 * j) % 40_000 + 100 for j in range(args.prompt_len)] for i in range(batch)
    ]
    loras = [names[i % len(names)] for i in range(batch)]
    t = time.perf_counter()
    out = engine.generate(prompts, params, loras=loras)
    elapsed = time.perf_counter() - t
    return sum(len(c.token_ids) for c in out) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    print(cpu_description())
    config = dict(device=args.device, max_num_seqs=max(64, args.batch), kv_cache_memory=256 << 20)
    plain_model = LoadedModel.load(EngineConfig(**config))
    lora_model = LoadedModel.load(EngineConfig(**config))
    with tempfile.TemporaryDirectory() as tmp:
        modules = []
        for i in range(max(args.adapters)):
            write_adapter(Path(tmp) / f"a{i}", lora_model, args.rank, seed=i)
            modules.append(f"a{i}={Path(tmp) / f'a{i}'}")
        plain = Engine(EngineConfig(**config), plain_model)
        served = Engine(
            EngineConfig(
                **config,
                lora_modules=tuple(modules),
                max_loras=max(args.adapters),
                max_lora_rank=args.rank,
            ),
            lora_model,
        )
        cases: dict[str, tuple[Engine, list[str | None]]] = {
            "plain": (plain, [None]),
            "base": (served, [None]),
        }
        for n in args.adapters:
            cases[f"lora{n}"] = (served, [f"a{i}" for i in range(n)])
        for engine, names in cases.values():  # warm-up: kernels, and every adapter resident
            tok_s(engine, args.batch, names, args)
        figures: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.reps):
            for name, (engine, names) in cases.items():
                figures[name].append(tok_s(engine, args.batch, names, args))
    median = {name: statistics.median(v) for name, v in figures.items()}
    print(f"batch {args.batch}, rank {args.rank}, {args.prompt_len}-token prompts, "
          f"{args.max_tokens} tokens each, median of {args.reps}")  # fmt: skip
    for name, value in median.items():
        print(f"  {name:>8}  {value:8.1f} tok/s  {value / median['plain']:.3f} x plain")
    ratios = " ".join(
        f"{n}_vs_plain={v / median['plain']:.3f}" for n, v in median.items() if n != "plain"
    )
    absolute = " ".join(f"{n}_tok_s={v:.1f}" for n, v in median.items())
    print(f"RESULT {ratios} {absolute}")


if __name__ == "__main__":
    main()
