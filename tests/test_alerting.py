from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torshmon.aggregator.core.alert import Alert, fingerprint
from torshmon.aggregator.core.alert_engine import AlertEngine
from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.rule_file import load_rules_text
from torshmon.aggregator.core.rules import RuleSet
from torshmon.aggregator.core.series import LabelSet, SeriesStore, labelset
from torshmon.aggregator.rule_files import default_rules

RANK0 = labelset(job="j", rank="0")


def _rules(text: str) -> RuleSet:
    return load_rules_text(text, source="test.yaml")


def _states(alerts: Sequence[Alert]) -> list[tuple[str, str]]:
    return [(alert.rule, alert.state) for alert in alerts]


THRESHOLD = """
rules:
  - name: Slow
    kind: threshold
    metric: step_duration_seconds
    op: ">"
    value: 1.0
    for: 10s
    severity: high
    labels: {team: ml}
    annotations:
      summary: "rank {rank} of {job}: {value:.1f} s ({alertname}, {severity}, {team}, {metric})"
    actions: [notify, autotune]
"""


def test_threshold_goes_pending_firing_resolved() -> None:
    engine = AlertEngine(_rules(THRESHOLD))
    series = SeriesStore()
    series.add("step_duration_seconds", RANK0, 100.0, 0.5)
    assert engine.evaluate(100.0, series, []) == []

    series.add("step_duration_seconds", RANK0, 101.0, 2.0)
    [pending] = engine.evaluate(101.0, series, [])
    assert pending.state == "pending"
    assert pending.starts_at_unix_s == 101.0
    assert pending.labels == {
        "alertname": "Slow",
        "severity": "high",
        "job": "j",
        "rank": "0",
        "team": "ml",
    }
    assert pending.annotations == {
        "summary": "rank 0 of j: 2.0 s (Slow, high, ml, step_duration_seconds)"
    }
    assert pending.value == 2.0
    assert engine.evaluate(110.9, series, []) == []  # not yet 10 s

    series.add("step_duration_seconds", RANK0, 111.0, 3.0)
    [firing] = engine.evaluate(111.0, series, [])
    assert (firing.state, firing.value, firing.starts_at_unix_s) == ("firing", 3.0, 111.0)
    assert firing.actions == ("notify", "autotune")
    assert firing.fingerprint == pending.fingerprint == fingerprint("Slow", firing.labels)
    assert engine.evaluate(112.0, series, []) == []
    assert _states(engine.active()) == [("Slow", "firing")]

    series.add("step_duration_seconds", RANK0, 113.0, 0.5)
    [resolved] = engine.evaluate(113.0, series, [])
    assert (resolved.state, resolved.ends_at_unix_s, resolved.starts_at_unix_s) == (
        "resolved",
        113.0,
        111.0,
    )
    assert resolved.actions == ("notify", "autotune")
    assert resolved.fingerprint == firing.fingerprint
    assert resolved.value == 3.0  # the last value while it held
    assert engine.active() == []


def test_for_zero_fires_in_the_first_evaluation_with_one_transition() -> None:
    engine = AlertEngine(_rules(THRESHOLD.replace("for: 10s", "for: 0s")))
    series = SeriesStore()
    series.add("step_duration_seconds", RANK0, 100.0, 2.0)
    [firing] = engine.evaluate(100.0, series, [])
    assert (firing.state, firing.starts_at_unix_s) == ("firing", 100.0)


def test_a_pending_alert_that_clears_resolves_without_actions() -> None:
    engine = AlertEngine(_rules(THRESHOLD))
    series = SeriesStore()
    series.add("step_duration_seconds", RANK0, 100.0, 2.0)
    [pending] = engine.evaluate(100.0, series, [])
    series.add("step_duration_seconds", RANK0, 105.0, 0.1)
    [resolved] = engine.evaluate(105.0, series, [])
    assert (resolved.state, resolved.actions) == ("resolved", ())
    assert (resolved.starts_at_unix_s, resolved.ends_at_unix_s) == (100.0, 105.0)
    assert resolved.fingerprint == pending.fingerprint
    # It starts over: a new pending period, not a firing one.
    series.add("step_duration_seconds", RANK0, 106.0, 2.0)
    assert _states(engine.evaluate(106.0, series, [])) == [("Slow", "pending")]


def test_cooldown_keeps_a_flapping_instance_quiet() -> None:
    text = THRESHOLD.replace("for: 10s", "for: 0s\n    cooldown: 60s")
    engine = AlertEngine(_rules(text))
    series = SeriesStore()
    other = labelset(job="j", rank="1")

    def feed(ts: float, value: float, labels: tuple[tuple[str, str], ...] = RANK0) -> None:
        series.add("step_duration_seconds", labels, ts, value)

    feed(100.0, 2.0)
    assert _states(engine.evaluate(100.0, series, [])) == [("Slow", "firing")]
    feed(101.0, 0.5)
    assert _states(engine.evaluate(101.0, series, [])) == [("Slow", "resolved")]
    feed(102.0, 2.0)
    feed(102.0, 2.0, other)  # another instance is not in cooldown
    [other_firing] = engine.evaluate(102.0, series, [])
    assert other_firing.labels["rank"] == "1"
    feed(160.0, 2.0)
    assert engine.evaluate(160.0, series, []) == []  # 59 s after resolving
    feed(161.0, 2.0)
    [again] = engine.evaluate(161.0, series, [])
    assert (again.state, again.labels["rank"]) == ("firing", "0")


def test_aggregate_mean_by_job() -> None:
    rules = _rules(
        """
rules:
  - name: Comm
    kind: threshold
    metric: communication_time_ratio
    op: ">"
    value: 0.4
    aggregate: mean
    by: [job]
"""
    )
    engine = AlertEngine(rules)
    series = SeriesStore()
    # A NaN is left out of the mean (else job a's mean would be NaN and never fire).
    for job, values in (("a", [0.3, 0.6, 0.6, math.nan]), ("b", [0.3, 0.3, 0.5])):
        for rank, value in enumerate(values):
            series.add("communication_time_ratio", labelset(job=job, rank=str(rank)), 1.0, value)
    [firing] = engine.evaluate(1.0, series, [])
    assert firing.labels == {"alertname": "Comm", "severity": "warning", "job": "a"}
    assert firing.value == pytest.approx(0.5)
    assert firing.annotations["summary"] == (
        "Comm: communication_time_ratio is 0.5 (> 0.4) on job=a"
    )


@pytest.mark.parametrize(("aggregate", "fires"), [("max", True), ("min", False), ("sum", True)])
def test_other_aggregates(aggregate: str, fires: bool) -> None:
    rules = _rules(
        f"""
rules:
  - name: Comm
    kind: threshold
    metric: communication_time_ratio
    op: ">"
    value: 0.5
    aggregate: {aggregate}
"""
    )
    series = SeriesStore()
    for rank, value in enumerate([0.2, 0.6]):
        series.add("communication_time_ratio", labelset(job="j", rank=str(rank)), 1.0, value)
    alerts = AlertEngine(rules).evaluate(1.0, series, [])
    assert bool(alerts) is fires
    if fires:
        assert alerts[0].labels == {"alertname": "Comm", "severity": "warning"}


def test_matchers_and_staleness() -> None:
    rules = _rules(
        """
rules:
  - name: Busy
    kind: threshold
    metric: cpu_utilization_ratio
    op: ">"
    value: 0.9
    matchers: {node: n1}
"""
    )
    engine = AlertEngine(rules, stale_after_s=60.0)
    series = SeriesStore()
    series.add("cpu_utilization_ratio", labelset(node="n1"), 100.0, 0.95)
    series.add("cpu_utilization_ratio", labelset(node="n2"), 100.0, 0.95)
    [firing] = engine.evaluate(100.0, series, [])
    assert firing.labels["node"] == "n1"
    # The node stops reporting: its last value must not hold the alert forever.
    assert engine.evaluate(160.0, series, []) == []
    [resolved] = engine.evaluate(160.5, series, [])
    assert resolved.state == "resolved"


def test_nonfinite_loss_fires_with_no_value_in_the_record() -> None:
    engine = AlertEngine(default_rules())
    series = SeriesStore()
    series.add("loss", RANK0, 10.0, 2.5)
    series.add("loss", labelset(job="j", rank="1"), 10.0, 2.5)
    assert engine.evaluate(10.0, series, []) == []
    series.add("loss", RANK0, 11.0, math.nan)
    [firing] = engine.evaluate(11.0, series, [])
    assert (firing.rule, firing.state, firing.severity) == ("Non-finite Loss", "firing", "critical")
    assert firing.value is None
    assert firing.annotations["summary"] == "Loss of job j rank 0 is nan: training diverged"
    series.add("loss", RANK0, 12.0, math.inf)
    assert engine.evaluate(12.0, series, []) == []


def test_nonfinite_loss_sees_a_nan_followed_by_finite_steps_and_resolves_a_window_later() -> None:
    """One ingested batch can carry a NaN step and the finite steps after it."""
    engine = AlertEngine(default_rules())
    series = SeriesStore()
    for ts, loss in ((10.0, 2.5), (10.1, math.nan), (10.2, 2.4), (10.3, 2.4)):
        series.add("loss", RANK0, ts, loss)
    [firing] = engine.evaluate(10.5, series, [])
    assert (firing.rule, firing.state, firing.labels["rank"]) == ("Non-finite Loss", "firing", "0")
    series.add("loss", RANK0, 15.0, 2.3)
    assert engine.evaluate(15.0, series, []) == []  # still firing: the NaN is in the window
    series.add("loss", RANK0, 20.5, 2.3)
    [resolved] = engine.evaluate(20.5, series, [])
    assert resolved.state == "resolved"


def test_finding_rules_take_labels_value_and_texts_from_the_finding() -> None:
    engine = AlertEngine(default_rules())
    series = SeriesStore()
    straggler = Finding(
        kind="straggler",
        labels={"job": "j", "rank": "3"},
        value=0.8,
        score=6.0,
        summary="rank 3 of job j computes 60% slower than its peers",
        since_unix_s=95.0,
        recommendation="check rank 3's host",
    )
    step_anomaly = Finding(
        kind="anomaly",
        labels={"job": "j", "metric": "step_duration_seconds"},
        value=1.2,
        score=4.0,
        summary="job j steps take 1.2 s, usually 0.5 s",
        since_unix_s=99.0,
    )
    throughput_anomaly = Finding(
        kind="anomaly",
        labels={"job": "j", "metric": "communication_time_ratio"},
        value=1.0,
        score=4.0,
        summary="no default rule for this one",
        since_unix_s=99.0,
    )
    alerts = engine.evaluate(100.0, series, [straggler, step_anomaly, throughput_anomaly])
    assert _states(alerts) == [("Step Time Anomaly", "firing"), ("Straggler", "firing")]
    anomaly, slow = alerts
    assert anomaly.labels == {
        "alertname": "StepTimeAnomaly",
        "severity": "warning",
        "job": "j",
        "metric": "step_duration_seconds",
    }
    assert anomaly.rank is None
    assert anomaly.annotations == {"summary": "job j steps take 1.2 s, usually 0.5 s"}
    assert (slow.value, slow.rank, slow.severity) == (0.8, "3", "high")
    assert slow.annotations == {
        "summary": "rank 3 of job j computes 60% slower than its peers",
        "recommendation": "check rank 3's host",
    }
    assert engine.evaluate(101.0, series, [straggler, step_anomaly]) == []
    [resolved] = engine.evaluate(102.0, series, [step_anomaly])
    assert (resolved.rule, resolved.state) == ("Straggler", "resolved")


def test_a_straggler_named_again_between_two_evaluations_is_a_new_alert() -> None:
    """The detector let rank 3 go and named it again within one ingest (a batch of many
    short steps): no evaluation saw it clear, but the finding's ``since`` is later, so the
    first alert resolves and the second episode gets an alert of its own (the benchmark
    saw one alert span two faults 60 steps apart). The same episode stays one alert."""
    engine = AlertEngine(default_rules())
    series = SeriesStore()

    def straggler(since: float) -> Finding:
        return Finding(
            kind="straggler",
            labels={"job": "j", "rank": "3"},
            value=0.8,
            score=1.5,
            summary="rank 3 of job j computes 1.50x slower",
            since_unix_s=since,
        )

    [first] = engine.evaluate(100.0, series, [straggler(99.0)])
    assert engine.evaluate(101.0, series, [straggler(99.0)]) == []
    resolved, fired = engine.evaluate(102.0, series, [straggler(101.5)])
    assert (resolved.state, resolved.fingerprint) == ("resolved", first.fingerprint)
    assert resolved.ends_at_unix_s == 102.0
    assert (fired.state, fired.starts_at_unix_s) == ("firing", 102.0)
    assert engine.evaluate(103.0, series, [straggler(101.5)]) == []


def test_an_open_alert_is_revised_to_the_findings_latest_sentence_without_a_transition() -> None:
    """A straggler's ratio moves as its episode goes on: the alert's stored text follows
    it (``revised``, at most every ``revise_every_s``) while no transition is emitted,
    so nobody is notified again; the resolution carries the latest text too."""
    engine = AlertEngine(default_rules(), revise_every_s=10.0)
    series = SeriesStore()

    def straggler(ratio: float) -> Finding:
        return Finding(
            kind="straggler",
            labels={"job": "j", "rank": "1"},
            value=0.8,
            score=ratio,
            summary=f"rank 1 of job j computes {ratio:.2f}x as long as its peers",
            since_unix_s=99.0,
        )

    [fired] = engine.evaluate(100.0, series, [straggler(3.86)])
    assert fired.state == "firing"
    assert "3.86x" in fired.annotations["summary"]
    assert engine.revised(100.0) == []  # just stored

    assert engine.evaluate(105.0, series, [straggler(4.10)]) == []
    assert engine.revised(105.0) == []  # not 10 s since it was stored
    assert engine.evaluate(110.0, series, [straggler(4.32)]) == []
    [revised] = engine.revised(110.0)
    assert (revised.state, revised.fingerprint) == ("firing", fired.fingerprint)
    assert revised.annotations["summary"] == "rank 1 of job j computes 4.32x as long as its peers"
    assert revised.starts_at_unix_s == fired.starts_at_unix_s
    assert engine.revised(130.0) == []  # the same text is not written again

    [resolved] = engine.evaluate(131.0, series, [])
    assert resolved.state == "resolved"
    assert "4.32x" in resolved.annotations["summary"]
    with pytest.raises(ValueError, match="revise_every_s"):
        AlertEngine(default_rules(), revise_every_s=-1.0)


def test_finding_rule_for_counts_from_when_the_finding_began() -> None:
    rules = _rules(
        """
rules:
  - name: Stuck
    kind: hang
    for: 30s
    severity: critical
    matchers: {job: j}
    annotations:
      summary: "rank {rank} of {job} stuck in {op} ({pg}) for {value:.0f} s"
"""
    )
    engine = AlertEngine(rules)
    hang = Finding(
        kind="hang",
        labels={"job": "j", "rank": "1", "op": "all_reduce", "pg": "0"},
        value=12.0,
        score=12.0,
        summary="rank 1 has not joined all_reduce #41",
        since_unix_s=88.0,
    )
    other_job = Finding(
        kind="hang",
        labels={"job": "k", "rank": "1", "op": "all_reduce", "pg": "0"},
        value=12.0,
        score=12.0,
        summary="",
        since_unix_s=88.0,
    )
    [pending] = engine.evaluate(100.0, SeriesStore(), [hang, other_job])
    assert (pending.state, pending.starts_at_unix_s) == ("pending", 88.0)
    assert pending.annotations["summary"] == "rank 1 of j stuck in all_reduce (0) for 12 s"
    assert engine.evaluate(117.9, SeriesStore(), [hang]) == []
    [firing] = engine.evaluate(118.0, SeriesStore(), [hang])
    assert firing.state == "firing"


def test_the_default_memory_leak_rule_catches_a_leak_within_a_minute() -> None:
    # The store holds the whole run; the engine only reads the window before `now`.
    engine = AlertEngine(default_rules())
    series = SeriesStore()
    labels = labelset(job="j", rank="0", node="n")
    fired = None
    for now in range(0, 200):
        if now % 2 == 0:
            # Flat for 60 s, then leaking 20 MB/s.
            series.add("rank_memory_rss_bytes", labels, float(now), 1e9 + 20e6 * max(0, now - 60))
        for alert in engine.evaluate(float(now), series, []):
            if alert.state == "firing":
                fired = alert
                break
        if fired is not None:
            break
    assert fired is not None
    assert fired.rule == "Memory Leak"
    assert fired.starts_at_unix_s - 60 < 60
    assert fired.value is not None and fired.value > 10e6
    assert fired.labels["node"] == "n"
    assert fired.annotations["summary"].startswith("Memory of job j rank 0 on node n grows by ")


@pytest.mark.parametrize("jump_at_s", [10, 100])
def test_the_default_memory_leak_rule_ignores_a_single_jump(jump_at_s: int) -> None:
    engine = AlertEngine(default_rules())
    series = SeriesStore()
    labels = labelset(job="j", rank="0", node="n")
    states = []
    for now in range(0, 200):
        if now % 2 == 0:
            rss = 1e9 + (4e9 if now >= jump_at_s else 0.0) + 1e5 * (now % 3)
            series.add("rank_memory_rss_bytes", labels, float(now), rss)
        states.extend(_states(engine.evaluate(float(now), series, [])))
    # The jump tilts the slope, but it rises once between flat points: not steady.
    assert not [s for s in states if s[0] == "Memory Leak"]


def test_the_default_memory_leak_rule_fires_within_ten_seconds_of_a_steady_leak() -> None:
    engine = AlertEngine(default_rules())
    series = SeriesStore()
    labels = labelset(job="j", rank="0", node="n")
    fired_at = None
    for now in range(0, 120):
        # Flat (with sampling noise) for 60 s, then leaking 30 MB/s, one sample a second.
        rss = 1e9 + 1e5 * (now % 3) + 30e6 * max(0, now - 60)
        series.add("rank_memory_rss_bytes", labels, float(now), rss)
        states = _states(engine.evaluate(float(now), series, []))
        if ("Memory Leak", "firing") in states:
            fired_at = now
            break
    assert fired_at is not None and fired_at - 60 <= 10


@pytest.mark.parametrize("switched", [True, False])
def test_a_config_switch_is_no_memory_leak_until_it_leaves_the_window(switched: bool) -> None:
    """An autotuner trial at t=60 allocates its buffers over 8 s (RSS rises 30 MB/s, then
    stays): with the switch reported, the Memory Leak rule leaves the job's series alone
    while the switch is in its window; unreported, the same rise fires."""
    engine = AlertEngine(default_rules())
    series = SeriesStore()
    labels = labelset(job="j", rank="0", node="n")
    switches = {"j": 60.0} if switched else {}
    fired = []
    for now in range(0, 120):
        rss = 1e9 + 1e5 * (now % 3) + 30e6 * min(max(0, now - 60), 8)
        series.add("rank_memory_rss_bytes", labels, float(now), rss)
        fired += [a for a in engine.evaluate(float(now), series, [], switches)]
    assert [a.rule for a in fired if a.state == "firing"] == ([] if switched else ["Memory Leak"])


def test_a_leak_after_a_config_switch_settles_is_still_caught() -> None:
    engine = AlertEngine(default_rules())
    series = SeriesStore()
    labels = labelset(job="j", rank="0", node="n")
    fired_at = None
    for now in range(0, 120):
        rss = 1e9 + 1e5 * (now % 3) + 30e6 * max(0, now - 40)  # leaking from t=40
        series.add("rank_memory_rss_bytes", labels, float(now), rss)
        states = _states(engine.evaluate(float(now), series, [], {"j": 30.0}))
        if ("Memory Leak", "firing") in states:
            fired_at = now
            break
    assert fired_at is not None and fired_at - 40 <= 10


def test_rate_needs_points_spanning_half_the_window() -> None:
    rules = _rules(
        """
rules:
  - name: Growth
    kind: rate
    metric: rank_memory_rss_bytes
    op: ">"
    value: 1.0
    window: 20s
"""
    )
    engine = AlertEngine(rules)
    series = SeriesStore()
    labels = labelset(job="j", rank="0", node="n")
    for ts in range(0, 9):
        series.add("rank_memory_rss_bytes", labels, float(ts), 100.0 * ts)
    assert engine.evaluate(9.0, series, []) == []  # 8 s of points, needs 10 s
    series.add("rank_memory_rss_bytes", labels, 10.0, 1000.0)
    [firing] = engine.evaluate(10.0, series, [])
    assert firing.value == pytest.approx(100.0)


def test_increase_fires_on_a_counters_rise_counts_resets_and_resolves_after_the_window() -> None:
    """A counter written when it changes: 0 then 2 fires with the rise (2); no new rise
    for a window resolves it; a drop is a reset, counted from 0 (3 after 2 -> 1: +1)."""
    rules = _rules(
        """
rules:
  - name: Failed
    kind: increase
    metric: collective_failures_total
    op: ">"
    value: 0
    window: 30s
"""
    )
    engine = AlertEngine(rules)
    series = SeriesStore()
    labels = labelset(job="j", rank="1", op="all_reduce", pg="default")
    series.add("collective_failures_total", labels, 9.999, 0.0)
    assert engine.evaluate(9.0, series, []) == []  # one point: no increase yet
    series.add("collective_failures_total", labels, 10.0, 2.0)
    [firing] = engine.evaluate(10.5, series, [])
    assert (firing.state, firing.value, firing.labels["rank"]) == ("firing", 2.0, "1")
    assert firing.annotations["summary"] == (
        "Failed: collective_failures_total rose by 2 in the last 30s (> 0) on job=j, "
        "rank=1, op=all_reduce, pg=default"
    )
    assert engine.evaluate(39.0, series, []) == []  # still inside the window: no change
    [resolved] = engine.evaluate(41.0, series, [])  # the rise left the window
    assert resolved.state == "resolved"
    series.add("collective_failures_total", labels, 50.0, 2.0)
    series.add("collective_failures_total", labels, 51.0, 1.0)  # the rank restarted
    [again] = engine.evaluate(51.0, series, [])
    assert (again.state, again.value) == ("firing", 1.0)


def test_absent_fires_for_a_silent_series_and_resolves_when_it_returns() -> None:
    rules = _rules(
        """
rules:
  - name: Silent
    kind: absent
    metric: step_duration_seconds
    for: 60s
"""
    )
    engine = AlertEngine(rules)
    series = SeriesStore()
    series.add("step_duration_seconds", RANK0, 100.0, 0.5)
    series.add("step_duration_seconds", labelset(job="j", rank="1"), 150.0, 0.5)
    assert engine.evaluate(159.0, series, []) == []
    [firing] = engine.evaluate(160.0, series, [])
    assert (firing.state, firing.labels["rank"], firing.starts_at_unix_s) == ("firing", "0", 160.0)
    assert firing.value == 60.0
    assert firing.annotations["summary"] == (
        "Silent: no step_duration_seconds sample for 60 s on job=j, rank=0"
    )
    series.add("step_duration_seconds", RANK0, 170.0, 0.5)
    [resolved] = engine.evaluate(170.0, series, [])
    assert resolved.state == "resolved"
    # A finished job is forgotten: its silence is not an alert.
    series.forget({"job": "j"})
    assert engine.evaluate(1000.0, series, []) == []


def test_restore_resumes_firing_and_pending_instances() -> None:
    rules = _rules(THRESHOLD)
    first = AlertEngine(rules)
    series = SeriesStore()
    other = labelset(job="j", rank="1")
    series.add("step_duration_seconds", RANK0, 100.0, 2.0)
    first.evaluate(100.0, series, [])
    series.add("step_duration_seconds", RANK0, 110.0, 2.0)
    series.add("step_duration_seconds", other, 110.0, 2.0)
    first.evaluate(110.0, series, [])
    stored = first.active()
    assert sorted(_states(stored)) == [("Slow", "firing"), ("Slow", "pending")]

    second = AlertEngine(rules)
    second.restore(stored)
    assert sorted(a.fingerprint for a in second.active()) == sorted(a.fingerprint for a in stored)
    series.add("step_duration_seconds", RANK0, 115.0, 2.0)
    series.add("step_duration_seconds", other, 115.0, 2.0)
    assert second.evaluate(115.0, series, []) == []  # no duplicate firing, no new pending
    series.add("step_duration_seconds", other, 120.0, 2.0)
    series.add("step_duration_seconds", RANK0, 120.0, 0.5)
    alerts = second.evaluate(120.0, series, [])
    by_rank = {alert.labels["rank"]: alert for alert in alerts}
    assert by_rank["1"].state == "firing"  # 10 s after its restored pending start
    assert by_rank["0"].state == "resolved"
    assert by_rank["0"].starts_at_unix_s == 110.0
    assert by_rank["0"].fingerprint == fingerprint("Slow", by_rank["0"].labels)


def test_restore_of_a_resolved_alert_restores_its_cooldown() -> None:
    rules = _rules(THRESHOLD.replace("for: 10s", "for: 0s\n    cooldown: 60s"))
    labels = {"alertname": "Slow", "severity": "high", "job": "j", "rank": "0", "team": "ml"}
    resolved = Alert(
        rule="Slow",
        state="resolved",
        severity="high",
        labels=labels,
        annotations={},
        value=2.0,
        starts_at_unix_s=50.0,
        ends_at_unix_s=90.0,
    )
    engine = AlertEngine(rules)
    engine.restore([resolved])
    series = SeriesStore()
    series.add("step_duration_seconds", RANK0, 100.0, 2.0)
    assert engine.evaluate(100.0, series, []) == []
    series.add("step_duration_seconds", RANK0, 150.0, 2.0)
    assert _states(engine.evaluate(150.0, series, [])) == [("Slow", "firing")]


def test_restored_alerts_of_removed_rules_resolve_at_the_next_evaluation() -> None:
    gone_firing = Alert(
        rule="Removed",
        state="firing",
        severity="warning",
        labels={"alertname": "Removed", "severity": "warning", "job": "j"},
        annotations={"summary": "s"},
        value=1.0,
        starts_at_unix_s=10.0,
        actions=("notify",),
    )
    gone_pending = Alert(
        rule="Removed",
        state="pending",
        severity="warning",
        labels={"alertname": "Removed", "severity": "warning", "job": "k"},
        annotations={},
        value=None,
        starts_at_unix_s=10.0,
    )
    engine = AlertEngine(_rules(THRESHOLD))
    engine.restore([gone_firing, gone_pending])
    alerts = engine.evaluate(20.0, SeriesStore(), [])
    assert [(a.fingerprint, a.state, a.actions, a.ends_at_unix_s) for a in alerts] == [
        (gone_firing.fingerprint, "resolved", ("notify",), 20.0),
        (gone_pending.fingerprint, "resolved", (), 20.0),
    ]
    assert engine.evaluate(21.0, SeriesStore(), []) == []


def test_evaluation_is_deterministic() -> None:
    def run() -> list[Alert]:
        engine = AlertEngine(default_rules())
        series = SeriesStore()
        out: list[Alert] = []
        for now in range(0, 200, 5):
            for rank in range(8):
                labels = labelset(job="j", rank=str(rank))
                series.add("communication_time_ratio", labels, float(now), 0.3 + 0.05 * rank)
                series.add("loss", labels, float(now), math.nan if rank == now % 8 else 1.0)
            out.extend(engine.evaluate(float(now), series, []))
        return out

    first = run()
    assert first == run()
    assert {alert.rule for alert in first} == {"High Communication Overhead", "Non-finite Loss"}


def test_stale_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stale_after_s"):
        AlertEngine(default_rules(), stale_after_s=0.0)


def test_thousands_of_healthy_series_raise_nothing_and_one_bad_job_one_alert() -> None:
    # What an evaluation of this many series costs is measured in benchmarks/evaluation.py.
    engine = AlertEngine(default_rules())
    series = SeriesStore()
    metrics = ["communication_time_ratio", "loss", "step_duration_seconds"]
    for rank in range(1000):
        node = f"n{rank // 8}"
        for ts in range(0, 60, 2):
            for metric in metrics:
                series.add(metric, labelset(job=f"j{rank % 4}", rank=str(rank)), float(ts), 0.3)
            series.add(
                "rank_memory_rss_bytes",
                labelset(job=f"j{rank % 4}", rank=str(rank), node=node),
                float(ts),
                1e9,
            )
    assert series.series_count() == 4000
    for now in range(60, 66):
        assert engine.evaluate(float(now), series, []) == []
    for rank in range(1, 1000, 4):
        series.add("communication_time_ratio", labelset(job="j1", rank=str(rank)), 66.0, 0.9)
    fired = engine.evaluate(66.0, series, [])
    assert [(alert.rule, alert.labels["job"]) for alert in fired] == [
        ("High Communication Overhead", "j1")
    ]


EVERY_SERIES = """
rules:
  - name: Slope
    kind: rate
    metric: rank_memory_rss_bytes
    op: ">"
    value: -1.0e+300
    window: 8s
  - name: Steady Slope
    kind: rate
    metric: rank_memory_rss_bytes
    op: ">"
    value: -1.0e+300
    window: 6s
    steady: 0.5
  - name: Node Growth
    kind: rate
    metric: rank_memory_rss_bytes
    op: ">"
    value: 0.0
    window: 6s
    aggregate: max
    by: [node]
  - name: Diverged
    kind: nonfinite
    metric: rank_memory_rss_bytes
    window: 5s
  - name: Mean By Node
    kind: threshold
    metric: rank_memory_rss_bytes
    op: ">"
    value: 1.0
    aggregate: mean
    by: [node]
"""


def _reference_slope(points: list[tuple[float, float]], min_span_s: float) -> float | None:
    """The rate rule's slope as first written: a plain recompute from the window's points."""
    finite = [(ts, value) for ts, value in points if math.isfinite(value)]
    if len(finite) < 3 or finite[-1][0] - finite[0][0] < min_span_s:
        return None
    mean_t = math.fsum(ts for ts, _ in finite) / len(finite)
    mean_v = math.fsum(value for _, value in finite) / len(finite)
    sxx = math.fsum((ts - mean_t) ** 2 for ts, _ in finite)
    if sxx <= 0:
        return None
    return math.fsum((ts - mean_t) * (value - mean_v) for ts, value in finite) / sxx


def _reference_rising(points: list[tuple[float, float]]) -> float:
    finite = [value for _, value in points if math.isfinite(value)]
    if len(finite) < 2:
        return 0.0
    return sum(1 for a, b in itertools.pairwise(finite) if b > a) / (len(finite) - 1)


def _series_labels(alert: Alert) -> LabelSet:
    return labelset(**{name: alert.labels[name] for name in ("job", "node", "rank")})


def _found(alerts: Sequence[Alert]) -> list[tuple[str, str, str]]:
    return [(alert.rule, repr(sorted(alert.labels.items())), repr(alert.value)) for alert in alerts]


def _copy(store: SeriesStore) -> SeriesStore:
    """The same points in a new store: no series in it was ever seen by an engine."""
    copy = SeriesStore(retention_s=store.retention_s)
    for metric in store.metrics():
        for labels in store.last_seen(metric):
            for ts, value in store.points(metric, labels, -math.inf):
                copy.add(metric, labels, ts, value)
    return copy


def _add_steps(store: SeriesStore, now: float, points: list[tuple[int, float]]) -> None:
    """Each (rank, step): the rank's series moves by ``step`` from its newest finite value."""
    for rank, step in points:
        labels = labelset(job="j", rank=str(rank), node=f"n{rank // 2}")
        previous = store.points("rank_memory_rss_bytes", labels, -math.inf)
        base = previous[-1][1] if previous and math.isfinite(previous[-1][1]) else 0.0
        store.add("rank_memory_rss_bytes", labels, now, base + step)


@settings(max_examples=150, deadline=None)
@given(
    ticks=st.lists(
        st.tuples(
            st.lists(
                st.tuples(
                    st.integers(0, 3),
                    st.sampled_from([0.0, 1.0, 2.0, 5.0, -3.0, 1e9, math.nan, math.inf]),
                ),
                max_size=5,
            ),
            st.sampled_from([0.0, 0.5, 1.0, 3.0]),
            st.booleans(),
        ),
        max_size=30,
    )
)
def test_kept_results_match_a_recompute_from_the_points(
    ticks: list[tuple[list[tuple[int, float]], float, bool]],
) -> None:
    """The engine keeps per-series results (rate) and groups (aggregates) between
    evaluations: each evaluation must find what a new engine finds in a copy of the store
    (every rule has ``for: 0``, so what holds is what fires)."""
    rules = _rules(EVERY_SERIES)
    kept = AlertEngine(rules)
    store = SeriesStore(retention_s=20.0)
    now = 100.0
    for points, advance_s, forget in ticks:
        _add_steps(store, now, points)
        if forget:
            store.forget({"rank": "1"})
        kept.evaluate(now, store, [])
        fresh = AlertEngine(rules).evaluate(now, _copy(store), [])
        assert {alert.state for alert in fresh} <= {"firing"}
        assert sorted(_found(kept.active())) == sorted(_found(fresh))
        for rule, window_s, steady in (("Slope", 8.0, None), ("Steady Slope", 6.0, 0.5)):
            expected = {}
            for labels in store.last_seen("rank_memory_rss_bytes"):
                window = store.points("rank_memory_rss_bytes", labels, now - window_s)
                slope = _reference_slope(window, window_s / 2)
                if slope is not None and (steady is None or _reference_rising(window) >= steady):
                    expected[labels] = slope
            assert {_series_labels(a): a.value for a in kept.active() if a.rule == rule} == expected
        store.expire(now)
        now += advance_s


NEWEST_POINTS = """
rules:
  - name: Low
    kind: threshold
    metric: rank_memory_rss_bytes
    op: "<"
    value: 0.5
  - name: Low For A While
    kind: threshold
    metric: rank_memory_rss_bytes
    op: "<="
    value: 0.5
    for: 2s
    cooldown: 3s
  - name: Low In Job One
    kind: threshold
    metric: rank_memory_rss_bytes
    op: "<"
    value: 0.5
    matchers: {job: j1}
  - name: Mean By Job
    kind: threshold
    metric: rank_memory_rss_bytes
    op: ">"
    value: 0.2
    aggregate: mean
    by: [job]
  - name: Max By Node
    kind: threshold
    metric: rank_memory_rss_bytes
    op: ">="
    value: 0.0
    aggregate: max
    by: [node]
    for: 1s
  - name: Sum Of Job One
    kind: threshold
    metric: rank_memory_rss_bytes
    op: "<"
    value: 10.0
    aggregate: sum
    by: [job]
    matchers: {job: j1}
"""


def _ticks(
    ranks: int, values: list[float], advances: list[float]
) -> st.SearchStrategy[list[tuple[list[tuple[int, float]], float, str]]]:
    """Evaluation ticks: points (rank, value) added before it, how far the clock then
    moves (back too), and what happens to the store after it."""
    return st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, ranks - 1), st.sampled_from(values)), max_size=ranks),
            st.sampled_from(advances),
            st.sampled_from(["", "", "", "forget", "expire"]),
        ),
        max_size=30,
    )


@settings(max_examples=200, deadline=None)
@given(
    ticks=_ticks(
        6, [0.0, -0.0, 0.25, 0.5, 0.75, 1.0, math.nan, math.inf], [0.0, 0.5, 1.0, 2.5, -1.0]
    )
)
def test_threshold_rules_find_what_a_read_of_every_series_finds(
    ticks: list[tuple[list[tuple[int, float]], float, str]],
) -> None:
    """Threshold rules look only at the series whose newest point changed since the last
    evaluation; an engine shown a new store each time reads every series. Both must
    make the same transitions in the same order (staleness, ``for``, cooldowns, series
    that go and come back, a clock that steps back)."""
    rules = _rules(NEWEST_POINTS)
    kept, rereading = AlertEngine(rules, stale_after_s=3.0), AlertEngine(rules, stale_after_s=3.0)
    store = SeriesStore(retention_s=5.0)
    now = 100.0
    for points, advance_s, then in ticks:
        for rank, value in points:
            labels = labelset(job=f"j{rank % 2}", node=f"n{rank // 3}", rank=str(rank))
            store.add("rank_memory_rss_bytes", labels, now, value)
        expected = rereading.evaluate(now, _copy(store), [])
        assert repr(kept.evaluate(now, store, [])) == repr(expected)
        assert repr(kept.active()) == repr(rereading.active())
        # And what a plain read of the newest points finds, for two of the rules.
        fresh = [
            (labels, value)
            for labels, ts, value in store.latest("rank_memory_rss_bytes")
            if ts >= now - 3.0
        ]
        low = {labels: value for labels, value in fresh if value < 0.5}
        active = kept.active()
        assert {_series_labels(a): a.value for a in active if a.rule == "Low"} == low
        by_job: dict[str, list[float]] = {}
        for labels, value in fresh:
            if not math.isnan(value):
                by_job.setdefault(dict(labels)["job"], []).append(value)
        means = {job: statistics.fmean(values) for job, values in by_job.items()}
        assert {a.labels["job"]: a.value for a in active if a.rule == "Mean By Job"} == {
            job: (mean if math.isfinite(mean) else None)
            for job, mean in means.items()
            if mean > 0.2
        }
        if then == "forget":
            store.forget({"rank": "1"})
        elif then == "expire":
            store.expire(now)
        now += advance_s


@settings(max_examples=200, deadline=None)
@given(
    ticks=_ticks(4, [0.0, 1.0, 2.0, 5.0, -3.0, 1e9, math.nan, math.inf], [0.0, 0.5, 1.0, 3.0, -1.0])
)
def test_rate_rules_find_what_a_read_of_every_series_finds(
    ticks: list[tuple[list[tuple[int, float]], float, str]],
) -> None:
    """Rate rules compute a series' slope again only once its window holds other points;
    an engine shown a new store each time computes every one. Both must make the same
    transitions in the same order (points that leave the window, series that go stale,
    go and come back, a clock that steps back)."""
    rules = _rules(EVERY_SERIES)
    kept, rereading = AlertEngine(rules, stale_after_s=4.0), AlertEngine(rules, stale_after_s=4.0)
    store = SeriesStore(retention_s=20.0)
    now = 100.0
    for points, advance_s, then in ticks:
        _add_steps(store, now, points)
        expected = rereading.evaluate(now, _copy(store), [])
        assert repr(kept.evaluate(now, store, [])) == repr(expected)
        assert repr(kept.active()) == repr(rereading.active())
        if then == "forget":
            store.forget({"rank": "1"})
        elif then == "expire":
            store.expire(now)
        now += advance_s
