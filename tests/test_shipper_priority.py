"""The shipper thread runs below the training thread's priority (``SHIPPER_NICE``)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.test_shipper import _hello
from torshmon.probe.inflight import InflightTable
from torshmon.probe.shipper import SHIPPER_NICE, Shipper, StepOutbox, lower_thread_priority

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's"
)


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_the_shipper_thread_runs_lower_and_the_training_thread_keeps_its_priority(
    tmp_path: Path,
) -> None:
    ours = _nice(threading.get_native_id())
    shipper = Shipper(
        socket_path=str(tmp_path / "no-agent.sock"),
        hello=_hello(),
        outbox=StepOutbox(8),
        inflight=InflightTable(),
    )
    shipper.start()
    try:
        tid = shipper._thread.native_id
        assert tid is not None
        deadline = time.monotonic() + 5.0
        while _nice(tid) == ours and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _nice(tid) == min(19, ours + SHIPPER_NICE)
        assert _nice(threading.get_native_id()) == ours
        assert _nice(os.getpid()) == ours  # the process's main thread, whoever runs this
    finally:
        shipper.close()


def test_lowering_stops_at_the_lowest_priority() -> None:
    seen: list[tuple[bool, int]] = []

    def lower_twice() -> None:
        lower_thread_priority(15)
        seen.append((lower_thread_priority(15), _nice(threading.get_native_id())))

    thread = threading.Thread(target=lower_twice)
    thread.start()
    thread.join()
    assert seen == [(True, 19)]
