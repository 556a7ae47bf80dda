from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from torshmon.agent.receiver import ProbeReceiver
from torshmon.wire import Batch, Hello, ProbeMessage, StepRecord


class ReceiverThread:
    """A real ProbeReceiver on its own event loop thread, for tests that run ranks."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.messages: list[ProbeMessage] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.receiver = ProbeReceiver(socket_path, on_message=self._observe)

    def _observe(self, message: ProbeMessage) -> None:
        with self._lock:
            self.messages.append(message)

    def _call(self, coro: object) -> None:
        future: Future[None] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        future.result(timeout=10)

    def start(self) -> ReceiverThread:
        self._thread.start()
        self._call(self.receiver.start())
        return self

    def stop(self) -> None:
        self._call(self.receiver.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

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
