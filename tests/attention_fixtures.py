"""Helpers shared by the attention kernels' tests."""

from __future__ import annotations

import torch


def scattered_tables(lens: list[int], block_size: int, num_blocks: int) -> list[list[int]]:
    """Block tables for requests of these lengths over blocks in random order, as a cache
    that has served a while hands them out."""
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(perm[used : used + need])
        used += need
    assert used <= num_blocks
    return tables
