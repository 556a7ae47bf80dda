"""Straggler detection: a rank's compute time against its peers' at the same steps.

In a blocking collective the slow rank waits least, so its collective time looks
best; compute time (step time minus communication wait) is where a straggler shows,
while its peers wait for it in communication. Each complete step gives every rank a
log ratio, ``log(compute / median of its peers' compute at that step)``: a rank is
compared with what the others did in the same step, never with its own history, so a
lasting slowdown does not become the rank's new normal and the finding lasts as long
as the rank is out of line.

- A rank is named when ``persistence`` of its last ``window_steps`` steps (5 of 8) are
  slower than its peers by more than a bar (k of n, not an unbroken streak: one lucky
  step does not restart the count; a preempted rank's burst of two or three slow steps
  is not enough). Equivalently, the ``persistence``-th largest ratio of the window, the
  window statistic, passes the bar. A rank whose last ``streak_steps`` steps (4) all
  passed the bar is named at once: a steady straggler one step sooner, still more
  than a preemption burst.
- A rank is not newly named while another rank's window statistic is at least
  ``overshadow_ratio`` (2) times its own: on shared CPUs a busy straggler slows a
  neighbour too (4 ranks on two cores: while a 3x straggler computed, another rank was
  13-21 % slower than the rest for 4 steps, held-out seed 61; beside a 1.5x straggler
  one was 14-18 % slower for 7 steps, and one 20 % slower for 6 steps as a 3x one
  began, seed 62; each was named). The other's latest step counts too, so a
  straggler's first slow steps hold the others back. The slower rank is the one to act
  on; the other is named only if it stays out of line once that one's slowdown is no
  longer twice its own.
- The bar is the larger of a relative floor (``min_slowdown``, 12 %, so jitter is never a
  straggler; ``pair_min_slowdown``, 20 %, with two ranks, where one peer is no majority)
  and ``z_threshold`` standard deviations of the window statistic's noise. That noise is
  measured from the peers: the changes of each rank's window statistic from one window
  to the next (the upper quartile of the absolute changes, which heavy tails such as
  preempted ranks raise more than the median), over the ranks not above the bar. A steady
  slowdown does not change a rank's ratio from window to window, so a straggler cannot
  raise its own bar; on a busy shared CPU the bar rises with the jitter. An on/off
  straggler's does change, so a rank whose finding cleared stays out of the estimate
  (with 2 ranks, its mirror-image peer too) until its window statistic has been under
  the floor for ``hold_steps`` steps in a row: one that cleared mid-fault (a 1.2x
  straggler at 2 ranks, at the floor) would otherwise raise the bar above the
  stragglers after it. One too mild to name is never cleared, so the estimate is taken
  as at most ``max_window_noise`` (2.5) times what the changes of the ranks' ratios from
  one step to the next over the last ``noise_samples`` steps imply: on/off spells change
  most windows but few single steps. No rank is named before the noise has been sampled in 16 steps
  (16 changes at least): the ranks' changes in one step, and those of overlapping
  windows in consecutive steps, move together, so the first steps' samples are a weak
  estimate (2 ranks, held-out seed 63: on contention a healthy rank computed 1.25x its
  peer at steps 32-39 and was named at step 38, the estimate then a dozen steps old;
  with the wait, the changes of every rank through such a burst are in the estimate
  before it can name one). Those changes lag
  a sudden burst of contention, so the bar also follows the noise of the latest
  ``step_noise_steps`` steps (16): the upper quartile of the changes of
  the ranks' ratios from one step to the next (a steady slowdown does not change its
  rank's ratio either), scaled to the window statistic.
- The peers' median leaves out ranks already named, so with 3 or 4 ranks a straggler
  does not move its peers' reference (and each of its slow spells does not look like
  noise on theirs). A rank left with a single peer that way takes the pair floor.
- A step counts against a rank only if it also lost at least ``min_excess_s`` (3 ms) of
  compute to its peers' median. Below that the host clock cannot tell a straggler from
  the operating system: a process that gives up one scheduler time slice (about 3 ms
  on Linux with 8 or more cores) to another is 1.5x slower on a 6 ms step, and a rank
  losing less than that costs the job little. Such steps count as in line.
- A finding clears only after ``hold_steps`` steps in a row without the condition, so a
  straggler that is slow on and off (off spells up to about ``hold_steps`` steps) stays
  one alert, and it resolves once the rank has been back in line with its peers for
  that long.
- Steps of a config switch (``pause``) are not scored: a new bucket layout or codec
  makes the first steps after it uneven across ranks.
- A rank named for ``chronic_steps`` steps is marked ``chronic``: synchronous training
  runs at its slowest rank's pace, so a permanently slower rank costs every step, and
  the recommendation turns to heterogeneous hardware and uneven data shards.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Final

import msgspec

from torshmon.aggregator.core.findings import Finding
from torshmon.settings import Section, setting

#: Scales the 75th percentile of |x| to the standard deviation of x (normal data):
#: higher than the median's scale where the noise has heavy tails (preempted ranks).
_Q75_TO_SIGMA: Final = 1 / 1.1503
#: Fewer noise samples than this are no estimate.
_MIN_NOISE: Final = 16
#: Nor are samples from fewer steps than this: the ranks' changes in one step, and the
#: changes of overlapping windows in consecutive steps, move together.
_MIN_NOISE_STEPS: Final = 16
#: The noise is sampled from this many ranks a step at most (in turns), so a large job's
#: estimate still spans many steps.
_NOISE_RANKS_PER_STEP: Final = 16


@dataclass(slots=True, eq=False)
class _RankState:
    """One rank's recent steps and its finding: ``ratios`` (log(compute / peers'
    median), the last two windows), ``computes``, ``peers`` (the peers' median) and
    ``times`` (the last window)."""

    ratios: deque[float]
    computes: deque[float]
    peers: deque[float]
    times: deque[float]
    active: bool = False
    active_steps: int = 0
    quiet_steps: int = 0
    since_unix_s: float = 0.0
    finding: Finding | None = None
    #: A cleared finding's rank stays out of the noise estimate until it has been in
    #: line for ``hold_steps`` steps in a row (counted in ``settled_steps``).
    unsettled: bool = False
    settled_steps: int = 0


@dataclass(slots=True)
class _JobState:
    #: |change of a rank's window statistic from one window to the next|, of ranks
    #: not above the bar.
    noise: deque[float]
    #: Per scored step, the median over ranks of |change of a rank's ratio from the
    #: step before|, the latest last: the node's noise now (the last
    #: ``step_noise_steps``) and over the last ``noise_samples`` (``max_window_noise``).
    jumps: deque[float]
    complete_steps: int = 0
    #: Scored steps that added to ``noise``, up to ``_MIN_NOISE_STEPS``.
    noise_steps: int = 0
    ranks: dict[int, _RankState] = field(default_factory=dict)
    #: Steps ``[from, until)`` of config switches, not scored.
    paused: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Score:
    """One rank's standing over its window: medians of its compute, of its peers' and
    of their ratio (as a factor)."""

    rank: int
    compute_s: float
    peer_median_s: float
    slowdown_ratio: float
    bar_ratio: float


def _active_findings(state: _JobState) -> list[Finding]:
    """The job's active findings by rank."""
    return [s.finding for _, s in sorted(state.ranks.items()) if s.active and s.finding is not None]


class StragglerSettings(Section, frozen=True):
    """The straggler detector's settings; the detector checks the rules between them."""

    min_slowdown: Annotated[
        float,
        setting(
            "how much slower than its peers' median at the same step a rank must compute "
            "for the step to count against it (0.12 = 12 %), with 3 or more ranks",
            gt=0,
        ),
    ] = 0.12
    pair_min_slowdown: Annotated[
        float, setting("the same with 2 ranks, where one peer is no majority", gt=0)
    ] = 0.20
    z_threshold: Annotated[
        float,
        setting(
            "and only beyond this many standard deviations of the window's noise "
            "(measured from the peers' window-to-window changes)",
            gt=0,
        ),
    ] = 4.0
    persistence: Annotated[
        int, setting("steps of the last window_steps that must count before a finding", ge=1)
    ] = 5
    window_steps: Annotated[
        int, setting("steps persistence is counted over (>= persistence)", ge=1)
    ] = 8
    streak_steps: Annotated[
        int,
        setting(
            "or this many slow steps in a row (0: off; more than a preempted process's "
            "burst of 2-3 steps)",
            ge=0,
        ),
    ] = 4
    overshadow_ratio: Annotated[
        float,
        setting(
            "a rank is not newly named while another's slowdown is this many times its own "
            "(a busy neighbour's contention; 0: off)",
            ge=0,
        ),
    ] = 2.0
    hold_steps: Annotated[
        int,
        setting("steps in a row without the condition before a finding clears", ge=1),
    ] = 25
    noise_samples: Annotated[
        int,
        setting(
            "window-to-window changes the noise is estimated from, and steps of "
            "step-to-step changes for max_window_noise",
            ge=16,
        ),
    ] = 256
    min_excess_s: Annotated[
        float,
        setting(
            "and only when its compute exceeds that median by at least this many seconds "
            "(one scheduler time slice: less cannot be told from the operating system)",
            ge=0,
        ),
    ] = 0.003
    warmup_steps: Annotated[int, setting("complete steps not scored at a job's start", ge=0)] = 10
    chronic_steps: Annotated[
        int, setting("steps a finding stays active before it is marked chronic", ge=1)
    ] = 500
    step_noise_steps: Annotated[
        int,
        setting(
            "the bar also rises with the noise of the latest this many steps (0: off)",
            ge=0,
        ),
    ] = 16
    max_window_noise: Annotated[
        float,
        setting(
            "the window's noise is taken as at most this many times what the changes of "
            "the ranks' ratios from one step to the next imply, so the swings of an "
            "on/off straggler too mild to name do not raise the bar (0: off)",
            ge=0,
        ),
    ] = 2.5

    def __post_init__(self) -> None:
        super().__post_init__()
        StragglerDetector(**msgspec.structs.asdict(self))  # its checks, its messages


class StragglerDetector:
    """Names the rank whose compute time lags its peers' at the same steps.

    Pure and deterministic; O(world_size x window_steps) per complete step. Not
    thread-safe; the aggregator drives it from one task.
    """

    def __init__(
        self,
        *,
        min_slowdown: float = 0.12,
        pair_min_slowdown: float = 0.20,
        z_threshold: float = 4.0,
        persistence: int = 5,
        window_steps: int = 8,
        streak_steps: int = 4,
        overshadow_ratio: float = 2.0,
        hold_steps: int = 25,
        noise_samples: int = 256,
        min_excess_s: float = 0.003,
        warmup_steps: int = 10,
        chronic_steps: int = 500,
        step_noise_steps: int = 16,
        max_window_noise: float = 2.5,
    ) -> None:
        """Raises ValueError naming any setting outside its allowed range."""
        if not (math.isfinite(z_threshold) and z_threshold > 0):
            raise ValueError(f"z_threshold must be a positive number, got {z_threshold}")
        if not (math.isfinite(overshadow_ratio) and overshadow_ratio >= 0):
            raise ValueError(f"overshadow_ratio must be a number >= 0, got {overshadow_ratio}")
        if not (math.isfinite(max_window_noise) and max_window_noise >= 0):
            raise ValueError(f"max_window_noise must be a number >= 0, got {max_window_noise}")
        if not (math.isfinite(min_excess_s) and min_excess_s >= 0):
            raise ValueError(f"min_excess_s must be 0 or more seconds, got {min_excess_s}")
        for name, ratio in (
            ("min_slowdown", min_slowdown),
            ("pair_min_slowdown", pair_min_slowdown),
        ):
            if not (math.isfinite(ratio) and ratio > 0):
                raise ValueError(f"{name} must be a positive fraction (0.1 = 10 %), got {ratio}")
        for name, steps, least in (
            ("persistence", persistence, 1),
            ("streak_steps", streak_steps, 0),
            ("hold_steps", hold_steps, 1),
            ("noise_samples", noise_samples, _MIN_NOISE),
            ("warmup_steps", warmup_steps, 0),
            ("chronic_steps", chronic_steps, 1),
            ("step_noise_steps", step_noise_steps, 0),
        ):
            if steps < least:
                raise ValueError(f"{name} must be at least {least} steps, got {steps}")
        if window_steps < persistence:
            raise ValueError(
                f"window_steps must be at least persistence ({persistence}), got {window_steps}"
            )
        if streak_steps > window_steps:
            raise ValueError(
                f"streak_steps must be at most window_steps ({window_steps}), got {streak_steps}"
            )
        self._floor = math.log1p(min_slowdown)
        self._pair_floor = math.log1p(pair_min_slowdown)
        self._z_threshold = z_threshold
        self._persistence = persistence
        self._streak_steps = streak_steps
        self._overshadow_ratio = overshadow_ratio
        self._window_steps = window_steps
        self._hold_steps = hold_steps
        self._noise_samples = noise_samples
        self._min_excess_s = min_excess_s
        self._warmup_steps = warmup_steps
        self._chronic_steps = chronic_steps
        self._step_noise_steps = step_noise_steps
        self._max_window_noise = max_window_noise
        self._stat_per_step = _order_statistic_sd(window_steps, persistence)
        self._jobs: dict[str, _JobState] = {}

    def observe_step(
        self, job: str, step: int, compute_s_by_rank: Mapping[int, float], ts_unix_s: float
    ) -> list[Finding]:
        """Score one complete step of ``job``; the job's active findings, by rank.

        Call once per complete step (see ``StepCollector``), in step order. Ranks with a
        non-finite or non-positive compute time are left out of this step; fewer than 2
        usable ranks, a warm-up step and a paused step leave every rank's state as it was.
        """
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = self._new_job()
        values = _usable(compute_s_by_rank)
        if len(values) < 2 or _paused(state, step):
            return _active_findings(state)
        state.complete_steps += 1
        if state.complete_steps <= self._warmup_steps:
            return _active_findings(state)
        named = {rank for rank, r in state.ranks.items() if r.active and rank in values}
        unsettled = {rank for rank, r in state.ranks.items() if r.unsettled and rank in values}
        ratios = _log_ratios(values, named)
        # With one peer to compare with (2 ranks, or 3 with one named, for the other two)
        # there is no majority to say which of the two is normal: the higher floor.
        floor = self._pair_floor if len(values) == 2 else self._floor
        peer_floor = self._pair_floor if len(values) - len(named) <= 2 else floor
        sigma = _window_sigma(state.noise) if state.noise_steps >= _MIN_NOISE_STEPS else None
        sigma = self._with_step_noise(state, sigma, values, ratios)
        noise_bar = None if sigma is None else self._z_threshold * sigma
        named_bar = None if noise_bar is None else max(floor, noise_bar)
        other_bar = None if noise_bar is None else max(peer_floor, noise_bar)
        stride = -(-len(ratios) // _NOISE_RANKS_PER_STEP)
        # The peers' ratios measure the noise only where a named straggler is not among
        # their peers; with fewer than two other ranks it is (a pair mirrors it).
        left_out = named | unsettled
        measures = not left_out or len(values) - len(left_out) >= 2
        ranks = state.ranks
        noise_step = False
        for i, (rank, (ratio, peers_s)) in enumerate(ratios.items()):
            rank_state = ranks.get(rank) or self._new_rank(state, rank)
            compute_s = values[rank]
            if compute_s - peers_s < self._min_excess_s:
                ratio = min(ratio, 0.0)  # too little time lost to tell from the OS
            rank_state.ratios.append(ratio)
            rank_state.computes.append(compute_s)
            rank_state.peers.append(peers_s)
            rank_state.times.append(ts_unix_s)
            sampled = measures and rank not in unsettled and (i + step) % stride == 0
            bar = named_bar if rank in named else other_bar
            if rank_state.unsettled:
                self._settle(rank_state, floor)
            if not (sampled or rank_state.active or (bar is not None and ratio > bar)):
                # A rank is named at one of its slow steps, so one that is neither slow
                # now nor named has nothing to decide (the common case, kept cheap).
                continue
            stat = self._statistic(rank_state, recent=True)
            if stat is None:
                continue
            holds = bar is not None and (stat > bar or self._streak(rank_state, bar))
            if (
                holds
                and bar is not None
                and not rank_state.active
                and self._overshadowed(state, rank, stat, bar)
            ):
                continue  # a much slower rank's contention, not a straggler of its own
            if sampled and not (holds or rank_state.active):
                before = self._statistic(rank_state, recent=False)
                if before is not None:
                    state.noise.append(abs(stat - before))
                    noise_step = True
            if bar is not None and (holds or rank_state.active):
                self._advance(job, step, ts_unix_s, rank, rank_state, bar, holds=holds)
        if noise_step and state.noise_steps < _MIN_NOISE_STEPS:
            state.noise_steps += 1
        return _active_findings(state)

    def _with_step_noise(
        self,
        state: _JobState,
        sigma: float | None,
        values: Mapping[int, float],
        ratios: Mapping[int, tuple[float, float]],
    ) -> float | None:
        """The window statistic's noise for the bar: ``sigma`` (from the window-to-window
        changes), at most ``max_window_noise`` times what the changes of the ranks'
        ratios from one step to the next over the last ``noise_samples`` steps imply,
        and at least what those of this step and the ``step_noise_steps`` before it do.

        - The cap: an on/off straggler too mild to name changes its windows at most
          steps (with spells of 10 steps and windows 8 apart, 4 in 5) but its single
          steps at 2 in 20, so its swings do not raise the bar over the stragglers
          after it (a 1.1x one at 2 ranks, under the floor, doubled sigma and hid a
          1.2x and a 1.5x, development seed 70). Contention lasting several steps makes
          the windows change more than the steps too: 1-2.3 times in the recorded
          runs of tests/data/detection, 1.4-1.9 times (median) in the benchmark's
          clean jobs of seeds 70 and 71.
        - The floor: the window-to-window changes span a few hundred rank-steps and lag
          a sudden burst of contention on the node, when one rank or another is 10-40 %
          slower for a few steps and a healthy rank was named (2 and 4 ranks on the
          benchmark's two shared cores). The changes of each rank's ratio from one step
          to the next follow the noise at once and leave a steady slowdown out."""
        jump = _step_jump(ratios, values, state.ranks, self._min_excess_s)
        if jump is not None:
            state.jumps.append(jump)
        if sigma is None:
            return None
        jumps = state.jumps
        if self._max_window_noise and len(jumps) >= _MIN_NOISE:
            long = list(jumps)[-self._noise_samples :]
            sigma = min(sigma, self._max_window_noise * self._jump_sigma(long))
        recent = self._step_noise_steps
        if not recent or len(jumps) < min(recent, _MIN_NOISE):
            return sigma
        return max(sigma, self._jump_sigma(list(jumps)[-recent:]))

    def _jump_sigma(self, jumps: list[float]) -> float:
        """The window statistic's noise from per-step ``jumps``: a change is the
        difference of two steps' noise (sqrt(2) times as wide); the upper quartile, not
        the median, so a burst raises the bar within a few steps. The window statistic's
        noise is a share of a single step's."""
        ordered = sorted(jumps)
        per_step = ordered[3 * len(ordered) // 4] * _Q75_TO_SIGMA / math.sqrt(2)
        return per_step * self._stat_per_step

    def _settle(self, state: _RankState, floor: float) -> None:
        """Count one more step of a cleared rank back in line (its window statistic
        under ``floor``), or start the count again; ``hold_steps`` in a row settle it."""
        stat = self._statistic(state, recent=True)
        if stat is not None and stat < floor:
            state.settled_steps += 1
            if state.settled_steps >= self._hold_steps:
                state.unsettled, state.settled_steps = False, 0
        else:
            state.settled_steps = 0

    def _statistic(self, state: _RankState, *, recent: bool) -> float | None:
        """The ``persistence``-th largest ratio of the last ``window_steps`` steps
        (``recent``) or of the ``window_steps`` before them; None until there are as
        many. It passes a bar exactly when ``persistence`` of the window's steps do."""
        n = self._window_steps
        ratios = state.ratios
        if len(ratios) < (n if recent else 2 * n):
            return None
        window = list(ratios)[-n:] if recent else list(ratios)[-2 * n : -n]
        window.sort()
        return window[-self._persistence]

    def _overshadowed(self, state: _JobState, rank: int, stat: float, bar: float) -> bool:
        """Whether another rank's window statistic, or its latest step's ratio, passes
        ``bar`` and is at least ``overshadow_ratio`` times ``stat`` (this rank's)."""
        factor = self._overshadow_ratio
        if factor <= 0:
            return False
        least = max(bar, factor * stat)
        for other, other_state in state.ranks.items():
            if other == rank or not other_state.ratios:
                continue
            other_stat = self._statistic(other_state, recent=True)
            if other_state.ratios[-1] >= least or (other_stat is not None and other_stat >= least):
                return True
        return False

    def _streak(self, state: _RankState, bar: float) -> bool:
        """Whether the last ``streak_steps`` steps all passed ``bar`` (never when 0)."""
        k = self._streak_steps
        ratios = state.ratios
        if k == 0 or len(ratios) < k:
            return False
        return all(ratios[-i] > bar for i in range(1, k + 1))

    def pause(self, job: str, from_step: int, until_step: int) -> None:
        """Leave ``job``'s steps ``from_step <= step < until_step`` unscored (a config
        switch and the steps it takes to settle). Ranges overlapping earlier ones merge."""
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = self._new_job()
        kept = [(a, b) for a, b in state.paused if b >= from_step - 1]
        for a, b in kept:
            if a <= until_step and from_step <= b:
                from_step, until_step = min(a, from_step), max(b, until_step)
        state.paused = [(a, b) for a, b in kept if not (a >= from_step and b <= until_step)]
        state.paused.append((from_step, until_step))

    def active(self) -> list[Finding]:
        """Every active finding, ordered by job and rank."""
        return [f for job in sorted(self._jobs) for f in _active_findings(self._jobs[job])]

    def forget(self, job: str) -> None:
        """Drop all state of a finished job (unknown jobs are ignored)."""
        self._jobs.pop(job, None)

    def _new_job(self) -> _JobState:
        return _JobState(
            noise=deque(maxlen=self._noise_samples),
            jumps=deque(maxlen=max(self._noise_samples, self._step_noise_steps)),
        )

    def _new_rank(self, state: _JobState, rank: int) -> _RankState:
        n = self._window_steps
        created = state.ranks[rank] = _RankState(
            ratios=deque(maxlen=2 * n),
            computes=deque(maxlen=n),
            peers=deque(maxlen=n),
            times=deque(maxlen=n),
        )
        return created

    def _advance(
        self,
        job: str,
        step: int,
        ts: float,
        rank: int,
        state: _RankState,
        bar: float,
        *,
        holds: bool,
    ) -> None:
        if holds:
            if not state.active:
                state.active = True
                state.active_steps = 0
                n = self._window_steps
                recent = list(state.ratios)[-n:]
                state.since_unix_s = next(
                    (t for t, r in zip(state.times, recent, strict=True) if r > bar), ts
                )
            state.active_steps += 1
            state.quiet_steps = 0
            state.finding = self._finding(
                job, step, state, _score(rank, state, bar, self._window_steps)
            )
            return
        if not state.active:
            return
        state.active_steps += 1
        state.quiet_steps += 1
        if state.quiet_steps >= self._hold_steps:
            state.active = False
            state.active_steps = state.quiet_steps = 0
            state.finding = None
            state.unsettled, state.settled_steps = True, 0
        elif state.finding is not None:
            steps, chronic = state.active_steps, self._chronic_steps
            state.finding = _with_steps(state.finding, step, steps, chronic)

    def _finding(self, job: str, step: int, state: _RankState, score: _Score) -> Finding:
        rank = score.rank
        summary = (
            f"rank {rank} of job {job} computes {score.slowdown_ratio:.2f}x slower than "
            f"the median of its peers at the same steps ({score.compute_s:.3f} s vs "
            f"{score.peer_median_s:.3f} s)"
        )
        finding = Finding(
            kind="straggler",
            labels={"job": job, "rank": str(rank)},
            value=score.compute_s,
            score=score.slowdown_ratio,
            summary=summary,
            since_unix_s=state.since_unix_s,
            recommendation=_ADVICE,
            severity="high",
            details={
                "slowdown_ratio": score.slowdown_ratio,
                "peer_median_s": score.peer_median_s,
                "bar_ratio": score.bar_ratio,
                "method": "peers_same_step",
                "step": step,
                "steps": state.active_steps,
                "chronic": False,
            },
        )
        return _with_steps(finding, step, state.active_steps, self._chronic_steps)


_ADVICE: Final = (
    "Check the rank's node: thermal or power throttling (nvidia-smi -q -d PERFORMANCE), "
    "CPU contention from other processes, its data loader and storage, and other "
    "processes on its GPU."
)


def _with_steps(finding: Finding, step: int, steps: int, chronic_steps: int) -> Finding:
    """``finding`` as of ``step``, active for ``steps`` steps (chronic from
    ``chronic_steps``)."""
    chronic = steps >= chronic_steps
    details = {**finding.details, "step": step, "steps": steps, "chronic": chronic}
    recommendation = finding.recommendation
    if chronic:
        rank = finding.labels["rank"]
        recommendation = (
            f"Rank {rank} has been slower than its peers for {steps} steps and holds back "
            "every step of the job: if its hardware differs from its peers' or its data "
            "shard is larger, rebalance the work; otherwise check its node for thermal or "
            "power throttling, CPU contention and a slow data loader."
        )
    return replace(finding, details=details, recommendation=recommendation)


def _score(rank: int, state: _RankState, bar: float, n: int) -> _Score:
    return _Score(
        rank=rank,
        compute_s=_median(sorted(state.computes)),
        peer_median_s=_median(sorted(state.peers)),
        slowdown_ratio=math.exp(_median(sorted(list(state.ratios)[-n:]))),
        bar_ratio=math.exp(bar),
    )


def _paused(state: _JobState, step: int) -> bool:
    return any(a <= step < b for a, b in state.paused)


def _log_ratios(values: Mapping[int, float], named: set[int]) -> dict[int, tuple[float, float]]:
    """Each rank's log(value / median of its peers' values), with that median; all
    values > 0.

    The peers are the ranks not ``named`` stragglers (while at least two are left): with
    few ranks a straggler would move its peers' reference, and each of its slow spells
    would look like noise on theirs.
    """
    reference = [x for rank, x in values.items() if rank not in named]
    if len(reference) < 2:
        reference, named = list(values.values()), set()
    reference.sort()
    n = len(reference)
    whole = _median(reference)
    # The median of the n - 1 values left when one x (at index i) is taken out: the
    # j-th of them is reference[j] below i, reference[j + 1] from i on.
    mid = (n - 1) // 2
    odd = (n - 1) % 2 == 1
    log, bisect_left = math.log, bisect.bisect_left
    out: dict[int, tuple[float, float]] = {}
    for rank, x in values.items():
        if rank in named:
            peers = whole
        else:
            i = bisect_left(reference, x)
            upper = reference[mid] if mid < i else reference[mid + 1]
            if odd:
                peers = upper
            else:
                lower = reference[mid - 1] if mid - 1 < i else reference[mid]
                peers = (lower + upper) / 2
        out[rank] = (log(x / peers), peers)
    return out


def _window_sigma(noise: deque[float]) -> float | None:
    """Standard deviation of the window statistic when nothing is wrong, from the
    absolute changes ``noise`` between consecutive windows (a change is the difference
    of two windows' noise: sqrt(2) times as wide); None with too few samples."""
    if len(noise) < _MIN_NOISE:
        return None
    ordered = sorted(noise)
    return ordered[3 * len(ordered) // 4] * _Q75_TO_SIGMA / math.sqrt(2)


def _step_jump(
    ratios: Mapping[int, tuple[float, float]],
    values: Mapping[int, float],
    ranks: Mapping[int, _RankState],
    min_excess_s: float,
) -> float | None:
    """The median over ranks of |this step's ratio - the rank's ratio at its previous
    scored step| (called before this step's are appended; a ratio counts as the
    detector keeps it, 0 at most where too little time was lost); None when no rank
    has an earlier one."""
    jumps = []
    for rank, (ratio, peers_s) in ratios.items():
        state = ranks.get(rank)
        if state is None or not state.ratios:
            continue
        if values[rank] - peers_s < min_excess_s:
            ratio = min(ratio, 0.0)
        jumps.append(abs(ratio - state.ratios[-1]))
    jumps.sort()
    return _median(jumps) if jumps else None


def _order_statistic_sd(n: int, k: int) -> float:
    """Standard deviation of the k-th largest of n independent standard normal values
    (the large-sample approximation): the window statistic's noise per unit of a
    single step's."""
    p = (n - k + 1) / (n + 1)
    x = statistics.NormalDist().inv_cdf(p)
    density = statistics.NormalDist().pdf(x)
    return math.sqrt(p * (1 - p) / n) / density


def _usable(compute_s_by_rank: Mapping[int, float]) -> dict[int, float]:
    """The finite, positive compute times."""
    return {rank: x for rank, x in compute_s_by_rank.items() if math.isfinite(x) and x > 0}


def _median(ordered: list[float]) -> float:
    """Median of an already sorted, non-empty list."""
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
