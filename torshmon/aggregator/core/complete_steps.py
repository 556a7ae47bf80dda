"""Complete steps: the per-rank step reports of a job, collected until every rank of a
step has reported, for the detectors that compare ranks at the same step (straggler)
or take the job's step time (Step Time Anomaly)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torshmon.aggregator.core.straggler import RankStep


@dataclass(frozen=True, slots=True)
class CompleteStep:
    """One step of one job with a compute time from every rank; ``ts_unix_s`` is the
    time of the report that completed it, ``duration_s`` the job's step time (its
    slowest rank's; NaN where the reports carried none), ``cpu_wait_s`` the most any
    rank's threads together waited for a CPU in it (NaN where none said)."""

    job: str
    step: int
    compute_s_by_rank: Mapping[int, float | RankStep]
    ts_unix_s: float
    duration_s: float = math.nan
    cpu_wait_s: float = math.nan


_Entry = tuple[dict[int, float | RankStep], dict[int, float], dict[int, float]]


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
        # Per job: step -> (compute_s by rank, step time by rank, CPU wait by rank), in
        # the order steps were first reported.
        self._pending: dict[str, dict[int, _Entry]] = {}

    @property
    def world_size(self) -> int:
        return self._world_size

    def add(
        self, job: str, step: int, rank: int, compute_s: float | RankStep, ts_unix_s: float
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
        compute_s: Sequence[float | RankStep],
        ts_unix_s: Sequence[float],
        duration_s: Sequence[float] | None = None,
        cpu_wait_s: Sequence[float | None] | None = None,
    ) -> list[tuple[int, CompleteStep]]:
        """``add`` for consecutive reports of one rank, in order; ``(index, step)`` for
        each report that completed a step (the ingest hot path: one call per batch).
        ``duration_s``: the reports' step times, for the complete steps' job step time;
        ``cpu_wait_s``: the rank's threads' run-queue delay in each (None: unknown).

        Raises ValueError if ``rank`` is outside ``0..world_size-1`` or the lengths differ.
        """
        if not 0 <= rank < self._world_size:
            raise ValueError(f"rank must be in 0..{self._world_size - 1}, got {rank}")
        if duration_s is None:
            duration_s = [math.nan] * len(steps)
        if cpu_wait_s is None:
            cpu_wait_s = [None] * len(steps)
        if not len(steps) == len(compute_s) == len(ts_unix_s) == len(duration_s) == len(cpu_wait_s):
            raise ValueError(
                f"{len(steps)} steps, {len(compute_s)} compute times, {len(ts_unix_s)} times"
            )
        pending = self._pending.get(job)
        if pending is None:
            pending = self._pending[job] = {}
        world_size, max_pending = self._world_size, self._max_pending
        out: list[tuple[int, CompleteStep]] = []
        for i, step in enumerate(steps):
            entry = pending.get(step)
            if entry is None:
                if len(pending) >= max_pending:
                    del pending[next(iter(pending))]
                entry = pending[step] = ({}, {}, {})
            by_rank, durations, waits = entry
            by_rank[rank] = compute_s[i]
            durations[rank] = duration_s[i]
            wait = cpu_wait_s[i]
            if wait is not None:
                waits[rank] = wait
            if len(by_rank) < world_size:
                continue
            del pending[step]
            while pending:
                oldest = next(iter(pending))
                if oldest >= step:
                    break
                del pending[oldest]
            slowest = max(durations.values())
            waited = max(waits.values()) if waits else math.nan
            out.append((i, CompleteStep(job, step, by_rank, ts_unix_s[i], slowest, waited)))
        return out

    def pending_steps(self, job: str) -> int:
        """How many incomplete steps of ``job`` are held."""
        return len(self._pending.get(job, ()))

    def forget(self, job: str) -> None:
        """Drop a finished job's pending steps (unknown jobs are ignored)."""
        self._pending.pop(job, None)
