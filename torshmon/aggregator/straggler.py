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

Decisions:

- World size 2 has no meaningful MAD (each rank is the other's only peer): there a
  rank is flagged when it computes at least ``pair_min_slowdown`` (default 20 %) more
  than the other rank - a higher bar than ``min_slowdown`` because with one peer
  there is no majority to say which rank is normal. Score: the slowdown ratio.
- A permanently slower rank keeps its finding: synchronous data-parallel training
  runs at its slowest rank's pace, so the slowdown costs every step. Once the finding
  has been active for ``window_steps`` steps it is marked ``chronic`` and its
  recommendation turns to heterogeneous hardware and uneven data shards. A rank's
  comparison with its own history (a slowdown that is new for that rank) is the
  rolling z-score detector's job (``ZScoreDetector(metric="compute_seconds")`` per
  rank), not this one's.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from torshmon.aggregator.findings import Finding

#: Scales the MAD of a normal distribution to its standard deviation (Iglewicz-Hoaglin).
_MAD_TO_Z: Final = 0.6745
_TINY: Final = 1e-12


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
        if not 0 <= rank < self._world_size:
            raise ValueError(f"rank must be in 0..{self._world_size - 1}, got {rank}")
        pending = self._pending.get(job)
        if pending is None:
            pending = self._pending[job] = {}
        by_rank = pending.get(step)
        if by_rank is None:
            if len(pending) >= self._max_pending:
                del pending[next(iter(pending))]
            by_rank = pending[step] = {}
        by_rank[rank] = compute_s
        if len(by_rank) < self._world_size:
            return None
        del pending[step]
        while pending:
            oldest = next(iter(pending))
            if oldest >= step:
                break
            del pending[oldest]
        return CompleteStep(job, step, by_rank, ts_unix_s)

    def pending_steps(self, job: str) -> int:
        """How many incomplete steps of ``job`` are held."""
        return len(self._pending.get(job, ()))

    def forget(self, job: str) -> None:
        """Drop a finished job's pending steps (unknown jobs are ignored)."""
        self._pending.pop(job, None)


@dataclass(slots=True)
class _RankState:
    """Persistence counters and the active finding of one rank."""

    flagged_streak: int = 0
    clear_streak: int = 0
    active: bool = False
    active_steps: int = 0
    since_unix_s: float = 0.0
    finding: Finding | None = None


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
        persistence: int = 3,
        window_steps: int = 500,
        pair_min_slowdown: float = 0.20,
        mad_floor_ratio: float = 0.01,
    ) -> None:
        """Raises ValueError naming any setting outside its allowed range."""
        if not (math.isfinite(z_threshold) and z_threshold > 0):
            raise ValueError(f"z_threshold must be a positive number, got {z_threshold}")
        for name, ratio in (
            ("min_slowdown", min_slowdown),
            ("pair_min_slowdown", pair_min_slowdown),
            ("mad_floor_ratio", mad_floor_ratio),
        ):
            if not (math.isfinite(ratio) and ratio > 0):
                raise ValueError(f"{name} must be a positive fraction (0.1 = 10 %), got {ratio}")
        if persistence < 1:
            raise ValueError(f"persistence must be at least 1 step, got {persistence}")
        if window_steps < persistence:
            raise ValueError(
                f"window_steps must be at least persistence ({persistence}), got {window_steps}"
            )
        self._z_threshold = z_threshold
        self._min_slowdown = min_slowdown
        self._pair_min_slowdown = pair_min_slowdown
        self._mad_floor_ratio = mad_floor_ratio
        self._persistence = persistence
        self._window_steps = window_steps
        self._ranks: dict[str, dict[int, _RankState]] = {}

    def observe_step(
        self, job: str, step: int, compute_s_by_rank: Mapping[int, float], ts_unix_s: float
    ) -> list[Finding]:
        """Score one complete step of ``job``; the job's active findings, by rank.

        Call once per complete step (see ``StepCollector``). Ranks with a non-finite
        or negative compute time are left out of this step; fewer than 2 usable ranks
        leave every rank's state unchanged.
        """
        values = {rank: x for rank, x in compute_s_by_rank.items() if math.isfinite(x) and x >= 0}
        states = self._ranks.get(job)
        if states is None:
            states = self._ranks[job] = {}
        if len(values) >= 2:
            flagged = self._pair(values) if len(values) == 2 else self._robust(values)
            for rank in values:
                state = states.get(rank)
                if state is None:
                    state = states[rank] = _RankState()
                self._advance(job, step, ts_unix_s, state, flagged.get(rank))
        return [
            state.finding
            for _, state in sorted(states.items())
            if state.active and state.finding is not None
        ]

    def active(self) -> list[Finding]:
        """Every active finding, ordered by job and rank."""
        return [
            state.finding
            for job in sorted(self._ranks)
            for _, state in sorted(self._ranks[job].items())
            if state.active and state.finding is not None
        ]

    def forget(self, job: str) -> None:
        """Drop all state of a finished job (unknown jobs are ignored)."""
        self._ranks.pop(job, None)

    def _robust(self, values: Mapping[int, float]) -> dict[int, _Score]:
        ordered = sorted(values.values())
        median = _median(ordered)
        mad = _median(sorted(abs(x - median) for x in ordered))
        scale = max(mad, self._mad_floor_ratio * median, _TINY)
        flagged: dict[int, _Score] = {}
        for rank, x in values.items():
            z = _MAD_TO_Z * (x - median) / scale
            if z <= self._z_threshold:
                continue
            # Only the (few) candidates pay for the median of their peers.
            peers = ordered.copy()
            del peers[bisect.bisect_left(peers, x)]
            peer_median = _median(peers)
            if peer_median <= 0 or x < peer_median * (1 + self._min_slowdown):
                continue
            flagged[rank] = _Score(rank, x, z, x / peer_median, peer_median, median, mad)
        return flagged

    def _pair(self, values: Mapping[int, float]) -> dict[int, _Score]:
        (rank_a, a), (rank_b, b) = values.items()
        flagged: dict[int, _Score] = {}
        for rank, x, other in ((rank_a, a, b), (rank_b, b, a)):
            if other > 0 and x >= other * (1 + self._pair_min_slowdown):
                ratio = x / other
                flagged[rank] = _Score(rank, x, ratio, ratio, other, (a + b) / 2, None)
        return flagged

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
        elif state.flagged_streak >= self._persistence:
            state.active = True
            state.active_steps = state.flagged_streak
        else:
            return
        state.finding = self._finding(job, step, state, score)

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


def _median(ordered: list[float]) -> float:
    """Median of an already sorted, non-empty list."""
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
