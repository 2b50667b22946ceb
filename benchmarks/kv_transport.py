"""P/D block transfer on one host: the Unix socket stream vs shared memory, side by side.

    python benchmarks/kv_transport.py [--mb 512] [--request-blocks 250] [--rounds 5]
                                      [--dtype float32|bfloat16] [--in-process]

A producer's block server (kvcache/connectors/peer_wire.py) holds `--mb` MB of real encoded
blocks (block_codec, SmolLM2-135M's KV shape: 30 layers, 3 KV heads, head dim 64, blocks of
16 tokens) and runs in a child process, as a producer does (`--in-process`: a thread of
this one, sharing its GIL). A consumer's PeerStore fetches them `--request-blocks` at a time
(250 blocks = a 4,000-token prompt), once asking for shared memory and once not, rounds
alternating; each fetch is what a consumer's IO thread does: ask, receive, verify every
block's crc, hand out views. Reported: MB/s of payload and microseconds per block, the best
round of each, beside the in-process floor (verifying blocks already in this process's
memory, no transport at all).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

from machine import cpu_description

from kvcache.connectors import KVLayout, MemoryStore, PeerServer, PeerStore

ITEMSIZE = {"float32": 4, "bfloat16": 2}


def layout(dtype: str) -> KVLayout:
    return KVLayout("LlamaForCausalLM:bench", dtype, 16, 30, 3, 64)


def payload_len(lay: KVLayout) -> int:
    per = lay.num_layers * 2 * lay.block_size * lay.num_kv_heads * lay.head_dim
    return per * ITEMSIZE[lay.dtype]


def keys_for(n: int) -> list[str]:
    return [hashlib.sha256(i.to_bytes(8, "little")).hexdigest() for i in range(n)]


def filled_store(lay: KVLayout, num_blocks: int) -> MemoryStore:
    size = payload_len(lay)
    store = MemoryStore(lay, size, num_blocks * (size + 4096))
    base = bytearray(os.urandom(size))
    for i, key in enumerate(keys_for(num_blocks)):
        base[:8] = i.to_bytes(8, "little")  # each block's bytes (and crc) differ
        store.put(key, base)
    return store


def serve(address: str, dtype: str, num_blocks: int, ready: mp.Event, stop: mp.Event) -> None:
    server = PeerServer(address, filled_store(layout(dtype), num_blocks))
    ready.set()
    stop.wait()
    server.close()


def fetch_all(remote: PeerStore | MemoryStore, keys: list[str], per: int) -> float:
    """Seconds to fetch (and verify) every key, `per` a request."""
    start = time.perf_counter()
    for i in range(0, len(keys), per):
        chunk = keys[i : i + per]
        got = remote.get_many(chunk)
        if len(got) != len(chunk):
            raise RuntimeError(f"fetched {len(got)} of {len(chunk)} blocks")
        del got  # the worker drops each view once copied in: the mapping goes with them
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=512, help="MB of blocks moved per round")
    parser.add_argument("--request-blocks", type=int, default=250, help="blocks per fetch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(ITEMSIZE), default="float32")
    parser.add_argument("--in-process", action="store_true", help="server on a thread here")
    args = parser.parse_args()

    lay = layout(args.dtype)
    size = payload_len(lay)
    num_blocks = max(1, int(args.mb * 1e6) // size)
    keys = keys_for(num_blocks)
    print(cpu_description())
    print(
        f"{num_blocks} blocks of {size / 1e6:.3f} MB payload ({args.dtype}), "
        f"{args.request_blocks} a fetch, {args.rounds} rounds, server "
        f"{'in this process' if args.in_process else 'in a child process'}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        address = str(Path(tmp) / "kv.sock")
        if args.in_process:
            server = PeerServer(address, filled_store(lay, num_blocks))
            child = None
        else:
            ctx = mp.get_context("spawn")
            ready, stop = ctx.Event(), ctx.Event()
            child = ctx.Process(target=serve, args=(address, args.dtype, num_blocks, ready, stop))
            child.start()
            if not ready.wait(600):
                raise SystemExit("the block server did not start")
        try:
            paths = {
                "socket": PeerStore(address, lay, size, shm=False),
                "shm": PeerStore(address, lay, size, shm=True),
            }
            best = {name: float("inf") for name in paths}
            for _ in range(args.rounds):
                for name, remote in paths.items():
                    best[name] = min(best[name], fetch_all(remote, keys, args.request_blocks))
            for name, remote in paths.items():
                if remote.transfers.get(name, 0) == 0 or remote.num_failed:
                    raise SystemExit(f"{name}: not taken ({dict(remote.transfers)}), or failed")
        finally:
            if child is None:
                server.close()
            else:
                stop.set()
                child.join(30)
    local = filled_store(lay, num_blocks)
    best["in_process"] = min(
        fetch_all(local, keys, args.request_blocks) for _ in range(args.rounds)
    )
    mb = num_blocks * size / 1e6
    print(f"{'path':<12}{'MB/s':>10}{'us/block':>10}")
    for name, seconds in best.items():
        print(f"{name:<12}{mb / seconds:>10.0f}{seconds / num_blocks * 1e6:>10.1f}")
    print(
        f"RESULT shm_vs_socket={best['socket'] / best['shm']:.2f} "
        f"socket_mb_s={mb / best['socket']:.0f} shm_mb_s={mb / best['shm']:.0f} "
        f"in_process_mb_s={mb / best['in_process']:.0f} "
        f"socket_us_per_block={best['socket'] / num_blocks * 1e6:.1f} "
        f"shm_us_per_block={best['shm'] / num_blocks * 1e6:.1f}"
    )


if __name__ == "__main__":
    main()
