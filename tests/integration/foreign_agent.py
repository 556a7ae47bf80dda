"""A Unix socket served by another uid (65534), for the probe's owner check.

The listener runs in a forked child that drops to uid 65534 before it binds, so
both the socket file's owner and the kernel's peer credentials name that uid.
Needs root.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

NOBODY = 65534


class ForeignAgent:
    """A listener at ``path`` in a forked child running as uid 65534 that counts the
    bytes its clients send; ``received()`` stops it and returns the count."""

    def __init__(self, path: Path) -> None:
        ready_r, ready_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self._result_r, result_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.close(self._stop_w)  # else its own copy keeps the stop pipe open
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                os.write(result_w, b"%d" % _serve(path, ready_w, self._stop_r))
                code = 0
            finally:
                os._exit(code)
        for fd in (ready_w, self._stop_r, result_w):
            os.close(fd)
        ready = os.read(ready_r, 5)
        os.close(ready_r)
        if ready != b"ready":
            raise RuntimeError("the foreign listener did not start")

    def received(self) -> int:
        os.close(self._stop_w)
        os.waitpid(self.pid, 0)
        with os.fdopen(self._result_r, "rb") as result:
            return int(result.read())

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)


def _serve(path: Path, ready_fd: int, stop_fd: int) -> int:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    os.write(ready_fd, b"ready")
    received = 0
    clients: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([server.fileno(), stop_fd, *clients], [], [])
        if stop_fd in ready:
            return received
        for fd in ready:
            if fd == server.fileno():
                client = server.accept()[0]
                clients[client.fileno()] = client
                continue
            data = clients[fd].recv(65536)
            received += len(data)
            if not data:
                clients.pop(fd).close()


@contextlib.contextmanager
def foreign_agent() -> Iterator[tuple[Path, ForeignAgent]]:
    """An agent socket served by uid 65534, in a folder of that uid (in the temp dir:
    pytest's own folders are root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="torshmon-foreign-"))
    os.chown(folder, NOBODY, NOBODY)
    path = folder / "agent.sock"
    agent = ForeignAgent(path)
    try:
        yield path, agent
    finally:
        agent.kill()
        shutil.rmtree(folder)
