"""The bottleneck report: where a job's step time goes, and what to do about it.

Thresholds and severities are DESIGN.md's: communication ratio > 0.3 high, > 0.5
critical; memory > 0.95 critical; GPU utilisation < 0.8 medium; I/O wait > 0.1 high;
overall efficiency (compute / step time) < 0.7 critical. The report is stateless: it
judges one snapshot of the job's recent means, and ``since_unix_s`` of its findings
is the report time (how long a condition has held is the rules engine's business).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Final

from torshmon.aggregator.core.findings import SEVERITIES, Finding

_COMMUNICATION_ADVICE: Final = (
    "Communication takes too much of the step: raise the DDP bucket cap (bucket_cap_mb) "
    "so fewer, larger all-reduces run; compress gradients (fp16 or bf16, PowerSGD); "
    "let communication overlap backward compute (static_graph=True, no needless "
    "synchronisation). torshmon's autotuner searches bucket size and codec for you "
    "(the rule action 'autotune')."
)
_MEMORY_ADVICE: Final = (
    "Memory is nearly exhausted: reduce the per-rank batch size (keep the global batch "
    "with gradient accumulation), enable activation checkpointing, train in mixed "
    "precision (bf16/fp16), shard optimizer state (ZeroRedundancyOptimizer or FSDP), "
    "and drop references to tensors kept across steps."
)
_GPU_ADVICE: Final = (
    "The GPU is idle part of the time, usually waiting for input: raise DataLoader "
    "num_workers, set pin_memory=True with non_blocking copies, use persistent_workers "
    "and prefetch_factor, move preprocessing to the GPU, or increase the batch size."
)
_IO_ADVICE: Final = (
    "Training waits on storage: move the data set to faster local storage (NVMe, "
    "RAM disk), cache or prefetch it, raise DataLoader num_workers and prefetch_factor, "
    "and read large sequential shards (WebDataset-style tar shards) rather than many "
    "small files."
)
_EFFICIENCY_ADVICE: Final = (
    "Less than {threshold:.0%} of the step is compute ({value:.0%}): fix the other "
    "findings of this report, most severe first."
)
_EFFICIENCY_ALONE_ADVICE: Final = (
    "Less than {threshold:.0%} of the step is compute ({value:.0%}) with no single "
    "cause above its threshold: profile a few steps (torch.profiler) for host-side "
    "overhead, synchronisation points (.item(), .cpu()) and many small kernels."
)


@dataclass(frozen=True, slots=True)
class JobSnapshot:
    """A job's recent means, each a ratio in 0..1 or None when unknown.

    ``gpu_utilization_ratio`` is None on CPU-only jobs; ``training_efficiency_ratio``
    is compute_s / duration_s. Raises ValueError for a value outside 0..1.
    """

    communication_time_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    gpu_utilization_ratio: float | None = None
    io_wait_ratio: float | None = None
    training_efficiency_ratio: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_ratio(f.name, getattr(self, f.name))


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Where the report starts to complain (ratios in 0..1); defaults from DESIGN.md.

    Raises ValueError for a value outside 0..1, or a critical communication threshold
    below the high one.
    """

    communication_high_ratio: float = 0.3
    communication_critical_ratio: float = 0.5
    memory_critical_ratio: float = 0.95
    gpu_utilization_medium_ratio: float = 0.8
    io_wait_high_ratio: float = 0.1
    efficiency_critical_ratio: float = 0.7

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_ratio(f.name, getattr(self, f.name))
        if self.communication_critical_ratio < self.communication_high_ratio:
            raise ValueError(
                "communication_critical_ratio must be >= communication_high_ratio "
                f"({self.communication_high_ratio}), got {self.communication_critical_ratio}"
            )


def bottleneck_report(
    job: str,
    snapshot: JobSnapshot,
    now_unix_s: float,
    *,
    thresholds: Thresholds | None = None,
) -> list[Finding]:
    """The job's bottlenecks at ``now_unix_s`` (Unix seconds), most severe first.

    Each finding has kind "bottleneck", labels ``job`` and ``metric`` (the metric name
    without the ``torshmon_`` prefix), the observed ratio as ``value`` and its margin
    past the threshold as ``score``.
    """
    t = thresholds if thresholds is not None else Thresholds()
    s = snapshot
    found: list[Finding] = []

    def add(
        metric: str,
        area: str,
        value: float,
        threshold: float,
        severity: str,
        summary: str,
        advice: str,
    ) -> None:
        found.append(
            Finding(
                kind="bottleneck",
                labels={"job": job, "metric": metric},
                value=value,
                score=abs(value - threshold),
                summary=summary,
                since_unix_s=now_unix_s,
                recommendation=advice,
                severity=severity,
                details={"area": area, "threshold": threshold},
            )
        )

    comm = s.communication_time_ratio
    if comm is not None and comm > t.communication_high_ratio:
        critical = comm > t.communication_critical_ratio
        threshold = t.communication_critical_ratio if critical else t.communication_high_ratio
        add(
            "communication_time_ratio",
            "communication",
            comm,
            threshold,
            "critical" if critical else "high",
            f"job {job} spends {comm:.0%} of its step time waiting for communication "
            f"(threshold {threshold:.0%})",
            _COMMUNICATION_ADVICE,
        )
    memory = s.memory_utilization_ratio
    if memory is not None and memory > t.memory_critical_ratio:
        add(
            "memory_utilization_ratio",
            "memory",
            memory,
            t.memory_critical_ratio,
            "critical",
            f"job {job} uses {memory:.0%} of its nodes' memory "
            f"(threshold {t.memory_critical_ratio:.0%})",
            _MEMORY_ADVICE,
        )
    gpu = s.gpu_utilization_ratio
    if gpu is not None and gpu < t.gpu_utilization_medium_ratio:
        add(
            "gpu_utilization_ratio",
            "gpu",
            gpu,
            t.gpu_utilization_medium_ratio,
            "medium",
            f"job {job} keeps its GPUs busy only {gpu:.0%} of the time "
            f"(threshold {t.gpu_utilization_medium_ratio:.0%})",
            _GPU_ADVICE,
        )
    io_wait = s.io_wait_ratio
    if io_wait is not None and io_wait > t.io_wait_high_ratio:
        add(
            "node_cpu_iowait_ratio",
            "io",
            io_wait,
            t.io_wait_high_ratio,
            "high",
            f"job {job}'s nodes spend {io_wait:.0%} of CPU time waiting for I/O "
            f"(threshold {t.io_wait_high_ratio:.0%})",
            _IO_ADVICE,
        )
    efficiency = s.training_efficiency_ratio
    if efficiency is not None and efficiency < t.efficiency_critical_ratio:
        template = _EFFICIENCY_ADVICE if found else _EFFICIENCY_ALONE_ADVICE
        add(
            "training_efficiency_ratio",
            "efficiency",
            efficiency,
            t.efficiency_critical_ratio,
            "critical",
            f"job {job} computes only {efficiency:.0%} of its step time "
            f"(threshold {t.efficiency_critical_ratio:.0%})",
            template.format(threshold=t.efficiency_critical_ratio, value=efficiency),
        )
    # Stable sort: equal severities keep the fixed order above (communication first).
    found.sort(key=lambda f: -SEVERITIES.index(f.severity))
    return found


def _check_ratio(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a ratio in 0..1 or None, got {value}")
