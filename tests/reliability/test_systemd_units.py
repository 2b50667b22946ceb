"""The shipped systemd units pass `systemd-analyze verify`, hardened as documented."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cache_dir import cache_dir

UNITS = Path(__file__).parents[2] / "daemon" / "service" / "units"
# The install steps live in docs/systemd.md (linked from the README).
README = Path(__file__).parents[2] / "docs" / "systemd.md"
EXEC = "/opt/headrace/bin/headrace"


def unit(name: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, _, value = line.partition("=")
            values.setdefault(key.strip(), []).append(value.strip())
    return values


def test_exec_start_is_what_the_readme_installs():
    service = unit("headrace.service")
    assert service["ExecStart"] == [f"{EXEC} serve"]
    readme = README.read_text()
    assert "python3 -m venv /opt/headrace" in readme
    assert "/opt/headrace/bin/pip install" in readme


def test_hardening_directives():
    s = unit("headrace.service")
    assert s["SystemCallFilter"] == ["@system-service"]
    assert s["ProtectProc"] == ["invisible"]
    assert s["DevicePolicy"] == ["closed"]
    assert s["UMask"] == ["0077"]
    assert s["CacheDirectory"] == ["headrace"]
    assert int(s["LimitNOFILE"][0]) > 4096  # above the default --max-connections
    assert "HEADRACE_CACHE_DIR" not in "".join(s.get("Environment", []))
    assert "/dev/nvidiactl rw" in (UNITS / "examples" / "cuda.conf").read_text()
    assert "IPAddressAllow=localhost" in (UNITS / "examples" / "localhost-only.conf").read_text()


def test_cache_dir_is_not_doubled(monkeypatch):
    monkeypatch.delenv("HEADRACE_CACHE_DIR", raising=False)
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/headrace")
    assert cache_dir() == Path("/var/cache/headrace")
    monkeypatch.delenv("CACHE_DIRECTORY")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert cache_dir() == Path("/x/headrace")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_analyze_verify_passes(tmp_path):
    """The units as shipped, with the example drop-ins; only ExecStart points at this
    environment's headrace (verify checks that the binary exists, and tests do not write
    /opt). The README's install creates /opt/headrace/bin/headrace on a real host."""
    headrace = Path(sys.prefix) / "bin" / "headrace"
    assert headrace.exists()
    text = (UNITS / "headrace.service").read_text().replace(EXEC, str(headrace))
    (tmp_path / "headrace.service").write_text(text)
    shutil.copy(UNITS / "headrace.socket", tmp_path)
    dropins = tmp_path / "headrace.service.d"
    dropins.mkdir()
    for conf in ("cuda.conf", "localhost-only.conf"):
        shutil.copy(UNITS / "examples" / conf, dropins)
    r = subprocess.run(
        ["systemd-analyze", "verify", "headrace.service", "headrace.socket"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    # Unknown keys and bad values are only warnings: none may appear.
    assert "headrace" not in r.stderr, r.stderr
