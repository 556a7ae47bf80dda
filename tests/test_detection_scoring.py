"""The detection benchmark's scoring (benchmarks/_scoring.py) on made-up alert timelines:
what counts as caught, as excused, as false."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks._scoring import (
    GRACE,
    SYMPTOM_GRACE_S,
    Episode,
    FiredAlert,
    coverage,
    grace_s,
    measured_ratio,
    min_magnitude_detected,
    score_run,
    summarize,
)
from tests.benchmark_loader import BENCHMARKS

T0 = 1_000_000.0  # the fault's onset, Unix seconds
STEP_S = 0.03  # the fault jobs' step period


def straggler(
    rank: int = 1, magnitude: float = 1.5, start: float = T0, onset_step: int = 100
) -> Episode:
    return Episode(
        "straggler",
        "straggler steady 4 ranks",
        magnitude,
        rank,
        onset_step,
        ((start, start + 20),),
        step_period_s=STEP_S,
    )


def test_an_alert_naming_a_healthy_rank_in_its_old_episodes_grace_is_false() -> None:
    """Episode A slowed rank 0 and ended 2 s ago (the old 10 s grace would still hold);
    episode B slows rank 1 now. A Straggler alert naming rank 0 during B is a page naming
    a healthy rank: false, B's wrong-rank alert, and no second detection of A."""
    a = Episode("straggler", "s", 1.5, 0, 100, ((T0, T0 + 3),), step_period_s=STEP_S)
    b = Episode("straggler", "s", 1.5, 1, 250, ((T0 + 5, T0 + 8),), step_period_s=STEP_S)
    right_a = FiredAlert("Straggler", 0, T0 + 0.15, T0 + 3.5, first_step=104)
    right_b = FiredAlert("Straggler", 1, T0 + 5.15, T0 + 8.5, first_step=254)
    healthy = FiredAlert("Straggler", 0, T0 + 6, T0 + 7, first_step=283)
    run = score_run([a, b], [right_a, right_b, healthy], run_end_unix_s=T0 + 60)
    score_a, score_b = run.episodes
    assert score_a.right == [right_a] and score_a.precise
    assert score_b.right == [right_b]
    assert score_b.wrong_rank == [healthy] and score_b.named is False and not score_b.precise
    summary = summarize([run], [], [])
    assert (summary.true_units, summary.false_units) == (1, 1)
    assert summary.attribution == 0.5
    # Without A in the plan the same alert is false too: the plan cannot make it right.
    alone = score_run([b], [right_b, healthy], run_end_unix_s=T0 + 60)
    assert alone.episodes[0].wrong_rank == [healthy]
    assert summarize([alone], [], []).precision_runs == 0.0


def test_a_straggler_alert_naming_a_rank_with_no_episode_is_false_between_episodes() -> None:
    """Between two episodes of rank 0 (past A's grace, before B's onset) no episode acts:
    the alert is false, though both episodes are near (filed with A, whose job-wide
    symptoms would still be excused then)."""
    a = Episode("straggler", "s", 1.5, 0, 100, ((T0, T0 + 3),), step_period_s=STEP_S)
    b = Episode("straggler", "s", 1.5, 0, 250, ((T0 + 8, T0 + 11),), step_period_s=STEP_S)
    between = FiredAlert("Straggler", 0, T0 + 3 + 6 * STEP_S)  # 6 steps after A's end
    run = score_run([a, b], [between], run_end_unix_s=T0 + 60)
    assert not run.episodes[0].detected and not run.episodes[1].detected
    assert run.episodes[0].false == [between] and run.outside == []
    assert summarize([run], [], []).precision_runs == 0.0


def test_the_grace_is_a_few_steps_for_stragglers_and_longer_for_hangs_and_leaks() -> None:
    assert grace_s("straggler", STEP_S) == pytest.approx(5 * STEP_S)
    assert grace_s("regression", 0.1) == pytest.approx(0.5)
    assert grace_s("hang", STEP_S) == 5.0
    assert grace_s("memory-leak", 0.1) == 15.0
    assert all(steps <= 5 for steps, _ in GRACE.values())
    ep = straggler()
    end = T0 + 20
    in_grace = FiredAlert("Straggler", 1, end + 4.9 * STEP_S, first_step=220)
    past = FiredAlert("Straggler", 1, end + 5.1 * STEP_S, first_step=221)
    assert score_run([ep], [in_grace], run_end_unix_s=T0 + 60).episodes[0].detected
    late = score_run([ep], [past], run_end_unix_s=T0 + 60)
    assert not late.episodes[0].detected and late.episodes[0].false == [past]
    hang = Episode("hang", "hang", 10.0, 1, 80, ((T0, T0 + 10),), step_period_s=0.05)
    after = FiredAlert("Hung Collective", 1, T0 + 14)
    assert score_run([hang], [after], run_end_unix_s=T0 + 60).episodes[0].detected


def test_the_onset_slack_is_one_step_and_an_earlier_alert_is_false() -> None:
    """An alert within one step period before the onset detects it with latency 0 steps
    and a negative latency in seconds (never clamped); one earlier is false."""
    ep = straggler()
    just = FiredAlert("Straggler", 1, T0 - 0.8 * STEP_S, first_step=99)
    early = FiredAlert("Straggler", 1, T0 - 1.2 * STEP_S, T0 - 0.5 * STEP_S, first_step=98)
    run = score_run([ep], [just], run_end_unix_s=T0 + 60)
    assert run.episodes[0].latency_steps == 0
    assert run.episodes[0].latency_s == pytest.approx(-0.8 * STEP_S)
    run = score_run([ep], [early], run_end_unix_s=T0 + 60)
    assert not run.episodes[0].detected and run.outside == [early]
    # 0.5 s before the onset (the old slack, ~17 steps) is false as well.
    half = FiredAlert("Straggler", 1, T0 - 0.5, first_step=84)
    assert score_run([ep], [half], run_end_unix_s=T0 + 60).outside == [half]


def test_the_right_rule_naming_the_right_rank_in_the_window_detects() -> None:
    alert = FiredAlert("Straggler", 1, T0 + 1.5, T0 + 21, first_step=104)
    run = score_run([straggler()], [alert], run_end_unix_s=T0 + 60)
    score = run.episodes[0]
    assert score.detected and score.named is True and score.precise
    assert score.latency_s == pytest.approx(1.5)
    assert score.latency_steps == 5  # steps 100..104 seen when it fired
    assert run.outside == []


def test_a_wrong_rank_alert_is_a_miss_and_a_false_alert() -> None:
    alert = FiredAlert("Straggler", 0, T0 + 1.5, T0 + 21)
    run = score_run([straggler(rank=1)], [alert], run_end_unix_s=T0 + 60)
    score = run.episodes[0]
    assert not score.detected
    assert score.named is False
    assert score.wrong_rank == [alert] and not score.precise
    summary = summarize([run], [], [])
    assert summary.recall == 0.0
    assert summary.attribution == 0.0
    assert summary.precision_runs == 0.0  # one false unit, no true one


def test_a_wrong_rank_alert_beside_the_right_one_detects_but_is_not_precise() -> None:
    right = FiredAlert("Straggler", 1, T0 + 1, T0 + 21)
    wrong = FiredAlert("Straggler", 2, T0 + 2, T0 + 5)
    run = score_run([straggler(rank=1)], [right, wrong], run_end_unix_s=T0 + 60)
    score = run.episodes[0]
    assert score.detected and score.named is False and not score.precise
    assert summarize([run], [], []).precision_runs == 0.0


def test_a_job_wide_symptom_is_excused_only_inside_its_window() -> None:
    inside = FiredAlert("Step Time Anomaly", None, T0 + 20 + SYMPTOM_GRACE_S - 1)
    late = FiredAlert("Step Time Anomaly", None, T0 + 20 + SYMPTOM_GRACE_S + 1)
    early = FiredAlert("Step Time Anomaly", None, T0 - 5)
    run = score_run([straggler()], [early, inside, late], run_end_unix_s=T0 + 90)
    assert run.episodes[0].symptoms == [inside]
    assert run.outside == [early, late]


def test_the_expected_rule_before_the_onset_or_after_the_grace_is_false() -> None:
    early = FiredAlert("Straggler", 1, T0 - 3, T0 - 1)
    late = FiredAlert("Straggler", 1, T0 + 20 + 2)
    run = score_run([straggler()], [early, late], run_end_unix_s=T0 + 90)
    assert not run.episodes[0].detected
    assert run.outside == [early]
    # 2 s after the end: past a straggler's grace, inside the symptom window, so filed
    # with the episode as a false alert (it is no symptom: it names a rank).
    assert run.episodes[0].false == [late]
    assert summarize([run], [], []).precision_runs == 0.0


def test_another_rule_inside_the_window_is_false_for_that_episode() -> None:
    leak = FiredAlert("Memory Leak", 1, T0 + 3)
    right = FiredAlert("Straggler", 1, T0 + 1)
    run = score_run([straggler()], [right, leak], run_end_unix_s=T0 + 60)
    assert run.episodes[0].detected and run.episodes[0].false == [leak]


def test_a_rank_symptom_must_name_the_faulted_rank() -> None:
    leak = Episode("memory-leak", "memory leak", 4.0, 0, 50, ((T0, T0 + 30),))
    own = FiredAlert("Straggler", 0, T0 + 10)
    other = FiredAlert("Straggler", 1, T0 + 12)
    run = score_run([leak], [own, other], run_end_unix_s=T0 + 60)
    assert run.episodes[0].symptoms == [own]
    assert run.episodes[0].false == [other]


def test_a_job_wide_fault_takes_any_rank() -> None:
    regression = Episode("regression", "regression", 2.0, None, 80, ((T0, T0 + 10),))
    alerts = [FiredAlert("Step Time Anomaly", r, T0 + 2 + r) for r in range(3)]
    run = score_run([regression], alerts, run_end_unix_s=T0 + 30)
    score = run.episodes[0]
    assert score.detected and score.named is None and len(score.right) == 3
    assert score.latency_s == pytest.approx(2.0)


def test_precision_counts_units_not_alerts() -> None:
    # Episode A: caught, with ten extra right alerts (one per re-fire): one true unit.
    # Episode B: caught, with one false alert inside its window: one false unit.
    # A clean job with two alerts: one false unit; a clean job with none: no unit.
    a = straggler(rank=1, start=T0)
    b = straggler(rank=2, start=T0 + 100)
    alerts = [FiredAlert("Straggler", 1, T0 + 1 + i * 0.5, T0 + 1.2 + i * 0.5) for i in range(10)]
    alerts += [FiredAlert("Straggler", 2, T0 + 101), FiredAlert("Loss Spike", 0, T0 + 105)]
    run = score_run([a, b], alerts, run_end_unix_s=T0 + 200)
    clean = [[FiredAlert("Straggler", 0, T0 + 500), FiredAlert("Straggler", 1, T0 + 501)], []]
    summary = summarize([run], clean, [])
    assert (summary.true_units, summary.false_units) == (1, 2)
    assert summary.precision_runs == pytest.approx(1 / 3)
    # a tuning session's alert is one more false unit
    assert summarize([run], clean, [[FiredAlert("Memory Leak", 0, T0)]]).false_units == 3


def test_false_alerts_between_episodes_count_once_for_the_job() -> None:
    alerts = [FiredAlert("Straggler", 1, T0 + 1), FiredAlert("Straggler", 0, T0 + 60)]
    alerts.append(FiredAlert("Step Time Anomaly", 0, T0 + 61))
    run = score_run([straggler()], alerts, run_end_unix_s=T0 + 90)
    assert len(run.outside) == 2
    assert summarize([run], [], []).precision_runs == pytest.approx(1 / 2)


def test_coverage_is_the_share_of_acting_time_with_a_right_alert_firing() -> None:
    # On 0..10 and 20..30 (intermittent); an alert firing 2..25 covers 8 + 5 of 20 s; a
    # second one from 28 that never resolves covers 2 more (to the run's end).
    periods = ((T0, T0 + 10), (T0 + 20, T0 + 30))
    alerts = [FiredAlert("Straggler", 1, T0 + 2, T0 + 25), FiredAlert("Straggler", 1, T0 + 28)]
    assert coverage(periods, alerts, T0 + 100) == pytest.approx(15 / 20)
    # overlapping firings are not counted twice
    twice = [FiredAlert("Straggler", 1, T0, T0 + 10), FiredAlert("Straggler", 1, T0 + 5, T0 + 10)]
    assert coverage(periods, twice, T0 + 100) == pytest.approx(10 / 20)


def test_an_alert_that_resolves_mid_fault_loses_coverage() -> None:
    ep = straggler()
    alert = FiredAlert("Straggler", 1, T0 + 2, T0 + 6)
    run = score_run([ep], [alert], run_end_unix_s=T0 + 60)
    assert run.episodes[0].coverage == pytest.approx(4 / 20)
    assert summarize([run], [], []).coverage_median == pytest.approx(0.2)


def test_coverage_after_the_alert_leaves_the_latency_out() -> None:
    """On 0..10 and 20..30; the alert fires at 4 and resolves at 25: 14 of 20 s from the
    onset, 11 of the 16 s acting after it fired."""
    ep = Episode("straggler", "s", 1.5, 1, 100, ((T0, T0 + 10), (T0 + 20, T0 + 30)))
    alert = FiredAlert("Straggler", 1, T0 + 4, T0 + 25)
    run = score_run([ep], [alert], run_end_unix_s=T0 + 60)
    assert run.episodes[0].coverage == pytest.approx(11 / 20)
    assert run.episodes[0].coverage_after_alert == pytest.approx(11 / 16)
    assert summarize([run], [], []).coverage_after_alert_median == pytest.approx(11 / 16)
    missed = score_run([ep], [], run_end_unix_s=T0 + 60)
    assert missed.episodes[0].coverage_after_alert is None


def test_an_alert_during_a_later_fault_of_the_same_rank_is_the_later_faults() -> None:
    """The first fault's grace (10 s) runs into the second one's start: an alert that
    fires while the second acts detects the second, not the first, late."""
    first = Episode("straggler", "s", 1.3, 0, 60, ((T0, T0 + 2),))
    second = Episode("straggler", "s", 2.0, 0, 170, ((T0 + 5, T0 + 7),))
    alert = FiredAlert("Straggler", 0, T0 + 5.3, T0 + 9, first_step=174)
    run = score_run([first, second], [alert], run_end_unix_s=T0 + 60)
    assert not run.episodes[0].detected
    assert run.episodes[1].detected and run.episodes[1].latency_steps == 5
    assert run.episodes[1].coverage == pytest.approx(1.7 / 2)


def test_an_alert_still_firing_from_an_earlier_fault_covers_the_next() -> None:
    first = Episode("straggler", "s", 2.0, 0, 60, ((T0, T0 + 2),))
    second = Episode("straggler", "s", 2.0, 0, 90, ((T0 + 3, T0 + 5),))
    alert = FiredAlert("Straggler", 0, T0 + 0.5, T0 + 4)  # one alert through both
    run = score_run([first, second], [alert], run_end_unix_s=T0 + 60)
    assert run.episodes[0].detected and run.episodes[0].coverage == pytest.approx(0.75)
    assert run.episodes[1].coverage == pytest.approx(0.5)


def test_out_of_scope_episodes_stay_out_of_recall() -> None:
    small = Episode("straggler", "s", 1.1, 1, 10, ((T0, T0 + 20),), in_scope=False)
    big = Episode("straggler", "s", 2.0, 1, 200, ((T0 + 100, T0 + 120),))
    run = score_run([small, big], [FiredAlert("Straggler", 1, T0 + 101)], run_end_unix_s=T0 + 200)
    summary = summarize([run], [], [])
    assert summary.recall == 1.0
    assert summary.recall_all == 0.5


def test_min_magnitude_needs_every_episode_from_there_up() -> None:
    def ep(magnitude: float, caught: bool) -> tuple[Episode, list[FiredAlert]]:
        start = T0 + 1000 * len(timeline)
        e = Episode("straggler", "s", magnitude, 1, 10, ((start, start + 20),))
        return e, [FiredAlert("Straggler", 1, start + 1)] if caught else []

    timeline: list[tuple[Episode, list[FiredAlert]]] = []
    for magnitude, caught in ((1.2, True), (1.3, False), (1.3, True), (1.5, True), (2.0, True)):
        timeline.append(ep(magnitude, caught))
    run = score_run(
        [e for e, _ in timeline], [a for _, al in timeline for a in al], run_end_unix_s=T0 + 9999
    )
    # 1.2 was caught, but one of the 1.3 episodes (another seed, or the on/off one) was not
    assert min_magnitude_detected(run.episodes) == 1.5
    assert min_magnitude_detected(run.episodes[:1]) == 1.2
    assert min_magnitude_detected([run.episodes[1]]) is None


def test_latency_is_reported_per_kind() -> None:
    """A fast straggler and a slow leak: each kind's median and worst, not one pool."""
    runs = []
    for i, (lat_steps, lat_s) in enumerate(((4, 0.12), (6, 0.18), (9, 0.27))):
        start = T0 + 100 * i
        ep = straggler(start=start, onset_step=100)
        alert = FiredAlert("Straggler", 1, start + lat_s, first_step=100 + lat_steps - 1)
        runs.append(score_run([ep], [alert], run_end_unix_s=start + 60))
    leak = Episode("memory-leak", "leak", 8.0, 0, 50, ((T0, T0 + 30),), step_period_s=0.1)
    runs.append(
        score_run(
            [leak], [FiredAlert("Memory Leak", 0, T0 + 11, first_step=160)], run_end_unix_s=T0 + 60
        )
    )
    by_kind = summarize(runs, [], []).latency_by_kind
    assert sorted(by_kind) == ["memory-leak", "straggler"]
    stragglers = by_kind["straggler"]
    assert (stragglers.median_steps, stragglers.worst_steps) == (6, 9)
    assert stragglers.median_s == pytest.approx(0.18)
    assert stragglers.worst_s == pytest.approx(0.27)
    assert (by_kind["memory-leak"].median_steps, by_kind["memory-leak"].worst_s) == (111, 11)


def test_coverage_counts_a_missed_episode_as_zero() -> None:
    caught = straggler(start=T0)
    missed = straggler(start=T0 + 100, onset_step=300)
    alert = FiredAlert("Straggler", 1, T0 + 2, T0 + 20, first_step=160)  # covers 18 of 20 s
    run = score_run([caught, missed], [alert], run_end_unix_s=T0 + 200)
    summary = summarize([run], [], [])
    assert summary.coverage_median == pytest.approx((0.9 + 0.0) / 2)
    assert summary.coverage_after_alert_median == pytest.approx(1.0)  # detected ones only


def test_the_measured_ratio_is_the_slow_ranks_compute_over_its_peers_median() -> None:
    """Rows (rank, step, compute_s): rank 1 takes 26 ms where its three peers take 20,
    21 and 22 ms (median 21), in the episode's steps; other steps and ranks missing a
    compute are left out."""
    rows: list[tuple[int, int, float | None]] = []
    for step in range(100, 110):
        rows += [(0, step, 0.020), (1, step, 0.026), (2, step, 0.021), (3, step, 0.022)]
    rows += [(1, 50, 0.1), (0, 50, 0.02), (1, 105, None)]
    assert measured_ratio(rows, 1, range(100, 110)) == pytest.approx(0.026 / 0.021)
    assert measured_ratio(rows, 1, range(200, 210)) is None


def test_the_magnitude_scored_is_the_measured_one() -> None:
    """Knob 1.2 measured 1.27, knob 1.3 measured 1.25: the smallest ratio from which on
    everything was caught is read on the measured scale."""

    def ep(knob: float, measured: float, caught: bool, i: int) -> tuple[Episode, list[FiredAlert]]:
        start = T0 + 1000 * i
        e = Episode("straggler", "s", knob, 1, 10, ((start, start + 20),), measured=measured)
        return e, [FiredAlert("Straggler", 1, start + 1)] if caught else []

    timeline = [ep(1.2, 1.27, True, 0), ep(1.3, 1.25, False, 1), ep(1.5, 1.52, True, 2)]
    run = score_run(
        [e for e, _ in timeline], [a for _, al in timeline for a in al], run_end_unix_s=T0 + 9999
    )
    assert min_magnitude_detected(run.episodes) == pytest.approx(1.27)


def test_the_sweep_plans_faults_that_parse_and_do_not_overlap() -> None:
    from benchmarks.detection import FAULT_STEPS, GAP_STEPS, SWEPT_KINDS, plan_jobs
    from torshmon.faults import KINDS, parse_fault

    for seed in (0, 1, 100):
        jobs = plan_jobs(KINDS, seed, quick=False)
        # every kind the benchmark offers is swept; none offered is left unplanned
        assert {e.kind for j in jobs for e in j.episodes} == set(SWEPT_KINDS)
        assert {j.name for j in jobs} >= {"timing-2", "timing-4", "hang", "memory-leak"}
        regressions = [e.magnitude for j in jobs for e in j.episodes if e.kind == "regression"]
        assert sorted(regressions) == [1.3, 2.0]  # each in a job of its own
        assert {j.name for j in jobs if j.name.startswith("regression")} == {
            "regression-1.3x",
            "regression-2x",
        }
        for job in jobs:
            episodes = sorted(job.episodes, key=lambda e: e.onset_step)
            for before, after in itertools.pairwise(episodes):
                assert after.onset_step - before.end_step >= GAP_STEPS
            for ep in episodes:
                faults = [parse_fault(s) for s in ep.specs]
                assert all(f.rank is None or f.rank < job.world_size for f in faults)
                assert faults[0].start_step == ep.onset_step
                assert job.steps > ep.end_step
            intermittent = [e for e in episodes if "on/off" in e.label]
            for ep in intermittent:  # periods of 10 slow steps, 10 normal between
                periods = [(f.start_step, f.stop_step or 0) for f in map(parse_fault, ep.specs)]
                assert [b - a for a, b in periods] == [10] * (FAULT_STEPS // 10 - 1)
                assert periods[-1][1] == ep.end_step
                assert periods[1][0] - periods[0][1] == 10
        timing = {j.name: j for j in jobs}
        for name in ("timing-2", "timing-4"):
            ratios = sorted(e.magnitude for e in timing[name].episodes if e.kind == "straggler")
            assert ratios == sorted([1.1, 1.2, 1.3, 1.5, 2.0, 3.0] * 2)


def test_the_report_sweep_runs_world_sizes_and_magnitudes_development_never_did() -> None:
    from benchmarks.detection import DEV, REPORT, plan_jobs
    from torshmon.faults import KINDS

    assert not set(REPORT.seeds) & set(DEV.seeds)
    assert all(seed > 101 for seed in REPORT.seeds)  # dev runs used seeds up to 101
    assert {3, 6, 8} <= set(REPORT.straggler_world_sizes) - set(DEV.straggler_world_sizes)
    assert set(REPORT.straggler_ratios) - set(DEV.straggler_ratios)
    jobs = {j.name: j for j in plan_jobs(KINDS, REPORT.seeds[0], quick=False, sweep=REPORT)}
    for world in REPORT.straggler_world_sizes:
        job = jobs[f"timing-{world}"]
        assert job.world_size == world
        ratios = sorted(e.magnitude for e in job.episodes)
        assert ratios == sorted(list(REPORT.straggler_ratios) * 2)
        assert all(e.rank is not None and e.rank < world for e in job.episodes)


def test_the_clean_jobs_noise_is_what_the_constants_say() -> None:
    """NoisyClock over 20 000 steps of one rank: jitter of the stated sigma, pauses,
    spells, hiccups and evaluations at their stated rates and sizes; evaluations at the
    same steps on every rank; sleeps it does not know pass through."""
    from benchmarks import detection as d

    slept: list[float] = []

    def run(rank: int, steps: int) -> tuple[Any, list[float], list[float], list[int]]:
        clock = d.NoisyClock(0.02, 0.002, seed=5, rank=rank)
        clock_time = _FakeTime(slept)
        computes, betweens, evals = [], [], []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(d, "time", clock_time)
            for _ in range(steps):
                slept.clear()
                clock.sleep(0.02)
                computes.append(slept[-1])
                before = clock.counts["evals"]
                clock.sleep(0.002)
                betweens.append(slept[-1])
                if clock.counts["evals"] > before:
                    evals.append(clock.step)
            clock.sleep(0.5)
            assert slept[-1] == 0.5
        return clock, computes, betweens, evals

    clock, computes, betweens, evals = run(0, 20_000)
    assert clock.counts["steps"] == 20_000
    ordinary = sorted(c for c in computes if c < 0.02 * 1.15)
    logs = [math.log(c / 0.02) for c in ordinary[len(ordinary) // 10 : -len(ordinary) // 10]]
    assert 0.7 * d.CLEAN_JITTER_SIGMA < statistics.pstdev(logs) / 0.66 < 1.3 * d.CLEAN_JITTER_SIGMA
    assert 20_000 / d.CLEAN_PAUSE_EVERY * 0.6 < clock.counts["pauses"] < 20_000 / 500 * 1.4
    assert max(computes) <= 0.02 * (1.5 * math.exp(4 * d.CLEAN_JITTER_SIGMA) + 6)
    assert 20_000 / d.CLEAN_SPELL_EVERY * 0.6 < clock.counts["spells"] < 20_000 / 400 * 1.4
    assert 20_000 / d.CLEAN_HICCUP_EVERY * 0.6 < clock.counts["hiccups"] < 20_000 / 200 * 1.4
    assert 20_000 / 600 <= clock.counts["evals"] <= 20_000 / 300 + 1
    assert max(betweens) <= 0.002 + 0.022 * (5 + 30)
    assert min(betweens) == 0.002
    _, _, _, evals_1 = run(1, 20_000)
    assert evals_1 == evals  # the job evaluates together
    with pytest.raises(ValueError, match="distinct"):
        d.NoisyClock(0.01, 0.01, seed=1, rank=0)


class _FakeTime:
    """A ``time`` module whose sleep records instead of sleeping."""

    def __init__(self, slept: list[float]) -> None:
        self.slept = slept

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_the_clean_figures_are_per_rank_step_with_the_bar_beside_them() -> None:
    from benchmarks import detection as d

    def clean(world: int, alerts: int, rank_steps: int) -> Any:
        fired = [FiredAlert("Straggler", 0, T0 + i) for i in range(alerts)]
        return d.CleanOutcome(
            f"clean-{world}", world, fired, rank_steps, 1.0, 0.5, [1.3, 1.2, 1.25], {}, 0.03
        )

    report = d.build_report([], [clean(4, 1, 10_000), clean(8, 0, 10_000)], [], {})
    assert report["clean_false_alerts"] == 1
    assert report["clean_rank_steps"] == 20_000
    assert report["false_alerts_clean_per_10k_rank_steps"] == pytest.approx(0.5)
    assert report["effective_bar_clean"]["4"] == {"median": 1.25, "min": 1.2, "max": 1.3}
    assert report["clean_jobs"]["clean-8"]["false_alerts_per_10k_rank_steps"] == 0.0
    assert report["precision_units"] == {"true": 0, "false": 1}


def test_a_tuning_jobs_figures_say_when_each_alert_fired_against_the_sessions_end() -> None:
    from benchmarks import detection as d

    fired = [
        FiredAlert("Step Time Anomaly", None, T0, T0 + 2.5, first_step=150),
        FiredAlert("Straggler", 1, T0 + 9, None, first_step=400),
    ]
    tuning = d.CleanOutcome(
        "autotune", 2, fired, 1600, 1.0, 0.5, [1.1], {}, 0.13, 608, "finished", 192
    )
    report = d.build_report([], [], [tuning], {})
    job = report["tuning_jobs"][0]
    assert job["session_ended_at_step"] == 192
    assert job["alerts_at"] == [
        {"alert": "Step Time Anomaly", "step": 150, "lasted_s": 2.5},
        {"alert": "Straggler (rank 1)", "step": 400, "lasted_s": None},
    ]
    assert report["tuning_false_alerts"] == 2


class _FakeAggregator:
    """What FiringWatch reads of a running aggregator: the job's last step, the firing
    alerts, the ranks' step counts and the straggler detector's bar."""

    def __init__(self) -> None:
        self.last_step = 0
        self.bar: float | None = None
        self.live = self
        self.alerts = self
        self.straggler = self

    def job_summary(self, job: str) -> dict[str, int]:
        return {"last_step": self.last_step}

    def active(self) -> list[Any]:
        return []

    def rank_summaries(self, job: str) -> dict[int, dict[str, int]]:
        return {0: {"steps_total": self.last_step, "urgent_steps_total": 0}}

    def run(self, job: str) -> _FakeAggregator:
        return self  # the job's latest run, with its straggler detector (self)

    def bar_ratio(self, job: str) -> float | None:
        return self.bar


def test_the_watch_samples_the_bar_and_a_tuning_job_runs_on_after_its_session(
    tmp_path: Path,
) -> None:
    from benchmarks.detection import SettleWatch

    done, stop = tmp_path / "done", tmp_path / "stop"
    watch = SettleWatch("bench", done, stop, settle_steps=50)
    agg = _FakeAggregator()
    for step, bar in ((10, None), (20, 1.3), (30, 1.25)):
        agg.last_step, agg.bar = step, bar
        watch(agg, None)
    assert watch.bars == [1.3, 1.25]  # no bar before the noise is measured
    assert watch.ended_at_step is None and not stop.exists()
    done.touch()  # the session ended at step 40
    agg.last_step = 40
    watch(agg, None)
    assert watch.ended_at_step == 40
    agg.last_step = 89
    watch(agg, None)
    assert not stop.exists()
    agg.last_step = 90
    watch(agg, None)
    assert stop.exists()


@pytest.mark.integration
def test_a_quick_clean_job_runs_with_its_noise_and_reports_per_rank_step() -> None:
    """``detection.py`` on one small clean job (2 ranks, 240 rank-steps): the ranks ran
    through NoisyClock (their steps and the time it added come back), and the figures
    are per rank-step with the straggler bar beside them."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "detection.py"), "--quick", "--dev", "--kinds",
         "--no-tuning", "--clean-world-sizes", "2", "--clean-rank-steps", "240"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["sweep"] == "dev" and report["seeds"] == [100]
    job = report["clean_jobs"]["clean-2"]
    assert job["noise"]["steps"] == 240  # 120 steps on each of 2 ranks, all noisy
    assert job["noise"]["noise_s"] != 0
    assert job["rank_steps"] == report["clean_rank_steps"] == 240
    alerts = report["clean_false_alerts"]
    assert report["false_alerts_clean_per_10k_rank_steps"] == pytest.approx(alerts * 10_000 / 240)
    assert set(report["effective_bar_clean"]) == {"2"}
    bar = report["effective_bar_clean"]["2"]
    assert bar["median"] is None or 1.0 < bar["min"] <= bar["median"] <= bar["max"]
    assert 0.02 < job["step_period_s"] < 0.5


def _dump(world: int, steps: int, slow: dict[int, tuple[int, int, float]]) -> dict[str, object]:
    """A ``detection.py --dump`` job: compute times around 50 ms with 3 % jitter, rank r
    ``factor`` times slower over steps [a, b) for ``slow[r] = (a, b, factor)``, and a
    small CPU wait on every step (left out of the compute, as the aggregator does)."""
    rng = random.Random(7)
    rows = []
    for step in range(1, steps + 1):
        for rank in range(world):
            a, b, factor = slow.get(rank, (0, 0, 1.0))
            compute = 0.05 * (factor if a <= step < b else 1.0) * math.exp(rng.gauss(0, 0.03))
            rows.append([rank, step, compute + 0.01, compute + 0.001, 0.001, 0.002])
    columns = ["rank", "step", "duration_s", "compute_s", "cpu_wait_s", "process_cpu_wait_s"]
    return {"world_size": world, "columns": columns, "rows": rows}


def test_the_replay_names_a_planned_straggler_and_flags_an_unplanned_one(tmp_path: Path) -> None:
    """``detection_replay.py`` on made-up dumps: a planned 1.5x straggler at 2 ranks is
    paged within the 20 steps the detector may take; the same slowdown in a job without
    a plan is a wrongly named rank; and ``--set`` reaches the detector (a 2x floor
    names nothing)."""
    from benchmarks import detection_replay

    planned = _dump(2, 300, {1: (100, 200, 1.5)})
    planned["plan"] = [
        {
            "kind": "straggler",
            "label": "straggler steady 2 ranks",
            "magnitude": 1.5,
            "rank": 1,
            "onset_step": 100,
            "end_step": 200,
        }
    ]
    (tmp_path / "timing-2-0.json").write_text(json.dumps(planned))
    (tmp_path / "clean-2-0.json").write_text(json.dumps(_dump(2, 300, {0: (150, 200, 1.5)})))
    summary = detection_replay.main([str(tmp_path)])
    assert summary["in_scope"] == 1 and summary["missed"] == 0
    assert 1 <= summary["worst_named_after_steps"] <= 20
    assert summary["jobs_with_a_wrong_name"] == 1
    loose = detection_replay.main([str(tmp_path), "--set", "min_slowdown=1.0"])
    assert loose["missed"] == 1 and loose["jobs_with_a_wrong_name"] == 0
    with pytest.raises(SystemExit, match="min_slowdown"):
        detection_replay.main([str(tmp_path), "--set", "min_slowdown=-1"])
