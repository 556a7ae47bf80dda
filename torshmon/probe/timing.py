"""How long a collective took: on the host (gloo) or on the device (NCCL).

On gloo a collective runs while the calling thread waits, so the host's clock times
it. On NCCL the call only enqueues a kernel and returns: the host's clock would time
the enqueue. There the probe times on the device instead and reads the result later,
without ever synchronising the training stream:

- a blocking collective (``async_op=False``) gets a pair of CUDA events recorded on
  the caller's current stream around the call (``CudaEventTiming``): NCCL's stream
  waits for that stream before it starts and the call makes that stream wait for
  NCCL's before it returns, so the pair spans the collective as the training stream
  sees it, waiting for peers included;
- an asynchronous one keeps its ``Work``: with NCCL's own timing on
  (``TORCH_NCCL_ENABLE_TIMING=1`` before the process group is made, as
  ``torshmon.launch`` sets it) the Work knows its kernel's duration
  (``WorkTiming``); without it the host's completion time stands (the future's
  callback), and the step says so.

A step leaves the probe once every device timing of it is ready, in order; a timing
still not ready after ``StepGate.max_wait_s`` keeps its host figure and is counted.
``DeviceClock`` decides per call which kind to take; ``resolve`` turns ready timings
into the events' durations. On NCCL a step also records ``StepMarks`` on the training
stream, so its duration and its DDP communication wait (compute is the rest) are the
device's too. Both sides are behind the small ``PendingTiming``
protocol, so the matching, deferral and reading are tested on CPU with fake events
(``tests/test_probe_timing.py``).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

from torshmon.probe.events import BucketEvent, CollectiveEvent

__all__ = [
    "NCCL_TIMING_ENV",
    "CudaEventTiming",
    "DeviceClock",
    "PendingTiming",
    "StepGate",
    "StepMarks",
    "WorkTiming",
    "resolve",
    "resolve_buckets",
]

NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"
T = TypeVar("T")


class PendingTiming(Protocol):
    """A device measurement that completes later."""

    def ready(self) -> bool:
        """Whether the device has finished it (never blocks)."""
        ...

    def seconds(self) -> float:
        """Its duration; only once ``ready()``. May raise if the device cannot say."""
        ...


class CudaEventTiming:
    """Two CUDA events (``enable_timing=True``) recorded around a call on one stream."""

    __slots__ = ("_end", "_start")

    def __init__(self, start: Any, end: Any) -> None:
        self._start = start
        self._end = end

    def ready(self) -> bool:
        return bool(self._end.query())

    def seconds(self) -> float:
        return float(self._start.elapsed_time(self._end)) / 1000.0


class WorkTiming:
    """NCCL's own timing of an asynchronous collective (its Work's start and end
    events; needs ``TORCH_NCCL_ENABLE_TIMING=1``)."""

    __slots__ = ("_work",)

    def __init__(self, work: Any) -> None:
        self._work = work

    def ready(self) -> bool:
        return bool(self._work.is_completed())

    def seconds(self) -> float:
        return float(self._work._get_duration()) / 1000.0


class DeviceClock:
    """Which timing a collective on a process group of ``backend`` gets.

    ``event_factory`` makes a CUDA event that can time (``torch.cuda.Event(
    enable_timing=True)``); ``nccl_timing`` says whether NCCL times its Works itself.
    Host-timed backends (gloo, mpi) get None everywhere: the wrapper's own clock stands.
    """

    def __init__(
        self,
        *,
        event_factory: Callable[[], Any] | None,
        nccl_timing: bool | None = None,
    ) -> None:
        self._event = event_factory
        self.nccl_timing = (
            os.environ.get(NCCL_TIMING_ENV, "0") not in ("", "0")
            if nccl_timing is None
            else nccl_timing
        )

    @staticmethod
    def for_torch() -> DeviceClock | None:
        """The clock of this process: CUDA events where CUDA is available; None without
        CUDA, so a CPU job's collectives pay nothing for it (the host clock stands)."""
        import torch

        if not torch.cuda.is_available():
            return None
        return DeviceClock(event_factory=lambda: torch.cuda.Event(enable_timing=True))

    def on_device(self, backend: str) -> bool:
        return self._event is not None and backend == "nccl"

    def before(self, backend: str) -> Any:
        """A start event recorded now on the current stream, or None (host timing)."""
        if not self.on_device(backend) or self._event is None:
            return None
        start = self._event()
        start.record()
        return start

    def mark(self) -> Any:
        """A CUDA event recorded now on the current stream (None without CUDA)."""
        if self._event is None:
            return None
        event = self._event()
        event.record()
        return event

    def after_blocking(self, start: Any) -> PendingTiming | None:
        """The timing of a blocking call begun with ``start`` (from ``before``)."""
        if start is None or self._event is None:
            return None
        end = self._event()
        end.record()
        return CudaEventTiming(start, end)

    def after_async(self, backend: str, work: Any) -> PendingTiming | None:
        """The timing of an asynchronous call's ``work``: NCCL's own, where it keeps one."""
        if not self.on_device(backend) or not self.nccl_timing or work is None:
            return None
        return WorkTiming(work)


class StepMarks:
    """CUDA events a step records on the training (current) stream: at its start, after
    its last gradient (backward compute over), when backward returned (DDP has made the
    stream wait for its buckets by then) and at its end. Read once ``end`` is done (the
    last on the stream, so the others are too): the step as the GPU ran it, and DDP's
    communication exposed after backward compute, however far the host ran ahead."""

    __slots__ = ("backward_end", "end", "last_grad", "start")

    def __init__(self, start: Any) -> None:
        self.start = start
        self.last_grad: Any = None
        self.backward_end: Any = None
        self.end: Any = None

    def ready(self) -> bool:
        return self.end is not None and bool(self.end.query())

    def seconds(self) -> float:
        return float(self.start.elapsed_time(self.end)) / 1000.0

    def split(self) -> tuple[float, float | None] | None:
        """(the step's seconds on the device, DDP's exposed communication in seconds or
        None without a backward); None when not ready or the device cannot say."""
        try:
            if not self.ready():
                return None
            step_s = self.seconds()
            ddp_s = None
            if self.last_grad is not None and self.backward_end is not None:
                ddp_s = max(0.0, float(self.last_grad.elapsed_time(self.backward_end)) / 1000.0)
        except RuntimeError:
            return None
        return (step_s, ddp_s) if step_s >= 0.0 else None


def resolve(events: Iterable[CollectiveEvent]) -> tuple[list[CollectiveEvent], int]:
    """The events with each ready device timing as their duration (from their host
    start), and how many device timings could not be read (not ready, or the device
    said no): those keep their host times."""
    return _resolved(events, "start_ns", "end_ns")


def resolve_buckets(buckets: Iterable[BucketEvent]) -> tuple[list[BucketEvent], int]:
    """``resolve`` for DDP buckets: each ready device timing as the bucket's duration
    from its launch; the count of those that could not be read (host times kept)."""
    return _resolved(buckets, "launch_ns", "done_ns")


_Timed = TypeVar("_Timed", CollectiveEvent, BucketEvent)


def _resolved(items: Iterable[_Timed], start: str, end: str) -> tuple[list[_Timed], int]:
    """Each item's ``end`` moved to its ``start`` plus its ready device timing (``device``
    cleared either way); the count of timings that could not be read."""
    out: list[_Timed] = []
    unread = 0
    for item in items:
        timing = item.device
        if timing is None:
            out.append(item)
            continue
        seconds = _seconds(timing)
        if seconds is None:
            unread += 1
            out.append(item._replace(device=None))
            continue
        ends_ns = getattr(item, start) + round(seconds * 1e9)
        out.append(item._replace(device=None, **{end: ends_ns}))
    return out, unread


def _seconds(timing: PendingTiming) -> float | None:
    """A ready timing's seconds; None when not ready or the device cannot say."""
    try:
        seconds = timing.seconds() if timing.ready() else None
    except RuntimeError:
        return None
    return seconds if seconds is not None and seconds >= 0.0 else None


class StepGate(Generic[T]):
    """Holds steps until their device timings are ready, and lets them go in order.

    ``pending(step)`` gives a step's timings. A step is released once all are ready,
    or once it has waited ``max_wait_s`` (then ``resolve`` keeps the host figures of
    those not ready); a step is never released before an earlier one. Runs on the
    shipper thread: ``ready()`` never blocks.
    """

    def __init__(
        self,
        pending: Callable[[T], Iterable[PendingTiming]],
        *,
        max_wait_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pending = pending
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._held: deque[tuple[float, T]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def add(self, steps: Iterable[T]) -> None:
        now = self._clock()
        self._held.extend((now, step) for step in steps)

    def ready(self, *, final: bool = False) -> list[T]:
        """The steps that may go now, oldest first (all of them when ``final``)."""
        out: list[T] = []
        now = self._clock()
        while self._held:
            since, step = self._held[0]
            if not final and now - since < self._max_wait_s and not self._done(step):
                break
            out.append(step)
            self._held.popleft()
        return out

    def _done(self, step: T) -> bool:
        for timing in self._pending(step):
            try:
                if not timing.ready():
                    return False
            except RuntimeError:
                continue  # resolve() counts it as unread
        return True
