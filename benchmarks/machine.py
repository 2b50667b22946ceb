"""The CPU a benchmark ran on: lscpu's model name and flags, printed with every result."""

from __future__ import annotations

import subprocess


def cpu_description() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "lscpu unavailable"
    keep = ("Model name", "CPU(s):", "Flags")
    return "\n".join(line for line in out.splitlines() if line.startswith(keep))
