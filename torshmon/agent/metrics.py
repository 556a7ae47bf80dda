"""The agent's Prometheus metrics: its node, the training processes on it, and itself.

The agent exports facts only it can know: the node (CPU, memory, network per
interface, disk, GPUs), each local training process (RSS, CPU time, and
``torshmon_rank_info`` to join on) and its own health. Training series (steps,
loss, collectives...) are the aggregator's alone, so that Prometheus scraping both
daemons counts each series once (``torshmon.catalogue.metrics``).

AgentMetrics keeps the latest state fed to it and one custom collector turns that
state into metric families at scrape time. Byte and CPU counters are exposed as
the operating system counts them, never re-counted with ``inc()``.

How the daemon feeds it::

    metrics = AgentMetrics(registry, node="n1")
    metrics.observe_node(sampler.sample(ranks))       # every sampling tick
    metrics.observe_probes(server.probes)             # the probes connected now
    metrics.set_agent_state(AgentState(...))          # whenever its counters change
    app.router.add_get("/metrics", make_metrics_handler(registry))

Thread safety: every method may be called from any thread; state is copied under
a lock and families are built outside it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from torshmon.catalogue import metrics as catalogue
from torshmon.catalogue.metrics import MetricSpec, build_info
from torshmon.wire import Hello, NodeSample

__all__ = ["AgentMetrics", "AgentState", "make_metrics_handler"]


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


class AgentMetrics:
    """The agent's metrics, registered on the given registry (never the global default).

    Feed it with observe_node(), observe_probes() and set_agent_state(); serve the
    registry with make_metrics_handler(). close() unregisters it. Thread-safe.
    """

    def __init__(self, registry: CollectorRegistry, *, node: str) -> None:
        self.registry = registry
        self.node = node
        self._lock = threading.Lock()
        self._sample: NodeSample | None = None
        self._probes: tuple[Hello, ...] = ()
        self._agent_state = AgentState()
        self._collector = _AgentCollector(self)
        registry.register(self._collector)

    def close(self) -> None:
        """Unregister from the registry; safe to call twice."""
        with contextlib.suppress(KeyError):
            self.registry.unregister(self._collector)

    def observe_node(self, sample: NodeSample) -> None:
        """Replace the node's state with this sample (node, GPU and process metrics)."""
        with self._lock:
            self._sample = sample

    def observe_probes(self, probes: Iterable[Hello]) -> None:
        """The probes connected now (their hellos): ``torshmon_rank_info`` shows these."""
        probes = tuple(probes)
        with self._lock:
            self._probes = probes

    def set_agent_state(self, state: AgentState) -> None:
        """Replace the agent's own health figures; the daemon calls it when they change."""
        with self._lock:
            self._agent_state = state

    def _snapshot(self) -> tuple[NodeSample | None, tuple[Hello, ...], AgentState]:
        with self._lock:
            return self._sample, self._probes, self._agent_state


class _AgentCollector(Collector):
    """Builds every family from a snapshot of AgentMetrics' state at scrape time."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        sample, probes, agent = self._metrics._snapshot()
        node = self._metrics.node
        if sample is not None:
            yield from _node_families(sample)
            yield from _process_families(sample)
        yield _rank_info(probes, node, sample)
        yield from _agent_families(agent, node)
        yield build_info("agent")


def _node_families(sample: NodeSample) -> Iterator[Metric]:
    node = [sample.node]
    for spec, value in (
        (catalogue.CPU_UTILIZATION_RATIO, sample.cpu_utilization_ratio),
        (catalogue.MEMORY_UTILIZATION_RATIO, sample.memory_utilization_ratio),
        (catalogue.MEMORY_USED_BYTES, sample.memory_used_bytes),
        (catalogue.NODE_CPU_IOWAIT_RATIO, sample.io_wait_ratio),
        (catalogue.DISK_READ_BYTES_TOTAL, sample.disk_read_bytes_total),
        (catalogue.DISK_WRITTEN_BYTES_TOTAL, sample.disk_write_bytes_total),
    ):
        yield _family(spec, [(node, value)])
    interfaces = [([sample.node, i.name], i) for i in sample.interfaces]
    yield _family(
        catalogue.NETWORK_RECEIVE_BYTES_TOTAL, [(la, i.rx_bytes_total) for la, i in interfaces]
    )
    yield _family(
        catalogue.NETWORK_TRANSMIT_BYTES_TOTAL, [(la, i.tx_bytes_total) for la, i in interfaces]
    )
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
        catalogue.GPU_MEMORY_UTILIZATION_RATIO,
        [
            (la, g.memory_used_bytes / g.memory_total_bytes)
            for la, g in gpus
            if g.memory_total_bytes
        ],
    )
    yield _family(
        catalogue.GPU_POWER_WATTS,
        [(la, g.power_watts) for la, g in gpus if g.power_watts is not None],
    )
    yield _family(
        catalogue.GPU_TEMPERATURE_CELSIUS,
        [(la, g.temperature_celsius) for la, g in gpus if g.temperature_celsius is not None],
    )
    yield _family(
        catalogue.GPU_THROTTLE_ACTIVE,
        [
            ([*la, reason], float(bool(g.throttle_reasons & bit)))
            for la, g in gpus
            for reason, bit in THROTTLE_REASONS.items()
        ],
    )
    yield _family(
        catalogue.GPU_ECC_UNCORRECTED_ERRORS_TOTAL,
        [
            (la, g.ecc_uncorrected_errors_total)
            for la, g in gpus
            if g.ecc_uncorrected_errors_total is not None
        ],
    )
    yield _family(catalogue.GPU_XID_ERRORS_TOTAL, [(la, g.xid_errors_total) for la, g in gpus])


#: NVML's clock event (throttle) reason bits (nvmlClocksEventReason*), by the name the
#: ``reason`` label of ``torshmon_gpu_throttle_active`` gives them.
THROTTLE_REASONS: Final[dict[str, int]] = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}


def _process_families(sample: NodeSample) -> Iterator[Metric]:
    processes = [([p.job, str(p.rank), sample.node], p) for p in sample.ranks]
    yield _family(catalogue.RANK_MEMORY_RSS_BYTES, [(la, p.rss_bytes) for la, p in processes])
    yield _family(catalogue.RANK_CPU_SECONDS_TOTAL, [(la, p.cpu_s_total) for la, p in processes])


def _rank_info(probes: Sequence[Hello], node: str, sample: NodeSample | None) -> Metric:
    """One series per connected probe; the node is the agent's own name for its node
    (the one its other series carry), the GPU the one NVML saw the process on."""
    gpu_by_pid = {p.pid: p.gpu for p in sample.ranks} if sample is not None else {}
    uuids = {g.index: g.uuid for g in sample.gpus} if sample is not None else {}
    rows = []
    for hello in sorted(probes, key=lambda h: (h.job, h.rank)):
        gpu = gpu_by_pid.get(hello.pid)
        labels = [
            hello.job,
            str(hello.rank),
            node,
            str(hello.local_rank),
            str(hello.pid),
            "" if gpu is None else str(gpu),
            "" if gpu is None else uuids.get(gpu, ""),
        ]
        rows.append((labels, 1))
    return _family(catalogue.RANK_INFO, rows)


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


def _family(
    spec: MetricSpec, values: Iterable[tuple[Sequence[str], float]]
) -> GaugeMetricFamily | CounterMetricFamily:
    """The gauge or counter family of ``spec``, with these samples."""
    family = spec.counter() if spec.kind == "counter" else spec.gauge()
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family


def make_metrics_handler(registry: CollectorRegistry) -> Handler:
    """An aiohttp handler serving ``registry`` (prometheus-client's own; content negotiated)."""
    return make_aiohttp_handler(registry)
