"""The persistent tier: one file per block under the cache directory, bounded, LRU.

```
<cache dir>/kv/<layout namespace>/<key[:2]>/<key>      key = the block's chained sha256 hash
```
Writes go to a temporary file in the same folder and are renamed into place, so a reader
(this process, a restarted one, another replica on the host) sees a whole file or none.
Each file carries its layout and key in a header and a crc32 of its payload; anything that
does not check out is deleted and reported missing, so its tokens are recomputed. The size
bound is kept by deleting the least recently used files (mtime, touched on every hit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from kvcache.connectors import block_codec
from kvcache.connectors.base import KVLayout

log = logging.getLogger("headrace.kv_connector")

_TMP_PREFIX = ".tmp-"
# A temporary file older than this was left by a writer that died; it is removed.
_STALE_TMP_S = 600.0


class DiskStore:
    """Blocks of one layout as files; safe to share the folder between processes."""

    def __init__(self, root: Path, layout: KVLayout, payload_len: int, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"kv_store_gb: must be > 0, got {max_bytes} bytes")
        self.layout, self.payload_len, self.max_bytes = layout, payload_len, max_bytes
        self.dir = Path(root) / layout.namespace
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.num_corrupt = 0
        # Blocks a load wanted and did not get, by kind: corrupt (bad, truncated or foreign
        # file), missing (gone between the look-up and the load: evicted, another process).
        self.failures: Counter[str] = Counter()
        # Our running estimate of the folder's size; other writers make it drift, so it only
        # decides when to rescan, and the rescan decides what to delete.
        self._bytes = sum(size for _, size, _ in self._scan())

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / key

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def get_many(self, keys: Sequence[str]) -> list[memoryview]:
        out = []
        for key in keys:
            payload = self._get(key)
            if payload is None:
                break
            out.append(payload)
        return out

    def _get(self, key: str) -> memoryview | None:
        path = self.path(key)
        try:
            # Into a bytearray: the runner side reads the payload in place (no copy).
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except OSError:
            self.failures["missing"] += 1
            return None
        payload = block_codec.decode(data, self.layout.key, key, self.payload_len)
        if payload is None:
            self.num_corrupt += 1
            self.failures["corrupt"] += 1
            log.warning("kv disk tier: %s is corrupt, truncated or foreign; removed", path)
            self._unlink(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU: a hit makes it the most recently used
        return payload

    def put(self, key: str, payload: bytes | memoryview) -> None:
        path = self.path(key)
        if path.is_file():
            with contextlib.suppress(OSError):
                os.utime(path)
            return
        data = block_codec.encode(self.layout.key, key, payload)
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{key[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("kv disk tier: cannot write %s: %s", path, e)
            self._unlink(tmp)
            return
        with self._lock:
            self._bytes += len(data)
            over = self._bytes > self.max_bytes
        if over:
            self.evict()

    def evict(self) -> int:
        """Delete least recently used files until the folder is at 90% of its bound."""
        with self._lock:
            files = sorted(self._scan(), key=lambda f: f[2])
            total = sum(size for _, size, _ in files)
            target = int(self.max_bytes * 0.9)
            removed = 0
            for path, size, _ in files:
                if total <= target:
                    break
                if self._unlink(path):
                    total -= size
                    removed += 1
            self._bytes = total
        return removed

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def _scan(self) -> list[tuple[Path, int, float]]:
        """(path, size, mtime) of every block file; stale temporary files are removed."""
        out = []
        now = time.time()
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if entry.name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime > _STALE_TMP_S:
                        self._unlink(Path(entry.path))
                    continue
                out.append((Path(entry.path), st.st_size, st.st_mtime))
        return out

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False
