"""The shared-memory collectives (runner/parallel/shm_collectives.py) across spawned ranks:
sums added in rank order on every rank, gathers in rank order, a missing peer -> timeout."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from runner.parallel.ring import RingTimeout
from runner.parallel.shm_collectives import ShmCollectives

WORLD, SLOT, CALLS = 3, 1 << 16, 5


def part(rank: int, call: int) -> torch.Tensor:
    """Values of very different magnitudes: float addition order changes the sum's bits."""
    g = torch.Generator().manual_seed(100 * call + rank)
    return torch.randn(4, 7, generator=g) * 10.0 ** (4 * rank - 4)


def in_rank_order(call: int) -> torch.Tensor:
    total = part(0, call).clone()
    for r in range(1, WORLD):
        total += part(r, call)
    return total


def peer(name: str, rank: int, out: mp.Queue) -> None:
    group = ShmCollectives.attach(name, rank, WORLD, SLOT)
    sums = []
    for call in range(CALLS):
        sums.append(group.all_reduce(part(rank, call)))
        group.gather(part(rank, call) + 1)  # interleaved gathers reuse the same slots
    out.put((rank, torch.stack(sums).numpy()))  # a plain pickle, not a shared fd
    group.close()


def test_all_reduce_sums_in_rank_order_and_gather_collects_every_rank():
    group = ShmCollectives.create(WORLD, SLOT)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=peer, args=(group.name, r, out)) for r in range(1, WORLD)]
    for p in procs:
        p.start()
    try:
        mine = []
        for call in range(CALLS):
            mine.append(group.all_reduce(part(0, call)))
            parts = group.gather(part(0, call) + 1)
            assert parts is not None and len(parts) == WORLD
            for r in range(WORLD):
                assert torch.equal(parts[r], part(r, call) + 1)
        mine = torch.stack(mine)
        want = torch.stack([in_rank_order(c) for c in range(CALLS)])
        reversed_order = part(2, 0) + part(1, 0) + part(0, 0)
        assert not torch.equal(reversed_order, want[0])  # the order is observable
        assert torch.equal(mine, want)
        for _ in procs:
            rank, sums = out.get(timeout=60)
            assert torch.equal(torch.from_numpy(sums), want), f"rank {rank} summed differently"
    finally:
        for p in procs:
            p.join(30)
        group.close(unlink=True)
    assert all(p.exitcode == 0 for p in procs)


def test_a_peer_that_never_arrives_times_out_and_oversized_payloads_are_refused():
    group = ShmCollectives.create(2, SLOT)
    try:
        group.timeout_s = 0.3
        with pytest.raises(RingTimeout, match="collective 1"):
            group.all_reduce(torch.ones(8))
        assert not group.fits(torch.zeros(SLOT // 4 + 1))
        with pytest.raises(ValueError, match="exceeds the shared slot"):
            group.all_reduce(torch.zeros(SLOT // 4 + 1))
    finally:
        group.close(unlink=True)


def test_a_dead_peer_fails_the_wait_before_the_timeout():
    group = ShmCollectives.create(2, SLOT)
    try:
        group.timeout_s = 60.0
        group.alive = lambda: False
        with pytest.raises(RingTimeout, match="peer is gone"):
            group.all_reduce(torch.ones(8))
    finally:
        group.close(unlink=True)
