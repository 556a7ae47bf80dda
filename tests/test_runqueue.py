"""The probe's run-queue clock (torshmon/probe/runqueue.py) on this Linux machine."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from torshmon.probe.runqueue import RunQueueClock


def test_a_thread_sharing_its_cpu_with_a_busy_process_waits_for_it() -> None:
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.fail("no /proc/thread-self/schedstat on this machine (Linux with schedstats)")
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    burner = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    clock = RunQueueClock()
    try:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.2)  # the burner is running on the CPU
        start = clock.read_ns()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            pass  # runnable all along, one CPU shared with the burner
        waited = clock.read_ns()
    finally:
        os.sched_setaffinity(0, before)
        burner.kill()
        burner.wait()
        clock.close()
    assert start is not None and waited is not None
    # Fair sharing gives each about half of the 0.5 s: the wait is most of the other half.
    assert 0.1e9 < waited - start < 0.6e9


def test_another_thread_reads_nothing() -> None:
    clock = RunQueueClock()
    assert clock.read_ns() is not None
    seen: list[int | None] = []
    thread = threading.Thread(target=lambda: seen.append(clock.read_ns()))
    thread.start()
    thread.join()
    assert seen == [None]
    clock.close()
    assert clock.read_ns() is None  # closed
