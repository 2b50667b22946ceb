"""The engines a benchmark launches side by side (headrace, or a peer through its
benchmarks/peers/run_*.sh script) and the machine the figures were taken on."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

PEERS_SCRIPTS = Path(
    os.environ.get(
        "HEADRACE_PEERS_SCRIPTS", Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
    )
)
# Flags worth naming when comparing CPU engines: the vector and matrix extensions they use.
_ISA = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
)


def machine_description() -> dict[str, Any]:
    """CPU model, ISA flags, cores and torch version, for the record beside every figure."""
    model, flags = platform.processor() or "unknown", set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("Flags:"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:
        torch_version = "not installed"
    return {
        "cpu_model": model,
        "isa_flags": [f for f in _ISA if f in flags],
        "cores": os.cpu_count(),
        "torch": torch_version,
        "python": platform.python_version(),
    }


def free_port() -> int:
    """A loopback TCP port that is free now (the kernel picks it; the tests use it too)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedPeer:
    """An engine started through its run_*.sh script (or `headrace serve`), stopped after use."""

    def __init__(self, name: str, headrace_args: str, log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        # transformers serve answers 422 to the (non-OpenAI) ignore_eos field.
        self.accepts_ignore_eos = name != "transformers"
        if name == "headrace":
            cmd = [
                sys.executable,
                "-m",
                "daemon.service.cli",
                "serve",
                "--port",
                str(self.port),
                *headrace_args.split(),
            ]
        elif name in ("vllm-cpu", "vllm-cpu-bf16"):
            dtype = "bfloat16" if name.endswith("bf16") else "float32"
            cmd = ["bash", str(PEERS_SCRIPTS / "run_vllm_cpu.sh"), str(self.port), dtype]
        elif name in ("llama-server", "transformers"):
            script = "run_llama_server.sh" if name == "llama-server" else "run_transformers.sh"
            cmd = ["bash", str(PEERS_SCRIPTS / script), str(self.port)]
        else:
            raise ValueError(f"--peers: unknown engine {name!r}")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"{name}.log"
        self.proc = subprocess.Popen(
            cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-1500:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"{self.name} did not answer within {timeout:g}s (log: {self.log})")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
