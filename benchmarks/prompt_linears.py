"""Prompt-row linears on AMX: the tile kernel (runner/cpu_ops/amx_gemm.cpp) against oneDNN's
bf16 GEMM, every decoder linear of the embedded model in turn, per prompt-chunk size.

    python benchmarks/prompt_linears.py [--rows 128 256 512 1024 2048] [--rounds 5]

Every decoder layer's QKV, o_proj, gate/up and down_proj, packed both ways from the loaded
weights (30 layers' own weights: they stream from memory as in a prompt step). gate/up is
called as the MLP calls it: silu(gate) * up in the same pass on the tiles, oneDNN's output
then silu_and_mul. Before each call its input is rewritten by an elementwise op on all
threads, as a norm or the activation writes it in a prompt step. Figures: ms a layer, best
of `--rounds`; RESULT: oneDNN's time over the tiles' at each row count (> 1: tiles faster).
"""

from __future__ import annotations

import argparse
import time

import torch
from machine import cpu_description

from daemon.engine.config import EngineConfig
from daemon.engine.loaded_model import LoadedModel
from runner.cpu_ops import load_cpu_ops
from runner.layers.linear import Linear

FORMATS = ("onednn", "amx_bf16")


def copies(model: torch.nn.Module, fmt: str) -> list[Linear]:
    """The model's per-token linears, in model order, repacked in `fmt`."""
    out = []
    for m in model.modules():
        if isinstance(m, Linear) and m.per_token:
            layer = Linear(m.in_features, m.out_features, bias=m.bias is not None, gated=m.gated)
            layer.weight.data = m.float_weight().to(torch.bfloat16).clone()
            if m.bias is not None:
                layer.bias.data = m.bias.detach().to(torch.bfloat16).clone()
            layer.pack(fmt)
            out.append(layer)
    return out


def sweep_ms(packed: dict[str, list[Linear]], rows: int, rounds: int) -> dict[str, float]:
    """ms of a pass over every layer per format: best of `rounds` rounds that take each
    format in turn (a drift falls on both alike), each input rewritten before its call."""
    widths = {m.in_features for layers in packed.values() for m in layers}
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in widths}
    best = dict.fromkeys(packed, float("inf"))
    with torch.inference_mode():
        for _ in range(rounds):
            for fmt, layers in packed.items():
                t = time.perf_counter()
                for m in layers:
                    x = inputs[m.in_features].mul_(1.0)
                    (m.silu_mul if m.gated else m)(x)
                best[fmt] = min(best[fmt], (time.perf_counter() - t) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(cpu_description())
    if load_cpu_ops() is not None or not torch.ops.headrace.amx_usable():
        print("no usable AMX here: nothing to compare")
        print("RESULT amx=0")
        return
    loaded = LoadedModel.load(EngineConfig(device="cpu"))
    packed = {fmt: copies(loaded.model, fmt) for fmt in FORMATS}
    n_layers = loaded.model.config.num_hidden_layers
    print(f"{len(packed['onednn'])} linears, {n_layers} layers, threads {torch.get_num_threads()}")
    print("| rows | AMX tiles (ms a layer) | oneDNN bf16 | oneDNN / tiles |")
    print("|---|---|---|---|")
    fields = []
    for rows in args.rows:
        ms = {fmt: t / n_layers for fmt, t in sweep_ms(packed, rows, args.rounds).items()}
        ratio = ms["onednn"] / ms["amx_bf16"]
        print(f"| {rows} | {ms['amx_bf16']:.2f} | {ms['onednn']:.2f} | {ratio:.2f}x |")
        fields.append(f"onednn_over_tiles_{rows}={ratio:.3f}")
    print(f"RESULT {' '.join(fields)}")


if __name__ == "__main__":
    main()
