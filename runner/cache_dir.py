"""Where headrace keeps what it derives once and reuses: converted tokenizers, built kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """HEADRACE_CACHE_DIR, else systemd's CACHE_DIRECTORY (CacheDirectory=headrace gives
    /var/cache/headrace), used as they are; else $XDG_CACHE_HOME/headrace or ~/.cache/headrace."""
    own = os.environ.get("HEADRACE_CACHE_DIR") or os.environ.get("CACHE_DIRECTORY")
    if own:
        return Path(own.split(":")[0])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "headrace"
