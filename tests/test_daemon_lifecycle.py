"""The daemon's life cycle: queue limits and drain on SIGTERM, socket activation, units."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys

import httpx
import pytest
from daemon_fixtures import Daemon, NotifyListener, free_port


def test_queue_full_429_then_sigterm_drains_and_exits_zero(tmp_path):
    d = Daemon(tmp_path, "--max-num-seqs", "1", "--max-waiting", "1", "--drain-timeout", "1")
    try:

        async def main() -> list[int]:
            async with httpx.AsyncClient(base_url=d.url, timeout=60) as h:
                body = {"prompt": "Tell a long story.", "max_tokens": 300, "ignore_eos": True}
                first = asyncio.create_task(h.post("/v1/completions", json=body))
                await asyncio.sleep(0.5)
                second = asyncio.create_task(h.post("/v1/completions", json=body))
                await asyncio.sleep(0.5)
                third = await h.post("/v1/completions", json=body)
                assert third.status_code == 429 and third.headers["Retry-After"] == "1"
                assert "waiting queue is full" in third.json()["error"]["message"]
                code = await asyncio.to_thread(d.terminate)
                assert d.notify.wait_for("STOPPING=1", timeout=1)
                results = await asyncio.gather(first, second, return_exceptions=True)
                return [code, *[getattr(r, "status_code", 0) for r in results]]

        code, *_ = asyncio.run(main())
        assert code == 0
        assert "stopped" in d.log.read_text()
        assert not (tmp_path / "headrace.sock").exists()  # the socket file is removed on exit
    finally:
        d.stop()


@pytest.mark.skipif(
    shutil.which("systemd-socket-activate") is None,
    reason="needs systemd-socket-activate (Debian package systemd)",
)
def test_socket_activation_serves_on_the_inherited_socket(tmp_path):
    port = free_port()
    notify = NotifyListener(tmp_path / "notify.sock")
    log = (tmp_path / "log").open("w")
    proc = subprocess.Popen(
        [
            "systemd-socket-activate",
            "-l",
            f"127.0.0.1:{port}",
            "-E",
            f"NOTIFY_SOCKET={notify.path}",
            "-E",
            f"PYTHONPATH={os.getcwd()}",
            sys.executable,
            "-m",
            "daemon.service.cli",
            "serve",
            "--threads",
            "1",
            "--kv-cache-memory",
            str(64 << 20),
            "--port",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # The listening socket exists before the daemon: this request waits in its backlog.
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "Hi", "max_tokens": 2},
            timeout=180,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert "READY=1" in notify.wait_for("READY=1", timeout=5)
    finally:
        proc.terminate()
        proc.wait(30)
        notify.close()
