"""The sd_notify protocol and socket activation, without libsystemd.

sd_notify: one datagram per message to the AF_UNIX socket named in $NOTIFY_SOCKET ('@'
means the abstract namespace). Socket activation: $LISTEN_PID names us and $LISTEN_FDS
counts inherited listening sockets starting at fd 3.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import MutableMapping

LISTEN_FDS_START = 3


class Notifier:
    """Sends READY/STATUS/WATCHDOG/STOPPING when run by systemd; does nothing otherwise."""

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET")
        if address and address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address
        self.watchdog_interval: float | None = None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if usec and (pid is None or pid == str(os.getpid())):
            # Ping at half the timeout, as sd_watchdog_enabled(3) recommends.
            self.watchdog_interval = int(usec) / 1e6 / 2
        self._last_ping = 0.0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        if not self.address:
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.connect(self.address)
                sock.sendall("\n".join(lines).encode())
            except OSError:
                return False
        return True

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self, status: str = "draining") -> None:
        """STOPPING=1, and no more watchdog pings: from here systemd's stop timeout
        governs, and a stop path that hangs must not look alive."""
        self.watchdog_interval = None
        self.notify("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> None:
        """Ping if the interval has passed; called from every engine-loop iteration."""
        if self.watchdog_interval is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval:
            self._last_ping = now
            self.notify("WATCHDOG=1")


def inherited_sockets(environ: MutableMapping[str, str] | None = None) -> list[socket.socket]:
    """Listening sockets passed by systemd (or systemd-socket-activate); [] when none.

    The variables are removed afterwards so child processes do not think they own them.
    """
    env = os.environ if environ is None else environ
    if env.get("LISTEN_PID") != str(os.getpid()):
        return []
    count = int(env.get("LISTEN_FDS", "0"))
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(key, None)
    out = []
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + count):
        os.set_inheritable(fd, False)
        out.append(socket.socket(fileno=fd))
    return out
