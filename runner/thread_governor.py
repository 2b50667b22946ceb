"""How many threads the next CPU step gets: every core while we have them, one when we do not.

libgomp's workers spin between parallel regions (its default). On a quiet machine that is
what makes a decode step fast: a forward opens hundreds of small regions, and a sleeping
worker (OMP_WAIT_POLICY=PASSIVE) costs a futex wake-up — tens of microseconds in a VM — at
each of them (measured: bs=1 decode 74 ms passive vs 44 ms spinning, benchmarks/threads_check.py).
But when something else holds a core (a neighbour, a busy event loop), a spinning team waits
at every barrier for a worker that is not running: a step slowed 10x.

So the runner measures, over windows of steps, whether it got the cores it asked for:
- with n > 1 threads, the process's CPU time over (wall time x n) — a descheduled worker
  does not accrue CPU time; below `share_floor`, the next steps run on one thread (no team,
  nothing to wait for);
- with one thread, the idle time of the machine (/proc/stat) — when at least `idle_floor` of
  the other cores sat idle, the team comes back;
- with one thread and no /proc/stat (systemd's ProcSubset=pid hides it, and other sandboxes
  do), a probe: after `probe_s` the team runs one window and keeps the cores if it got
  `share_floor` of them; a failed probe doubles the wait (up to `max_probe_s`), so a busy
  machine pays one slow window in `max_probe_s` at most.
Torch-free; the engine applies `threads()` with torch.set_num_threads on the runner thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def read_idle_seconds() -> float | None:
    """Idle + iowait seconds of all CPUs since boot (Linux /proc/stat), None elsewhere."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu" or len(fields) < 6:
        return None
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Chooses 1 or `max_threads` per step from measured CPU share; see the module doc."""

    def __init__(
        self,
        max_threads: int,
        window_s: float = 0.3,
        share_floor: float = 0.7,
        idle_floor: float = 0.6,
        probe_s: float = 2.0,
        max_probe_s: float = 60.0,
        wall: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], float] = time.process_time,
        idle: Callable[[], float | None] = read_idle_seconds,
    ) -> None:
        self.max_threads = max_threads
        self.window_s, self.share_floor, self.idle_floor = window_s, share_floor, idle_floor
        self._wall, self._cpu, self._idle = wall, cpu, idle
        self.probe_s, self.max_probe_s = probe_s, max_probe_s
        # Without the machine's idle time: single-thread wall time until the next probe.
        self._blind = idle() is None
        self._probe_wait, self._single_wall, self._probing = probe_s, 0.0, False
        self.current = max_threads
        self.switches = 0
        # Why the thread count last changed (for the log line).
        self.reason = "start"
        self._reset()

    def _reset(self) -> None:
        self._win_wall = self._win_cpu = self._win_idle = 0.0
        self._step: tuple[float, float, float | None] | None = None

    @property
    def enabled(self) -> bool:
        return self.max_threads > 1

    def threads(self) -> int:
        """Threads for the step about to run; call `step_done()` when it ends."""
        # The machine's idle time decides only on one thread: reading /proc/stat twice a
        # step costs ~0.1 ms, 2% of a batch-1 step.
        idle = self._idle() if self.current == 1 and not self._blind else None
        self._step = (self._wall(), self._cpu(), idle)
        return self.current

    def step_done(self) -> None:
        if self._step is None:
            return
        wall0, cpu0, idle0 = self._step
        idle1 = self._idle() if idle0 is not None else None
        self._win_wall += self._wall() - wall0
        self._win_cpu += self._cpu() - cpu0
        if idle0 is not None and idle1 is not None:
            self._win_idle += idle1 - idle0
        self._step = None
        if self._win_wall >= self.window_s:
            self._decide()

    def _decide(self) -> None:
        if self.current > 1:
            share = self._win_cpu / (self._win_wall * self.current)
            if share < self.share_floor:
                if self._probing:  # the cores are still taken: wait longer next time
                    self._probe_wait = min(2 * self._probe_wait, self.max_probe_s)
                self._switch(1, f"our threads got {share:.0%} of their cores")
            elif self._probing:
                self._probe_wait = self.probe_s
            self._probing = False
        elif self._blind:
            self._single_wall += self._win_wall
            if self._single_wall >= self._probe_wait:
                self._single_wall, self._probing = 0.0, True
                self._switch(self.max_threads, "probing (no /proc/stat to read idle cores)")
        else:
            # Idle cores while our one thread ran (clock ticks: coarse, hence the window).
            idle_cores = self._win_idle / self._win_wall
            if idle_cores >= self.idle_floor * (self.max_threads - 1):
                self._switch(self.max_threads, f"{idle_cores:.2f} cores sat idle")
        self._win_wall = self._win_cpu = self._win_idle = 0.0

    def _switch(self, n: int, reason: str) -> None:
        self.current, self.reason = n, reason
        self.switches += 1
