"""Collectives in flight on this rank, so a hang can be attributed to a rank.

Thread safety: ``begin`` and ``end`` are called from the training thread, the
autograd thread and communication threads; they only use operations that are
atomic under the GIL (``next`` on a counter, dict item set and pop). ``fail``, rare,
counts under a lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

from torshmon.wire import TEXT_MAX_CHARS, CollectiveFailures, InflightOp

#: The longest exception text kept of a failed collective.
_ERROR_MAX_CHARS = min(TEXT_MAX_CHARS, 500)


class _Entry(NamedTuple):
    pg: str
    seq: int
    op: str
    size_bytes: int
    peer: int | None
    start_unix_ns: int
    start_perf_ns: int


class InflightTable:
    """Sequence numbers per process group and the set of unfinished collectives.

    Collectives are numbered per group; point-to-point ops per (group, peer), so
    the same number on two ranks names the same operation.
    """

    def __init__(self) -> None:
        self._tokens = itertools.count()
        self._seqs: dict[tuple[str, int | None], Iterator[int]] = {}
        self._open: dict[int, _Entry] = {}
        self._failures: dict[tuple[str, str], CollectiveFailures] = {}
        self._failures_lock = threading.Lock()
        self._failure_count = 0

    def begin(self, pg: str, op: str, size_bytes: int, peer: int | None = None) -> int:
        """Register an op as entered; returns the token to pass to ``end``."""
        key = (pg, peer)
        counter = self._seqs.get(key)
        if counter is None:
            counter = self._seqs.setdefault(key, itertools.count(1))
        token = next(self._tokens)
        # tuple.__new__ skips the named tuple's Python-level __new__: 3 us of the
        # 16 us the last gradient's hook spends here on a loaded core (in-situ medians).
        self._open[token] = tuple.__new__(
            _Entry,
            (pg, next(counter), op, size_bytes, peer, time.time_ns(), time.perf_counter_ns()),
        )
        return token

    def end(self, token: int) -> None:
        """Mark an op as finished (successfully or not); unknown tokens are ignored."""
        self._open.pop(token, None)

    def fail(self, token: int, error: BaseException) -> None:
        """Mark an op as finished by raising ``error``: counted per (op, group) in
        ``failures``. Unknown tokens are ignored."""
        entry = self._open.pop(token, None)
        if entry is not None:
            self.count_failure(entry.op, entry.pg, error)

    def count_failure(self, op: str, pg: str, error: BaseException) -> None:
        """Count one failed ``op`` on group ``pg`` that raised ``error``."""
        text = f"{type(error).__name__}: {error}"[:_ERROR_MAX_CHARS]
        with self._failures_lock:
            before = self._failures.get((op, pg))
            self._failures[(op, pg)] = CollectiveFailures(
                op=op,
                pg=pg,
                count=1 if before is None else before.count + 1,
                last_error=text,
                last_unix_ns=time.time_ns(),
            )
            self._failure_count += 1

    def failure_count(self) -> int:
        """Failed collectives since this table was made, all ops together."""
        return self._failure_count

    def failures(self) -> list[CollectiveFailures]:
        """Failed collectives since this table was made, per (op, group)."""
        with self._failures_lock:
            return list(self._failures.values())

    def __len__(self) -> int:
        return len(self._open)

    def oldest(self, now_perf_ns: int | None = None) -> list[InflightOp]:
        """The oldest unfinished op of each (group, peer), oldest first."""
        now = time.perf_counter_ns() if now_perf_ns is None else now_perf_ns
        oldest: dict[tuple[str, int | None], _Entry] = {}
        for entry in self._open.copy().values():
            key = (entry.pg, entry.peer)
            current = oldest.get(key)
            if current is None or entry.seq < current.seq:
                oldest[key] = entry
        ordered = sorted(oldest.values(), key=lambda e: e.start_perf_ns)
        return [
            InflightOp(
                pg=e.pg,
                seq=e.seq,
                op=e.op,
                size_bytes=e.size_bytes,
                start_unix_ns=e.start_unix_ns,
                age_s=max(0.0, (now - e.start_perf_ns) / 1e9),
                peer=e.peer,
            )
            for e in ordered
        ]
