"""Straggler detection: the rank that makes the others wait, and in which phase.

In synchronous training every rank waits, in its next collective, for the last rank to
arrive, so a rank is late by what it spends before that collective: its compute, the
time its threads wait for a CPU (``host``) and its wait for the next batch (``input``).
Each complete step gives every rank a log ratio, ``log(late / median of its peers' late
at that step)``: a rank is compared with what the others did in the same step, never
with its own history, so a lasting slowdown never becomes the rank's normal.

The contract (settings in ``StragglerSettings``; the why of each choice and the measured
rates in ``docs/detectors/straggler.md``):

- A step is *slow* for a rank when its ratio passes the bar: the larger of a relative
  floor (``min_slowdown``) and ``z_threshold`` times the job's per-step noise, measured
  from the changes of every unnamed rank's ratio from one step to the next (a steady
  slowdown does not change its rank's ratio, so a straggler cannot raise its own bar).
  There is no floor in seconds: on short steps the bar is what the noise says.
- A *finding* (shown on the pages and the report) names a rank with ``persistence`` slow
  steps of its last ``window_steps``, or ``streak_steps`` in a row. It clears after
  ``hold_steps`` steps in a row without that, so an on/off straggler stays one finding.
- A finding *pages* (``details["page"]``: the Straggler rule fires only then) once the
  rank was slow in ``page_steps`` of its last ``page_window_steps`` and the finding's
  condition holds at that step (it is slow now, not just back in line): slowness lasting a
  few steps (a preempted process, a garbage collection, another job's burst) is shown
  but never wakes anybody. With slow steps independent at rate ``p`` on a healthy rank
  the chance a window pages is the binomial tail ``P(X >= page_steps)``.
- The finding's figures are computed here, once: ``slowdown_ratio`` (the median, over
  the finding's slow steps, of the rank's late time over its peers' median), the
  ``excess_s`` it costs each such step and the ``phase`` (compute, input or host) that
  holds most of that excess.
- The peers' median leaves out ranks already named (while two others are left); steps
  of a config switch (``pause``) and the first ``warmup_steps`` are not scored.

Pure and deterministic; O(world_size) per complete step. Not thread-safe.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Final

from torshmon.aggregator.core.findings import Finding
from torshmon.settings import Section, setting

#: The phases a rank can be late in, reported in ``details["phase"]``.
PHASES: Final = ("compute", "input", "host")
#: Median of |N(0, 1)|: scales a median absolute value to a standard deviation.
_MAD_TO_SIGMA: Final = 1 / 0.6744897501960817
#: Fewer steps of noise samples than this are no estimate: nothing is named before.
_MIN_NOISE_STEPS: Final = 16
#: The noise is sampled from this many ranks a step at most, so a large job's estimate
#: still spans many steps.
_NOISE_RANKS_PER_STEP: Final = 16
#: A finding's slow steps kept for its figures (the latest).
_EPISODE_STEPS: Final = 64


class StragglerSettings(Section, frozen=True):
    """The straggler detector's settings, checked once when built."""

    min_slowdown: Annotated[
        float,
        setting(
            "a step is slow for a rank only if it is late by at least this share of its "
            "peers' median (0.05 = 5 %), however quiet the job",
            gt=0,
        ),
    ] = 0.05
    z_threshold: Annotated[
        float,
        setting(
            "and by more than this many standard deviations of the job's per-step noise "
            "(measured from the step-to-step changes of the ranks' ratios)",
            gt=0,
        ),
    ] = 1.6
    persistence: Annotated[
        int, setting("slow steps of the last window_steps that make a finding", ge=1)
    ] = 6
    window_steps: Annotated[
        int, setting("steps persistence is counted over (>= persistence)", ge=1)
    ] = 8
    streak_steps: Annotated[
        int, setting("or this many slow steps in a row make a finding (0: off)", ge=0)
    ] = 5
    page_steps: Annotated[
        int,
        setting(
            "a finding pages (fires the Straggler rule) once the rank was slow in this "
            "many of its last page_window_steps steps",
            ge=1,
        ),
    ] = 16
    page_window_steps: Annotated[
        int, setting("steps page_steps is counted over (>= page_steps)", ge=1)
    ] = 28
    hold_steps: Annotated[
        int,
        setting("steps in a row without the finding's condition before it clears", ge=1),
    ] = 25
    noise_samples: Annotated[
        int,
        setting(
            "the latest step-to-step changes of the ranks' ratios the noise is measured "
            "from (up to 16 ranks a step)",
            ge=16,
        ),
    ] = 1024
    warmup_steps: Annotated[int, setting("complete steps not scored at a job's start", ge=0)] = 10
    chronic_steps: Annotated[
        int, setting("steps a finding stays active before it is marked chronic", ge=1)
    ] = 500

    def __post_init__(self) -> None:
        super().__post_init__()
        for small, large in (
            ("persistence", "window_steps"),
            ("streak_steps", "window_steps"),
            ("page_steps", "page_window_steps"),
        ):
            if getattr(self, small) > getattr(self, large):
                raise ValueError(
                    f"{small} must be at most {large} ({getattr(self, large)}), "
                    f"got {getattr(self, small)}"
                )


@dataclass(frozen=True, slots=True)
class RankStep:
    """What one rank spent before its step's collectives, in seconds: ``compute_s``
    (the step's compute less the time its threads waited for a CPU), ``host_s`` (that
    wait) and ``input_s`` (its wait for the batch before the step)."""

    compute_s: float
    input_s: float = 0.0
    host_s: float = 0.0

    @property
    def late_s(self) -> float:
        return self.compute_s + self.input_s + self.host_s


@dataclass(frozen=True, slots=True)
class _SlowStep:
    """One slow step of a rank: its ratio (as a factor), its and its peers' late time,
    and its excess over its peers by phase (each against the peers' median of it)."""

    ratio: float
    late_s: float
    peers_s: float
    phase_excess_s: tuple[float, float, float]


@dataclass(slots=True, eq=False)
class _Episode:
    """A finding's slow steps (the latest ``_EPISODE_STEPS``) and their excess by phase
    summed over all of them."""

    steps: deque[_SlowStep] = field(default_factory=lambda: deque(maxlen=_EPISODE_STEPS))
    phase_s: list[float] = field(default_factory=lambda: [0.0] * len(PHASES))
    count: int = 0

    def add(self, slow: _SlowStep) -> None:
        self.steps.append(slow)
        self.count += 1
        for i, excess in enumerate(slow.phase_excess_s):
            self.phase_s[i] += excess


@dataclass(slots=True, eq=False)
class _RankState:
    """One rank's last ``window_steps`` steps (time, and the slow step or None), its
    slow-step flags of the last page window, its last ratio and its finding."""

    flags: deque[bool]
    window: deque[tuple[float, _SlowStep | None]]
    #: Slow steps among the last ``window_steps`` and ``page_window_steps``, and in a
    #: row up to the latest (kept as the flags come, not counted again each step).
    in_window: int = 0
    in_page_window: int = 0
    in_a_row: int = 0
    last_ratio: float | None = None
    active: bool = False
    paged: bool = False
    active_steps: int = 0
    quiet_steps: int = 0
    since_unix_s: float = 0.0
    episode: _Episode = field(default_factory=_Episode)
    finding: Finding | None = None


class _RollingMedian:
    """The median of the latest ``size`` values, kept sorted as they come (a value in
    and the oldest out cost a bisection and a list shift, not a sort each step)."""

    __slots__ = ("_order", "_sorted")

    def __init__(self, size: int) -> None:
        self._order: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._order)

    def add(self, x: float) -> None:
        if len(self._order) == self._order.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._order[0])]
        self._order.append(x)
        bisect.insort(self._sorted, x)

    def median(self) -> float:
        return _median(self._sorted)


@dataclass(slots=True)
class _JobState:
    #: |change of an unnamed rank's ratio from its previous scored step|.
    noise: _RollingMedian
    complete_steps: int = 0
    noise_steps: int = 0
    ranks: dict[int, _RankState] = field(default_factory=dict)
    #: Steps ``[from, until)`` of config switches, not scored.
    paused: list[tuple[int, int]] = field(default_factory=list)


class StragglerDetector:
    """Names the rank whose time before the step's collectives lags its peers'.

    Feed it complete steps (every rank's ``RankStep``) in step order; it returns the
    job's active findings. Pure and deterministic; not thread-safe.
    """

    def __init__(self, settings: StragglerSettings | None = None) -> None:
        self.settings = s = settings if settings is not None else StragglerSettings()
        self._floor = math.log1p(s.min_slowdown)
        self._flags_kept = max(s.window_steps, s.page_window_steps)
        self._jobs: dict[str, _JobState] = {}

    # -- the public surface ---------------------------------------------------------------

    def observe_step(
        self,
        job: str,
        step: int,
        compute_s_by_rank: Mapping[int, float | RankStep],
        ts_unix_s: float,
    ) -> list[Finding]:
        """Score one complete step of ``job``; the job's active findings, by rank.

        A plain float is a rank's compute time alone. Ranks whose late time is not a
        finite positive number are left out of this step; fewer than 2 usable ranks, a
        warm-up step and a paused step leave every rank's state as it was.
        """
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = self._new_job()
        values = _usable(compute_s_by_rank)
        if len(values) < 2 or _paused(state, step):
            return _active_findings(state)
        state.complete_steps += 1
        if state.complete_steps <= self.settings.warmup_steps:
            return _active_findings(state)
        named = {rank for rank, r in state.ranks.items() if r.active and rank in values}
        ratios = _log_ratios({rank: v.late_s for rank, v in values.items()}, named)
        self._sample_noise(state, step, ratios, named)
        bar = self._bar(state)
        for rank, (ratio, peers_s) in ratios.items():
            rank_state = state.ranks.get(rank) or self._new_rank(state, rank)
            rank_state.last_ratio = ratio
            if bar is None:
                continue
            slow = _slow_step(rank, ratio, peers_s, values) if ratio > bar else None
            self._flag(rank_state, slow is not None)
            rank_state.window.append((ts_unix_s, slow))
            if slow is not None and rank_state.active:
                rank_state.episode.add(slow)
            self._advance(job, step, ts_unix_s, rank, rank_state, bar)
        return _active_findings(state)

    def bar_ratio(self, job: str) -> float | None:
        """The factor a rank of ``job`` must be late by for a step to count as slow now
        (``exp`` of the bar); None before the noise is measured."""
        state = self._jobs.get(job)
        bar = None if state is None else self._bar(state)
        return None if bar is None else math.exp(bar)

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

    # -- the noise and the bar ------------------------------------------------------------

    def _sample_noise(
        self,
        state: _JobState,
        step: int,
        ratios: Mapping[int, tuple[float, float]],
        named: set[int],
    ) -> None:
        """Add the step-to-step changes of the unnamed ranks' ratios (at most
        ``_NOISE_RANKS_PER_STEP`` ranks a step, in turns) to the job's noise."""
        stride = -(-len(ratios) // _NOISE_RANKS_PER_STEP)
        sampled = False
        for i, (rank, (ratio, _)) in enumerate(ratios.items()):
            previous = state.ranks.get(rank)
            if rank in named or previous is None or previous.last_ratio is None:
                continue
            if (i + step) % stride == 0:
                state.noise.add(abs(ratio - previous.last_ratio))
                sampled = True
        if sampled and state.noise_steps < _MIN_NOISE_STEPS:
            state.noise_steps += 1

    def _bar(self, state: _JobState) -> float | None:
        """The log ratio a slow step passes; None until the noise is measured.

        A change is the difference of two steps' noise, sqrt(2) times as wide; its median
        is robust to the rare large changes of a burst or of an on/off straggler's switch.
        """
        if state.noise_steps < _MIN_NOISE_STEPS:
            return None
        sigma = state.noise.median() * _MAD_TO_SIGMA / math.sqrt(2)
        return max(self._floor, self.settings.z_threshold * sigma)

    # -- one rank's finding ---------------------------------------------------------------

    def _flag(self, rank_state: _RankState, slow: bool) -> None:
        """Append one step's flag and move the counts with it."""
        s, flags = self.settings, rank_state.flags
        if len(flags) >= s.window_steps:
            rank_state.in_window -= flags[-s.window_steps]
        if len(flags) >= s.page_window_steps:
            rank_state.in_page_window -= flags[-s.page_window_steps]
        flags.append(slow)
        rank_state.in_window += slow
        rank_state.in_page_window += slow
        rank_state.in_a_row = rank_state.in_a_row + 1 if slow else 0

    def _holds(self, rank_state: _RankState) -> bool:
        """Whether the finding's condition holds: ``persistence`` slow steps of the last
        ``window_steps``, or ``streak_steps`` in a row."""
        s = self.settings
        k = s.streak_steps
        return rank_state.in_window >= s.persistence or (k > 0 and rank_state.in_a_row >= k)

    def _pages(self, rank_state: _RankState) -> bool:
        return rank_state.in_page_window >= self.settings.page_steps

    def _advance(
        self, job: str, step: int, ts: float, rank: int, rank_state: _RankState, bar: float
    ) -> None:
        holds = self._holds(rank_state)
        if not (holds or rank_state.active):
            return
        if not rank_state.active:
            self._open(rank_state, ts)
        rank_state.active_steps += 1
        rank_state.quiet_steps = 0 if holds else rank_state.quiet_steps + 1
        if rank_state.quiet_steps >= self.settings.hold_steps:
            self._close(rank_state)
            return
        # A page needs the slowness now too: a count that reached page_steps only as the
        # rank came back in line would page for what has just ended.
        rank_state.paged = rank_state.paged or (holds and self._pages(rank_state))
        rank_state.finding = self._finding(job, step, rank, rank_state, bar)

    def _open(self, rank_state: _RankState, ts: float) -> None:
        """Start a finding: its onset is the first slow step of the window that made it,
        and the window's slow steps are its first figures."""
        rank_state.active = True
        rank_state.active_steps = rank_state.quiet_steps = 0
        rank_state.episode = episode = _Episode()
        slow_steps = [(t, slow) for t, slow in rank_state.window if slow is not None]
        rank_state.since_unix_s = slow_steps[0][0] if slow_steps else ts
        for _, slow in slow_steps:
            episode.add(slow)

    def _close(self, rank_state: _RankState) -> None:
        rank_state.active = rank_state.paged = False
        rank_state.active_steps = rank_state.quiet_steps = 0
        rank_state.finding = None

    def _finding(
        self, job: str, step: int, rank: int, rank_state: _RankState, bar: float
    ) -> Finding:
        figures = episode_figures(rank_state.episode)
        steps = rank_state.active_steps
        chronic = steps >= self.settings.chronic_steps
        return Finding(
            kind="straggler",
            labels={"job": job, "rank": str(rank)},
            value=figures.late_s,
            score=figures.slowdown_ratio,
            summary=_summary(job, rank, figures),
            since_unix_s=rank_state.since_unix_s,
            recommendation=_advice(rank, figures.phase, steps, chronic),
            severity="high",
            details={
                "slowdown_ratio": figures.slowdown_ratio,
                "peer_median_s": figures.peer_median_s,
                "late_s": figures.late_s,
                "excess_s": figures.excess_s,
                "phase": figures.phase,
                "phase_excess_s": figures.phase_excess_s,
                "bar_ratio": math.exp(bar),
                "method": "peers_same_step",
                "page": rank_state.paged,
                "step": step,
                "steps": steps,
                "chronic": chronic,
            },
        )

    # -- state ----------------------------------------------------------------------------

    def _new_job(self) -> _JobState:
        return _JobState(noise=_RollingMedian(self.settings.noise_samples))

    def _new_rank(self, state: _JobState, rank: int) -> _RankState:
        created = state.ranks[rank] = _RankState(
            flags=deque(maxlen=self._flags_kept),
            window=deque(maxlen=self.settings.window_steps),
        )
        return created


@dataclass(frozen=True, slots=True)
class EpisodeFigures:
    """A finding's figures over its slow steps: the rank's ``slowdown_ratio`` (median of
    its late time over its peers' median), its and its peers' median late time, the
    median ``excess_s`` (what each slow step costs the job) and the ``phase`` holding
    most of the excess (``phase_excess_s``: the mean excess per slow step by phase)."""

    slowdown_ratio: float
    late_s: float
    peer_median_s: float
    excess_s: float
    phase: str
    phase_excess_s: Mapping[str, float]


def episode_figures(episode: _Episode) -> EpisodeFigures:
    """The figures of a finding's episode (at least one slow step)."""
    steps = episode.steps
    by_phase = {
        phase: total / episode.count for phase, total in zip(PHASES, episode.phase_s, strict=True)
    }
    return EpisodeFigures(
        slowdown_ratio=_median(sorted(x.ratio for x in steps)),
        late_s=_median(sorted(x.late_s for x in steps)),
        peer_median_s=_median(sorted(x.peers_s for x in steps)),
        excess_s=_median(sorted(x.late_s - x.peers_s for x in steps)),
        phase=max(PHASES, key=lambda phase: by_phase[phase]),
        phase_excess_s=by_phase,
    )


def _slow_step(
    rank: int, ratio: float, peers_s: float, values: Mapping[int, RankStep]
) -> _SlowStep:
    """A slow step of ``rank``: its ratio, its and its peers' late time, and its excess
    by phase, each phase against the median of its peers' (the others at this step)."""
    mine = values[rank]
    others = [v for other, v in values.items() if other != rank]
    excess = tuple(
        max(0.0, getattr(mine, name) - _median(sorted(getattr(v, name) for v in others)))
        for name in ("compute_s", "input_s", "host_s")
    )
    return _SlowStep(math.exp(ratio), mine.late_s, peers_s, excess)


_WHAT: Final = {
    "compute": "computes {ratio:.2f}x as long as the median of its peers at the same steps",
    "input": "waits for its input so long that it is {ratio:.2f}x as late as its peers",
    "host": "waits for a CPU so long that it is {ratio:.2f}x as late as its peers",
}


def _summary(job: str, rank: int, figures: EpisodeFigures) -> str:
    what = _WHAT[figures.phase].format(ratio=figures.slowdown_ratio)
    return (
        f"rank {rank} of job {job} {what} ({figures.late_s:.3f} s vs "
        f"{figures.peer_median_s:.3f} s before each step's collectives; mostly "
        f"{figures.phase})"
    )


_ADVICE: Final = {
    "compute": (
        "Check the rank's node: thermal or power throttling (nvidia-smi -q -d PERFORMANCE), "
        "other processes on its GPU, or a larger share of the data on this rank."
    ),
    "input": (
        "The rank's data loader is slower than its peers': more workers, pinned memory, "
        "prefetching, or its storage (a slower disk or network mount on its node)."
    ),
    "host": (
        "The rank's threads wait for a CPU: other processes on its node, too few cores for "
        "its data-loader workers and threads, or a CPU-affinity setting."
    ),
}


def _advice(rank: int, phase: str, steps: int, chronic: bool) -> str:
    if not chronic:
        return _ADVICE[phase]
    return (
        f"Rank {rank} has been slower than its peers for {steps} steps and holds back "
        "every step of the job: if its hardware differs from its peers' or its data shard "
        f"is larger, rebalance the work. {_ADVICE[phase]}"
    )


def _active_findings(state: _JobState) -> list[Finding]:
    return [s.finding for _, s in sorted(state.ranks.items()) if s.active and s.finding is not None]


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
    out: dict[int, tuple[float, float]] = {}
    for rank, x in values.items():
        if rank in named:
            peers = whole
        else:
            i = bisect.bisect_left(reference, x)
            upper = reference[mid] if mid < i else reference[mid + 1]
            if odd:
                peers = upper
            else:
                lower = reference[mid - 1] if mid - 1 < i else reference[mid]
                peers = (lower + upper) / 2
        out[rank] = (math.log(x / peers), peers)
    return out


def _usable(by_rank: Mapping[int, float | RankStep]) -> dict[int, RankStep]:
    """Each rank's ``RankStep`` (a float is compute alone) whose late time is finite and
    positive, its parts finite."""
    out = {}
    for rank, value in by_rank.items():
        v = value if isinstance(value, RankStep) else RankStep(value)
        late = v.late_s
        if math.isfinite(late) and late > 0 and v.compute_s >= 0:
            out[rank] = v
    return out


def _median(ordered: list[float]) -> float:
    """Median of an already sorted, non-empty list."""
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


__all__ = ["PHASES", "EpisodeFigures", "RankStep", "StragglerDetector", "StragglerSettings"]
