"""C++ kernels for the CPU path, compiled once on the machine that runs them.

```
torch.ops.headrace.paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale)
torch.ops.headrace.write_kv_(kv_cache, k, v, slots)   (kv_write.cpp)
torch.ops.headrace.int8_weight_linear(x, qweight, scale, bias)
torch.ops.headrace.amx_pack_int8(qweight) / amx_int8_linear(x, tiles, scale, bias, n)
torch.ops.headrace.amx_usable()   (AMX builds on a kernel that grants the tile state)
torch.ops.headrace.amx_pack_bf16(w) / amx_bf16_linear(x, tiles, bias, n) /
    amx_bf16_silu_mul(x, tiles, n)   (prompt rows on AMX tiles: amx_gemm.cpp)
torch.ops.headrace.paged_prefill_attention_(out, q, kv_cache, tables, seq_lens, starts, lens, s)
torch.ops.headrace.paged_prefill_attention_vec_(...)   (the same without AMX: vec_attention.cpp)
torch.ops.headrace.rms_norm / add_rms_norm_ / silu_and_mul / rotary_   (elementwise.cpp)
torch.ops.headrace.lora_delta_(y, x, a, bt, rows, starts, slots, width)   (lora.cpp)
torch.ops.headrace.batched_int8_pack(q) / batched_int8_linear(x, packed, scale, bias, n,
    kernel) / batched_int8_kernels()   (8-256 rows without AMX: "dot" or "widen")
torch.ops.headrace.q4_pack(q, d, m) / q4_linear(x, packed, scales, bias, n) / q4_kernels()
    (a GGUF's 4-bit blocks on AVX2 maddubs, int8 activations: q4_linear.cpp)
torch.ops.headrace.q4_gemv_pack(q, d, m) / q4_gemv(x, packed, bias, n) / q4_gemv_kernels()
    (the same blocks for a few rows, int16 activations, vpdpwssd / vpmaddwd: q4_gemv.cpp)
torch.ops.headrace.decode_layers(x, weights, kv_caches, cos, sin, slots, tables, lens, ...)
    (every decoder layer of a few-row decode step in one call: fused_decode.cpp)
torch.ops.headrace.row_argmax(logits)   (greedy sampling's argmax: argmax.cpp)
```

The sources live next to this file. `load_cpu_ops()` builds them with torch's extension
builder (g++, ninja) into the cache directory, keyed by the sources, the compiler flags
(`HEADRACE_CPU_OPS_CFLAGS` appends some), torch's version and the CPU's flags (they are
compiled for this CPU: `-march=native`), and loads the library; later starts load the built
library directly. Without a compiler the engine keeps the torch
reference and says why in the log.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from runner.cache_dir import cache_dir

log = logging.getLogger("headrace.cpu_ops")

SOURCES = (
    "paged_attention.cpp",
    "kv_write.cpp",
    "int8_linear.cpp",
    "amx_linear.cpp",
    "amx_gemm.cpp",
    "amx_attention.cpp",
    "elementwise.cpp",
    "vec_attention.cpp",
    "lora.cpp",
    "batched_int8.cpp",
    "q4_linear.cpp",
    "q4_gemv.cpp",
    "fused_decode.cpp",
    "argmax.cpp",
)
# Every header here is in the build key: a list of names once left tile_driver.h out, so an
# edit to it loaded the stale library.
HEADERS = tuple(sorted(p.name for p in Path(__file__).parent.glob("*.h")))
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")
# Appended to CFLAGS (and to the build key): `-mno-avx512f` builds the AVX2 paths on an
# AVX-512 machine, which is how the tests cover both on one CPU.
EXTRA_CFLAGS_ENV = "HEADRACE_CPU_OPS_CFLAGS"


# Written into a build directory once its library is complete.
_DONE = "built.ok"


def cflags() -> list[str]:
    return [*CFLAGS, *os.environ.get(EXTRA_CFLAGS_ENV, "").split()]


def build_key() -> str:
    """Changes with the sources, the compiler flags, torch and the CPU."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update((Path(__file__).parent / name).read_bytes())
    h.update(" ".join(cflags()).encode())
    h.update(torch.__version__.encode())
    # The platform's own flag reader (imported here: it imports this package lazily).
    from runner.platform import read_cpu_flags

    h.update(" ".join(sorted(read_cpu_flags())).encode())
    return h.hexdigest()[:16]


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel puts it beside Python."""
    if shutil.which("ninja"):
        return
    with contextlib.suppress(ImportError):
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


@functools.cache
def load_cpu_ops() -> str | None:
    """Build (first time) and load the kernels; None when they are ready, else the reason."""
    if hasattr(torch.ops.headrace, "paged_decode_attention"):
        return None
    return build_and_load(cache_dir() / "cpu_ops" / build_key())


def build_and_load(build_dir: Path) -> str | None:
    """Load the library built in `build_dir`, building it there first if needed."""
    name = f"headrace_cpu_ops_{build_dir.name}"
    library = build_dir / f"{name}.so"
    try:
        if (build_dir / _DONE).exists() and library.exists():
            torch.ops.load_library(str(library))
            return None
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        build_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        log.info("building the CPU kernels into %s (once per machine, ~15 s)", build_dir)
        load(
            name=name,
            sources=[str(Path(__file__).parent / source) for source in SOURCES],
            extra_cflags=cflags(),
            # at::parallel_for is inline OpenMP: linked by soname to the libgomp.so.1 torch
            # has already loaded, so both share one thread pool (and the governor's setting).
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        # Written last: a second process that sees it may load the library without a lock.
        (build_dir / _DONE).touch()
        log.info("built the CPU kernels in %.1f s", time.perf_counter() - t0)
        return None
    except Exception as exc:  # any build failure leaves the torch reference
        lines = str(exc).strip().splitlines()
        reason = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
        log.warning("CPU kernels unavailable, using the torch reference (%s)", reason)
        return reason


def kernel_isas(listing: str) -> dict[str, str]:
    """A kernel family's entries in this build, name -> instructions, from its listing op
    (`torch.ops.headrace.<listing>()`, entries "name:isa"); {} where the kernels did not
    build."""
    if load_cpu_ops() is not None:
        return {}
    return dict(entry.split(":", 1) for entry in getattr(torch.ops.headrace, listing)())
