"""Re-tuning on drift: when a finished session's job is tuned again."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from scipy import stats  # type: ignore[import-untyped]  # scipy ships no type stubs

from torshmon.aggregator.core.tuner.config import (
    TunerError,
)
from torshmon.aggregator.core.tuner.events import (
    StepSample,
)
from torshmon.aggregator.core.tuner.settings import RetuneSettings


class DriftWatch:
    """Watches one job after its session ended; says when its throughput drifted away.

    ``reference`` are the windows the session stood by (the verification's, or the
    baseline's when it left the job alone), ``unit`` their unit, ``ended_unix_s`` when
    the session ended. Only steps of the first config version seen are used: a later
    version (someone changed the config) ends the watch, since the reference no longer
    describes the job. Pure: ``observe`` takes ``now``; not thread-safe.
    """

    def __init__(
        self,
        reference: Sequence[float],
        unit: str,
        ended_unix_s: float,
        settings: RetuneSettings | None = None,
    ) -> None:
        self.settings = settings if settings is not None else RetuneSettings()
        if len(reference) < 2:
            raise TunerError(f"a drift watch needs >= 2 reference windows, got {len(reference)}")
        self.reference = tuple(reference)
        # Sessions stored before the unit said "per rank" measured the same thing.
        self.unit = "samples/s per rank" if unit == "samples/s" else unit
        self.ended_unix_s = ended_unix_s
        self.version: int | None = None
        self.stopped = False
        self.drifting_since: float | None = None
        self.ratio: float | None = None  # median of the recent windows over the reference's
        self._rates: list[float] = []
        self._windows: list[float] = []

    def observe(self, sample: StepSample, now: float) -> str | None:
        """Feed one of rank 0's steps; returns why to re-tune once drift has lasted, else None."""
        if self.stopped:
            return None
        if self.version is None:
            self.version = sample.config_version
        elif sample.config_version != self.version:
            self.stopped = True  # the config changed under us: the reference is void
            return None
        rate = sample.rate()
        if rate is None or rate[1] != self.unit:
            return None
        self._rates.append(rate[0])
        if len(self._rates) < self.settings.window_steps:
            return None
        self._windows.append(len(self._rates) / sum(1.0 / r for r in self._rates))
        self._rates.clear()
        del self._windows[: -self.settings.windows]
        return self._judge(now)

    def _judge(self, now: float) -> str | None:
        s = self.settings
        if len(self._windows) < s.windows:
            return None
        self.ratio = statistics.median(self._windows) / statistics.median(self.reference)
        p = float(stats.mannwhitneyu(self._windows, self.reference, alternative="less").pvalue)
        if not (p < s.alpha and self.ratio < 1 - s.threshold):
            self.drifting_since = None
            return None
        if self.drifting_since is None:
            self.drifting_since = now
        if now - self.drifting_since < s.for_s:
            return None
        if now - self.ended_unix_s < s.min_interval_s:
            return None
        return (
            f"throughput drifted {self.ratio - 1:+.0%} from the tuned {self.unit} "
            f"(p={p:.2g}) for {now - self.drifting_since:.0f} s"
        )
