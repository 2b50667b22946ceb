"""The platform: hardware choices made once at start-up, logged, and kept out of model code.

```
CpuPlatform   flags (AVX2 / AVX-512 / AVX512-BF16 / AMX / VNNI) -> dtype, weight format, threads
CudaPlatform  bf16, float weights (int8 waits for its own CUDA kernels)
```

Rules (the CPU's flags decide, plus a start-up micro-benchmark for int8; never one
machine's figures):
- dtype auto: bfloat16 where the CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16);
  float32 elsewhere (on AVX2-only CPUs bf16 matmuls are emulated and
  ran ~100x slower than fp32).
- quantization auto: int8 on CPU when the checkpoint is already quantised (a Q4/Q8 GGUF, so
  int8 loses little more) and int8 beats the float path by 10% in a micro-benchmark of the
  model's own linear layers, each format at the activation dtype it would run with and the
  float path with the int8 copies it would keep (below); none on CUDA.
- bf16 linears go through oneDNN with the weight reordered once when available, else F.linear.
  Under quantization auto, fp32 linears go through oneDNN's fp32 GEMM (weight reordered
  once) where a start-up timing of the model's shapes at prompt rows finds it 5% faster than
  F.linear (MKL); quantization none and --deterministic (its batch invariance was measured
  on F.linear) keep F.linear.
- small-batch int8 (quantised checkpoint, quantization auto, weights not int8 already, the CPU
  kernels built): every linear also keeps a weight-only int8 copy, used for calls of up to
  `small_rows` rows; laid out for AMX tiles where the CPU has AMX-BF16 and the model runs in
  bf16, as int8 rows for the GEMV elsewhere. `small_rows` is the largest of 1, 2, 4, ..., 64
  up to which a sweep over the loaded model's own linears (all of them, so the weights stream
  from memory as in a real step) is 10% faster with the copies at every step; 0 drops them.
  Where a layer's weight is on a 4-bit grid (the GGUF's Q4_1 blocks), its copy also keeps
  those blocks for the 4-bit GEMV (runner/cpu_ops/q4_gemv.cpp), used up to `q4_rows` rows:
  the largest of 1, 2, 4, 8 at which the same kind of sweep is faster on them.
- batched int8 (the same conditions, no AMX): every linear also keeps a copy for the batched
  kernel (runner/layers/batched_int8.py); runner/batched_rows.py measures which kernel wins
  here and up to how many rows (`batched_rows`) it beats the bf16/fp32 path.
- int8 KV rows (`--kv-cache-dtype auto`; quantised checkpoint, quantization auto, not
  --deterministic, the CPU kernels built, which read the rows in place): each cached row
  as int8 values and its scale (runner/kv_format.py). On SmolLM2 they moved perplexity by
  -0.02% on the fp32 path and +0.17 points on the served bf16 path (benchmarks/
  quality_int8.py), where the Q4 weights themselves cost more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from runner.format_timing import (
    AMX_GEMM_ROWS,
    amx_gemm_rows,
    int8_beats_float,
    measure_q4_rows,
    measure_small_rows,
    onednn_f32_beats_float,
)
from runner.layers.linear import Linear, LinearShape, pack_linears
from runner.layers.q4_blocks import Q4_GEMV, q4_gemv_kernels
from runner.layers.q8_embedding import compress_embedding
from runner.layers.weight_formats import (
    default_int8_kernel,
    onednn_bf16_available,
    onednn_f32_available,
)

log = logging.getLogger("headrace.platform")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("none", "int8", "auto")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """The ISA extensions that change which kernels are fast."""

    avx2: bool = False
    avx512: bool = False
    avx512_bf16: bool = False
    amx_bf16: bool = False
    vnni: bool = False

    @classmethod
    def from_flags(cls, flags: set[str]) -> CpuFeatures:
        return cls(
            avx2="avx2" in flags,
            avx512="avx512f" in flags,
            avx512_bf16="avx512_bf16" in flags,
            amx_bf16="amx_bf16" in flags,
            vnni="avx512_vnni" in flags or "avx_vnni" in flags,
        )

    @classmethod
    def detect(cls) -> CpuFeatures:
        return cls.from_flags(read_cpu_flags())

    @property
    def native_bf16(self) -> bool:
        return self.amx_bf16 or self.avx512_bf16

    def names(self) -> str:
        on = [f for f in ("avx2", "avx512", "avx512_bf16", "amx_bf16", "vnni") if getattr(self, f)]
        return "+".join(on) or "baseline"


def read_cpu_flags() -> set[str]:
    """The `flags` line of /proc/cpuinfo (Linux); elsewhere what torch's cpuinfo reports.

    NOTE: where /proc/cpuinfo is hidden (systemd's ProcSubset=pid) torch's own cpuinfo
    fails too (it parses the same file): every query says "no", and ATen itself dispatches
    its DEFAULT, unvectorised kernels. That is logged loudly; daemon/units/ does not hide it.
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError as e:
        log.warning(
            "CPU flags: /proc/cpuinfo is not readable (%s; systemd ProcSubset=pid hides it): "
            "torch sees capability %s, so dtype auto and the CPU kernels choose from what "
            "it reports; give the process /proc/cpuinfo to serve the benchmarked engine",
            e.strerror,
            torch.backends.cpu.get_cpu_capability(),
        )
    return torch_cpu_flags()


def torch_cpu_flags() -> set[str]:
    """The flags we use, as torch's cpuinfo (cpuid) reports them, named as /proc/cpuinfo."""
    cpu = torch.cpu
    checks = {
        "avx2": "_is_avx2_supported",
        "avx512f": "_is_avx512_supported",
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_bf16": "_is_amx_tile_supported",
        "avx512_vnni": "_is_vnni_supported",
    }
    flags = {name for name, fn in checks.items() if getattr(cpu, fn, lambda: False)()}
    cap = torch.backends.cpu.get_cpu_capability().lower()  # "avx2", "avx512", "default"
    if "avx2" in cap or "avx512" in cap:
        flags.add("avx2")
    if "avx512" in cap:
        flags.add("avx512f")
    return flags


@dataclass(slots=True)
class Platform:
    """What the engine runs with on this device; chosen once by `select_platform`."""

    device: torch.device
    dtype: torch.dtype
    # Linear weight format: "float" (F.linear), "onednn" (prepacked bf16), "onednn_f32"
    # (prepacked fp32), "amx_bf16" (bf16 AMX tiles) or "int8".
    weight_format: str
    int8_kernel: str | None = None
    # The format of layers that stay float when the rest is int8 (see Linear.int8_inputs):
    # "onednn" (bf16 weights, inputs cast) where the CPU has native bf16 ("amx_bf16" where
    # AMX's tiles timed faster), else "onednn_f32" where it timed faster, else "float".
    float_format: str = "float"
    int8_reduce_range: bool = False
    # An onednn format's calls of up to this many rows (past the int8 copies) take AMX tiles
    # kept beside its weight (0: none): the rows where a start-up timing found them faster.
    amx_rows: int = 0
    # The layout of the weight-only int8 copies to try for few-row calls (None: none);
    # `prepare` measures and sets `small_rows` (0: not worth it here, copies dropped).
    small_batch_int8: str | None = None
    small_rows: int = 0
    # Up to how many rows the copies' 4-bit blocks serve (measured in `prepare`; 0: none).
    q4_rows: int = 0
    # The batched int8 kernel to pack for (None: none); `prepare` measures the kernel and
    # `batched_rows` (runner/batched_rows.py).
    batched_int8: str | None = None
    batched_rows: int = 0
    features: CpuFeatures | None = None
    # --deterministic: no small-batch copies, linear calls padded to `min_rows` (measured).
    deterministic: bool = False
    # `--kv-cache-dtype auto` stores int8 rows (runner/kv_format.py) rather than `dtype`'s.
    int8_kv: bool = False
    min_rows: int | None = None
    # Why each choice was made, for the start-up log.
    reasons: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "CudaPlatform" if self.device.type == "cuda" else "CpuPlatform"

    def prepare(self, model: torch.nn.Module, step_rows: int = 0) -> None:
        """Convert the loaded model's linear layers to the chosen format (once); `step_rows`
        (the step's token budget) bounds the rows a batched int8 copy may be measured for."""
        counts = self._pack(model, self.batched_int8)
        log.info("linear layers by format: %s", counts)
        if self.deterministic:
            from runner.batch_invariance import measure_min_rows

            self.min_rows = measure_min_rows(model, self.dtype)
            if self.min_rows is None:
                log.warning("deterministic: some linear layer is not batch-invariant here")
            self.reasons.append(
                "deterministic: one linear path for every batch size, calls padded to "
                f"{self.min_rows} rows"
                if self.min_rows
                else "deterministic: linear layers NOT batch-invariant on this device"
            )
        if self.small_batch_int8:
            self.small_rows = measure_small_rows(model, self.dtype)
            self.q4_rows = measure_q4_rows(model, self.dtype)
        batched = None
        if self.batched_int8:
            from runner.batched_rows import measure_batched_rows

            batched = measure_batched_rows(model, self.dtype, step_rows=step_rows)
            self.batched_int8, self.batched_rows = batched.kernel, batched.batched_rows
            self.small_rows = batched.small_rows
        # Told after the batched measurement, which may have lowered `small_rows`.
        if self.small_batch_int8:
            taken = batched is not None and batched.kernel is not None
            self.reasons.append(
                f"small-batch int8 weights ({self.small_batch_int8}) for <= {self.small_rows} rows"
                if self.small_rows
                else "small-batch int8 weights: dropped, the batched kernel serves from 1 row"
                if taken
                else "small-batch int8 weights: not faster here, dropped"
            )
        # The blocks serve inside the small copy's rows, which the batched measurement may
        # have lowered.
        self.q4_rows = min(self.q4_rows, self.small_rows)
        if self.q4_rows:
            isa = q4_gemv_kernels().get(Q4_GEMV, "")
            freed = _free_covered_int8(model)
            self.reasons.append(
                f"small-batch 4-bit blocks ({isa}) for <= {self.q4_rows} rows where a layer "
                "has them" + (f" (their int8 copies freed: {freed / 1e6:.0f} MB)" if freed else "")
            )
        if batched is not None:
            self.reasons.append(batched.describe())
        if self.device.type == "cpu" and (saved := compress_embedding(model)):
            self.reasons.append(f"token embedding as its Q8_0 blocks ({saved / 1e6:.0f} MB less)")

    def _pack(self, model: torch.nn.Module, batched_int8: str | None) -> dict[str, int]:
        return pack_linears(
            model,
            self.weight_format,
            self.int8_kernel,
            self.int8_reduce_range,
            self.float_format,
            self.small_batch_int8,
            batched_int8,
            self.amx_rows,
        )

    def prepare_as(
        self, model: torch.nn.Module, small_rows: int, min_rows: int | None, q4_rows: int = 0
    ) -> None:
        """Convert a tensor-parallel worker's shard as rank 0 did, with rank 0's measured
        figures: every rank takes the same linear path for the same step (no batched int8
        copies: their choice is not passed on)."""
        self._pack(model, None)
        self.small_rows, self.min_rows, self.q4_rows = small_rows, min_rows, q4_rows
        for m in model.modules():
            if isinstance(m, Linear):
                m.min_rows = min_rows or 0
                if m.has_small_batch_int8 and small_rows:
                    m.small_rows = small_rows
                elif m.has_small_batch_int8:
                    m.drop_small_batch_int8()
                if (copy := m.small_batch_copy) is not None:
                    copy.q4_rows = q4_rows
                    if not q4_rows:
                        copy.q4 = None
        _free_covered_int8(model)

    def describe(self) -> str:
        kernel = f" ({self.int8_kernel})" if self.weight_format == "int8" else ""
        feats = f" cpu={self.features.names()}" if self.features else ""
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.name}: device={self.device} dtype={dtype} "
            f"weights={self.weight_format}{kernel}{feats}; " + "; ".join(self.reasons)
        )


def select_platform(
    device: torch.device,
    dtype: str = "auto",
    quantization: str = "auto",
    checkpoint_quantized: bool = False,
    features: CpuFeatures | None = None,
    int8_faster: Callable[[torch.dtype, str], bool] | None = None,
    linears: Sequence[LinearShape] = (),
    deterministic: bool = False,
    onednn_f32_faster: Callable[[], bool] | None = None,
    amx_gemm_timing: Callable[[], int] | None = None,
) -> Platform:
    """Choose dtype and weight format for `device`. `linears` are the model's layer shapes
    for the micro-benchmarks; `features`, `int8_faster`, `onednn_f32_faster` and
    `amx_gemm_timing` are injectable so tests can force every branch on any machine.
    `deterministic` keeps one linear path for every batch size (no small-batch int8 copies,
    F.linear for fp32; runner/batch_invariance.py)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if device.type == "cuda":
        platform = _cuda_platform(device, dtype, quantization)
        platform.deterministic = deterministic
        return platform
    feats = features if features is not None else CpuFeatures.detect()
    reasons = []
    chosen = DTYPES.get(dtype, torch.bfloat16 if feats.native_bf16 else torch.float32)
    if dtype == "auto":
        reasons.append(
            "dtype auto -> bfloat16 (native bf16 matmul)"
            if feats.native_bf16
            else "dtype auto -> float32 (no native bf16 matmul on this CPU)"
        )
    float_format = "onednn" if chosen == torch.bfloat16 and onednn_bf16_available() else "float"
    # Only under quantization auto (the serving default): `none` keeps F.linear, the exact
    # reference path the transformers comparisons run on.
    auto = quantization == "auto" and not deterministic
    if chosen == torch.float32 and auto and onednn_f32_available():
        faster = (
            onednn_f32_faster()
            if onednn_f32_faster is not None
            else onednn_f32_beats_float(linears)
        )
        float_format = "onednn_f32" if faster else "float"
        reasons.append(
            f"fp32 linears -> {'oneDNN' if faster else 'F.linear (MKL)'} "
            f"(oneDNN {'' if faster else 'not '}at least 5% faster at prompt rows)"
        )
    amx_rows = 0
    if float_format == "onednn" and auto and _amx_kernels_usable(feats):
        timed = amx_gemm_timing or (lambda: amx_gemm_rows(linears))
        amx_rows = timed()
        if amx_rows >= max(AMX_GEMM_ROWS):
            float_format, amx_rows = "amx_bf16", 0
            reasons.append("bf16 linears -> AMX tiles (oneDNN not 5% faster at any row count)")
        else:
            reasons.append(
                f"bf16 linears -> AMX tiles up to {amx_rows} rows, oneDNN past (oneDNN 5% "
                "faster past there, in two timings)"
                if amx_rows
                else "bf16 linears -> oneDNN (5% faster than the AMX tiles, in two timings)"
            )
    # NOTE: without VNNI, fbgemm sums u8 x s8 pairs in int16 and needs 7-bit activations
    # (reduce_range) not to saturate: on SmolLM2 that lost 2 of 4 greedy answers within a few
    # tokens on Zen 3. torch._int_mm accumulates in int32 at full range, but served 2.7x slower
    # at c=8 there (TPOT 404 vs 153 ms), so only an explicit --quantization int8 takes it; auto
    # keeps fbgemm's speed until an AVX2 int8 kernel of our own replaces both.
    exact = quantization == "int8" and not feats.vnni
    kernel = "int_mm" if exact else default_int8_kernel()
    fmt = float_format
    copies = _float_copies(feats, chosen, deterministic, quantization, checkpoint_quantized)
    if quantization == "int8":
        fmt = "int8"
    elif quantization == "auto":
        if not checkpoint_quantized:
            reasons.append("quantization auto -> none (checkpoint is not quantised)")
        elif all(copies):
            # NOTE: the micro-benchmark below times linears alone; it misses the fused decode
            # step (runner/models/fused_decode.py), which the int8 format cannot take, and
            # the batched kernel chosen later at load. On a Xeon with AVX2 only enabled it
            # timed fbgemm 6-12% faster, flipping between starts, and the int8 choice served
            # chat prompts at 0.64-0.78x of float with its copies (TPOT 106 against 76 ms).
            # fbgemm also rounds activations per token (+2.1% perplexity, AMX-masked Xeon).
            reasons.append(
                "quantization auto -> none (quantised checkpoint; int8 copies of the float "
                "weights serve decode rows, in one fused call a step)"
            )
        else:
            if int8_faster is None:
                # int8 runs with fp32 activations unless the user fixed the dtype (below).
                int8_dtype = torch.float32 if dtype == "auto" else chosen
                faster = int8_beats_float(chosen, float_format, int8_dtype, linears, *copies)
            else:
                faster = int8_faster(chosen, float_format)
            fmt = "int8" if faster else float_format
            reasons.append(
                f"quantization auto -> {'int8' if faster else 'none'} "
                f"(quantised checkpoint; int8 {'' if faster else 'not '}at least 10% faster "
                f"than {float_format} in the start-up micro-benchmark)"
            )
    if fmt == "int8" and dtype == "auto" and chosen != torch.float32:
        # NOTE: measured on SmolLM2: int8 linears with bf16 activations and KV cost +1.4%
        # perplexity on top of int8 alone; fp32 activations cost little (int8 dominates).
        chosen = torch.float32
        reasons.append("int8 linears keep float32 activations and KV cache")
    if fmt == "int8" and feats.native_bf16 and onednn_bf16_available():
        float_format = "onednn"  # the layers int8 leaves float: bf16 weights where native
    small_layout, batched = (None, None) if fmt == "int8" else copies
    int8_kv = auto and checkpoint_quantized and _cpu_kernels_built()
    if int8_kv:
        reasons.append(
            "kv cache dtype auto means int8 rows here (quantised checkpoint; kernels read them)"
        )
    return Platform(
        device,
        chosen,
        fmt,
        int8_kernel=kernel if fmt == "int8" else None,
        float_format=float_format,
        amx_rows=amx_rows,
        int8_reduce_range=fmt == "int8" and kernel == "fbgemm" and not feats.vnni,
        small_batch_int8=small_layout,
        batched_int8=batched,
        features=feats,
        deterministic=deterministic,
        int8_kv=int8_kv,
        reasons=reasons,
    )


def _free_covered_int8(model: torch.nn.Module) -> int:
    """Free the small copies' int8 weights wherever their 4-bit blocks serve every row the
    copy gets (`small_rows` <= `q4_rows`: on SmolLM2 without AMX, its 120 decoder linears,
    106 MB); the bytes freed."""
    return sum(
        copy.free_int8(m.small_rows)
        for m in model.modules()
        if isinstance(m, Linear) and (copy := m.small_batch_copy) is not None
    )


def _cpu_kernels_built() -> bool:
    from runner.cpu_ops import load_cpu_ops

    return load_cpu_ops() is None


def _amx_kernels_usable(feats: CpuFeatures) -> bool:
    """Whether this CPU has AMX and our kernels built with it and may use it."""
    return feats.amx_bf16 and _cpu_kernels_built() and bool(torch.ops.headrace.amx_usable())


def _float_copies(
    feats: CpuFeatures,
    chosen: torch.dtype,
    deterministic: bool,
    quantization: str,
    checkpoint_quantized: bool,
) -> tuple[str | None, str | None]:
    """The int8 copies the float format would keep: the small-batch layout and the batched
    kernel (None each where there would be none)."""
    # The GEMV takes fp32 or bf16 activations (not fp16).
    if (
        deterministic
        or quantization != "auto"
        or not checkpoint_quantized
        or chosen not in (torch.float32, torch.bfloat16)
    ):
        return None, None
    if not _cpu_kernels_built():
        return None, None
    # AMX multiplies bf16 only: fp32 activations keep the GEMV (and their precision).
    if chosen == torch.bfloat16 and _amx_kernels_usable(feats):
        return "amx", None
    from runner.layers.batched_int8 import AUTO_KERNELS, batched_kernels

    return "rows", next((k for k in AUTO_KERNELS if k in batched_kernels()), None)


def _cuda_platform(device: torch.device, dtype: str, quantization: str) -> Platform:
    if quantization == "int8":
        raise ValueError("quantization: int8 has no CUDA kernels yet; use none or auto")
    chosen = torch.bfloat16 if dtype == "auto" else DTYPES[dtype]
    return Platform(device, chosen, "float", reasons=["CUDA: float weights"])
