"""Per-rank and per-job live records: the latest values, histograms and recent steps
behind the job-level ``/metrics``, the summaries and the bottleneck report."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress

from torshmon.aggregator.core.complete_steps import StepCollector
from torshmon.aggregator.core.series import LabelSet, labelset_from
from torshmon.labels import LabelCap
from torshmon.wire import (
    DURATION_BUCKETS_S,
    STEP_DURATION_BUCKETS_S,
    AppliedConfig,
    Batch,
    CollectiveFailures,
    CollectiveStat,
)

#: The buckets of a collective-duration histogram, by index.
COLL_BUCKETS = range(len(DURATION_BUCKETS_S) + 1)
#: How many recent steps the job-level means (bottleneck report, summaries) cover.
RECENT = 50
#: How many recent step ends (time, number) a rank keeps to date memory samples.
STEP_MARKS = 1024


@dataclass(slots=True)
class Histogram:
    """Cumulative histogram: per-bucket counts (non-cumulative), sum and count."""

    counts: list[int]
    sum: float = 0.0
    count: int = 0


@dataclass(slots=True)
class Recent:
    """The last ``RECENT`` steps' durations, communication waits, compute times and
    input waits (seconds; NaN where not measured), as columns: a batch's steps go in
    without a tuple per step."""

    duration_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    wait_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    compute_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    input_wait_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    def rows(self) -> Iterator[tuple[float, float, float]]:
        """(duration, wait, compute) of each step, oldest first."""
        return zip(self.duration_s, self.wait_s, self.compute_s, strict=True)


@dataclass(slots=True)
class RankState:
    node: str = ""
    last_step: int = -1
    last_seen_unix_s: float = 0.0  # aggregator clock: the last batch, heartbeats included
    steps_total: int = 0
    urgent_steps_total: int = 0
    samples_total: float = 0.0
    dropped_records_total: int = 0
    # Summed over every step (the step time's sum is ``step_hist.sum``), in step order.
    comm_wait_s_total: float = 0.0
    compute_s_total: float = 0.0
    input_wait_s_total: float = 0.0
    input_wait_s: float = math.nan  # before the latest step; NaN while never measured
    inflight_oldest_age_s: float = 0.0
    duration_s: float = math.nan
    comm_wait_s: float = math.nan
    compute_s: float = math.nan
    communication_time_ratio: float = math.nan
    samples_per_s: float = math.nan
    loss: float = math.nan
    nonfinite_loss_total: int = 0
    config_version: int = 0
    rss_bytes: float = math.nan
    gpu_memory_allocated_bytes: float = math.nan
    gpu_memory_reserved_bytes: float = math.nan
    gpu_memory_peak_bytes: float = math.nan
    compression: dict[str, float] = field(default_factory=dict)  # codec -> ratio
    relative_error: dict[str, float] = field(default_factory=dict)  # codec -> latest
    wire_bytes_total: dict[str, float] = field(default_factory=dict)  # codec -> bytes
    step_hist: Histogram = field(
        default_factory=lambda: Histogram([0] * (len(STEP_DURATION_BUCKETS_S) + 1))
    )
    collectives: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    busbw: dict[tuple[str, str], float] = field(default_factory=dict)
    collective_bytes_total: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (op, pg) -> the probe's newest count of collectives that raised
    collective_failures: dict[tuple[str, str], CollectiveFailures] = field(default_factory=dict)
    recent: Recent = field(default_factory=Recent)
    #: (end time in Unix seconds, step number) of the latest steps, oldest first.
    step_marks: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=STEP_MARKS))
    labels: LabelSet = ()


@dataclass(slots=True)
class JobState:
    #: The job's own series labels (job-level step time).
    labels: tuple[tuple[str, str], ...] = ()
    world_size: int | None = None
    #: The launch its state is of (the hellos' run id; "" before one was seen).
    run_id: str = ""
    #: The probe sessions that said hello with ``run_id``.
    sessions: set[str] = field(default_factory=set)
    ranks: dict[int, RankState] = field(default_factory=dict)
    config: AppliedConfig | None = None
    bucket_cap_bytes: int | None = None
    collector: StepCollector | None = None
    #: What the probe was attached to, as the steps show it: "ddp" once a step has DDP
    #: phase splits or statistics, else "fsdp2" once a step all-gathers and
    #: reduce-scatters (FSDP2's pattern), else "collectives"; None before any step.
    kind: str | None = None
    #: The newest config version any rank ran a step with.
    config_version: int = 0
    #: Steps before this one are a config switch settling: not judged by step time.
    settled_from_step: int = 0
    #: When the aggregator learnt of the newest config switch (None: never switched).
    config_switched_unix_s: float | None = None
    #: An autotuner session is trying configs: step time is not judged against the past.
    tuning: bool = False

    def last_seen_unix_s(self) -> float:
        """When any of its ranks last reported (0 before any)."""
        return max((r.last_seen_unix_s for r in self.ranks.values()), default=0.0)

    def judged_from(self) -> int:
        """The first step the step-time z-scores judge: none while tuning."""
        return _NEVER if self.tuning else self.settled_from_step


def copy_rank(r: RankState) -> RankState:
    """A copy safe to read outside the lock: the exported mutable members are copied,
    ``recent`` and ``step_marks`` (not exported) are left empty."""
    return replace(
        r,
        compression=dict(r.compression),
        relative_error=dict(r.relative_error),
        wire_bytes_total=dict(r.wire_bytes_total),
        step_hist=Histogram(list(r.step_hist.counts), r.step_hist.sum, r.step_hist.count),
        collectives={
            k: Histogram(list(h.counts), h.sum, h.count) for k, h in r.collectives.items()
        },
        busbw=dict(r.busbw),
        collective_bytes_total=dict(r.collective_bytes_total),
        collective_failures=dict(r.collective_failures),
        recent=Recent(),
        step_marks=deque(maxlen=STEP_MARKS),
    )


def observe_collectives(
    r: RankState, collectives: Sequence[CollectiveStat], job: str, labels: LabelCap
) -> None:
    by_key, busbw, sizes = r.collectives, r.busbw, r.collective_bytes_total
    for c in collectives:
        key = (c.op, c.pg)
        if key not in by_key:  # a pair kept before is kept as it is
            key = labels.collective(job, c.op, c.pg)
        hist = by_key.get(key)
        if hist is None:
            hist = by_key[key] = Histogram([0] * len(COLL_BUCKETS))
        sizes[key] = sizes.get(key, 0) + c.size_bytes
        if c.duration_s is None:
            continue  # bytes alone (gloo's DDP all-reduces): no time to fold in
        counts, added = hist.counts, c.duration_hist
        # Only the buckets the op fell in (usually one of them); extra buckets are ignored.
        for i in compress(COLL_BUCKETS, added):
            counts[i] += added[i]
        hist.sum += c.duration_s
        hist.count += c.count
        if c.busbw_bytes_per_s is not None:
            busbw[key] = c.busbw_bytes_per_s


_NEVER = 2**62

#: A failed collective newer than this (seconds) is news to an aggregator that has not
#: seen its rank fail before; an older one (the aggregator restarted) is not alerted.
FAILURE_NEWS_S = 300.0


def failure_points(
    r: RankState, batch: Batch, ts: float, now_unix_s: float
) -> list[tuple[LabelSet, float, float]]:
    """The probe's counts of failed collectives in ``batch`` into ``r``; the points of
    ``collective_failures_total`` (labels, time, count) where one changed. A count first
    seen here starts from a 0 just before it when its newest failure is recent, so an
    ``increase`` rule sees the rise; an old count (an aggregator that restarted) is
    only a level."""
    known = r.collective_failures
    points: list[tuple[LabelSet, float, float]] = []
    for failure in batch.collective_failures:
        key = (failure.op, failure.pg)
        before = known.get(key)
        if before is not None and before.count == failure.count:
            continue
        known[key] = failure
        # The rank's labels (job, rank and its run, if named) with the op's.
        labels = labelset_from((*r.labels, ("op", failure.op), ("pg", failure.pg)))
        if before is None and failure.last_unix_ns / 1e9 >= now_unix_s - FAILURE_NEWS_S:
            points.append((labels, ts - 1e-3, 0.0))
        points.append((labels, ts, float(failure.count)))
    return points
