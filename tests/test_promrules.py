from __future__ import annotations

import math
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.core.alert_engine import AlertEngine
from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.promrules import expression, to_prometheus
from torshmon.aggregator.core.rule_file import load_rules_text
from torshmon.aggregator.core.rules import FINDING_LABELS, METRIC_LABELS, Rule, RuleSet
from torshmon.aggregator.core.series import SeriesStore
from torshmon.aggregator.rule_files import check_rules_cli, default_rules, export_rules_cli
from torshmon.catalogue import metrics as catalogue

PROMTOOL = "/usr/bin/promtool"
DATA = Path(__file__).parent / "data" / "rules"

RULES = """
rules:
  - name: High Comm
    kind: threshold
    metric: communication_time_ratio
    op: ">"
    value: 0.4
    aggregate: mean
    by: [job]
    for: 2m
    severity: high
    labels: {team: ml}
    annotations:
      summary: "Communication takes {value:.0%} of step time in job {job}"
      description: "{alertname} ({severity}) team {team} on {metric}: {value:.2f} {{a}} {{{{b}}}}"
  - name: Slow Steps
    kind: threshold
    metric: step_duration_seconds
    op: ">"
    value: 1
    matchers: {job: a}
  - name: Slow Job
    kind: threshold
    metric: step_duration_seconds
    op: ">"
    value: 1
    aggregate: mean
    by: [job]
    annotations:
      summary: "job {job} steps take {value:.1f} s"
  - name: Growth
    kind: rate
    metric: rank_memory_rss_bytes
    op: ">"
    value: 1e6
    window: 2m
    annotations:
      summary: "rank {rank} grows {value:.2f} B/s"
  - name: Diverged
    kind: nonfinite
    metric: loss
    annotations:
      summary: "loss of {job}/{rank} is {value}"
  - name: Silent
    kind: absent
    metric: step_duration_seconds
    for: 5m
  - name: Loss Spike
    kind: anomaly
    metric: loss
  - name: Slow Rank
    kind: straggler
  - name: Stuck
    kind: hang
    severity: critical
"""


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_default_rules_pass_promtool_check(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(to_prometheus(default_rules()))
    result = _promtool("check", "rules", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(default_rules())} rules found" in result.stdout


def test_promtool_rejects_what_it_should(tmp_path: Path) -> None:
    # The check above can fail: a broken expression is caught by the same command.
    text = to_prometheus(default_rules()).replace("torshmon_straggler_paging > 0", "> 0 >")
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    assert _promtool("check", "rules", str(path), cwd=tmp_path).returncode != 0


def test_expressions() -> None:
    rules = {rule.name: rule for rule in load_rules_text(RULES)}
    assert expression(rules["High Comm"]) == (
        "avg by (job, run) (torshmon_communication_time_ratio) > 0.4"
    )
    assert expression(rules["Slow Steps"]) == (
        'rate(torshmon_step_duration_seconds_sum{job="a"}[1m]) / '
        'rate(torshmon_step_duration_seconds_count{job="a"}[1m]) > 1.0'
    )
    assert expression(rules["Slow Job"]) == (
        "sum by (job, run) (rate(torshmon_step_duration_seconds_sum[1m])) / "
        "sum by (job, run) (rate(torshmon_step_duration_seconds_count[1m])) > 1.0"
    )
    assert expression(rules["Growth"]) == "deriv(torshmon_rank_memory_rss_bytes[2m]) > 1000000.0"
    assert expression(rules["Diverged"]) == (
        "(torshmon_loss != torshmon_loss) or (abs(torshmon_loss) == +Inf)"
    )
    assert expression(rules["Silent"]) == (
        "absent_over_time(torshmon_step_duration_seconds_count[5m])"
    )
    # Findings page on _paging: _active also holds those too short yet to page.
    assert expression(rules["Loss Spike"]) == 'torshmon_anomaly_paging{metric="loss"} > 0'
    assert expression(rules["Slow Rank"]) == "torshmon_straggler_paging > 0"
    assert expression(rules["Stuck"]) == "torshmon_hung_collective_age_seconds > 0"


def test_rule_file_shape_and_translated_annotations() -> None:
    document = yaml.safe_load(to_prometheus(load_rules_text(RULES), group="g"))
    [group] = document["groups"]
    assert group["name"] == "g"
    comm = group["rules"][0]
    assert comm == {
        "alert": "HighComm",
        "expr": "avg by (job, run) (torshmon_communication_time_ratio) > 0.4",
        "for": "2m",
        "labels": {"team": "ml", "severity": "high"},
        "annotations": {
            "summary": (
                "Communication takes {{ $value | humanizePercentage }} of step time in job "
                "{{ $labels.job }}"
            ),
            "description": (
                "High Comm (high) team ml on communication_time_ratio: "
                '{{ printf "%.2f" $value }} {a} {{ "{{" }}b}}'
            ),
        },
    }
    silent = group["rules"][5]
    assert "for" not in silent  # the silence is inside absent_over_time
    assert silent["annotations"] == {"summary": "Silent: no step_duration_seconds sample for 5m"}
    assert [rule["alert"] for rule in group["rules"]] == [
        "HighComm",
        "SlowSteps",
        "SlowJob",
        "Growth",
        "Diverged",
        "Silent",
        "LossSpike",
        "SlowRank",
        "Stuck",
    ]


def test_prometheus_evaluates_the_exported_rules_as_torshmon_does(tmp_path: Path) -> None:
    """promtool's rule unit tests run the real PromQL engine on the exported file."""
    (tmp_path / "rules.yaml").write_text(to_prometheus(load_rules_text(RULES)))
    series = [
        # Job a: communication at 50% (fires), job b at 20%.
        ("torshmon_communication_time_ratio", {"job": "a", "rank": "0"}, "0.5x10"),
        ("torshmon_communication_time_ratio", {"job": "a", "rank": "1"}, "0.5x10"),
        ("torshmon_communication_time_ratio", {"job": "b", "rank": "0"}, "0.2x10"),
        # Job a: 60 steps a minute of 2 s each; job b: 0.5 s each.
        ("torshmon_step_duration_seconds_count", {"job": "a", "rank": "0"}, "0+60x10"),
        ("torshmon_step_duration_seconds_sum", {"job": "a", "rank": "0"}, "0+120x10"),
        ("torshmon_step_duration_seconds_count", {"job": "b", "rank": "0"}, "0+60x10"),
        ("torshmon_step_duration_seconds_sum", {"job": "b", "rank": "0"}, "0+30x10"),
        # Rank 1 leaks 200 MB a minute; rank 0 is flat.
        ("torshmon_rank_memory_rss_bytes", {"job": "a", "rank": "0", "node": "n"}, "1e9x10"),
        ("torshmon_rank_memory_rss_bytes", {"job": "a", "rank": "1", "node": "n"}, "1e9+2e8x10"),
        ("torshmon_loss", {"job": "a", "rank": "0"}, "1 1 1 1 NaN NaN NaN NaN NaN NaN NaN"),
        ("torshmon_loss", {"job": "a", "rank": "1"}, "1x10"),
        ("torshmon_anomaly_active", {"job": "a", "metric": "loss"}, "0 0 0 0 1x6"),
        ("torshmon_anomaly_paging", {"job": "a", "metric": "loss"}, "0 0 0 0 1x6"),
        ("torshmon_anomaly_active", {"job": "a", "metric": "step_duration_seconds"}, "1x10"),
        # Rank 1 is shown as a straggler all along but never pages: no alert.
        ("torshmon_straggler_active", {"job": "a", "rank": "1"}, "1x10"),
        ("torshmon_straggler_paging", {"job": "a", "rank": "1"}, "0x10"),
        (
            "torshmon_hung_collective_age_seconds",
            {"job": "a", "rank": "0", "op": "barrier", "pg": "0"},
            "0 0 0 0 30 90 150 210 270 330",
        ),
    ]

    def alerts(name: str, *expected: dict[str, object]) -> dict[str, object]:
        return {"eval_time": "6m", "alertname": name, "exp_alerts": list(expected)}

    def alert(labels: dict[str, str], summary: str, **more: str) -> dict[str, object]:
        return {"exp_labels": labels, "exp_annotations": {"summary": summary, **more}}

    comm_labels = {"job": "a", "team": "ml", "severity": "high"}
    unit_tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": name
                        + "{"
                        + ",".join(f'{k}="{v}"' for k, v in labels.items())
                        + "}",
                        "values": values,
                    }
                    for name, labels, values in series
                ],
                "alert_rule_test": [
                    alerts(
                        "HighComm",
                        alert(
                            comm_labels,
                            "Communication takes 50% of step time in job a",
                            description=(
                                "High Comm (high) team ml on communication_time_ratio: "
                                "0.50 {a} {{b}}"
                            ),
                        ),
                    ),
                    alerts(
                        "SlowSteps",
                        alert(
                            {"job": "a", "rank": "0", "severity": "warning"},
                            "Slow Steps: step_duration_seconds is 2 (> 1) on job=a, rank=0",
                        ),
                    ),
                    alerts(
                        "SlowJob",
                        alert({"job": "a", "severity": "warning"}, "job a steps take 2.0 s"),
                    ),
                    alerts(
                        "Growth",
                        alert(
                            {"job": "a", "rank": "1", "node": "n", "severity": "warning"},
                            "rank 1 grows 3333333.33 B/s",
                        ),
                    ),
                    alerts(
                        "Diverged",
                        alert(
                            {"job": "a", "rank": "0", "severity": "warning"}, "loss of a/0 is NaN"
                        ),
                    ),
                    alerts("Silent"),
                    alerts(
                        "LossSpike",
                        alert(
                            {"job": "a", "metric": "loss", "severity": "warning"},
                            "Loss Spike: loss is anomalous in job a rank ",
                        ),
                    ),
                    alerts("SlowRank"),
                    alerts(
                        "Stuck",
                        alert(
                            {
                                "job": "a",
                                "rank": "0",
                                "op": "barrier",
                                "pg": "0",
                                "severity": "critical",
                            },
                            "Stuck: rank 0 of job a is stuck in barrier on group 0",
                        ),
                    ),
                ],
            },
            {
                # No step series at all: only now can Prometheus see the absence.
                "interval": "1m",
                "input_series": [
                    {"series": 'torshmon_loss{job="a",rank="0"}', "values": "1x10"},
                ],
                "alert_rule_test": [
                    alerts(
                        "Silent",
                        alert(
                            {"severity": "warning"},
                            "Silent: no step_duration_seconds sample for 5m",
                        ),
                    ),
                ],
            },
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(unit_tests, sort_keys=False))
    result = _promtool("test", "rules", "test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_check_cli_ok_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_rules_cli(str(DATA / "good.yaml")) == 0
    out, err = capsys.readouterr()
    assert (out, err) == ("OK: 8 rules\n", "")
    assert check_rules_cli(str(DATA / "bad_many.yaml")) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 8
    assert all(line.startswith(f"{DATA / 'bad_many.yaml'}:") for line in lines)


def test_check_cli_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert check_rules_cli(str(tmp_path / "missing.yaml")) == 1
    assert "cannot read the rule file" in capsys.readouterr().err


def test_export_cli_defaults_and_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert export_rules_cli(None, "prometheus") == 0
    out, _ = capsys.readouterr()
    assert out == to_prometheus(default_rules())
    assert export_rules_cli(str(DATA / "good.yaml"), "prometheus") == 0
    document = yaml.safe_load(capsys.readouterr().out)
    assert len(document["groups"][0]["rules"]) == 8


def test_export_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert export_rules_cli(None, "nagios") == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "unknown format 'nagios': expected one of prometheus\n"
    assert export_rules_cli(str(DATA / "bad_op.yaml"), "prometheus") == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "rules[2].op: expected one of >, >=, <, <=, ==, !=, got '=>'" in err


def test_exported_good_file_passes_promtool(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(to_prometheus(load_rules_text((DATA / "good.yaml").read_text())))
    result = _promtool("check", "rules", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# -- one alert identity: the aggregator's alerts and the exported rules' (issue 18) --------

#: One value per label name, for the series both paths see.
LABEL_VALUES = {
    "job": "train",
    "run": "r1",
    "rank": "1",
    "node": "n1",
    "gpu": "0",
    "op": "all_reduce",
    "pg": "0",
}
#: The metric each finding kind's rule reads in Prometheus.
FINDING_METRICS = {
    "anomaly": catalogue.ANOMALY_PAGING,
    "straggler": catalogue.STRAGGLER_PAGING,
    "hang": catalogue.HUNG_COLLECTIVE_AGE_SECONDS,
    "slow_link": catalogue.SLOW_LINK_BANDWIDTH_BYTES_PER_SECOND,
    "bottleneck": catalogue.BOTTLENECK_ACTIVE,
}
#: What a scrape of the aggregator adds (``honor_labels: true``, as deploy/prometheus.yml).
SCRAPE_INSTANCE = "aggregator:9470"
SCRAPE_JOB = "torshmon-aggregator"
#: Every default rule both paths can alert on. ``absent`` cannot be shared: Prometheus
#: only knows that no series matched, torshmon which series fell silent.
SHARED_RULES = [rule for rule in default_rules() if rule.kind != "absent"]


def firing_value(rule: Rule) -> float:
    """A value of ``rule``'s metric that meets its condition (per second for ``rate``
    and ``increase``)."""
    if rule.kind == "nonfinite":
        return math.nan
    if rule.kind in FINDING_METRICS:
        return 1.0
    threshold = rule.threshold or 0.0
    return next(v for v in (threshold * 2 + 1, threshold / 2) if rule.compare(v))


def scraped_series(rule: Rule) -> tuple[str, dict[str, str]]:
    """The series ``rule``'s exported expression reads, labelled as Prometheus stores it
    after scraping its exporter (the aggregator or the agent)."""
    if rule.kind in FINDING_METRICS:
        spec = FINDING_METRICS[rule.kind]
    else:
        spec = catalogue.METRICS[catalogue.PREFIX + (rule.metric or "")]
    labels = {name: LABEL_VALUES.get(name, rule.metric or "") for name in spec.labels}
    labels.update({k: v for k, v in rule.matchers.items() if k in spec.labels})
    labels.setdefault("job", SCRAPE_JOB)
    return spec.name, {**labels, "instance": SCRAPE_INSTANCE}


def engine_alert(rule: Rule) -> Alert:
    """The firing alert the aggregator's engine makes of ``rule`` on ``scraped_series``'s
    values (a finding with the same labels for finding kinds)."""
    engine = AlertEngine(RuleSet((rule,), source="default_rules.yaml"))
    series = SeriesStore()
    labels = {name: LABEL_VALUES[name] for name in METRIC_LABELS.get(rule.metric or "", ())}
    findings = []
    if rule.kind in FINDING_METRICS:
        finding_labels = {name: LABEL_VALUES.get(name, "") for name in FINDING_LABELS[rule.kind]}
        if rule.kind == "anomaly":
            finding_labels["metric"] = rule.metric or ""
        finding_labels.update(rule.matchers)
        findings = [Finding(rule.kind, finding_labels, 1.0, 5.0, "found", 0.0)]
    value = firing_value(rule)
    for second in range(int(rule.for_s + rule.window_s) + 10):
        if rule.kind not in FINDING_METRICS:
            point = value * second if rule.kind in ("rate", "increase") else value
            series.add(rule.metric or "", labels, float(second), point)
        firing = [
            a
            for a in engine.evaluate(float(second), series, findings, runs={"train": "r1"})
            if a.state == "firing"
        ]
        if firing:
            return firing[0]
    raise AssertionError(f"rule {rule.name!r} never fired")


def prometheus_alert_labels(rule: Rule, exported: Mapping[str, Any]) -> dict[str, str]:
    """The labels Prometheus gives the exported rule's alert: the result's labels (an
    aggregation keeps its ``by`` labels), the rule's ``labels`` set over them, an empty
    value removing one, and ``alertname``."""
    _, labels = scraped_series(rule)
    if rule.aggregate is not None:
        by = [*rule.by, "run"] if "job" in rule.by else rule.by  # a job's run stays with it
        labels = {name: labels[name] for name in by if name in labels}
    labels = {**labels, **exported["labels"], "alertname": exported["alert"]}
    return {name: value for name, value in labels.items() if value}


@pytest.mark.parametrize("rule", SHARED_RULES, ids=lambda rule: rule.name)
def test_default_rule_alerts_alike_from_both_paths(rule: Rule) -> None:
    (group,) = yaml.safe_load(to_prometheus(default_rules()))["groups"]
    exported = {entry["alert"]: entry for entry in group["rules"]}
    alert = engine_alert(rule)
    assert alert.rule == rule.name  # the title people read stays the rule's own name
    assert alert.labels["alertname"] in exported
    expected = prometheus_alert_labels(rule, exported[alert.labels["alertname"]])
    # Both name the job's run where the series read carry it: the aggregator's, not
    # the agent's process series.
    carries_run = "job" in alert.labels and "run" in scraped_series(rule)[1]
    assert alert.labels.get("run") == (LABEL_VALUES["run"] if carries_run else None)
    assert dict(alert.labels) == expected
