from __future__ import annotations

import math

import pytest

from torshmon.probe.events import BucketEvent, CollectiveEvent, RawStep, StepEvents
from torshmon.probe.summary import aggregate_collectives, ddp_stats, summarize_step

MS = 1_000_000


def _raw(
    events: StepEvents, *, start: int = 0, end: int = 100 * MS, loss: object = None
) -> RawStep:
    return RawStep(
        step=1,
        start_ns=start,
        end_ns=end,
        end_unix_ns=0,
        batch_size=10,
        loss=loss,
        events=events,
        ddp_logging=None,
    )


def test_comm_wait_counts_blocking_calls_and_the_unhidden_bucket_tail() -> None:
    events = StepEvents(
        collectives=[
            CollectiveEvent("all_reduce", "default", 2, "float32", 400, 10 * MS, 15 * MS, True),
            # started before the step: belongs to no wait of this step
            CollectiveEvent("barrier", "default", 2, "none", 0, -5 * MS, 1 * MS, True),
        ],
        buckets=[
            BucketEvent(1, 100, 2, 50 * MS, 60 * MS, "none", 100),
            BucketEvent(0, 100, 2, 70 * MS, 90 * MS, "fp16", 50),
        ],
        forward_start_ns=20 * MS,
        forward_end_ns=40 * MS,
        backward_end_ns=92 * MS,
    )
    record = summarize_step(_raw(events))
    assert record.duration_s == pytest.approx(0.1)
    assert record.comm_wait_s == pytest.approx(0.005 + 0.020)
    assert record.compute_s == pytest.approx(0.075)
    assert record.communication_time_ratio == pytest.approx(0.25)
    assert record.forward_s == pytest.approx(0.02)
    assert record.backward_s == pytest.approx(0.052)
    assert record.optimizer_s == pytest.approx(0.008)
    assert record.samples_per_s == pytest.approx(100.0)
    assert [b.index for b in record.buckets] == [0, 1]
    assert [b.compression_ratio for b in record.buckets] == [0.5, 1.0]


def test_aggregation_sums_per_op_and_fills_the_histogram() -> None:
    calls = [
        CollectiveEvent("all_reduce", "default", 4, "float32", 4000, 0, 1 * MS, True),
        CollectiveEvent("all_reduce", "default", 4, "float32", 4000, 0, 3 * MS, False),
        CollectiveEvent("all_gather", "default", 4, "float32", 800, 0, 2 * MS, True),
    ]
    stats = {s.op: s for s in aggregate_collectives(calls)}
    ar = stats["all_reduce"]
    assert (ar.count, ar.size_bytes) == (2, 8000)
    assert ar.duration_s == pytest.approx(0.004)
    assert ar.max_duration_s == pytest.approx(0.003)
    assert ar.algbw_bytes_per_s == pytest.approx(2e6)
    assert ar.busbw_bytes_per_s == pytest.approx(3e6)
    assert sum(ar.duration_hist) == 2
    assert stats["all_gather"].busbw_bytes_per_s == pytest.approx(0.75 * 800 / 0.002)


def test_nonfinite_loss_is_flagged_not_lost() -> None:
    record = summarize_step(_raw(StepEvents(), loss=math.nan))
    assert record.loss is None
    assert record.loss_nonfinite
    assert summarize_step(_raw(StepEvents(), loss=0.5)).loss == 0.5


def test_ddp_logging_data_is_parsed_and_malformed_data_ignored() -> None:
    stats = ddp_stats(
        {
            "bucket_cap_bytes": 26214400,
            "bucket_sizes": "100, 200",
            "rebuilt_bucket_sizes": "300, 400, 500",
            "avg_forward_compute_time": 2_000_000,
            "avg_backward_compute_time": 3_000_000,
            "avg_backward_comm_time": 4_000_000,
            "avg_backward_compute_comm_overlap_time": 1_000_000,
            "num_buckets_reduced": 3,
        }
    )
    assert stats is not None
    assert stats.bucket_sizes_bytes == [300, 400, 500]
    assert stats.avg_backward_comm_s == pytest.approx(0.004)
    assert ddp_stats({"bucket_sizes": "x"}) is None


def test_comm_wait_after_the_last_gradient_when_ddp_reduces_in_cpp() -> None:
    events = StepEvents(
        forward_start_ns=0,
        forward_end_ns=20 * MS,
        last_grad_ns=60 * MS,
        backward_end_ns=75 * MS,
    )
    record = summarize_step(_raw(events))
    assert record.comm_wait_s == pytest.approx(0.015)
    assert record.backward_s == pytest.approx(0.055)
    assert record.buckets == []


def test_a_functional_collective_counts_the_time_its_caller_waited_not_its_whole_span() -> None:
    events = StepEvents(
        collectives=[
            # launched at 10 ms, waited on from 30 ms to 34 ms (wait_tensor)
            CollectiveEvent(
                "all_reduce", "default", 2, "float32", 4, 10 * MS, 34 * MS, False, 4 * MS
            ),
            # an async op nobody was seen waiting on
            CollectiveEvent("broadcast", "default", 2, "float32", 4, 40 * MS, 60 * MS, False),
        ]
    )
    record = summarize_step(_raw(events))
    assert record.comm_wait_s == pytest.approx(0.004)
    assert record.comm_busy_s == pytest.approx(0.024 + 0.020)


def test_input_wait_is_reported_in_seconds_and_stays_out_of_the_step() -> None:
    raw = _raw(StepEvents())
    raw = raw._replace(input_wait_ns=250 * MS)
    record = summarize_step(raw)
    assert record.input_wait_s == pytest.approx(0.25)
    assert record.duration_s == pytest.approx(0.1)
    assert summarize_step(_raw(StepEvents())).input_wait_s is None


def test_cpu_wait_is_reported_in_seconds_and_none_where_unmeasured() -> None:
    raw = _raw(StepEvents())
    raw = raw._replace(cpu_wait_ns=30 * MS)
    assert summarize_step(raw).cpu_wait_s == pytest.approx(0.03)
    assert summarize_step(_raw(StepEvents())).cpu_wait_s is None
