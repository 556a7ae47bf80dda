"""The job-level ``/metrics`` of the live view: a Prometheus collector built at scrape time.

``LiveCollector(live)`` reads ``LiveState.snapshot_for_export`` (a copy, taken on the
event loop that serves ``/metrics``) and names every family as ``torshmon.catalogue.metrics`` does;
register it with the registry the service exposes. It exports the training series
only: node and process series are the agents' (one exporter per series).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, TypeAlias

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.live import LiveState
from torshmon.aggregator.core.rank_state import RankState
from torshmon.catalogue import metrics as catalogue
from torshmon.catalogue.metrics import MetricSpec
from torshmon.wire import DURATION_BUCKETS_S, STEP_DURATION_BUCKETS_S

#: What ``snapshot_for_export`` holds per (job, run) (run "" where the probes sent no
#: run id): bucket cap, codec, (rank, state) pairs.
_Job: TypeAlias = tuple[int | None, str | None, list[tuple[int, RankState]]]
_Jobs: TypeAlias = dict[tuple[str, str], _Job]

# prometheus-client leaves this helper unannotated; it formats `le` as its own histograms do.
_go_float: Callable[[float], str] = floatToGoString
_STEP_LE = [_go_float(b) for b in STEP_DURATION_BUCKETS_S] + ["+Inf"]
_COLL_LE = [_go_float(b) for b in DURATION_BUCKETS_S] + ["+Inf"]
_RANK_GAUGES: Final = (
    catalogue.COMMUNICATION_TIME_RATIO,
    catalogue.TRAINING_EFFICIENCY_RATIO,
    catalogue.INPUT_WAIT_TIME_RATIO,
    catalogue.THROUGHPUT_SAMPLES_PER_SECOND,
    catalogue.LOSS,
    catalogue.CONFIG_VERSION,
    catalogue.INFLIGHT_OLDEST_AGE_SECONDS,
    catalogue.RANK_GPU_MEMORY_ALLOCATED_BYTES,
    catalogue.RANK_GPU_MEMORY_RESERVED_BYTES,
    catalogue.RANK_GPU_MEMORY_PEAK_BYTES,
)
_RANK_COUNTERS: Final = (
    catalogue.STEPS_TOTAL,
    catalogue.STEP_SECONDS_TOTAL,
    catalogue.COMM_WAIT_SECONDS_TOTAL,
    catalogue.COMPUTE_SECONDS_TOTAL,
    catalogue.INPUT_WAIT_SECONDS_TOTAL,
    catalogue.PROBE_URGENT_STEPS_TOTAL,
    catalogue.PROBE_DROPPED_RECORDS_TOTAL,
    catalogue.NONFINITE_LOSS_TOTAL,
)


def _rank_gauge_values(r: RankState) -> dict[MetricSpec, float]:
    """The latest step's values of one rank (NaN where it has none)."""
    period = r.duration_s + (r.input_wait_s if math.isfinite(r.input_wait_s) else 0.0)
    return {
        catalogue.COMMUNICATION_TIME_RATIO: r.communication_time_ratio,
        catalogue.TRAINING_EFFICIENCY_RATIO: r.compute_s / period if period > 0 else math.nan,
        catalogue.INPUT_WAIT_TIME_RATIO: (
            r.input_wait_s / period if period > 0 else math.nan  # NaN: not measured
        ),
        catalogue.THROUGHPUT_SAMPLES_PER_SECOND: r.samples_per_s,
        catalogue.LOSS: r.loss,
        catalogue.CONFIG_VERSION: float(r.config_version),
        catalogue.INFLIGHT_OLDEST_AGE_SECONDS: r.inflight_oldest_age_s,
        catalogue.RANK_GPU_MEMORY_ALLOCATED_BYTES: r.gpu_memory_allocated_bytes,
        catalogue.RANK_GPU_MEMORY_RESERVED_BYTES: r.gpu_memory_reserved_bytes,
        catalogue.RANK_GPU_MEMORY_PEAK_BYTES: r.gpu_memory_peak_bytes,
    }


def _rank_counter_values(r: RankState) -> dict[MetricSpec, float]:
    """One rank's counts and summed times since the aggregator first saw it."""
    return {
        catalogue.STEPS_TOTAL: float(r.steps_total),
        catalogue.STEP_SECONDS_TOTAL: r.step_hist.sum,
        catalogue.COMM_WAIT_SECONDS_TOTAL: r.comm_wait_s_total,
        catalogue.COMPUTE_SECONDS_TOTAL: r.compute_s_total,
        catalogue.INPUT_WAIT_SECONDS_TOTAL: r.input_wait_s_total,
        catalogue.PROBE_URGENT_STEPS_TOTAL: float(r.urgent_steps_total),
        catalogue.PROBE_DROPPED_RECORDS_TOTAL: float(r.dropped_records_total),
        catalogue.NONFINITE_LOSS_TOTAL: float(r.nonfinite_loss_total),
    }


def _buckets(counts: Sequence[int], le: Sequence[str]) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip(le, counts, strict=False):
        total += n
        out.append((bound, float(total)))
    return out


def _drop_empty_run(family: Metric) -> None:
    """Leave the ``run`` label out of the series of jobs whose probes sent no run id
    (Prometheus reads an empty label as no label; so do exact lookups then)."""
    family.samples = [
        s._replace(labels={k: v for k, v in s.labels.items() if k != "run"})
        if s.labels.get("run") == ""
        else s
        for s in family.samples
    ]


class LiveCollector:
    """Job-level metrics as torshmon.catalogue.metrics names them, built at scrape time.

    The collective histogram and byte counter are summed over each job's ranks
    unless ``collectives_per_rank`` (a rank label then multiplies their series by the
    world size). Node series are the agents' to export, not this collector's.
    """

    def __init__(self, live: LiveState, *, collectives_per_rank: bool = False) -> None:
        self._live = live
        self._per_rank = collectives_per_rank

    def collect(self) -> Iterator[Metric]:
        for family in self._families():
            _drop_empty_run(family)
            yield family

    def _families(self) -> Iterator[Metric]:
        snap = self._live.snapshot_for_export()
        yield from self._rank_families(snap["jobs"])
        yield from self._collective_families(snap["jobs"])
        yield from self._codec_families(snap["jobs"])
        folded = catalogue.LABEL_VALUES_FOLDED_TOTAL.counter()
        for job, label, count in snap["labels_folded"]:
            folded.add_metric([job, label], float(count))
        yield folded
        silence = catalogue.AGENT_SILENCE_SECONDS.gauge()
        for node, seconds in sorted(snap["agent_silence"].items()):
            silence.add_metric([node], seconds)
        yield silence
        yield from self._detector_families(snap)

    def _rank_families(self, jobs: _Jobs) -> Iterator[Metric]:
        gauges = {spec: spec.gauge() for spec in _RANK_GAUGES}
        counters = {spec: spec.counter() for spec in _RANK_COUNTERS}
        step_h = catalogue.STEP_DURATION_SECONDS.histogram()
        failures = catalogue.COLLECTIVE_FAILURES_TOTAL.counter()
        for (job, run), (_cap, _codec, ranks) in jobs.items():
            for rank, r in ranks:
                lv = [job, run, str(rank)]
                for (op, pg), failed in r.collective_failures.items():
                    failures.add_metric([*lv, op, pg], float(failed.count))
                for spec, value in _rank_gauge_values(r).items():
                    # A NaN loss is exported as NaN (the model diverged); others are skipped.
                    if math.isfinite(value) or (spec is catalogue.LOSS and r.steps_total):
                        gauges[spec].add_metric(lv, value)
                for spec, value in _rank_counter_values(r).items():
                    counters[spec].add_metric(lv, value)
                step_h.add_metric(
                    lv, _buckets(r.step_hist.counts, _STEP_LE), sum_value=r.step_hist.sum
                )
        yield from gauges.values()
        yield from counters.values()
        yield step_h
        yield failures

    def _collective_families(self, jobs: _Jobs) -> Iterator[Metric]:
        per_rank = self._per_rank
        durations = catalogue.COLLECTIVE_DURATION_SECONDS.histogram(optional=per_rank)
        sizes = catalogue.COLLECTIVE_BYTES_TOTAL.counter(optional=per_rank)
        busbw = catalogue.COLLECTIVE_BUSBW_BYTES_PER_SECOND.gauge()
        for (job, run), (_cap, _codec, ranks) in jobs.items():
            # (op, pg[, rank]) -> (bucket counts, sum, bytes), summed over ranks unless per rank
            merged: dict[tuple[str, ...], tuple[list[int], float, int]] = {}
            for rank, r in ranks:
                for (op, pg), h in r.collectives.items():
                    measured = r.busbw.get((op, pg))
                    if measured is not None:  # none where nothing timed the op (gloo DDP)
                        busbw.add_metric([job, run, str(rank), op, pg], measured)
                    key: tuple[str, ...] = (op, pg, str(rank)) if per_rank else (op, pg)
                    counts, total, size = merged.get(key, ([0] * len(h.counts), 0.0, 0))
                    merged[key] = (
                        [a + b for a, b in zip(counts, h.counts, strict=True)],
                        total + h.sum,
                        size + r.collective_bytes_total.get((op, pg), 0),
                    )
            for key, (counts, total, size) in sorted(merged.items()):
                durations.add_metric([job, run, *key], _buckets(counts, _COLL_LE), total)
                sizes.add_metric([job, run, *key], float(size))
        yield from (durations, sizes, busbw)

    def _codec_families(self, jobs: _Jobs) -> Iterator[Metric]:
        compression = catalogue.COMPRESSION_RATIO.gauge()
        rel_err = catalogue.COMPRESSION_RELATIVE_ERROR.gauge()
        wire = catalogue.COMPRESSION_WIRE_BYTES_TOTAL.counter()
        cap = catalogue.DDP_BUCKET_CAP_BYTES.gauge()
        codec = catalogue.CODEC_INFO.gauge()
        for (job, run), (bucket_cap, codec_name, ranks) in jobs.items():
            if bucket_cap is not None:
                cap.add_metric([job, run], float(bucket_cap))
            codec.add_metric([job, run, codec_name or "none"], 1.0)
            for rank, r in ranks:
                for name, ratio in r.compression.items():
                    compression.add_metric([job, run, str(rank), name], ratio)
                for name, err in r.relative_error.items():
                    rel_err.add_metric([job, run, str(rank), name], err)
                for name, total in r.wire_bytes_total.items():
                    wire.add_metric([job, run, str(rank), name], total)
        yield from (compression, rel_err, wire, cap, codec)

    def _detector_families(self, snap: dict[str, Any]) -> Iterator[Metric]:

        def of(f: Finding, *names: str) -> list[str]:
            """``f``'s job, its run, then its labels ``names`` ("" where missing)."""
            return [f.labels.get(name, "") for name in ("job", "run", *names)]

        # A finding shown but too short-lived yet to wake anybody (details["page"] is
        # False) is active, not paging: the exported rules fire on paging, as the
        # aggregator's own rules do.
        anomaly = catalogue.ANOMALY_ACTIVE.gauge()
        anomaly_paging = catalogue.ANOMALY_PAGING.gauge()
        zscore = catalogue.ANOMALY_ZSCORE.gauge()
        for f in snap["anomalies"]:
            lv = of(f, "rank", "metric")
            anomaly.add_metric(lv, 1.0)
            if f.details.get("page") is not False:
                anomaly_paging.add_metric(lv, 1.0)
            zscore.add_metric(lv, f.score)
        straggler = catalogue.STRAGGLER_ACTIVE.gauge()
        straggler_paging = catalogue.STRAGGLER_PAGING.gauge()
        score = catalogue.STRAGGLER_SCORE.gauge()
        for f in snap["stragglers"]:
            lv = of(f, "rank")
            straggler.add_metric(lv, 1.0)
            if f.details.get("page") is not False:
                straggler_paging.add_metric(lv, 1.0)
            score.add_metric(lv, f.score)
        active = catalogue.BOTTLENECK_ACTIVE.gauge()
        gain = catalogue.BOTTLENECK_EXPECTED_GAIN_RATIO.gauge()
        for (job, run), report in sorted(snap["reports"].items()):
            # Several stragglers (or slow links) are one category: its largest gain.
            gains: dict[str, float | None] = {}
            for f in report:
                before = gains.get(f.category)
                value = f.expected_gain_ratio
                gains[f.category] = value if before is None else max(before, value or 0.0)
            for category, value in sorted(gains.items()):
                active.add_metric([job, run, category], 1.0)
                if value is not None:
                    gain.add_metric([job, run, category], value)
        hang = catalogue.HUNG_COLLECTIVE_AGE_SECONDS.gauge()
        for f in snap["hangs"]:
            hang.add_metric(of(f, "rank", "op", "pg"), f.value)
        slow_link = catalogue.SLOW_LINK_BANDWIDTH_BYTES_PER_SECOND.gauge()
        for f in snap["slow_links"]:
            slow_link.add_metric(of(f, "rank", "node"), f.value)
        link_bw = catalogue.LINK_BANDWIDTH_BYTES_PER_SECOND.gauge()
        node_bw = catalogue.NODE_LINK_BANDWIDTH_BYTES_PER_SECOND.gauge()
        for (job, run), reading in snap["link_bandwidth"].items():
            for rank, bandwidth in sorted(reading.bandwidth_by_rank.items()):
                link_bw.add_metric([job, run, str(rank)], bandwidth)
            if reading.nodes is not None:
                for (src, dst), bandwidth in reading.nodes.pairs.items():
                    node_bw.add_metric([job, run, src, dst], bandwidth)
                for node, pairs in reading.nodes.intra.items():
                    if pairs:
                        node_bw.add_metric([job, run, node, node], max(pairs.values()))
        firing = catalogue.ALERTS.gauge()
        counts: dict[tuple[str, str, str], int] = {}
        for a in snap["alerts"]:
            key = (a.rule, a.severity, a.state)
            counts[key] = counts.get(key, 0) + 1
        for key, n in sorted(counts.items()):
            firing.add_metric(list(key), float(n))
        yield from (
            anomaly,
            anomaly_paging,
            zscore,
            straggler,
            straggler_paging,
            score,
            active,
            gain,
            hang,
            slow_link,
            link_bw,
        )
        yield from (node_bw, firing)
