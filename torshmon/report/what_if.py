"""What each cause costs: the job's step time with and without it, from the measured
steps (a straggler over its episode, a hang over the run)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torshmon.aggregator.core.bottleneck import loss_severity, straggler_summary, what_if_step_s
from torshmon.report.model import FindingItem
from torshmon.report.series import Columns


def with_what_ifs(
    job: str,
    findings: Sequence[FindingItem],
    steps: Mapping[int, Columns],
    nodes: Mapping[int, str],
    last_seen: float,
) -> list[FindingItem]:
    """Each cause with the job's step time without it, from the measured steps (a
    straggler: over its episode, each step less its excess over its peers' median; a
    hang: over the run, its stalled steps at the median), what that costs, the
    severity that follows from it, and a straggler's sentence with that cost."""
    grid = _step_grid(steps) if any(f.kind in ("straggler", "hang") for f in findings) else None
    out = []
    for f in findings:
        node = nodes.get(f.rank, "") if f.rank is not None else ""
        measured: tuple[float, float] | None = None
        if f.kind == "straggler" and f.rank is not None:
            measured = _straggler_what_if(grid, f, last_seen)
        elif f.kind == "hang":
            measured = _hang_what_if(grid, f, last_seen)
        if measured is None:
            out.append(dataclasses.replace(f, node=str(node or "")))
            continue
        step_s, what_if = measured
        loss = min(1.0, max(0.0, 1.0 - what_if / step_s)) if step_s > 0 else 0.0
        summary = f.summary
        if f.kind == "straggler" and f.slowdown_ratio is not None and f.loss_ratio is not None:
            # A sentence written by the straggler's report: the same one, with the loss
            # the report measured over the whole episode.
            summary = straggler_summary(
                job, str(f.rank), f.slowdown_ratio, f.peer_median_s, f.phase, loss
            )
        out.append(
            dataclasses.replace(
                f,
                node=str(node or ""),
                step_s=step_s,
                what_if_step_s=what_if,
                loss_ratio=loss,
                expected_gain_ratio=loss,
                severity=loss_severity(loss) if f.kind != "hang" else f.severity,
                summary=summary,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class _StepGrid:
    """The history's steps as (step number x rank) arrays, NaN where a rank has no such
    step: ``period`` (step time plus input wait), ``compute``, ``input_wait``; and per
    step number the job's ``job_period`` (the ranks' median) and ``end_unix_s`` (the
    last rank's end)."""

    ranks: tuple[int, ...]
    period: np.ndarray[Any, Any]
    compute: np.ndarray[Any, Any]
    input_wait: np.ndarray[Any, Any]
    end_unix_s: np.ndarray[Any, Any]
    job_period: np.ndarray[Any, Any]


def _step_grid(steps: Mapping[int, Columns]) -> _StepGrid | None:
    if not steps:
        return None
    numbers = np.unique(np.concatenate([c["step"][np.isfinite(c["step"])] for c in steps.values()]))
    ranks = tuple(sorted(steps))
    shape = (len(numbers), len(ranks))
    grids = {n: np.full(shape, np.nan) for n in ("period", "compute", "input_wait", "end")}
    for j, rank in enumerate(ranks):
        cols = steps[rank]
        keep = np.isfinite(cols["step"]) & np.isfinite(cols["duration_s"])
        rows = np.searchsorted(numbers, cols["step"][keep])
        waited = np.nan_to_num(cols["input_wait_s"][keep], nan=0.0)
        grids["period"][rows, j] = cols["duration_s"][keep] + waited
        grids["compute"][rows, j] = cols["compute_s"][keep]
        grids["input_wait"][rows, j] = waited
        grids["end"][rows, j] = cols["end_unix_ns"][keep] / 1e9
    with warnings.catch_warnings():  # a step number no rank has is NaN, as meant
        warnings.simplefilter("ignore", RuntimeWarning)
        job_period = np.nanmedian(grids["period"], axis=1)
        end = np.nanmax(grids["end"], axis=1)
    return _StepGrid(ranks, grids["period"], grids["compute"], grids["input_wait"], end, job_period)


def _straggler_what_if(
    grid: _StepGrid | None, f: FindingItem, last_seen: float
) -> tuple[float, float] | None:
    """The job's mean step period over ``f``'s episode, and that period with the
    straggler's phase at its peers' median at each step (``what_if_step_s``)."""
    if grid is None or f.rank not in grid.ranks or len(grid.ranks) < 2:
        return None
    j = grid.ranks.index(f.rank)
    phase = grid.input_wait if f.phase == "input" else grid.compute
    until = f.ended_unix_s if f.ended_unix_s is not None else last_seen
    with warnings.catch_warnings():  # a step no peer has is NaN, left out below
        warnings.simplefilter("ignore", RuntimeWarning)
        peers = np.nanmedian(np.delete(phase, j, axis=1), axis=1)
    own = phase[:, j]
    with np.errstate(invalid="ignore"):
        episode = (
            np.isfinite(own)
            & np.isfinite(peers)
            & np.isfinite(grid.job_period)
            & (grid.end_unix_s >= f.since_unix_s)
            & (grid.end_unix_s <= until)
        )
    if not episode.any():
        return None
    periods = grid.job_period[episode]
    what_ifs = [
        what_if_step_s(float(p), float(e))
        for p, e in zip(periods, own[episode] - peers[episode], strict=True)
    ]
    return float(np.mean(periods)), float(np.mean(what_ifs))


def _hang_what_if(
    grid: _StepGrid | None, f: FindingItem, last_seen: float
) -> tuple[float, float] | None:
    """The job's mean step period over the run, and that period with the steps the hang
    stalled at the run's median (a hang still open at the end adds its stall)."""
    if grid is None:
        return None
    known = np.isfinite(grid.job_period)
    periods, ends = grid.job_period[known], grid.end_unix_s[known]
    if not periods.size:
        return None
    median = float(np.median(periods))
    if f.ended_unix_s is None and float(np.max(ends)) <= f.since_unix_s:
        stall = max(0.0, last_seen - f.since_unix_s)
        return (float(periods.sum()) + stall) / periods.size, float(periods.mean())
    end = (f.ended_unix_s if f.ended_unix_s is not None else last_seen) + median
    hung = (ends >= f.since_unix_s) & (ends <= end)
    return float(periods.mean()), float(np.where(hung, np.minimum(periods, median), periods).mean())
