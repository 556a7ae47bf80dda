from __future__ import annotations

import json
import math
import random
import re
import statistics
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.step_time import StepTimeDetector
from torshmon.aggregator.core.zscore import (
    Direction,
    RollingMedian,
    RollingStats,
    ZScoreDetector,
    ZScoreSettings,
)
from torshmon.settings import SettingsError

LABELS = {"job": "demo", "rank": "1"}

#: Step time's policies by the names of their settings in the ``zscore:`` section.
_POLICIES = {
    "explained_share": "step_cpu_wait_share",
    "min_duration_s": "step_min_duration_s",
    "min_out_share": "step_min_out_share",
    "level_window_s": "step_level_window_s",
    "level_sigmas": "step_level_sigmas",
    "level_share": "step_level_share",
}
#: Step time's policies off, and its floor no higher than ``std_floor_ratio``.
_POLICIES_OFF: dict[str, Any] = {
    "step_std_floor_ratio": 0.0,
    "step_cpu_wait_share": 0.0,
    "step_min_duration_s": 0.0,
    "step_level_window_s": 0.0,
}


def _generic(
    *,
    metric: str = "step_duration_seconds",
    direction: Direction = "up",
    robust: bool = False,
    **settings: Any,
) -> ZScoreDetector:
    """The generic detector on ``metric`` with the section's ``settings``."""
    return ZScoreDetector(
        ZScoreSettings(**settings), metric=metric, direction=direction, robust=robust
    )


def _step(*, direction: Direction = "up", robust: bool = False, **kwargs: Any) -> StepTimeDetector:
    """Step time's detector with only the policies named in ``kwargs`` (by their old
    detector names, see ``_POLICIES``) on, and the section's other ``kwargs``."""
    policies = {_POLICIES[k]: kwargs.pop(k) for k in list(kwargs) if k in _POLICIES}
    settings = ZScoreSettings(**{**_POLICIES_OFF, "step_robust": robust, **kwargs, **policies})
    return StepTimeDetector(settings, direction=direction)


def _feed(
    det: ZScoreDetector, values: list[float], *, labels: dict[str, str] | None = None
) -> list[Finding | None]:
    lab = LABELS if labels is None else labels
    return [det.observe(lab, 100.0 + i, v) for i, v in enumerate(values)]


def _baseline(n: int = 20) -> list[float]:
    # mean 0.2, sample std ~0.00103: a realistic, slightly noisy step time
    return [0.199 if i % 2 else 0.201 for i in range(n)]


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(min_value=2, max_value=12),
    values=st.lists(
        st.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=1, max_size=80
    ),
)
def test_rolling_stats_match_a_brute_force_window(window: int, values: list[float]) -> None:
    stats = RollingStats(window)
    for i, v in enumerate(values):
        stats.add(v)
        tail = values[max(0, i + 1 - window) : i + 1]
        assert len(stats) == len(tail)
        # Removing a value cancels digits: the error scales with the magnitude of the
        # values evicted since the last recompute, not only of those still in the window.
        scale = 1e-7 * (1.0 + max(abs(v) for v in values[: i + 1]))
        assert stats.mean == pytest.approx(statistics.fmean(tail), rel=1e-9, abs=scale)
        expected_std = statistics.stdev(tail) if len(tail) > 1 else 0.0
        # The std is the square root of a sum that cancelled: its error is about the
        # square root of the sum's, so it gets a looser absolute bound.
        assert stats.std == pytest.approx(expected_std, rel=1e-6, abs=10 * scale)


def test_rolling_stats_stay_accurate_over_many_evictions_at_a_large_offset() -> None:
    rng = random.Random(7)
    stats = RollingStats(100)
    values = [1e6 + rng.gauss(0.0, 0.01) for _ in range(20_000)]
    for v in values:
        stats.add(v)
    tail = values[-100:]
    assert stats.mean == pytest.approx(statistics.fmean(tail), rel=1e-12)
    assert stats.std == pytest.approx(statistics.stdev(tail), rel=1e-6)


def test_no_finding_before_min_samples() -> None:
    det = _generic(min_samples=10, persistence=1)
    results = _feed(det, [0.2] * 9 + [5.0])
    # the tenth value only completes the warm-up window; it is not judged
    assert results == [None] * 10
    assert det.observe(LABELS, 200.0, 5.0) is not None


def test_a_sustained_spike_fires_after_persistence_and_names_the_series() -> None:
    det = _generic(persistence=3)
    assert _feed(det, _baseline()) == [None] * 20
    assert det.observe(LABELS, 200.0, 0.412) is None
    assert det.observe(LABELS, 201.0, 0.412) is None
    finding = det.observe(LABELS, 202.0, 0.412)
    assert finding is not None
    assert finding.kind == "anomaly"
    assert dict(finding.labels) == {"job": "demo", "rank": "1", "metric": "step_duration_seconds"}
    assert finding.severity == "warning"
    assert finding.since_unix_s == 200.0
    assert finding.value == 0.412
    assert finding.score == pytest.approx((0.412 - 0.2) / statistics.stdev(_baseline()), rel=1e-6)
    assert re.fullmatch(
        r"step time of job demo rank 1 is 0\.412 s, \d+\.\d sigma above its mean 0\.2 s",
        finding.summary,
    ), finding.summary
    assert finding.recommendation
    assert det.active() == [finding]


def test_summary_reports_sigma_and_mean_as_in_the_design_example() -> None:
    det = _generic(persistence=1, min_samples=4)
    # mean 0.201, std 0.0514: 0.412 is 4.1 sigma above
    for i, v in enumerate([0.138, 0.264, 0.2, 0.202]):
        det.observe(LABELS, float(i), v)
    finding = det.observe(LABELS, 10.0, 0.412)
    assert finding is not None
    assert (
        finding.summary
        == "step time of job demo rank 1 is 0.412 s, 4.1 sigma above its mean 0.201 s"
    )


def test_hysteresis_clears_only_after_persistence_in_band_samples() -> None:
    det = _generic(persistence=3)
    _feed(det, _baseline())
    for t in range(3):
        det.observe(LABELS, 200.0 + t, 0.4)
    active = det.active()
    assert len(active) == 1
    assert det.observe(LABELS, 210.0, 0.2) == active[0]
    assert det.observe(LABELS, 211.0, 0.2) == active[0]
    assert det.observe(LABELS, 212.0, 0.2) is None
    assert det.active() == []


def test_a_short_excursion_is_absorbed_into_the_baseline() -> None:
    det = _generic(persistence=3, std_floor_ratio=1e-3)
    _feed(det, [1.0] * 10)
    assert _feed(det, [2.0, 2.0, 1.0]) == [None] * 3
    # The two 2.0 values widened the band (std ~0.39 now), so 2.0 is no anomaly any more.
    assert [det.observe(LABELS, 300.0 + i, 2.0) for i in range(3)] == [None] * 3


def test_an_active_anomaly_does_not_absorb_its_values_then_adapts_to_the_new_level() -> None:
    det = _generic(window=40, persistence=3, min_samples=10)  # adapt_after = 10
    _feed(det, _baseline(40))
    results = [det.observe(LABELS, 300.0 + i, 0.3) for i in range(12)]
    # fires from the third value and keeps firing: the baseline stays at 0.2
    assert results[:2] == [None, None]
    assert all(r is not None and r.details["mean"] == pytest.approx(0.2) for r in results[2:9])
    # the tenth anomalous value makes 0.3 the new normal
    assert results[9] is None and results[10] is None and results[11] is None
    assert det.active() == []
    back = [det.observe(LABELS, 400.0 + i, 0.3 * 1.5) for i in range(3)]
    assert back[2] is not None and back[2].details["mean"] == pytest.approx(0.3)


def test_direction_up_ignores_drops_down_ignores_rises_both_sees_both() -> None:
    drop = [0.1] * 3
    rise = [0.4] * 3
    for direction, flags_drop, flags_rise in (
        ("up", False, True),
        ("down", True, False),
        ("both", True, True),
    ):
        for tail, expected in ((drop, flags_drop), (rise, flags_rise)):
            det = _generic(direction=direction, persistence=3)  # type: ignore[arg-type]
            _feed(det, _baseline())
            last = _feed(det, tail)[-1]
            assert (last is not None) == expected, (direction, tail)
            if last is not None and tail is drop:
                assert "below its mean" in last.summary
                assert last.score < 0


def test_zero_variance_uses_the_relative_std_floor() -> None:
    det = _generic(persistence=1)
    _feed(det, [1.0] * 10)
    # 1e-7 relative noise on a constant series must not look like 1e5 sigma
    assert det.observe(LABELS, 50.0, 1.0000001) is None
    finding = det.observe(LABELS, 51.0, 1.01)  # 10 sigma with the 1e-3 floor
    assert finding is not None
    assert finding.score == pytest.approx(10.0, rel=1e-6)


def test_non_finite_values_are_ignored() -> None:
    det = _generic(persistence=1)
    _feed(det, _baseline())
    assert det.observe(LABELS, 50.0, math.nan) is None
    assert det.observe(LABELS, 51.0, math.inf) is None
    active = det.observe(LABELS, 52.0, 0.5)
    assert active is not None
    assert det.observe(LABELS, 53.0, math.nan) == active


def test_series_are_independent_and_forget_drops_a_job() -> None:
    det = _generic(persistence=1)
    other = {"job": "other", "rank": "0"}
    _feed(det, _baseline())
    _feed(det, _baseline(), labels=other)
    assert det.observe({"job": "demo", "rank": "2"}, 1.0, 0.9) is None  # new series: warm-up
    assert det.observe(LABELS, 300.0, 0.9) is not None
    assert det.observe(other, 300.0, 0.9) is not None
    assert [f.labels["job"] for f in det.active()] == ["demo", "other"]
    det.forget("demo")
    assert [f.labels["job"] for f in det.active()] == ["other"]
    # the forgotten series starts over with a warm-up
    assert det.observe(LABELS, 301.0, 0.9) is None


def test_other_metrics_get_their_name_and_unit() -> None:
    det = _generic(metric="torshmon_throughput_samples_per_second", direction="down")
    _feed(det, [100.0, 102.0] * 10)
    last = _feed(det, [50.0] * 3)[-1]
    assert last is not None
    assert last.labels["metric"] == "torshmon_throughput_samples_per_second"
    assert last.summary.startswith("throughput of job demo rank 1 is 50 samples/s")


def test_labels_without_job_are_rejected() -> None:
    det = _generic()
    with pytest.raises(ValueError, match="job"):
        det.observe({"rank": "0"}, 0.0, 1.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 0.0}, "threshold"),
        ({"threshold": math.nan}, "threshold"),
        ({"threshold": math.inf}, "threshold must be a finite number"),
        ({"window": 1}, "window"),
        ({"min_samples": 2000}, "min_samples must be at most window"),
        ({"persistence": 0}, "persistence"),
        ({"adapt_after": 2}, "adapt_after"),
        ({"std_floor_ratio": -1.0}, "std_floor_ratio"),
        ({"step_min_duration_s": -0.1}, "step_min_duration_s"),
        ({"step_min_duration_s": math.inf}, "step_min_duration_s"),
        ({"step_level_window_s": -1.0}, "step_level_window_s"),
        ({"step_level_sigmas": 0.0}, "step_level_sigmas"),
        ({"step_level_share": 1.5}, "step_level_share"),
    ],
)
def test_bad_settings_are_rejected_by_name(kwargs: dict[str, object], match: str) -> None:
    """Checked once, where the section is built: the detectors trust it."""
    with pytest.raises(SettingsError, match=match):
        ZScoreSettings(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"direction": "sideways"}, "direction"), ({"metric": ""}, "metric")]
)
def test_a_detector_refuses_a_direction_or_metric_of_no_meaning(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ZScoreDetector(**kwargs)  # type: ignore[arg-type]


_VALUES = st.one_of(
    st.floats(min_value=0.05, max_value=2.0),
    st.sampled_from([0.2, 0.2001, 0.1999, math.nan, math.inf, 5.0]),
)


@settings(max_examples=300, deadline=None)
@given(
    direction=st.sampled_from(["up", "down", "both"]),
    persistence=st.integers(1, 4),
    chunks=st.lists(st.lists(_VALUES, min_size=1, max_size=7), max_size=25),
    robust=st.booleans(),
    level=st.booleans(),
)
def test_observe_many_is_observe_one_by_one(
    direction: str, persistence: int, chunks: list[list[float]], robust: bool, level: bool
) -> None:
    kwargs: dict[str, Any] = {
        "window": 12,
        "min_samples": 4,
        "persistence": persistence,
        "direction": direction,
        "robust": robust,
    }
    one: ZScoreDetector
    many: ZScoreDetector
    if level:
        one, many = (_step(**kwargs, level_window_s=5.0, level_sigmas=1.0) for _ in "12")
    else:
        one, many = _generic(**kwargs), _generic(**kwargs)
    ts = 0.0
    for chunk in chunks:
        times = [ts + i for i in range(len(chunk))]
        ts += len(chunk)
        expected = [
            (i, one.observe(LABELS, t, v))
            for i, (t, v) in enumerate(zip(times, chunk, strict=True))
        ]
        got = many.observe_many(LABELS, times, chunk)
        assert [(i, f.summary, f.details) for i, f in got] == [
            (i, f.summary, f.details) for i, f in expected if f is not None
        ]
    assert [f.summary for f in many.active()] == [f.summary for f in one.active()]


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(min_value=2, max_value=9),
    values=st.lists(st.floats(min_value=-1e3, max_value=1e3), min_size=1, max_size=60),
    threshold=st.floats(min_value=0.5, max_value=4.0),
)
def test_add_in_band_is_add_while_in_band(
    window: int, values: list[float], threshold: float
) -> None:
    """Bit for bit: the fast path keeps the same mean and std as ``add``."""
    fast, slow = RollingStats(window), RollingStats(window)
    start = 0
    while start < len(values):
        stop = fast.add_in_band(values, start, threshold, 1e-3)
        for value in values[start:stop]:
            slow.add(value)
        assert (fast.mean, fast.std, len(fast)) == (slow.mean, slow.std, len(slow))
        if stop < len(values):
            mean, std = slow.mean, max(slow.std, 1e-3 * abs(slow.mean), 1e-12)
            assert (values[stop] - mean) / std > threshold  # it stopped for a reason
            fast.add(values[stop])
            slow.add(values[stop])
        start = stop + 1


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(min_value=2, max_value=31),
    values=st.lists(
        st.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=1, max_size=80
    ),
)
def test_rolling_median_matches_a_brute_force_window(window: int, values: list[float]) -> None:
    """Below 32 values the MAD is recomputed after every change: exact."""
    stats = RollingMedian(window)
    for i, v in enumerate(values):
        stats.add(v)
        tail = values[max(0, i + 1 - window) : i + 1]
        assert len(stats) == len(tail)
        center = statistics.median(tail)
        assert stats.center == center
        expected = 1.4826 * statistics.median(abs(x - center) for x in tail) if i else 0.0
        assert stats.scale == pytest.approx(expected, rel=1e-12)
    stats.reset(values[:3])
    assert stats.center == statistics.median(values[:3][-window:])


@pytest.mark.parametrize("robust", [False, True])
def test_slow_first_steps_hide_a_regression_from_the_mean_not_from_the_median(
    robust: bool,
) -> None:
    """A job's first steps are several times its normal one (start-up, warm-up) and a
    busy host adds single long steps; the mean and std take them into the band, so a
    1.4x regression 100 steps later fits inside it. The median and MAD do not."""
    rng = random.Random(3)
    start_up = [1.0, 0.6, 0.4, 0.3, 0.25]
    normal = [0.1 * (1 + rng.uniform(-0.03, 0.03)) for _ in range(100)]
    for at in (20, 45, 70, 90):
        normal[at] = 0.5  # preempted once
    regressed = [0.14 * (1 + rng.uniform(-0.03, 0.03)) for _ in range(10)]
    det = _generic(persistence=3, std_floor_ratio=0.05, robust=robust)
    found = [f for f in _feed(det, start_up + normal + regressed) if f is not None]
    if robust:
        assert found and "sigma above its median 0.1" in found[0].summary
        assert found[0].details["baseline"] == "median and MAD"
    else:
        assert found == []


def test_observe_many_refuses_times_and_values_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="2 times but 1 values"):
        _generic().observe_many(LABELS, [1.0, 2.0], [0.2])


def test_a_label_set_tuple_is_the_series_of_its_dict() -> None:
    """Sorted label pairs (the aggregator's LabelSet) find the series without sorting;
    pairs out of order still find it, the long way."""
    det, plain = _generic(persistence=1), _generic(persistence=1)
    pairs = (("job", "demo"), ("rank", "1"))
    values = [*_baseline(), 0.9, 0.9]
    for i, v in enumerate(values):
        labels = [pairs, LABELS, (("rank", "1"), ("job", "demo"))][i % 3]
        got = det.observe_many(labels, [100.0 + i], [v])
        expected = plain.observe_many(LABELS, [100.0 + i], [v])
        assert [(j, f.labels, f.summary) for j, f in got] == [
            (j, f.labels, f.summary) for j, f in expected
        ]
    assert [f.summary for f in det.active()] == [f.summary for f in plain.active()] != []
    det.forget("demo")
    assert det.active() == []
    assert det.observe(pairs, 300.0, 0.9) is None  # forgotten: a new series, warming up


def test_a_rise_its_known_cause_explains_is_not_judged() -> None:
    """``explained_share``: steps 40 % slower whose threads waited for a CPU for most of
    the rise (a busy node) set off nothing and do not move the baseline; the same rise
    with no such wait, or with too little, is an anomaly."""
    normal = [0.1] * 50
    slow = [0.14] * 10

    def found(waits: list[float]) -> list[int]:
        det = _step(persistence=3, std_floor_ratio=0.05, robust=True, explained_share=0.5)
        values = normal + slow + normal[:5] + slow
        ts = [float(i) for i in range(len(values))]
        explained = [0.0] * 50 + waits + [0.0] * 5 + [0.0] * 10
        return [i for i, _ in det.observe_many(LABELS, ts, values, explained)]

    # held back: nothing during the first slow stretch; the unexplained second one fires
    assert found([0.03] * 10)[:1] == [67]
    # half the rise is the bar: 0.019 s of a 0.04 s rise is not enough
    assert found([0.019] * 10)[:1] == [52]


def test_a_cause_that_is_always_there_explains_no_rise() -> None:
    """A node always busy: every step carries 30 ms of CPU wait. A 40 % rise with the
    same wait is the job's own and fires; with 20 ms more wait than usual it does not."""

    def found(extra: float) -> list[int]:
        det = _step(persistence=3, std_floor_ratio=0.05, robust=True, explained_share=0.5)
        values = [0.1] * 50 + [0.14] * 10
        explained = [0.03] * 50 + [0.03 + extra] * 10
        ts = [float(i) for i in range(len(values))]
        return [i for i, _ in det.observe_many(LABELS, ts, values, explained)]

    assert found(0.0)[:1] == [52]
    assert found(0.02) == []


def test_the_cpu_wait_share_is_off_at_0_and_never_negative() -> None:
    assert _step(explained_share=0.0)._explained_share is None
    with pytest.raises(SettingsError, match="step_cpu_wait_share must be >= 0"):
        ZScoreSettings(step_cpu_wait_share=-0.1)


def test_a_finding_needs_its_rise_to_last_min_duration_s() -> None:
    """Steps of 10 ms: a rise of 10 steps (0.1 s) fires with the step count alone, not
    with a 0.5 s floor; a rise that lasts fires once its first and latest out-of-band
    values are 0.5 s apart (51 steps in)."""
    values = [0.01] * 100 + [0.02] * 10 + [0.01] * 100 + [0.02] * 100
    ts = [0.01 * i for i in range(len(values))]

    def found(min_duration_s: float) -> list[int]:
        det = _step(persistence=3, std_floor_ratio=0.05, min_duration_s=min_duration_s)
        return [i for i, _ in det.observe_many(LABELS, ts, values)]

    assert found(0.0)[:1] == [102]
    assert found(0.5)[:1] == [210 + 50]


def test_a_rise_with_in_band_steps_between_is_one_finding_until_it_is_over() -> None:
    """Steps of 10 ms, then 100 steps of which every fourth is back in band: the rise is
    one finding from 0.5 s in until shortly after its end, though a single slow step
    still comes every 0.2 s after it. Needing the 0.5 s unbroken (a share of 1) finds
    nothing."""
    rise = [0.02, 0.02, 0.02, 0.0101] * 25
    values = [0.01] * 100 + rise + ([0.01] * 19 + [0.02]) * 10
    ts = [0.01 * i for i in range(len(values))]

    def found(share: float) -> list[int]:
        det = _step(persistence=3, std_floor_ratio=0.05, min_duration_s=0.5, min_out_share=share)
        return [i for i, _ in det.observe_many(LABELS, ts, values)]

    firing = found(0.7)
    assert 150 <= firing[0] <= 152  # the first slow step at least 0.5 s in
    assert firing == list(range(firing[0], firing[-1] + 1))  # one finding, never cleared
    end = 100 + len(rise)
    assert end + 3 <= firing[-1] < end + 40  # under 0.4 s, though a step in 20 is slow
    assert found(1.0) == []
    with pytest.raises(SettingsError, match="step_min_out_share"):
        ZScoreSettings(step_min_out_share=0.0)


def test_a_rise_mostly_in_band_is_named_by_its_level_and_over_when_it_is() -> None:
    """Steps of 10 ms with 10 % noise, then 5 s of a 1.22x rise whose steps mostly stay in
    the 2.5 sigma band: too few out of band for the share, but most of every second above
    1.5 sigma. The level test names it within 1.5 s, holds it to the end (the baseline
    does not follow the rise) and lets it go within 1 s of its end."""
    rng = random.Random(7)
    before = [rng.gauss(0.010, 0.001) for _ in range(300)]
    rise = [rng.gauss(0.0122, 0.001) for _ in range(500)]
    after = [rng.gauss(0.010, 0.001) for _ in range(300)]
    values = before + rise + after
    ts = [0.01 * i for i in range(len(values))]

    def firing(level_window_s: float) -> list[int]:
        det = _step(
            robust=True,
            std_floor_ratio=0.065,
            min_duration_s=0.5,
            level_window_s=level_window_s,
        )
        found = det.observe_many(LABELS, ts, values)
        if found:
            assert "has risen to" in found[0][1].summary
        return sorted({i for i, _ in found})

    steps = firing(1.0)
    assert 300 < steps[0] <= 450
    assert steps == list(range(steps[0], steps[-1] + 1))  # one finding
    assert 800 <= steps[-1] < 900
    assert len(firing(0.0)) < 50


def _hiccups() -> dict[str, list[list[float]]]:
    path = Path(__file__).parent / "data" / "detection" / "step_time_clean_hiccups.json"
    runs: dict[str, list[list[float]]] = json.loads(path.read_text())["runs"]
    return runs


def _step_time_detector(settings: ZScoreSettings) -> StepTimeDetector:
    return StepTimeDetector(settings)


@pytest.mark.parametrize("run", ["seed30_steps_1_600", "seed53_steps_2000_2450"])
def test_a_busy_hosts_hiccups_of_a_few_tenths_of_a_second_are_no_anomaly(run: str) -> None:
    """Recorded clean 2-rank jobs (10 ms steps on two shared cores, a bursty CPU
    burner): runs of 10-12 steps at 1.5-5x the usual step time, which the CPU wait does
    not explain, set Step Time Anomaly off live. The default 0.5 s floor keeps them
    quiet; without it they fire."""
    rows = _hiccups()[run]
    ts = [row[1] for row in rows]
    values = [row[2] for row in rows]
    waits = [math.nan if row[3] is None else row[3] for row in rows]
    quiet = _step_time_detector(ZScoreSettings())
    assert quiet.observe_many(LABELS, ts, values, waits) == []
    twitchy = _step_time_detector(ZScoreSettings(step_min_duration_s=0.0))
    assert twitchy.observe_many(LABELS, ts, values, waits) != []


def _regression_run(seed: int) -> tuple[list[list[Any]], int, int]:
    path = Path(__file__).parent / "data" / "detection" / "step_time_regression_1.3x.json"
    run = json.loads(path.read_text())["runs"][f"seed{seed}"]
    return run["steps"], run["onset_step"], run["end_step"]


def _firing_steps(rows: list[list[Any]], settings: ZScoreSettings) -> list[int]:
    """The steps at which step time's detector had a finding, fed ``rows`` as the
    aggregator feeds it (job step time, the most CPU wait of any rank)."""
    det = _step_time_detector(settings)
    found = det.observe_many(
        LABELS,
        [row[1] for row in rows],
        [row[2] for row in rows],
        [math.nan if row[3] is None else row[3] for row in rows],
    )
    return sorted({rows[i][0] for i, _ in found})


@pytest.mark.parametrize("seed", [57, 58, 59])
def test_a_1_3x_regression_near_the_top_of_the_band_is_named_and_stays_named(seed: int) -> None:
    """Recorded 1.3x regressions of benchmarks/detection.py at ~36-39 ms steps: in-band
    steps come between the slow ones. Named within 20 steps, firing through at least
    80 % of the regression, nothing before it, and over within 20 steps of its end."""
    rows, onset, end = _regression_run(seed)
    steps = _firing_steps(rows, ZScoreSettings())
    assert steps and onset <= steps[0] <= onset + 20
    inside = [step for step in steps if onset <= step < end]
    assert len(inside) >= 0.8 * (end - onset)
    assert max(steps) < end + 20


@pytest.mark.parametrize("seed", [57, 58])
def test_out_of_band_steps_need_not_come_unbroken(seed: int) -> None:
    """Without the level test, the out-of-band share alone names seeds 57's and 58's
    regressions; needing every step out of band (a share of 1), the live aggregator
    named seed 57's late and seed 58's never."""
    rows, onset, end = _regression_run(seed)
    steps = _firing_steps(rows, ZScoreSettings(step_level_window_s=0))
    assert steps and onset <= steps[0] <= onset + 20
    assert len([step for step in steps if onset <= step < end]) >= 0.8 * (end - onset)
    unbroken = _firing_steps(rows, ZScoreSettings(step_min_out_share=1.0, step_level_window_s=0))
    assert not unbroken or unbroken[0] >= steps[0] + 5  # later, or never


def test_a_rise_that_half_sits_in_band_needs_the_level_test() -> None:
    """Held-out seed 59's regression (1.30x measured at ~39 ms steps, noise ~12 % of the
    step): half its steps are in band and the out-of-band share never holds for 0.5 s.
    The level test (most of the latest second above 1.5 sigma) names it; without it,
    nothing does, and a line 2 sigma up is too high for it."""
    rows, onset, end = _regression_run(59)
    assert _firing_steps(rows, ZScoreSettings(step_level_window_s=0)) == []
    steps = _firing_steps(rows, ZScoreSettings(step_level_sigmas=2.0))
    assert len([step for step in steps if onset <= step < end]) < 0.5 * (end - onset)


@pytest.mark.parametrize("run", ["seed30_steps_1_600", "seed53_steps_2000_2450"])
def test_the_level_test_leaves_a_busy_hosts_hiccups_alone(run: str) -> None:
    """The clean jobs' runs of slow steps do not move the level of their latest second:
    quiet at the defaults, and with a line as low as 0.5 sigma."""
    rows = _hiccups()[run]
    assert _firing_steps(rows, ZScoreSettings()) == []
    assert _firing_steps(rows, ZScoreSettings(step_level_sigmas=0.5)) == []


def test_a_third_of_a_second_is_too_short_a_level_window_for_a_busy_hosts_hiccups() -> None:
    """Seed 53's hiccups fill most of a 0.3 s window: at 0.3 s the level test fires in
    that clean job, at the default 1 s it does not. (Seed 30's set off a 0.5 s window
    too while the values the CPU wait accounts for stayed out of the level window.)"""
    rows = _hiccups()["seed53_steps_2000_2450"]
    assert _firing_steps(rows, ZScoreSettings(step_level_window_s=0.3)) != []
    assert _firing_steps(rows, ZScoreSettings()) == []


def test_a_busy_spell_the_cpu_wait_accounts_for_is_no_anomaly() -> None:
    """Held-out seed 68's clean 2-rank job: beside a CPU burner, about 70 steps (1 s) ran
    1.3-2x slower. The CPU wait accounts for most steps' rise, not for a third of them
    one by one (a rank's wait at the end of its step holds its peer up in the next). The
    live aggregator named those scattered steps as a rise and fired; replayed from step
    4400 that code fires at 4842. Values the wait accounts for now count as in band in
    the span and below the line in the level window: quiet. Without the CPU wait figures
    the same spell is an anomaly."""
    path = Path(__file__).parent / "data" / "detection" / "step_time_clean_busy_spell.json"
    rows = json.loads(path.read_text())["steps"]
    assert _firing_steps(rows, ZScoreSettings()) == []
    unknown = [[step, ts, value, None] for step, ts, value, _ in rows]
    steps = _firing_steps(unknown, ZScoreSettings())
    assert steps and 4795 <= steps[0] <= 4870


def test_scattered_steps_the_known_cause_does_not_explain_are_no_rise() -> None:
    """A long busy spell: every step 40 % slower, three in four with 30 ms more CPU wait
    than usual, the fourth with none. The unexplained quarter is no span (0.25 of the
    judged values, under ``min_out_share``) and does not move the level; with no wait
    anywhere the same spell fires."""

    def found(waits: list[float]) -> list[int]:
        det = StepTimeDetector(ZScoreSettings())
        values = [0.1] * 300 + [0.14] * 200
        ts = [0.01 * i for i in range(len(values))]
        return [i for i, _ in det.observe_many(LABELS, ts, values, [0.0] * 300 + waits)]

    assert found([0.0 if i % 4 == 3 else 0.03 for i in range(200)]) == []
    assert found([0.0] * 200)[:1] != []


# -- shown, then paged (step_page_steps, step_page_min_s) ----------------------------------


@pytest.mark.parametrize("seed", [57, 58, 59])
def test_a_recorded_1_3x_regression_pages_within_twice_the_persistence(seed: int) -> None:
    """The recorded 1.3x regressions (~36-39 ms steps, 100 steps): shown after 11-15
    steps, paged after 32-33 (``step_page_steps`` 32; 1 s is ~27 of these steps), never
    before the onset nor 20 steps after the end."""
    rows, onset, end = _regression_run(seed)
    det = _step_time_detector(ZScoreSettings())
    found = det.observe_many(
        LABELS,
        [row[1] for row in rows],
        [row[2] for row in rows],
        [math.nan if row[3] is None else row[3] for row in rows],
    )
    shown = [rows[i][0] for i, _ in found]
    paged = [rows[i][0] for i, f in found if f.details["page"]]
    assert onset <= shown[0] < paged[0] <= onset + 2 * 32
    assert paged[0] >= onset + 32 - 1  # 32 slow steps at the least
    assert all(onset <= step < end + 20 for step in paged)


def test_a_finding_pages_once_it_lasted_and_stays_paged_until_it_clears() -> None:
    """0.1 s steps 2x slower: shown from the 5th slow step (0.5 s), ``page`` False and
    said so in the summary until the 32nd, then True, through in-band steps too, until
    the finding clears; the next rise starts unpaged again."""
    det = _step_time_detector(ZScoreSettings())
    values = [0.1] * 50 + [0.2] * 40 + [0.1, 0.2] * 3 + [0.1] * 20 + [0.2] * 10
    found = dict(det.observe_many(LABELS, [100.0 + 0.1 * i for i in range(len(values))], values))
    first = min(found)
    assert first == 50 + 5
    assert [found[i].details["page"] for i in range(first, 50 + 31)] == [False] * 26
    assert found[50 + 30].summary.endswith("(for 31 steps so far: it pages if it lasts)")
    assert found[50 + 30].details["rise_steps"] == 31
    assert all(found[i].details["page"] for i in range(50 + 31, 96))
    assert "pages if it lasts" not in found[50 + 31].summary
    assert max(i for i in found if i < 116) < 105  # cleared within 0.5 s back in band
    again = [found[i] for i in found if i >= 116]
    assert again and not any(f.details["page"] for f in again)


def test_with_no_persistence_a_finding_pages_as_soon_as_it_is_shown() -> None:
    det = _step_time_detector(ZScoreSettings(step_page_steps=0, step_page_min_s=0.0))
    values = [0.1] * 50 + [0.2] * 10
    found = det.observe_many(LABELS, [100.0 + 0.1 * i for i in range(len(values))], values)
    assert found and all(f.details["page"] for _, f in found)
    assert found[0][0] == 50 + 5
