"""Triton kernels for the CUDA path: paged KV writes, paged attention, RMSNorm and RoPE.

Importing this package does not import triton; the kernel modules do. Every kernel takes
plain tensors in the layouts the torch reference uses (runner/attention.py), runs compiled
on CUDA, and runs under `TRITON_INTERPRET=1` on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Whether triton is installed (it compiles kernels only where a GPU is present)."""
    return importlib.util.find_spec("triton") is not None
