"""Step time's detector: the rolling z-score (``zscore.ZScoreDetector``) plus four
policies only step time has, each read from the ``zscore:`` section's ``step_*``
settings (and each off at 0).

- A known cause (``step_cpu_wait_share``; 0: every value is judged): a value out of band
  by ``x`` whose ``explained`` amount (``observe_many``: the CPU wait of the step's
  threads) exceeds its usual level by at least this share of ``x`` is not judged:
  neither counted toward a finding nor taken into the baseline. The usual level is the
  median of the amounts of the latest ``USUAL_WINDOW`` in-band values (``add_usual``).
- A rise must last (``step_min_duration_s``; 0: ``persistence`` values in a row are
  enough): a finding also needs its out-of-band values to span this many seconds, first
  to latest. The span need not be unbroken: in-band values may come between while at
  least ``step_min_out_share`` of the values since its first are out of band (and at
  least ``persistence`` of them); below that share the span ends and its values join the
  baseline, as a short excursion's do. An active finding clears after ``persistence``
  in-band values in a row that span ``step_min_duration_s`` too, or once under half
  ``step_min_out_share`` of the latest ``step_min_duration_s``'s values are out of band.
- The level test (``step_level_window_s``; 0: none): a finding is also raised once at
  least ``step_level_share`` of the values of the latest ``step_level_window_s`` (and at
  least ``min_samples`` values) are above the level line, ``step_level_sigmas`` above the
  center: values at the top of the band, not out of it, that together move its median
  (``LevelWindow``). In-band values above that line join the baseline only once they
  are older than the window (or not at all, if they become part of a finding), and a
  finding does not clear while half the window is above the line.
- Shown, then paged (``step_page_steps``, ``step_page_min_s``; 0 and 0: at once): a
  finding carries ``details["page"]``, False (shown on the pages and the report, the
  Step Time Anomaly rule does not fire) until at least ``step_page_steps`` of its steps
  were out of band or above the level line (``details["rise_steps"]``, counted from its
  first: the span's out-of-band steps or the level window's steps above the line,
  whichever are more, when it was raised) and it spans ``step_page_min_s``, with the
  step at hand one of them (slow now, not only on its way back). Once True it stays
  True until the finding clears: a few slow steps are shown, a lasting rise pages.

Step time is also judged against the median and MAD (``step_robust``) with a higher
floor on the band (``step_std_floor_ratio``). Why each policy exists and what set its
default: docs/detectors/zscore.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Final, cast

from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.rolling import RollingMedian, RollingStats
from torshmon.aggregator.core.zscore import (
    Direction,
    SeriesKey,
    SeriesState,
    ZScoreDetector,
    ZScoreSettings,
    where,
)

#: The metric step time's detector watches.
STEP_TIME_METRIC: Final = "step_duration_seconds"

#: In-band values whose ``explained`` amount makes its usual level.
USUAL_WINDOW: Final = 256

STEP_TIME_ADVICE: Final = (
    "The job's steps got slower: check what changed around the start time - other "
    "processes or throttling on its nodes, the input pipeline, the network - and the job's "
    "straggler and bottleneck findings (a config switch starts the baseline over)."
)


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


@dataclass(slots=True)
class StepSeries(SeriesState):
    """A series' state with what step time's policies keep beside it."""

    #: with ``min_duration_s``: in-band values since the first held one (a pending span
    #: or an active finding), kept out of the baseline until it ends
    held_in: list[float] = field(default_factory=list)
    #: values out of band the known cause accounts for since the first held one
    held_explained: int = 0
    #: the time of the first of ``in_streak`` in-band values in a row
    in_since_unix_s: float = 0.0
    #: with ``min_duration_s``, while active: (time, out of band) of the values of the
    #: latest ``min_duration_s``
    recent: deque[tuple[float, bool]] = field(default_factory=deque)
    #: with ``level_window_s``: the level test's window
    level: LevelWindow = field(default_factory=LevelWindow)
    #: with ``level_window_s``, while quiet: (time, value) of in-band values above the
    #: level line, which join the baseline once they are older than the level window
    marginal: deque[tuple[float, float]] = field(default_factory=deque)
    #: the usual ``explained`` amount of in-band values (``explained_share``)
    explained: RollingMedian | None = None
    #: while active: the finding's steps out of band or above the level line so far
    rise_steps: int = 0
    #: while active: whether the finding pages (``step_page_steps``)
    paged: bool = False
    #: whether the value being judged was out of band or above the level line (and not
    #: accounted for by the known cause)
    rising: bool = False


class StepTimeDetector(ZScoreDetector):
    """Step time's rolling z-score: the generic detector on ``step_duration_seconds``
    with the policies of this module, read from ``settings`` (checked when built).

    ``direction`` is "up" for step time; other directions are for tests of the
    policies. Pure and deterministic like the generic detector; not thread-safe.
    """

    advice: ClassVar[str] = STEP_TIME_ADVICE

    def __init__(
        self, settings: ZScoreSettings | None = None, *, direction: Direction = "up"
    ) -> None:
        s = settings if settings is not None else ZScoreSettings()
        super().__init__(s, metric=STEP_TIME_METRIC, direction=direction, robust=s.step_robust)
        self._std_floor_ratio = max(s.std_floor_ratio, s.step_std_floor_ratio)
        self._explained_share = s.step_cpu_wait_share or None
        self._min_duration_s = s.step_min_duration_s
        self._min_out_share = s.step_min_out_share
        self._level_window_s = s.step_level_window_s
        self._level_sigmas = s.step_level_sigmas
        self._level_share = s.step_level_share
        self._page_steps = s.step_page_steps
        self._page_min_s = s.step_page_min_s

    def observe_many(
        self,
        labels: Mapping[str, str] | SeriesKey,
        ts_unix_s: Sequence[float],
        values: Sequence[float],
        explained: Sequence[float] | None = None,
    ) -> list[tuple[int, Finding]]:
        """The generic ``observe_many``; ``explained``: per value, how much of it a
        known cause accounts for (the time a step's threads waited for a CPU; NaN:
        unknown), read with ``step_cpu_wait_share``."""
        return self._observe_run(labels, ts_unix_s, values, explained)

    def _new_series(
        self, labels: dict[str, str], stats: RollingStats | RollingMedian
    ) -> StepSeries:
        return StepSeries(labels, stats)

    def _add_quiet(
        self,
        series: SeriesState,
        ts_unix_s: Sequence[float],
        values: Sequence[float],
        explained: Sequence[float] | None,
        start: int,
        end: int,
    ) -> int:
        s = _step(series)
        level = self._level_window_s > 0
        # With the level test, a quiet series' values above its line are judged one by one.
        line = min(self._threshold, self._level_sigmas) if level else self._threshold
        stop = end
        if level and s.marginal:
            # Up to the value at which the oldest marginal one joins the baseline.
            due = s.marginal[0][0] + self._level_window_s
            stop = start
            while stop < end and not ts_unix_s[stop] > due:
                stop += 1
        added = s.stats.add_in_band(values, start, line, self._std_floor_ratio, stop)
        if explained is not None and self._explained_share is not None:
            for why in explained[start:added]:
                s.explained = add_usual(s.explained, why)
        if level:
            window_s, min_samples = self._level_window_s, self._min_samples
            for j in range(start, added):
                s.level.add(ts_unix_s[j], values[j], False, window_s, min_samples)
        return added

    def _judge(
        self,
        series: SeriesState,
        key: SeriesKey,
        ts_unix_s: float,
        value: float,
        explained: float,
    ) -> Finding | None:
        s = _step(series)
        was_active = s.active
        s.rising = False
        found = self._judge_value(s, key, ts_unix_s, value, explained)
        if not s.active or found is None:
            return found
        if s.rising:
            if was_active:
                s.rise_steps += 1
            if (
                not s.paged
                and s.rise_steps >= self._page_steps
                and ts_unix_s - s.since_unix_s >= self._page_min_s
            ):
                s.paged = True
        details = found.details
        if details.get("page") is s.paged and details.get("rise_steps") == s.rise_steps:
            return found
        return self._with_page(s, key, found)

    def _with_page(self, series: StepSeries, key: SeriesKey, finding: Finding) -> Finding:
        """``finding`` with whether it pages (and, until it does, saying so)."""
        summary = finding.summary
        if finding.details.get("page") is False:
            summary = summary.rsplit(" (for ", 1)[0]  # the note of an earlier step
        if not series.paged:
            summary += f" (for {series.rise_steps} steps so far: it pages if it lasts)"
        finding = dataclasses.replace(
            finding,
            summary=summary,
            details={**finding.details, "page": series.paged, "rise_steps": series.rise_steps},
        )
        series.finding = finding
        self._active.setdefault(series.labels["job"], {})[key] = finding
        return finding

    def _judge_value(
        self,
        s: StepSeries,
        key: SeriesKey,
        ts_unix_s: float,
        value: float,
        explained: float,
    ) -> Finding | None:
        """``_judge`` less the page: whether ``value`` rose is left in ``s.rising``."""
        if not math.isfinite(value):
            return s.finding
        marginal = s.marginal
        while marginal and marginal[0][0] < ts_unix_s - self._level_window_s:
            s.stats.add(marginal.popleft()[1])  # old enough: part of the normal level
        if len(s.stats) < self._min_samples:
            s.stats.add(value)
            if self._explained_share is not None:
                s.explained = add_usual(s.explained, explained)
            return None
        mean, std, z = self._score(s, value)
        out = self._beyond(z, self._threshold)
        share = self._explained_share
        level = self._level_window_s > 0
        high = level and self._beyond(z, self._level_sigmas)
        if (out or high) and share is not None:
            usual = s.explained
            # How much more of the known cause (a busy node's CPU wait) than in-band
            # values usually carry: a node always this busy is part of the normal level.
            extra = explained - (usual.center if usual is not None else 0.0)
            if extra >= share * abs(value - mean):
                if out:
                    # It accounts for the excursion: not the series' own change, and not
                    # its normal level either (and in the level window, not above it).
                    if level:
                        self._level_add(s, ts_unix_s, value, False)
                    self._explained_in_span(s)
                    return s.finding
                high = False
        s.rising = out or high
        if out:
            if level:
                self._level_add(s, ts_unix_s, value, True)
            return self._out_of_band(s, key, ts_unix_s, value, mean, std, z)
        if share is not None:
            s.explained = add_usual(s.explained, explained)
        if level:
            self._level_add(s, ts_unix_s, value, high)
            if high and not s.active:
                # Raised on a value above the line (a quiet series' others skip this).
                if self._level_holds(s, self._level_share):
                    return self._level_rise(s, key, ts_unix_s, value, mean, std, z)
                if not s.held:
                    # At the top of the band: into the baseline once it is older than the
                    # window, unless the level has moved by then.
                    s.out_streak = 0
                    s.marginal.append((ts_unix_s, value))
                    return None
        return self._in_band(s, key, ts_unix_s, value)

    def _level_add(self, series: StepSeries, ts_unix_s: float, value: float, high: bool) -> None:
        series.level.add(ts_unix_s, value, high, self._level_window_s, self._min_samples)

    def _level_holds(self, series: StepSeries, share: float) -> bool:
        """Whether at least ``share`` of a full level window is above the line."""
        return series.level.holds(share, self._level_window_s, self._min_samples)

    def _level_rise(
        self,
        series: StepSeries,
        key: SeriesKey,
        ts_unix_s: float,
        value: float,
        mean: float,
        std: float,
        z: float,
    ) -> Finding:
        """The level test's finding, raised on an in-band value."""
        first_high = series.level.first_high_unix_s()
        if not series.held or first_high < series.since_unix_s:
            series.since_unix_s = first_high
        self._start(series)
        series.in_streak = 0
        series.held_in.append(value)
        if self._min_duration_s > 0:
            series.recent.append((ts_unix_s, False))
        level, samples = series.level.median()
        finding = self._finding(series, value, mean, std, z)
        up = level >= mean
        side = "above" if up else "below"
        line = mean + (1.0 if up else -1.0) * self._level_sigmas * std
        summary = (
            f"{self._name} of {where(series.labels)} has {'risen' if up else 'fallen'} to "
            f"{level:.3g}{self._unit} (median of its latest {samples} values, "
            f"{series.level.high} of them {side} {line:.3g}{self._unit}), "
            f"{abs(level - mean) / std:.1f} sigma {side} its {self._center_name} "
            f"{mean:.3g}{self._unit}"
        )
        finding = dataclasses.replace(
            finding,
            summary=summary,
            value=level,
            score=(level - mean) / std,
            details={**finding.details, "level_samples": samples},
        )
        series.finding = finding
        self._active.setdefault(series.labels["job"], {})[key] = finding
        return finding

    def _explained_in_span(self, series: StepSeries) -> None:
        """A value out of band the known cause accounts for counts in a pending span as
        one in band: below ``min_out_share`` the span ends, as a short excursion's does."""
        if series.active or not series.held or self._min_duration_s <= 0:
            return
        series.held_explained += 1
        judged = len(series.held) + len(series.held_in) + series.held_explained
        if len(series.held) >= self._min_out_share * judged:
            return
        self._end_span(series)
        series.out_streak = 0

    def _out_of_band(
        self,
        series: SeriesState,
        key: SeriesKey,
        ts_unix_s: float,
        value: float,
        mean: float,
        std: float,
        z: float,
    ) -> Finding | None:
        found = super()._out_of_band(series, key, ts_unix_s, value, mean, std, z)
        if series.active and self._min_duration_s > 0:
            _step(series).recent.append((ts_unix_s, True))
        return found

    def _starts(self, series: SeriesState, ts_unix_s: float) -> bool:
        s = _step(series)
        if self._level_window_s > 0 and self._level_holds(s, self._level_share):
            return True  # the level has moved
        if self._min_duration_s > 0:
            # Out of band for long enough, mostly: in-band values may come between.
            return (
                len(s.held) >= self._persistence
                and ts_unix_s - s.since_unix_s >= self._min_duration_s
            )
        return super()._starts(series, ts_unix_s)

    def _start(self, series: SeriesState) -> None:
        """Make a series active; its marginal values are part of the finding."""
        s = _step(series)
        super()._start(s)
        s.rise_steps = max(len(s.held), s.level.high)
        s.paged = False
        s.held_explained = 0
        s.held_in.extend(value for _, value in s.marginal)
        s.marginal.clear()

    def _adapt(self, series: SeriesState) -> None:
        s = _step(series)
        s.stats.reset(s.held + s.held_in)
        s.held_in.clear()
        s.level.clear()  # judged against the old level

    def _keep_while_active(self, series: SeriesState, ts_unix_s: float, value: float) -> None:
        s = _step(series)
        if self._min_duration_s > 0:
            # Held like the out-of-band values: in-band values at the new level would
            # otherwise widen the band until the level fits in it.
            s.held_in.append(value)
            s.recent.append((ts_unix_s, False))
        else:
            s.stats.add(value)
        if s.in_streak == 0:
            s.in_since_unix_s = ts_unix_s

    def _back_in_band(self, series: SeriesState, ts_unix_s: float) -> bool:
        """With ``min_duration_s``, once the in-band values span it, or sooner where
        out-of-band values are under half ``min_out_share`` of the latest
        ``min_duration_s`` (single slow steps coming back every few tenths of a second
        do not keep a finding alive)."""
        s = _step(series)
        if self._level_window_s > 0 and self._level_holds(s, 0.5):
            return False  # half the level window is still above the line
        span = self._min_duration_s
        if ts_unix_s - s.in_since_unix_s >= span:
            return True
        recent = s.recent
        while recent and recent[0][0] < ts_unix_s - span:
            recent.popleft()
        out = sum(1 for _, was_out in recent if was_out)
        return out < 0.5 * self._min_out_share * len(recent)

    def _span_goes_on(self, series: SeriesState, value: float) -> bool:
        """With ``min_duration_s``, a pending span goes on while mostly out of band."""
        if self._min_duration_s <= 0:
            return False
        s = _step(series)
        s.held_in.append(value)
        judged = len(s.held) + len(s.held_in) + s.held_explained
        if len(s.held) >= self._min_out_share * judged:
            return True
        s.held_in.pop()  # the span ends: this value joins the baseline
        return False

    def _end_span(self, series: SeriesState) -> None:
        super()._end_span(series)
        s = _step(series)
        for value in s.held_in:
            s.stats.add(value)
        s.held_in.clear()
        s.held_explained = 0

    def _clear(self, series: SeriesState, key: SeriesKey) -> None:
        s = _step(series)
        for value in s.held_in:  # the values that brought it back in band
            s.stats.add(value)
        s.held_in.clear()
        s.held_explained = 0
        s.recent.clear()
        s.rise_steps = 0
        s.paged = False
        super()._clear(series, key)


def _step(series: SeriesState) -> StepSeries:
    """A series of ``StepTimeDetector``: it makes only these (``_new_series``)."""
    return cast(StepSeries, series)
