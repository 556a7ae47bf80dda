"""Per-rank and per-job live records: the latest values, histograms and recent steps
behind the job-level ``/metrics``, the summaries and the bottleneck report."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress

from torshmon.aggregator.core.series import LabelSet
from torshmon.aggregator.core.straggler import StepCollector
from torshmon.labels import LabelCap
from torshmon.wire import (
    DURATION_BUCKETS_S,
    STEP_DURATION_BUCKETS_S,
    AppliedConfig,
    CollectiveStat,
)

#: The buckets of a collective-duration histogram, by index.
COLL_BUCKETS = range(len(DURATION_BUCKETS_S) + 1)
#: How many recent steps the job-level means (bottleneck report, summaries) cover.
RECENT = 50


@dataclass(slots=True)
class Histogram:
    """Cumulative histogram: per-bucket counts (non-cumulative), sum and count."""

    counts: list[int]
    sum: float = 0.0
    count: int = 0


@dataclass(slots=True)
class Recent:
    """The last ``RECENT`` steps' durations, communication waits and compute times
    (seconds), as columns: a batch's steps go in without a tuple per step."""

    duration_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    wait_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    compute_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

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
    compression: dict[str, float] = field(default_factory=dict)  # codec -> ratio
    relative_error: dict[str, float] = field(default_factory=dict)  # codec -> latest
    wire_bytes_total: dict[str, float] = field(default_factory=dict)  # codec -> bytes
    step_hist: Histogram = field(
        default_factory=lambda: Histogram([0] * (len(STEP_DURATION_BUCKETS_S) + 1))
    )
    collectives: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    busbw: dict[tuple[str, str], float] = field(default_factory=dict)
    collective_bytes_total: dict[tuple[str, str], int] = field(default_factory=dict)
    recent: Recent = field(default_factory=Recent)
    labels: LabelSet = ()


@dataclass(slots=True)
class JobState:
    #: The job's own series labels (job-level step time).
    labels: tuple[tuple[str, str], ...] = ()
    world_size: int | None = None
    ranks: dict[int, RankState] = field(default_factory=dict)
    config: AppliedConfig | None = None
    bucket_cap_bytes: int | None = None
    collector: StepCollector | None = None
    #: The newest config version any rank ran a step with.
    config_version: int = 0
    #: Steps before this one are a config switch settling: not judged by step time.
    settled_from_step: int = 0
    #: When the aggregator learnt of the newest config switch (None: never switched).
    config_switched_unix_s: float | None = None


def copy_rank(r: RankState) -> RankState:
    """A copy safe to read outside the lock: the exported mutable members are copied,
    ``recent`` (not exported) is left empty."""
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
        recent=Recent(),
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
        counts, added = hist.counts, c.duration_hist
        # Only the buckets the op fell in (usually one of them); extra buckets are ignored.
        for i in compress(COLL_BUCKETS, added):
            counts[i] += added[i]
        hist.sum += c.duration_s
        hist.count += c.count
        busbw[key] = c.busbw_bytes_per_s
        sizes[key] = sizes.get(key, 0) + c.size_bytes
