"""Rolling baselines of one series: the mean and standard deviation, or the median and
scaled median absolute deviation, of its last ``window`` values (``zscore.py``'s bands)."""

from __future__ import annotations

import bisect
import math
import statistics
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Final

#: Absolute floor on the standard deviation, so a constant series never divides by 0.
TINY_STD: Final = 1e-12


class RollingStats:
    """Mean and sample standard deviation of the last ``window`` values.

    O(1) amortised per ``add``: Welford updates for the value added and the value
    evicted, and a full recomputation after every ``window`` evictions so that rounding
    error from the removals cannot build up over a long run. The window is a ring of
    doubles (no object per value for the garbage collector to walk).
    """

    __slots__ = ("_head", "_m2", "_mean", "_removals", "_values", "_window")

    def __init__(self, window: int) -> None:
        if window < 2:
            raise ValueError(f"window must be at least 2 values, got {window}")
        self._window = window
        self._values = array("d")
        self._head = 0  # once full: the slot of the oldest value
        self._mean = 0.0
        self._m2 = 0.0
        self._removals = 0

    def __len__(self) -> int:
        return len(self._values)

    @property
    def mean(self) -> float:
        """Mean of the window (0.0 when empty)."""
        return self._mean

    @property
    def std(self) -> float:
        """Sample standard deviation of the window (0.0 with fewer than 2 values)."""
        n = len(self._values)
        return math.sqrt(self._m2 / (n - 1)) if n > 1 else 0.0

    #: What ``ZScoreDetector`` judges against: the window's center and spread.
    center = mean
    scale = std

    def add(self, value: float) -> None:
        """Append one value, evicting the oldest when the window is full."""
        values = self._values
        n = len(values)
        if n == self._window:
            head = self._head
            self._remove(values[head], n - 1)
            values[head] = value
            self._head = head + 1 if head + 1 < n else 0
        else:
            values.append(value)
            n += 1
        delta = value - self._mean
        self._mean += delta / n
        self._m2 += delta * (value - self._mean)

    def add_in_band(
        self,
        values: Sequence[float],
        start: int,
        threshold: float,
        floor_ratio: float,
        stop: int | None = None,
    ) -> int:
        """``add`` each of ``values[start:stop]`` in turn while it is finite and at most
        ``threshold`` standard deviations above the mean of the window before it; returns
        the index of the first value not added (``stop`` or ``len(values)`` when all were).

        The standard deviation is floored at ``floor_ratio * |mean|`` and a tiny
        absolute, as ``ZScoreDetector`` judges. The same arithmetic as ``add``, with the
        state in local variables: the ingest hot path of a quiet series.
        """
        # Kept for its measured cost: ``benchmarks/ingest.py --quick --backends sqlite``,
        # interleaved on 2 shared cores, gave 297k and 317k samples per aggregator
        # CPU-second with this loop and 294k and 276k with a plain one (``self.add`` per
        # value after the band check), about 7 %; a cProfile of the same run put this
        # function at ~10 % of the event loop's CPU. tests/test_zscore.py holds it equal
        # to ``add``.
        values_in = self._values
        window = self._window
        n = len(values_in)
        mean, m2, head, removals = self._mean, self._m2, self._head, self._removals
        sqrt, isfinite = math.sqrt, math.isfinite
        i, end = start, len(values) if stop is None else stop
        while i < end:
            value = values[i]
            if not isfinite(value):
                break
            std = sqrt(m2 / (n - 1)) if n > 1 else 0.0
            floor = floor_ratio * abs(mean)
            if floor > std:  # max(std, floor, TINY_STD), comparison for comparison
                std = floor
            if std < TINY_STD:
                std = TINY_STD
            if not (value - mean) / std <= threshold:
                break
            if n == window:
                old = values_in[head]
                kept = n - 1  # ``_remove``: the window without its oldest value
                new_mean = mean + (mean - old) / kept
                m2 = max(0.0, m2 - (old - mean) * (old - new_mean))
                mean = new_mean
                removals += 1
                if removals >= window:
                    removals = 0
                    rest = values_in[head + 1 :] + values_in[:head]
                    mean = math.fsum(rest) / kept
                    m2 = math.fsum((v - mean) ** 2 for v in rest)
                values_in[head] = value
                head = head + 1 if head + 1 < n else 0
            else:
                values_in.append(value)
                n += 1
            delta = value - mean
            mean += delta / n
            m2 += delta * (value - mean)
            i += 1
        self._mean, self._m2, self._head, self._removals = mean, m2, head, removals
        return i

    def reset(self, values: Iterable[float]) -> None:
        """Replace the window by (the last ``window`` of) ``values``."""
        self._values = array("d", list(values)[-self._window :])
        self._head = 0
        self._recompute(self._values)

    def _remove(self, old: float, n: int) -> None:
        """Take ``old`` (in the head slot) out of the mean and M2; ``n`` values remain."""
        if n == 0:
            self._mean = self._m2 = 0.0
            return
        new_mean = self._mean + (self._mean - old) / n
        self._m2 = max(0.0, self._m2 - (old - self._mean) * (old - new_mean))
        self._mean = new_mean
        self._removals += 1
        if self._removals >= self._window:
            head, values = self._head, self._values
            self._recompute(values[head + 1 :] + values[:head])

    def _recompute(self, values: array[float]) -> None:
        self._removals = 0
        n = len(values)
        if n == 0:
            self._mean = self._m2 = 0.0
            return
        self._mean = math.fsum(values) / n
        self._m2 = math.fsum((v - self._mean) ** 2 for v in values)


#: Scales the median absolute deviation to the standard deviation (normal data).
_MAD_TO_SIGMA: Final = 1.4826


class RollingMedian:
    """Median and scaled median absolute deviation of the last ``window`` values: a
    baseline that a few outliers do not move.

    A job's first steps (process start, warm-up, lazy initialisation) are often several
    times its normal step and a preempted host adds single steps as long: with the mean
    and standard deviation those few values widen the band until a 1.4x regression is
    inside it. The median and the MAD ignore them. ``add`` is a binary insertion into a
    sorted copy of the window (O(window) memory moves, fast for a thousand doubles); the
    MAD is recomputed when read after the window has changed by ``window / 32`` values,
    as the spread of a thousand values moves slowly.
    """

    __slots__ = ("_changes", "_order", "_scale", "_sorted", "_window")

    def __init__(self, window: int) -> None:
        if window < 2:
            raise ValueError(f"window must be at least 2 values, got {window}")
        self._window = window
        self._order: deque[float] = deque()
        self._sorted: list[float] = []
        self._scale = 0.0
        self._changes = -1  # < 0: the scale must be computed before it is read

    def __len__(self) -> int:
        return len(self._order)

    @property
    def center(self) -> float:
        """Median of the window (0.0 when empty)."""
        ordered = self._sorted
        n = len(ordered)
        if n == 0:
            return 0.0
        half = n // 2
        return ordered[half] if n % 2 else (ordered[half - 1] + ordered[half]) / 2

    @property
    def scale(self) -> float:
        """1.4826 x the median absolute deviation (0.0 with fewer than 2 values)."""
        n = len(self._sorted)
        if n < 2:
            return 0.0
        if self._changes < 0 or self._changes >= max(1, n // 32):
            center = self.center
            self._scale = _MAD_TO_SIGMA * statistics.median([abs(v - center) for v in self._sorted])
            self._changes = 0
        return self._scale

    def add(self, value: float) -> None:
        """Append one value, evicting the oldest when the window is full."""
        if len(self._order) == self._window:
            oldest = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._order.append(value)
        bisect.insort(self._sorted, value)
        if self._changes >= 0:
            self._changes += 1

    def add_in_band(
        self,
        values: Sequence[float],
        start: int,
        threshold: float,
        floor_ratio: float,
        stop: int | None = None,
    ) -> int:
        """As ``RollingStats.add_in_band``, against the median and scaled MAD."""
        i, end = start, len(values) if stop is None else stop
        while i < end:
            value = values[i]
            if not math.isfinite(value):
                break
            center = self.center
            scale = max(self.scale, floor_ratio * abs(center), TINY_STD)
            if not (value - center) / scale <= threshold:
                break
            self.add(value)
            i += 1
        return i

    def reset(self, values: Iterable[float]) -> None:
        """Replace the window by (the last ``window`` of) ``values``."""
        self._order = deque(list(values)[-self._window :])
        self._sorted = sorted(self._order)
        self._changes = -1
