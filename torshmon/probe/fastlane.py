"""The probe's fast lane: steps out of line with a rank's recent ones skip the batching wait.

Steps normally travel in batches every ``flush_interval_s`` (0.5 s), and the agent
gathers records for as long again before it POSTs: cheap, but up to a second old
when they arrive. When something goes wrong, that second is most of the time to an
alert. So the shipper judges each step as it summarises it (on its own thread,
never the training thread) and, when one is notable, sends it at once and keeps
sending every step at once for ``open_s``, long enough for the aggregator's
detectors to see the few steps their persistence asks for. The batch is marked
``urgent`` and the agent forwards it without its own wait.

A step is notable when its duration or compute time is at least ``time_ratio`` (1.15)
times the median of the rank's last ``window`` steps, or its loss is non-finite or
at least ``loss_ratio`` times the median of the recent finite losses. The bar is
deliberately low: a false judgement only costs an early, small batch; the
aggregator decides what is wrong. Notable steps enter the history too, so a new
normal (a slower phase of training) stops being notable within half a window. At 1.3
a 1.2x straggler (and its peers' steps, which wait for it) never opened the lane: the
straggler detector named it on its 4th slow step, and the alert came 7-10 steps later,
with the next batches.

On a rank whose steps are steady the time bar comes down, to ``noise_iqrs`` (3)
interquartile ranges of the window above its median, but never under
``min_time_ratio`` (1.05). A straggler's peers only wait for it: where communication is
a large part of their step, a 1.2x straggler lengthens it by less than 1.15x, and a
peer's lane stayed shut while its records were the ones the straggler detector
compares the slow rank with. On two shared cores (where 8-30 % of steps are 1.15x
their median by noise) the bar stays at 1.15x, and noise keeps the lanes open anyway.
The training thread judges a step's duration and a float loss
against the lane's bars (``bars``) as the step ends, so a step out of line wakes the
shipper then, and while the lane is open a step's end wakes the shipper (one send
per ``poll_s`` at most); the agent reads the probe's frames within
``URGENT_READ_WINDOW_S`` instead of its group-commit window and gathers the node's
other ranks' records of the same step for ``URGENT_GATHER_S``; its POSTs stay paced
(``URGENT_MIN_INTERVAL_S``), so an open lane costs a node at most 20 POSTs a second.
Before, a step's last record reached the aggregator a median 160 ms after the step
ended (the shipper waited a poll, then a group-commit window for its ack).

``attach(..., fast_lane=False)`` turns it off (``enabled=False``): no step is judged,
every step waits for the next flush. Where a rank has no core to spare (CPU jobs with
one core a rank), an open lane's sends take CPU time from training: 0-2.4 % of a
10 ms step of ``benchmarks/overhead.py``'s 40-bucket model (``--ablate``), where noise
alone keeps the lane open. Alerts then come with the batches, up to a second later.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections import deque

from torshmon.wire import StepRecord


class RollingMedian:
    """The median of the last ``size`` values: a step judged costs an insertion into a
    sorted list, not a sort of a copy of the window (``statistics.median``, three times
    a step): judging a step and the bars took 7.6 us, now 3.7 (20 000 steps, best of 5)."""

    __slots__ = ("_order", "_sorted")

    def __init__(self, size: int) -> None:
        self._order: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._order)

    def append(self, value: float) -> None:
        """Add a value, the oldest leaving a full window; one that is not finite is
        ignored (it has no place in an order)."""
        if not math.isfinite(value):
            return
        order = self._order
        if len(order) == order.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, order[0])]
        order.append(value)
        bisect.insort(self._sorted, value)

    def median(self) -> float:
        """The window's median; ValueError when it is empty."""
        values = self._sorted
        n = len(values)
        if n == 0:
            raise ValueError("median of an empty window")
        mid = n // 2
        return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2.0

    def quantile(self, q: float) -> float:
        """The window's value at rank ``q`` (0..1, nearest rank); ValueError when empty."""
        values = self._sorted
        if not values:
            raise ValueError("quantile of an empty window")
        return values[round(q * (len(values) - 1))]


class FastLane:
    """Judges summarised steps and says whether the lane is open (shipper thread only)."""

    def __init__(
        self,
        *,
        open_s: float = 2.0,
        window: int = 32,
        min_history: int = 8,
        time_ratio: float = 1.15,
        min_time_ratio: float = 1.05,
        noise_iqrs: float = 3.0,
        loss_ratio: float = 2.0,
        enabled: bool = True,
    ) -> None:
        for name, value in (("open_s", open_s), ("noise_iqrs", noise_iqrs)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 1.0 < min_time_ratio <= time_ratio:
            raise ValueError(
                f"need 1 < min_time_ratio <= time_ratio, got {min_time_ratio} and {time_ratio}"
            )
        if loss_ratio <= 1:
            raise ValueError(f"loss_ratio must be > 1, got {loss_ratio}")
        if not 1 <= min_history <= window:
            raise ValueError(f"min_history must be in 1..window ({window}), got {min_history}")
        self.open_s = open_s
        self.min_history = min_history
        self.time_ratio = time_ratio
        self.min_time_ratio = min_time_ratio
        self.noise_iqrs = noise_iqrs
        self.loss_ratio = loss_ratio
        #: False: nothing is judged, the lane never opens (``attach(fast_lane=False)``)
        self.enabled = enabled
        self._durations = RollingMedian(window)
        self._computes = RollingMedian(window)
        self._losses = RollingMedian(window)
        self._open_until = -math.inf
        self.opened_total = 0

    def observe(self, steps: list[StepRecord], now: float) -> bool:
        """Take in newly summarised steps; True if one was notable (the lane opens)."""
        if not self.enabled:
            return False
        notable = False
        for s in steps:
            notable = self._notable(s) or notable
        if notable:
            if now >= self._open_until:
                self.opened_total += 1
            self._open_until = now + self.open_s
        return notable

    def is_open(self, now: float) -> bool:
        return now < self._open_until

    def bars(self) -> tuple[int, float]:
        """What the training thread judges a step's end against (``StepOutbox``): the
        duration in nanoseconds, and the loss, at or above which a step is out of line,
        as ``observe`` would judge the next step; out of reach until enough history,
        and always where the lane is off."""
        slow_ns = sys.maxsize
        if not self.enabled:
            return slow_ns, math.inf
        bar = self._bar(self._durations)
        if bar is not None:
            slow_ns = math.ceil(bar * 1e9)
        loss_above = math.inf
        if len(self._losses) >= self.min_history:
            median = self._losses.median()
            loss_above = median + (self.loss_ratio - 1.0) * max(abs(median), 1e-12)
        return slow_ns, loss_above

    def _notable(self, s: StepRecord) -> bool:
        notable = self._above(self._durations, s.duration_s)
        notable = self._above(self._computes, s.compute_s) or notable
        if s.loss_nonfinite:
            notable = True
        elif s.loss is not None and math.isfinite(s.loss):
            # Losses can be negative (log-likelihoods): judge the size of a move up.
            notable = self._loss_jumped(s.loss) or notable
            self._losses.append(s.loss)
        return notable

    def _bar(self, history: RollingMedian) -> float | None:
        """The time at or above which the next value of ``history`` is slow: ``noise_iqrs``
        interquartile ranges above the median, kept within ``min_time_ratio`` and
        ``time_ratio`` times it; None until there is history enough (or a median of 0)."""
        if len(history) < self.min_history:
            return None
        median = history.median()
        if median <= 0.0:
            return None
        spread = (history.quantile(0.75) - history.quantile(0.25)) / median
        ratio = min(self.time_ratio, max(self.min_time_ratio, 1.0 + self.noise_iqrs * spread))
        return ratio * median

    def _above(self, history: RollingMedian, value: float) -> bool:
        bar = self._bar(history)
        history.append(value)
        return bar is not None and value >= bar

    def _loss_jumped(self, loss: float) -> bool:
        if len(self._losses) < self.min_history:
            return False
        median = self._losses.median()
        return loss - median >= (self.loss_ratio - 1.0) * max(abs(median), 1e-12)
