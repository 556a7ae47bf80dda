"""The shipper sends only to an agent of a trusted user (``torshmon.probe.shipper``).

The foreign agent is a real listener in a process that runs as uid 65534, so the
kernel's peer credentials are what the probe reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torshmon.probe.events import RawStep, StepEvents
from torshmon.probe.inflight import InflightTable
from torshmon.probe.shipper import Outbox, Shipper
from torshmon.wire import SCHEMA_VERSION, Hello

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs a listener as another uid")


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
    received, clients = 0, []
    while True:
        ready, _, _ = select.select([server, stop_fd, *clients], [], [])
        if stop_fd in ready:
            return received
        for sock in ready:
            if sock is server:
                clients.append(server.accept()[0])
            else:
                data = sock.recv(65536)
                received += len(data)
                if not data:
                    clients.remove(sock)
                    sock.close()


@pytest.fixture
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


def _hello() -> Hello:
    return Hello(
        v=SCHEMA_VERSION,
        session="s",
        job="j",
        rank=0,
        world_size=1,
        local_rank=0,
        node="n",
        pid=os.getpid(),
        backend="gloo",
        torch_version="test",
        probe_version="test",
    )


def _raw_step(n: int) -> RawStep:
    now = time.time_ns()
    return RawStep(
        step=n,
        start_ns=time.perf_counter_ns(),
        end_ns=time.perf_counter_ns() + 1_000_000,
        end_unix_ns=now,
        batch_size=4,
        loss=None,
        events=StepEvents(),
        ddp_logging=None,
    )


def _ship(path: Path, steps: int, trusted_uids: frozenset[int] | None = None) -> Shipper:
    """Run a shipper while ``steps`` steps are put, as the training thread does."""
    outbox: Outbox[RawStep] = Outbox(1000)
    shipper = Shipper(
        socket_path=str(path),
        hello=_hello(),
        outbox=outbox,
        inflight=InflightTable(),
        flush_interval_s=0.05,
        poll_s=0.01,
        max_buffered_steps=10,
        reconnect_max_s=0.1,
        trusted_uids=trusted_uids,
    )
    shipper.start()
    for n in range(steps):
        outbox.put(_raw_step(n))  # training goes on: a put never waits or raises
        time.sleep(0.01)
    shipper.close(timeout_s=2.0)
    return shipper


def test_a_socket_served_by_another_uid_gets_nothing_and_training_goes_on(
    foreign_agent: tuple[Path, ForeignAgent], caplog: pytest.LogCaptureFixture
) -> None:
    path, agent = foreign_agent
    with caplog.at_level(logging.WARNING, logger="torshmon.probe.shipper"):
        shipper = _ship(path, steps=50)
    assert agent.received() == 0
    assert shipper.dropped_records_total >= 40  # as with no agent: kept 10 at most, dropped
    refusals = [r.getMessage() for r in caplog.records if f"uid {NOBODY}" in r.getMessage()]
    assert len(refusals) == 1, refusals  # said once, though it tried again and again


def test_the_same_socket_gets_the_data_when_its_user_is_trusted(
    foreign_agent: tuple[Path, ForeignAgent],
) -> None:
    """The control: the listener does see what a probe sends to it."""
    path, agent = foreign_agent
    _ship(path, steps=5, trusted_uids=frozenset({os.geteuid(), 0, NOBODY}))
    assert agent.received() > 0


def test_the_agent_user_is_trusted_by_name_or_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    from torshmon.probe.shipper import trusted_agent_uids

    monkeypatch.setenv("TORSHMON_AGENT_USER", "nobody")
    assert trusted_agent_uids() == {os.geteuid(), 0, NOBODY}
    monkeypatch.setenv("TORSHMON_AGENT_USER", "4242")
    assert trusted_agent_uids() == {os.geteuid(), 0, 4242}
    monkeypatch.setenv("TORSHMON_AGENT_USER", "no-such-user-here")
    assert trusted_agent_uids() == {os.geteuid(), 0}
