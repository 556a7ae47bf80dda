from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torshmon.aggregator.core import straggler
from torshmon.aggregator.core.complete_steps import CompleteStep, StepCollector
from torshmon.aggregator.core.straggler import StragglerDetector, _log_ratios, _median

DATA = Path(__file__).parent / "data" / "detection"
SYNTHETIC = sorted(DATA.glob("straggler_*_synthetic.json"))
RECORDED = sorted(set(DATA.glob("straggler_*.json")) - set(SYNTHETIC))


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
) -> list[list[float]]:
    """Compute times around 0.1 s with lognormal jitter; ``slow``: factor by rank."""
    rng = random.Random(seed)
    slow = slow or {}
    return [
        [0.1 * slow.get(r, 1.0) * math.exp(rng.gauss(0.0, sigma)) for r in range(world)]
        for _ in range(steps)
    ]


# -- the targets on golden scenarios -----------------------------------------------


@pytest.mark.parametrize("path", SYNTHETIC, ids=lambda p: p.stem)
def test_synthetic_scenarios_meet_the_targets(path: Path) -> None:
    """Steady and on/off stragglers of 1.2-1.4x at 2-4 ranks (jitter and preemption
    bursts, see make_stragglers.py): named within 10 steps (at 2 ranks from 1.3x, at 3
    and more from 1.2x), named through >= 90 % of the slow steps (off spells bridged),
    resolved at the end, and no rank named that is not slow."""
    scenario: dict[str, Any] = json.loads(path.read_text())
    named = _run(StragglerDetector(), scenario["steps"])
    slow_rank = scenario["slow_rank"]
    allowed = set() if slow_rank is None else {slow_rank}
    assert [i for i, ranks in enumerate(named) if ranks - allowed] == []
    if slow_rank is None:
        return
    slow = [i for a, b in scenario["slow_steps"] for i in range(a, b)]
    assert not any(named[: slow[0]])
    first = next(i for i in range(slow[0], len(named)) if slow_rank in named[i])
    assert first - slow[0] + 1 <= 10
    covered = sum(1 for i in slow if slow_rank in named[i]) / len(slow)
    assert covered >= 0.9
    assert named[-1] == set()


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
def test_recorded_runs_never_name_a_healthy_rank(path: Path) -> None:
    scenario: dict[str, Any] = json.loads(path.read_text())
    named = _run(StragglerDetector(), scenario["steps"])
    healthy = set(scenario["never_named"])
    assert [i for i, ranks in enumerate(named) if ranks & healthy] == []


@pytest.mark.parametrize(
    "name", ["straggler_onoff_pair_cascade", "straggler_onoff_pair_after_a_milder_one"]
)
def test_on_off_stragglers_in_a_row_do_not_raise_their_own_bar(name: str) -> None:
    """Recorded 2-rank runs where an on/off straggler's swings went into the noise
    estimate as a healthy rank's and hid the ones after it. Held-out seed 49: one was
    named, cleared mid-fault, and then sampled (the bar rose from 0.21 to 1.9; the next
    three went unnamed, 2x included) before a cleared rank was kept out of the
    estimate. Development seed 70: a 1.1x one, under the floor and never named, raised
    the bar over a 1.2x and a 1.5x one before the window's noise was capped by the
    step-to-step changes'. Each one in scope (1.3x and more at 2 ranks) must be named
    within 10 steps, the 1.2x ones at all, and no rank outside its own episodes."""
    scenario: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    named = _run(StragglerDetector(), scenario["steps"])
    allowed: dict[int, set[int]] = {rank: set() for rank in range(scenario["world_size"])}
    for episode in scenario["episodes"]:
        first, end = episode["slow_steps"][0][0], episode["slow_steps"][-1][1]
        # Named from its first slow step until it has been back in line for hold_steps.
        allowed[episode["rank"]] |= set(range(first, end + 25 + 8))
        if episode["magnitude"] < 1.2:
            continue
        hits = [i for i in range(first, end) if episode["rank"] in named[i]]
        assert hits, episode["magnitude"]
        if episode["magnitude"] >= 1.3:
            assert hits[0] - first + 1 <= 10, (episode["magnitude"], hits[0] - first + 1)
    wrong = [(i, r) for i, ranks in enumerate(named) for r in ranks if i not in allowed[r]]
    assert wrong == []


def test_without_the_cap_a_milder_on_off_straggler_hides_the_next_ones() -> None:
    """The recorded seed-70 run again, with ``max_window_noise`` off: the 1.1x one's
    swings raise the bar over the 1.2x and 1.5x on/off ones, as in the benchmark."""
    name = "straggler_onoff_pair_after_a_milder_one.json"
    scenario: dict[str, Any] = json.loads((DATA / name).read_text())
    named = _run(StragglerDetector(max_window_noise=0), scenario["steps"])
    for episode in scenario["episodes"][-2:]:
        first, end = episode["slow_steps"][0][0], episode["slow_steps"][-1][1]
        assert not any(episode["rank"] in named[i] for i in range(first, end))


def test_make_stragglers_writes_the_files_as_committed(tmp_path: Path) -> None:
    """The synthetic scenarios are generated: the generator, run again, gives the same."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_stragglers", DATA / "make_stragglers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.HERE = tmp_path
    module.main()
    written = sorted(p.name for p in tmp_path.glob("*.json"))
    assert written == [p.name for p in SYNTHETIC]
    for name in written:
        assert (tmp_path / name).read_text() == (DATA / name).read_text(), name


# -- behaviour ----------------------------------------------------------------------------


def test_a_slow_rank_is_named_with_its_slowdown_against_its_peers() -> None:
    det = StragglerDetector()
    rows = _noisy(8, 40) + _noisy(8, 12, seed=1, slow={3: 1.5})
    named = _run(det, rows)
    assert named[:40] == [set()] * 40
    assert {3} in named[40:46]  # within 6 slow steps
    (finding,) = det.active()
    assert finding.kind == "straggler"
    assert dict(finding.labels) == {"job": "demo", "rank": "3"}
    assert finding.severity == "high"
    assert finding.details["slowdown_ratio"] == pytest.approx(1.5, rel=0.05)
    assert finding.score == finding.details["slowdown_ratio"]
    assert finding.value == pytest.approx(0.15, rel=0.05)
    assert finding.details["peer_median_s"] == pytest.approx(0.1, rel=0.05)
    assert finding.details["method"] == "peers_same_step"
    assert finding.summary.startswith("rank 3 of job demo computes 1.")
    assert "slower than the median of its peers at the same steps" in finding.summary
    assert 1040.0 <= finding.since_unix_s <= 1045.0
    assert "throttling" in finding.recommendation


def test_a_lasting_slowdown_keeps_firing_and_turns_chronic() -> None:
    """The fault of issue 19: a history baseline absorbed a steady 1.4x slowdown and the
    alert resolved while the rank was still slow. Against its peers it stays named."""
    det = StragglerDetector(chronic_steps=300)
    named = _run(det, _noisy(3, 40) + _noisy(3, 600, seed=2, slow={1: 1.4}))
    assert all(ranks == {1} for ranks in named[50:])
    (finding,) = det.active()
    assert finding.details["chronic"] is True
    assert "rebalance" in finding.recommendation


def test_a_fast_rank_is_never_a_straggler() -> None:
    det = StragglerDetector()
    assert not any(_run(det, _noisy(4, 200, slow={0: 0.5})))


def test_two_slow_ranks_of_many_are_both_named() -> None:
    det = StragglerDetector()
    named = _run(det, _noisy(16, 40) + _noisy(16, 20, seed=3, slow={4: 1.5, 9: 1.8}))
    assert named[-1] == {4, 9}


def test_persistence_is_k_of_the_last_n_steps_not_a_streak() -> None:
    """Every third step at normal speed (a lucky step) does not restart the count."""
    det = StragglerDetector(persistence=5, window_steps=8)
    calm = _noisy(3, 40)
    spotty = [[0.1, 0.1 * (1.0 if i % 3 == 2 else 1.5), 0.1] for i in range(12)]
    named = _run(det, calm + spotty)
    assert {1} in named[40:48]


def test_four_slow_steps_in_a_row_name_the_rank_before_five_of_eight_would() -> None:
    calm = _noisy(3, 40, sigma=0.01)
    slow = _noisy(3, 8, seed=5, sigma=0.01, slow={1: 1.5})
    streak = _run(StragglerDetector(), calm + slow)
    k_of_n = _run(StragglerDetector(streak_steps=0), calm + slow)
    assert [i - 40 + 1 for i, ranks in enumerate(streak) if ranks][:1] == [4]
    assert [i - 40 + 1 for i, ranks in enumerate(k_of_n) if ranks][:1] == [5]
    with pytest.raises(ValueError, match="streak_steps"):
        StragglerDetector(streak_steps=9, window_steps=8)


def test_short_bursts_are_not_a_straggler() -> None:
    """A preempted rank: 2x slower for three steps in a row, now and then."""
    rows = _noisy(3, 300)
    for start in range(40, 300, 25):
        for i in range(start, start + 3):
            rows[i][start % 3] *= 2.0
    assert not any(_run(StragglerDetector(), rows))


def test_the_bar_rises_with_the_noise() -> None:
    """A 1.3x rank among ranks whose single steps scatter by 2 % is named; among ranks
    that scatter by 40 % it is noise, and nobody is named."""
    quiet = _noisy(3, 40, sigma=0.02) + _noisy(3, 60, seed=4, sigma=0.02, slow={2: 1.3})
    assert _run(StragglerDetector(), quiet)[-1] == {2}
    loud = _noisy(3, 40, sigma=0.4) + _noisy(3, 60, seed=4, sigma=0.4, slow={2: 1.3})
    assert not any(_run(StragglerDetector(), loud))


def test_a_sudden_burst_of_noise_raises_the_bar_before_it_names_a_healthy_rank() -> None:
    """Ranks whose steps scatter by 3 %, then by 15-20 % (a busy node): the bar from the
    window-to-window changes of the calm steps lags, and healthy ranks were named a few
    steps into the burst; the changes of the latest steps raise it in time. A 1.2x
    rank among ranks scattering by 5 % is still named within 10 steps, most often on
    its 4th slow step."""
    storms = [
        _noisy(4, 300, seed=seed, sigma=0.03) + _noisy(4, 120, seed=100 + seed, sigma=0.15)
        for seed in range(10)
    ]

    # Two ranks, 20 % scatter: above the pair floor as often.
    pair_storms = [
        _noisy(2, 300, seed=seed, sigma=0.03) + _noisy(2, 120, seed=100 + seed, sigma=0.2)
        for seed in range(10)
    ]

    def named_in(jobs: list[list[list[float]]], det: Callable[[], StragglerDetector]) -> int:
        return sum(any(named[300:]) for named in (_run(det(), rows) for rows in jobs))

    for jobs in (storms, pair_storms):
        assert named_in(jobs, lambda: StragglerDetector(step_noise_steps=0)) >= 8
        assert named_in(jobs, StragglerDetector) <= 1
    latencies = []
    for seed in range(10):
        rows = _noisy(4, 100, seed=seed, sigma=0.05)
        rows += _noisy(4, 60, seed=50 + seed, sigma=0.05, slow={2: 1.2})
        named = _run(StragglerDetector(), rows)
        latencies.append(next(i - 99 for i in range(100, 160) if 2 in named[i]))
        assert not any(named[:100])
    assert max(latencies) <= 10 and sorted(latencies)[5] == 4


def test_a_burst_early_in_a_job_is_in_the_noise_before_any_rank_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Held-out seed 63's shape: 2 ranks, and soon after the job's start one computed
    1.25x its peer for 8 steps on contention. Named while the noise estimate stood on
    its first 16 changes (a few steps' worth, all alike); with the noise sampled in 16
    steps first, the burst is part of it and nobody is named. A real straggler that
    starts as early is still named, a little later."""
    early_bursts = []
    for seed in range(10):
        rows = _noisy(2, 120, seed=seed, sigma=0.03)
        for i in range(31, 39):
            rows[i][1] *= 1.25
        early_bursts.append(rows)
    assert not any(any(_run(StragglerDetector(), rows)) for rows in early_bursts)
    with monkeypatch.context() as patched:
        patched.setattr(straggler, "_MIN_NOISE_STEPS", 1)  # 16 changes, from any steps
        assert sum(any(_run(StragglerDetector(), rows)) for rows in early_bursts) >= 5
    named = _run(StragglerDetector(), _noisy(2, 20) + _noisy(2, 60, seed=7, slow={1: 1.4}))
    assert named[-1] == {1}
    assert all(not ranks for ranks in named[:40])


def test_the_relative_floor_keeps_a_small_steady_offset_quiet() -> None:
    """5 % slower at every step is below min_slowdown (12 %), however quiet the job."""
    rows = _noisy(4, 300, sigma=0.005, slow={2: 1.05})
    assert not any(_run(StragglerDetector(), rows))


def test_two_ranks_take_the_higher_pair_floor() -> None:
    """At 2 ranks 15 % is below pair_min_slowdown (20 %); 40 % is named."""
    assert not any(_run(StragglerDetector(), _noisy(2, 300, sigma=0.01, slow={1: 1.15})))
    named = _run(StragglerDetector(), _noisy(2, 40, sigma=0.01) + _noisy(2, 20, slow={1: 1.4}))
    assert named[-1] == {1}


def test_a_rank_losing_less_than_a_time_slice_is_not_a_straggler() -> None:
    """On 2 ms steps rank 1 at 1.6x loses 1.2 ms a step, less than one scheduler time
    slice (min_excess_s, 3 ms): the host clock cannot tell it from the OS, so it is not
    named; the same 1.6x on 20 ms steps (12 ms a step) is, and so are the short steps
    once min_excess_s is lowered."""
    short = [[x / 50 for x in row] for row in _noisy(3, 40, sigma=0.01)]
    short += [[x / 50 for x in row] for row in _noisy(3, 60, seed=1, slow={1: 1.6})]
    assert not any(_run(StragglerDetector(), short))
    assert _run(StragglerDetector(min_excess_s=0.001), short)[-1] == {1}
    long = [[x / 5 for x in row] for row in _noisy(3, 40, sigma=0.01)]
    long += [[x / 5 for x in row] for row in _noisy(3, 60, seed=1, slow={1: 1.6})]
    assert _run(StragglerDetector(), long)[-1] == {1}
    with pytest.raises(ValueError, match="min_excess_s must be 0 or more seconds, got -1"):
        StragglerDetector(min_excess_s=-1)


def test_with_one_straggler_named_of_three_the_other_two_take_the_pair_floor() -> None:
    """Rank 2 is named (4x); ranks 0 and 1 are left with one peer each, no majority: rank
    1 at 15 % over rank 0 is under the pair floor (20 %), not a second straggler."""
    rows = _noisy(3, 40, sigma=0.01) + _noisy(3, 60, sigma=0.01, slow={1: 1.15, 2: 4.0})
    named = _run(StragglerDetector(), rows)
    assert named[-1] == {2}
    assert not any(1 in ranks for ranks in named)


def test_on_off_spells_are_one_finding_that_resolves_after_the_fault() -> None:
    det = StragglerDetector(hold_steps=25)
    rows = _noisy(4, 40)
    for spell in range(5):
        rows += _noisy(4, 12, seed=10 + spell, slow={2: 1.4}) + _noisy(4, 18, seed=20 + spell)
    rows += _noisy(4, 60, seed=5)
    named = _run(det, rows)
    first = next(i for i, ranks in enumerate(named) if ranks)
    last = max(i for i, ranks in enumerate(named) if ranks)
    assert first < 40 + 10
    assert all(named[i] == {2} for i in range(first, last + 1))  # one finding, no gap
    end_of_fault = 40 + 5 * 30 - 18
    assert end_of_fault < last <= end_of_fault + 25 + 8
    assert named[-1] == set()


def test_a_cleared_rank_rejoins_the_noise_estimate_once_back_in_line() -> None:
    """At 2 ranks the noise is not sampled while a cleared straggler is unsettled (its
    on/off swings and its peer's mirror image would raise the bar), and is again once
    it has been in line for hold_steps steps."""
    det = StragglerDetector()
    rows = _noisy(2, 60) + _noisy(2, 30, seed=1, slow={1: 1.6}) + _noisy(2, 200, seed=2)
    named = _run(det, rows[:130])
    noise = det._jobs["demo"].noise
    assert 1 in named[60 + 10]
    cleared = named.index(set(), 70)
    assert cleared < 130
    frozen = len(noise)
    for i in range(130, cleared + 25):
        det.observe_step("demo", i, dict(enumerate(rows[i])), 1000.0 + i)
    assert len(noise) == frozen  # not yet hold_steps in line
    for i in range(cleared + 25, len(rows)):
        det.observe_step("demo", i, dict(enumerate(rows[i])), 1000.0 + i)
    assert len(noise) > frozen + 100


def test_a_paused_config_switch_is_not_scored() -> None:
    """Steps of a config switch (one rank rebuilds its buckets slower) are skipped."""
    det = StragglerDetector()
    rows = _noisy(3, 40) + _noisy(3, 10, slow={0: 3.0}) + _noisy(3, 40, seed=6)
    det.pause("demo", 40, 50)
    assert not any(_run(det, rows))
    det.pause("demo", 200, 210)
    det.pause("demo", 205, 220)  # overlapping ranges merge
    assert det._jobs["demo"].paused[-1] == (200, 220)


def test_a_single_rank_and_unusable_values_change_nothing() -> None:
    det = StragglerDetector(warmup_steps=0)
    assert det.observe_step("demo", 1, {0: 0.5}, 1.0) == []
    assert det.observe_step("demo", 2, {0: 0.1, 1: math.nan, 2: -1.0, 3: 0.0}, 2.0) == []
    assert det._jobs["demo"].ranks == {}
    # the non-finite and non-positive ranks are left out; the rest is still judged
    rows = [[0.1, 0.1, 0.1, 0.1 * (3.0 if i >= 40 else 1.0), math.inf] for i in range(60)]
    assert _run(det, rows)[-1] == {3}


def test_jobs_are_independent_and_forget_drops_one() -> None:
    det = StragglerDetector()
    rows = _noisy(3, 40) + _noisy(3, 20, slow={2: 2.0})
    _run(det, rows, job="a")
    _run(det, rows, job="b")
    assert [f.labels["job"] for f in det.active()] == ["a", "b"]
    det.forget("a")
    assert [f.labels["job"] for f in det.active()] == ["b"]
    det.forget("unknown")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"z_threshold": 0}, "z_threshold"),
        ({"min_slowdown": -0.1}, "min_slowdown"),
        ({"pair_min_slowdown": math.nan}, "pair_min_slowdown"),
        ({"persistence": 0}, "persistence"),
        ({"window_steps": 2, "persistence": 3}, "window_steps"),
        ({"hold_steps": 0}, "hold_steps"),
        ({"noise_samples": 4}, "noise_samples"),
        ({"max_window_noise": -1.0}, "max_window_noise"),
        ({"max_window_noise": math.inf}, "max_window_noise"),
    ],
)
def test_bad_settings_are_rejected_by_name(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StragglerDetector(**kwargs)


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


# -- StepCollector ------------------------------------------------------------------------


def test_collector_emits_a_step_once_every_rank_reported() -> None:
    col = StepCollector(3)
    assert col.add("demo", 5, 0, 0.1, 10.0) is None
    assert col.add("demo", 5, 2, 0.3, 10.2) is None
    assert col.add("demo", 5, 0, 0.11, 10.3) is None  # a repeat replaces the value
    done = col.add("demo", 5, 1, 0.2, 10.4)
    assert done == CompleteStep("demo", 5, {0: 0.11, 2: 0.3, 1: 0.2}, 10.4)
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
        compute = [rng.random() for _ in steps]
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


def test_a_much_slower_ranks_neighbour_is_not_named_for_its_contention() -> None:
    """Held-out seed 61's 4-rank job: while rank 0 computed 3x, rank 1 was 13-21 % slower
    than ranks 2 and 3 for exactly 4 steps. Four steps in a row just past the 12 % bar
    named it; a rank is not newly named while another is twice as slow. Rank 0 stays
    named."""
    path = DATA / "straggler_contention_4_ranks.json"
    scenario: dict[str, Any] = json.loads(path.read_text())
    named = _run(StragglerDetector(), scenario["steps"])
    assert not any(ranks & {1, 2, 3} for ranks in named)
    assert sum(1 for ranks in named if 0 in ranks) >= 150
    bare = _run(StragglerDetector(overshadow_ratio=0.0), scenario["steps"])
    assert next(i for i, ranks in enumerate(bare) if 1 in ranks) == 217
