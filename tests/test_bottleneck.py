from __future__ import annotations

import math
from typing import Any

import pytest

from torshmon.aggregator.core.bottleneck import JobSnapshot, Thresholds, bottleneck_report
from torshmon.aggregator.core.findings import SEVERITIES

HEALTHY = JobSnapshot(
    communication_time_ratio=0.2,
    memory_utilization_ratio=0.6,
    gpu_utilization_ratio=0.95,
    io_wait_ratio=0.01,
    training_efficiency_ratio=0.8,
)


def _metrics(snapshot: JobSnapshot, **kwargs: Any) -> list[tuple[str, str]]:
    return [
        (f.labels["metric"], f.severity)
        for f in bottleneck_report("demo", snapshot, 50.0, **kwargs)
    ]


def test_a_healthy_or_unknown_job_has_no_bottleneck() -> None:
    assert bottleneck_report("demo", HEALTHY, 50.0) == []
    assert bottleneck_report("demo", JobSnapshot(), 50.0) == []


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        (0.3, []),
        (0.31, [("communication_time_ratio", "high")]),
        (0.5, [("communication_time_ratio", "high")]),
        (0.51, [("communication_time_ratio", "critical")]),
    ],
)
def test_communication_thresholds(ratio: float, expected: list[tuple[str, str]]) -> None:
    snap = JobSnapshot(communication_time_ratio=ratio)
    assert _metrics(snap) == expected


def test_each_area_names_its_metric_and_a_concrete_recommendation() -> None:
    cases = [
        ("communication_time_ratio", 0.4, "high", ("bucket", "PowerSGD", "autotuner")),
        ("memory_utilization_ratio", 0.97, "critical", ("batch size", "checkpointing")),
        ("gpu_utilization_ratio", 0.5, "medium", ("num_workers", "pin_memory")),
        ("io_wait_ratio", 0.2, "high", ("storage", "prefetch", "num_workers")),
    ]
    for field, value, severity, words in cases:
        (finding,) = bottleneck_report("demo", JobSnapshot(**{field: value}), 50.0)
        assert finding.kind == "bottleneck"
        assert finding.severity == severity
        assert finding.value == value
        assert finding.since_unix_s == 50.0
        assert finding.labels["job"] == "demo"
        assert "demo" in finding.summary and f"{value:.0%}" in finding.summary
        for word in words:
            assert word in finding.recommendation, (field, word)
    (io,) = bottleneck_report("demo", JobSnapshot(io_wait_ratio=0.2), 0.0)
    assert io.labels["metric"] == "node_cpu_iowait_ratio"
    assert io.score == pytest.approx(0.1)


def test_memory_at_the_threshold_and_gpu_absent_are_fine() -> None:
    assert _metrics(JobSnapshot(memory_utilization_ratio=0.95, gpu_utilization_ratio=None)) == []


def test_low_efficiency_alone_points_to_profiling() -> None:
    (finding,) = bottleneck_report("demo", JobSnapshot(training_efficiency_ratio=0.6), 0.0)
    assert finding.severity == "critical"
    assert finding.labels["metric"] == "training_efficiency_ratio"
    assert "torch.profiler" in finding.recommendation


def test_low_efficiency_with_causes_points_to_them() -> None:
    snap = JobSnapshot(communication_time_ratio=0.45, training_efficiency_ratio=0.55)
    findings = bottleneck_report("demo", snap, 0.0)
    eff = next(f for f in findings if f.labels["metric"] == "training_efficiency_ratio")
    assert "other findings" in eff.recommendation
    assert "55%" in eff.recommendation


def test_findings_are_sorted_most_severe_first() -> None:
    snap = JobSnapshot(
        communication_time_ratio=0.6,
        memory_utilization_ratio=0.99,
        gpu_utilization_ratio=0.3,
        io_wait_ratio=0.5,
        training_efficiency_ratio=0.3,
    )
    assert _metrics(snap) == [
        ("communication_time_ratio", "critical"),
        ("memory_utilization_ratio", "critical"),
        ("training_efficiency_ratio", "critical"),
        ("node_cpu_iowait_ratio", "high"),
        ("gpu_utilization_ratio", "medium"),
    ]
    ranks = [SEVERITIES.index(s) for _, s in _metrics(snap)]
    assert ranks == sorted(ranks, reverse=True)


def test_thresholds_are_configurable() -> None:
    strict = Thresholds(communication_high_ratio=0.1, communication_critical_ratio=0.15)
    assert _metrics(HEALTHY, thresholds=strict) == [("communication_time_ratio", "critical")]
    lax = Thresholds(gpu_utilization_medium_ratio=0.5)
    assert _metrics(JobSnapshot(gpu_utilization_ratio=0.6), thresholds=lax) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"communication_high_ratio": 1.5}, "communication_high_ratio"),
        ({"io_wait_high_ratio": math.nan}, "io_wait_high_ratio"),
        (
            {"communication_high_ratio": 0.6, "communication_critical_ratio": 0.5},
            "communication_critical_ratio",
        ),
    ],
)
def test_bad_thresholds_are_rejected_by_name(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Thresholds(**kwargs)


@pytest.mark.parametrize(
    "field", ["communication_time_ratio", "gpu_utilization_ratio", "training_efficiency_ratio"]
)
@pytest.mark.parametrize("value", [-0.1, 1.2, math.nan, math.inf])
def test_snapshot_rejects_values_that_are_not_ratios(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        JobSnapshot(**{field: value})
