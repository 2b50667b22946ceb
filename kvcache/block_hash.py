"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its own token ids and extra keys (cache
salt, LoRA adapter ids), so equal hashes mean equal prefixes, not just equal blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import Any

BlockHash = bytes | int
HashFn = Callable[[BlockHash | None, Sequence[int], tuple[Any, ...]], BlockHash]

_ROOT = b"headrace-prefix-v1"


def sha256_block_hash(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...]
) -> bytes:
    """Collision-resistant hash; the default, safe to share a cache between tenants."""
    h = hashlib.sha256()
    h.update(parent if isinstance(parent, bytes) else _ROOT)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def builtin_block_hash(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...]
) -> int:
    """Python's `hash`: faster, but not collision resistant across tenants."""
    return hash((parent, tuple(token_ids), extra_keys))


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_block_hash, "builtin": builtin_block_hash}


def get_hash_fn(name: str) -> HashFn:
    """Look up a block hash function by its config name."""
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"prefix_cache_hash: unknown hash {name!r}; choose one of {sorted(HASH_FUNCTIONS)}"
        ) from None


def request_extra_keys(cache_salt: str | None, lora_id: str | None = None) -> tuple[Any, ...]:
    """The extra keys a request's first block is hashed with: its cache salt and adapter.

    `lora_id` names the LoRA adapter that computed the KV: the same tokens through another
    adapter (or the base) are different keys and values, so never a hit.
    """
    first: tuple[Any, ...] = () if cache_salt is None else (cache_salt,)
    if lora_id is not None:
        first += (("lora", lora_id),)
    return first


def hash_request_blocks(
    hash_fn: HashFn,
    block_size: int,
    token_ids: Sequence[int],
    known: list[BlockHash],
    cache_salt: str | None,
    lora_id: str | None = None,
) -> None:
    """Extend `known` with the hashes of every full block of `token_ids` not hashed yet."""
    # Checked here first: most calls (a decode step that filled no block) hash nothing.
    if len(known) < len(token_ids) // block_size:
        first = request_extra_keys(cache_salt, lora_id)
        _extend_chain(hash_fn, block_size, token_ids, known, first)


def prefix_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    hash_name: str = "sha256",
    extra_keys: tuple[Any, ...] = (),
) -> list[BlockHash]:
    """The chained hashes of every full block of `token_ids`, as a KVCacheManager computes them.

    For a request with a cache salt or a LoRA adapter pass
    `extra_keys=request_extra_keys(salt, lora_id)`; the result then equals that request's
    `block_hashes` in a manager using `hash_name`. Only the sha256 hash is reproducible in
    another process: "builtin" is Python's `hash`, which is seeded per process for str and
    bytes (a salt, an adapter name) unless PYTHONHASHSEED fixes it.
    """
    if not isinstance(extra_keys, tuple):
        raise TypeError(
            f"extra_keys must be a tuple, got {type(extra_keys).__name__}; "
            "for a cache salt pass request_extra_keys(salt)"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    _extend_chain(get_hash_fn(hash_name), block_size, token_ids, hashes, extra_keys)
    return hashes


def _extend_chain(
    hash_fn: HashFn,
    block_size: int,
    token_ids: Sequence[int],
    known: list[BlockHash],
    first_extra: tuple[Any, ...],
) -> None:
    # NOTE: the extra keys go into the first block only; chaining carries them to all others.
    num_full = len(token_ids) // block_size
    for i in range(len(known), num_full):
        parent = known[i - 1] if i else None
        extra = first_extra if i == 0 else ()
        known.append(hash_fn(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
