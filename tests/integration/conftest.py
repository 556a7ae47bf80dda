from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.venvs import build_wheel
from torshmon.agent.receiver import ThreadedReceiver
from torshmon.launch import use_forkserver
from torshmon.wire import Batch, Hello, ProbeMessage, StepRecord


class ReceiverThread(ThreadedReceiver):
    """A real receiver on its own thread that keeps every message, for tests that run ranks."""

    def __init__(self, socket_path: Path) -> None:
        self.messages: list[ProbeMessage] = []
        self._lock = threading.Lock()
        super().__init__(socket_path, on_message=self._observe)

    def _observe(self, message: ProbeMessage) -> None:
        with self._lock:
            self.messages.append(message)

    def start(self) -> ReceiverThread:
        super().start()
        return self

    def batches(self, rank: int | None = None) -> list[Batch]:
        with self._lock:
            return [
                m
                for m in self.messages
                if isinstance(m, Batch) and (rank is None or m.rank == rank)
            ]

    def hellos(self) -> list[Hello]:
        with self._lock:
            return [m for m in self.messages if isinstance(m, Hello)]

    def steps(self, rank: int, job: str | None = None) -> list[StepRecord]:
        return [s for b in self.batches(rank) if job is None or b.job == job for s in b.steps]


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[ReceiverThread]:
    rx = ReceiverThread(tmp_path / "agent.sock").start()
    try:
        yield rx
    finally:
        rx.stop()


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once for every install test of the session (a
    build takes 10-15 s on 2 busy cores, and each test installs it into a venv of its own)."""
    return build_wheel(tmp_path_factory.mktemp("wheel") / "dist")


@pytest.fixture(scope="session", autouse=True)
def _ranks_from_a_forkserver() -> Iterator[None]:
    """Tests launch ranks about ninety times: fork them from one server that imported
    torch, about a second each instead of 25-30 s of fresh imports (torshmon.launch).

    The session's ranks run one torch thread each (``OMP_NUM_THREADS=1``, as the server
    imports torch): the tests whose ranks ask for it (a framework's, the Flight
    Recorder's, the load tests') then fork too, where a value that differed from the
    server's would make their every launch a fresh interpreter; and two or more ranks
    on two cores gain nothing from more."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        use_forkserver()
        yield
