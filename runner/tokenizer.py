"""Tokenizer and chat template from the model's own file or directory (transformers)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runner.cache_dir import cache_dir
from runner.model_source import ModelSource


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer, or None when the directory has none (token-id-only use).

    Converting a GGUF vocabulary takes ~10 s, so the converted tokenizer is saved under the
    cache directory, keyed by the file's path, size and mtime, and loaded from there later.
    """
    if source.gguf_file is None:
        has_files = any(
            (source.path / f).exists()
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )
        return AutoTokenizer.from_pretrained(source.path) if has_files else None
    stat = source.gguf_file.stat()
    key = hashlib.sha256(
        f"{source.gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file.name)
    # Saved beside the target and renamed into place: replicas starting together convert at
    # once, and one must never load another's half-written directory. A read-only cache
    # only costs the conversion time at the next start.
    staging = cached.with_name(f"{key}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tok.save_pretrained(staging)
        staging.rename(cached)  # fails when another process got there first: theirs stays
    shutil.rmtree(staging, ignore_errors=True)
    return tok
