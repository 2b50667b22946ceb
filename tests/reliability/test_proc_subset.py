"""CPU detection where /proc shows only processes (systemd's ProcSubset=pid), and why the
shipped unit does not set it: run detection in such a mount namespace where the machine lets
us (root with unshare), the way the unit would have run it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parents[2] / "daemon" / "service" / "units" / "headrace.service"
PROBE = """
import json, logging, torch
logging.basicConfig(level=logging.WARNING)
from runner.platform import CpuFeatures
from runner.thread_governor import ThreadGovernor
f = CpuFeatures.detect()
print(json.dumps({"features": f.names(), "capability": torch.backends.cpu.get_cpu_capability(),
                  "governor": ThreadGovernor(2).enabled}))
"""


def _detect(proc_subset_pid: bool) -> tuple[dict, str]:
    cmd = [sys.executable, "-c", PROBE]
    if proc_subset_pid:
        # What ProcSubset=pid mounts: a procfs with the process directories only.
        mount = 'mount -t proc -o subset=pid proc /proc && exec "$@"'
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh", *cmd]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         "mount -t proc -o subset=pid proc /proc && test ! -e /proc/cpuinfo"],
        capture_output=True, timeout=30,
    )  # fmt: skip
    return r.returncode == 0


def test_the_unit_does_not_hide_proc_cpuinfo():
    lines = [ln.strip() for ln in UNIT.read_text().splitlines()]
    assert not any(ln.startswith("ProcSubset=") for ln in lines)
    assert "ProtectProc=invisible" in lines  # other processes stay hidden


@pytest.mark.skipif(not _can_unshare(), reason="needs root and a kernel with procfs subset=pid")
def test_detection_under_proc_subset_pid_says_what_it_lost():
    normal, _ = _detect(False)
    hidden, log = _detect(True)
    # The governor still works without /proc/stat (it probes instead).
    assert normal["governor"] and hidden["governor"]
    # Detection says plainly that it cannot see the CPU instead of silently choosing float32.
    assert "/proc/cpuinfo is not readable" in log and "ProcSubset=pid" in log
    # Why the unit does not set it: torch's own cpuinfo fails there, and ATen drops to its
    # unvectorised kernels, whatever headrace detects.
    if normal["capability"] != "DEFAULT":
        assert hidden["capability"] == "DEFAULT"
        assert "avx2" in normal["features"]
