"""Every metric torshmon exports: name, type, unit, HELP text and labels, per daemon.

The agent (node-level ``/metrics``) and the aggregator (job-level ``/metrics``)
build their families from these specs; the dashboards, the rule export and the
docs (``docs/metrics.md``) read them too. A name both daemons export has one spec
and one HELP text; its labels are given per daemon, since the aggregator may
export a job-wide value (``ddp_bucket_cap_bytes``) where the agent has one per
rank. Prometheus drops from the agent's scrape what the aggregator also exports
(``deploy/prometheus.yml``).

Names follow Prometheus conventions: prefix ``torshmon_``, base units
(``_seconds``, ``_bytes``, ``_ratio`` in 0..1), ``_total`` for counters. Pure and
torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal, TypeAlias

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

__all__ = [
    "EXPORTERS",
    "METRICS",
    "PREFIX",
    "Exporter",
    "Kind",
    "MetricSpec",
    "exported_by",
]

Kind: TypeAlias = Literal["gauge", "counter", "histogram"]
Exporter: TypeAlias = Literal["agent", "aggregator"]

PREFIX: Final = "torshmon_"
EXPORTERS: Final[tuple[Exporter, ...]] = ("agent", "aggregator")
#: Units a name may end with (before ``_total``), longest first.
_UNITS: Final = (
    "bytes_per_second",
    "samples_per_second",
    "seconds",
    "bytes",
    "ratio",
)
_NAME: Final = re.compile(r"^torshmon_[a-z0-9_]+$")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric. ``name`` is the sample name (a counter's ends in ``_total``).

    ``agent`` and ``aggregator`` are the label names each daemon exports it with,
    None where that daemon does not export it. ``unit`` is the base unit the name
    ends with ("" for counts, levels and scores). ValueError on a name against
    the conventions.
    """

    name: str
    kind: Kind
    help: str
    agent: tuple[str, ...] | None = None
    aggregator: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"metric name {self.name!r} must match {_NAME.pattern}")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name!r}: only counters end in _total")
        if self.agent is None and self.aggregator is None:
            raise ValueError(f"metric {self.name!r}: no daemon exports it")

    @property
    def unit(self) -> str:
        """The base unit the name ends with (``seconds``, ``bytes``...), "" if none."""
        bare = self.name.removesuffix("_total")
        return next((unit for unit in _UNITS if bare.endswith(f"_{unit}")), "")

    @property
    def family_name(self) -> str:
        """The name prometheus-client's families and instruments take (no ``_total``)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    def labels(self, exporter: Exporter) -> tuple[str, ...]:
        """The label names ``exporter`` uses; ValueError if it does not export this metric."""
        labels = self.agent if exporter == "agent" else self.aggregator
        if labels is None:
            raise ValueError(f"the {exporter} does not export {self.name}")
        return labels

    def gauge(self, exporter: Exporter) -> GaugeMetricFamily:
        """An empty gauge family of this metric, labelled as ``exporter`` exports it."""
        self._expect("gauge")
        return GaugeMetricFamily(self.name, self.help, labels=self.labels(exporter))

    def counter(self, exporter: Exporter) -> CounterMetricFamily:
        """An empty counter family (prometheus-client adds ``_total`` back on exposition)."""
        self._expect("counter")
        return CounterMetricFamily(self.family_name, self.help, labels=self.labels(exporter))

    def histogram(self, exporter: Exporter) -> HistogramMetricFamily:
        """An empty histogram family of this metric, labelled as ``exporter`` exports it."""
        self._expect("histogram")
        return HistogramMetricFamily(self.name, self.help, labels=self.labels(exporter))

    def _expect(self, kind: Kind) -> None:
        if self.kind != kind:
            raise TypeError(f"{self.name} is a {self.kind}, not a {kind}")


def _gauge(
    name: str,
    help: str,
    *,
    agent: Sequence[str] | None = None,
    aggregator: Sequence[str] | None = None,
) -> MetricSpec:
    return _spec("gauge", name, help, agent, aggregator)


def _counter(
    name: str,
    help: str,
    *,
    agent: Sequence[str] | None = None,
    aggregator: Sequence[str] | None = None,
) -> MetricSpec:
    return _spec("counter", name, help, agent, aggregator)


def _histogram(
    name: str,
    help: str,
    *,
    agent: Sequence[str] | None = None,
    aggregator: Sequence[str] | None = None,
) -> MetricSpec:
    return _spec("histogram", name, help, agent, aggregator)


def _spec(
    kind: Kind,
    name: str,
    help: str,
    agent: Sequence[str] | None,
    aggregator: Sequence[str] | None,
) -> MetricSpec:
    return MetricSpec(
        PREFIX + name,
        kind,
        help,
        None if agent is None else tuple(agent),
        None if aggregator is None else tuple(aggregator),
    )


_NODE: Final = ("node",)
_GPU: Final = ("node", "gpu")
_RANK: Final = ("job", "rank")
_COLLECTIVE: Final = ("job", "rank", "op", "pg")
_CODEC: Final = ("job", "rank", "codec")

# -- nodes ----------------------------------------------------------------------------------

CPU_UTILIZATION_RATIO: Final = _gauge(
    "cpu_utilization_ratio", "CPU busy time over all cores, 0..1.", agent=_NODE, aggregator=_NODE
)
MEMORY_UTILIZATION_RATIO: Final = _gauge(
    "memory_utilization_ratio", "Used over total memory, 0..1.", agent=_NODE, aggregator=_NODE
)
MEMORY_USED_BYTES: Final = _gauge("memory_used_bytes", "Memory in use.", agent=_NODE)
IO_WAIT_TIME_RATIO: Final = _gauge(
    "io_wait_time_ratio",
    "CPU time waiting for I/O, 0..1 (0 off Linux).",
    agent=_NODE,
    aggregator=_NODE,
)
NETWORK_RECEIVE_BYTES_TOTAL: Final = _counter(
    "network_receive_bytes_total", "Bytes received on all interfaces.", agent=_NODE
)
NETWORK_TRANSMIT_BYTES_TOTAL: Final = _counter(
    "network_transmit_bytes_total", "Bytes sent on all interfaces.", agent=_NODE
)
DISK_READ_BYTES_TOTAL: Final = _counter(
    "disk_read_bytes_total", "Bytes read from all disks.", agent=_NODE
)
DISK_WRITTEN_BYTES_TOTAL: Final = _counter(
    "disk_written_bytes_total", "Bytes written to all disks.", agent=_NODE
)
GPU_UTILIZATION_RATIO: Final = _gauge(
    "gpu_utilization_ratio", "GPU busy time (NVML), 0..1.", agent=_GPU, aggregator=_GPU
)
GPU_MEMORY_USED_BYTES: Final = _gauge(
    "gpu_memory_used_bytes", "GPU memory in use (NVML).", agent=_GPU
)
GPU_MEMORY_TOTAL_BYTES: Final = _gauge(
    "gpu_memory_total_bytes", "GPU memory in total (NVML).", agent=_GPU
)
PROCESS_RESIDENT_MEMORY_BYTES: Final = _gauge(
    "process_resident_memory_bytes",
    "Resident memory of a training process.",
    agent=("job", "rank", "node"),
)
RANK_MEMORY_RSS_BYTES: Final = _gauge(
    "rank_memory_rss_bytes",
    "Resident memory of the rank's process",
    aggregator=("job", "node", "rank"),
)

# -- ranks ----------------------------------------------------------------------------------

STEP_DURATION_SECONDS: Final = _histogram(
    "step_duration_seconds", "Training step wall time.", agent=_RANK, aggregator=_RANK
)
STEPS_TOTAL: Final = _counter(
    "steps_total", "Training steps reported.", agent=_RANK, aggregator=_RANK
)
PROBE_URGENT_STEPS_TOTAL: Final = _counter(
    "probe_urgent_steps_total",
    "Steps the probe sent at once through its fast lane (out of line with the rank's "
    "recent steps) rather than with the next batch.",
    agent=_RANK,
)
PROBE_DROPPED_RECORDS_TOTAL: Final = _counter(
    "probe_dropped_records_total",
    "Step records the probe dropped since it attached (no or slow agent).",
    agent=_RANK,
    aggregator=_RANK,
)
NONFINITE_LOSS_TOTAL: Final = _counter(
    "nonfinite_loss_total", "Steps with a NaN or infinite loss", aggregator=_RANK
)
INFLIGHT_OLDEST_AGE_SECONDS: Final = _gauge(
    "inflight_oldest_age_seconds",
    "Age of the oldest collective the rank is inside (0 when none).",
    agent=_RANK,
)
COMMUNICATION_TIME_RATIO: Final = _gauge(
    "communication_time_ratio",
    "Share of the latest step spent waiting for communication, 0..1.",
    agent=_RANK,
    aggregator=_RANK,
)
TRAINING_EFFICIENCY_RATIO: Final = _gauge(
    "training_efficiency_ratio",
    "Compute time over step time of the latest step, 0..1.",
    agent=_RANK,
    aggregator=_RANK,
)
THROUGHPUT_SAMPLES_PER_SECOND: Final = _gauge(
    "throughput_samples_per_second",
    "Samples per second of the latest step.",
    agent=_RANK,
    aggregator=_RANK,
)
COMPUTE_SECONDS: Final = _gauge(
    "compute_seconds", "Compute time of the last step", aggregator=_RANK
)
COMM_WAIT_SECONDS: Final = _gauge(
    "comm_wait_seconds", "Communication wait of the last step", aggregator=_RANK
)
LOSS: Final = _gauge(
    "loss",
    "Training loss of the latest step (the agent: the latest finite one; the aggregator: "
    "NaN when it was not finite).",
    agent=_RANK,
    aggregator=_RANK,
)
CONFIG_VERSION: Final = _gauge(
    "config_version",
    "Communication config version the rank runs.",
    agent=_RANK,
    aggregator=_RANK,
)
DDP_BUCKET_CAP_BYTES: Final = _gauge(
    "ddp_bucket_cap_bytes",
    "DDP gradient bucket cap in force.",
    agent=_RANK,
    aggregator=("job",),
)
CODEC_INFO: Final = _gauge(
    "codec_info", "Gradient codec in force (value 1)", aggregator=("job", "codec")
)
COMPRESSION_RATIO: Final = _gauge(
    "compression_ratio",
    "Wire bytes over gradient bytes per codec in the latest step (1 uncompressed).",
    agent=_CODEC,
    aggregator=_CODEC,
)
COMPRESSION_RELATIVE_ERROR: Final = _gauge(
    "compression_relative_error",
    "Sampled relative error of the gradient codec",
    aggregator=_CODEC,
)
COMPRESSION_WIRE_BYTES_TOTAL: Final = _counter(
    "compression_wire_bytes_total",
    "Bytes the comm hook sent for gradients",
    aggregator=_CODEC,
)

# -- collectives ----------------------------------------------------------------------------

COLLECTIVE_DURATION_SECONDS: Final = _histogram(
    "collective_duration_seconds",
    "Duration of each collective call.",
    agent=_COLLECTIVE,
    aggregator=_COLLECTIVE,
)
COLLECTIVE_BYTES_TOTAL: Final = _counter(
    "collective_bytes_total", "Collective message bytes (nccl-tests size).", agent=_COLLECTIVE
)
COLLECTIVE_BUSBW_BYTES_PER_SECOND: Final = _gauge(
    "collective_busbw_bytes_per_second",
    "Bus bandwidth (nccl-tests) of the latest step with this collective.",
    agent=_COLLECTIVE,
    aggregator=_COLLECTIVE,
)
LABEL_VALUES_FOLDED_TOTAL: Final = _counter(
    "label_values_folded_total",
    "Op, pg and codec label values a job's probes named past its cap of distinct "
    "values, kept under 'other' instead.",
    agent=("job", "label"),
    aggregator=("job", "label"),
)

# -- detectors and alerts -------------------------------------------------------------------

AGENT_SILENCE_SECONDS: Final = _gauge(
    "agent_silence_seconds",
    "Seconds since the node's agent last reached the aggregator (it sends at least once "
    "a second), as of the last rule evaluation; behind the Agent Down alert",
    aggregator=_NODE,
)

ANOMALY_ACTIVE: Final = _gauge(
    "anomaly_active",
    "1 while a rolling z-score anomaly is active on the series",
    aggregator=("job", "rank", "metric"),
)
ANOMALY_ZSCORE: Final = _gauge(
    "anomaly_zscore", "z-score of the active anomaly", aggregator=("job", "rank", "metric")
)
STRAGGLER_ACTIVE: Final = _gauge(
    "straggler_active", "1 while the rank is a straggler", aggregator=_RANK
)
STRAGGLER_SCORE: Final = _gauge("straggler_score", "Straggler score of the rank", aggregator=_RANK)
HUNG_COLLECTIVE_AGE_SECONDS: Final = _gauge(
    "hung_collective_age_seconds",
    "Age of a collective the rank never joined while its peers wait",
    aggregator=_COLLECTIVE,
)
SLOW_LINK_BANDWIDTH_BYTES_PER_SECOND: Final = _gauge(
    "slow_link_bandwidth_bytes_per_second",
    "While a link check finds the rank's link slow: the rank's best pair bandwidth "
    "(rank is 'A-B' at world size 2, where only the pair can be named)",
    aggregator=_RANK,
)
LINK_BANDWIDTH_BYTES_PER_SECOND: Final = _gauge(
    "link_bandwidth_bytes_per_second",
    "Best pair bandwidth of the rank in the job's latest link check",
    aggregator=_RANK,
)
ALERTS: Final = _gauge(
    "alerts",
    "Alerts pending or firing, by rule and severity",
    aggregator=("alertname", "severity", "state"),
)

# -- the autotuner --------------------------------------------------------------------------

TUNER_TRIALS_TOTAL: Final = _counter(
    "tuner_trials_total", "Tuning trials decided, by decision", aggregator=("job", "decision")
)
TUNER_BEST_SCORE: Final = _gauge(
    "tuner_best_score",
    "Best throughput of the job's tuning session (incumbent), samples per second",
    aggregator=("job",),
)
TUNER_STATE: Final = _gauge(
    "tuner_state", "1 for the tuning session's current phase", aggregator=("job", "state")
)

# -- the daemons themselves -----------------------------------------------------------------

INGEST_BATCHES_TOTAL: Final = _counter(
    "ingest_batches_total", "Ingest requests by outcome", aggregator=("outcome",)
)
INGEST_RECORDS_TOTAL: Final = _counter(
    "ingest_records_total", "Agent spool records stored", aggregator=()
)
INGEST_DUPLICATES_TOTAL: Final = _counter(
    "ingest_duplicates_total", "Records or probe batches seen before", aggregator=()
)
INGEST_SAMPLES_TOTAL: Final = _counter(
    "ingest_samples_total", "Measurements stored (one number each)", aggregator=()
)
INGEST_DURATION_SECONDS: Final = _histogram(
    "ingest_duration_seconds",
    "Time to store one ingest request (including its wait for the writer)",
    aggregator=(),
)
NOTIFICATIONS_SENT_TOTAL: Final = _counter(
    "notifications_sent_total",
    "Notification messages delivered, per target",
    aggregator=("target",),
)
NOTIFICATIONS_FAILED_TOTAL: Final = _counter(
    "notifications_failed_total",
    "Notification messages given up on, per target",
    aggregator=("target",),
)
NOTIFICATIONS_RETRIES_TOTAL: Final = _counter(
    "notifications_retries_total",
    "Notification delivery retries, per target",
    aggregator=("target",),
)
NOTIFICATIONS_DROPPED_TOTAL: Final = _counter(
    "notifications_dropped_total",
    "Alerts dropped before delivery (queue full or shutdown), per target",
    aggregator=("target",),
)
NOTIFICATIONS_DEDUPLICATED_TOTAL: Final = _counter(
    "notifications_deduplicated_total",
    "Alerts not sent again because they were already delivered",
    aggregator=("target",),
)
NOTIFICATIONS_QUEUED: Final = _gauge(
    "notifications_queued", "Alerts waiting to be sent, per target", aggregator=("target",)
)
AGENT_FRAMES_REJECTED_TOTAL: Final = _counter(
    "agent_frames_rejected_total", "Probe frames the agent rejected.", agent=_NODE
)
AGENT_SPOOL_DROPPED_RECORDS_TOTAL: Final = _counter(
    "agent_spool_dropped_records_total",
    "Spool records dropped because the spool was full.",
    agent=_NODE,
)
AGENT_FORWARD_FAILURES_TOTAL: Final = _counter(
    "agent_forward_failures_total", "Failed forwards to the aggregator.", agent=_NODE
)
AGENT_PROBE_CONNECTIONS: Final = _gauge(
    "agent_probe_connections", "Probes connected to the agent.", agent=_NODE
)
AGENT_SPOOL_RECORDS: Final = _gauge(
    "agent_spool_records", "Records waiting in the spool.", agent=_NODE
)
AGENT_SPOOL_BYTES: Final = _gauge("agent_spool_bytes", "Bytes of the spool on disk.", agent=_NODE)
AGENT_FORWARD_UP: Final = _gauge(
    "agent_forward_up", "1 when the last forward to the aggregator succeeded.", agent=_NODE
)


def _table() -> Mapping[str, MetricSpec]:
    specs = [value for value in globals().values() if isinstance(value, MetricSpec)]
    table = {spec.name: spec for spec in specs}
    if len(table) != len(specs):  # pragma: no cover - a spec defined twice under two names
        raise ValueError("two metric specs share a name")
    return MappingProxyType(table)


#: Every metric, by name, in the order defined above.
METRICS: Final = _table()


def exported_by(exporter: Exporter) -> tuple[MetricSpec, ...]:
    """The metrics ``exporter`` exports, in catalogue order."""
    return tuple(
        spec
        for spec in METRICS.values()
        if (spec.agent if exporter == "agent" else spec.aggregator) is not None
    )
