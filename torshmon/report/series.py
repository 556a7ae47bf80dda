"""A job's steps and memory samples as the report shows them: per-rank statistics,
the median split of a step into phases, and time series of ``MAX_POINTS`` at most."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from torshmon.history.store.report import JobHistory
from torshmon.report.model import MemorySeries, Peaks, RankSeries, RankStats, StepPhases

#: Points per rank in a time series; longer runs are reduced to medians of equal spans.
MAX_POINTS: Final = 600


#: Step columns the report computes with, as float arrays (NULL is NaN).
_STEP_FIELDS: Final = (
    "step",
    "end_unix_ns",
    "duration_s",
    "comm_wait_s",
    "compute_s",
    "communication_time_ratio",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "samples_per_s",
    "input_wait_s",
    "eval_s",
    "between_steps_comm_s",
)

Columns = dict[str, "np.ndarray[Any, Any]"]


def columns(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> Columns:
    """Each of ``names`` as a float array over ``rows`` (NULL and absent columns NaN)."""
    return {n: np.array([r.get(n) for r in rows], dtype=float) for n in names}


def steps_by_rank(steps: Mapping[str, Sequence[Any]]) -> dict[int, Columns]:
    """Each rank's step columns in step order, ranks in order."""
    if not steps.get("step"):
        return {}
    count = len(steps["step"])
    cols = {
        n: np.array(steps[n] if n in steps else [None] * count, dtype=float)
        for n in ("rank", *_STEP_FIELDS)
    }
    order = np.lexsort((cols["end_unix_ns"], cols["step"], cols["rank"]))
    cols = {n: v[order] for n, v in cols.items()}
    ranks, starts = np.unique(cols["rank"], return_index=True)
    bounds = [*starts[1:], len(order)]
    return {
        int(rank): {n: v[start:end] for n, v in cols.items()}
        for rank, start, end in zip(ranks, starts, bounds, strict=True)
    }


def median(values: np.ndarray[Any, Any]) -> float | None:
    """The median of the finite ``values``; None if there are none."""
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if finite.size else None


def _binned(values: np.ndarray[Any, Any], size: int) -> np.ndarray[Any, Any]:
    """Medians of ``values`` in consecutive bins of ``size`` (NaN for a bin of NaN)."""
    padded = np.concatenate([values, np.full((-len(values)) % size, np.nan)])
    with warnings.catch_warnings():  # a bin with no finite value is NaN, as meant
        warnings.simplefilter("ignore", RuntimeWarning)
        medians: np.ndarray[Any, Any] = np.nanmedian(padded.reshape(-1, size), axis=1)
    return medians


def _peaks(values: np.ndarray[Any, Any], steps: np.ndarray[Any, Any], size: int) -> Peaks:
    """The largest finite value of each bin of ``size`` and its step; () for bins of one
    (the points are the values then)."""
    if size == 1:
        return ()
    pad = (-len(values)) % size
    bins = np.concatenate([values, np.full(pad, np.nan)]).reshape(-1, size)
    at = np.concatenate([steps, np.zeros(pad)]).reshape(-1, size)
    known = np.where(np.isfinite(bins), bins, -np.inf)
    top = known.argmax(axis=1)
    rows = np.arange(len(bins))
    return tuple(
        (float(v), int(s)) if np.isfinite(v) else (None, 0)
        for v, s in zip(known[rows, top], at[rows, top], strict=True)
    )


def _optional(values: np.ndarray[Any, Any]) -> tuple[float | None, ...]:
    return tuple(float(v) if np.isfinite(v) else None for v in values)


def _bin_size(count: int) -> int:
    return max(1, -(-count // MAX_POINTS))


def rank_stats(rank: int, cols: Columns, node: str) -> RankStats:
    durations = cols["duration_s"][np.isfinite(cols["duration_s"])]
    return RankStats(
        rank=rank,
        node=node,
        steps=len(cols["step"]),
        last_step=int(cols["step"][-1]),
        median_step_s=float(np.median(durations)) if durations.size else None,
        p95_step_s=float(np.percentile(durations, 95)) if durations.size else None,
        median_compute_s=median(cols["compute_s"]),
        median_comm_wait_s=median(cols["comm_wait_s"]),
        median_comm_ratio=median(cols["communication_time_ratio"]),
        median_samples_per_s=median(_period_samples_per_s(cols)),
    )


def _period_samples_per_s(cols: Columns) -> np.ndarray[Any, Any]:
    """Each step's samples over its period: the step and the time since the previous one
    ended (input wait, evaluation, collectives between steps). In synchronous training
    every rank runs at the job's pace; a rank whose data loader makes the others wait
    has short steps, and its samples over its step time alone would make it the
    fastest."""
    duration = cols["duration_s"]
    between = np.nansum(
        np.stack([cols["input_wait_s"], cols["eval_s"], cols["between_steps_comm_s"]]), axis=0
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        period_samples: np.ndarray[Any, Any] = (
            cols["samples_per_s"] * duration / (duration + between)
        )
    return period_samples


def step_phases(rank: int, cols: Columns) -> StepPhases:
    step, input_wait, forward, backward, comm, optimizer = (
        median(cols[n])
        for n in ("duration_s", "input_wait_s", "forward_s", "backward_s", "comm_wait_s",
                  "optimizer_s")
    )  # fmt: skip
    if backward is not None and comm is not None:
        backward = max(0.0, backward - comm)
    # The input wait comes before the step (it is not in its duration).
    known = [v for v in (forward, backward, comm, optimizer) if v is not None]
    other = max(0.0, step - sum(known)) if step is not None else None
    return StepPhases(rank, input_wait, forward, backward, comm, optimizer, other)


def rank_series(rank: int, cols: Columns) -> RankSeries:
    size = _bin_size(len(cols["step"]))
    steps = np.concatenate([cols["step"], np.full((-len(cols["step"])) % size, np.nan)])
    return RankSeries(
        rank=rank,
        time_unix_s=tuple(float(t) / 1e9 for t in _binned(cols["end_unix_ns"], size)),
        step=tuple(int(s) for s in np.nanmax(steps.reshape(-1, size), axis=1)),
        duration_s=_optional(_binned(cols["duration_s"], size)),
        compute_s=_optional(_binned(cols["compute_s"], size)),
        comm_ratio=_optional(_binned(cols["communication_time_ratio"], size)),
        duration_peak=_peaks(cols["duration_s"], cols["step"], size),
        compute_peak=_peaks(cols["compute_s"], cols["step"], size),
    )


def memory_series(history: JobHistory) -> tuple[MemorySeries, ...]:
    series: list[MemorySeries] = []
    for kind, rows, key, value in (
        ("node", history.node_samples, "node", "memory_utilization_ratio"),
        ("rank", history.rank_samples, "rank", "rss_bytes"),
    ):
        by_key: dict[Any, list[Mapping[str, Any]]] = {}
        for row in reversed(rows):  # oldest first
            by_key.setdefault(row[key], []).append(row)
        for name, of_key in sorted(by_key.items()):
            cols = columns(of_key, ("ts_unix_ns", value))
            size = _bin_size(len(of_key))
            series.append(
                MemorySeries(
                    kind=kind,
                    name=str(name),
                    time_unix_s=tuple(float(t) / 1e9 for t in _binned(cols["ts_unix_ns"], size)),
                    value=_optional(_binned(cols[value], size)),
                )
            )
    return tuple(series)
