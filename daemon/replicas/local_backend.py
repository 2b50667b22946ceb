"""The local backend: each replica a process on its own share of the cores.

A channel is the front door's end of one replica's socketpair. `connect` spawns the process,
sends its spec and waits for its Hello; restarting is the ReplicaSet's loop calling
`connect` again after a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import socket
from dataclasses import replace
from multiprocessing.process import BaseProcess

from daemon.replicas.framing import read_frame, write_frame
from daemon.replicas.messages import FromReplica, Hello, ToReplica
from daemon.replicas.replica import ReplicaSpec
from daemon.replicas.worker import run_replica

log = logging.getLogger("headrace.replicas")


def _cores() -> list[int]:
    """The cores this process may run on (its affinity mask)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def core_shares(n: int) -> list[list[int] | None]:
    """Disjoint core sets for n replicas (None each when there are fewer cores than replicas)."""
    cores = _cores()
    if len(cores) < n:
        return [None] * n
    per = len(cores) // n
    return [cores[i * per : (i + 1) * per] for i in range(n)]


def threads_per_replica(n: int, threads: int | None) -> int:
    """--threads when given, else cores // N (at least one)."""
    return threads or max(1, len(_cores()) // n)


class SocketChannel:
    """One replica process and the stream to it."""

    def __init__(
        self, process: BaseProcess, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.process = process
        self.reader = reader
        self.writer = writer
        self.pid = process.pid

    def send(self, message: ToReplica) -> None:
        if not self.writer.is_closing():
            write_frame(self.writer, message)

    async def recv(self) -> FromReplica:
        """The next message; raises ConnectionError once the replica is gone."""
        try:
            return await read_frame(self.reader)
        except (asyncio.IncompleteReadError, OSError) as e:
            raise ConnectionError(f"replica process {self.pid} ended") from e

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, ValueError):
            self.process.kill()

    async def close(self, timeout: float) -> None:
        """Wait for the process to exit (after Stop), killing it past `timeout`."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.process.join, timeout)
        if self.process.exitcode is None:
            self.kill()
            await loop.run_in_executor(None, self.process.join)
        self.writer.close()


class LocalBackend:
    """Replica processes forked from a forkserver that preloaded torch and the engine."""

    name = "local"

    def __init__(
        self, n: int, threads: int | None, log_level: str = "info", pin_cores: bool = True
    ) -> None:
        self.threads = threads_per_replica(n, threads)
        self.cores = core_shares(n) if pin_cores else [None] * n
        self.log_level = log_level
        self.context = multiprocessing.get_context("forkserver")
        # Imported once, in the forkserver: the engine, and torch._dynamo, which building the
        # model on the meta device imports (17 of a 22 s restart on a busy 2-core machine).
        self.context.set_forkserver_preload(
            ["daemon.replicas.replica", "daemon.replicas.worker", "torch._dynamo"]
        )

    async def connect(self, spec: ReplicaSpec) -> tuple[SocketChannel, Hello]:
        spec = replace(spec, engine=replace(spec.engine, threads=self.threads))
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        process = self.context.Process(
            target=run_replica,
            args=(child, self.cores[spec.index], self.threads, self.log_level),
            name=f"headrace-replica-{spec.index}",
            daemon=True,
        )
        try:
            # Off the loop: the first start launches the forkserver (it imports torch).
            await asyncio.get_running_loop().run_in_executor(None, process.start)
        finally:
            child.close()
        reader, writer = await asyncio.open_connection(sock=parent)
        channel = SocketChannel(process, reader, writer)
        write_frame(writer, spec)
        try:
            hello = await channel.recv()
        except BaseException:
            channel.kill()
            raise
        if not isinstance(hello, Hello):
            channel.kill()
            raise ConnectionError(f"replica {spec.index}: expected Hello, got {hello!r}")
        return channel, hello

    async def shutdown(self) -> None:
        """Nothing shared to release: each channel owns its process; the forkserver ends
        with this process."""
