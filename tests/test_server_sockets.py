import os
import socket
import stat

import pytest

from daemon.service.server import bind_unix_socket
from daemon.service.systemd import Notifier, inherited_sockets


def test_unix_socket_mode_and_stale_file_replaced(tmp_path):
    path = str(tmp_path / "s.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # a crashed server leaves its socket file behind
    sock = bind_unix_socket(path)
    try:
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660
        with pytest.raises(FileExistsError, match="another server"):
            bind_unix_socket(path)  # a live one is never taken over
    finally:
        sock.close()


def test_unix_socket_refuses_to_replace_a_regular_file(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("keep me")
    with pytest.raises(FileExistsError, match="not a socket"):
        bind_unix_socket(str(path))
    assert path.read_text() == "keep me"


def test_notifier_speaks_sd_notify_to_abstract_and_path_sockets(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind("\0headrace-test-notify")
    n = Notifier({"NOTIFY_SOCKET": "@headrace-test-notify", "WATCHDOG_USEC": "1000000"})
    n.ready("serving")
    msg = listener.recv(1024).decode().splitlines()
    assert msg[0] == "READY=1" and "STATUS=serving" in msg
    assert n.watchdog_interval == 0.5
    n.watchdog()
    assert listener.recv(1024) == b"WATCHDOG=1"
    n.watchdog()  # rate-limited: nothing within the interval
    listener.settimeout(0.1)
    with pytest.raises(TimeoutError):
        listener.recv(1024)
    listener.close()
    assert not Notifier({}).notify("READY=1")  # not under systemd: a no-op


def test_inherited_sockets_only_for_our_pid():
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1"}
    assert inherited_sockets(env) == [] and "LISTEN_FDS" in env
