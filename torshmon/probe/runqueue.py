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
        thread = threading.get_ident()
        if self._thread is None:
            self._thread = thread
            try:
                self._fd = os.open(_PATH, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._fd = None
        if self._fd is None or thread != self._thread:
            return None
        try:
            fields = os.pread(self._fd, 96, 0).split()
            return int(fields[1])
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
