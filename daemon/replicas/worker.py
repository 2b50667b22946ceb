"""A local replica process: `run_replica`, started by a multiprocessing forkserver.

The forkserver has imported torch and the engine once, so a (re)start costs a fork plus
the model load, not the imports (25 s on a busy 2-core machine). The front door made a
socketpair and passes one end; the first frame on it is the ReplicaSpec. The process never
outlives the front door: PR_SET_PDEATHSIG kills it when its parent (the forkserver, which
itself ends with the front door) dies, and end of stream on the socket stops it too.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the socket's end of stream still stops us
    if os.getppid() == 1:
        sys.exit(1)  # the parent died before prctl took effect


def _pin(cpus: list[int] | None, threads: int) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    # torch is loaded already (the forkserver preloads it); the engine sets its threads with
    # torch.set_num_threads, and these reach any library that reads them later.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)


async def _serve(sock: socket.socket) -> int:
    from daemon.replicas.framing import read_frame, write_frame
    from daemon.replicas.replica import ReplicaCore

    reader, writer = await asyncio.open_connection(sock=sock)
    spec = await read_frame(reader)
    core = ReplicaCore(spec, lambda message: write_frame(writer, message))
    hello = await core.start()
    write_frame(writer, hello)
    log = logging.getLogger("headrace.replica")
    log.info("replica %d ready (pid %d, %d threads)", spec.index, hello.pid, hello.threads)

    async def receive() -> None:
        try:
            while not core.stopped.is_set():
                core.handle(await read_frame(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            core.stopped.set()  # the front door went away

    receiver = asyncio.get_running_loop().create_task(receive())
    await core.stopped.wait()
    receiver.cancel()
    await core.stop()
    writer.close()
    if core.failure is not None:
        log.error("replica %d stopped: %s", spec.index, core.failure)
        return 1
    return 0


def run_replica(sock: socket.socket, cpus: list[int] | None, threads: int, log_level: str) -> None:
    """The replica process's target (a forkserver child: torch is already imported)."""
    _die_with_parent()
    _pin(cpus, threads)
    logging.basicConfig(
        level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s", force=True
    )
    # The front door drains and then sends Stop; a stray SIGTERM/SIGINT (systemd signals the
    # whole cgroup, a terminal the process group) must not cut streams.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import uvloop

    sys.exit(uvloop.run(_serve(sock)))
