"""The aggregator's live series: recent samples per metric and label set, in memory.

The alert rules read from here; the history in SQL is separate. Metric names are
the Prometheus names without the ``torshmon_`` prefix (``step_duration_seconds``).
Each series holds its points in time order in two arrays of doubles (times, values):
no Python object per point, so ingest appends in C and the garbage collector has
nothing to walk. A non-finite loss is stored as NaN; each series notes where its
newest non-finite value is, so the ``nonfinite`` rule reads no points.

How much of a series is kept is the readers' need: a store built with ``windows_s``
keeps points for the metrics named there (the windows of the rules that read
points, such as ``rate`` and ``nonfinite``) and only the newest point of every other
metric (all that threshold and absence rules read).

Thread safety: none. The aggregator owns one store on its event-loop thread.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from array import array
from collections.abc import Mapping, Sequence
from typing import TypeAlias

__all__ = ["Changes", "Cursor", "LabelSet", "SeriesStore", "labelset", "labelset_from"]

#: Labels of one series as ``(name, value)`` pairs sorted by name: hashable, cheap to key.
LabelSet: TypeAlias = tuple[tuple[str, str], ...]

#: Where a reader of ``SeriesStore.changes`` got to in one metric: opaque.
Cursor: TypeAlias = tuple[int, int, int]

#: The series of a metric whose newest point changed, from ``SeriesStore.changes``:
#: ``(serial, labels, ts_unix_s, value)`` of its newest point. The serial names the
#: series and orders the series as the store lists them.
Changes: TypeAlias = list[tuple[int, LabelSet, float, float]]

_serials = itertools.count()


def labelset(**labels: str) -> LabelSet:
    """The sorted LabelSet of keyword labels: ``labelset(job="j", rank="0")``."""
    return tuple(sorted(labels.items()))


def labelset_from(labels: Mapping[str, str] | LabelSet) -> LabelSet:
    """The sorted LabelSet of a mapping or of ``(name, value)`` pairs in any order."""
    if isinstance(labels, tuple):
        return tuple(sorted(labels))
    return tuple(sorted(labels.items()))


class _Series:
    """One series: times and values from ``start`` on are its points, oldest first.

    Points before ``start`` are dead (evicted by the point bound or expired); they are
    cut off in one move once they outnumber the live ones, so appends stay O(1)
    amortised. A ``newest_only`` series holds one point, overwritten in place.

    ``cut`` counts the points cut off the front of the arrays, so ``cut + i`` numbers
    the point at index ``i`` for the series' whole life; ``serial`` tells series apart,
    in every store. ``nonfinite_at`` is the index of the newest NaN or infinite value
    (-1: none); it is a point of the series while it is at least ``start``. A
    ``newest_only`` series keeps neither (its one point is read instead), so
    ``put_newest``, the hot path of most metrics, does no more than store the point.
    """

    __slots__ = (
        "changes",
        "cut",
        "key",
        "newest_only",
        "nonfinite_at",
        "serial",
        "start",
        "ts",
        "values",
    )

    def __init__(self, key: LabelSet, newest_only: bool, changes: list[_Series]) -> None:
        self.key = key
        self.changes = changes  # the metric's log of changed series
        self.ts = array("d")
        self.values = array("d")
        self.start = 0
        self.newest_only = newest_only
        self.cut = 0
        self.nonfinite_at = -1
        self.serial = next(_serials)

    def __len__(self) -> int:
        return len(self.ts) - self.start

    def append(self, ts_unix_s: float, value: float) -> None:
        self.ts.append(ts_unix_s)
        self.values.append(value)
        if not math.isfinite(value):
            self.nonfinite_at = len(self.values) - 1

    def extended(self, values: Sequence[float]) -> None:
        """Note the ``values`` just appended (the hot path has tested their sum: finite
        only if every value is, as NaN and infinities carry through it)."""
        end = len(self.values)
        for back, value in enumerate(reversed(values), 1):
            if not math.isfinite(value):
                self.nonfinite_at = end - back
                return

    def put_newest(self, ts_unix_s: float, value: float) -> None:
        """Make (ts, value) the only point (a ``newest_only`` series)."""
        if self.ts:
            self.ts[0] = ts_unix_s
            self.values[0] = value
        else:
            self.ts.append(ts_unix_s)
            self.values.append(value)

    def trim(self, max_points: int) -> None:
        """Keep the newest ``max_points`` points."""
        end = len(self.ts)
        if end - self.start > max_points:
            self.start = end - max_points
            self.compact()

    def compact(self) -> None:
        """Cut off the dead prefix once it is as long as the live points (each cut moves
        at most as many points as it frees: O(1) amortised per point)."""
        start = self.start
        if start and 2 * start >= len(self.ts):
            del self.ts[:start]
            del self.values[:start]
            self.start = 0
            self.cut += start
            self.nonfinite_at = max(self.nonfinite_at - start, -1)


class SeriesStore:
    """Recent points per (metric, label set), bounded in age and in count.

    ``retention_s`` bounds the age ``expire`` keeps: a series whose newest point is
    older goes. ``windows_s`` (None: every metric keeps all its points for
    ``retention_s``) maps the metrics whose points are read to how far back they are
    read (seconds before ``expire``'s now); every other metric keeps its newest point
    only. ``max_points`` bounds each series (the oldest points go first). Points are
    expected in time order per series: a point older than the series' latest is
    dropped and counted in ``out_of_order_total`` (rules read the newest points;
    history is in SQL). Raises ValueError for a non-positive retention, point bound or
    window.
    """

    __slots__ = (
        "_changes",
        "_due",
        "_id",
        "_max_points",
        "_removals",
        "_removed",
        "_rows",
        "_series",
        "_windows_s",
        "out_of_order_total",
        "retention_s",
    )

    def __init__(
        self,
        *,
        retention_s: float = 900.0,
        max_points: int = 4096,
        windows_s: Mapping[str, float] | None = None,
    ) -> None:
        if not retention_s > 0:
            raise ValueError(f"retention_s must be positive, got {retention_s}")
        if max_points < 1:
            raise ValueError(f"max_points must be at least 1, got {max_points}")
        for metric, window_s in (windows_s or {}).items():
            if not window_s > 0:
                raise ValueError(f"the window of {metric} must be positive, got {window_s}")
        self.retention_s = float(retention_s)
        self._max_points = max_points
        self._windows_s = None if windows_s is None else dict(windows_s)
        self._series: dict[str, dict[LabelSet, _Series]] = {}
        # The same series by label set, then metric: a batch hashes its labels once.
        self._rows: dict[LabelSet, dict[str, _Series]] = {}
        # A heap of (a time at or before a series' newest point, serial, metric, labels),
        # one entry per series: ``expire`` visits a series only once that time is past the
        # retention, rather than every series on every call (the newest point only grows,
        # so an entry is never late; a series that turns out newer goes back in).
        self._due: list[tuple[float, int, str, LabelSet]] = []
        # Per metric, a log of the series whose newest point changed, one entry per change
        # (an append: the cheapest note ingest can take), as [number of its first entry,
        # entries]; and the removal count when it last lost a series. ``changes`` reads
        # the log from a reader's cursor on; ``expire`` cuts off the old part.
        self._id = next(_serials)
        self._changes: dict[str, tuple[list[int], list[_Series]]] = {}
        self._removals = 0
        self._removed: dict[str, int] = {}
        self.out_of_order_total = 0

    def _get(self, metric: str, labels: Mapping[str, str] | LabelSet, ts_unix_s: float) -> _Series:
        """The series, made if new: its first point will be at ``ts_unix_s``."""
        key = labels if isinstance(labels, tuple) else tuple(sorted(labels.items()))
        by_labels = self._series.get(metric)
        if by_labels is None:
            by_labels = self._series[metric] = {}
            self._changes.setdefault(metric, ([0], []))
        series = by_labels.get(key)
        if series is None:
            windows = self._windows_s
            newest_only = windows is not None and metric not in windows
            log = self._changes[metric][1]
            series = by_labels[key] = _Series(key, newest_only, log)
            self._rows.setdefault(key, {})[metric] = series
            # A NaN time is never older than anything: expire looks at it every call.
            due = ts_unix_s if ts_unix_s == ts_unix_s else -math.inf
            heapq.heappush(self._due, (due, series.serial, metric, key))
        return series

    def add(
        self, metric: str, labels: Mapping[str, str] | LabelSet, ts_unix_s: float, value: float
    ) -> None:
        """Append one point. A tuple is taken as an already sorted LabelSet (``labelset()``)."""
        series = self._get(metric, labels, ts_unix_s)
        ts = series.ts
        if len(ts) > series.start and ts_unix_s < ts[-1]:
            self.out_of_order_total += 1
            return
        series.changes.append(series)
        if series.newest_only:
            series.put_newest(ts_unix_s, value)
            return
        series.append(ts_unix_s, value)
        series.trim(self._max_points)

    def add_many(
        self,
        labels: Mapping[str, str] | LabelSet,
        ts_unix_s: Sequence[float],
        values_by_metric: Mapping[str, Sequence[float]],
    ) -> None:
        """Append points at the times ``ts_unix_s`` to the series ``labels`` of each
        metric, as ``add`` would one by one (same order, same out-of-order rule).

        The hot path of ingest: one call per probe batch for all its step metrics.
        Raises ValueError when a metric's values and the times differ in length.
        """
        n = len(ts_unix_s)
        for metric, values in values_by_metric.items():
            if len(values) != n:
                raise ValueError(f"{n} times but {len(values)} values of {metric}")
        if not n:
            return
        key = labels if isinstance(labels, tuple) else tuple(sorted(labels.items()))
        in_order = True
        previous = ts_unix_s[0]
        for t in ts_unix_s:
            if t < previous:
                in_order = False
                break
            previous = t
        first, last, max_points = ts_unix_s[0], ts_unix_s[-1], self._max_points
        isfinite = math.isfinite
        row = self._rows.get(key)
        for metric, values in values_by_metric.items():
            series = row.get(metric) if row is not None else None
            if series is None:
                series = self._get(metric, key, first)
            ts = series.ts
            if not in_order or (len(ts) > series.start and first < ts[-1]):
                for t, v in zip(ts_unix_s, values, strict=True):
                    self.add(metric, key, t, v)
                continue
            series.changes.append(series)
            if series.newest_only:
                series.put_newest(last, values[-1])
            else:
                ts.extend(ts_unix_s)
                series.values.extend(values)
                if not isfinite(sum(values)):
                    series.extended(values)
                if len(ts) - series.start > max_points:
                    series.trim(max_points)

    def latest(self, metric: str) -> list[tuple[LabelSet, float, float]]:
        """The newest point of every series of ``metric``: ``(labels, ts_unix_s, value)``."""
        by_labels = self._series.get(metric)
        if by_labels is None:
            return []
        return [(key, s.ts[-1], s.values[-1]) for key, s in by_labels.items()]

    def points(
        self, metric: str, labels: Mapping[str, str] | LabelSet, since_unix_s: float
    ) -> list[tuple[float, float]]:
        """Points of one series at or after ``since_unix_s``, oldest first ([] if unknown)."""
        by_labels = self._series.get(metric)
        if by_labels is None:
            return []
        found = by_labels.get(labelset_from(labels))
        if found is None:
            return []
        ts = found.ts
        first = bisect.bisect_left(ts, since_unix_s, found.start)
        return list(zip(ts[first:], found.values[first:], strict=True))

    def columns(
        self, metric: str, labels: LabelSet, since_unix_s: float
    ) -> tuple[array[float], array[float]]:
        """Times and values of the points of one series at or after ``since_unix_s``
        (copies, oldest first; empty if the series is unknown). ``labels`` is sorted."""
        found = self._series.get(metric, {}).get(labels)
        if found is None:
            return array("d"), array("d")
        first = bisect.bisect_left(found.ts, since_unix_s, found.start)
        return found.ts[first:], found.values[first:]

    def changes(self, metric: str, since: Cursor | None) -> tuple[Cursor, bool, Changes]:
        """What changed in the newest points of ``metric`` since the cursor a reader got
        from its last call: a new cursor, whether this is every series, and the series.

        Usually the series whose newest point is new, in no order (O(changed series): a
        rule can keep what it found for the others). Every series, in the store's order,
        when one went (expired, forgotten), when ``since`` is None or another store's, or
        when the reader is so far behind that the log no longer reaches back to it: the
        reader starts again from these.
        """
        first, log = self._changes.get(metric, ([0], []))
        cursor = (self._id, first[0] + len(log), self._removals)
        if (
            since is None
            or since[0] != self._id
            or since[1] < first[0]
            or self._removed.get(metric, -1) >= since[2]
        ):
            every = self._series.get(metric, {}).values()
            out = [(s.serial, s.key, s.ts[-1], s.values[-1]) for s in every]
            self._cut_log(metric)
            return cursor, True, out
        new = dict.fromkeys(log[since[1] - first[0] :])
        self._cut_log(metric)
        return cursor, False, [(s.serial, s.key, s.ts[-1], s.values[-1]) for s in new]

    def _cut_log(self, metric: str) -> None:
        """Cut off the older half of a metric's change log once it holds over two changes
        per series (a reader that far behind reads every series, no more than that)."""
        first, log = self._changes.get(metric, ([0], []))
        keep = len(self._series.get(metric, ())) + 64
        if len(log) > 2 * keep:
            cut = len(log) - keep
            del log[:cut]
            first[0] += cut

    def newest_nonfinite(self, metric: str) -> dict[LabelSet, float]:
        """Time of the newest NaN or infinite point of every series of ``metric`` that
        holds one (Unix seconds). O(series): each series keeps track as points come."""
        by_labels = self._series.get(metric)
        if by_labels is None:
            return {}
        out = {}
        for key, s in by_labels.items():
            if s.nonfinite_at >= s.start:
                out[key] = s.ts[s.nonfinite_at]
            elif s.newest_only and not math.isfinite(s.values[0]):
                out[key] = s.ts[0]
        return out

    def last_seen(self, metric: str) -> dict[LabelSet, float]:
        """Time of the newest point of every series of ``metric`` (Unix seconds)."""
        by_labels = self._series.get(metric)
        if by_labels is None:
            return {}
        return {key: s.ts[-1] for key, s in by_labels.items()}

    def metrics(self) -> set[str]:
        """Names of the metrics that have at least one series."""
        return set(self._series)

    def series_count(self) -> int:
        """Number of series held, over all metrics."""
        return sum(len(by_labels) for by_labels in self._series.values())

    def expire(self, now_unix_s: float) -> int:
        """Drop series whose newest point is older than ``retention_s``, and points older
        than their metric's window (``retention_s`` without ``windows_s``) but the newest;
        returns the points dropped."""
        cutoff = now_unix_s - self.retention_s
        dropped = self._drop_idle(cutoff)
        for metric in self._changes:
            self._cut_log(metric)
        windows = self._windows_s
        for metric, by_labels in self._series.items():
            if windows is None:
                points_cutoff = cutoff
            elif metric in windows:
                points_cutoff = max(cutoff, now_unix_s - windows[metric])
            else:
                continue  # newest point only: nothing to trim
            # The series with anything to drop, found without hashing every label set.
            for series in [s for s in by_labels.values() if not s.ts[s.start] >= points_cutoff]:
                # The newest point stays: threshold and absence rules read it.
                ts = series.ts
                first = min(bisect.bisect_left(ts, points_cutoff, series.start), len(ts) - 1)
                dropped += first - series.start
                series.start = first
                series.compact()
        return dropped

    def _drop_idle(self, cutoff: float) -> int:
        """Drop the series whose newest point is older than ``cutoff``; returns their points."""
        due = self._due
        dropped = 0
        later = []
        while due and due[0][0] < cutoff:
            _, serial, metric, key = heapq.heappop(due)
            by_labels = self._series.get(metric)
            if by_labels is None:
                continue  # forgotten
            series = by_labels.get(key)
            if series is None or series.serial != serial:
                continue  # forgotten (and perhaps back as another series)
            newest = series.ts[-1]
            if newest < cutoff:
                dropped += len(series)
                self._remove(metric, by_labels, series)
            else:
                later.append((newest if newest == newest else -math.inf, serial, metric, key))
        for entry in later:
            heapq.heappush(due, entry)
        return dropped

    def _remove(self, metric: str, by_labels: dict[LabelSet, _Series], series: _Series) -> None:
        key = series.key
        del by_labels[key]
        if not by_labels:
            del self._series[metric]
        row = self._rows[key]
        del row[metric]
        if not row:
            del self._rows[key]
        self._removed[metric] = self._removals
        self._removals += 1

    def forget(self, match: Mapping[str, str]) -> int:
        """Drop every series whose labels include all of ``match`` (e.g. a finished job).

        Returns the number of series dropped. Raises ValueError for an empty match,
        which would drop everything.
        """
        if not match:
            raise ValueError("forget() needs at least one label to match; an empty match is all")
        wanted = set(match.items())
        dropped = 0
        for metric, by_labels in list(self._series.items()):
            for series in [s for key, s in by_labels.items() if wanted.issubset(key)]:
                self._remove(metric, by_labels, series)
                dropped += 1
        return dropped
