"""GPU check: kernels vs torch, greedy equality vs transformers, decode speed vs the roofline.

    python benchmarks/gpu_check.py               # on a CUDA machine (benchmarks/gpu_check.sh)
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --cpu-dry-run    # tiny shapes, CPU

Random-weight models of real shapes are built on the device from the configs below (no
download): SmolLM2-135M and a Llama-3.2-1B-shaped one. Sections, each ending in a
`RESULT` line:
1. kernels: paged decode attention at 8k context vs torch SDPA on the same unpaged data;
   fused RMSNorm+residual and RoPE vs the torch modules.
2. greedy equality: the engine (Triton backend, graphs on) vs transformers `generate`,
   fp32 (must match) and bf16 (reported: random weights give near-ties).
3. decode tokens/s at batch 1, 32, 256, graphs on and off, vs transformers `generate` and
   vs the HBM roofline (weights + KV bytes read per step / 4.8 TB/s); launch overhead that
   graph replay removes (SmolLM2 shape, batch 1).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import time
from collections.abc import Callable

import torch

from daemon.engine.config import EngineConfig
from daemon.engine.engine import Engine
from daemon.engine.loaded_model import LoadedModel
from runner.model_config import ModelConfig
from runner.models.decoder import DecoderForCausalLM
from scheduling import SamplingParams

HBM_BYTES_PER_S = 4.8e12  # H200
# "auto" picks Triton on CUDA; the CPU dry run forces it so the interpreter runs the kernels.
BACKEND = {"name": "auto"}

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip
LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip
TINY = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=True,
)  # fmt: skip


def result(**kv: object) -> None:
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in kv.items()), flush=True)  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / reps


# -- models ------------------------------------------------------------------------------


def build_pair(
    shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.nn.Module, LoadedModel]:
    """transformers' Llama with random weights, and our decoder holding the same weights."""
    import transformers as tf

    torch.manual_seed(seed)
    hf_cfg = tf.LlamaConfig(**shape, initializer_range=0.02)
    with torch.device(device):
        hf = tf.LlamaForCausalLM(hf_cfg).to(dtype).eval()
    cfg = ModelConfig.from_hf(hf_cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    with torch.device(device):
        ours = DecoderForCausalLM(cfg).to(dtype)
    ours.load_weights(hf.state_dict().items())
    ours.rope = ours.rope.to(device=device, dtype=dtype)
    loaded = LoadedModel(ours.eval(), cfg, None, "random", device, dtype)
    return hf, loaded


def engine(loaded: LoadedModel, **cfg: object) -> Engine:
    free_device_memory(loaded.device)
    cfg.setdefault("kv_cache_memory", 8 << 30 if loaded.device.type == "cuda" else 16 << 20)
    cfg.setdefault("attention_backend", BACKEND["name"])
    return Engine(EngineConfig(device=str(loaded.device), **cfg), loaded)  # type: ignore[arg-type]


def free_device_memory(device: torch.device) -> None:
    """Earlier engines' KV caches and graph pools go back before the next one is sized."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


# -- 1. kernels ------------------------------------------------------------------------


def check_kernels(device: torch.device, context: int, batch: int) -> None:
    import torch.nn.functional as F

    from runner.models.decoder import RMSNorm
    from runner.models.rope import RotaryEmbedding
    from runner.triton_ops import decode_attention, norm_rope
    from runner.triton_ops.metadata import build_triton_metadata

    heads, kv_heads, head_dim, block_size = 32, 8, 64, 16
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq + 1
    k = torch.randn(batch, kv_heads, context, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    # The same keys, paged into shuffled blocks.
    perm = torch.randperm(num_blocks - 1)[: batch * blocks_per_seq].view(batch, -1) + 1
    kv = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    for i in range(batch):
        paged = k[i].view(kv_heads, blocks_per_seq, block_size, head_dim).permute(1, 2, 0, 3)
        kv[0, perm[i].to(device)] = paged
        kv[1, perm[i].to(device)] = (
            v[i].view(kv_heads, blocks_per_seq, block_size, head_dim).permute(1, 2, 0, 3)
        )
    meta = build_triton_metadata(
        [context - 1] * batch, [1] * batch, perm.tolist(), block_size, device, kv_heads
    )
    out = torch.empty_like(q)
    scale = head_dim**-0.5

    def ours() -> None:
        decode_attention.decode_attention(q, kv, meta, scale, out)

    k_rep = k.repeat_interleave(heads // kv_heads, dim=1)
    v_rep = v.repeat_interleave(heads // kv_heads, dim=1)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.unsqueeze(2), k_rep, v_rep, scale=scale)

    reps = 50 if device.type == "cuda" else 1
    t_ours, t_sdpa = timed(ours, device, reps), timed(sdpa, device, reps)
    err = (out.float() - sdpa().squeeze(2).float()).abs().max().item()
    kv_bytes = 2 * batch * context * kv_heads * head_dim * kv.element_size()
    print(f"decode attention, {batch} x {context} ctx, GQA {heads}/{kv_heads}, D {head_dim}, "
          f"{meta.num_decode_splits} splits: triton paged {t_ours * 1e6:.1f} us "
          f"({kv_bytes / t_ours / 1e12:.2f} TB/s), SDPA unpaged {t_sdpa * 1e6:.1f} us, "
          f"max |diff| {err:.3g}")  # fmt: skip
    result(decode_attn_vs_sdpa=t_ours / t_sdpa, decode_attn_us=t_ours * 1e6, max_abs_err=err)

    tokens, hidden = (batch * 8, 2048) if device.type == "cuda" else (8, 64)
    norm = RMSNorm(hidden, 1e-5).to(device, dtype)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    res = torch.randn_like(x)

    def torch_norm() -> torch.Tensor:
        return norm(x + res)

    t_tn = timed(torch_norm, device, reps)
    t_fn = timed(lambda: norm_rope.rms_norm(x, norm.weight, 1e-5, res.clone()), device, reps)
    t_clone = timed(res.clone, device, reps)
    cfg = ModelConfig.from_hf(LLAMA_3_2_1B | {"architectures": ["LlamaForCausalLM"]})
    rope = RotaryEmbedding(cfg, 4096).to(device, dtype)
    pos = torch.randint(0, 4096, (tokens,), device=device)
    qr = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
    kr = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
    t_tr = timed(lambda: rope(pos, qr, kr), device, reps)

    def fused_rope() -> None:
        norm_rope.apply_rope_(qr, pos, rope.cos, rope.sin)
        norm_rope.apply_rope_(kr, pos, rope.cos, rope.sin)

    t_fr = timed(fused_rope, device, reps)
    print(f"rmsnorm+residual [{tokens}, {hidden}]: torch {t_tn * 1e6:.1f} us, triton "
          f"{(t_fn - t_clone) * 1e6:.1f} us; rope: torch {t_tr * 1e6:.1f} us, triton "
          f"{t_fr * 1e6:.1f} us")  # fmt: skip
    result(rmsnorm_speedup=t_tn / max(t_fn - t_clone, 1e-9), rope_speedup=t_tr / t_fr)


# -- 2. greedy equality ----------------------------------------------------------------


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int, device: torch.device) -> list[int]:
    hf.generation_config.eos_token_id = None
    out = hf.generate(
        torch.tensor([prompt], device=device), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def check_greedy(name: str, shape: dict, device: torch.device, n_prompts: int, n_tokens: int):
    for dtype in (torch.float32, torch.bfloat16):
        hf, loaded = build_pair(shape, device, dtype)
        rng = random.Random(1)
        prompts = [
            [rng.randrange(3, shape["vocab_size"]) for _ in range(rng.randrange(5, 200))]
            for _ in range(n_prompts)
        ]
        params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
        eng = engine(loaded, max_num_seqs=16)
        ours = [c.token_ids for c in eng.generate(prompts, params)]
        ref = [hf_greedy(hf, p, n_tokens, device) for p in prompts]
        same = sum(a == b for a, b in zip(ours, ref))
        agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                 for a, b in zip(ours, ref)]  # fmt: skip
        tag = str(dtype).removeprefix("torch.")
        print(f"{name} {tag}: {same}/{n_prompts} prompts identical over {n_tokens} tokens; "
              f"tokens agreeing before the first difference: {agree} "
              f"(backend {eng.runner.attn_backend.name}, graphs "
              f"{'on' if eng.runner.graphs else 'off'})")  # fmt: skip
        result(**{f"greedy_equal_{name}_{tag}": f"{same}/{n_prompts}"})
        del hf, loaded, eng
        free_device_memory(device)


# -- 3. decode speed -------------------------------------------------------------------


def decode_tok_s(eng: Engine, prompts: list[list[int]], n_tokens: int) -> float:
    """Decode tokens/s once every request has its first token (prefill excluded)."""
    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    produced = 0
    while produced < len(prompts):  # prefill steps (their first tokens)
        produced += sum(len(d.new_token_ids) for d in eng.step())
    sync(eng.device)
    t, decoded = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        decoded += sum(len(d.new_token_ids) for d in eng.step())
    sync(eng.device)
    eng.release_finished()
    return decoded / (time.perf_counter() - t)


def hf_decode_tok_s(hf: torch.nn.Module, prompts: list[list[int]], n_tokens: int) -> float:
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=device)
    hf.generation_config.eos_token_id = None

    def gen(n: int) -> None:
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    gen(2)  # warm-up
    sync(device)
    t = time.perf_counter()
    gen(1)
    sync(device)
    t_prefill = time.perf_counter() - t
    t = time.perf_counter()
    gen(n_tokens)
    sync(device)
    return len(prompts) * (n_tokens - 1) / (time.perf_counter() - t - t_prefill)


def roofline_tok_s(loaded: LoadedModel, batch: int, context: float) -> float:
    """Tokens/s if each step only read the weights once and each sequence's KV once."""
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    cfg = loaded.config
    kv_per_token = (
        cfg.num_hidden_layers * 2 * cfg.kv_size * loaded.model.embed_tokens.weight.element_size()
    )
    step_bytes = weights + batch * context * kv_per_token
    return batch / (step_bytes / HBM_BYTES_PER_S)


def check_speed(name: str, shape: dict, device: torch.device, batches: list[int], prompt_len: int,
                n_tokens: int) -> None:  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf, loaded = build_pair(shape, device, dtype)
    for batch in batches:
        prompts = random_prompts(batch, prompt_len, shape["vocab_size"])
        figures = {}
        for graphs in (True, False):
            eng = engine(loaded, max_num_seqs=batch, enforce_eager=not graphs,
                         max_num_batched_tokens=max(2048, prompt_len))  # fmt: skip
            figures[graphs] = decode_tok_s(eng, prompts, n_tokens)
            del eng
        hf_rate = hf_decode_tok_s(hf, prompts, n_tokens)
        roof = roofline_tok_s(loaded, batch, prompt_len + n_tokens / 2)
        print(f"{name} batch {batch}: graphs {figures[True]:.0f} tok/s, eager "
              f"{figures[False]:.0f} tok/s, transformers {hf_rate:.0f} tok/s, HBM roofline "
              f"{roof:.0f} tok/s")  # fmt: skip
        result(**{f"{name}_b{batch}_vs_transformers": figures[True] / hf_rate,
                  f"{name}_b{batch}_of_roofline": figures[True] / roof,
                  f"{name}_b{batch}_graphs_vs_eager": figures[True] / figures[False],
                  f"{name}_b{batch}_tok_s": figures[True]})  # fmt: skip
    del hf
    overlap_gain(name, loaded, batches[len(batches) // 2], prompt_len, n_tokens)
    if device.type == "cuda":
        launch_overhead(name, loaded, prompt_len)


def overlap_gain(name: str, loaded: LoadedModel, batch: int, prompt_len: int, n_tokens: int):
    """End-to-end tokens/s through AsyncEngine with the batch queue (overlap) on and off."""
    import asyncio

    from daemon.engine.async_engine import AsyncEngine

    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    prompts = random_prompts(batch, prompt_len, loaded.config.vocab_size, seed=2)

    async def run(overlap: bool) -> float:
        eng = AsyncEngine(engine(loaded, max_num_seqs=batch), overlap=overlap)

        async def one(p: list[int]) -> int:
            return sum([len(d.new_token_ids) async for d in eng.generate(p, params)])

        t = time.perf_counter()
        total = sum(await asyncio.gather(*(one(p) for p in prompts)))
        rate = total / (time.perf_counter() - t)
        await eng.stop()
        return rate

    on, off = asyncio.run(run(True)), asyncio.run(run(False))
    print(f"{name} batch {batch} through AsyncEngine: overlap on {on:.0f} tok/s, off {off:.0f}")
    result(**{f"{name}_b{batch}_overlap_gain": on / off})


def launch_overhead(name: str, loaded: LoadedModel, prompt_len: int) -> None:
    """Batch-1 step time eager vs graphed, against the replay alone (the GPU's own time):
    the share of the eager step's launch overhead that graphs remove."""
    prompts = random_prompts(1, prompt_len, loaded.config.vocab_size)
    t_graph = 1 / decode_tok_s(engine(loaded, max_num_seqs=1), prompts, 64)
    t_eager = 1 / decode_tok_s(engine(loaded, max_num_seqs=1, enforce_eager=True), prompts, 64)
    eng = engine(loaded, max_num_seqs=1)
    graph, _ = eng.runner.graphs.graphs[1]
    t_gpu = timed(graph.replay, loaded.device, 200)
    removed = (t_eager - t_graph) / max(t_eager - t_gpu, 1e-9)
    print(f"{name} batch-1 step: eager {t_eager * 1e3:.2f} ms, graphs {t_graph * 1e3:.2f} ms, "
          f"replay alone {t_gpu * 1e3:.2f} ms")  # fmt: skip
    result(**{f"{name}_launch_overhead_removed": removed})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--only", choices=["kernels", "greedy", "speed"], default=None)
    args = ap.parse_args()
    dry = args.cpu_dry_run
    if dry and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--cpu-dry-run needs TRITON_INTERPRET=1 set before python starts")
    device = torch.device("cpu" if dry else "cuda")
    if dry:
        BACKEND["name"] = "triton"
    if device.type == "cuda":
        print(torch.cuda.get_device_name(device), "torch", torch.__version__)
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm",
                        "--format=csv"], check=False)  # fmt: skip
    else:
        subprocess.run(["lscpu"], check=False)
    models = [("tiny", TINY)] if dry else [("smollm2", SMOLLM2_135M), ("llama1b", LLAMA_3_2_1B)]
    if args.only in (None, "kernels"):
        check_kernels(device, context=256 if dry else 8192, batch=2 if dry else 32)
    if args.only in (None, "greedy"):
        for name, shape in models:
            check_greedy(name, shape, device, n_prompts=3 if dry else 8, n_tokens=6 if dry else 32)
    if args.only in (None, "speed"):
        for name, shape in models:
            check_speed(name, shape, device, batches=[1, 4] if dry else [1, 32, 256],
                        prompt_len=16 if dry else 128, n_tokens=8 if dry else 128)  # fmt: skip


if __name__ == "__main__":
    main()
