"""A batch's steps as columns, and the folds of those columns into a rank's state.

The ingest hot path (``LiveState._observe_steps``) reads each field of a batch's steps
once, as a column: ``StepColumns.of`` zips the steps' ``astuple`` (a step's fields in one
C call, cheaper than fetching them one by one). Small folds then take the whole batch,
each changing its own part of the state as it would step by step, in step order:

- ``fold_totals``: the step-duration histogram, the running totals, the recent windows;
- ``add_step_series``: the per-rank series the rules read (step time, waits, ratios,
  efficiency, throughput, loss);
- ``fold_extras``: collectives, comm-hook buckets, the job's kind and its config;
- ``fold_latest``: the rank's latest values.

Pure: the columns and the state in, the state changed; the detectors are the caller's.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, Final, NamedTuple, cast

import msgspec

from torshmon.aggregator.core.job_snapshot import job_kind_after
from torshmon.aggregator.core.rank_state import JobState, RankState, observe_collectives
from torshmon.aggregator.core.series import SeriesStore
from torshmon.aggregator.core.step_series import observe_collective_series, observe_input_waits
from torshmon.labels import LabelCap
from torshmon.wire import (
    STEP_DURATION_BUCKETS_S,
    AppliedConfig,
    BucketStat,
    CollectiveStat,
    DdpStats,
    StepRecord,
)

#: The fields of a batch's steps the live state reads, in ``StepColumns``' order.
STEP_FIELDS: Final = (
    "end_unix_ns",
    "duration_s",
    "comm_wait_s",
    "compute_s",
    "communication_time_ratio",
    "samples_per_s",
    "batch_size",
    "loss",
    "loss_nonfinite",
    "step",
    "collectives",
    "buckets",
    "ddp",
    "applied_config",
    "config_version",
    "input_wait_s",
    "forward_s",
    "cpu_wait_s",
    "process_cpu_wait_s",
)
_Row = tuple[Any, ...]
#: Those columns out of the ``zip`` of the steps' ``astuple``.
_COLUMNS: Callable[[list[_Row]], tuple[_Row, ...]] = operator.itemgetter(
    *map(StepRecord.__struct_fields__.index, STEP_FIELDS)
)
_astuple: Callable[[StepRecord], tuple[Any, ...]] = msgspec.structs.astuple
#: The step-duration histogram bucket of a duration (as ``Histogram.counts`` indexes).
_STEP_BUCKET: Callable[[float], int] = functools.partial(
    bisect.bisect_left, STEP_DURATION_BUCKETS_S
)
#: ``x > 0`` as a C call (False for NaN, as the comparison is).
_POSITIVE: Callable[[float], bool] = functools.partial(operator.lt, 0.0)


class StepColumns(NamedTuple):
    """One batch's steps (at least one), field by field, in step order; ``ts`` is the
    steps' end in Unix seconds. A named tuple: built in one C call per batch, read by
    name at a tuple's cost."""

    ts: list[float]
    durations: tuple[float, ...]
    waits: tuple[float, ...]
    computes: tuple[float, ...]
    ratios: tuple[float, ...]
    throughputs: tuple[float | None, ...]
    sizes: tuple[int | None, ...]
    losses: tuple[float | None, ...]
    nonfinite: tuple[bool, ...]
    numbers: tuple[int, ...]
    collectives: tuple[list[CollectiveStat], ...]
    buckets: tuple[list[BucketStat], ...]
    ddps: tuple[DdpStats | None, ...]
    applied: tuple[AppliedConfig | None, ...]
    config_versions: tuple[int, ...]
    input_waits: tuple[float | None, ...]
    forwards: tuple[float | None, ...]
    cpu_waits: tuple[float | None, ...]
    process_waits: tuple[float | None, ...]

    @classmethod
    def of(cls, steps: Sequence[StepRecord]) -> StepColumns:
        columns = _COLUMNS(list(zip(*map(_astuple, steps), strict=True)))
        ts = list(map(operator.truediv, columns[0], repeat(1e9)))
        return cls._make((ts, *columns[1:]))

    @property
    def every_loss(self) -> bool:
        """Whether every step has a finite loss (the loss series' fast path)."""
        return True not in self.nonfinite and None not in self.losses


def fold_totals(r: RankState, cols: StepColumns) -> None:
    """The steps into ``r``'s step-duration histogram, totals and recent windows."""
    n = len(cols.ts)
    hist = r.step_hist
    counts = hist.counts
    for bucket in map(_STEP_BUCKET, cols.durations):
        counts[bucket] += 1
    hist.sum = functools.reduce(operator.add, cols.durations, hist.sum)  # in step order
    hist.count += n
    r.comm_wait_s_total = functools.reduce(operator.add, cols.waits, r.comm_wait_s_total)
    r.compute_s_total = functools.reduce(operator.add, cols.computes, r.compute_s_total)
    recent = r.recent
    recent.duration_s.extend(cols.durations)
    recent.wait_s.extend(cols.waits)
    recent.compute_s.extend(cols.computes)
    if cols.input_waits.count(None) == n:
        recent.input_wait_s.extend(repeat(math.nan, n))
    sizes: Sequence[int | None] = cols.sizes
    if None in sizes:
        sizes = [size for size in sizes if size is not None]
    r.samples_total += sum(cast(Sequence[int], sizes))  # integers: exact in any order


def add_step_series(series: SeriesStore, r: RankState, cols: StepColumns) -> None:
    """The steps' per-rank series, one ``add_many`` for the columns every step has; a
    column some steps lack goes in apart, with the steps that have it. Sets
    ``r.samples_per_s`` (the latest throughput)."""
    ts, durations, computes = cols.ts, cols.durations, cols.computes
    columns_by_metric: dict[str, Sequence[float]] = {
        "step_duration_seconds": durations,
        "comm_wait_seconds": cols.waits,
        "compute_seconds": computes,
        "communication_time_ratio": cols.ratios,
    }
    if cols.input_waits.count(None) < len(ts):
        # Efficiency too: the input wait is part of the step period.
        observe_input_waits(series, r, ts, durations, computes, cols.input_waits)
    elif all(map(_POSITIVE, durations)):
        columns_by_metric["training_efficiency_ratio"] = list(
            map(operator.truediv, computes, durations)
        )
    else:
        kept = [i for i, d in enumerate(durations) if d > 0]
        series.add_many(
            r.labels,
            [ts[i] for i in kept],
            {"training_efficiency_ratio": [computes[i] / durations[i] for i in kept]},
        )
    throughputs = cols.throughputs
    if None not in throughputs:
        r.samples_per_s = cast(float, throughputs[-1])
        columns_by_metric["throughput_samples_per_second"] = cast(Sequence[float], throughputs)
    else:
        kept = [i for i, v in enumerate(throughputs) if v is not None]
        if kept:
            r.samples_per_s = cast(float, throughputs[kept[-1]])
            series.add_many(
                r.labels,
                [ts[i] for i in kept],
                {"throughput_samples_per_second": [cast(float, throughputs[i]) for i in kept]},
            )
    if cols.every_loss:
        columns_by_metric["loss"] = cast(Sequence[float], cols.losses)
    series.add_many(r.labels, ts, columns_by_metric)


def fold_extras(
    r: RankState,
    job: JobState,
    cols: StepColumns,
    *,
    job_name: str,
    labels: LabelCap,
    series: SeriesStore | None,
) -> None:
    """The steps' extras into ``r`` and ``job``: collectives (and, with ``series``, their
    per-job series), comm-hook buckets by codec, the job's kind and its config. Each kind
    of extra changes its own part of the state, so each is taken for the whole batch
    (usually none of a batch's steps has any)."""
    collectives, buckets = cols.collectives, cols.buckets
    if any(collectives):
        for step_collectives in collectives:
            if step_collectives:
                observe_collectives(r, step_collectives, job_name, labels)
        if series is not None:
            observe_collective_series(series, job_name, r, cols.ts, collectives)
    if any(buckets):
        fold = labels.value
        for step_buckets in buckets:
            for b in step_buckets:
                codec = fold(job_name, "codec", b.codec)
                r.compression[codec] = b.compression_ratio
                total = r.wire_bytes_total.get(codec, 0.0)
                r.wire_bytes_total[codec] = total + b.wire_bytes
                if b.relative_error is not None:
                    r.relative_error[codec] = b.relative_error
    ddps, applied = cols.ddps, cols.applied
    if job.kind != "ddp":
        job.kind = job_kind_after(job.kind, ddps, cols.forwards, cast(Any, buckets), collectives)
    n = len(cols.ts)
    if ddps.count(None) < n or applied.count(None) < n:
        for ddp, config in zip(ddps, applied, strict=True):
            if ddp is not None:
                job.bucket_cap_bytes = ddp.bucket_cap_bytes
            if config is not None:
                job.config = config
                job.bucket_cap_bytes = config.bucket_cap_bytes


def fold_latest(r: RankState, cols: StepColumns, last: StepRecord) -> None:
    """``r``'s latest values: the last step's, and every step's (time, number) mark."""
    r.step_marks.extend(zip(cols.ts, cols.numbers, strict=True))
    r.last_step = cols.numbers[-1]
    r.steps_total += len(cols.ts)
    r.duration_s = cols.durations[-1]
    r.comm_wait_s = cols.waits[-1]
    r.compute_s = cols.computes[-1]
    r.communication_time_ratio = cols.ratios[-1]
    r.config_version = cols.config_versions[-1]
    if last.gpu_memory_reserved_bytes is not None:
        r.gpu_memory_allocated_bytes = float(last.gpu_memory_allocated_bytes or 0)
        r.gpu_memory_reserved_bytes = float(last.gpu_memory_reserved_bytes)
        r.gpu_memory_peak_bytes = float(last.gpu_memory_peak_bytes or 0)
