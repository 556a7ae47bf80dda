"""Writes torshmon's Grafana dashboards (Grafana 10+ JSON) into this folder.

The six dashboards share their variables (data source, job, node, rank), panel
defaults and layout, so they are generated here rather than edited by hand::

    python dashboards/build.py            # rewrite the JSON files
    python dashboards/build.py --check    # exit 1 if a file is out of date

Every query reads metrics named in ``torshmon.catalogue.metrics`` (checked when
the files are written) from Prometheus scraping the aggregator (job-level series)
and the agents (node and agent-health series); see deploy/prometheus.yml.
``$__rate_interval`` is Grafana's, so the same panel works for any scrape interval.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from torshmon.catalogue.metrics import METRICS

HERE: Final = Path(__file__).resolve().parent
#: The data source the provisioning in grafana/ creates (a variable, so that the
#: dashboards also import into a Grafana whose Prometheus has another uid).
DATASOURCE_UID: Final = "torshmon-prometheus"
DATASOURCE: Final = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION: Final = 39
TAG: Final = "torshmon"
GRID_WIDTH: Final = 24

# Label selectors shared by the panels.
JOB: Final = 'job="$job"'
RANKS: Final = 'job="$job", rank=~"$rank"'
NODES: Final = 'node=~"$node"'
RATE: Final = "$__rate_interval"
METRIC_NAME: Final = re.compile(r"\btorshmon_[a-z0-9_]+")


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL target; ``instant`` for tables and current values."""

    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False
    heatmap: bool = False


@dataclass(frozen=True, slots=True)
class Panel:
    """One panel; ``kind`` is a Grafana panel type. Sizes are grid units (24 wide)."""

    kind: str
    title: str
    queries: tuple[Query, ...]
    description: str = ""
    unit: str = "short"
    width: int = 12
    height: int = 8
    min_value: float | None = None
    max_value: float | None = None
    thresholds: tuple[tuple[str, float | None], ...] = ()
    threshold_lines: bool = False
    stack: bool = False
    stat_text: str = "auto"
    transformations: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True, slots=True)
class Dashboard:
    """One dashboard file: ``<slug>.json`` with uid ``torshmon-<slug>``."""

    slug: str
    title: str
    description: str
    rows: tuple[Row, ...]
    extra_variables: tuple[dict[str, Any], ...] = ()
    tags: tuple[str, ...] = ()

    @property
    def uid(self) -> str:
        return f"torshmon-{self.slug}"

    @property
    def filename(self) -> str:
        return f"{self.slug}.json"


# -- panel shorthands ---------------------------------------------------------------------


def q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


def timeseries(title: str, *queries: Query, **options: Any) -> Panel:
    return Panel("timeseries", title, queries, **options)


def stat(title: str, *queries: Query, **options: Any) -> Panel:
    """A current value with its sparkline (a range query reduced to its last value)."""
    options.setdefault("width", 4)
    options.setdefault("height", 4)
    return Panel("stat", title, queries, **options)


def timeline(title: str, *queries: Query, **options: Any) -> Panel:
    return Panel("state-timeline", title, queries, **options)


def table(title: str, *queries: Query, **options: Any) -> Panel:
    return Panel(
        "table",
        title,
        tuple(Query(x.expr, x.legend, instant=True, table=True) for x in queries),
        **options,
    )


def bars(title: str, *queries: Query, **options: Any) -> Panel:
    return Panel(
        "bargauge", title, tuple(Query(x.expr, x.legend, instant=True) for x in queries), **options
    )


def heatmap(title: str, expr: str, **options: Any) -> Panel:
    return Panel("heatmap", title, (Query(expr, "{{le}}", heatmap=True),), **options)


def mean_step(selector: str, by: str = "") -> str:
    """Mean step time from the step histogram (every step weighs the same)."""
    group = f" by ({by})" if by else ""
    return (
        f"sum{group} (rate(torshmon_step_duration_seconds_sum{{{selector}}}[{RATE}]))"
        f" / sum{group} (rate(torshmon_step_duration_seconds_count{{{selector}}}[{RATE}]))"
    )


def step_quantile(quantile: float) -> str:
    return (
        f"histogram_quantile({quantile}, sum by (le) "
        f"(rate(torshmon_step_duration_seconds_bucket{{{RANKS}}}[{RATE}])))"
    )


OK_WARN_BAD_UP = (("green", None), ("orange", 0.3), ("red", 0.5))
RED_BELOW_07 = (("red", None), ("green", 0.7))


# -- the dashboards -----------------------------------------------------------------------


def job_overview() -> Dashboard:
    headline = Row(
        "Job $job",
        (
            stat(
                "Throughput",
                q(f"sum(torshmon_throughput_samples_per_second{{{RANKS}}})"),
                unit="short",
                description="Samples per second of the whole job: the ranks' latest steps summed.",
            ),
            stat("Mean step time", q(mean_step(RANKS)), unit="s"),
            stat(
                "Communication share",
                q(f"avg(torshmon_communication_time_ratio{{{RANKS}}})"),
                unit="percentunit",
                thresholds=OK_WARN_BAD_UP,
                description="Share of each step spent waiting for communication, mean over "
                "ranks. Above 30% is a bottleneck, above 50% a critical one.",
            ),
            stat(
                "Training efficiency",
                q(f"avg(torshmon_training_efficiency_ratio{{{RANKS}}})"),
                unit="percentunit",
                thresholds=RED_BELOW_07,
                description="Compute time over step time, mean over ranks; below 70% the "
                "job spends too much time waiting.",
            ),
            stat("Ranks reporting", q(f"count(torshmon_steps_total{{{JOB}}})"), unit="none"),
            stat(
                "Steps per second",
                q(f"avg(rate(torshmon_steps_total{{{RANKS}}}[{RATE}]))"),
                unit="none",
            ),
        ),
    )
    training = Row(
        "Throughput and step time",
        (
            timeseries(
                "Throughput",
                q(f"sum(torshmon_throughput_samples_per_second{{{RANKS}}})", "job"),
                q(f"torshmon_throughput_samples_per_second{{{RANKS}}}", "rank {{rank}}"),
                unit="short",
                description="Samples per second, the job's and each rank's.",
            ),
            timeseries(
                "Step time",
                q(step_quantile(0.5), "p50"),
                q(step_quantile(0.9), "p90"),
                q(step_quantile(0.99), "p99"),
                q(mean_step(RANKS), "mean"),
                unit="s",
                description="Quantiles of the step-time histogram over the selected ranks.",
            ),
            timeseries(
                "Communication share of step time",
                q(f"torshmon_communication_time_ratio{{{RANKS}}}", "rank {{rank}}"),
                unit="percentunit",
                min_value=0,
                max_value=1,
                thresholds=OK_WARN_BAD_UP,
                threshold_lines=True,
                description="Time each step waited for communication over its duration. "
                "Lines at 30% (high) and 50% (critical) are the bottleneck report's.",
            ),
            timeseries(
                "Training efficiency",
                q(f"torshmon_training_efficiency_ratio{{{RANKS}}}", "rank {{rank}}"),
                unit="percentunit",
                min_value=0,
                max_value=1,
                thresholds=RED_BELOW_07,
                threshold_lines=True,
                description="Compute time over step time per rank (line: 70%).",
            ),
            timeseries(
                "Compute and communication wait",
                q(f"avg(torshmon_compute_seconds{{{RANKS}}})", "compute"),
                q(f"avg(torshmon_comm_wait_seconds{{{RANKS}}})", "communication wait"),
                unit="s",
                stack=True,
                description="The latest step split into compute and communication wait, "
                "mean over ranks.",
            ),
            timeseries(
                "Loss",
                q(f"torshmon_loss{{{RANKS}}}", "rank {{rank}}"),
                description="Latest training loss per rank.",
            ),
        ),
    )
    nodes = Row(
        "Nodes",
        (
            timeseries(
                "CPU utilisation",
                q(f"torshmon_cpu_utilization_ratio{{{NODES}}}", "{{node}}"),
                unit="percentunit",
                min_value=0,
                max_value=1,
                width=8,
            ),
            timeseries(
                "Memory utilisation",
                q(f"torshmon_memory_utilization_ratio{{{NODES}}}", "{{node}}"),
                unit="percentunit",
                min_value=0,
                max_value=1,
                thresholds=(("green", None), ("red", 0.9)),
                threshold_lines=True,
                width=8,
                description="Used over total memory; the High Memory Usage alert fires "
                "above 90% (line).",
            ),
            timeseries(
                "I/O wait",
                q(f"torshmon_io_wait_time_ratio{{{NODES}}}", "{{node}}"),
                unit="percentunit",
                min_value=0,
                thresholds=(("green", None), ("orange", 0.1)),
                threshold_lines=True,
                width=8,
                description="CPU time waiting for I/O; above 10% the input pipeline is "
                "likely the bottleneck.",
            ),
            timeseries(
                "GPU utilisation",
                q(f"torshmon_gpu_utilization_ratio{{{NODES}}}", "{{node}} gpu {{gpu}}"),
                unit="percentunit",
                min_value=0,
                max_value=1,
                thresholds=RED_BELOW_07,
                threshold_lines=True,
                width=8,
                description="NVML busy time per GPU (empty on nodes without NVIDIA GPUs).",
            ),
            timeseries(
                "Network",
                q(
                    f"rate(torshmon_network_receive_bytes_total{{{NODES}}}[{RATE}])",
                    "{{node}} received",
                ),
                q(
                    f"rate(torshmon_network_transmit_bytes_total{{{NODES}}}[{RATE}])",
                    "{{node}} sent",
                ),
                unit="Bps",
                width=8,
            ),
            timeseries(
                "Rank memory (RSS)",
                q(
                    f"torshmon_rank_memory_rss_bytes{{{RANKS}, {NODES}}}",
                    "rank {{rank}} on {{node}}",
                ),
                unit="bytes",
                width=8,
                description="Resident memory of each training process; steady growth "
                "is what the Memory Leak alert looks for.",
            ),
        ),
    )
    return Dashboard(
        "job-overview",
        "torshmon / Job overview",
        "Throughput, step time, communication share and efficiency of one training job.",
        (headline, training, nodes),
    )


def ranks() -> Dashboard:
    compute = Row(
        "Stragglers",
        (
            timeseries(
                "Compute time per rank",
                q(f"torshmon_compute_seconds{{{RANKS}}}", "rank {{rank}}"),
                unit="s",
                description="Step time minus communication wait. This is the straggler "
                "signal: a slow rank computes longer, while its collectives look fastest "
                "(it arrives last and waits least).",
            ),
            timeseries(
                "Compute time relative to the job's median",
                q(
                    f"torshmon_compute_seconds{{{RANKS}}} / on (job) group_left () "
                    f"quantile by (job) (0.5, torshmon_compute_seconds{{{JOB}}})",
                    "rank {{rank}}",
                ),
                unit="none",
                thresholds=(("green", None), ("orange", 1.5)),
                threshold_lines=True,
                description="1 is the median rank; a straggler stands out above it.",
            ),
            timeseries(
                "Communication wait per rank",
                q(f"torshmon_comm_wait_seconds{{{RANKS}}}", "rank {{rank}}"),
                unit="s",
                description="The ranks that wait longest are waiting for the straggler.",
            ),
            timeline(
                "Straggler detected",
                q(f"max by (rank) (torshmon_straggler_active{{{RANKS}}})", "rank {{rank}}"),
                description="While the aggregator's detector (robust z-score of compute "
                "time across ranks, with persistence) flags the rank.",
            ),
            timeseries(
                "Straggler score",
                q(f"torshmon_straggler_score{{{RANKS}}}", "rank {{rank}}"),
                unit="none",
                description="The detector's statistic for a flagged rank.",
            ),
            bars(
                "Mean step time per rank",
                q(mean_step(RANKS, "rank"), "rank {{rank}}"),
                unit="s",
            ),
        ),
    )
    health = Row(
        "Per-rank health",
        (
            timeseries(
                "Steps per second",
                q(f"rate(torshmon_steps_total{{{RANKS}}}[{RATE}])", "rank {{rank}}"),
                unit="none",
                width=8,
            ),
            timeseries(
                "Throughput per rank",
                q(f"torshmon_throughput_samples_per_second{{{RANKS}}}", "rank {{rank}}"),
                width=8,
            ),
            timeseries(
                "Oldest collective in flight",
                q(
                    f"max by (rank) (torshmon_inflight_oldest_age_seconds{{{RANKS}}})",
                    "rank {{rank}}",
                ),
                unit="s",
                width=8,
                description="Age of the oldest collective each rank is inside (0: none). "
                "In a hang the rank that never joined stays at 0 while its peers grow.",
            ),
            timeseries(
                "Communication config version",
                q(f"torshmon_config_version{{{RANKS}}}", "rank {{rank}}"),
                unit="none",
                width=8,
                description="Every rank must run the same version: configs change on all "
                "ranks at the same step.",
            ),
            timeseries(
                "Records dropped by the probe",
                q(
                    f"rate(torshmon_probe_dropped_records_total{{{RANKS}}}[{RATE}])",
                    "rank {{rank}}",
                ),
                unit="none",
                width=8,
                description="Step records per second the probe had to drop (no or slow "
                "agent); training itself is never blocked.",
            ),
            timeseries(
                "Rank memory (RSS)",
                q(f"torshmon_rank_memory_rss_bytes{{{RANKS}}}", "rank {{rank}}"),
                unit="bytes",
                width=8,
            ),
            table(
                "Ranks now",
                q(f"max by (rank) (torshmon_steps_total{{{RANKS}}})"),
                q(f"max by (rank) (torshmon_compute_seconds{{{RANKS}}})"),
                q(f"max by (rank) (torshmon_comm_wait_seconds{{{RANKS}}})"),
                q(f"max by (rank) (torshmon_communication_time_ratio{{{RANKS}}})"),
                q(f"max by (rank) (torshmon_config_version{{{RANKS}}})"),
                width=24,
                transformations=(
                    {"id": "merge", "options": {}},
                    {
                        "id": "organize",
                        "options": {
                            "excludeByName": {"Time": True},
                            "renameByName": {
                                "Value #A": "steps",
                                "Value #B": "compute (s)",
                                "Value #C": "comm wait (s)",
                                "Value #D": "comm share",
                                "Value #E": "config version",
                            },
                        },
                    },
                ),
            ),
        ),
    )
    return Dashboard(
        "ranks",
        "torshmon / Per-rank comparison",
        "Every rank side by side: the straggler view.",
        (compute, health),
    )


def collectives() -> Dashboard:
    sel = f'{RANKS}, op=~"$op"'
    op_variable = _query_variable(
        "op",
        "Collective",
        f"label_values(torshmon_collective_duration_seconds_count{{{JOB}}}, op)",
        multi=True,
    )
    latency = Row(
        "Latency",
        (
            heatmap(
                "Collective duration (all ops)",
                f"sum by (le) (rate(torshmon_collective_duration_seconds_bucket{{{sel}}}[{RATE}]))",
                description="How many collectives took how long, per second.",
            ),
            timeseries(
                "Duration p50 / p99 by op",
                q(
                    f"histogram_quantile(0.5, sum by (le, op) "
                    f"(rate(torshmon_collective_duration_seconds_bucket{{{sel}}}[{RATE}])))",
                    "{{op}} p50",
                ),
                q(
                    f"histogram_quantile(0.99, sum by (le, op) "
                    f"(rate(torshmon_collective_duration_seconds_bucket{{{sel}}}[{RATE}])))",
                    "{{op}} p99",
                ),
                unit="s",
            ),
            timeseries(
                "Calls per second by op",
                q(
                    f"sum by (op) (rate(torshmon_collective_duration_seconds_count{{{sel}}}"
                    f"[{RATE}]))",
                    "{{op}}",
                ),
                unit="none",
            ),
            timeseries(
                "Time in collectives per rank",
                q(
                    f"sum by (rank) (rate(torshmon_collective_duration_seconds_sum{{{sel}}}"
                    f"[{RATE}]))",
                    "rank {{rank}}",
                ),
                unit="percentunit",
                description="Seconds spent inside collectives per second of wall time. "
                "The straggler spends the least: its peers wait for it inside the call.",
            ),
        ),
    )
    bandwidth = Row(
        "Bandwidth and size",
        (
            timeseries(
                "Bus bandwidth by op",
                q(f"avg by (op) (torshmon_collective_busbw_bytes_per_second{{{sel}}})", "{{op}}"),
                unit="Bps",
                description="nccl-tests bus bandwidth of the latest step, mean over ranks: "
                "comparable across ops and world sizes, and with the link's speed.",
            ),
            timeseries(
                "Bus bandwidth per rank",
                q(
                    f"torshmon_collective_busbw_bytes_per_second{{{sel}}}",
                    "rank {{rank}} {{op}} ({{pg}})",
                ),
                unit="Bps",
            ),
            timeseries(
                "Algorithm bandwidth by op",
                q(
                    f"sum by (op) (rate(torshmon_collective_bytes_total{{{sel}}}[{RATE}]))"
                    f" / sum by (op) (rate(torshmon_collective_duration_seconds_sum{{{sel}}}"
                    f"[{RATE}]))",
                    "{{op}}",
                ),
                unit="Bps",
                description="Message bytes over time inside the call (nccl-tests algbw).",
            ),
            timeseries(
                "Mean message size by op",
                q(
                    f"sum by (op) (rate(torshmon_collective_bytes_total{{{sel}}}[{RATE}]))"
                    f" / sum by (op) (rate(torshmon_collective_duration_seconds_count{{{sel}}}"
                    f"[{RATE}]))",
                    "{{op}}",
                ),
                unit="bytes",
                description="Bytes per call (nccl-tests message size). Small messages are "
                "latency-bound: larger DDP buckets raise it.",
            ),
            timeseries(
                "Collective bytes per second by op",
                q(
                    f"sum by (op) (rate(torshmon_collective_bytes_total{{{sel}}}[{RATE}]))",
                    "{{op}}",
                ),
                unit="Bps",
            ),
        ),
    )
    return Dashboard(
        "collectives",
        "torshmon / Collectives",
        "Latency histograms, bus bandwidth and message sizes of torch.distributed "
        "collectives, by op. DDP's bucket all-reduces appear here while a gradient codec "
        "runs or when the probe is attached with bucket_timing=True.",
        (latency, bandwidth),
        extra_variables=(op_variable,),
    )


def ddp() -> Dashboard:
    now = Row(
        "Configuration in force",
        (
            stat(
                "Bucket cap",
                q(f"max(torshmon_ddp_bucket_cap_bytes{{{JOB}}})"),
                unit="bytes",
                width=6,
            ),
            stat(
                "Gradient codec",
                q(f"torshmon_codec_info{{{JOB}}} == 1", "{{codec}}"),
                stat_text="name",
                width=6,
            ),
            stat(
                "Config version",
                q(f"max(torshmon_config_version{{{RANKS}}})"),
                unit="none",
                width=6,
            ),
            stat(
                "Communication share",
                q(f"avg(torshmon_communication_time_ratio{{{RANKS}}})"),
                unit="percentunit",
                thresholds=OK_WARN_BAD_UP,
                width=6,
            ),
        ),
    )
    buckets = Row(
        "Buckets",
        (
            timeseries(
                "Bucket cap",
                q(f"max(torshmon_ddp_bucket_cap_bytes{{{JOB}}})", "bucket cap"),
                unit="bytes",
                description="DDP's gradient bucket cap; the autotuner changes it on every "
                "rank at the same step.",
            ),
            timeseries(
                "Step time and communication wait",
                q(mean_step(RANKS), "mean step"),
                q(f"avg(torshmon_comm_wait_seconds{{{RANKS}}})", "communication wait"),
                unit="s",
                description="What a bucket or codec change is meant to improve.",
            ),
        ),
    )
    compression = Row(
        "Compression",
        (
            timeline(
                "Codec in force",
                q(f"torshmon_codec_info{{{JOB}}}", "{{codec}}"),
                width=24,
                height=5,
            ),
            timeseries(
                "Compression ratio",
                q(f"torshmon_compression_ratio{{{RANKS}}}", "{{codec}} rank {{rank}}"),
                unit="percentunit",
                min_value=0,
                width=8,
                description="Wire bytes over gradient bytes (100%: uncompressed).",
            ),
            timeseries(
                "Codec relative error",
                q(
                    f"torshmon_compression_relative_error{{{RANKS}}}",
                    "{{codec}} rank {{rank}}",
                ),
                unit="percentunit",
                width=8,
                description="||g - decode(encode(g))|| / ||g|| on sampled steps; the "
                "autotuner's guardrail.",
            ),
            timeseries(
                "Gradient bytes on the wire",
                q(
                    f"sum by (codec) (rate(torshmon_compression_wire_bytes_total{{{RANKS}}}"
                    f"[{RATE}]))",
                    "{{codec}}",
                ),
                unit="Bps",
                width=8,
            ),
        ),
    )
    return Dashboard(
        "ddp",
        "torshmon / DDP buckets and compression",
        "DDP bucket cap, gradient codec, compression ratio and error.",
        (now, buckets, compression),
    )


def autotuner() -> Dashboard:
    state = Row(
        "Tuner",
        (
            stat(
                "State",
                q(f"torshmon_tuner_state{{{JOB}}} == 1", "{{state}}"),
                stat_text="name",
                width=6,
            ),
            stat(
                "Best score",
                q(f"max(torshmon_tuner_best_score{{{JOB}}})"),
                unit="short",
                width=6,
                description="Throughput (samples/s) of the best config tried so far.",
            ),
            stat(
                "Trials",
                q(f"sum(torshmon_tuner_trials_total{{{JOB}}})"),
                unit="none",
                width=6,
            ),
            stat(
                "Bucket cap",
                q(f"max(torshmon_ddp_bucket_cap_bytes{{{JOB}}})"),
                unit="bytes",
                width=6,
            ),
            timeline(
                "Tuner state",
                q(f"torshmon_tuner_state{{{JOB}}}", "{{state}}"),
                width=24,
                height=5,
            ),
        ),
    )
    trials = Row(
        "Trials",
        (
            timeseries(
                "Best score and throughput",
                q(f"max(torshmon_tuner_best_score{{{JOB}}})", "best score"),
                q(f"sum(torshmon_throughput_samples_per_second{{{RANKS}}})", "throughput now"),
                unit="short",
                description="Samples/s: the best trial so far against what the job does now.",
            ),
            timeseries(
                "Trials by decision",
                q(
                    f"sum by (decision) (increase(torshmon_tuner_trials_total{{{JOB}}}[{RATE}]))",
                    "{{decision}}",
                ),
                unit="none",
                stack=True,
                description="Every trial, decision and rollback is also in SQL: "
                'torshmon query "SELECT * FROM tuning_trials".',
            ),
            bars(
                "Trials so far by decision",
                q(f"sum by (decision) (torshmon_tuner_trials_total{{{JOB}}})", "{{decision}}"),
                unit="none",
            ),
            timeseries(
                "Bucket cap",
                q(f"max(torshmon_ddp_bucket_cap_bytes{{{JOB}}})", "bucket cap"),
                unit="bytes",
            ),
            timeline(
                "Codec in force",
                q(f"torshmon_codec_info{{{JOB}}}", "{{codec}}"),
                width=24,
                height=5,
            ),
        ),
    )
    return Dashboard(
        "autotuner",
        "torshmon / Autotuner",
        "The autotuner's state, trials and score, and the DDP config it steers.",
        (state, trials),
    )


def alerts() -> Dashboard:
    firing = Row(
        "Alerts",
        (
            table(
                "Alerts pending and firing",
                q(f"ALERTS{{{JOB}}}"),
                width=24,
                transformations=(
                    {
                        "id": "organize",
                        "options": {
                            "excludeByName": {"Time": True, "Value": True, "__name__": True},
                        },
                    },
                ),
                description="From Prometheus evaluating torshmon's exported rules "
                "(deploy/torshmon-rules.yml); the same conditions the aggregator notifies on.",
            ),
            timeseries(
                "torshmon alerts by rule and state",
                q("sum by (alertname, state) (torshmon_alerts)", "{{alertname}} ({{state}})"),
                unit="none",
                description="Alert instances the aggregator holds pending or firing.",
            ),
            timeseries(
                "Non-finite losses",
                q(
                    f"sum by (rank) (increase(torshmon_nonfinite_loss_total{{{RANKS}}}[{RATE}]))",
                    "rank {{rank}}",
                ),
                unit="none",
                description="Steps whose loss was NaN or infinite: the model diverged.",
            ),
        ),
    )
    detectors = Row(
        "Detectors",
        (
            timeline(
                "Stragglers",
                q(f"max by (rank) (torshmon_straggler_active{{{RANKS}}})", "rank {{rank}}"),
            ),
            timeseries(
                "Straggler score",
                q(f"torshmon_straggler_score{{{RANKS}}}", "rank {{rank}}"),
                unit="none",
            ),
            timeline(
                "Anomalies",
                q(
                    f"max by (metric, rank) (torshmon_anomaly_active{{{RANKS}}})",
                    "{{metric}} rank {{rank}}",
                ),
                description="Rolling z-score anomalies (step time, loss) per rank.",
            ),
            timeseries(
                "Anomaly z-score",
                q(f"torshmon_anomaly_zscore{{{RANKS}}}", "{{metric}} rank {{rank}}"),
                unit="none",
            ),
            timeseries(
                "Oldest collective in flight",
                q(
                    f"max by (rank) (torshmon_inflight_oldest_age_seconds{{{RANKS}}})",
                    "rank {{rank}}",
                ),
                unit="s",
                width=24,
                description="A hung collective shows as peers' ages growing while one rank "
                "stays at 0; the Hung Collective alert names that rank, op and group.",
            ),
        ),
    )
    pipeline = Row(
        "torshmon itself",
        (
            timeseries(
                "Notifications",
                q(
                    f"sum by (target) (rate(torshmon_notifications_sent_total[{RATE}]))",
                    "{{target}} sent",
                ),
                q(
                    f"sum by (target) (rate(torshmon_notifications_failed_total[{RATE}]))",
                    "{{target}} failed",
                ),
                unit="none",
                width=8,
            ),
            timeseries(
                "Agents forwarding",
                q(f"torshmon_agent_forward_up{{{NODES}}}", "{{node}}"),
                unit="none",
                min_value=0,
                max_value=1,
                width=8,
                description="1 while the node's agent reaches the aggregator; otherwise it "
                "spools to disk and forwards later.",
            ),
            timeseries(
                "Agent spool",
                q(f"torshmon_agent_spool_records{{{NODES}}}", "{{node}}"),
                unit="none",
                width=8,
                description="Records waiting on disk to be forwarded.",
            ),
            timeseries(
                "Ingest",
                q(f"sum(rate(torshmon_ingest_records_total[{RATE}]))", "records"),
                q(f"sum(rate(torshmon_ingest_duplicates_total[{RATE}]))", "duplicates"),
                unit="none",
                width=12,
                description="Agent records the aggregator stored per second.",
            ),
            timeseries(
                "Records dropped by probes",
                q(
                    f"sum by (rank) (rate(torshmon_probe_dropped_records_total{{{RANKS}}}"
                    f"[{RATE}]))",
                    "rank {{rank}}",
                ),
                unit="none",
                width=12,
            ),
        ),
    )
    return Dashboard(
        "alerts",
        "torshmon / Alerts and anomalies",
        "Alerts, detector findings and the health of torshmon's own pipeline.",
        (firing, detectors, pipeline),
    )


DASHBOARDS: Final = (job_overview, ranks, collectives, ddp, autotuner, alerts)


# -- JSON -------------------------------------------------------------------------------


def _query_variable(
    name: str, label: str, query: str, *, multi: bool, include_all: bool = True
) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": f"torshmon-{name}"},
        "refresh": 2,
        "sort": 3 if name == "rank" else 1,
        "multi": multi,
        "includeAll": include_all,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if include_all else {},
        "hide": 0,
        "regex": "",
        "options": [],
        "skipUrlSync": False,
    }


def variables(extra: Iterable[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Data source, job, node and rank, then the dashboard's own."""
    datasource = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {"selected": False, "text": "Prometheus", "value": DATASOURCE_UID},
        "hide": 0,
        "regex": "",
        "options": [],
        "refresh": 1,
        "skipUrlSync": False,
    }
    return [
        datasource,
        _query_variable(
            "job",
            "Job",
            "label_values(torshmon_steps_total, job)",
            multi=False,
            include_all=False,
        ),
        _query_variable(
            "node", "Node", "label_values(torshmon_cpu_utilization_ratio, node)", multi=True
        ),
        _query_variable(
            "rank", "Rank", f"label_values(torshmon_steps_total{{{JOB}}}, rank)", multi=True
        ),
        *extra,
    ]


def _target(query: Query, ref_id: str) -> dict[str, Any]:
    target: dict[str, Any] = {
        "datasource": DATASOURCE,
        "refId": ref_id,
        "expr": query.expr,
        "legendFormat": query.legend or "__auto",
        "range": not query.instant,
        "instant": query.instant,
        "editorMode": "code",
    }
    if query.table:
        target["format"] = "table"
    elif query.heatmap:
        target["format"] = "heatmap"
    return target


def _thresholds(steps: Sequence[tuple[str, float | None]]) -> dict[str, Any]:
    if not steps:
        steps = (("green", None),)
    return {
        "mode": "absolute",
        "steps": [{"color": color, "value": value} for color, value in steps],
    }


def _field_config(panel: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "color": {"mode": "thresholds" if panel.kind == "stat" else "palette-classic"},
        "thresholds": _thresholds(panel.thresholds),
        "mappings": [],
    }
    if panel.min_value is not None:
        defaults["min"] = panel.min_value
    if panel.max_value is not None:
        defaults["max"] = panel.max_value
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 30 if panel.stack else 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "line" if panel.threshold_lines else "off"},
        }
    if panel.kind == "state-timeline":
        defaults["color"] = {"mode": "thresholds"}
        defaults["thresholds"] = _thresholds((("transparent", None), ("red", 1)))
        defaults["mappings"] = [
            {"type": "value", "options": {"0": {"text": "no"}, "1": {"text": "yes"}}}
        ]
        defaults["custom"] = {"fillOpacity": 70, "lineWidth": 0}
    return {"defaults": defaults, "overrides": []}


def _options(panel: Panel) -> dict[str, Any]:
    legend = {"displayMode": "list", "placement": "bottom", "showLegend": True}
    if panel.kind == "timeseries":
        return {"legend": legend, "tooltip": {"mode": "multi", "sort": "desc"}}
    if panel.kind == "stat":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": panel.stat_text,
        }
    if panel.kind == "bargauge":
        return {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "displayMode": "gradient",
            "orientation": "horizontal",
            "showUnfilled": True,
        }
    if panel.kind == "state-timeline":
        return {
            "legend": legend,
            "tooltip": {"mode": "single"},
            "showValue": "never",
            "mergeValues": True,
            "rowHeight": 0.9,
            "alignValue": "left",
        }
    if panel.kind == "heatmap":
        return {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Spectral", "steps": 64, "exponent": 0.5},
            "yAxis": {"unit": "s", "axisPlacement": "left"},
            "rowsFrame": {"layout": "auto"},
            "legend": {"show": True},
            "tooltip": {"show": True, "yHistogram": False},
        }
    if panel.kind == "table":
        return {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    raise ValueError(f"unknown panel kind {panel.kind!r}")


class _Layout:
    """Places panels left to right, wrapping at the grid's width."""

    def __init__(self) -> None:
        self.x = 0
        self.y = 0
        self.row_height = 0

    def row(self) -> dict[str, int]:
        self._newline()
        pos = {"h": 1, "w": GRID_WIDTH, "x": 0, "y": self.y}
        self.y += 1
        return pos

    def place(self, width: int, height: int) -> dict[str, int]:
        if self.x + width > GRID_WIDTH:
            self._newline()
        pos = {"h": height, "w": width, "x": self.x, "y": self.y}
        self.x += width
        self.row_height = max(self.row_height, height)
        return pos

    def _newline(self) -> None:
        self.y += self.row_height
        self.x = 0
        self.row_height = 0


def render(dashboard: Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    layout = _Layout()
    panels: list[dict[str, Any]] = []
    next_id = 1
    for row in dashboard.rows:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": layout.row(),
                "panels": [],
            }
        )
        next_id += 1
        for panel in row.panels:
            if not 1 <= panel.width <= GRID_WIDTH:
                raise ValueError(f"panel {panel.title!r} width {panel.width} is not 1..24")
            entry: dict[str, Any] = {
                "id": next_id,
                "type": panel.kind,
                "title": panel.title,
                "description": panel.description,
                "datasource": DATASOURCE,
                "gridPos": layout.place(panel.width, panel.height),
                "targets": [
                    _target(query, chr(ord("A") + index))
                    for index, query in enumerate(panel.queries)
                ],
                "fieldConfig": _field_config(panel),
                "options": _options(panel),
            }
            if panel.transformations:
                entry["transformations"] = list(panel.transformations)
            panels.append(entry)
            next_id += 1
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                },
                {
                    "datasource": DATASOURCE,
                    "enable": True,
                    "expr": f'ALERTS{{{JOB}, alertstate="firing"}}',
                    "iconColor": "red",
                    "name": "torshmon alerts",
                    "step": "15s",
                    "titleFormat": "{{alertname}}",
                    "textFormat": "rank {{rank}}",
                    "useValueForTime": False,
                },
            ]
        },
        "description": dashboard.description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [
            {
                "title": "torshmon",
                "type": "dashboards",
                "tags": [TAG],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "panels": panels,
        "refresh": "10s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": [TAG, *dashboard.tags],
        "templating": {"list": variables(dashboard.extra_variables)},
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": dashboard.title,
        "uid": dashboard.uid,
        "version": 1,
        "weekStart": "",
    }


def dump(model: dict[str, Any]) -> str:
    return json.dumps(model, indent=2, ensure_ascii=False) + "\n"


def catalogued(name: str) -> bool:
    """Whether a sample name is one of the catalogue's metrics (or a histogram's series)."""
    if name in METRICS:
        return True
    base, _, suffix = name.rpartition("_")
    spec = METRICS.get(base)
    return spec is not None and spec.kind == "histogram" and suffix in ("bucket", "sum", "count")


def check_metrics(model: Any, where: str) -> None:
    """ValueError naming the dashboard if a query names a metric torshmon does not export."""
    if isinstance(model, dict):
        for value in model.values():
            check_metrics(value, where)
    elif isinstance(model, list):
        for value in model:
            check_metrics(value, where)
    elif isinstance(model, str):
        unknown = sorted(n for n in METRIC_NAME.findall(model) if not catalogued(n))
        if unknown:
            raise ValueError(f"{where}: {', '.join(unknown)} not in torshmon.catalogue.metrics")


def files() -> dict[str, str]:
    """File name to JSON text, for every dashboard; ValueError if a query names an
    unknown metric."""
    out = {}
    for dashboard in (factory() for factory in DASHBOARDS):
        model = render(dashboard)
        check_metrics(model, dashboard.filename)
        out[dashboard.filename] = dump(model)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    parser.add_argument("--out", type=Path, default=HERE, help="folder (this one)")
    args = parser.parse_args(argv)
    stale = []
    for name, text in files().items():
        path = args.out / name
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python dashboards/build.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
