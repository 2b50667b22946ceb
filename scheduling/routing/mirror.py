"""CacheMirror: the router's exact copy of each replica's set of prefix-cache hashes."""

from __future__ import annotations

from collections.abc import Sequence

from kvcache import BlockHash, KVEvent, apply_events


class CacheMirror:
    """One set of block hashes per replica, kept equal to the replica's pool by its events.

    Exact, not guessed: a hash is here only after the replica said it stored it, and leaves
    when the replica says it evicted it. Hashes are chained, so a prefix look-up walks the
    request's hashes from the start and stops at the first miss: O(cached prefix).
    """

    def __init__(self) -> None:
        self._replicas: dict[int, set[BlockHash]] = {}

    def apply(self, replica: int, events: Sequence[KVEvent]) -> None:
        """Apply one replica's events, in the order it drained them."""
        apply_events(self._replicas.setdefault(replica, set()), events)

    def reset(self, replica: int) -> None:
        """The replica restarted: it holds nothing."""
        self._replicas.pop(replica, None)

    def hashes(self, replica: int) -> set[BlockHash]:
        """A copy of the hashes the replica holds (for tests and metrics)."""
        return set(self._replicas.get(replica, ()))

    def num_blocks(self, replica: int) -> int:
        return len(self._replicas.get(replica, ()))

    def cached_prefix_blocks(self, replica: int, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `block_hashes` the replica holds."""
        held = self._replicas.get(replica)
        if not held:
            return 0
        n = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            n += 1
        return n
