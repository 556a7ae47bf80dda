"""Turns a step's raw events into its wire record (runs on the shipper thread)."""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Mapping

from torshmon.probe.bandwidth import bandwidths
from torshmon.probe.events import CollectiveEvent, RawStep, StepEvents
from torshmon.wire import DURATION_BUCKETS_S, BucketStat, CollectiveStat, DdpStats, StepRecord

log = logging.getLogger(__name__)

_NS = 1e-9


def summarize_step(raw: RawStep, device: tuple[float, float | None] | None = None) -> StepRecord:
    """The wire record of one step: durations in seconds, collectives aggregated
    per (op, group, dtype), buckets in index order. ``device``: the step's seconds and
    DDP's exposed communication as the GPU ran them (``StepMarks.split``), which then
    stand for the host's (the phases stay host times)."""
    events = raw.events
    duration_s = max(0.0, (raw.end_ns - raw.start_ns) * _NS)
    ddp_exposed_s = None
    if device is not None:
        duration_s, ddp_exposed_s = device
    comm_wait_s = min(duration_s, communication_wait_s(events, raw.start_ns, ddp_exposed_s))
    forward_s, backward_s, optimizer_s = _phases(events, raw.end_ns)
    samples_per_s = None
    loss = _loss_value(raw.loss)
    if raw.batch_size is not None and duration_s > 0.0:
        samples_per_s = raw.batch_size / duration_s
    return StepRecord(
        step=raw.step,
        end_unix_ns=raw.end_unix_ns,
        duration_s=duration_s,
        comm_wait_s=comm_wait_s,
        compute_s=duration_s - comm_wait_s,
        communication_time_ratio=comm_wait_s / duration_s if duration_s > 0.0 else 0.0,
        comm_busy_s=sum(e.end_ns - e.start_ns for e in events.collectives) * _NS,
        forward_s=forward_s,
        backward_s=backward_s,
        optimizer_s=optimizer_s,
        input_wait_s=None if raw.input_wait_ns is None else raw.input_wait_ns * _NS,
        eval_s=None if raw.eval_ns is None else raw.eval_ns * _NS,
        between_steps_comm_s=(
            None if raw.between_steps_comm_ns is None else raw.between_steps_comm_ns * _NS
        ),
        cpu_wait_s=(
            None
            if raw.cpu_wait_ns is None
            else compute_cpu_wait_ns(raw.cpu_wait_ns, events, raw.start_ns) * _NS
        ),
        process_cpu_wait_s=(
            None if raw.process_cpu_wait_ns is None else raw.process_cpu_wait_ns * _NS
        ),
        batch_size=raw.batch_size,
        samples_per_s=samples_per_s,
        loss=loss if loss is None or math.isfinite(loss) else None,
        loss_nonfinite=loss is not None and not math.isfinite(loss),
        collectives=aggregate_collectives(events.collectives),
        buckets=[
            BucketStat(
                index=b.bucket_index,
                size_bytes=b.size_bytes,
                parameters=b.parameters,
                duration_s=(b.done_ns - b.launch_ns) * _NS,
                codec=b.codec,
                wire_bytes=b.wire_bytes,
                compression_ratio=b.wire_bytes / b.size_bytes if b.size_bytes else 1.0,
                encode_s=b.encode_s,
                decode_s=b.decode_s,
                relative_error=b.relative_error,
            )
            for b in sorted(events.buckets)
        ],
        ddp=ddp_stats(raw.ddp_logging) if raw.ddp_logging is not None else None,
        config_version=raw.config_version,
        applied_config=raw.applied_config,
        config_rejections=list(raw.config_rejections),
        gpu_memory_allocated_bytes=None if raw.gpu_memory is None else raw.gpu_memory[0],
        gpu_memory_reserved_bytes=None if raw.gpu_memory is None else raw.gpu_memory[1],
        gpu_memory_peak_bytes=None if raw.gpu_memory is None else raw.gpu_memory[2],
    )


def communication_wait_s(
    events: StepEvents, step_start_ns: int, ddp_exposed_s: float | None = None
) -> float:
    """Seconds the step spent waiting for communication.

    Blocking collectives count whole, others by the time their caller waited on
    them (functional collectives' ``wait_tensor``). DDP's reduction overlaps backward compute:
    only what follows the last gradient (backward compute over) until backward
    returns (DDP waited for every bucket) is waiting; ``ddp_exposed_s`` is that
    measured on the device (NCCL). Without those marks, the tail from the last bucket's
    launch to the last bucket's end stands for it.
    """
    waited_ns = sum(
        e.end_ns - e.start_ns if e.blocking else e.wait_ns
        for e in events.collectives
        if e.start_ns >= step_start_ns
    )
    if ddp_exposed_s is not None:
        waited_ns += round(ddp_exposed_s * 1e9)
    elif events.last_grad_ns is not None and events.backward_end_ns is not None:
        waited_ns += max(0, events.backward_end_ns - events.last_grad_ns)
    elif events.buckets:
        last_launch = max(b.launch_ns for b in events.buckets)
        last_done = max(b.done_ns for b in events.buckets)
        waited_ns += max(0, last_done - last_launch)
    return waited_ns * _NS


def compute_cpu_wait_ns(step_ns: int, events: StepEvents, step_start_ns: int) -> int:
    """Of the run-queue delay ``step_ns`` of a whole step (begun at ``step_start_ns``),
    the part outside its communication waits (DDP's reduction, blocking collectives):
    the part that lengthened the step's compute. A thread woken from a wait on a busy
    node waits for a CPU first; that delay is in the step's communication wait, and a
    rank whose delays fell there lost no compute to them."""
    waited = sum(e.cpu_wait_ns for e in events.collectives if e.start_ns >= step_start_ns)
    start, end = events.last_grad_runqueue_ns, events.backward_end_runqueue_ns
    if start is not None and end is not None and events.backward_end_ns is not None:
        waited += max(0, end - start)
    return max(0, step_ns - waited)


def aggregate_collectives(collectives: list[CollectiveEvent]) -> list[CollectiveStat]:
    """Per (op, group, dtype): count, summed size and time, max time, bandwidths,
    and a duration histogram over DURATION_BUCKETS_S. Calls nothing timed (``timed``
    False) make a row of their own, its times and bandwidths None and its histogram
    empty, after the timed row of the same key."""
    groups: dict[tuple[str, str, str, bool], list[CollectiveEvent]] = {}
    for event in collectives:
        groups.setdefault((event.op, event.pg, event.dtype, not event.timed), []).append(event)
    stats = []
    for (op, pg, dtype, untimed), calls in sorted(groups.items()):
        size = sum(c.size_bytes for c in calls)
        hist = [0] * (len(DURATION_BUCKETS_S) + 1)
        if untimed:
            stats.append(
                CollectiveStat(
                    op=op, pg=pg, dtype=dtype, count=len(calls), size_bytes=size, duration_hist=hist
                )
            )
            continue
        durations = [(c.end_ns - c.start_ns) * _NS for c in calls]
        total_s = sum(durations)
        algbw, busbw = bandwidths(op, size, total_s, calls[0].group_size)
        for d in durations:
            hist[bisect.bisect_left(DURATION_BUCKETS_S, d)] += 1
        stats.append(
            CollectiveStat(
                op=op,
                pg=pg,
                dtype=dtype,
                count=len(calls),
                size_bytes=size,
                duration_s=total_s,
                max_duration_s=max(durations),
                algbw_bytes_per_s=algbw,
                busbw_bytes_per_s=busbw,
                duration_hist=hist,
            )
        )
    return stats


def ddp_stats(data: Mapping[str, object]) -> DdpStats | None:
    """DDP's logging data in wire form; None if a field is missing or malformed."""
    try:
        sizes = str(data.get("rebuilt_bucket_sizes") or data["bucket_sizes"])
        return DdpStats(
            bucket_cap_bytes=int(str(data["bucket_cap_bytes"])),
            bucket_sizes_bytes=[int(s) for s in sizes.split(",") if s.strip()],
            num_buckets_reduced=int(str(data.get("num_buckets_reduced", 0))),
            avg_forward_compute_s=_ns_field(data, "avg_forward_compute_time"),
            avg_backward_compute_s=_ns_field(data, "avg_backward_compute_time"),
            avg_backward_comm_s=_ns_field(data, "avg_backward_comm_time"),
            avg_backward_compute_comm_overlap_s=_ns_field(
                data, "avg_backward_compute_comm_overlap_time"
            ),
        )
    except (KeyError, ValueError):
        log.debug("torshmon: unexpected DDP logging data %r", data)
        return None


def _ns_field(data: Mapping[str, object], key: str) -> float:
    return int(str(data.get(key, 0))) * _NS


def _phases(events: StepEvents, end_ns: int) -> tuple[float | None, float | None, float | None]:
    fwd_start, fwd_end, bwd_end = (
        events.forward_start_ns,
        events.forward_end_ns,
        events.backward_end_ns,
    )
    forward = (fwd_end - fwd_start) * _NS if fwd_start is not None and fwd_end is not None else None
    if fwd_end is None or bwd_end is None or bwd_end < fwd_end:
        return forward, None, None
    return forward, (bwd_end - fwd_end) * _NS, max(0, end_ns - bwd_end) * _NS


def _loss_value(loss: object) -> float | None:
    """A float from whatever the user reported (float, 0-d tensor); None if unusable."""
    if loss is None:
        return None
    try:
        item = getattr(loss, "item", None)
        value = float(item() if callable(item) else loss)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        return None
    return value
