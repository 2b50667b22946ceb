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


def hash_request_blocks(
    hash_fn: HashFn,
    block_size: int,
    token_ids: Sequence[int],
    known: list[BlockHash],
    cache_salt: str | None,
    lora_id: str | None = None,
) -> None:
    """Extend `known` with the hashes of every full block of `token_ids` not hashed yet.

    `lora_id` names the LoRA adapter that computed the KV: the same tokens through another
    adapter (or the base) are different keys and values, so never a hit.
    NOTE: salt and adapter go into the first block only; chaining carries them to all others.
    """
    num_full = len(token_ids) // block_size
    first: tuple[object, ...] = () if cache_salt is None else (cache_salt,)
    if lora_id is not None:
        first += (("lora", lora_id),)
    for i in range(len(known), num_full):
        parent = known[i - 1] if i else None
        extra = first if i == 0 else ()
        known.append(hash_fn(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
