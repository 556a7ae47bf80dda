"""The probe's run-queue clock (torshmon/probe/runqueue.py) on this Linux machine."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torshmon.probe.events import CollectiveEvent, StepEvents
from torshmon.probe.runqueue import ProcessRunQueue, RunQueueClock
from torshmon.probe.summary import compute_cpu_wait_ns


@contextlib.contextmanager
def _sharing_a_cpu_with_a_burner() -> Iterator[None]:
    """The calling thread pinned to one CPU that a busy process holds too."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    burner = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.2)  # the burner is running on the CPU
        yield
    finally:
        os.sched_setaffinity(0, before)
        burner.kill()
        burner.wait()


def test_a_thread_sharing_its_cpu_with_a_busy_process_waits_for_it() -> None:
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.fail("no /proc/thread-self/schedstat on this machine (Linux with schedstats)")
    clock = RunQueueClock()
    with _sharing_a_cpu_with_a_burner():
        start = clock.read_ns()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            pass  # runnable all along, one CPU shared with the burner
        waited = clock.read_ns()
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
    assert compute_cpu_wait_ns(4_000_000, events, 0) == 1_000_000
    # never below zero (the two readings bracket part of the step's total)
    assert compute_cpu_wait_ns(2_000_000, events, 0) == 0


def test_without_both_readings_the_whole_step_wait_is_kept() -> None:
    assert compute_cpu_wait_ns(4_000_000, StepEvents(), 0) == 4_000_000
    events = StepEvents(last_grad_ns=100)  # backward never ended inside the step
    events.last_grad_runqueue_ns = 1_000_000
    assert compute_cpu_wait_ns(4_000_000, events, 0) == 4_000_000


def test_the_wake_up_after_a_blocking_collective_is_communication_wait_too() -> None:
    def blocking(start_ns: int, cpu_wait_ns: int) -> CollectiveEvent:
        return CollectiveEvent(
            "all_reduce",
            "0",
            2,
            "float32",
            4,
            start_ns,
            start_ns + 10,
            True,
            cpu_wait_ns=cpu_wait_ns,
        )

    # The second call began before the step (an eval pass's): not part of its wait.
    events = StepEvents(collectives=[blocking(500, 1_000_000), blocking(50, 2_000_000)])
    assert compute_cpu_wait_ns(4_000_000, events, 100) == 3_000_000


_REAL_ALL_REDUCE = """
import torch, torch.distributed as dist
from torshmon.probe.collectives import CollectiveTracer
from torshmon.probe.events import StepEvents
from torshmon.probe.inflight import InflightTable
from torshmon.probe.runqueue import ProcessRunQueue, RunQueueClock

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
events, clock, reads = StepEvents(), RunQueueClock(), []

def read():
    reads.append(clock.read_ns())
    return reads[-1]

tracer = CollectiveTracer(InflightTable(), lambda: events)
tracer.runqueue = read
tracer.install()
dist.all_reduce(torch.ones(4))
dist.all_reduce(torch.ones(4), async_op=True).wait()
tracer.uninstall()
dist.destroy_process_group()
print(len(reads), events.collectives[0].cpu_wait_ns == reads[1] - reads[0])
"""


def test_a_real_blocking_all_reduce_records_its_callers_run_queue_delay() -> None:
    """A gloo group of one, in a process of its own: the wrapper reads the clock around
    the blocking call only, and records the difference."""
    done = subprocess.run(
        [sys.executable, "-c", _REAL_ALL_REDUCE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    # Two reads around the one blocking call; its recorded delay is their difference.
    assert done.stdout.split() == ["2", "True"], (done.stdout, done.stderr[-2000:])


def _spin(go: threading.Event, spun: threading.Event, done: threading.Event) -> None:
    """Once ``go``, run 0.5 s on the CPU, say so, and stay alive until ``done`` (a thread
    that has ended has no schedstat to read)."""
    go.wait()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        pass
    spun.set()
    done.wait()


def test_the_process_clock_sees_a_worker_thread_waiting_for_its_cpu() -> None:
    """``ProcessRunQueue`` sums every thread's delay: a worker thread (as gloo's are)
    sharing one CPU with a busy process waits about half of its 0.5 s, while the
    thread that reads the clock sleeps."""
    clock = ProcessRunQueue()
    go, spun, done = threading.Event(), threading.Event(), threading.Event()
    worker = threading.Thread(target=_spin, args=(go, spun, done))
    try:
        with _sharing_a_cpu_with_a_burner():
            worker.start()  # on the same CPU (a new thread takes its creator's affinity)
            first = clock.read_ns()  # lists the worker
            go.set()
            spun.wait()
            last = clock.read_ns()
    finally:
        done.set()
        worker.join()
    assert first is not None and last is not None
    assert 0.1e9 < last - first < 0.6e9
    clock.close()
    assert clock.read_ns() is None


def test_the_process_clock_forgets_threads_that_ended_and_lists_new_ones() -> None:
    clock = ProcessRunQueue(refresh_every=1)
    assert clock.read_ns() is not None
    worker = threading.Thread(target=time.sleep, args=(0.1,))
    worker.start()
    clock.read_ns()
    assert str(worker.native_id) in clock._fds
    worker.join()
    clock.read_ns()
    assert str(worker.native_id) not in clock._fds
    clock.close()
    assert clock._fds == {}


def test_the_process_clock_reads_idle_threads_only_at_a_refresh() -> None:
    """Between refreshes only threads that ran or waited are read, so 40 sleeping
    threads cost a step nothing; one of them that then waits for its CPU is counted,
    with all it waited, at the next refresh."""
    clock = ProcessRunQueue(refresh_every=4)
    go, spun, done = threading.Event(), threading.Event(), threading.Event()

    sleepers = [threading.Thread(target=done.wait) for _ in range(40)]
    worker = threading.Thread(target=_spin, args=(go, spun, done))
    try:
        with _sharing_a_cpu_with_a_burner():
            for thread in (*sleepers, worker):
                thread.start()
            idle = False
            for _ in range(40):  # refreshes until the new threads have settled
                clock.read_ns()
                while clock._since_refresh:  # 0: that read was a refresh
                    time.sleep(0.01)
                    clock.read_ns()
                if str(worker.native_id) in clock._fds and not any(
                    tid == str(worker.native_id) for tid, _ in clock._active
                ):
                    idle = True
                    break
            assert idle, "the waiting worker never counted as idle"
            assert len(clock._active) < 10 and len(clock._fds) > 40
            first = clock.read_ns()  # the last read was a refresh: this one is not
            go.set()
            spun.wait()
            between = clock.read_ns()
            clock.read_ns()
            at_refresh = clock.read_ns()  # the fourth read since the refresh
    finally:
        go.set()
        done.set()
        for thread in (*sleepers, worker):
            thread.join()
    assert first is not None and between is not None and at_refresh is not None
    assert between - first < 0.05e9  # the worker's wait is not read yet
    assert 0.1e9 < at_refresh - first < 0.6e9
    clock.close()


def test_the_process_clock_keeps_the_watched_threads_own_delay() -> None:
    """What the process clock read of the watched thread is that thread's own clock: a
    thread-self reading just after it is never lower, and under a burner both move by
    the same wait (the step takes it as the thread clock's, one file fewer)."""
    process, own = ProcessRunQueue(refresh_every=3), RunQueueClock()
    process.watch(threading.get_native_id())
    with _sharing_a_cpu_with_a_burner():
        readings = []
        for _ in range(6):  # refreshes and reads between them alike
            assert process.read_ns() is not None
            watched, after = process.watched_ns, own.read_ns()
            assert watched is not None and after is not None
            readings.append((watched, after))
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.1:
                pass
    process.close()
    own.close()
    for watched, after in readings:
        assert 0 <= after - watched < 5_000_000, readings
    moved = readings[-1][0] - readings[0][0]
    assert 0.1e9 < moved < 0.6e9, readings
    assert abs(moved - (readings[-1][1] - readings[0][1])) < 10_000_000, readings
    unwatched = ProcessRunQueue()
    unwatched.read_ns()
    assert unwatched.watched_ns is None
    unwatched.close()


def test_a_thread_left_out_is_not_counted() -> None:
    """The shipper's case: a thread left out waits for its CPU unseen (and its file is
    not read), where the same wait counts without ``leave_out``."""
    clock = ProcessRunQueue(refresh_every=1)
    go, spun, done = threading.Event(), threading.Event(), threading.Event()
    worker = threading.Thread(target=_spin, args=(go, spun, done))
    try:
        with _sharing_a_cpu_with_a_burner():
            worker.start()
            assert worker.native_id is not None
            clock.read_ns()
            assert str(worker.native_id) in clock._fds
            clock.leave_out(worker.native_id)
            assert str(worker.native_id) not in clock._fds
            first = clock.read_ns()
            go.set()
            spun.wait()
            last = clock.read_ns()
    finally:
        go.set()
        done.set()
        worker.join()
    assert first is not None and last is not None
    assert str(worker.native_id) not in clock._fds
    # The reading thread slept meanwhile: the left-out worker's wait (0.1-0.6 s when
    # counted, as the test above shows) is not there.
    assert last - first < 0.05e9
    clock.close()


_STEPS_UNDER_LOAD = """
import os, subprocess, sys, time
import torch.distributed as dist
import torshmon
from torshmon.probe.runqueue import ProcessRunQueue

os.sched_setaffinity(0, {0})
HOG = "import os\\nos.sched_setaffinity(0, {0})\\nwhile True: pass"
hog = subprocess.Popen([sys.executable, "-c", HOG])
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mon = torshmon.attach(None, job="rq", agent_socket=sys.argv[1], cpu_wait=True)
raws = []
values = []  # every reading of the probe's process clock, in order
ends = []  # how many readings there were at each step's end (both clocks read by then)
def put(raw):
    raws.append(raw)
    ends.append(len(values))
    time.sleep(0.0005)  # torshmon's own end-of-step work, as with a DDP job: 0.1-0.3 ms
mon._outbox.put = put
process = ProcessRunQueue(refresh_every=1)
probe_clock = mon._process_runqueue
probe_read = probe_clock.read_ns
def counted():
    value = probe_read()
    values.append(value)
    return value
class Counted:
    read_ns = staticmethod(counted)
    @property
    def watched_ns(self):
        return probe_clock.watched_ns
mon._process_runqueue = Counted()
own_reads = []  # the thread clock's own reads: none, the process clock reads its file
own_clock = mon._runqueue
class OwnCounted:
    def read_ns(self):
        own_reads.append(1)
        return own_clock.read_ns()
mon._runqueue = OwnCounted()
before = process.read_ns()
for _ in range(300):
    with mon.step():
        # Computing well beyond the 0.5 ms put: otherwise the hog can get its share in
        # the sleeps and hardly preempt the steps (12-25 ms of wait over the loop).
        sum(range(100_000))
after = process.read_ns()
hog.kill()
mon._process_runqueue = probe_clock
mon._runqueue = own_clock
shipper_read = str(mon._shipper.native_id) in probe_clock._fds
thread_waits = sum(r.cpu_wait_ns for r in raws)
mon.close()
steps = sum(r.process_cpu_wait_ns for r in raws)
# A step that read its start afresh (the core taken between the previous exit and its
# start) leaves the wait since the previous end reading to no step: the gap's.
gaps = sum(
    values[ends[k - 1]] - values[ends[k - 1] - 1]
    for k in range(1, len(ends))
    if ends[k] - ends[k - 1] == 2
)
print(len(raws), after - before, steps, len(values), gaps, values[-1] - values[0])
print(len(own_reads), shipper_read, thread_waits)
"""


def test_steps_straight_after_each_other_share_their_readings_and_lose_no_wait(
    tmp_path: Path,
) -> None:
    """A loop with nothing between its steps: each step's start takes the previous
    end's readings (one read a step, though torshmon's own end-of-step work comes
    between them), and the steps' run-queue delays add up to the process's over the
    loop, a CPU hog on the same core making it large."""
    done = subprocess.run(
        [sys.executable, "-c", _STEPS_UNDER_LOAD, str(tmp_path / "no-agent.sock")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    count, loop_ns, steps_ns, reads, gaps_ns, clock_ns = (int(x) for x in first.split())
    own_reads, shipper_read, thread_waits_ns = second.split()
    seen = f"loop {loop_ns} ns, steps {steps_ns}, gaps {gaps_ns}, clock {clock_ns}, {reads} reads"
    assert count == 300
    assert loop_ns > 50_000_000, seen  # the hog held the core a good part of the loop
    # One read a step (and the first step's start), two only where the hog took the
    # core between a step's exit and the next one's start: never for most steps.
    assert 300 < reads < 400, seen
    # Each step is charged exactly the wait between its readings, reused or not: the
    # steps and the gaps between them (wait outside any step) add up to what the
    # probe's clock moved over the loop, to the nanosecond.
    assert steps_ns + gaps_ns == clock_ns, seen
    # And that clock, reading only the threads that ran lately, saw the process's wait:
    # a second clock reading every thread at every read agrees. On two shared cores the
    # steps held 0.99-1.0 of it; CI's machine once 0.85, the rest not known: the
    # figures in the message say whether gaps or the clock fell short.
    assert 0.8 * loop_ns <= clock_ns <= loop_ns, seen
    # The training thread's own wait came from the process clock's reads of its file
    # (no read of its own clock), and was most of the process's: it did the computing.
    # The shipper (lower priority, waiting long behind the hog) was not read at all.
    assert own_reads == "0", second
    assert shipper_read == "False", second
    assert 0.5 * steps_ns <= int(thread_waits_ns) <= steps_ns, (seen, second)
