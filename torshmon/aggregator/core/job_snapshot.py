"""What the bottleneck report judges a job by: its kind and its recent means.

``job_kind_after`` reads what the probe was attached to from the steps it sends;
``job_snapshot`` takes a job's recent steps and its nodes' latest samples to the
``JobSnapshot`` the report (``bottleneck``) judges. Pure: the live state passes its
records in.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import cast

from torshmon.aggregator.core.bottleneck import JOB_KINDS, JobKind, JobSnapshot
from torshmon.aggregator.core.rank_state import JobState
from torshmon.wire import CollectiveStat, NodeSample


def job_kind_after(
    kind: str | None,
    ddps: tuple[object, ...],
    forwards: tuple[float | None, ...],
    buckets: tuple[list[object], ...],
    collectives: tuple[list[CollectiveStat], ...],
) -> str:
    """The job's kind after a batch of steps (``JobState.kind``), from its columns: DDP
    shows as phase splits, DDP statistics or comm-hook buckets, which only a DDP module
    gives; FSDP2 as a step that all-gathers and reduce-scatters."""
    if forwards.count(None) < len(forwards) or ddps.count(None) < len(ddps) or any(buckets):
        return "ddp"
    if kind == "fsdp2":
        return kind
    for step in collectives:
        ops = {c.op for c in step}
        if any(op.startswith("all_gather") for op in ops) and any(
            op.startswith("reduce_scatter") for op in ops
        ):
            return "fsdp2"
    return "collectives"


def job_snapshot(name: str, job: JobState, nodes: Mapping[str, NodeSample]) -> JobSnapshot:
    """Job ``name``'s recent means; shares are of the step period (input wait + step).

    Memory is its fullest node's and fullest GPU's; GPUs are those the agents map to
    the job's ranks (all GPUs of its nodes where they map none)."""
    comm, efficiency, input_share, periods = [], [], [], []
    for r in job.ranks.values():
        recent = r.recent
        for duration, wait, compute, input_wait in zip(
            recent.duration_s, recent.wait_s, recent.compute_s, recent.input_wait_s, strict=True
        ):
            measured = math.isfinite(input_wait)
            period = duration + (input_wait if measured else 0.0)
            if period > 0:
                comm.append(wait / period)
                efficiency.append(compute / period)
                periods.append(period)
                if measured:
                    input_share.append(input_wait / period)
    samples = [
        nodes[node] for node in sorted({r.node for r in job.ranks.values()}) if node in nodes
    ]
    gpu_busy, gpu_memory = [], []
    for sample in samples:
        used = {p.gpu for p in sample.ranks if p.job == name and p.gpu is not None}
        for gpu in sample.gpus:
            if used and gpu.index not in used:
                continue
            gpu_busy.append(gpu.utilization_ratio)
            if gpu.memory_total_bytes > 0:
                gpu_memory.append(gpu.memory_used_bytes / gpu.memory_total_bytes)
    kind = job.kind if job.kind in JOB_KINDS else None
    return JobSnapshot(
        communication_time_ratio=_ratio(_mean(comm)),
        memory_utilization_ratio=_ratio(_max([n.memory_utilization_ratio for n in samples])),
        gpu_utilization_ratio=_ratio(_mean(gpu_busy)),
        io_wait_ratio=_ratio(_mean([n.io_wait_ratio for n in samples])),
        training_efficiency_ratio=_ratio(_mean(efficiency)),
        input_wait_ratio=_ratio(_mean(input_share)),
        gpu_memory_utilization_ratio=_ratio(_max(gpu_memory)),
        job_kind=cast(JobKind | None, kind),
        step_s=_mean(periods),
    )


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else None


def _max(values: Sequence[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else None


def _ratio(value: float | None) -> float | None:
    """A mean of measured ratios kept inside 0..1 (clock jitter can push one just past)."""
    return None if value is None else min(1.0, max(0.0, value))
