"""The probe's run-queue clock (torshmon/probe/runqueue.py) on this Linux machine."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from torshmon.probe.events import StepEvents
from torshmon.probe.monitor import _compute_cpu_wait_ns
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


def test_the_wait_for_ddps_reduction_is_not_counted_as_compute_wait() -> None:
    # A thread woken from its wait for the reduction on a busy node waits for a CPU
    # first: that delay lengthened the communication wait, not the compute.
    events = StepEvents(last_grad_ns=100, backward_end_ns=900)
    events.last_grad_runqueue_ns = 2_000_000
    events.backward_end_runqueue_ns = 5_000_000
    assert _compute_cpu_wait_ns(4_000_000, events) == 1_000_000
    # never below zero (the two readings bracket part of the step's total)
    assert _compute_cpu_wait_ns(2_000_000, events) == 0


def test_without_both_readings_the_whole_step_wait_is_kept() -> None:
    assert _compute_cpu_wait_ns(4_000_000, StepEvents()) == 4_000_000
    events = StepEvents(last_grad_ns=100)  # backward never ended inside the step
    events.last_grad_runqueue_ns = 1_000_000
    assert _compute_cpu_wait_ns(4_000_000, events) == 4_000_000
