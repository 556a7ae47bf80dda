"""How long a thread waited for a CPU: Linux's run-queue delay of the training thread.

``/proc/thread-self/schedstat`` holds three numbers for the calling thread: nanoseconds
on a CPU, nanoseconds runnable but waiting for one (the run-queue delay), and time
slices. The probe reads the second at each step's start and end; the difference is the
part of the step the training thread was ready to run and another process (or thread)
had its CPU. A rank slowed that way is not slow itself: its node is busy. The straggler
detector compares ranks net of it, as a GPU job's kernel times are free of it.

The file is opened once, by the thread that reads it (``thread-self`` resolves to the
opening thread), and read with ``pread``: about 2 us. Where the file is missing (not
Linux, schedstats off) or unreadable, every reading is None and nothing is reported.

``ProcessRunQueue`` sums the same delay over every thread of the process (gloo's and
NCCL's workers, the data loader's pin thread, the training thread): a busy node holds
back a job's communication threads as well, and a step then takes longer with its
compute unchanged. The training thread reads it at each step's start and end, as the
step's own clock: samples taken elsewhere (the shipper's, 50 ms apart) smeared a
burst's delay over the steps around it and told too little. A step that starts within
0.2 ms of the previous scope's exit (no input wait between) takes that step's end
readings of both clocks as its own start's (``Monitor``): one read of each a step, not
two. The process clock reads the training thread's file with the others and keeps its
value (``watch``), which the step takes as the thread clock's at its ends; torshmon's own
shipper thread is left out (``leave_out``): it runs at a lower priority, and its wait
for a CPU, which can be long on a busy core, holds no step back. What a read costs in a
training loop is its first system call: 10-30 us after the step's compute has evicted
the kernel's path from the caches (any system call pays 3-5 us there; 0.4 us in a tight
loop), the files read right after it about 1 us each. So a step pays for each place it
reads a clock (the last gradient, the end of backward, the step's end), hardly for how
many files it reads there.
"""

from __future__ import annotations

import contextlib
import os
import threading

_PATH = "/proc/thread-self/schedstat"


class RunQueueClock:
    """Cumulative run-queue delay of the thread that first reads it, in nanoseconds."""

    __slots__ = ("_fd", "_thread")

    def __init__(self) -> None:
        self._fd: int | None = None
        self._thread: int | None = None

    def read_ns(self) -> int | None:
        """The delay so far, or None (no schedstat, or called from another thread)."""
        fd = self._fd
        if fd is None or self._thread != threading.get_ident():
            if self._thread is not None:
                return None  # another thread's, closed, or no file
            self._thread = threading.get_ident()
            try:
                fd = self._fd = os.open(_PATH, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            return int(os.pread(fd, 96, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        """Close the file; later reads say None (a clock closed before its first read
        never opens it)."""
        fd, self._fd = self._fd, None
        self._thread = -1  # no thread's ident: read_ns neither opens nor reads
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


_TASKS = "/proc/self/task"


class ProcessRunQueue:
    """Cumulative run-queue delay summed over the process's threads, in nanoseconds.

    Adds up what each thread's delay grew since it was last read, so a thread that
    starts or ends moves the total only by what it waited in between (a thread's wait
    after its last read is lost when it ends). Every ``refresh_every`` reads the thread
    list is read again and every thread's schedstat is read (about 1.5 us each); the
    reads between touch only the threads that ran or waited since the refresh before.
    An idle thread (a sleeping OpenMP worker, a finished job's gloo threads) accrues no
    delay, and one that wakes up is read, with all it waited, at the next refresh: the
    total stays exact, and a step costs the active threads' reads (a gloo rank has
    about 7), not the process's every thread. Read from one thread at a time.
    """

    __slots__ = (
        "_active",
        "_fds",
        "_last",
        "_left_out",
        "_ok",
        "_refresh_every",
        "_since_refresh",
        "_stamp",
        "_total",
        "_watched",
        "watched_ns",
    )

    def __init__(self, *, refresh_every: int = 64) -> None:
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
        self._refresh_every = refresh_every
        self._fds: dict[str, int] = {}
        self._last: dict[str, int] = {}  # each thread's delay when last read
        # Each thread's CPU time plus delay at the last refresh: unchanged means idle.
        self._stamp: dict[str, int] = {}
        self._active: list[tuple[str, int]] = []
        self._total = 0
        self._since_refresh = refresh_every  # the first read lists the threads
        self._ok = os.path.isdir(_TASKS)
        self._left_out: set[str] = set()
        self._watched: str | None = None
        #: the watched thread's own delay as the last ``read_ns`` read it (None: not read)
        self.watched_ns: int | None = None

    def watch(self, native_id: int) -> None:
        """Keep thread ``native_id``'s own delay, read with the others, in ``watched_ns``."""
        self._watched = str(native_id)

    def leave_out(self, native_id: int) -> None:
        """Do not count thread ``native_id`` (from the next read on)."""
        tid = str(native_id)
        self._left_out.add(tid)
        self._active = [(t, fd) for t, fd in self._active if t != tid]
        self._forget(tid)

    def read_ns(self) -> int | None:
        """The delay so far, or None (no schedstat)."""
        self.watched_ns = None
        if not self._ok:
            return None
        self._since_refresh += 1
        if self._since_refresh >= self._refresh_every:
            self._since_refresh = 0
            self._refresh()
        else:
            # The training thread reads this at each step's end, with cold caches: the
            # loop makes as few calls as it can (every active thread has a last reading:
            # the refresh that made it active took one).
            last = self._last
            total = self._total
            watched = self._watched
            pread = os.pread
            for tid, fd in self._active:
                try:
                    delay = int(pread(fd, 96, 0).split()[1])
                except (OSError, IndexError, ValueError):
                    continue  # ended: the next refresh forgets it
                before = last[tid]
                if delay > before:
                    total += delay - before
                    last[tid] = delay
                if tid == watched:
                    self.watched_ns = delay
            self._total = total
        return self._total if self._fds else None

    def _refresh(self) -> None:
        """List the threads, read every one, and keep those that ran or waited since."""
        try:
            tids = set(os.listdir(_TASKS))
        except OSError:
            self._ok = False
            self.close()
            return
        for tid in set(self._fds) - tids:
            self._forget(tid)
        for tid in tids - set(self._fds) - self._left_out:
            try:
                self._fds[tid] = os.open(f"{_TASKS}/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
        last, stamp = self._last, self._stamp
        total = self._total
        active = []
        for tid, fd in list(self._fds.items()):
            try:
                fields = os.pread(fd, 96, 0).split()
                ran, delay = int(fields[0]), int(fields[1])
            except (OSError, IndexError, ValueError):
                self._forget(tid)  # the thread ended
                continue
            before = last.get(tid)
            if before is not None and delay > before:
                total += delay - before
            last[tid] = delay
            if tid == self._watched:
                self.watched_ns = delay
            if stamp.get(tid) != ran + delay:
                stamp[tid] = ran + delay
                active.append((tid, fd))
        self._total = total
        self._active = active

    def _forget(self, tid: str) -> None:
        fd = self._fds.pop(tid, None)
        self._last.pop(tid, None)
        self._stamp.pop(tid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Close every file; later reads say None."""
        self._ok = False
        self._active = []
        for tid in list(self._fds):
            self._forget(tid)
