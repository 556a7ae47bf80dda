"""Slow-link localisation: when a job gets a link check, and whose link is named slow."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from torshmon.aggregator.core.alert_engine import AlertEngine
from torshmon.aggregator.core.linkcheck import LinkChecker, LinkCheckSettings, _Baseline
from torshmon.aggregator.core.localization import localize, pair_bandwidths, pair_link_bounds
from torshmon.aggregator.core.promrules import expression, to_prometheus
from torshmon.aggregator.core.rule_file import load_rules_text
from torshmon.aggregator.core.rules import RuleError
from torshmon.aggregator.core.series import SeriesStore
from torshmon.aggregator.rule_files import default_rules
from torshmon.wire import LinkCheckResult, LinkPeerResult

MB = 4 * 2**20
TRIGGERED = "communication rose while compute did not"
FAST = 600e6  # bytes/s of a healthy pair
SLOW = 12e6  # bytes/s through a 100 Mbit/s link


def _results(
    check_id: str,
    world: int,
    slow: frozenset[int] = frozenset(),
    *,
    step: int = 7,
    wait_share: dict[int, float] | None = None,
) -> list[LinkCheckResult]:
    """Every rank's result of one check in which the ranks in ``slow`` have slow links;
    ``wait_share``: the share of each exchange's time the rank's threads waited for a
    CPU (none said: 0)."""
    rng = random.Random(check_id)
    out = []
    for rank in range(world):
        peers = []
        for peer in range(world):
            if peer == rank:
                continue
            bandwidth = SLOW if {rank, peer} & slow else FAST
            bandwidth *= rng.uniform(0.8, 1.0)  # noise only ever slows an exchange
            duration = MB / bandwidth
            wait = (wait_share or {}).get(rank, 0.0) * duration
            peers.append(
                LinkPeerResult(peer=peer, size_bytes=MB, duration_s=duration, cpu_wait_s=wait)
            )
        out.append(
            LinkCheckResult(id=check_id, job="j", rank=rank, step=step, duration_s=1, peers=peers)
        )
    return out


# -- localisation ---------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "slow"), [(3, 1), (3, 0), (4, 2), (8, 5)])
def test_the_rank_whose_pairs_are_all_slow_is_named(world: int, slow: int) -> None:
    reading = localize(world, pair_bandwidths(_results("c", world, frozenset({slow}))))
    assert reading.slow == (slow,)
    assert reading.bandwidth_by_rank[slow] < 0.5 * (reading.reference_bytes_per_s or 0)


def test_two_slow_ranks_of_eight_are_both_named() -> None:
    reading = localize(8, pair_bandwidths(_results("c", 8, frozenset({2, 6}))))
    assert reading.slow == (2, 6)


@pytest.mark.parametrize("world", [3, 4, 6])
def test_equal_links_name_nobody(world: int) -> None:
    assert localize(world, pair_bandwidths(_results("c", world))).slow == ()


def test_every_link_slow_names_nobody() -> None:
    reading = localize(3, pair_bandwidths(_results("c", 3, frozenset({0, 1, 2}))))
    assert reading.slow == ()


def test_one_slow_pair_is_noise_not_a_slow_rank() -> None:
    """A busy CPU slowing one exchange must not name either end: each has a fast pair."""
    pairs = {(0, 1): SLOW, (0, 2): FAST, (1, 2): FAST}
    assert localize(3, pairs).slow == ()


def test_each_pair_is_read_from_its_faster_side() -> None:
    one_side = LinkCheckResult(
        id="c", job="j", rank=0, step=1, duration_s=1,
        peers=[LinkPeerResult(peer=1, size_bytes=1000, duration_s=2.0)],
    )  # fmt: skip
    other_side = LinkCheckResult(
        id="c", job="j", rank=1, step=1, duration_s=1,
        peers=[LinkPeerResult(peer=0, size_bytes=1000, duration_s=1.0)],
    )  # fmt: skip
    assert pair_bandwidths([one_side, other_side]) == {(0, 1): 1000.0}


def test_at_world_size_two_only_a_slower_pair_than_before_is_named() -> None:
    pairs = {(0, 1): SLOW}
    assert localize(2, pairs).slow == ()  # nothing to compare with
    assert localize(2, pairs, reference_pair={(0, 1): FAST}).slow == (0, 1)
    assert localize(2, {(0, 1): 0.9 * FAST}, reference_pair={(0, 1): FAST}).slow == ()


def test_pair_link_bounds_take_the_larger_wait_off_the_faster_time() -> None:
    def side(rank: int, duration: float, wait: float | None) -> LinkCheckResult:
        peer = LinkPeerResult(peer=1 - rank, size_bytes=1000, duration_s=duration, cpu_wait_s=wait)
        return LinkCheckResult(id="c", job="j", rank=rank, step=1, duration_s=1, peers=[peer])

    assert pair_link_bounds([side(0, 2.0, 0.5), side(1, 1.5, 1.0)]) == {(0, 1): 2000.0}
    assert pair_link_bounds([side(0, 2.0, 2.5), side(1, 2.0, 0.0)]) == {(0, 1): math.inf}
    # A probe that did not measure its wait: the pair as measured.
    assert pair_link_bounds([side(0, 2.0, None), side(1, 4.0, 1.0)]) == {(0, 1): 500.0}


@pytest.mark.parametrize("world", [3, 4])
def test_a_rank_slow_only_while_its_threads_waited_for_a_cpu_is_not_named(world: int) -> None:
    """A busy host holds up gloo's threads: the exchanges are slow, and the run-queue
    delay covers the time lost. Such a rank is contended, not slow; with little wait
    the same timings name it."""
    results = _results("c", world, frozenset({1}), wait_share={1: 0.99})
    busy = localize(world, pair_bandwidths(results), bounds=pair_link_bounds(results))
    assert (busy.slow, busy.contended) == ((), (1,))
    results = _results("c", world, frozenset({1}), wait_share={1: 0.05, 0: 0.05})
    link = localize(world, pair_bandwidths(results), bounds=pair_link_bounds(results))
    assert (link.slow, link.contended) == ((1,), ())


def test_at_world_size_two_a_contended_reading_names_nothing_and_is_no_reference() -> None:
    checker = LinkChecker()
    _warm(checker, world=2)
    checker.sent("j", "w1", "requested", 200.0)
    for result in _results("w1", 2, frozenset({1}), wait_share={0: 0.99}):
        checker.observe_result(result, 200.0)
    checker.evaluate(200.0)
    reading = checker.last("j")
    assert reading is not None and (reading.slow, reading.contended) == ((), (0, 1))
    assert checker.active() == [] and checker.due(203.0) == []  # no suspect to confirm
    # The reference is still the healthy pair's: a slow link is a suspect at once.
    checker.sent("j", "w2", "requested", 210.0)
    _answer2(checker, "w2", 210.0, frozenset({1}))
    assert checker.due(213.0) == [("j", "confirm")]


# -- when to check --------------------------------------------------------------------------


def _steps(checker: LinkChecker, world: int, n: int, comm: dict[int, float], compute: float = 0.05,
           computes: dict[int, float] | None = None) -> None:  # fmt: skip
    for _ in range(n):
        for rank in range(world):
            c = (computes or {}).get(rank, compute)
            checker.observe_step("j", rank, comm.get(rank, comm.get(-1, 0.01)), c)


def _warm(checker: LinkChecker, world: int = 3, now: float = 100.0) -> None:
    checker.set_world("j", world)
    _steps(checker, world, 40, {-1: 0.01})
    assert checker.due(now) == [("j", "reference")]
    checker.sent("j", "ref", "reference", now)
    assert checker.due(now) == []  # one check at a time
    for result in _results("ref", world):
        checker.observe_result(result, now)
    checker.evaluate(now)
    assert checker.active() == []


def _answer(
    checker: LinkChecker, check_id: str, now: float, slow: frozenset[int] = frozenset()
) -> None:
    for result in _results(check_id, 3, slow):
        checker.observe_result(result, now)
    checker.evaluate(now)


def test_a_slow_link_is_checked_named_rechecked_and_cleared() -> None:
    checker = LinkChecker()
    _warm(checker)
    _steps(checker, 3, 10, {-1: 0.01})
    assert checker.due(110.0) == []  # healthy
    _steps(checker, 3, 6, {-1: 0.08})  # every rank's comm wait up 8x, compute flat
    [(job, reason)] = checker.due(116.0)  # the reference check does not hold it back
    assert job == "j" and "communication rose" in reason
    checker.sent("j", "c1", reason, 116.0)
    assert checker.due(117.0) == []  # one check at a time
    _answer(checker, "c1", 116.5, frozenset({1}))
    assert checker.active() == []  # named once: a suspect until a later check agrees
    assert checker.due(118.9) == []  # confirm_after_s (3 s) after the check: past a burst
    assert checker.due(119.0) == [("j", "confirm")]
    checker.sent("j", "c1b", "confirm", 119.0)
    _answer(checker, "c1b", 119.5, frozenset({1}))
    [finding] = checker.active()
    assert finding.kind == "slow_link"
    assert dict(finding.labels) == {"job": "j", "rank": "1"}
    assert finding.value < 0.5 * FAST and finding.score < 0.5
    assert finding.since_unix_s == 119.0
    assert "Slow network link at rank 1 of job j" in finding.summary
    assert "ethtool" in finding.recommendation
    assert finding.details["check_id"] == "c1b" and finding.details["step"] == 7

    assert checker.due(123.0) == []  # rechecks every recheck_s (5 s)
    assert checker.due(124.5) == [("j", "recheck")]
    checker.sent("j", "c2", "recheck", 124.5)
    _answer(checker, "c2", 125.0, frozenset({1}))
    [still] = checker.active()
    assert still.since_unix_s == 119.0  # the same condition, still going

    checker.sent("j", "c3", "recheck", 130.0)
    _answer(checker, "c3", 130.5, frozenset({2}))  # rank 1 recovered; a noisy rank 2?
    assert checker.active() == []  # a recheck naming a new rank needs a confirmation
    assert checker.due(133.0) == [("j", "confirm")]
    checker.sent("j", "c4", "confirm", 133.0)
    _answer(checker, "c4", 133.5)  # it was noise
    assert checker.active() == []
    assert checker.due(133.6) == []  # comm still high, but within min_interval_s of c1
    _steps(checker, 3, 6, {-1: 0.01})
    assert checker.due(140.0) == []  # back to normal


def test_a_straggler_does_not_trigger_a_link_check() -> None:
    """Peers wait for a slow rank (their comm wait rises) but its compute rose too."""
    checker = LinkChecker()
    _warm(checker)
    _steps(checker, 3, 10, {0: 0.2, 1: 0.01, 2: 0.2}, computes={1: 0.25})
    assert checker.due(200.0) == []


def test_a_whole_job_slowdown_in_compute_does_not_trigger() -> None:
    checker = LinkChecker()
    _warm(checker)
    _steps(checker, 3, 10, {-1: 0.08}, compute=0.2)
    assert checker.due(200.0) == []


def test_a_slow_link_that_also_raises_compute_a_little_is_checked() -> None:
    """A slow link raised every rank's compute 1.2-1.6x (a few ms) while the wait rose
    tens of ms: the factor alone explained nothing, and no check came."""
    checker = LinkChecker()
    _warm(checker)
    _steps(checker, 3, 10, {-1: 0.1}, computes={0: 0.065, 1: 0.075, 2: 0.07})  # 1.3-1.5x
    [(_, reason)] = checker.due(200.0)
    assert "communication rose" in reason


def test_a_rise_no_check_explains_becomes_the_new_baseline() -> None:
    settings = LinkCheckSettings(max_unexplained=2)
    checker = LinkChecker(settings)
    _warm(checker)
    now = 100.0
    for i in range(2):
        now += settings.min_interval_s
        _steps(checker, 3, 6, {-1: 0.08})
        [(_, reason)] = checker.due(now)
        checker.sent("j", f"u{i}", reason, now)
        _answer(checker, f"u{i}", now)
    now += settings.min_interval_s
    _steps(checker, 3, 40, {-1: 0.08})
    assert checker.due(now) == []  # relearned: 0.08 s is normal now


def test_a_job_that_refuses_checks_is_left_alone() -> None:
    checker = LinkChecker()
    checker.set_world("j", 3)
    _steps(checker, 3, 40, {-1: 0.01})
    now = 100.0
    for i in range(3):
        [(_, reason)] = checker.due(now)
        checker.sent("j", f"r{i}", reason, now)
        checker.command_done("j", f"r{i}", "rejected", now)
        now += 20.0
    assert checker.due(now) == []


def test_checks_that_expire_unanswered_are_no_refusal_and_go_on() -> None:
    """A busy job lets three checks expire: it is checked again once the interval has
    passed (refusals stop the checks, expiries do not)."""
    checker = LinkChecker()
    checker.set_world("j", 3)
    _steps(checker, 3, 40, {-1: 0.01})
    now = 100.0
    for i in range(3):
        [(_, reason)] = checker.due(now)
        checker.sent("j", f"e{i}", reason, now)
        assert checker.due(now + 1.0) == []  # one at a time
        checker.command_done("j", f"e{i}", "expired", now + 1.0)
        assert checker.due(now + 2.0) == []  # and not at once after an expiry
        now += 20.0
    assert checker.due(now) != []


def test_a_check_missing_a_rank_is_read_after_the_timeout() -> None:
    checker = LinkChecker(LinkCheckSettings(timeout_s=3.0))
    _warm(checker)
    checker.sent("j", "p", TRIGGERED, 200.0)
    for result in _results("p", 3, frozenset({2}))[:2]:  # rank 2 never answers
        checker.observe_result(result, 200.5)
    checker.evaluate(201.0)
    assert checker.active() == []
    checker.evaluate(204.0)  # read without rank 2: slow in every pair it answered for
    assert checker.active() == []
    assert checker.due(204.0) == [("j", "confirm")]
    checker.sent("j", "p2", "confirm", 204.0)
    _answer(checker, "p2", 204.5, frozenset({2}))
    [finding] = checker.active()
    assert finding.labels["rank"] == "2"


def test_a_check_asked_for_by_hand_is_read_too_and_confirmed() -> None:
    checker = LinkChecker()
    checker.set_world("j", 3)
    for result in _results("manual", 3, frozenset({0})):
        checker.observe_result(result, 50.0)
    checker.evaluate(50.0)
    assert checker.active() == []  # not prompted by the job's timings: confirm first
    assert checker.due(50.1) == [("j", "confirm")]
    checker.sent("j", "again", "confirm", 50.1)
    for result in _results("again", 3, frozenset({0})):
        checker.observe_result(result, 50.5)
    checker.evaluate(50.5)
    assert [f.labels["rank"] for f in checker.active()] == ["0"]
    checker.forget("j")
    assert checker.active() == []


def _answer2(checker: LinkChecker, check_id: str, now: float, slow: frozenset[int]) -> None:
    for result in _results(check_id, 2, slow):
        checker.observe_result(result, now)
    checker.evaluate(now)


def test_world_size_two_names_the_pair_once_a_second_check_agrees() -> None:
    checker = LinkChecker()
    _warm(checker, world=2)
    checker.sent("j", "w1", "requested", 200.0)
    _answer2(checker, "w1", 200.0, frozenset({1}))
    assert checker.active() == []
    assert checker.due(202.9) == []
    assert checker.due(203.0) == [("j", "confirm")]  # confirm_after_s, no rate limit
    checker.sent("j", "w2", "confirm", 203.0)
    _answer2(checker, "w2", 203.5, frozenset({1}))
    [finding] = checker.active()
    assert finding.labels["rank"] == "0-1"
    assert checker.check_args("j") == {"repeats": 3}  # one pair: best of three
    assert "cannot tell which end" in finding.summary


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slow_ratio": 1.0}, "slow_ratio must be in"),
        ({"comm_rise": 1.0}, "comm_rise must be > 1"),
        ({"recheck_s": -1.0}, "recheck_s must be a finite number"),
        ({"recent_steps": 0}, "recent_steps must be >= 1"),
        ({"baseline_steps": 5}, "baseline_steps .5. must be >= min_baseline_steps"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkCheckSettings(**kwargs)  # type: ignore[arg-type]


# -- the rule -------------------------------------------------------------------------------


def test_the_default_slow_link_rule_fires_and_resolves_with_the_finding() -> None:
    rules = default_rules()
    rule = rules.get("Slow Link")
    assert rule is not None and rule.kind == "slow_link"
    engine = AlertEngine(rules)
    series = SeriesStore()
    checker = LinkChecker()
    checker.set_world("j", 3)
    for check_id, sent in (("c", 6.0), ("c2", 9.0)):  # named, then confirmed
        checker.sent("j", check_id, TRIGGERED, sent)
        for result in _results(check_id, 3, frozenset({1})):
            checker.observe_result(result, 10.0)
        checker.evaluate(10.0)
    fired = [a for a in engine.evaluate(10.0, series, checker.active()) if a.rule == "Slow Link"]
    [alert] = fired
    assert alert.state == "firing"
    assert alert.labels["rank"] == "1" and alert.labels["job"] == "j"
    assert "rank 1 of job j" in alert.annotations["summary"]
    assert "ethtool" in alert.annotations["recommendation"]
    assert engine.evaluate(11.0, series, checker.active()) == []
    [resolved] = engine.evaluate(12.0, series, [])
    assert resolved.state == "resolved" and resolved.labels["rank"] == "1"


def test_slow_link_rules_parse_and_export() -> None:
    ruleset = load_rules_text(
        "rules:\n  - name: Slow\n    kind: slow_link\n    matchers: {job: train}\n"
    )
    [rule] = ruleset
    assert rule.instance_labels == ("job", "rank", "node")
    assert expression(rule) == ('torshmon_slow_link_bandwidth_bytes_per_second{job="train"} > 0')
    exported = to_prometheus(ruleset)
    assert "(rank: {{ $labels.rank }}, node: {{ $labels.node }})" in exported
    with pytest.raises(RuleError, match=r"rules\[0\]\.metric: not allowed for kind 'slow_link'"):
        load_rules_text("rules:\n  - name: Slow\n    kind: slow_link\n    metric: loss\n")
    with pytest.raises(RuleError, match=r"unknown field \{op\}"):
        load_rules_text(
            "rules:\n  - name: S\n    kind: slow_link\n    annotations: {summary: '{op}'}\n"
        )


def test_every_pair_is_measured_in_the_results() -> None:
    pairs = pair_bandwidths(_results("c", 5))
    assert sorted(pairs) == list(itertools.combinations(range(5), 2))


def test_world_size_two_drops_a_slow_reading_the_confirmation_contradicts() -> None:
    checker = LinkChecker()
    _warm(checker, world=2)
    checker.sent("j", "w1", "requested", 200.0)
    _answer2(checker, "w1", 200.0, frozenset({0}))
    checker.sent("j", "w2", "confirm", 200.1)
    _answer2(checker, "w2", 200.5, frozenset())
    assert checker.active() == []
    assert checker.due(201.0) == []


def test_slow_link_findings_fit_the_migrated_history(tmp_path: Path) -> None:
    from sqlalchemy import insert
    from sqlalchemy.exc import IntegrityError

    from torshmon.history.db import make_engine
    from torshmon.history.migrate import upgrade
    from torshmon.history.models import Base

    url = f"sqlite:///{tmp_path / 'h.db'}"
    upgrade(url)
    findings = Base.metadata.tables["findings"]
    row = {
        "job": "j", "rank": 1, "value": 1.0, "score": 0.1, "summary": "s",
        "recommendation": "r", "severity": "high", "since_unix_s": 1.0,
        "detected_unix_s": 2.0, "details": {},
    }  # fmt: skip
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(insert(findings), [{**row, "kind": "slow_link"}])
        with pytest.raises(IntegrityError, match="ck_findings_kind"), engine.begin() as conn:
            conn.execute(insert(findings), [{**row, "kind": "slow_lnk"}])
    finally:
        engine.dispose()


_TIMES = st.sampled_from([0.0, -0.0, -0.5, 0.01, 0.02, 0.5, math.inf, math.nan])
_ZEROS = [(0.0, 0.0), (-0.0, -0.0), (math.inf, math.inf), (-0.5, -0.5)]


@settings(max_examples=300, deadline=None)
@given(
    maxlen=st.integers(1, 8),
    batches=st.lists(
        st.one_of(st.none(), st.lists(st.tuples(_TIMES, _TIMES), max_size=6)), max_size=20
    ),
)
# The step that leaves is the oldest of its equals: 0.0 goes, -0.0 is the median.
@example(maxlen=3, batches=[_ZEROS])
def test_baseline_medians_are_statistics_median_of_the_window(
    maxlen: int, batches: list[list[tuple[float, float]] | None]
) -> None:
    """The baseline keeps its comm times sorted as steps come and go (None: cleared)."""
    baseline = _Baseline(maxlen)
    for batch in batches:
        if batch is None:
            baseline.clear()
        else:
            baseline.extend(batch)
        assert len(baseline) == len(baseline.steps) <= maxlen
        if baseline.steps:
            comm = statistics.median(c for c, _ in baseline.steps)
            compute = statistics.median(c for _, c in baseline.steps)
            # repr: NaN equals nothing, and -0.0 == 0.0.
            assert repr(baseline.median_comm()) == repr(comm)
            assert repr(baseline.median_compute()) == repr(compute)


@settings(max_examples=200, deadline=None)
@given(
    recent_steps=st.integers(1, 6),
    batches=st.lists(
        st.tuples(st.integers(-1, 3), st.lists(st.tuples(_TIMES, _TIMES), max_size=9)),
        max_size=20,
    ),
)
def test_observe_steps_is_observe_step_one_by_one(
    recent_steps: int, batches: list[tuple[int, list[tuple[float, float]]]]
) -> None:
    settings = LinkCheckSettings(recent_steps=recent_steps, baseline_steps=20)
    one, many = LinkChecker(settings), LinkChecker(settings)
    for checker in (one, many):
        checker.set_world("j", 3)  # rank 3 and -1 are out of range
    for i, (rank, steps) in enumerate(batches):
        for comm, compute in steps:
            one.observe_step("j", rank, comm, compute)
        many.observe_steps("j", rank, [c for c, _ in steps], [c for _, c in steps])
        assert repr(many.due(float(i))) == repr(one.due(float(i)))
        ranks_one, ranks_many = one._jobs["j"].ranks, many._jobs["j"].ranks
        assert ranks_many.keys() == ranks_one.keys()
        for r, kept in ranks_one.items():
            assert repr(list(ranks_many[r].recent)) == repr(list(kept.recent))
            assert repr(list(ranks_many[r].older)) == repr(list(kept.older))
            assert repr(list(ranks_many[r].baseline.steps)) == repr(list(kept.baseline.steps))


def test_observe_steps_refuses_columns_of_different_lengths() -> None:
    checker = LinkChecker()
    checker.set_world("j", 2)
    with pytest.raises(ValueError):
        checker.observe_steps("j", 0, [0.1, 0.2], [0.1])
