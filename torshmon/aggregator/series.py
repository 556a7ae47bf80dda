"""The aggregator's live series: recent samples per metric and label set, in memory.

The alert rules read from here; the history in SQL is separate. Metric names are
the Prometheus names without the ``torshmon_`` prefix (``step_duration_seconds``).
Each series is a bounded deque of ``(ts_unix_s, value)`` points in time order; a
non-finite loss is stored as NaN.

Thread safety: none. The aggregator owns one store on its event-loop thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TypeAlias

__all__ = ["LabelSet", "SeriesStore", "labelset", "labelset_from"]

#: Labels of one series as ``(name, value)`` pairs sorted by name: hashable, cheap to key.
LabelSet: TypeAlias = tuple[tuple[str, str], ...]

_Points: TypeAlias = deque[tuple[float, float]]


def labelset(**labels: str) -> LabelSet:
    """The sorted LabelSet of keyword labels: ``labelset(job="j", rank="0")``."""
    return tuple(sorted(labels.items()))


def labelset_from(labels: Mapping[str, str] | LabelSet) -> LabelSet:
    """The sorted LabelSet of a mapping or of ``(name, value)`` pairs in any order."""
    if isinstance(labels, tuple):
        return tuple(sorted(labels))
    return tuple(sorted(labels.items()))


class SeriesStore:
    """Recent points per (metric, label set), bounded in age and in count.

    ``retention_s`` bounds the age ``expire`` keeps; ``max_points`` bounds each
    series (the oldest points go first). Points are expected in time order per
    series: a point older than the series' latest is dropped and counted in
    ``out_of_order_total`` (rules read the newest points; history is in SQL).
    Raises ValueError for a non-positive retention or point bound.
    """

    __slots__ = ("_max_points", "_series", "out_of_order_total", "retention_s")

    def __init__(self, *, retention_s: float = 900.0, max_points: int = 4096) -> None:
        if not retention_s > 0:
            raise ValueError(f"retention_s must be positive, got {retention_s}")
        if max_points < 1:
            raise ValueError(f"max_points must be at least 1, got {max_points}")
        self.retention_s = float(retention_s)
        self._max_points = max_points
        self._series: dict[str, dict[LabelSet, _Points]] = {}
        self.out_of_order_total = 0

    def add(
        self, metric: str, labels: Mapping[str, str] | LabelSet, ts_unix_s: float, value: float
    ) -> None:
        """Append one point. A tuple is taken as an already sorted LabelSet (``labelset()``)."""
        # The hot path of ingest (~10^5 points/s): a tuple skips the sort, so callers
        # that build a LabelSet once per rank pay only two dict lookups and an append.
        key = labels if isinstance(labels, tuple) else tuple(sorted(labels.items()))
        by_labels = self._series.get(metric)
        if by_labels is None:
            by_labels = self._series[metric] = {}
        points = by_labels.get(key)
        if points is None:
            points = by_labels[key] = deque(maxlen=self._max_points)
        elif ts_unix_s < points[-1][0]:
            self.out_of_order_total += 1
            return
        points.append((ts_unix_s, value))

    def latest(self, metric: str) -> list[tuple[LabelSet, float, float]]:
        """The newest point of every series of ``metric``: ``(labels, ts_unix_s, value)``."""
        by_labels = self._series.get(metric)
        if by_labels is None:
            return []
        return [(key, *points[-1]) for key, points in by_labels.items()]

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
        # Rules ask for a recent window: walk back from the newest point only as far
        # as needed (indexing the middle of a deque is O(n)).
        recent: list[tuple[float, float]] = []
        for point in reversed(found):
            if point[0] < since_unix_s:
                break
            recent.append(point)
        recent.reverse()
        return recent

    def last_seen(self, metric: str) -> dict[LabelSet, float]:
        """Time of the newest point of every series of ``metric`` (Unix seconds)."""
        by_labels = self._series.get(metric)
        if by_labels is None:
            return {}
        return {key: points[-1][0] for key, points in by_labels.items()}

    def metrics(self) -> set[str]:
        """Names of the metrics that have at least one series."""
        return set(self._series)

    def series_count(self) -> int:
        """Number of series held, over all metrics."""
        return sum(len(by_labels) for by_labels in self._series.values())

    def expire(self, now_unix_s: float) -> int:
        """Drop points older than ``retention_s`` and series left empty; returns points dropped."""
        cutoff = now_unix_s - self.retention_s
        dropped = 0
        for metric in list(self._series):
            by_labels = self._series[metric]
            for key in list(by_labels):
                points = by_labels[key]
                while points and points[0][0] < cutoff:
                    points.popleft()
                    dropped += 1
                if not points:
                    del by_labels[key]
            if not by_labels:
                del self._series[metric]
        return dropped

    def forget(self, match: Mapping[str, str]) -> int:
        """Drop every series whose labels include all of ``match`` (e.g. a finished job).

        Returns the number of series dropped. Raises ValueError for an empty match,
        which would drop everything.
        """
        if not match:
            raise ValueError("forget() needs at least one label to match; an empty match is all")
        wanted = set(match.items())
        dropped = 0
        for metric in list(self._series):
            by_labels = self._series[metric]
            for key in [key for key in by_labels if wanted.issubset(key)]:
                del by_labels[key]
                dropped += 1
            if not by_labels:
                del self._series[metric]
        return dropped
