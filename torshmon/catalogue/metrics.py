"""Every metric torshmon exports: name, type, unit, HELP text, labels and exporter.

Each series has exactly one exporter. The agent (node-level ``/metrics``) exports
facts about its node and about the training processes on it (CPU, memory,
network, disk, GPUs; each rank's RSS, CPU time and ``rank_info``); the aggregator
(job-level ``/metrics``) exports every training series (steps, step time, loss,
collectives, compression), the detectors' findings, the tuner and its own
health. Scraped together with no relabelling, a sum over a label counts every
series once. The one exemption is ``torshmon_build_info``: each daemon describes
itself, told apart by the ``daemon`` label.

Both daemons build their families from these specs; the dashboards, the rule
export and the docs (``docs/metrics.md``) read them too. Names follow Prometheus
conventions: prefix ``torshmon_``, base units (``_seconds``, ``_bytes``,
``_ratio`` in 0..1), ``_total`` for counters. Pure and torch-free.
"""

from __future__ import annotations

import platform
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

from torshmon.version import __version__

__all__ = [
    "EACH",
    "EXPORTERS",
    "METRICS",
    "PREFIX",
    "Exporter",
    "Kind",
    "MetricSpec",
    "Owner",
    "build_info",
    "exported_by",
]

Kind: TypeAlias = Literal["gauge", "counter", "histogram"]
Exporter: TypeAlias = Literal["agent", "aggregator"]
#: Who exports a metric: one daemon, or ``each`` for a series every daemon exports
#: about itself (labelled ``daemon``), the one exemption from one exporter per series.
Owner: TypeAlias = Literal["agent", "aggregator", "each"]

PREFIX: Final = "torshmon_"
EXPORTERS: Final[tuple[Exporter, ...]] = ("agent", "aggregator")
EACH: Final = "each"
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

    ``exporter`` is the one daemon that exports it (``each``: every daemon, about
    itself, with a ``daemon`` label). ``labels`` are always there; ``optional_labels``
    only where a setting asks for them (the collective histogram's ``rank``).
    ``unit`` is the base unit the name ends with ("" for counts, levels and
    scores). ValueError on a name or owner against the conventions.
    """

    name: str
    kind: Kind
    help: str
    exporter: Owner
    labels: tuple[str, ...]
    optional_labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"metric name {self.name!r} must match {_NAME.pattern}")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name!r}: only counters end in _total")
        if self.exporter not in (*EXPORTERS, EACH):
            raise ValueError(
                f"metric {self.name!r}: exporter must be agent, aggregator or each, "
                f"got {self.exporter!r}"
            )
        if self.exporter == EACH and not (
            self.kind == "gauge" and self.name.endswith("_info") and "daemon" in self.labels
        ):
            raise ValueError(
                f"metric {self.name!r}: only an _info gauge with a daemon label may be "
                "exported by each daemon"
            )

    @property
    def unit(self) -> str:
        """The base unit the name ends with (``seconds``, ``bytes``...), "" if none."""
        bare = self.name.removesuffix("_total")
        return next((unit for unit in _UNITS if bare.endswith(f"_{unit}")), "")

    @property
    def family_name(self) -> str:
        """The name prometheus-client's families and instruments take (no ``_total``)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    def exported_by(self, exporter: Exporter) -> bool:
        """Whether ``exporter`` exports this metric."""
        return self.exporter in (exporter, EACH)

    def label_names(self, *, optional: bool = False) -> tuple[str, ...]:
        """The labels, with the optional ones when ``optional``."""
        return (*self.labels, *self.optional_labels) if optional else self.labels

    def gauge(self) -> GaugeMetricFamily:
        """An empty gauge family of this metric."""
        self._expect("gauge")
        return GaugeMetricFamily(self.name, self.help, labels=self.labels)

    def counter(self, *, optional: bool = False) -> CounterMetricFamily:
        """An empty counter family (prometheus-client adds ``_total`` back on exposition)."""
        self._expect("counter")
        return CounterMetricFamily(
            self.family_name, self.help, labels=self.label_names(optional=optional)
        )

    def histogram(self, *, optional: bool = False) -> HistogramMetricFamily:
        """An empty histogram family; with ``optional`` it takes the optional labels too."""
        self._expect("histogram")
        return HistogramMetricFamily(
            self.name, self.help, labels=self.label_names(optional=optional)
        )

    def _expect(self, kind: Kind) -> None:
        if self.kind != kind:
            raise TypeError(f"{self.name} is a {self.kind}, not a {kind}")


def _spec(
    kind: Kind,
    exporter: Owner,
    name: str,
    help: str,
    labels: Sequence[str],
    optional: Sequence[str] = (),
) -> MetricSpec:
    return MetricSpec(PREFIX + name, kind, help, exporter, tuple(labels), tuple(optional))


def _agent_gauge(name: str, help: str, labels: Sequence[str] = ("node",)) -> MetricSpec:
    return _spec("gauge", "agent", name, help, labels)


def _agent_counter(name: str, help: str, labels: Sequence[str] = ("node",)) -> MetricSpec:
    return _spec("counter", "agent", name, help, labels)


def _gauge(name: str, help: str, labels: Sequence[str]) -> MetricSpec:
    return _spec("gauge", "aggregator", name, help, labels)


def _counter(
    name: str, help: str, labels: Sequence[str], optional: Sequence[str] = ()
) -> MetricSpec:
    return _spec("counter", "aggregator", name, help, labels, optional)


def _histogram(
    name: str, help: str, labels: Sequence[str], optional: Sequence[str] = ()
) -> MetricSpec:
    return _spec("histogram", "aggregator", name, help, labels, optional)


_NODE: Final = ("node",)
_GPU: Final = ("node", "gpu")
_INTERFACE: Final = ("node", "interface")
_PROCESS: Final = ("job", "rank", "node")
#: A job's live series: its name and its run (the launch's id; empty where the probes
#: sent none). Only live runs have series, two at once where a relaunch runs beside an
#: older launch; a run's go when its ranks fall silent, as a finished job's do.
_JOB: Final = ("job", "run")
_RANK: Final = (*_JOB, "rank")
_COLLECTIVE: Final = (*_JOB, "rank", "op", "pg")
_CODEC: Final = (*_JOB, "rank", "codec")
_LAST_STEP: Final = (
    " A last-step gauge, kept for threshold rules and current values; for the share over "
    "a window divide rates of the _seconds_total counters."
)

# -- nodes (the agent) ----------------------------------------------------------------------

CPU_UTILIZATION_RATIO: Final = _agent_gauge(
    "cpu_utilization_ratio", "CPU busy time over all cores, 0..1."
)
MEMORY_UTILIZATION_RATIO: Final = _agent_gauge(
    "memory_utilization_ratio", "Used over total memory, 0..1."
)
MEMORY_USED_BYTES: Final = _agent_gauge("memory_used_bytes", "Memory in use.")
NODE_CPU_IOWAIT_RATIO: Final = _agent_gauge(
    "node_cpu_iowait_ratio",
    "The node's CPU time idle waiting for I/O (Linux iowait), 0..1 (0 off Linux); "
    "not a job's data-loading time (its steps' input_wait_s).",
)
NETWORK_RECEIVE_BYTES_TOTAL: Final = _agent_counter(
    "network_receive_bytes_total",
    "Bytes received, per network interface (loopback interfaces left out).",
    _INTERFACE,
)
NETWORK_TRANSMIT_BYTES_TOTAL: Final = _agent_counter(
    "network_transmit_bytes_total",
    "Bytes sent, per network interface (loopback interfaces left out).",
    _INTERFACE,
)
DISK_READ_BYTES_TOTAL: Final = _agent_counter("disk_read_bytes_total", "Bytes read from all disks.")
DISK_WRITTEN_BYTES_TOTAL: Final = _agent_counter(
    "disk_written_bytes_total", "Bytes written to all disks."
)
GPU_UTILIZATION_RATIO: Final = _agent_gauge(
    "gpu_utilization_ratio", "GPU busy time (NVML), 0..1.", _GPU
)
GPU_MEMORY_USED_BYTES: Final = _agent_gauge(
    "gpu_memory_used_bytes", "GPU memory in use (NVML).", _GPU
)
GPU_MEMORY_TOTAL_BYTES: Final = _agent_gauge(
    "gpu_memory_total_bytes", "GPU memory in total (NVML).", _GPU
)
GPU_MEMORY_UTILIZATION_RATIO: Final = _agent_gauge(
    "gpu_memory_utilization_ratio", "GPU memory in use over total (NVML), 0..1.", _GPU
)
GPU_POWER_WATTS: Final = _agent_gauge(
    "gpu_power_watts", "Board power draw (NVML); absent where NVML does not report it.", _GPU
)
GPU_TEMPERATURE_CELSIUS: Final = _agent_gauge(
    "gpu_temperature_celsius", "GPU core temperature (NVML), degrees Celsius.", _GPU
)
GPU_THROTTLE_ACTIVE: Final = _agent_gauge(
    "gpu_throttle_active",
    "1 while NVML reports this clock event (throttle) reason on the GPU, else 0: "
    "sw_power_cap, hw_slowdown, hw_thermal_slowdown, hw_power_brake, sw_thermal_slowdown, "
    "sync_boost, applications_clocks, display_clocks, gpu_idle.",
    ("node", "gpu", "reason"),
)
GPU_ECC_UNCORRECTED_ERRORS_TOTAL: Final = _agent_counter(
    "gpu_ecc_uncorrected_errors_total",
    "Uncorrected ECC memory errors since the driver loaded (NVML, volatile); absent without ECC.",
    _GPU,
)
GPU_XID_ERRORS_TOTAL: Final = _agent_counter(
    "gpu_xid_errors_total",
    "Xid errors (NVML critical error events) the agent has seen since it started.",
    _GPU,
)

# -- the training processes on a node (the agent) -------------------------------------------

RANK_INFO: Final = _agent_gauge(
    "rank_info",
    "1 for every training process connected to the agent: which node, local rank, "
    "process id and GPU (NVML index and UUID, '' when unknown) runs the job's rank; join "
    "on job and rank, or on node and gpu or gpu_uuid with node and GPU exporters (DCGM).",
    ("job", "rank", "node", "local_rank", "pid", "gpu", "gpu_uuid"),
)
RANK_MEMORY_RSS_BYTES: Final = _agent_gauge(
    "rank_memory_rss_bytes", "Resident memory of the rank's process.", _PROCESS
)
RANK_CPU_SECONDS_TOTAL: Final = _agent_counter(
    "rank_cpu_seconds_total", "CPU time (user and system) of the rank's process.", _PROCESS
)

# -- ranks (the aggregator) -----------------------------------------------------------------

STEP_DURATION_SECONDS: Final = _histogram(
    "step_duration_seconds", "Training step wall time.", _RANK
)
STEPS_TOTAL: Final = _counter("steps_total", "Training steps reported.", _RANK)
STEP_SECONDS_TOTAL: Final = _counter(
    "step_seconds_total", "Wall time of every step reported (step time summed).", _RANK
)
COMM_WAIT_SECONDS_TOTAL: Final = _counter(
    "comm_wait_seconds_total",
    "Time steps waited for communication; over torshmon_step_seconds_total's rate, the "
    "share of time spent waiting.",
    _RANK,
)
COMPUTE_SECONDS_TOTAL: Final = _counter(
    "compute_seconds_total",
    "Compute time of every step (step time minus communication wait), summed.",
    _RANK,
)
INPUT_WAIT_SECONDS_TOTAL: Final = _counter(
    "input_wait_seconds_total",
    "Time the rank waited for its next batch before each step (the data loader), summed "
    "over the steps whose probe measures it; over the rates of this and "
    "torshmon_step_seconds_total summed, the share of time spent waiting for input.",
    _RANK,
)
INPUT_WAIT_TIME_RATIO: Final = _gauge(
    "input_wait_time_ratio",
    "Input wait before the latest step over that step's period (input wait plus step "
    "time), 0..1." + _LAST_STEP,
    _RANK,
)
PROBE_URGENT_STEPS_TOTAL: Final = _counter(
    "probe_urgent_steps_total",
    "Steps the probe sent at once through its fast lane (out of line with the rank's "
    "recent steps) rather than with the next batch.",
    _RANK,
)
PROBE_DROPPED_RECORDS_TOTAL: Final = _counter(
    "probe_dropped_records_total",
    "Step records the probe dropped since it attached (no or slow agent).",
    _RANK,
)
NONFINITE_LOSS_TOTAL: Final = _counter(
    "nonfinite_loss_total", "Steps with a NaN or infinite loss", _RANK
)
COLLECTIVE_FAILURES_TOTAL: Final = _counter(
    "collective_failures_total",
    "Collectives that raised instead of completing (a timeout, a peer gone, a NCCL "
    "error), per op and process group, counted by the probe since attach.",
    _COLLECTIVE,
)
INFLIGHT_OLDEST_AGE_SECONDS: Final = _gauge(
    "inflight_oldest_age_seconds",
    "Age of the oldest collective the rank was inside at its latest report (0 when none).",
    _RANK,
)
COMMUNICATION_TIME_RATIO: Final = _gauge(
    "communication_time_ratio",
    "Share of the latest step spent waiting for communication, 0..1." + _LAST_STEP,
    _RANK,
)
TRAINING_EFFICIENCY_RATIO: Final = _gauge(
    "training_efficiency_ratio",
    "Compute time over the latest step's period (step time plus the input wait before "
    "it), 0..1." + _LAST_STEP,
    _RANK,
)
THROUGHPUT_SAMPLES_PER_SECOND: Final = _gauge(
    "throughput_samples_per_second",
    "Samples per second of the rank's latest step (per rank; sum by job for the job's).",
    _RANK,
)
RANK_GPU_MEMORY_ALLOCATED_BYTES: Final = _gauge(
    "rank_gpu_memory_allocated_bytes",
    "CUDA memory the rank's tensors hold at the end of its latest step "
    "(torch.cuda.memory_allocated); absent off CUDA.",
    _RANK,
)
RANK_GPU_MEMORY_RESERVED_BYTES: Final = _gauge(
    "rank_gpu_memory_reserved_bytes",
    "CUDA memory the rank's caching allocator holds (torch.cuda.memory_reserved); absent off CUDA.",
    _RANK,
)
RANK_GPU_MEMORY_PEAK_BYTES: Final = _gauge(
    "rank_gpu_memory_peak_bytes",
    "Peak CUDA memory allocated by the rank since it started or last reset its peak "
    "(torch.cuda.max_memory_allocated); absent off CUDA.",
    _RANK,
)
LOSS: Final = _gauge(
    "loss", "Training loss of the latest step (NaN when it was not finite).", _RANK
)
CONFIG_VERSION: Final = _gauge(
    "config_version", "Communication config version the rank runs.", _RANK
)
DDP_BUCKET_CAP_BYTES: Final = _gauge(
    "ddp_bucket_cap_bytes", "DDP gradient bucket cap in force.", _JOB
)
CODEC_INFO: Final = _gauge("codec_info", "Gradient codec in force (value 1)", (*_JOB, "codec"))
COMPRESSION_RATIO: Final = _gauge(
    "compression_ratio",
    "Wire bytes over gradient bytes per codec in the latest step (1 uncompressed).",
    _CODEC,
)
COMPRESSION_RELATIVE_ERROR: Final = _gauge(
    "compression_relative_error", "Sampled relative error of the gradient codec", _CODEC
)
COMPRESSION_WIRE_BYTES_TOTAL: Final = _counter(
    "compression_wire_bytes_total", "Bytes the comm hook sent for gradients", _CODEC
)

# -- collectives (the aggregator) -----------------------------------------------------------

COLLECTIVE_DURATION_SECONDS: Final = _histogram(
    "collective_duration_seconds",
    "Duration of each collective call, over the job's ranks (per rank with the "
    "aggregator's collective_metrics_per_rank setting).",
    (*_JOB, "op", "pg"),
    optional=("rank",),
)
COLLECTIVE_BYTES_TOTAL: Final = _counter(
    "collective_bytes_total",
    "Collective message bytes (nccl-tests size), over the job's ranks (per rank with "
    "the aggregator's collective_metrics_per_rank setting).",
    (*_JOB, "op", "pg"),
    optional=("rank",),
)
COLLECTIVE_BUSBW_BYTES_PER_SECOND: Final = _gauge(
    "collective_busbw_bytes_per_second",
    "Bus bandwidth (nccl-tests) of the latest step with this collective.",
    _COLLECTIVE,
)
LABEL_VALUES_FOLDED_TOTAL: Final = _counter(
    "label_values_folded_total",
    "Op, pg and codec label values a job's probes named past its cap of distinct "
    "values, kept under 'other' instead.",
    ("job", "label"),
)

# -- detectors and alerts -------------------------------------------------------------------

AGENT_SILENCE_SECONDS: Final = _gauge(
    "agent_silence_seconds",
    "Seconds since the node's agent last reached the aggregator (it sends at least once "
    "a second), as of the last rule evaluation; behind the Agent Down alert",
    _NODE,
)

ANOMALY_ACTIVE: Final = _gauge(
    "anomaly_active",
    "1 while a rolling z-score anomaly is active on the series (rank is empty for the "
    "job's step time, judged once per job)",
    (*_JOB, "rank", "metric"),
)
ANOMALY_ZSCORE: Final = _gauge(
    "anomaly_zscore", "z-score of the active anomaly", (*_JOB, "rank", "metric")
)
ANOMALY_PAGING: Final = _gauge(
    "anomaly_paging",
    "1 while an active anomaly pages (its alert rule fires): a step-time rise once it "
    "has lasted zscore.step_page_steps steps; other metrics' anomalies from the start. "
    "torshmon_anomaly_active also counts the rises too short yet to page",
    (*_JOB, "rank", "metric"),
)
STRAGGLER_ACTIVE: Final = _gauge(
    "straggler_active",
    "1 while the rank is a straggler (shown on the pages: paging or not yet)",
    _RANK,
)
STRAGGLER_PAGING: Final = _gauge(
    "straggler_paging",
    "1 while the rank's straggler finding pages (its alert rule fires): the rank was slow "
    "in straggler.page_steps of its last straggler.page_window_steps steps",
    _RANK,
)
STRAGGLER_SCORE: Final = _gauge(
    "straggler_score",
    "While the rank is a straggler: its compute time over its peers' median at the same "
    "steps (median over the detector's window; 1.4 = 40 % slower)",
    _RANK,
)
BOTTLENECK_ACTIVE: Final = _gauge(
    "bottleneck_active",
    "1 while the job's bottleneck report has a finding of the category (communication, "
    "efficiency, input, memory, gpu_memory, gpu, network, straggler), as of the last "
    "rule evaluation",
    (*_JOB, "category"),
)
BOTTLENECK_EXPECTED_GAIN_RATIO: Final = _gauge(
    "bottleneck_expected_gain_ratio",
    "Estimated share of the step time the report's recommendation for the category would "
    "save, 0..1 (absent where it prevents a failure rather than saving time)",
    (*_JOB, "category"),
)
HUNG_COLLECTIVE_AGE_SECONDS: Final = _gauge(
    "hung_collective_age_seconds",
    "Age of a collective the rank never joined while its peers wait",
    _COLLECTIVE,
)
SLOW_LINK_BANDWIDTH_BYTES_PER_SECOND: Final = _gauge(
    "slow_link_bandwidth_bytes_per_second",
    "While a link check finds the rank's link slow: the rank's best pair bandwidth "
    "(rank is 'A-B' at world size 2, where only the pair can be named); when ranks "
    "share hosts, node names the slow node instead ('A-B' with two nodes) and rank is ''",
    (*_JOB, "rank", "node"),
)
LINK_BANDWIDTH_BYTES_PER_SECOND: Final = _gauge(
    "link_bandwidth_bytes_per_second",
    "Best pair bandwidth of the rank in the job's latest link check",
    _RANK,
)
NODE_LINK_BANDWIDTH_BYTES_PER_SECOND: Final = _gauge(
    "node_link_bandwidth_bytes_per_second",
    "Bandwidth between two nodes in the job's latest link check, when ranks share "
    "hosts; src_node = dst_node: the best pair within the node (another fabric)",
    (*_JOB, "src_node", "dst_node"),
)
ALERTS: Final = _gauge(
    "alerts",
    "Alerts pending or firing, by rule and severity",
    ("alertname", "severity", "state"),
)

# -- the autotuner --------------------------------------------------------------------------

TUNER_TRIALS_TOTAL: Final = _counter(
    "tuner_trials_total", "Tuning trials decided, by decision", ("job", "decision")
)
TUNER_BEST_SCORE: Final = _gauge(
    "tuner_best_score",
    "Best throughput of the job's tuning session (incumbent), samples/s per rank (rank 0's)",
    ("job",),
)
TUNER_STATE: Final = _gauge(
    "tuner_state", "1 for the tuning session's current phase", ("job", "state")
)

# -- the daemons themselves -----------------------------------------------------------------

INGEST_BATCHES_TOTAL: Final = _counter(
    "ingest_batches_total", "Ingest requests by outcome", ("outcome",)
)
INGEST_RECORDS_TOTAL: Final = _counter("ingest_records_total", "Agent spool records stored", ())
INGEST_DUPLICATES_TOTAL: Final = _counter(
    "ingest_duplicates_total", "Records or probe batches seen before", ()
)
INGEST_SAMPLES_TOTAL: Final = _counter(
    "ingest_samples_total", "Measurements stored (one number each)", ()
)
INGEST_DURATION_SECONDS: Final = _histogram(
    "ingest_duration_seconds",
    "Time to store one ingest request (including its wait for the writer)",
    (),
)
QUERIES_RUNNING: Final = _gauge(
    "queries_running", "History queries (POST /api/v1/query) running now", ()
)
QUERIES_REFUSED_TOTAL: Final = _counter(
    "queries_refused_total",
    "History queries refused at once (429): reason busy when query_max_running ran, "
    "client_busy when query_max_per_client of the same client's did",
    ("reason",),
)
HTTP_CONNECTIONS: Final = _gauge("http_connections", "Open HTTP connections to the aggregator", ())
HTTP_CONNECTIONS_REFUSED_TOTAL: Final = _counter(
    "http_connections_refused_total",
    "HTTP connections refused (503, closed) because http_max_connections were open",
    (),
)
HTTP_CLIENT_TIMEOUTS_TOTAL: Final = _counter(
    "http_client_timeouts_total",
    "Requests given up on because the client was too slow: phase headers (no whole "
    "request head within http_header_timeout_s: 408 or a closed socket) or body (the "
    "body not in within http_body_timeout_s: 408)",
    ("phase",),
)
NOTIFICATIONS_SENT_TOTAL: Final = _counter(
    "notifications_sent_total",
    "Notification messages delivered, per target",
    ("target",),
)
NOTIFICATIONS_FAILED_TOTAL: Final = _counter(
    "notifications_failed_total",
    "Notification messages given up on, per target",
    ("target",),
)
NOTIFICATIONS_RETRIES_TOTAL: Final = _counter(
    "notifications_retries_total",
    "Notification delivery retries, per target",
    ("target",),
)
NOTIFICATIONS_DROPPED_TOTAL: Final = _counter(
    "notifications_dropped_total",
    "Alerts dropped before delivery (queue full or shutdown), per target",
    ("target",),
)
NOTIFICATIONS_DEDUPLICATED_TOTAL: Final = _counter(
    "notifications_deduplicated_total",
    "Alerts not sent again because they were already delivered",
    ("target",),
)
ALERTS_SILENCED_TOTAL: Final = _counter(
    "alerts_silenced_total",
    "Alert notifications held back because a silence matched, per rule",
    ("alertname",),
)
NOTIFICATIONS_QUEUED: Final = _gauge(
    "notifications_queued", "Alerts waiting to be sent, per target", ("target",)
)
AGENT_FRAMES_REJECTED_TOTAL: Final = _agent_counter(
    "agent_frames_rejected_total", "Probe frames the agent rejected."
)
AGENT_SPOOL_DROPPED_RECORDS_TOTAL: Final = _agent_counter(
    "agent_spool_dropped_records_total",
    "Spool records dropped because the spool was full.",
)
AGENT_FORWARD_FAILURES_TOTAL: Final = _agent_counter(
    "agent_forward_failures_total", "Failed forwards to the aggregator."
)
AGENT_PROBE_CONNECTIONS: Final = _agent_gauge(
    "agent_probe_connections", "Probes connected to the agent."
)
AGENT_SPOOL_RECORDS: Final = _agent_gauge("agent_spool_records", "Records waiting in the spool.")
AGENT_SPOOL_BYTES: Final = _agent_gauge("agent_spool_bytes", "Bytes of the spool on disk.")
AGENT_FORWARD_UP: Final = _agent_gauge(
    "agent_forward_up", "1 when the last forward to the aggregator succeeded."
)


BUILD_INFO: Final = _spec(
    "gauge",
    EACH,
    "build_info",
    "1, labelled with the daemon (agent or aggregator) and the torshmon and Python "
    "versions it runs.",
    ("daemon", "version", "python", "implementation"),
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
    """The metrics ``exporter`` exports, in catalogue order (``build_info`` included)."""
    return tuple(spec for spec in METRICS.values() if spec.exported_by(exporter))


def build_info(daemon: Exporter) -> GaugeMetricFamily:
    """``torshmon_build_info`` as ``daemon`` exports it: 1, labelled with the versions."""
    family = BUILD_INFO.gauge()
    family.add_metric(
        [daemon, __version__, platform.python_version(), platform.python_implementation()], 1
    )
    return family
