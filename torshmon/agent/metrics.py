"""The agent's Prometheus metrics: the node, each local rank, and the agent itself.

AgentMetrics keeps the latest state fed to it (node samples, probe batches, the
daemon's own counters) and one custom collector turns that state into metric
families at scrape time. Values the sources already count cumulatively (byte
counters, the probe's drop count, collective histograms pre-bucketed by the
probe) are exposed as they are, never re-counted with ``inc()``.

How the daemon feeds it::

    metrics = AgentMetrics(registry, node="n1")
    metrics.observe_node(sampler.sample(ranks))       # every sampling tick
    metrics.observe_batch(batch)                      # every accepted probe Batch
    metrics.set_agent_state(AgentState(...))          # whenever its counters change
    metrics.forget_rank(job, rank)                    # probe gone for good
    app.router.add_get("/metrics", make_metrics_handler(registry))

Thread safety: every method may be called from any thread; state is copied under
a lock and families are built outside it.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from torshmon.catalogue import metrics as catalogue
from torshmon.catalogue.metrics import MetricSpec
from torshmon.labels import LabelCap
from torshmon.ratelog import LogLimiter
from torshmon.wire import (
    DURATION_BUCKETS_S,
    STEP_DURATION_BUCKETS_S,
    Batch,
    CollectiveStat,
    NodeSample,
    StepRecord,
)

log = logging.getLogger(__name__)

__all__ = ["STEP_DURATION_BUCKETS_S", "AgentMetrics", "AgentState", "make_metrics_handler"]


# prometheus-client leaves this helper unannotated; it formats `le` exactly as its own
# histograms do.
_go_float: Callable[[float], str] = floatToGoString
_METRIC_NAME = re.compile(r"^torshmon_[a-z0-9_]+$")
#: Pre-bucketed count lists a histogram holds before summing them (bounds memory).
_MAX_PENDING_COUNTS = 64


@dataclass(frozen=True, slots=True)
class AgentState:
    """The agent daemon's own health, as the daemon counts it.

    ``*_total`` fields are cumulative since the agent started (exposed as counters);
    the rest are current levels. ``forward_up`` is whether the last forward to the
    aggregator succeeded.
    """

    frames_rejected_total: int = 0
    probe_connections: int = 0
    spool_records: int = 0
    spool_bytes: int = 0
    spool_dropped_records_total: int = 0
    forward_failures_total: int = 0
    forward_up: bool = False


class _Histogram:
    """Bucket counts (not cumulative; the last is the +Inf overflow) and the sum.

    Pre-bucketed counts (``merge``) are summed lazily, a column at a time: one
    list per collective per step arrives, and adding each at once was most of
    the cost of folding a batch.
    """

    __slots__ = ("_counts", "_pending", "bounds", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._pending: list[Sequence[int]] = []
        self.sum = 0.0

    @property
    def counts(self) -> list[int]:
        if self._pending:
            self._counts = [sum(col) for col in zip(self._counts, *self._pending, strict=True)]
            self._pending.clear()
        return self._counts

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le is inclusive).
        counts = self._counts
        counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def merge(self, counts: Sequence[int], total: float) -> None:
        """Add pre-bucketed counts; ValueError unless there is one per bucket."""
        if len(counts) != len(self._counts):
            raise ValueError(f"expected {len(self._counts)} bucket counts, got {len(counts)}")
        self._pending.append(counts)
        self.sum += total
        if len(self._pending) >= _MAX_PENDING_COUNTS:
            self._counts = self.counts

    def copy(self) -> _Histogram:
        clone = _Histogram(self.bounds)
        clone._counts = list(self.counts)
        clone.sum = self.sum
        return clone

    def cumulative_buckets(self) -> list[tuple[str, float]]:
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            buckets.append((_go_float(bound), running))
        return buckets


@dataclass(slots=True)
class _CollectiveState:
    histogram: _Histogram = field(default_factory=lambda: _Histogram(DURATION_BUCKETS_S))
    bytes_total: int = 0
    busbw_bytes_per_s: float = 0.0


@dataclass(slots=True)
class _RankState:
    session: str = ""
    step_duration: _Histogram = field(default_factory=lambda: _Histogram(STEP_DURATION_BUCKETS_S))
    steps_total: int = 0
    urgent_steps_total: int = 0
    communication_time_ratio: float | None = None
    training_efficiency_ratio: float | None = None
    throughput_samples_per_s: float | None = None
    loss: float | None = None
    config_version: int | None = None
    bucket_cap_bytes: int | None = None
    dropped_records_total: int = 0
    inflight_oldest_age_s: float = 0.0
    compression_ratio: dict[str, float] = field(default_factory=dict)
    collectives: dict[tuple[str, str], _CollectiveState] = field(default_factory=dict)

    def copy(self) -> _RankState:
        return _RankState(
            session=self.session,
            step_duration=self.step_duration.copy(),
            steps_total=self.steps_total,
            urgent_steps_total=self.urgent_steps_total,
            communication_time_ratio=self.communication_time_ratio,
            training_efficiency_ratio=self.training_efficiency_ratio,
            throughput_samples_per_s=self.throughput_samples_per_s,
            loss=self.loss,
            config_version=self.config_version,
            bucket_cap_bytes=self.bucket_cap_bytes,
            dropped_records_total=self.dropped_records_total,
            inflight_oldest_age_s=self.inflight_oldest_age_s,
            compression_ratio=dict(self.compression_ratio),
            collectives={
                key: _CollectiveState(c.histogram.copy(), c.bytes_total, c.busbw_bytes_per_s)
                for key, c in self.collectives.items()
            },
        )


class AgentMetrics:
    """The agent's metrics, registered on the given registry (never the global default).

    Feed it with observe_node(), observe_batch() and set_agent_state(); serve the
    registry with make_metrics_handler(). close() unregisters it. Thread-safe.
    The op, pg and codec values a job's probes name are capped by ``label_cap``
    (``torshmon.labels``); the rest fold into ``other`` as they arrive.
    """

    def __init__(
        self, registry: CollectorRegistry, *, node: str, label_cap: LabelCap | None = None
    ) -> None:
        self.registry = registry
        self.node = node
        self._labels = label_cap if label_cap is not None else LabelCap()
        self._lock = threading.Lock()
        self._sample: NodeSample | None = None
        self._ranks: dict[tuple[str, int], _RankState] = {}
        self._agent_state = AgentState()
        self._gauge_functions: dict[str, tuple[str, Callable[[], float]]] = {}
        self._bad_hist_log = LogLimiter()  # once
        self._collector = _AgentCollector(self)
        registry.register(self._collector)

    def close(self) -> None:
        """Unregister from the registry; safe to call twice."""
        with contextlib.suppress(KeyError):
            self.registry.unregister(self._collector)

    def observe_node(self, sample: NodeSample) -> None:
        """Replace the node's state with this sample (node, GPU and rank RSS metrics)."""
        with self._lock:
            self._sample = sample

    def observe_batch(self, batch: Batch) -> None:
        """Fold one probe batch into its rank's state (steps, collectives, in-flight ops)."""
        with self._lock:
            state = self._ranks.get((batch.job, batch.rank))
            if state is None:
                state = self._ranks[(batch.job, batch.rank)] = _RankState()
            if state.session == batch.session:
                # A resent batch can be older; the probe's count only grows in a session.
                state.dropped_records_total = max(
                    state.dropped_records_total, batch.dropped_records_total
                )
            else:
                # A new session (probe restarted) counts from zero; Prometheus sees a reset.
                state.session = batch.session
                state.dropped_records_total = batch.dropped_records_total
            if batch.steps:
                self._observe_steps(batch.job, state, batch.steps)
                if batch.urgent:
                    state.urgent_steps_total += len(batch.steps)
            state.inflight_oldest_age_s = max((op.age_s for op in batch.inflight), default=0.0)

    def forget_rank(self, job: str, rank: int) -> None:
        """Drop every series of one rank (its probe is gone for good)."""
        with self._lock:
            self._ranks.pop((job, rank), None)
            if not any(known == job for known, _ in self._ranks):
                self._labels.forget(job)

    def set_agent_state(self, state: AgentState) -> None:
        """Replace the agent's own health figures; the daemon calls it when they change."""
        with self._lock:
            self._agent_state = state

    def add_gauge_function(self, name: str, documentation: str, fn: Callable[[], float]) -> None:
        """Expose ``fn()`` as gauge ``name`` (labelled with this node) at every scrape.

        Raises ValueError for a name outside ``torshmon_[a-z0-9_]+`` or one already added.
        A failing ``fn`` is logged and its gauge left out of that scrape.
        """
        if not _METRIC_NAME.match(name):
            raise ValueError(f"gauge name {name!r} must match {_METRIC_NAME.pattern}")
        with self._lock:
            if name in self._gauge_functions:
                raise ValueError(f"gauge {name!r} is already added")
            self._gauge_functions[name] = (documentation, fn)

    def _observe_steps(self, job: str, state: _RankState, steps: Sequence[StepRecord]) -> None:
        """Counters and histograms take every step; gauges only need the latest value."""
        state.steps_total += len(steps)
        observe = state.step_duration.observe
        # The batch's (op, pg) pairs as kept (capped), so that the bus bandwidth pass
        # neither folds nor counts them again.
        keys: dict[tuple[str, str], tuple[str, str]] = {}
        for step in steps:
            observe(step.duration_s)
            if step.collectives:
                self._count_collectives(job, state, step.collectives, keys)
        self._set_bus_bandwidths(state, steps, keys)
        last = steps[-1]
        state.communication_time_ratio = _unit(last.communication_time_ratio)
        if last.duration_s > 0.0:
            state.training_efficiency_ratio = _unit(last.compute_s / last.duration_s)
        if last.samples_per_s is not None:
            state.throughput_samples_per_s = last.samples_per_s
        state.config_version = last.config_version
        for step in reversed(steps):
            if step.loss is not None and math.isfinite(step.loss):
                state.loss = step.loss
                break
        for step in steps:
            if step.ddp is not None:
                state.bucket_cap_bytes = step.ddp.bucket_cap_bytes
            if step.applied_config is not None:
                # Applied at this step's end, so newer than the DDP stats read during it.
                state.bucket_cap_bytes = step.applied_config.bucket_cap_bytes
        with_buckets = next((s for s in reversed(steps) if s.buckets), None)
        if with_buckets is not None:
            ratios: dict[str, list[float]] = {}
            for bucket in with_buckets.buckets:
                codec = self._labels.value(job, "codec", bucket.codec)
                ratios.setdefault(codec, []).append(bucket.compression_ratio)
            # Replaced, not merged: a codec switched away from stops being reported.
            state.compression_ratio = {c: sum(r) / len(r) for c, r in ratios.items()}

    def _count_collectives(
        self,
        job: str,
        state: _RankState,
        stats: Sequence[CollectiveStat],
        keys: dict[tuple[str, str], tuple[str, str]],
    ) -> None:
        collectives = state.collectives
        expected = len(DURATION_BUCKETS_S) + 1
        for stat in stats:
            key = (stat.op, stat.pg)
            if key not in collectives:  # a pair kept before is kept as it is
                keys[key] = key = self._labels.collective(job, stat.op, stat.pg)
            collective = collectives.get(key)
            if collective is None:  # not setdefault: that builds a state on every call
                collective = collectives[key] = _CollectiveState()
            collective.bytes_total += stat.size_bytes
            if len(stat.duration_hist) == expected:
                collective.histogram.merge(stat.duration_hist, stat.duration_s)
            elif self._bad_hist_log.allow():
                log.warning(
                    "skipping collective histograms with %d counts; expected %d",
                    len(stat.duration_hist),
                    expected,
                )

    @staticmethod
    def _set_bus_bandwidths(
        state: _RankState,
        steps: Sequence[StepRecord],
        keys: dict[tuple[str, str], tuple[str, str]],
    ) -> None:
        """Each (op, pg)'s bus bandwidth in the latest step that timed it.

        Bus bandwidth is bytes over time, so dtypes of one (op, pg) combine
        weighted by their time. Steps are read newest first, and only until every
        (op, pg) has its value: usually just the last step.
        """
        done: set[tuple[str, str]] = set()
        for step in reversed(steps):
            busy: dict[tuple[str, str], tuple[float, float]] = {}
            for stat in step.collectives:
                key = (stat.op, stat.pg)
                key = keys.get(key, key)
                if key not in done:
                    weighted, seconds = busy.get(key, (0.0, 0.0))
                    busy[key] = (
                        weighted + stat.busbw_bytes_per_s * stat.duration_s,
                        seconds + stat.duration_s,
                    )
            for key, (weighted, seconds) in busy.items():
                if seconds > 0.0:
                    state.collectives[key].busbw_bytes_per_s = weighted / seconds
                    done.add(key)
            if len(done) == len(state.collectives):
                return

    def _snapshot(
        self,
    ) -> tuple[
        NodeSample | None,
        dict[tuple[str, int], _RankState],
        AgentState,
        dict[str, tuple[str, Callable[[], float]]],
        list[tuple[str, str, int]],
    ]:
        with self._lock:
            ranks = {key: state.copy() for key, state in self._ranks.items()}
            return (
                self._sample,
                ranks,
                self._agent_state,
                dict(self._gauge_functions),
                self._labels.folded(),
            )


class _AgentCollector(Collector):
    """Builds every family from a snapshot of AgentMetrics' state at scrape time."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        sample, ranks, agent, gauges, folded = self._metrics._snapshot()
        node = self._metrics.node
        if sample is not None:
            yield from _node_families(sample)
        yield from _rank_families(ranks)
        yield _family(
            catalogue.LABEL_VALUES_FOLDED_TOTAL,
            [([job, label], count) for job, label, count in folded],
        )
        yield from _agent_families(agent, node)
        yield from _function_families(gauges, node)


def _node_families(sample: NodeSample) -> Iterator[Metric]:
    node = [sample.node]
    for spec, value in (
        (catalogue.CPU_UTILIZATION_RATIO, sample.cpu_utilization_ratio),
        (catalogue.MEMORY_UTILIZATION_RATIO, sample.memory_utilization_ratio),
        (catalogue.MEMORY_USED_BYTES, sample.memory_used_bytes),
        (catalogue.IO_WAIT_TIME_RATIO, sample.io_wait_ratio),
        (catalogue.NETWORK_RECEIVE_BYTES_TOTAL, sample.net_rx_bytes_total),
        (catalogue.NETWORK_TRANSMIT_BYTES_TOTAL, sample.net_tx_bytes_total),
        (catalogue.DISK_READ_BYTES_TOTAL, sample.disk_read_bytes_total),
        (catalogue.DISK_WRITTEN_BYTES_TOTAL, sample.disk_write_bytes_total),
    ):
        yield _family(spec, [(node, value)])
    gpus = [([sample.node, str(g.index)], g) for g in sample.gpus]
    yield _family(
        catalogue.GPU_UTILIZATION_RATIO, [(labels, g.utilization_ratio) for labels, g in gpus]
    )
    yield _family(
        catalogue.GPU_MEMORY_USED_BYTES, [(labels, g.memory_used_bytes) for labels, g in gpus]
    )
    yield _family(
        catalogue.GPU_MEMORY_TOTAL_BYTES, [(labels, g.memory_total_bytes) for labels, g in gpus]
    )
    yield _family(
        catalogue.PROCESS_RESIDENT_MEMORY_BYTES,
        [([p.job, str(p.rank), sample.node], p.rss_bytes) for p in sample.ranks],
    )


def _rank_families(ranks: dict[tuple[str, int], _RankState]) -> Iterator[Metric]:
    items = [([job, str(rank)], state) for (job, rank), state in sorted(ranks.items())]
    steps = _histogram(catalogue.STEP_DURATION_SECONDS)
    for labels, state in items:
        steps.add_metric(labels, state.step_duration.cumulative_buckets(), state.step_duration.sum)
    yield steps
    yield _family(catalogue.STEPS_TOTAL, [(labels, s.steps_total) for labels, s in items])
    yield _family(
        catalogue.PROBE_URGENT_STEPS_TOTAL, [(labels, s.urgent_steps_total) for labels, s in items]
    )
    yield _family(
        catalogue.PROBE_DROPPED_RECORDS_TOTAL,
        [(labels, s.dropped_records_total) for labels, s in items],
    )
    yield _family(
        catalogue.INFLIGHT_OLDEST_AGE_SECONDS,
        [(labels, s.inflight_oldest_age_s) for labels, s in items],
    )
    for spec, attribute in (
        (catalogue.COMMUNICATION_TIME_RATIO, "communication_time_ratio"),
        (catalogue.TRAINING_EFFICIENCY_RATIO, "training_efficiency_ratio"),
        (catalogue.THROUGHPUT_SAMPLES_PER_SECOND, "throughput_samples_per_s"),
        (catalogue.LOSS, "loss"),
        (catalogue.CONFIG_VERSION, "config_version"),
        (catalogue.DDP_BUCKET_CAP_BYTES, "bucket_cap_bytes"),
    ):
        values = [(labels, getattr(s, attribute)) for labels, s in items]
        yield _family(spec, [(la, v) for la, v in values if v is not None])
    yield _family(
        catalogue.COMPRESSION_RATIO,
        [([*labels, codec], r) for labels, s in items for codec, r in s.compression_ratio.items()],
    )
    yield from _collective_families(items)


def _collective_families(items: list[tuple[list[str], _RankState]]) -> Iterator[Metric]:
    collectives = [
        ([*labels, op, pg], c)
        for labels, state in items
        for (op, pg), c in sorted(state.collectives.items())
    ]
    durations = _histogram(catalogue.COLLECTIVE_DURATION_SECONDS)
    for labels, c in collectives:
        durations.add_metric(labels, c.histogram.cumulative_buckets(), c.histogram.sum)
    yield durations
    yield _family(catalogue.COLLECTIVE_BYTES_TOTAL, [(la, c.bytes_total) for la, c in collectives])
    yield _family(
        catalogue.COLLECTIVE_BUSBW_BYTES_PER_SECOND,
        [(labels, c.busbw_bytes_per_s) for labels, c in collectives],
    )


def _agent_families(state: AgentState, node: str) -> Iterator[Metric]:
    labels = [node]
    for spec, value in (
        (catalogue.AGENT_FRAMES_REJECTED_TOTAL, state.frames_rejected_total),
        (catalogue.AGENT_SPOOL_DROPPED_RECORDS_TOTAL, state.spool_dropped_records_total),
        (catalogue.AGENT_FORWARD_FAILURES_TOTAL, state.forward_failures_total),
        (catalogue.AGENT_PROBE_CONNECTIONS, state.probe_connections),
        (catalogue.AGENT_SPOOL_RECORDS, state.spool_records),
        (catalogue.AGENT_SPOOL_BYTES, state.spool_bytes),
        (catalogue.AGENT_FORWARD_UP, int(state.forward_up)),
    ):
        yield _family(spec, [(labels, value)])


def _function_families(
    gauges: dict[str, tuple[str, Callable[[], float]]], node: str
) -> Iterator[Metric]:
    for name, (doc, fn) in gauges.items():
        try:
            value = float(fn())
        except Exception:
            # A broken callback must not take the whole scrape down with it.
            log.exception("gauge function for %s failed", name)
            continue
        family = GaugeMetricFamily(name, doc, labels=["node"])
        family.add_metric([node], value)
        yield family


def _histogram(spec: MetricSpec) -> HistogramMetricFamily:
    return spec.histogram("agent")


def _family(
    spec: MetricSpec, values: Iterable[tuple[Sequence[str], float]]
) -> GaugeMetricFamily | CounterMetricFamily:
    """The gauge or counter family of ``spec`` as the agent exports it, with these samples."""
    family = spec.counter("agent") if spec.kind == "counter" else spec.gauge("agent")
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family


def _unit(value: float) -> float:
    """Pin a measured ratio into [0, 1]: timer jitter can put compute a hair below zero."""
    if not math.isfinite(value):
        return 0.0
    return min(1.0, max(0.0, value))


def make_metrics_handler(registry: CollectorRegistry) -> Handler:
    """An aiohttp handler serving ``registry`` (prometheus-client's own; content negotiated)."""
    return make_aiohttp_handler(registry)
