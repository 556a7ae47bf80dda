from __future__ import annotations

import functools
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.straggler_draws import (
    Fault,
    Rates,
    draw,
    measure,
    rates_table,
    scenarios,
)
from torshmon.aggregator.core.alert_engine import AlertEngine
from torshmon.aggregator.core.complete_steps import CompleteStep, StepCollector
from torshmon.aggregator.core.series import SeriesStore
from torshmon.aggregator.core.straggler import (
    RankStep,
    StragglerDetector,
    StragglerSettings,
    _log_ratios,
    _median,
)
from torshmon.aggregator.rule_files import default_rules

DATA = Path(__file__).parent / "data" / "detection"
RECORDED = sorted(DATA.glob("straggler_*.json"))
DOC = Path(__file__).parent.parent / "docs" / "detectors" / "straggler.md"


def _run(det: StragglerDetector, rows: list[list[float]], *, job: str = "demo") -> list[set[int]]:
    """Feed one row per step (index = rank); the named ranks after each step."""
    out = []
    for i, row in enumerate(rows):
        findings = det.observe_step(job, i, dict(enumerate(row)), 1000.0 + i)
        out.append({int(f.labels["rank"]) for f in findings})
    return out


def _noisy(
    world: int,
    steps: int,
    *,
    seed: int = 0,
    sigma: float = 0.03,
    slow: dict[int, float] | None = None,
    base: float = 0.1,
) -> list[list[float]]:
    """Compute times around ``base`` with lognormal jitter; ``slow``: factor by rank."""
    rng = random.Random(seed)
    slow = slow or {}
    return [
        [base * slow.get(r, 1.0) * math.exp(rng.gauss(0.0, sigma)) for r in range(world)]
        for _ in range(steps)
    ]


# -- the rates over many draws (tests/straggler_draws.py) ----------------------------------

SCENARIOS = {s.name: s for s in scenarios()}


@functools.cache
def _rates(name: str) -> Rates:
    rates = measure(SCENARIOS[name])
    print(f"{name}: {rates}")  # the rates, for the log of the run (pytest -s or -rA)
    return rates


def _names(prefix: str) -> list[str]:
    return [name for name in SCENARIOS if name.startswith(prefix)]


@pytest.mark.parametrize("name", _names("clean"))
def test_clean_jobs_never_page_a_healthy_rank(name: str) -> None:
    """1000-step jobs with jitter and preemption bursts of 1-3 steps: a page naming a
    rank in at most 1 % of them (the bursts may show as short findings)."""
    assert _rates(name).healthy_paged <= 0.01


@pytest.mark.parametrize("name", _names("steady 1.2x"))
def test_a_steady_1_2x_straggler_is_found_in_10_steps_and_paged_in_20(name: str) -> None:
    rates = _rates(name)
    assert rates.found_10 is not None and rates.found_10 >= 0.95
    assert rates.paged_20 is not None and rates.paged_20 >= 0.95
    assert rates.healthy_paged <= 0.01


@pytest.mark.parametrize("name", _names("on/off 1.3x"))
def test_an_on_off_1_3x_straggler_is_named_through_90_percent_of_its_slow_steps(
    name: str,
) -> None:
    rates = _rates(name)
    assert rates.coverage is not None and rates.coverage >= 0.9
    assert rates.healthy_paged <= 0.01


@pytest.mark.parametrize("name", _names("burst"))
def test_a_burst_of_8_slow_steps_on_a_healthy_rank_never_pages(name: str) -> None:
    rates = _rates(name)
    assert rates.ever_paged is not None and rates.ever_paged <= 0.01
    assert rates.healthy_paged <= 0.01


@pytest.mark.parametrize("name", [n for n in SCENARIOS if " input," in n or " host," in n])
def test_a_rank_late_outside_its_compute_is_named_with_its_phase(name: str) -> None:
    rates = _rates(name)
    assert rates.found_10 is not None and rates.found_10 >= 0.95
    assert rates.phase_right is not None and rates.phase_right >= 0.95


def test_the_published_rates_are_the_tests_own() -> None:
    """docs/detectors/straggler.md holds the table these draws make; regenerate it with
    ``python -m tests.straggler_draws`` after a change."""
    table = rates_table({name: _rates(name) for name in SCENARIOS})
    assert table in DOC.read_text()


# -- recorded runs (real jobs on two shared cores) ----------------------------------------


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
def test_recorded_runs_never_page_a_healthy_rank(path: Path) -> None:
    scenario: dict[str, Any] = json.loads(path.read_text())
    det = StragglerDetector()
    healthy = set(scenario["never_named"])
    for i, row in enumerate(scenario["steps"]):
        findings = det.observe_step("job", i, dict(enumerate(row)), 1000.0 + i)
        paged = {int(f.labels["rank"]) for f in findings if f.details["page"]}
        assert not paged & healthy, (i, paged)


@pytest.mark.parametrize(
    "name", ["straggler_onoff_pair_cascade", "straggler_onoff_pair_after_a_milder_one"]
)
def test_recorded_on_off_stragglers_in_a_row_are_each_named_and_paged(name: str) -> None:
    """Real 2-rank jobs with on/off stragglers of 1.1-3x one after the other (9 spells of
    10 slow steps, 10 in line): each is named within 10 steps and paged, whatever the one
    before it did to the noise."""
    scenario: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    det = StragglerDetector()
    named: list[set[int]] = []
    paged: list[set[int]] = []
    for i, row in enumerate(scenario["steps"]):
        findings = det.observe_step("job", i, dict(enumerate(row)), 1000.0 + i)
        named.append({int(f.labels["rank"]) for f in findings})
        paged.append({int(f.labels["rank"]) for f in findings if f.details["page"]})
    for episode in scenario["episodes"]:
        start, end = episode["slow_steps"][0][0], episode["slow_steps"][-1][1]
        rank = episode["rank"]
        assert any(rank in named[i] for i in range(start, start + 10)), episode
        assert any(rank in paged[i] for i in range(start, end)), episode


# -- behaviour ----------------------------------------------------------------------------


def test_a_slow_rank_is_named_with_one_ratio_its_excess_and_its_phase() -> None:
    det = StragglerDetector()
    rows = _noisy(4, 40, sigma=0.01) + _noisy(4, 30, sigma=0.01, seed=1, slow={2: 1.5})
    named = _run(det, rows)
    assert named[-1] == {2}
    [finding] = det.active()
    details = finding.details
    assert finding.score == details["slowdown_ratio"] == pytest.approx(1.5, rel=0.03)
    assert details["peer_median_s"] == pytest.approx(0.1, rel=0.03)
    assert details["excess_s"] == pytest.approx(0.05, rel=0.1)
    assert details["phase"] == "compute"
    assert f"{finding.score:.2f}x" in finding.summary
    assert "rank 2 of job demo computes" in finding.summary
    assert finding.since_unix_s == 1040.0  # the first slow step, not when it was named


def test_a_finding_pages_only_once_the_slowness_lasts() -> None:
    """Shown from the 5th slow step in a row, paged from the 16th of 28."""
    det = StragglerDetector()
    calm = _noisy(3, 40, sigma=0.01)
    slow = _noisy(3, 30, sigma=0.01, seed=2, slow={1: 2.0})
    pages = []
    for i, row in enumerate(calm + slow):
        findings = det.observe_step("j", i, dict(enumerate(row)), float(i))
        pages.append([bool(f.details["page"]) for f in findings])
    assert pages[43] == [] and pages[44] == [False]
    assert pages[54] == [False] and pages[55] == [True]
    assert all(p == [True] for p in pages[55:])


def test_no_page_once_the_slowness_has_ended() -> None:
    """Spells of 10, 5 and 1 slow steps reach 16 of 28 at the last one, while the rank is
    mostly back in line (5 of its last 8 slow): shown, not paged for what just ended."""
    det = StragglerDetector()
    rows = _noisy(3, 40, sigma=0.01)
    for seed, (length, factor) in enumerate(
        [(10, 2.0), (6, 1.0), (5, 2.0), (3, 1.0), (1, 2.0), (30, 1.0)]
    ):
        rows += _noisy(3, length, sigma=0.01, seed=40 + seed, slow={1: factor})
    seen = []
    for i, row in enumerate(rows):
        findings = det.observe_step("j", i, dict(enumerate(row)), float(i))
        seen.append([bool(f.details["page"]) for f in findings])
    assert seen[64] == [False]  # the 16th slow step of the last 28
    assert not any(True in step for step in seen)


def test_a_burst_is_shown_then_clears_without_paging() -> None:
    det = StragglerDetector()
    rows = _noisy(4, 60, sigma=0.01) + _noisy(4, 8, sigma=0.01, seed=3, slow={3: 3.0})
    rows += _noisy(4, 60, sigma=0.01, seed=4)
    seen: list[list[bool]] = []
    for i, row in enumerate(rows):
        findings = det.observe_step("j", i, dict(enumerate(row)), float(i))
        seen.append([bool(f.details["page"]) for f in findings])
    assert [False] in seen  # shown on the pages
    assert not any(True in step for step in seen)  # never a page
    assert seen[-1] == []  # and cleared


def test_a_rank_held_back_by_its_input_is_named_as_its_input() -> None:
    """A slow data loader on rank 1: its compute is like its peers', its wait for the
    batch is not. It is the rank that makes the others wait, named with its phase."""
    det = StragglerDetector()
    rng = random.Random(7)
    for step in range(80):
        row = {}
        for rank in range(4):
            compute = 0.1 * math.exp(rng.gauss(0, 0.02))
            wait = 0.002 + (0.04 if rank == 1 and step >= 40 else 0.0)
            row[rank] = RankStep(compute, input_s=wait)
        det.observe_step("j", step, row, float(step))
    [finding] = det.active()
    assert finding.labels["rank"] == "1"
    assert finding.details["phase"] == "input"
    assert finding.details["page"] is True
    assert finding.score == pytest.approx(1.4, rel=0.05)
    assert "input" in finding.summary and "data loader" in finding.recommendation


def test_a_rank_whose_threads_wait_for_a_cpu_is_named_as_host() -> None:
    det = StragglerDetector()
    for step in range(60):
        row = {r: RankStep(0.1, host_s=0.05 if r == 0 and step >= 30 else 0.001) for r in range(3)}
        det.observe_step("j", step, row, float(step))
    [finding] = det.active()
    assert (finding.labels["rank"], finding.details["phase"]) == ("0", "host")


def test_short_steps_have_no_floor_in_seconds() -> None:
    """5 ms of compute, a 1.3x straggler losing 1.5 ms a step: named (an absolute floor
    of a scheduler time slice made the detector blind here)."""
    rows = _noisy(4, 40, base=0.005, sigma=0.02) + _noisy(
        4, 30, base=0.005, sigma=0.02, seed=5, slow={0: 1.3}
    )
    assert _run(StragglerDetector(), rows)[-1] == {0}


def test_the_bar_follows_the_noise() -> None:
    quiet = _noisy(4, 40, sigma=0.01) + _noisy(4, 30, sigma=0.01, seed=6, slow={2: 1.15})
    det = StragglerDetector()
    assert _run(det, quiet)[-1] == {2}
    loud = _noisy(4, 40, sigma=0.1) + _noisy(4, 30, sigma=0.1, seed=6, slow={2: 1.15})
    det = StragglerDetector()
    assert not any(_run(det, loud)[40:])
    bar = det.bar_ratio("demo")
    assert bar is not None and bar > 1.15


def test_the_relative_floor_keeps_a_small_steady_offset_quiet() -> None:
    rows = _noisy(3, 300, sigma=0.002, slow={1: 1.03})
    assert not any(_run(StragglerDetector(), rows))


def test_a_fast_rank_is_never_a_straggler() -> None:
    assert not any(_run(StragglerDetector(), _noisy(4, 100, slow={3: 0.5})))


def test_two_slow_ranks_of_many_are_both_named() -> None:
    rows = _noisy(8, 40, sigma=0.01) + _noisy(8, 30, sigma=0.01, seed=8, slow={2: 1.5, 5: 1.4})
    assert _run(StragglerDetector(), rows)[-1] == {2, 5}


def test_on_off_spells_are_one_finding_that_resolves_after_the_fault() -> None:
    det = StragglerDetector()
    rows = _noisy(3, 40, sigma=0.01)
    for period in range(4):
        rows += _noisy(3, 10, sigma=0.01, seed=10 + period, slow={1: 1.5})
        rows += _noisy(3, 10, sigma=0.01, seed=20 + period)
    rows += _noisy(3, 40, sigma=0.01, seed=30)
    sinces = set()
    for i, row in enumerate(rows):
        for f in det.observe_step("j", i, dict(enumerate(row)), float(i)):
            sinces.add(f.since_unix_s)
    assert sinces == {40.0}
    assert det.active() == []


def test_a_lasting_slowdown_turns_chronic() -> None:
    det = StragglerDetector(StragglerSettings(chronic_steps=100))
    _run(det, _noisy(3, 40, sigma=0.01) + _noisy(3, 120, sigma=0.01, seed=9, slow={0: 1.5}))
    [finding] = det.active()
    assert finding.details["chronic"] is True
    assert "rebalance" in finding.recommendation


def test_a_paused_config_switch_is_not_scored() -> None:
    det = StragglerDetector()
    rows = _noisy(3, 40, sigma=0.01) + _noisy(3, 20, sigma=0.01, seed=11, slow={1: 2.0})
    det.pause("demo", 40, 60)
    assert not any(_run(det, rows))


def test_a_single_rank_and_unusable_values_change_nothing() -> None:
    det = StragglerDetector(StragglerSettings(warmup_steps=0))
    assert det.observe_step("demo", 1, {0: 0.5}, 1.0) == []
    assert det.observe_step("demo", 2, {0: 0.1, 1: math.nan, 2: -1.0, 3: 0.0}, 2.0) == []
    assert det.bar_ratio("demo") is None


def test_jobs_are_independent_and_forget_drops_one() -> None:
    det = StragglerDetector()
    slow = _noisy(3, 40, sigma=0.01) + _noisy(3, 20, sigma=0.01, seed=12, slow={1: 2.0})
    calm = _noisy(3, 60, sigma=0.01, seed=13)
    for i in range(60):
        det.observe_step("a", i, dict(enumerate(slow[i])), float(i))
        det.observe_step("b", i, dict(enumerate(calm[i])), float(i))
    assert [f.labels["job"] for f in det.active()] == ["a"]
    det.forget("a")
    assert det.active() == []
    det.forget("unknown")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"z_threshold": 0}, "z_threshold"),
        ({"min_slowdown": -0.1}, "min_slowdown"),
        ({"persistence": 0}, "persistence"),
        ({"window_steps": 4, "persistence": 5}, "persistence must be at most window_steps"),
        ({"streak_steps": 9}, "streak_steps must be at most window_steps"),
        ({"page_steps": 30}, "page_steps must be at most page_window_steps"),
        ({"hold_steps": 0}, "hold_steps"),
        ({"noise_samples": 4}, "noise_samples"),
    ],
)
def test_bad_settings_are_rejected_by_name(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        StragglerSettings(**kwargs)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(0.001, 10.0), min_size=2, max_size=12),
    named=st.sets(st.integers(0, 11), max_size=4),
)
def test_log_ratios_are_against_the_median_of_the_other_unnamed_ranks(
    values: list[float], named: set[int]
) -> None:
    """The peers' median as written in the textbook, rank by rank."""
    by_rank = dict(enumerate(values))
    named &= set(by_rank)
    if len(by_rank) - len(named) < 2:
        named = set()
    got = _log_ratios(by_rank, named)
    for rank, x in by_rank.items():
        peers = sorted(v for r, v in by_rank.items() if r != rank and r not in named)
        ratio, peers_s = got[rank]
        assert peers_s == _median(peers)
        assert ratio == pytest.approx(math.log(x / _median(peers)), abs=1e-12)


# -- the Straggler rule pages only what the detector says pages ---------------------------


def test_the_straggler_rule_fires_only_for_a_finding_that_pages() -> None:
    engine = AlertEngine(default_rules())
    series = SeriesStore()
    det = StragglerDetector()
    rows = _noisy(3, 40, sigma=0.01) + _noisy(3, 20, sigma=0.01, seed=14, slow={1: 2.0})
    fired_at = None
    for i, row in enumerate(rows):
        findings = det.observe_step("j", i, dict(enumerate(row)), float(i))
        for alert in engine.evaluate(float(i), series, findings):
            if alert.rule == "Straggler" and alert.state == "firing":
                fired_at = fired_at if fired_at is not None else i
                assert alert.labels["rank"] == "1"
                assert re.search(r"2\.\d\dx", alert.annotations["summary"])
    assert fired_at == 55  # the 16th slow step, not the 5th, when it was first shown


# -- StepCollector ------------------------------------------------------------------------


def test_collector_emits_a_step_once_every_rank_reported() -> None:
    col = StepCollector(3)
    assert col.add("demo", 5, 0, 0.1, 10.0) is None
    assert col.add("demo", 5, 2, RankStep(0.3, input_s=0.01), 10.2) is None
    assert col.add("demo", 5, 0, 0.11, 10.3) is None  # a repeat replaces the value
    done = col.add("demo", 5, 1, 0.2, 10.4)
    assert done == CompleteStep("demo", 5, {0: 0.11, 2: RankStep(0.3, 0.01), 1: 0.2}, 10.4)
    assert col.pending_steps("demo") == 0


def test_collector_evicts_steps_that_can_no_longer_complete() -> None:
    col = StepCollector(2)
    for step in range(1, 6):
        col.add("demo", step, 0, 0.1, float(step))
    # rank 1 dropped steps 1 and 2; once its step 3 arrives they cannot complete
    assert col.add("demo", 3, 1, 0.1, 3.5) is not None
    assert col.pending_steps("demo") == 2  # steps 4 and 5 wait for rank 1
    assert col.add("demo", 4, 1, 0.1, 4.5) is not None
    assert col.pending_steps("demo") == 1


def test_collector_bounds_pending_steps_of_a_silent_rank() -> None:
    col = StepCollector(2, max_pending_steps=4)
    for step in range(100):
        col.add("demo", step, 0, 0.1, float(step))
    assert col.pending_steps("demo") == 4
    assert col.add("demo", 97, 1, 0.1, 200.0) is not None
    assert col.add("demo", 10, 1, 0.1, 201.0) is None  # long evicted: starts a new entry


def test_collector_keeps_jobs_apart_and_validates_ranks() -> None:
    col = StepCollector(2)
    col.add("a", 1, 0, 0.1, 1.0)
    assert col.add("b", 1, 1, 0.1, 1.0) is None
    assert col.add("a", 1, 1, 0.1, 1.0) is not None
    col.add("b", 2, 0, 0.1, 1.0)
    col.forget("b")
    assert col.pending_steps("b") == 0
    assert col.world_size == 2
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1, got 2"):
        col.add("a", 1, 2, 0.1, 1.0)
    with pytest.raises(ValueError, match="world_size"):
        StepCollector(0)
    with pytest.raises(ValueError, match="max_pending_steps"):
        StepCollector(2, max_pending_steps=0)


def test_add_many_is_add_one_by_one() -> None:
    """Ranks report runs of steps, with gaps, repeats and a bound on pending steps."""
    rng = random.Random(5)
    one = StepCollector(4, max_pending_steps=8)
    many = StepCollector(4, max_pending_steps=8)
    next_step = [0, 0, 0, 0]
    completed = 0
    for turn in range(400):
        rank = turn % 4
        steps = []
        while next_step[rank] < turn // 4 * 3 + rng.randint(-4, 4):
            next_step[rank] += rng.choice([1] * 12 + [2, 0])
            steps.append(next_step[rank])
        if not steps:
            continue
        compute: list[float | RankStep] = [rng.random() for _ in steps]
        ts = [float(s) for s in steps]
        expected = [
            (i, found)
            for i, (s, c, t) in enumerate(zip(steps, compute, ts, strict=True))
            if (found := one.add("j", s, rank, c, t)) is not None
        ]
        assert many.add_many("j", rank, steps, compute, ts) == expected
        assert many.pending_steps("j") == one.pending_steps("j")
        completed += len(expected)
    assert completed > 20


def test_add_many_refuses_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
        StepCollector(2).add_many("j", 2, [1], [0.1], [1.0])


def test_collector_reports_the_job_step_time_of_the_slowest_rank() -> None:
    col = StepCollector(2)
    col.add_many("demo", 0, [1, 2], [0.1, 0.1], [1.0, 2.0], [0.30, 0.2])
    ((_, done),) = col.add_many("demo", 1, [1], [0.2], [1.1], [0.31])
    assert done.duration_s == 0.31
    ((_, without),) = col.add_many("demo", 1, [2], [0.2], [2.1])  # no durations given
    assert without.duration_s == 0.2
    assert col.add("demo", 3, 0, 0.1, 3.0) is None
    last = col.add("demo", 3, 1, 0.1, 3.1)
    assert last is not None and math.isnan(last.duration_s)


def test_draws_are_reproducible_and_faults_act_in_their_phase() -> None:
    """The generator the rates rest on: the same seed gives the same steps; a fault
    moves its rank's late time in its phase only."""
    fault = Fault(1, 1.5, ((5, 10),), "input")
    a, b = draw(3, 4, 20, [fault]), draw(3, 4, 20, [fault])
    assert a == b
    clean = draw(3, 4, 20)
    assert [row[1].compute_s for row in a] == [row[1].compute_s for row in clean]
    assert all(a[i][1].input_s > 0 for i in range(5, 10))
    assert a[4][1].input_s == a[10][1].input_s == 0.0
