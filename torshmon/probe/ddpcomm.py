"""DDP's own collectives (its bucket all-reduces) from torch's Flight Recorder, filed
under the steps they ran in, on the shipper's thread.

DDP reduces its buckets in C++, unseen by the probe's collective wrappers; a Python comm
hook would see them at about 0.3 ms a bucket on the training thread. The Flight Recorder
(``probe.flightrec``) records every collective natively, so the shipper reads it instead:
each read dumps the ring buffer once, keeps the new entries of the DDP module's process
group, and hands every step held since the last read its own, those enqueued after the
previous step's end and up to its own (wall clock). Entries enqueued inside a call the
probe traced itself (a job's ``dist.all_reduce``) are that call's, already counted.

Never on the training thread, but a dump holds the GIL throughout (``flightrec``), so the
training thread waits for it: reads are spaced so they take at most ``READ_BUDGET`` of
the time (and no closer than the job's collectives need: ``MAX_SPACING_S``), and only a
buffer of at most ``MAX_BUFFER_ENTRIES`` is read (a full default one,
2 000 entries, takes 60-130 ms). The size is read once, as the first process group
starts: ``torshmon run`` sets ``TORCH_FR_BUFFER_SIZE`` to ``DEFAULT_BUFFER_ENTRIES`` where
the job did not; a job that attaches itself sets it before ``init_process_group``.

gloo's entries carry no time (``flightrec``): their rows have bytes and counts and no
duration or bandwidth. NCCL's carry the GPU's duration where ``TORCH_NCCL_ENABLE_TIMING=1``.
Steps whose buckets the probe's comm hook reduced (codecs, ``bucket_timing``) take none:
the hook counted them.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from torshmon.probe import flightrec
from torshmon.probe.events import CollectiveEvent, RawStep
from torshmon.ratelog import LogLimiter

log = logging.getLogger(__name__)

#: what ``torshmon run`` sets ``TORCH_FR_BUFFER_SIZE`` to where the job sets neither
#: variable: 256 entries dump in about 1.5 ms (2-core box), and hold 0.5 s of a job that
#: runs 500 collectives a second
DEFAULT_BUFFER_ENTRIES = 256
#: the largest buffer read: 400 entries dumped in 6 ms, 800 in 23 (superlinear)
MAX_BUFFER_ENTRIES = 512
#: at most this share of the time goes to reads (their CPU time: the GIL is held)
READ_BUDGET = 0.005
#: the longest wait between reads (s): a step waits at most about this long for its
#: read; a job whose collectives would fill half the buffer sooner is read sooner
#: (within the budget)
MAX_SPACING_S = 0.5
#: how far outside a traced call (ns) the enqueue of its own entry may seem to lie: the
#: two clocks are read a few microseconds apart at each read
_SLACK_NS = 100_000
#: an asynchronous traced call enqueues as it starts: its entry lies this close to it
_ASYNC_ENQUEUE_NS = 1_000_000


class DdpCollectives:
    """Files the Flight Recorder's entries of one process group under the steps they
    ran in. ``file`` and everything else run on the shipper's thread only.

    ``pg_name``: the group's ``group_name`` as the recorder names it; ``pg_label`` and
    ``group_size``: as the probe's own records of it have them. Entries enqueued before
    ``since_unix_ns`` (the attach) are left out. ``read``, ``clock`` (monotonic s),
    ``cpu_clock`` (the thread's CPU s), ``wall_ns`` and ``perf_ns`` are injectable.
    """

    def __init__(
        self,
        *,
        pg_name: str,
        pg_label: str,
        group_size: int,
        since_unix_ns: int,
        capacity: int = DEFAULT_BUFFER_ENTRIES,
        read: Callable[[int], list[flightrec.FrCollective]] = flightrec.read,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
        wall_ns: Callable[[], int] = time.time_ns,
        perf_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self._pg_name = pg_name
        self._pg_label = pg_label
        self._group_size = group_size
        self._since_ns = since_unix_ns
        self._capacity = capacity
        self._read = read
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._wall_ns = wall_ns
        self._perf_ns = perf_ns
        self._held: list[RawStep] = []
        self._carry: deque[flightrec.FrCollective] = deque()
        self._last_id = -1
        self._next_read = 0.0
        self._last_read: float | None = None
        self._off = False
        self._log = LogLimiter()
        self.reads = 0
        self.read_cpu_s = 0.0
        #: entries overwritten before a read reached them (the buffer wrapped)
        self.lost_total = 0

    def file(self, steps: list[RawStep], *, final: bool = False) -> list[RawStep]:
        """The steps that may go now, oldest first, each with its DDP collectives added
        to its events: those held so far and ``steps``, once a read after their end has
        filed them (at once where ``final`` or the read budget allows one now)."""
        self._held += steps
        if self._off:
            out, self._held = self._held, []
            return out
        if not self._held or (not final and self._clock() < self._next_read):
            return []
        out, self._held = self._held, []
        self._read_into(out)
        return out

    def _read_into(self, steps: list[RawStep]) -> None:
        started = self._cpu_clock()
        try:
            fresh = self._read(self._last_id)
        except Exception:  # the job comes first: its steps go without these rows
            self._off = True
            log.warning(
                "torshmon: reading the Flight Recorder failed; DDP's collectives "
                "go unrecorded from now on",
                exc_info=True,
            )
            return
        spent = max(0.0, self._cpu_clock() - started)
        self.reads += 1
        self.read_cpu_s += spent
        self._schedule(spent, len(fresh))
        offset = self._wall_ns() - self._perf_ns()  # wall clock minus perf_counter, now
        self._take(fresh)
        for step in steps:
            mine = []
            while self._carry and self._carry[0].created_ns <= step.end_unix_ns:
                mine.append(self._carry.popleft())
            if mine and not step.events.buckets:  # else the probe's hook counted them
                step.events.collectives.extend(self._untraced(mine, step, offset))

    def _schedule(self, spent_s: float, entries: int) -> None:
        """The next read: when half the buffer will have filled at the rate since the
        last one (at most ``MAX_SPACING_S`` on), never sooner than the budget allows."""
        now = self._clock()
        spacing = MAX_SPACING_S
        if self._last_read is not None and entries and now > self._last_read:
            fill_s = self._capacity / 2 / (entries / (now - self._last_read))
            spacing = min(spacing, fill_s)
        self._last_read = now
        self._next_read = now + max(spacing, spent_s / READ_BUDGET)

    def _take(self, fresh: list[flightrec.FrCollective]) -> None:
        """Keep the group's new entries; count those the buffer lost before this read."""
        if not fresh:
            return
        if self._last_id >= 0 and fresh[0].record_id > self._last_id + 1:
            lost = fresh[0].record_id - self._last_id - 1
            self.lost_total += lost
            if self._log.allow("lost"):
                log.warning(
                    "torshmon: %d collectives left the Flight Recorder before it was read "
                    "(a buffer of %d entries): their steps lack them; a larger "
                    "TORCH_FR_BUFFER_SIZE (at most %d) keeps more",
                    lost,
                    self._capacity,
                    MAX_BUFFER_ENTRIES,
                )
        self._last_id = fresh[-1].record_id
        for entry in fresh:
            if entry.pg_name == self._pg_name and entry.created_ns > self._since_ns:
                self._carry.append(entry)
        while len(self._carry) > self._capacity:  # no step came to take them
            self._carry.popleft()

    def _untraced(
        self, entries: list[flightrec.FrCollective], step: RawStep, offset: int
    ) -> list[CollectiveEvent]:
        """``entries`` as the step's collective events, less those enqueued inside a
        call the probe's wrappers recorded (on the same group) in the step."""
        windows = []
        for e in step.events.collectives:
            if e.pg != self._pg_label:
                continue
            end = e.end_ns if e.blocking else min(e.end_ns, e.start_ns + _ASYNC_ENQUEUE_NS)
            windows.append((e.start_ns + offset - _SLACK_NS, end + offset + _SLACK_NS))
        out = []
        for entry in entries:
            if any(lo <= entry.created_ns <= hi for lo, hi in windows):
                continue
            start = entry.created_ns - offset
            timed = entry.duration_s is not None
            end = start + round(entry.duration_s * 1e9) if entry.duration_s is not None else start
            out.append(
                CollectiveEvent(
                    entry.op,
                    self._pg_label,
                    self._group_size,
                    entry.dtype,
                    entry.bytes or 0,
                    start,
                    end,
                    False,
                    timed=timed,
                )
            )
        return out


def for_module(
    module: Any, pg_label: str, *, hooked: bool, env: Mapping[str, str] | None = None
) -> DdpCollectives | None:
    """The reader of a DDP ``module``'s collectives, or None (and one line that says
    why) where there is none to read: no module, the probe's comm hook on every bucket
    (``hooked``), or a Flight Recorder that is off or too large to read cheaply."""
    if module is None or hooked:
        return None
    size = flightrec.buffer_size(os.environ if env is None else env)
    if size is None or not 0 < size <= MAX_BUFFER_ENTRIES:
        log.info(
            "torshmon: DDP's all-reduces go unrecorded: the Flight Recorder holds %s "
            "entries; set TORCH_FR_BUFFER_SIZE=%d (1-%d) before init_process_group "
            "(torshmon run does)",
            "torch's default number of" if size is None else size,
            DEFAULT_BUFFER_ENTRIES,
            MAX_BUFFER_ENTRIES,
        )
        return None
    group = module.process_group
    backend = _backend(group)
    return DdpCollectives(
        pg_name=str(group.group_name),
        pg_label=pg_label,
        group_size=int(group.size()),
        since_unix_ns=time.time_ns(),
        capacity=size,
        read=functools.partial(flightrec.read, backend=backend),
    )


def _backend(group: Any) -> str:
    """The group's backend as torch names it ("nccl", "gloo"); "" where it cannot say."""
    try:
        import torch.distributed as dist

        return str(dist.get_backend(group))
    except Exception:  # an odd group: the generic recorder is the one to read
        return ""


__all__ = ["DEFAULT_BUFFER_ENTRIES", "MAX_BUFFER_ENTRIES", "DdpCollectives", "for_module"]
