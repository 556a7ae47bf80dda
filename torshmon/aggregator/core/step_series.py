"""What a batch of steps adds to the rules' series beyond the per-step columns: each
collective's mean duration, and the input-wait share and efficiency of the steps that
measured an input wait. ``LiveState`` calls these from its ingest path."""

from __future__ import annotations

import math

from torshmon.aggregator.core.rank_state import RankState
from torshmon.aggregator.core.series import SeriesStore
from torshmon.wire import CollectiveStat


def observe_collective_series(
    series: SeriesStore,
    job: str,
    r: RankState,
    ts: list[float],
    collectives: tuple[list[CollectiveStat], ...],
) -> None:
    """Each step's mean duration per (op, pg) into ``collective_duration_seconds``
    (labels job, op, pg and run: every rank's steps into one series per op and group, as
    Prometheus sums the histogram over ranks). Pairs folded into ``other`` by the
    label cap are left out, and calls nothing timed (gloo's DDP all-reduces)."""
    kept = r.collectives
    run = tuple(pair for pair in r.labels if pair[0] == "run")  # the rank's run, if named
    for t, step_collectives in zip(ts, collectives, strict=True):
        for c in step_collectives:
            if c.count and c.duration_s is not None and (c.op, c.pg) in kept:
                labels = (("job", job), ("op", c.op), ("pg", c.pg), *run)
                series.add("collective_duration_seconds", labels, t, c.duration_s / c.count)


def observe_input_waits(
    series: SeriesStore,
    r: RankState,
    ts: list[float],
    durations: tuple[float, ...],
    computes: tuple[float, ...],
    input_waits: tuple[float | None, ...],
) -> None:
    """Steps with input waits (some may lack one): the input-wait share and the
    efficiency, both over the step period (input wait plus step time), into the
    series, ``r``'s totals and recent steps."""
    measured = [w if w is not None and math.isfinite(w) and w >= 0 else None for w in input_waits]
    r.recent.input_wait_s.extend(math.nan if w is None else w for w in measured)
    kept_ts, shares, kept_eff_ts, efficiencies = [], [], [], []
    for i, wait in enumerate(measured):
        period = durations[i] + (wait or 0.0)
        if wait is not None:
            r.input_wait_s_total += wait
            r.input_wait_s = wait
            if period > 0:
                kept_ts.append(ts[i])
                shares.append(wait / period)
        if period > 0:
            kept_eff_ts.append(ts[i])
            efficiencies.append(computes[i] / period)
    series.add_many(r.labels, kept_ts, {"input_wait_time_ratio": shares})
    series.add_many(r.labels, kept_eff_ts, {"training_efficiency_ratio": efficiencies})
