"""The job-level ``/metrics`` of the live view: a Prometheus collector built at scrape time.

``LiveCollector(live)`` reads ``LiveState.snapshot_for_export`` (a copy taken under the
live state's lock) and names every family as ``torshmon.catalogue.metrics`` does;
register it with the registry the service exposes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from torshmon.aggregator.core.live import LiveState
from torshmon.catalogue import metrics as catalogue
from torshmon.catalogue.metrics import MetricSpec
from torshmon.wire import (
    DURATION_BUCKETS_S,
    STEP_DURATION_BUCKETS_S,
    NodeSample,
)

# prometheus-client leaves this helper unannotated; it formats `le` as its own histograms do.
_go_float: Callable[[float], str] = floatToGoString
_STEP_LE = [_go_float(b) for b in STEP_DURATION_BUCKETS_S] + ["+Inf"]
_COLL_LE = [_go_float(b) for b in DURATION_BUCKETS_S] + ["+Inf"]


def _gauge(spec: MetricSpec) -> GaugeMetricFamily:
    return spec.gauge("aggregator")


def _counter(spec: MetricSpec) -> CounterMetricFamily:
    return spec.counter("aggregator")


def _histogram(spec: MetricSpec) -> HistogramMetricFamily:
    return spec.histogram("aggregator")


def _buckets(counts: Sequence[int], le: Sequence[str]) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip(le, counts, strict=False):
        total += n
        out.append((bound, float(total)))
    return out


class LiveCollector:
    """Job-level metrics as torshmon.catalogue.metrics names them, built at scrape time."""

    def __init__(self, live: LiveState) -> None:
        self._live = live

    def collect(self) -> Iterator[Metric]:
        snap = self._live.snapshot_for_export()
        g = {
            "communication_time_ratio": _gauge(catalogue.COMMUNICATION_TIME_RATIO),
            "training_efficiency_ratio": _gauge(catalogue.TRAINING_EFFICIENCY_RATIO),
            "throughput_samples_per_second": _gauge(catalogue.THROUGHPUT_SAMPLES_PER_SECOND),
            "compute_seconds": _gauge(catalogue.COMPUTE_SECONDS),
            "comm_wait_seconds": _gauge(catalogue.COMM_WAIT_SECONDS),
            "loss": _gauge(catalogue.LOSS),
            "config_version": _gauge(catalogue.CONFIG_VERSION),
        }
        rss = _gauge(catalogue.RANK_MEMORY_RSS_BYTES)
        steps = _counter(catalogue.STEPS_TOTAL)
        nonfinite = _counter(catalogue.NONFINITE_LOSS_TOTAL)
        dropped = _counter(catalogue.PROBE_DROPPED_RECORDS_TOTAL)
        step_h = _histogram(catalogue.STEP_DURATION_SECONDS)
        coll_h = _histogram(catalogue.COLLECTIVE_DURATION_SECONDS)
        busbw = _gauge(catalogue.COLLECTIVE_BUSBW_BYTES_PER_SECOND)
        compression = _gauge(catalogue.COMPRESSION_RATIO)
        rel_err = _gauge(catalogue.COMPRESSION_RELATIVE_ERROR)
        wire = _counter(catalogue.COMPRESSION_WIRE_BYTES_TOTAL)
        cap = _gauge(catalogue.DDP_BUCKET_CAP_BYTES)
        codec = _gauge(catalogue.CODEC_INFO)
        for job, (bucket_cap, codec_name, ranks) in snap["jobs"].items():
            if bucket_cap is not None:
                cap.add_metric([job], float(bucket_cap))
            codec.add_metric([job, codec_name or "none"], 1.0)
            for rank, r in ranks:
                lv = [job, str(rank)]
                values = {
                    "communication_time_ratio": r.communication_time_ratio,
                    "training_efficiency_ratio": (
                        r.compute_s / r.duration_s if r.duration_s > 0 else math.nan
                    ),
                    "throughput_samples_per_second": r.samples_per_s,
                    "compute_seconds": r.compute_s,
                    "comm_wait_seconds": r.comm_wait_s,
                    "loss": r.loss,
                    "config_version": float(r.config_version),
                }
                for key, fam in g.items():
                    value = values[key]
                    # A NaN loss is exported as NaN (the model diverged); others are skipped.
                    if math.isfinite(value) or (key == "loss" and r.steps_total):
                        fam.add_metric(lv, value)
                if math.isfinite(r.rss_bytes):
                    rss.add_metric([job, r.node, str(rank)], r.rss_bytes)
                steps.add_metric(lv, float(r.steps_total))
                nonfinite.add_metric(lv, float(r.nonfinite_loss_total))
                dropped.add_metric(lv, float(r.dropped_records_total))
                step_h.add_metric(
                    lv, _buckets(r.step_hist.counts, _STEP_LE), sum_value=r.step_hist.sum
                )
                for (op, pg), h in r.collectives.items():
                    coll_h.add_metric([job, str(rank), op, pg], _buckets(h.counts, _COLL_LE), h.sum)
                    busbw.add_metric([job, str(rank), op, pg], r.busbw.get((op, pg), 0.0))
                for name, ratio in r.compression.items():
                    compression.add_metric([job, str(rank), name], ratio)
                for name, err in r.relative_error.items():
                    rel_err.add_metric([job, str(rank), name], err)
                for name, total in r.wire_bytes_total.items():
                    wire.add_metric([job, str(rank), name], total)
        yield from g.values()
        yield from (rss, steps, nonfinite, dropped, step_h, coll_h, busbw)
        yield from (compression, rel_err, wire, cap, codec)
        folded = _counter(catalogue.LABEL_VALUES_FOLDED_TOTAL)
        for job, label, count in snap["labels_folded"]:
            folded.add_metric([job, label], float(count))
        yield folded
        yield from self._node_families(snap["nodes"], snap["agent_silence"])
        yield from self._detector_families(snap)

    def _node_families(
        self, nodes: dict[str, NodeSample], snap_silence: dict[str, float]
    ) -> Iterator[Metric]:
        fams = {
            "cpu_utilization_ratio": _gauge(catalogue.CPU_UTILIZATION_RATIO),
            "memory_utilization_ratio": _gauge(catalogue.MEMORY_UTILIZATION_RATIO),
            "io_wait_ratio": _gauge(catalogue.IO_WAIT_TIME_RATIO),
        }
        gpu = _gauge(catalogue.GPU_UTILIZATION_RATIO)
        for name, sample in nodes.items():
            for key, fam in fams.items():
                fam.add_metric([name], float(getattr(sample, key)))
            for g in sample.gpus:
                gpu.add_metric([name, str(g.index)], g.utilization_ratio)
        yield from fams.values()
        yield gpu
        silence = _gauge(catalogue.AGENT_SILENCE_SECONDS)
        for name, seconds in sorted(snap_silence.items()):
            silence.add_metric([name], seconds)
        yield silence

    def _detector_families(self, snap: dict[str, Any]) -> Iterator[Metric]:
        anomaly = _gauge(catalogue.ANOMALY_ACTIVE)
        zscore = _gauge(catalogue.ANOMALY_ZSCORE)
        for f in snap["anomalies"]:
            lv = [f.labels.get("job", ""), f.labels.get("rank", ""), f.labels.get("metric", "")]
            anomaly.add_metric(lv, 1.0)
            zscore.add_metric(lv, f.score)
        straggler = _gauge(catalogue.STRAGGLER_ACTIVE)
        score = _gauge(catalogue.STRAGGLER_SCORE)
        for f in snap["stragglers"]:
            lv = [f.labels.get("job", ""), f.labels.get("rank", "")]
            straggler.add_metric(lv, 1.0)
            score.add_metric(lv, f.score)
        hang = _gauge(catalogue.HUNG_COLLECTIVE_AGE_SECONDS)
        for f in snap["hangs"]:
            hang.add_metric(
                [
                    f.labels.get("job", ""),
                    f.labels.get("rank", ""),
                    f.labels.get("op", ""),
                    f.labels.get("pg", ""),
                ],
                f.value,
            )
        slow_link = _gauge(catalogue.SLOW_LINK_BANDWIDTH_BYTES_PER_SECOND)
        for f in snap["slow_links"]:
            slow_link.add_metric([f.labels.get("job", ""), f.labels.get("rank", "")], f.value)
        link_bw = _gauge(catalogue.LINK_BANDWIDTH_BYTES_PER_SECOND)
        for job, by_rank in snap["link_bandwidth"].items():
            for rank, bandwidth in sorted(by_rank.items()):
                link_bw.add_metric([job, str(rank)], bandwidth)
        firing = _gauge(catalogue.ALERTS)
        counts: dict[tuple[str, str, str], int] = {}
        for a in snap["alerts"]:
            key = (a.rule, a.severity, a.state)
            counts[key] = counts.get(key, 0) + 1
        for key, n in sorted(counts.items()):
            firing.add_metric(list(key), float(n))
        yield from (anomaly, zscore, straggler, score, hang, slow_link, link_bw, firing)
