"""Step time's policies for the rolling z-score detector (``zscore.ZScoreDetector``).

Step time is judged like any series, plus three policies only it switches on (each off
by default; ``ZScoreSettings.step_time_detector`` turns them on):

- ``explained_share``, a known cause (None: every value is judged): a value out of band
  by ``x`` whose ``explained`` amount (``observe_many``: the CPU wait of the step's
  threads) exceeds its usual level by at least this share of ``x`` is not judged:
  neither counted toward a finding nor taken into the baseline. The usual level is the
  median of the amounts of the latest ``USUAL_WINDOW`` in-band values (``add_usual``).
- ``min_duration_s``, a rise must last (0: ``persistence`` values in a row are enough):
  a finding also needs its out-of-band values to span this many seconds, first to
  latest. The span need not be unbroken: in-band values may come between while at least
  ``min_out_share`` of the values since its first are out of band (and at least
  ``persistence`` of them); below that share the span ends and its values join the
  baseline, as a short excursion's do. An active finding clears after ``persistence``
  in-band values in a row that span ``min_duration_s`` too, or once under half
  ``min_out_share`` of the latest ``min_duration_s``'s values are out of band.
- ``level_window_s``, the level test (0: none): a finding is also raised once at least
  ``level_share`` of the values of the latest ``level_window_s`` (and at least
  ``min_samples`` values) are above the level line, ``level_sigmas`` above the center:
  values at the top of the band, not out of it, that together move its median
  (``LevelWindow``). In-band values above that line join the baseline only once they
  are older than the window (or not at all, if they become part of a finding), and a
  finding does not clear while half the window is above the line.

This module holds the policies' state and checks; the detector calls them where it
judges a value. Why each exists and what set its default: docs/detectors/zscore.md.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from torshmon.aggregator.core.rolling import RollingMedian

#: In-band values whose ``explained`` amount makes its usual level.
USUAL_WINDOW: Final = 256

STEP_TIME_ADVICE: Final = (
    "The job's steps got slower: check what changed around the start time - other "
    "processes or throttling on its nodes, the input pipeline, the network - and the job's "
    "straggler and bottleneck findings (a config switch starts the baseline over)."
)


def check_policies(
    *,
    explained_share: float | None,
    min_duration_s: float,
    min_out_share: float,
    level_window_s: float,
    level_sigmas: float,
    level_share: float,
) -> None:
    """Raises ValueError naming the first policy setting outside its allowed range."""
    if explained_share is not None and not (math.isfinite(explained_share) and explained_share > 0):
        raise ValueError(f"explained_share must be a number > 0, got {explained_share}")
    if not (math.isfinite(min_duration_s) and min_duration_s >= 0):
        raise ValueError(f"min_duration_s must be a number >= 0, got {min_duration_s}")
    if not (math.isfinite(min_out_share) and 0 < min_out_share <= 1):
        raise ValueError(f"min_out_share must be in (0, 1], got {min_out_share}")
    if not (math.isfinite(level_window_s) and level_window_s >= 0):
        raise ValueError(f"level_window_s must be a number >= 0, got {level_window_s}")
    if not (math.isfinite(level_sigmas) and level_sigmas > 0):
        raise ValueError(f"level_sigmas must be a number > 0, got {level_sigmas}")
    if not (math.isfinite(level_share) and 0 < level_share <= 1):
        raise ValueError(f"level_share must be in (0, 1], got {level_share}")


def add_usual(usual: RollingMedian | None, explained: float) -> RollingMedian | None:
    """An in-band value's ``explained`` amount taken into its series' usual level (NaN:
    unknown, ignored); the usual level, created on the first amount."""
    if not math.isfinite(explained):
        return usual
    if usual is None:
        usual = RollingMedian(USUAL_WINDOW)
    usual.add(explained)
    return usual


@dataclass(slots=True)
class LevelWindow:
    """The level test's window of one series: (time, value, above the level line) of
    the latest ``level_window_s`` of judged values (at least ``min_samples`` of them).

    A 1.3x regression whose noise is ~12 % of the step leaves half its steps in band,
    and a baseline drifts up with them: single values never pass the threshold, yet the
    median of the latest second has moved. The window asks that question instead.
    """

    entries: deque[tuple[float, float, bool]] = field(default_factory=deque)
    #: how many of ``entries`` are above the line
    high: int = 0

    def add(
        self, ts_unix_s: float, value: float, high: bool, window_s: float, min_samples: int
    ) -> None:
        """One judged value into the window."""
        entries = self.entries
        entries.append((ts_unix_s, value, high))
        self.high += high
        horizon = ts_unix_s - window_s
        # Keep one value at or before the horizon: the window then spans all of it.
        while len(entries) > min_samples and entries[1][0] <= horizon:
            self.high -= entries.popleft()[2]

    def holds(self, share: float, window_s: float, min_samples: int) -> bool:
        """Whether at least ``share`` of a full window is above the line."""
        entries = self.entries
        return (
            len(entries) >= min_samples
            and entries[-1][0] - entries[0][0] >= window_s
            and self.high >= share * len(entries)
        )

    def first_high_unix_s(self) -> float:
        """The time of the window's first value above the line (there must be one)."""
        return next(ts for ts, _, high in self.entries if high)

    def median(self) -> tuple[float, int]:
        """(the median of the window's values, how many values it holds)."""
        values = sorted(value for _, value, _ in self.entries)
        return values[len(values) // 2], len(values)

    def clear(self) -> None:
        self.entries.clear()
        self.high = 0
