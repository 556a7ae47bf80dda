"""The report's plots show the events they exist to show (issue 48): read from the SVG
matplotlib writes, as a browser would (``<text>`` elements, the paths' vertices, the
gids the plots give their artists).

The job in these tests: 2 ranks (or 1 000), 300 steps of 28 ms, 1 s apart... except a
straggler (rank 1 computes 60 ms from step 40 to 120), one 8 s hang at step 200, and
steps 250-259 never recorded."""

from __future__ import annotations

import re
import time
import xml.etree.ElementTree as ET
from dataclasses import replace

import numpy as np
import pytest

from torshmon.report.model import (
    AlertItem,
    ConfigChange,
    JobReport,
    RankSeries,
    RankStats,
    TrialItem,
)
from torshmon.report.plots import MAX_LINES, plots
from torshmon.report.series import MAX_POINTS, rank_series

T0 = 1_700_000_000.0
STEPS = 300
HANG_STEP = 200
GAP = range(250, 260)
_NS = "{http://www.w3.org/2000/svg}"


def _rank(rank: int, *, straggler: bool) -> tuple[RankSeries, RankStats]:
    steps, times, step_s, compute_s, ratio = [], [], [], [], []
    clock = T0
    for step in range(1, STEPS + 1):
        slow = 40 <= step < 120
        duration = 8.0 if step == HANG_STEP else (0.060 if slow else 0.028)
        compute = 0.060 if slow and straggler else 0.020
        if step == HANG_STEP and straggler:
            compute = 8.0
        clock += duration + 1.0
        if step in GAP:
            continue
        steps.append(step)
        times.append(clock)
        step_s.append(duration)
        compute_s.append(compute)
        ratio.append(1 - compute / duration)
    series = RankSeries(
        rank=rank,
        time_unix_s=tuple(times),
        step=tuple(steps),
        duration_s=tuple(step_s),
        compute_s=tuple(compute_s),
        comm_ratio=tuple(ratio),
    )
    stats = RankStats(
        rank=rank,
        node="vm",
        steps=len(steps),
        last_step=steps[-1],
        median_step_s=float(np.median(step_s)),
        p95_step_s=float(np.quantile(step_s, 0.95)),
        median_compute_s=float(np.median(compute_s)) + (0.001 if straggler else 0.0),
        median_comm_wait_s=None,
        median_comm_ratio=float(np.median(ratio)),
        median_samples_per_s=None,
    )
    return series, stats


def _report(world: int = 2) -> JobReport:
    made = [_rank(r, straggler=r == 1) for r in range(world)]
    series = tuple(s for s, _ in made)
    last = max(series[0].time_unix_s)
    straggler_from = series[1].time_unix_s[series[1].step.index(40)]
    straggler_to = series[1].time_unix_s[series[1].step.index(120)]
    alert = AlertItem(
        id=7, rule="Straggler", severity="high", state="resolved", rank=1,
        summary="rank 1 computes 3x slower", recommendation="", value=3.0,
        starts_at_unix_s=straggler_from, fired_at_unix_s=straggler_from,
        ends_at_unix_s=straggler_to,
    )  # fmt: skip
    trial_at = series[0].time_unix_s[series[0].step.index(150)]
    trial = TrialItem(
        session_id="s1", trial_index=1, codec="fp16", bucket_cap_mb=25.0,
        config_text="fp16, bucket 25 MB", score=900.0, decision="kept", reason="",
        started_unix_s=trial_at,
    )  # fmt: skip
    return JobReport(
        job="j", world_size=world, backend="gloo", first_seen_unix_s=T0,
        last_seen_unix_s=last, generated_unix_s=last + 1, running=False,
        steps_read=STEPS * world, steps_truncated=False, ranks=tuple(s for _, s in made),
        phases=(), series=series, memory=(), alerts=(alert,), findings=(), sessions=(),
        trials=(trial,),
    )  # fmt: skip


def _svg(report: JobReport, name: str = "step_time") -> ET.Element:
    return ET.fromstring(plots(report)[name])


def _by_id(root: ET.Element, gid: str) -> ET.Element:
    found = root.find(f".//*[@id='{gid}']")
    assert found is not None, gid
    return found


def _texts(element: ET.Element) -> list[str]:
    return ["".join(t.itertext()).strip() for t in element.iter(f"{_NS}text")]


def _axis(root: ET.Element, label: str) -> list[float]:
    """The tick values of the axis labelled ``label`` (its last <text>)."""
    for g in root.iter(f"{_NS}g"):
        if g.get("id", "").startswith("matplotlib.axis_"):
            texts = _texts(g)
            if texts and texts[-1] == label:
                return [float(t.replace("\u2212", "-")) for t in texts[:-1]]
    raise AssertionError(f"no axis labelled {label!r}")


def _vertices(element: ET.Element) -> list[list[tuple[float, float]]]:
    """The path's runs of joined vertices (a new M starts a new run)."""
    path = element.find(f".//{_NS}path")
    assert path is not None
    runs: list[list[tuple[float, float]]] = []
    for op, x, y in re.findall(r"([ML])\s*([-\d.]+)\s+([-\d.]+)", path.get("d", "")):
        if op == "M":
            runs.append([])
        runs[-1].append((float(x), float(y)))
    return runs


def test_the_x_axis_is_the_step_and_time_is_on_a_second_axis() -> None:
    root = _svg(_report())
    ticks = _axis(root, "step")
    assert ticks[0] <= 1 and 300 <= ticks[-1] <= 350  # the run's steps, 1 to 300
    # the top axis: seconds since the start (300 steps of ~1 s, a 8 s hang: ~320 s)
    seconds = _axis(root, "time since the job started (s)")
    assert 300 <= seconds[-1] <= 400


def test_an_8_s_hang_is_marked_on_the_edge_and_the_typical_range_stays_readable() -> None:
    root = _svg(_report())
    ticks = _axis(root, "step time (ms)")
    # the axis ends near the typical values (28 ms, the straggler's 60 ms), not at 8 000
    assert 60 <= max(ticks) <= 120
    marker = _by_id(root, "duration_s-outliers")
    assert "step 200: 8 s on rank" in marker.findtext(f"{_NS}title", "")
    assert _texts(_by_id(root, "duration_s-outlier-step-200")) == ["step 200: 8 s (rank 0)"]
    # the compute plot marks the straggler's hang on rank 1
    assert _texts(_by_id(root, "compute_s-outlier-step-200")) == ["step 200: 8 s (rank 1)"]


def test_a_hang_and_a_gap_are_not_joined_by_a_line() -> None:
    root = _svg(_report())
    runs = _vertices(_by_id(root, "step-time-rank-0"))
    # three pieces: 1-199, 201-249, 260-300 (step 200 above the axis, 250-259 missing)
    assert len(runs) == 3
    (a0, a1), (b0, b1), (c0, c1) = ((r[0][0], r[-1][0]) for r in runs)
    per_step = (c1 - a0) / (300 - 1)
    assert (a1 - a0) / per_step == pytest.approx(199 - 1, abs=0.5)
    assert (b0 - a1) / per_step == pytest.approx(2, abs=0.5)  # 199 to 201
    assert (c0 - b1) / per_step == pytest.approx(11, abs=0.5)  # 249 to 260
    assert _texts(_by_id(root, "step-time-gap-249-260")) == ["no steps 250-259"]


def test_an_alert_span_is_labelled_with_its_rule_and_rank() -> None:
    root = _svg(_report())
    assert _texts(_by_id(root, "alert-label-7")) == ["Straggler rank 1"]
    title = _by_id(root, "alert-span-7").findtext(f"{_NS}title", "")
    assert title.startswith("Straggler rank 1 (high): steps 40-120")


def test_a_config_change_is_marked_with_what_changed() -> None:
    root = _svg(_report())
    assert _texts(_by_id(root, "config-s1-1-label")) == ["#1 fp16, bucket 25 MB"]
    title = _by_id(root, "config-s1-1").findtext(f"{_NS}title", "")
    assert title.startswith("step 150, ") and "trial 1 applies fp16, bucket 25 MB (kept)" in title


def test_each_config_version_applied_is_marked_at_its_step_rollbacks_too() -> None:
    report = _report()
    at = {s: t for s, t in zip(report.series[0].step, report.series[0].time_unix_s, strict=True)}
    configs = (
        ConfigChange(2, 150, at[150], "fp16, bucket 25 MB"),  # the trial above
        ConfigChange(3, 180, at[180], "none, bucket 25 MB"),  # the tuner rolls back
    )
    root = _svg(replace(report, configs=configs))
    assert _texts(_by_id(root, "config-v2-label")) == ["v2 (autotuner trial 1): fp16, bucket 25 MB"]
    assert _texts(_by_id(root, "config-v3-label")) == ["v3: none, bucket 25 MB"]
    hover = _by_id(root, "config-v2").findtext(f"{_NS}title", "")
    assert hover.startswith("step 150, ") and hover.endswith(
        "config version 2 applied, fp16, bucket 25 MB (autotuner trial 1, kept)"
    )
    assert root.find(".//*[@id='config-s1-1']") is None  # the versions, not the trials


def test_a_config_the_user_asked_for_is_named_as_theirs_beside_the_tuners() -> None:
    report = _report()
    at = {s: t for s, t in zip(report.series[0].step, report.series[0].time_unix_s, strict=True)}
    configs = (
        ConfigChange(2, 150, at[150], "fp16, bucket 25 MB", "autotuner trial 1"),
        ConfigChange(3, 180, at[180], "none, bucket 4 MB", "you, via the API"),
        ConfigChange(4, 220, at[220], "bf16, bucket 25 MB", "you, in the training script"),
    )
    root = _svg(replace(report, configs=configs))
    assert _texts(_by_id(root, "config-v3-label")) == ["v3 (you, via the API): none, bucket 4 MB"]
    assert _texts(_by_id(root, "config-v4-label")) == [
        "v4 (you, in the training script): bf16, bucket 25 MB"
    ]
    assert (
        _by_id(root, "config-v3")
        .findtext(f"{_NS}title", "")
        .endswith("config version 3 applied, none, bucket 4 MB (you, via the API)")
    )
    assert (
        _by_id(root, "config-v2").findtext(f"{_NS}title", "").endswith("(autotuner trial 1, kept)")
    )


LONG_STEPS = 5_000
LONG_HANG_STEP = 3_217


def _long_run_series(rank: int) -> RankSeries:
    """5 000 steps of ~30 ms (with a little jitter) and, on rank 0, one 6 s step."""
    steps = np.arange(1, LONG_STEPS + 1, dtype=float)
    duration = 0.030 + 0.002 * np.sin(steps)
    if rank == 0:
        duration[LONG_HANG_STEP - 1] = 6.0
    ends = T0 + np.cumsum(duration)
    return rank_series(
        rank,
        {
            "step": steps,
            "end_unix_ns": ends * 1e9,
            "duration_s": duration,
            "compute_s": duration * 0.8,
            "communication_time_ratio": np.full(LONG_STEPS, 0.2),
        },
    )


def test_a_long_runs_points_keep_each_spans_longest_step() -> None:
    series = _long_run_series(0)
    assert len(series.step) <= MAX_POINTS < LONG_STEPS
    # the medians lose the hang: no point is near 6 s
    assert max(v for v in series.duration_s if v is not None) < 0.05
    # each span's peak keeps it, at its own step
    assert max(series.duration_peak) == (6.0, LONG_HANG_STEP)
    assert max(series.compute_peak) == (pytest.approx(4.8), LONG_HANG_STEP)
    assert len(series.duration_peak) == len(series.step)
    # a short run's points are its steps: no peaks to keep
    assert _rank(0, straggler=False)[0].duration_peak == ()


def test_a_one_step_hang_in_a_5000_step_run_is_marked_and_labelled() -> None:
    report = _report()
    long = tuple(_long_run_series(r) for r in range(2))
    root = _svg(replace(report, series=long, alerts=(), trials=()))
    assert _texts(_by_id(root, f"duration_s-outlier-step-{LONG_HANG_STEP}")) == [
        f"step {LONG_HANG_STEP}: 6 s (rank 0)"
    ]
    assert max(_axis(root, "step time (ms)")) < 200  # the 30 ms steps stay readable


def test_a_thousand_ranks_render_as_bands_and_the_worst_ranks_in_bounded_time() -> None:
    report = _report(1000)
    started = time.perf_counter()
    figures = plots(report)
    elapsed = time.perf_counter() - started
    assert elapsed < 20.0, elapsed
    assert sum(len(svg) for svg in figures.values()) < 1_500_000
    root = ET.fromstring(figures["step_time"])
    lines = {g.get("id") for g in root.iter(f"{_NS}g") if "time-rank-" in g.get("id", "")}
    # the straggler (rank 1, the largest median compute) is among the lines drawn
    assert "compute-time-rank-1" in lines and len(lines) <= 2 * MAX_LINES
    _by_id(root, "compute_s-band-all")
    _by_id(root, "compute_s-band-p10-p90")
    assert _texts(_by_id(root, "compute_s-outlier-step-200")) == ["step 200: 8 s (rank 1)"]
    # the median of all ranks breaks at the hang (above the axis) and at the missing steps
    assert len(_vertices(_by_id(root, "duration_s-median"))) == 3
    # the straggler's 60 ms stays on the axis though 999 ranks compute in 20 ms
    assert max(_axis(root, "compute time (ms)")) >= 60
