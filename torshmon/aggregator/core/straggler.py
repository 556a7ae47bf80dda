"""Cross-rank straggler detection on compute time (step time minus communication wait).

In a blocking collective the slow rank waits least, so its collective time looks
best; compute time is where a straggler shows. Each complete step is scored across
ranks with a robust z-score, ``0.6745 * (x - median) / MAD``, the MAD floored at
``mad_floor_ratio`` of the median so that ranks in lock-step (MAD ~ 0) do not turn
microsecond noise into huge z. A rank is flagged on a step when its robust z passes
``z_threshold`` AND it computes at least ``min_slowdown`` more than the median of its
peers (a shift worth acting on, as in Greyhound/Falcon: >= 10 %). A finding becomes
active after ``persistence`` flagged steps in a row and clears after ``persistence``
steps in a row without.

Guards keep noise from naming a rank. Measured on the demo (2 ranks sharing 2 busy
cores with the aggregator): single steps' compute scattered by 20-50 %, rank 0 computed
1.2-1.8x its peer on 27 of 220 clean steps, three in a row during warm-up, and the
plain rule named it.

- Each rank is scored on the median of its last ``smoothing`` compute times, so one
  noisy step never counts. A rank is named after ``persistence`` (4) flagged smoothed
  steps, its fourth slow step; one at least ``1 + fast_slowdown`` (3x) slower than
  its peers after ``fast_persistence`` (2), its third. On 2 shared cores contention
  made single ranks 1.5-2x slower for up to three steps in a row; a sustained
  straggler lasts longer, a severe one is obvious sooner.
- A rank must also be slower than its own history: above the median of its last
  ``history_steps`` unflagged (smoothed) compute times by ``min_slowdown`` and by
  ``z_threshold`` robust standard deviations of that history, so the bar rises with
  the noise. A rank that has always been somewhat slower (rank 0 also hosting the
  store, a slower GPU model) is that rank's normal, not a new fault. A rank at least
  ``standalone_slowdown`` (50 %) slower than the median of its peers is named
  whatever its history. The first ``warmup_steps`` complete steps only build history.

Decisions:

- World size 2 has no meaningful MAD (each rank is the other's only peer): there the
  log of the two ranks' compute ratio is compared with its own history, and a rank is
  flagged when the ratio moves its way by at least ``pair_min_slowdown`` (50 %, a
  higher bar than ``min_slowdown`` because with one peer there is no majority to say
  which rank is normal, and because clean demo runs on 2 shared cores showed 1.3x
  episodes lasting five steps) and by ``z_threshold`` robust standard deviations of
  that history. Score: the move, as a factor. The rank must also be slower than its
  own history by the same ``pair_min_slowdown`` (unless it is ``1 + fast_slowdown``,
  3x, slower than its peer now): when one rank recovers from a long slow phase (a
  memory leak made a rank 1.3-2x slower for 120 steps in the detection benchmark), the
  ratio swings the peer's way against a history the slow phase had shifted, and the
  peer, no slower than ever, was named. A pair does not take ``standalone_slowdown``
  (50 %) as its bypass: that is the pair's own bar, so every flagged step would pass
  it and the history check would guard nothing. It failed so after a job-wide
  slowdown ended (CI, test_faults regression): the ranks' compute fell from ~180 ms
  back to ~10 ms, where the shared cores' noise makes one rank 1.3-1.5x its peer for
  several steps, against a pair history the slowdown had filled with ratios near 1;
  that rank, far below its own (slowed) history, was named.
- A permanently slower rank keeps its finding: synchronous data-parallel training
  runs at its slowest rank's pace, so the slowdown costs every step. Once the finding
  has been active for ``window_steps`` steps it is marked ``chronic`` and its
  recommendation turns to heterogeneous hardware and uneven data shards. Flagged steps
  never enter a rank's history, so a straggler does not become its own normal.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Final

import msgspec

from torshmon.aggregator.core.findings import Finding
from torshmon.settings import Section, setting

#: Scales the MAD of a normal distribution to its standard deviation (Iglewicz-Hoaglin).
_MAD_TO_Z: Final = 0.6745
_TINY: Final = 1e-12
#: Scales a MAD to a standard deviation (normal data).
_MAD_TO_SIGMA: Final = 1.4826
#: Fewer past values than this are no baseline.
_MIN_HISTORY: Final = 5


def _rank_of(item: tuple[int, Finding | None]) -> int:
    return item[0]


@dataclass(frozen=True, slots=True)
class CompleteStep:
    """One step of one job with a compute time from every rank; ``ts_unix_s`` is the
    time of the report that completed it."""

    job: str
    step: int
    compute_s_by_rank: Mapping[int, float]
    ts_unix_s: float


class StepCollector:
    """Collects per-rank step reports until every rank of the step has reported.

    Reports of one rank arrive in step order, so once step ``s`` is complete every
    rank is past all older steps: pending steps older than ``s`` can no longer
    complete (a rank dropped them) and are evicted then. At most
    ``max_pending_steps`` incomplete steps are kept per job (the oldest go first), so
    a silent rank cannot grow memory. O(1) amortised per report.
    """

    def __init__(self, world_size: int, *, max_pending_steps: int = 256) -> None:
        """Raises ValueError if world_size < 1 or max_pending_steps < 1."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if max_pending_steps < 1:
            raise ValueError(f"max_pending_steps must be at least 1, got {max_pending_steps}")
        self._world_size = world_size
        self._max_pending = max_pending_steps
        # Per job: step -> compute_s by rank, in the order steps were first reported.
        self._pending: dict[str, dict[int, dict[int, float]]] = {}

    @property
    def world_size(self) -> int:
        return self._world_size

    def add(
        self, job: str, step: int, rank: int, compute_s: float, ts_unix_s: float
    ) -> CompleteStep | None:
        """Record one rank's compute time for a step; the step once it is complete.

        A repeated report of the same (job, step, rank) replaces the earlier one.
        Raises ValueError if ``rank`` is outside ``0..world_size-1``.
        """
        done = self.add_many(job, rank, (step,), (compute_s,), (ts_unix_s,))
        return done[0][1] if done else None

    def add_many(
        self,
        job: str,
        rank: int,
        steps: Sequence[int],
        compute_s: Sequence[float],
        ts_unix_s: Sequence[float],
    ) -> list[tuple[int, CompleteStep]]:
        """``add`` for consecutive reports of one rank, in order; ``(index, step)`` for
        each report that completed a step (the ingest hot path: one call per batch).

        Raises ValueError if ``rank`` is outside ``0..world_size-1`` or the lengths differ.
        """
        if not 0 <= rank < self._world_size:
            raise ValueError(f"rank must be in 0..{self._world_size - 1}, got {rank}")
        if not len(steps) == len(compute_s) == len(ts_unix_s):
            raise ValueError(
                f"{len(steps)} steps, {len(compute_s)} compute times, {len(ts_unix_s)} times"
            )
        pending = self._pending.get(job)
        if pending is None:
            pending = self._pending[job] = {}
        world_size, max_pending = self._world_size, self._max_pending
        out: list[tuple[int, CompleteStep]] = []
        for i, step in enumerate(steps):
            by_rank = pending.get(step)
            if by_rank is None:
                if len(pending) >= max_pending:
                    del pending[next(iter(pending))]
                by_rank = pending[step] = {}
            by_rank[rank] = compute_s[i]
            if len(by_rank) < world_size:
                continue
            del pending[step]
            while pending:
                oldest = next(iter(pending))
                if oldest >= step:
                    break
                del pending[oldest]
            out.append((i, CompleteStep(job, step, by_rank, ts_unix_s[i])))
        return out

    def pending_steps(self, job: str) -> int:
        """How many incomplete steps of ``job`` are held."""
        return len(self._pending.get(job, ()))

    def forget(self, job: str) -> None:
        """Drop a finished job's pending steps (unknown jobs are ignored)."""
        self._pending.pop(job, None)


@dataclass(slots=True, eq=False)
class _RankState:
    """Recent and normal compute times, persistence counters and the active finding of
    one rank."""

    recent: deque[float]
    history: deque[float]
    flagged_streak: int = 0
    clear_streak: int = 0
    active: bool = False
    active_steps: int = 0
    since_unix_s: float = 0.0
    finding: Finding | None = None

    def smoothed(self) -> float:
        return _median(sorted(self.recent))


@dataclass(slots=True)
class _JobState:
    #: World size 2: log(slower rank's / faster rank's compute) of unflagged steps.
    pair_history: deque[float]
    complete_steps: int = 0
    ranks: dict[int, _RankState] = field(default_factory=dict)
    #: The ranks with a flagged streak or an active finding (usually none): a step
    #: needs to look at these and at the ranks it flags, and the others only append
    #: to their history.
    busy: dict[int, _RankState] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Score:
    """One rank's standing on one step."""

    rank: int
    compute_s: float
    score: float
    slowdown_ratio: float
    peer_median_s: float
    median_s: float
    mad_s: float | None


def _active_findings(state: _JobState) -> list[Finding]:
    """The job's active findings by rank. Active ranks are busy ranks (``_settle`` keeps
    them there), so this sorts those (usually none), not the whole job."""
    active = [
        (rank, rank_state.finding)
        for rank, rank_state in state.busy.items()
        if rank_state.active and rank_state.finding is not None
    ]
    active.sort(key=_rank_of)
    return [finding for _, finding in active]


class StragglerSettings(Section, frozen=True):
    """The straggler detector's settings; the detector checks the rules between them."""

    z_threshold: Annotated[
        float, setting("robust z-score a rank's compute time must pass", gt=0)
    ] = 3.5
    min_slowdown: Annotated[
        float,
        setting("how much slower than its peers' median a rank must compute (0.1 = 10 %)", gt=0),
    ] = 0.10
    persistence: Annotated[int, setting("flagged steps in a row before a rank is named", ge=1)] = 4
    fast_persistence: Annotated[
        int, setting("flagged steps in a row for a rank 1 + fast_slowdown times slower", ge=1)
    ] = 2
    fast_slowdown: Annotated[
        float, setting("slowdown named after fast_persistence steps", gt=0)
    ] = 2.0
    window_steps: Annotated[
        int,
        setting("steps a finding stays active before it is marked chronic (>= persistence)", ge=1),
    ] = 500
    pair_min_slowdown: Annotated[
        float, setting("with two ranks: how far their compute ratio must move (0.5 = 50 %)", gt=0)
    ] = 0.50
    mad_floor_ratio: Annotated[
        float, setting("floor of the MAD as a fraction of the median (ranks in lock-step)", gt=0)
    ] = 0.01
    smoothing: Annotated[
        int, setting("a rank is scored on the median of this many steps", ge=1)
    ] = 3
    warmup_steps: Annotated[int, setting("complete steps that only build history", ge=0)] = 10
    history_steps: Annotated[
        int, setting("unflagged steps each rank's own history holds", ge=1)
    ] = 50
    standalone_slowdown: Annotated[
        float, setting("slowdown named whatever the rank's history (0.5 = 50 %)", gt=0)
    ] = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        StragglerDetector(**msgspec.structs.asdict(self))  # its checks, its messages


class StragglerDetector:
    """Names the rank whose compute time persistently lags its peers'.

    Pure and deterministic; O(world_size log world_size) per complete step. Not
    thread-safe; the aggregator drives it from one task.
    """

    def __init__(
        self,
        *,
        z_threshold: float = 3.5,
        min_slowdown: float = 0.10,
        persistence: int = 4,
        fast_persistence: int = 2,
        fast_slowdown: float = 2.0,
        window_steps: int = 500,
        pair_min_slowdown: float = 0.50,
        mad_floor_ratio: float = 0.01,
        smoothing: int = 3,
        warmup_steps: int = 10,
        history_steps: int = 50,
        standalone_slowdown: float = 0.5,
    ) -> None:
        """Raises ValueError naming any setting outside its allowed range."""
        if not (math.isfinite(z_threshold) and z_threshold > 0):
            raise ValueError(f"z_threshold must be a positive number, got {z_threshold}")
        for name, ratio in (
            ("min_slowdown", min_slowdown),
            ("pair_min_slowdown", pair_min_slowdown),
            ("mad_floor_ratio", mad_floor_ratio),
            ("standalone_slowdown", standalone_slowdown),
        ):
            if not (math.isfinite(ratio) and ratio > 0):
                raise ValueError(f"{name} must be a positive fraction (0.1 = 10 %), got {ratio}")
        if not (math.isfinite(fast_slowdown) and fast_slowdown > 0):
            raise ValueError(f"fast_slowdown must be a positive fraction, got {fast_slowdown}")
        for name, steps, least in (
            ("persistence", persistence, 1),
            ("fast_persistence", fast_persistence, 1),
            ("smoothing", smoothing, 1),
            ("warmup_steps", warmup_steps, 0),
            ("history_steps", history_steps, 1),
        ):
            if steps < least:
                raise ValueError(f"{name} must be at least {least} steps, got {steps}")
        if window_steps < persistence:
            raise ValueError(
                f"window_steps must be at least persistence ({persistence}), got {window_steps}"
            )
        self._z_threshold = z_threshold
        self._min_slowdown = min_slowdown
        self._pair_min_slowdown = pair_min_slowdown
        self._mad_floor_ratio = mad_floor_ratio
        self._persistence = persistence
        self._fast_persistence = min(fast_persistence, persistence)
        self._fast_slowdown = fast_slowdown
        self._window_steps = window_steps
        self._smoothing = smoothing
        self._warmup_steps = warmup_steps
        self._history_steps = history_steps
        self._standalone_slowdown = standalone_slowdown
        self._jobs: dict[str, _JobState] = {}

    def observe_step(
        self, job: str, step: int, compute_s_by_rank: Mapping[int, float], ts_unix_s: float
    ) -> list[Finding]:
        """Score one complete step of ``job``; the job's active findings, by rank.

        Call once per complete step (see ``StepCollector``). Ranks with a non-finite
        or negative compute time are left out of this step; fewer than 2 usable ranks
        leave every rank's state unchanged.
        """
        values = _usable(compute_s_by_rank)
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = _JobState(pair_history=deque(maxlen=self._history_steps))
        if len(values) >= 2:
            ranks = list(values)
            states, smoothed = self._smooth(state, values)
            state.complete_steps += 1
            warming_up = state.complete_steps <= self._warmup_steps
            if len(values) == 2:
                pair = dict(zip(ranks, smoothed, strict=True))
                flagged = self._pair(state, pair, warming_up=warming_up)
            else:
                flagged = {} if warming_up else self._robust(ranks, smoothed)
            if warming_up:
                for rank_state, x in zip(states, smoothed, strict=True):
                    rank_state.history.append(x)
            else:
                self._settle(job, step, ts_unix_s, state, values, states, smoothed, flagged)
        return _active_findings(state)

    def _smooth(
        self, state: _JobState, values: Mapping[int, float]
    ) -> tuple[list[_RankState], list[float]]:
        """Each rank's state, with its value added to its recent ones, and the median of
        those, in the order of ``values``."""
        states: list[_RankState] = []
        smoothed: list[float] = []
        for rank, x in values.items():
            rank_state = state.ranks.get(rank) or self._new_rank(state, rank)
            rank_state.recent.append(x)
            states.append(rank_state)
            smoothed.append(rank_state.smoothed())
        return states, smoothed

    def _settle(
        self,
        job: str,
        step: int,
        ts_unix_s: float,
        state: _JobState,
        values: Mapping[int, float],
        states: list[_RankState],
        smoothed: list[float],
        flagged: dict[int, _Score],
    ) -> None:
        """After warm-up: the flagged ranks' scores (if also slower than their own
        history), the histories of the others, and the streaks of both."""
        scores: dict[int, _Score] = {}
        for rank, score in flagged.items():
            if self._new_for_rank(state.ranks[rank], score):
                scores[rank] = score
        # A scored step never enters the rank's history.
        for rank, rank_state, x in zip(values, states, smoothed, strict=True):
            if rank not in scores:
                rank_state.history.append(x)
        busy = state.busy
        if not (scores or busy):
            return
        # A rank neither scored nor busy has no streak to reset and nothing to advance.
        touched: dict[int, _Score | None] = dict(scores)
        for rank in busy:
            if rank not in scores and rank in values:
                touched[rank] = None
        for rank, maybe in touched.items():
            rank_state = state.ranks[rank]
            if maybe is None and not rank_state.active:
                rank_state.flagged_streak = 0
            else:
                self._advance(job, step, ts_unix_s, rank_state, maybe)
            if rank_state.flagged_streak or rank_state.active:
                busy[rank] = rank_state
            else:
                busy.pop(rank, None)

    def _new_rank(self, state: _JobState, rank: int) -> _RankState:
        created = state.ranks[rank] = _RankState(
            recent=deque(maxlen=self._smoothing), history=deque(maxlen=self._history_steps)
        )
        return created

    def _new_for_rank(self, state: _RankState, score: _Score) -> bool:
        """Whether a rank slower than its peers is also slower than its own normal: by
        ``min_slowdown`` (``pair_min_slowdown`` in a pair) and by ``z_threshold`` times
        the spread of its own history. Always, for a rank ``standalone_slowdown``
        (``fast_slowdown`` in a pair) slower than its peers now."""
        pair = score.mad_s is None
        if score.slowdown_ratio >= 1 + (self._fast_slowdown if pair else self._standalone_slowdown):
            return True
        if len(state.history) < _MIN_HISTORY or score.compute_s <= 0:
            return True
        normal, spread = _center_spread([math.log(x) for x in state.history if x > 0])
        least = self._pair_min_slowdown if pair else self._min_slowdown
        bar = max(math.log1p(least), self._z_threshold * spread)
        return math.log(score.compute_s) - normal >= bar

    def active(self) -> list[Finding]:
        """Every active finding, ordered by job and rank."""
        return [f for job in sorted(self._jobs) for f in _active_findings(self._jobs[job])]

    def forget(self, job: str) -> None:
        """Drop all state of a finished job (unknown jobs are ignored)."""
        self._jobs.pop(job, None)

    def _robust(self, ranks: list[int], values: list[float]) -> dict[int, _Score]:
        """The ranks whose value (``values[i]`` is ``ranks[i]``'s) passes the robust
        z-score and the minimum slowdown, in the order of ``ranks``."""
        ordered = sorted(values)
        median = _median(ordered)
        mad = _median(sorted(abs(x - median) for x in ordered))
        scale = max(mad, self._mad_floor_ratio * median, _TINY)
        flagged: dict[int, _Score] = {}
        for rank, x in zip(ranks, values, strict=True):
            z = _MAD_TO_Z * (x - median) / scale
            if z <= self._z_threshold:
                continue
            peers = ordered.copy()
            peers.remove(x)
            peer_median = _median(peers)
            if peer_median <= 0 or x < peer_median * (1 + self._min_slowdown):
                continue
            flagged[rank] = _Score(rank, x, z, x / peer_median, peer_median, median, mad)
        return flagged

    def _pair(
        self, state: _JobState, values: Mapping[int, float], *, warming_up: bool
    ) -> dict[int, _Score]:
        """World size 2: the log of the ranks' compute ratio against its own history.

        A steady offset (one rank always a bit slower) is the baseline; a rank is
        flagged when the ratio moves its way by ``pair_min_slowdown`` and by
        ``z_threshold`` times the ratio's own spread (noise-adaptive: on a busy shared
        CPU single steps scatter by 20-50 %, on a GPU by a few percent). The score is
        that move as a factor.
        """
        (rank_a, a), (rank_b, b) = sorted(values.items())
        if a <= 0 or b <= 0:
            return {}
        history = state.pair_history
        log_ratio = math.log(b / a)
        if warming_up:
            history.append(log_ratio)
            return {}
        base, spread = _center_spread(history) if len(history) >= _MIN_HISTORY else (0.0, 0.0)
        bar = max(math.log1p(self._pair_min_slowdown), self._z_threshold * spread)
        shift = log_ratio - base
        if abs(shift) < bar:
            history.append(log_ratio)
            return {}
        rank, x, other = (rank_b, b, a) if shift > 0 else (rank_a, a, b)
        return {rank: _Score(rank, x, math.exp(abs(shift)), x / other, other, (a + b) / 2, None)}

    def _advance(
        self, job: str, step: int, ts_unix_s: float, state: _RankState, score: _Score | None
    ) -> None:
        if score is None:
            state.flagged_streak = 0
            if state.active:
                state.active_steps += 1
                state.clear_streak += 1
                if state.clear_streak >= self._persistence:
                    state.active = False
                    state.active_steps = state.clear_streak = 0
                    state.finding = None
            return
        state.clear_streak = 0
        if state.flagged_streak == 0 and not state.active:
            state.since_unix_s = ts_unix_s
        state.flagged_streak += 1
        if state.active:
            state.active_steps += 1
        elif state.flagged_streak >= self._required_streak(score):
            state.active = True
            state.active_steps = state.flagged_streak
        else:
            return
        state.finding = self._finding(job, step, state, score)

    def _required_streak(self, score: _Score) -> int:
        """Flagged steps in a row before a finding: fewer for a rank far slower."""
        if score.slowdown_ratio >= 1 + self._fast_slowdown:
            return self._fast_persistence
        return self._persistence

    def _finding(self, job: str, step: int, state: _RankState, score: _Score) -> Finding:
        rank = score.rank
        chronic = state.active_steps >= self._window_steps
        against = "its peer" if score.mad_s is None else "the median of its peers"
        summary = (
            f"rank {rank} of job {job} computes {score.slowdown_ratio:.2f}x slower than "
            f"{against} ({score.compute_s:.3f} s vs {score.peer_median_s:.3f} s)"
        )
        if chronic:
            recommendation = (
                f"Rank {rank} has been slower for {state.active_steps} steps and "
                "holds back every step of the job: if its hardware differs from its peers' "
                "or its data shard is larger, rebalance the work; otherwise check its node "
                "for thermal or power throttling, CPU contention and a slow data loader."
            )
        else:
            recommendation = (
                f"Check rank {rank}'s node: thermal or power throttling (nvidia-smi -q -d "
                "PERFORMANCE), CPU contention from other processes, its data loader and "
                "storage, and other processes on its GPU."
            )
        return Finding(
            kind="straggler",
            labels={"job": job, "rank": str(rank)},
            value=score.compute_s,
            score=score.score,
            summary=summary,
            since_unix_s=state.since_unix_s,
            recommendation=recommendation,
            severity="high",
            details={
                "slowdown_ratio": score.slowdown_ratio,
                "peer_median_s": score.peer_median_s,
                "median_s": score.median_s,
                "mad_s": score.mad_s,
                "method": "pair" if score.mad_s is None else "robust_z",
                "step": step,
                "steps": state.active_steps,
                "chronic": chronic,
            },
        )


def _usable(compute_s_by_rank: Mapping[int, float]) -> dict[int, float]:
    """The finite, non-negative compute times."""
    return {rank: x for rank, x in compute_s_by_rank.items() if math.isfinite(x) and x >= 0}


def _center_spread(values: Iterable[float]) -> tuple[float, float]:
    """Median and robust standard deviation (1.4826 x MAD) of the values."""
    ordered = sorted(values)
    if not ordered:
        return 0.0, 0.0
    center = _median(ordered)
    return center, _MAD_TO_SIGMA * _median(sorted(abs(x - center) for x in ordered))


def _median(ordered: list[float]) -> float:
    """Median of an already sorted, non-empty list."""
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
