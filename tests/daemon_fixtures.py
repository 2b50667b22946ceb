"""Start the real daemon as a subprocess and listen to it the way systemd would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from daemon.bench.peers import free_port


class NotifyListener:
    """A fake $NOTIFY_SOCKET: collects every sd_notify datagram the daemon sends."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def wait_for(self, line: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in list(self.messages):
                if line in m.splitlines():
                    return m
            time.sleep(0.05)
        raise TimeoutError(f"no {line!r} within {timeout}s; got {self.messages}")

    def close(self) -> None:
        self._stop = True
        self.sock.close()


class Daemon:
    """`headrace serve` on the embedded model, with TCP, a Unix socket and NOTIFY_SOCKET."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.uds = str(tmp / "headrace.sock")
        self.notify = NotifyListener(tmp / "notify.sock")
        self.log = tmp / "daemon.log"
        cmd = [
            sys.executable,
            "-m",
            "daemon.service.cli",
            "serve",
            "--port",
            str(self.port),
            "--uds",
            self.uds,
            "--threads",
            "1",
            "--kv-cache-memory",
            str(96 << 20),
            # The exact path: tests compare outputs across batch compositions, which bf16 and
            # int8 matmuls do not promise (their kernels block differently by batch size).
            "--dtype",
            "float32",
            "--quantization",
            "none",
            *args,
        ]
        full_env = {**os.environ, "NOTIFY_SOCKET": self.notify.path, **(env or {})}
        self.proc = subprocess.Popen(
            cmd, env=full_env, stdout=self.log.open("w"), stderr=subprocess.STDOUT
        )
        try:
            self.ready = self.notify.wait_for("READY=1", timeout=180)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"daemon did not become ready:\n{self.log.read_text()}") from None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()
