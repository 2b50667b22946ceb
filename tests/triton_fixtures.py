"""Triton kernels under the interpreter, for tests on machines without a GPU.

`@triton.jit` reads TRITON_INTERPRET when it decorates a kernel, i.e. when a kernel module
is imported. `interpreted_kernels()` sets it, (re)imports the kernel modules, and on exit
restores the variable and re-imports them compiled, so nothing else in the session sees it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

KERNEL_MODULES = (
    "runner.triton_ops.kv_write",
    "runner.triton_ops.decode_attention",
    "runner.triton_ops.prefill_attention",
    "runner.triton_ops.norm_rope",
)


def _load_all() -> None:
    for name in KERNEL_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        else:
            importlib.import_module(name)


@contextmanager
def interpreted_kernels() -> Iterator[None]:
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _load_all()
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
        _load_all()
