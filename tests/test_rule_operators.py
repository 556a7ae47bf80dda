"""Rules added for the bottleneck report and the seeds: ``==`` and ``!=``, ``kind:
bottleneck`` on the live report, anomaly rules on communication wait and throughput;
each in torshmon's engine and, exported, in Prometheus's own (promtool)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.integration import wire_factory as wf
from tests.test_bottleneck import T0, _live
from tests.test_promrules import _promtool
from torshmon.aggregator.core.alert_engine import AlertEngine
from torshmon.aggregator.core.promrules import expression, to_prometheus
from torshmon.aggregator.core.rule_file import load_rules_text
from torshmon.aggregator.core.rules import RuleError
from torshmon.aggregator.core.series import SeriesStore, labelset
from torshmon.aggregator.core.stored import Stored

RULES = """
rules:
  - name: GPU Idle
    kind: threshold
    metric: gpu_utilization_ratio
    op: "=="
    value: 0
    severity: warning
  - name: Not One Rank
    kind: threshold
    metric: training_efficiency_ratio
    op: "!="
    value: 1
    matchers: {rank: "0"}
  - name: Input Starved
    kind: bottleneck
    matchers: {category: input}
    for: 30s
    severity: high
"""


def test_equal_and_not_equal_compare_exactly() -> None:
    rules = load_rules_text(RULES, source="t.yaml")
    engine = AlertEngine(rules)
    series = SeriesStore()
    gpu0 = labelset(node="n", gpu="0")
    gpu1 = labelset(node="n", gpu="1")
    series.add("gpu_utilization_ratio", gpu0, 1.0, 0.0)
    series.add("gpu_utilization_ratio", gpu1, 1.0, 0.001)
    series.add("training_efficiency_ratio", labelset(job="j", rank="0"), 1.0, 1.0)
    series.add("training_efficiency_ratio", labelset(job="j", rank="1"), 1.0, 0.5)
    fired = engine.evaluate(1.0, series, [])
    assert [(a.rule, dict(a.labels).get("gpu"), a.state) for a in fired] == [
        ("GPU Idle", "0", "firing")
    ]
    series.add("training_efficiency_ratio", labelset(job="j", rank="0"), 2.0, 0.99)
    series.add("gpu_utilization_ratio", gpu0, 2.0, 0.2)
    changed = engine.evaluate(2.0, series, [])
    assert sorted((a.rule, a.state) for a in changed) == [
        ("GPU Idle", "resolved"),
        ("Not One Rank", "firing"),
    ]


def test_the_operators_export_as_promql() -> None:
    rules = load_rules_text(RULES, source="t.yaml")
    assert [expression(rule) for rule in rules] == [
        "torshmon_gpu_utilization_ratio == 0.0",
        'torshmon_training_efficiency_ratio{rank="0"} != 1.0',
        'torshmon_bottleneck_active{category="input"} > 0',
    ]


def test_a_misspelt_operator_or_an_unwatched_anomaly_metric_is_refused() -> None:
    with pytest.raises(RuleError, match=r"op: expected one of >, >=, <, <=, ==, !=, got '='"):
        load_rules_text(RULES.replace('"=="', '"="'), source="t.yaml")
    text = "rules:\n  - name: A\n    kind: anomaly\n    metric: compute_seconds\n"
    with pytest.raises(RuleError, match="no anomaly detector watches 'compute_seconds'"):
        load_rules_text(text, source="t.yaml")


def test_a_bottleneck_rule_fires_on_the_live_report_after_its_for() -> None:
    live, _ = _live("input_bound")
    engine = AlertEngine(load_rules_text(RULES, source="t.yaml"))
    states = []
    for second in (10, 25, 41):
        now = T0 + second
        for alert in engine.evaluate(now, live.series, live.findings(now)):
            if alert.rule == "Input Starved":
                states.append((second, alert.state))
                last = alert
    assert states == [(10, "pending"), (41, "firing")]
    assert dict(last.labels) == {
        "alertname": "InputStarved",
        "severity": "high",
        "job": "input_bound",
        "category": "input",
    }
    assert last.value == pytest.approx(0.12 / 0.22, rel=0.02)
    assert "waits for input data 55%" in last.annotations["summary"]
    assert "num_workers" in last.annotations["recommendation"]


def test_a_rule_on_one_collective_op_reads_its_per_step_mean() -> None:
    text = """
rules:
  - name: Slow All-Reduce
    kind: threshold
    metric: collective_duration_seconds
    op: ">"
    value: 0.05
    matchers: {op: all_reduce}
  - name: Slow Broadcast
    kind: threshold
    metric: collective_duration_seconds
    op: ">"
    value: 0.05
    matchers: {op: broadcast}
"""
    rules = load_rules_text(text, source="t.yaml")
    assert expression(rules.rules[0]) == (
        'rate(torshmon_collective_duration_seconds_sum{op="all_reduce"}[1m]) / '
        'rate(torshmon_collective_duration_seconds_count{op="all_reduce"}[1m]) > 0.05'
    )
    # 60 ms of all-reduce per 0.1 s step on each rank; the loop's broadcasts 17.5 ms.
    for name in ("ddp_communication", "collectives_only"):
        live, _ = _live(name, collective_series=True)
        fired = AlertEngine(rules).evaluate(T0 + 10, live.series, [])
        assert [(a.rule, dict(a.labels)["op"]) for a in fired] == (
            [("Slow All-Reduce", "all_reduce")] if name == "ddp_communication" else []
        )
        if fired:
            assert dict(fired[0].labels)["pg"] == "0"
            assert fired[0].value == pytest.approx(0.06, rel=0.03)
    live, _ = _live("ddp_communication")  # no rule names the series: none kept
    assert live.series.latest("collective_duration_seconds") == []


def test_anomaly_rules_on_comm_wait_and_throughput_run_only_where_a_rule_names_them() -> None:
    text = """
rules:
  - name: Communication Wait Anomaly
    kind: anomaly
    metric: comm_wait_seconds
  - name: Throughput Drop
    kind: anomaly
    metric: throughput_samples_per_second
"""
    rules = load_rules_text(text, source="t.yaml")
    assert [expression(rule) for rule in rules] == [
        'torshmon_anomaly_paging{metric="comm_wait_seconds"} > 0',
        'torshmon_anomaly_paging{metric="throughput_samples_per_second"} > 0',
    ]
    wanted = {rule.metric for rule in rules if rule.metric}
    # The straggler's peers wait for it: their communication wait jumps at step 41 on.
    live, _ = _live("ddp_communication", anomaly_metrics=wanted)
    off, _ = _live("ddp_communication", anomaly_metrics=())
    for state in (live, off):
        for rank in (0, 1):
            hello = wf.hello("ddp_communication", rank, 2)
            steps = [
                wf.step(
                    n, duration_s=0.4, comm_wait_s=0.36, end_unix_ns=int((T0 + 4 + n * 0.4) * 1e9)
                )
                for n in range(41, 51)
            ]
            state.observe(Stored(acked_seq=0, batches=[(wf.batch(hello, 9, steps), "node-a")]), T0)
    found = {
        (f.labels["metric"], f.labels.get("rank"))
        for f in live.findings(T0 + 30)
        if f.kind == "anomaly"
    }
    assert ("comm_wait_seconds", "0") in found and ("comm_wait_seconds", "1") in found
    assert ("throughput_samples_per_second", "0") in found
    assert not [f for f in off.findings(T0 + 30) if f.labels.get("metric") == "comm_wait_seconds"]
    fired = AlertEngine(rules).evaluate(T0 + 30, live.series, live.findings(T0 + 30))
    assert {a.rule for a in fired} == {"Communication Wait Anomaly", "Throughput Drop"}


def test_prometheus_evaluates_the_new_rules_as_torshmon_does(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(to_prometheus(load_rules_text(RULES, source="t.yaml")))
    series = [
        ('torshmon_gpu_utilization_ratio{node="n",gpu="0"}', "0x10"),
        ('torshmon_gpu_utilization_ratio{node="n",gpu="1"}', "0.001x10"),
        ('torshmon_training_efficiency_ratio{job="j",rank="0"}', "1x10"),
        ('torshmon_training_efficiency_ratio{job="k",rank="0"}', "0.5x10"),
        ('torshmon_bottleneck_active{job="j",category="input"}', "1x10"),
        ('torshmon_bottleneck_active{job="j",category="memory"}', "1x10"),
    ]
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [
                    {
                        "eval_time": "5m",
                        "alertname": "GPUIdle",
                        "exp_alerts": [
                            {
                                "exp_labels": {"node": "n", "gpu": "0", "severity": "warning"},
                                "exp_annotations": {
                                    "summary": "GPU Idle: gpu_utilization_ratio is 0 (== 0) "
                                    "on node=n, gpu=0"
                                },
                            }
                        ],
                    },
                    {
                        "eval_time": "5m",
                        "alertname": "NotOneRank",
                        "exp_alerts": [
                            {
                                "exp_labels": {"job": "k", "rank": "0", "severity": "warning"},
                                "exp_annotations": {
                                    "summary": "Not One Rank: training_efficiency_ratio is "
                                    "0.5 (!= 1) on job=k, rank=0"
                                },
                            }
                        ],
                    },
                    {
                        "eval_time": "5m",
                        "alertname": "InputStarved",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "job": "j",
                                    "category": "input",
                                    "severity": "high",
                                },
                                "exp_annotations": {
                                    "summary": "Input Starved: job j has a bottleneck in "
                                    "input (torshmon report)"
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = _promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
