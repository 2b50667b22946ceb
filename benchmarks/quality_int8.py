"""Quality of the fast weight and KV formats against the fp32 path, on the embedded SmolLM2.

    python benchmarks/quality_int8.py [--variants fp32 bf16 int8 bf16+int8 auto
                                       fp32+kv8 bf16+kv8 auto+kv8] [--ppl-tokens 4096]

`+kv8` variants store the KV cache as int8 rows (--kv-cache-dtype int8, runner/kv_format.py).
`auto@q4` is `auto` run as a few streams are: batches and perplexity chunks of `q4_rows` rows,
so every token goes through the small copies' 4-bit blocks (runner/cpu_ops/q4_gemv.cpp).

`auto` is what `headrace serve` picks on this CPU; where that includes the small-batch or
batched int8 weights (runner/platform.py), its prompts run one batch of at most `small_rows`
(or `batched_rows`, the larger) requests at a time and its perplexity is scored that many
tokens per forward, so that every token goes through the int8 copies (the batched ones where
they are kept).

1. Greedy agreement: the first 64 tokens for each chat prompt in
   benchmarks/data/chat_prompts.txt (55 prompts, chat template applied), compared with fp32:
   the share of tokens generated before the first divergence, and how many of the prompts
   give all 64 tokens identical.
2. Perplexity on real English text that ships with an installed package: numpy's
   LICENSE.txt (its own licence and the bundled ones), first `--ppl-tokens` tokens, scored
   in chunks of 1024 tokens that each see all earlier tokens (through the paged KV cache).

Target (issue 9): int8 perplexity within +2% of fp32; the int8 KV cache the same.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import cpu_description

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from runner import kv_format
from runner.attention import build_metadata
from runner.model_runner import ModelRunner
from scheduling import SamplingParams

PROMPTS = Path(__file__).parent / "data" / "chat_prompts.txt"
# name: (dtype, quantization, kv_cache_dtype)
VARIANTS = {
    "fp32": ("float32", "none", "auto"),
    "bf16": ("bfloat16", "none", "auto"),
    "int8": ("float32", "int8", "auto"),
    "bf16+int8": ("bfloat16", "int8", "auto"),
    "auto": ("auto", "auto", "auto"),
    "fp32+kv8": ("float32", "none", "int8"),
    "bf16+kv8": ("bfloat16", "none", "int8"),
    "auto+kv8": ("auto", "auto", "int8"),
    "auto@q4": ("auto", "auto", "auto"),
}
DEFAULT_VARIANTS = ["fp32", "bf16", "int8", "bf16+int8", "auto"]


def english_text() -> str:
    dist = importlib.metadata.distribution("numpy")
    for f in dist.files or []:
        if str(f).endswith("licenses/LICENSE.txt"):
            return Path(str(dist.locate_file(f))).read_text()
    raise FileNotFoundError("numpy's LICENSE.txt is not installed")


def chat_prompts(tokenizer) -> list[str]:
    lines = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": line}], add_generation_prompt=True, tokenize=False
        )
        for line in lines
    ]


@torch.inference_mode()
def perplexity(
    loaded: LoadedModel, ids: list[int], chunk: int = 1024, kv_cache_dtype: str = "auto"
) -> float:
    block = 16
    kv_dtype = kv_format.cache_dtype(kv_cache_dtype, loaded.dtype)
    runner = ModelRunner(
        loaded.model, loaded.config, -(-len(ids) // block), block, loaded.device, kv_dtype
    )
    blocks = list(range(-(-len(ids) // block)))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : start + chunk]
        meta = build_metadata([start], [len(piece)], [blocks], block, loaded.device)
        hidden = loaded.model(
            torch.tensor(piece), torch.arange(start, start + len(piece)), runner.kv_caches, meta
        )
        logits = loaded.model.compute_logits(hidden)  # [n, V] fp32
        targets = torch.tensor(ids[start + 1 : start + len(piece) + 1])
        logits = logits[: len(targets)]
        nll += F.cross_entropy(logits, targets, reduction="sum").item()
        count += len(targets)
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    print(cpu_description())
    variants = ["fp32"] + [v for v in args.variants if v != "fp32"]
    outputs: dict[str, list[list[int]]] = {}
    ppl: dict[str, float] = {}
    for name in variants:
        dtype, quant, kv = VARIANTS[name]
        config = EngineConfig(
            device="cpu", dtype=dtype, quantization=quant, threads=args.threads,
            kv_cache_memory=256 << 20, max_num_seqs=64, kv_cache_dtype=kv,
        )  # fmt: skip
        loaded = LoadedModel.load(config)
        rows = (
            max(loaded.platform.small_rows, loaded.platform.batched_rows) if loaded.platform else 0
        )
        if name == "auto@q4":  # the rows a single stream's steps take: the 4-bit blocks'
            rows = loaded.platform.q4_rows if loaded.platform else 0
            if not rows:
                raise SystemExit("auto@q4: this CPU's platform keeps no 4-bit blocks")
        if rows:
            config.max_num_seqs = rows
        engine = Engine(config, loaded)
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        prompts = chat_prompts(engine.tokenizer)
        outputs[name] = [c.token_ids for c in engine.generate(prompts, params)]
        text_ids = engine.tokenizer.encode(english_text())[: args.ppl_tokens]
        ppl[name] = perplexity(loaded, text_ids, chunk=rows or 1024, kv_cache_dtype=kv)
        described = loaded.platform.describe() if loaded.platform else ""
        del engine, loaded
        print(f"{name}: perplexity {ppl[name]:.3f} on {len(text_ids)} tokens; {described}")
    ref = outputs["fp32"]
    fields = []
    for name in variants[1:]:
        prefix = [_common_prefix(a, b) for a, b in zip(ref, outputs[name])]
        agree = sum(prefix) / (len(ref) * args.new_tokens)
        same = sum(p == args.new_tokens for p in prefix)
        dppl = ppl[name] / ppl["fp32"] - 1
        print(
            f"{name:10s} vs fp32: {agree:.1%} of tokens before the first divergence, "
            f"{same}/{len(ref)} prompts identical for {args.new_tokens} tokens; "
            f"perplexity {ppl[name]:.3f} vs {ppl['fp32']:.3f} ({dppl:+.2%})"
        )
        key = name.replace("+", "_").replace("@", "_")
        fields.append(f"{key}_ppl_delta={dppl:+.4f} {key}_agree={agree:.3f} {key}_same={same}")
    print(f"RESULT {' '.join(fields)} fp32_ppl={ppl['fp32']:.3f} prompts={len(ref)}")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


if __name__ == "__main__":
    main()
