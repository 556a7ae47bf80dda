from __future__ import annotations

import math
from pathlib import Path

import pytest

from torshmon.aggregator.core.findings import SEVERITIES
from torshmon.aggregator.core.rule_file import load_rules_text
from torshmon.aggregator.core.rules import (
    KNOWN_METRICS,
    Rule,
    RuleError,
    alert_name,
    default_summary,
    parse_duration,
    prometheus_duration,
)
from torshmon.aggregator.core.templates import render_template
from torshmon.aggregator.rule_files import default_rules, load_rules

DATA = Path(__file__).parent / "data" / "rules"


def _one(body: str) -> str:
    """A rule file holding one rule whose keys are ``body`` (indented for the list)."""
    lines = body.strip("\n").splitlines()
    return "rules:\n  - " + "\n    ".join(lines) + "\n"


def _error(text: str) -> str:
    with pytest.raises(RuleError) as info:
        load_rules_text(text, source="r.yaml")
    return str(info.value)


# -- the default rules -------------------------------------------------------------------


def test_default_rules_encode_the_design_table() -> None:
    rules = default_rules()
    by_name = {rule.name: rule for rule in rules}
    assert list(by_name) == [
        "Low GPU Utilization",
        "High Memory Usage",
        "High GPU Memory Usage",
        "High Communication Overhead",
        "Step Time Anomaly",
        "Straggler",
        "Hung Collective",
        "Collective Failed",
        "Loss Spike",
        "Non-finite Loss",
        "Memory Leak",
        "Slow Link",
        "Input Bound",
        "Agent Down",
    ]
    failed = by_name["Collective Failed"]
    assert (failed.kind, failed.metric, failed.op, failed.threshold, failed.window_s) == (
        "increase",
        "collective_failures_total",
        ">",
        0.0,
        300.0,
    )
    assert (failed.severity, failed.for_s, failed.cooldown_s) == ("critical", 0.0, 0.0)
    agent = by_name["Agent Down"]
    assert (agent.kind, agent.metric, agent.op, agent.threshold, agent.severity) == (
        "threshold",
        "agent_silence_seconds",
        ">",
        5.0,
        "high",
    )
    gpu_memory = by_name["High GPU Memory Usage"]
    assert (
        gpu_memory.kind,
        gpu_memory.metric,
        gpu_memory.op,
        gpu_memory.threshold,
        gpu_memory.severity,
    ) == ("threshold", "gpu_memory_utilization_ratio", ">", 0.9, "critical")
    gpu = by_name["Low GPU Utilization"]
    assert (gpu.kind, gpu.metric, gpu.op, gpu.threshold, gpu.for_s, gpu.severity) == (
        "threshold",
        "gpu_utilization_ratio",
        "<",
        0.7,
        60.0,
        "warning",
    )
    memory = by_name["High Memory Usage"]
    assert (memory.op, memory.threshold, memory.for_s, memory.severity) == (
        ">",
        0.9,
        30.0,
        "critical",
    )
    assert memory.actions == ("notify", "recommend_memory")
    comm = by_name["High Communication Overhead"]
    assert (comm.aggregate, comm.by, comm.threshold, comm.for_s, comm.severity) == (
        "mean",
        ("job",),
        0.4,
        120.0,
        "high",
    )
    assert comm.actions == ("notify", "autotune")
    assert by_name["Step Time Anomaly"].metric == "step_duration_seconds"
    assert by_name["Straggler"].severity == "high"
    assert by_name["Hung Collective"].severity == "critical"
    assert (by_name["Slow Link"].kind, by_name["Slow Link"].severity) == ("slow_link", "high")
    assert by_name["Loss Spike"].metric == "loss"
    assert by_name["Non-finite Loss"].kind == "nonfinite"
    leak = by_name["Memory Leak"]
    assert (leak.kind, leak.metric, leak.threshold) == ("rate", "rank_memory_rss_bytes", 10e6)
    # A one-off jump rises once: not steady (see the rule's comment); about 8 s to fire.
    assert (leak.window_s, leak.steady, leak.for_s) == (10.0, 0.8, 5.0)
    inputs = by_name["Input Bound"]
    assert (inputs.kind, dict(inputs.matchers), inputs.for_s) == (
        "bottleneck",
        {"category": "input"},
        60.0,
    )
    # GPU memory alerts once, per GPU, from NVML (High GPU Memory Usage, the seeds' 90%):
    # the report's gpu_memory finding (95%) is a series and a rule kind, not a second alert.
    assert not any(
        r.kind == "bottleneck" and dict(r.matchers).get("category") == "gpu_memory" for r in rules
    )
    assert rules.source == "default_rules.yaml"


def test_steady_is_a_fraction_of_a_rate_rules_intervals() -> None:
    text = """rules:
  - name: Leak
    kind: rate
    metric: rank_memory_rss_bytes
    op: ">"
    value: 1
    steady: {steady}
"""
    assert next(iter(load_rules_text(text.format(steady=0.5), source="r.yaml"))).steady == 0.5
    with pytest.raises(RuleError, match=r"r.yaml:7: rules\[0\].steady: must be a fraction"):
        load_rules_text(text.format(steady=1.5), source="r.yaml")
    with pytest.raises(RuleError, match=r"rules\[0\].steady: not allowed for kind 'threshold'"):
        load_rules_text(
            text.replace("kind: rate", "kind: threshold").format(steady=0.5), source="r"
        )


def test_good_file_parses_every_kind_and_form() -> None:
    rules = load_rules(DATA / "good.yaml")
    assert len(rules) == 8
    slow = rules.rules[0]
    assert slow.metric == "step_duration_seconds"  # torshmon_ prefix stripped
    assert (slow.op, slow.threshold, slow.aggregate, slow.by) == (">=", 2.0, "max", ("job",))
    assert (slow.for_s, slow.cooldown_s) == (90.0, 600.0)
    assert slow.labels == {"team": "ml", "tier": "1"}  # a number label value is text
    assert slow.actions == ("notify", "autotune")
    assert slow.source == f"{DATA / 'good.yaml'}:3"
    busy = rules.get("Busy CPU")
    assert busy is not None
    assert (busy.for_s, busy.matchers, busy.severity, busy.actions) == (
        0.5,
        {"node": "n1"},
        "warning",
        ("notify",),
    )
    growth = rules.get("RSS Growth")
    assert growth is not None
    assert (growth.threshold, growth.window_s, growth.for_s) == (1e6, 120.0, 120.0)
    silent = rules.get("Rank Silent")
    assert silent is not None
    assert (silent.for_s, silent.actions) == (300.0, ())
    assert rules.get("Throughput Anomaly") is not None
    assert rules.get("nope") is None
    assert [rule.kind for rule in rules] == [
        "threshold",
        "threshold",
        "rate",
        "nonfinite",
        "absent",
        "anomaly",
        "straggler",
        "hang",
    ]


def test_error_names_file_line_and_field() -> None:
    with pytest.raises(RuleError) as info:
        load_rules(DATA / "bad_op.yaml")
    assert info.value.errors == (
        f"{DATA / 'bad_op.yaml'}:13: rules[2].op: expected one of >, >=, <, <=, ==, !=, got '=>'",
    )


def test_every_mistake_is_reported_at_once() -> None:
    with pytest.raises(RuleError) as info:
        load_rules(DATA / "bad_many.yaml")
    errors = [line.split(": ", 1)[1] for line in info.value.errors]
    lines = [int(line.split(":")[1]) for line in info.value.errors]
    assert len(errors) == 8, info.value.errors
    assert errors[0].startswith("rules[0].fro: unknown key (allowed: ")
    assert "rules[1].name: duplicate rule name 'Typo' (first defined at line 2)" in errors
    assert any(e.startswith("rules[2].for: expected a duration") for e in errors)
    assert (
        "rules[3].severity: expected one of " + ", ".join(SEVERITIES) + ", got 'urgent'" in errors
    )
    assert (
        "rules[4].actions[1]: expected one of notify, autotune, recommend_memory, "
        "capture_evidence, got 'page'" in errors
    )
    assert any(e.startswith("rules[5].kind: expected one of threshold, rate") for e in errors)
    assert any(e.startswith("rules[6].metric: unknown metric 'gpu_util' (known: ") for e in errors)
    assert any(
        e.startswith("rules[7].annotations.summary: template names unknown field {jobname}")
        for e in errors
    )
    assert lines == sorted(lines)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "name: A\nkind: threshold\nmetric: loss\nop: '>'",
            "missing required key 'value' for kind",
        ),
        ("kind: straggler", "missing required key 'name'"),
        ("name: A", "missing required key 'kind'"),
        ("name: A\nkind: straggler\nop: '>'", "rules[0].op: not allowed for kind 'straggler'"),
        (
            "name: A\nkind: threshold\nmetric: loss\nop: '>'\nvalue: high",
            "expected a finite number",
        ),
        (
            "name: A\nkind: threshold\nmetric: loss\nop: '>'\nvalue: .nan",
            "expected a finite number",
        ),
        (
            "name: A\nkind: threshold\nmetric: loss\nop: '>'\nvalue: true",
            "expected a finite number",
        ),
        ("name: A\nkind: straggler\nfor: -5", "expected a non-negative duration, got -5"),
        ("name: A\nkind: straggler\ncooldown: 10x", "expected a duration such as 30s"),
        (
            "name: A\nkind: straggler\nfor: [1]",
            "expected a duration such as 30s, 5m or 1h, got a list",
        ),
        ("name: A\nkind: absent\nmetric: loss", "missing required key 'for' for kind 'absent'"),
        ("name: A\nkind: absent\nmetric: loss\nfor: 0s", "absent rule needs a positive duration"),
        ("name: A\nkind: rate\nmetric: loss\nop: '>'\nvalue: 1\nwindow: 0", "positive duration"),
        (
            "name: A\nkind: threshold\nmetric: loss\nop: '>'\nvalue: 1\nby: [job]",
            "rules[0].by: needs 'aggregate'",
        ),
        (
            "name: A\nkind: threshold\nmetric: loss\nop: '>'\nvalue: 1\n"
            "aggregate: mean\nby: [node]",
            "loss has no label 'node' (it has: job, rank)",
        ),
        (
            "name: A\nkind: threshold\nmetric: loss\nop: '>'\nvalue: 1\naggregate: median",
            "expected one of mean, max, min, sum, got 'median'",
        ),
        (
            "name: A\nkind: threshold\nmetric: loss\nop: '>'\nvalue: 1\nmatchers: {gpu: '0'}",
            "rules[0].matchers.gpu: loss has no label 'gpu'",
        ),
        ("name: A\nkind: straggler\nlabels: {severity: page}", "labels.severity: is set by"),
        ("name: A\nkind: straggler\nlabels: {rank: '0'}", "would replace the label"),
        ("name: A\nkind: straggler\nlabels: {bad-name: x}", "not a label name"),
        (
            "name: A\nkind: straggler\nlabels: [a]",
            "rules[0].labels: expected a mapping, got a list",
        ),
        ("name: A\nkind: straggler\nactions: notify", "expected a list of actions"),
        ("name: A\nkind: straggler\nkind: hang", "rules[0].kind: duplicate key"),
        ("name: '!!'\nkind: straggler", "expected a name with letters or digits"),
        ("name: A\nkind: straggler\nannotations: {summary: '{0}'}", "must be a plain name"),
        ("name: A\nkind: straggler\nannotations: {summary: '{job.x}'}", "must be a plain name"),
        ("name: A\nkind: straggler\nannotations: {summary: 'a } b'}", "invalid template"),
        ("name: A\nkind: straggler\nannotations: {summary: '{job:.2f}'}", "cannot be rendered"),
        ("name: A\nkind: straggler\nannotations: {summary: '{value:d}'}", "cannot be rendered"),
        ("name: A\nkind: straggler\nannotations: {summary: '{job:101}'}", "width above 100"),
        ("name: A\nkind: straggler\nannotations: {summary: '{value:.1000f}'}", "precision above"),
        ("name: A\nkind: straggler\nannotations: {summary: '{job:q}'}", "format spec 'q' is not"),
    ],
)
def test_rule_mistakes(body: str, expected: str) -> None:
    message = _error(_one(body))
    assert expected in message
    assert message.startswith("r.yaml:")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "r.yaml:1: expected a mapping with a 'rules' list"),
        ("- a\n- b\n", "r.yaml:1: expected a mapping, got a list"),
        ("other: 1\n", "r.yaml:1: other: unknown key (a rule file holds only 'rules')"),
        ("rules: 3\n", "r.yaml:1: rules: expected a list of rules"),
        ("rules:\n  - 3\n", "r.yaml:2: rules[0]: expected a mapping, got '3'"),
        ("rules:\n  - name: [a\n", "r.yaml:3: invalid YAML"),
    ],
)
def test_file_structure_mistakes(text: str, expected: str) -> None:
    assert _error(text).startswith(expected)


def test_names_that_collide_in_prometheus_are_rejected() -> None:
    text = "rules:\n  - {name: High Mem, kind: straggler}\n  - {name: high-mem, kind: hang}\n"
    assert "exports to the same Prometheus alert name 'HighMem' as 'High Mem'" in _error(text)


def test_missing_file_is_a_rule_error(tmp_path: Path) -> None:
    with pytest.raises(RuleError, match="cannot read the rule file"):
        load_rules(tmp_path / "none.yaml")


def test_an_empty_rule_list_is_valid() -> None:
    assert len(load_rules_text("rules: []\n")) == 0


def test_a_number_in_exponent_form_is_a_number() -> None:
    # PyYAML reads 1e7 (no dot) as a string; a rule author means a number.
    rules = load_rules_text(_one("name: A\nkind: rate\nmetric: loss\nop: '>'\nvalue: 1e7"))
    assert rules.rules[0].threshold == 1e7


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1m30s", 90.0),
        (12, 12.0),
        (0.25, 0.25),
        ("2d", 172800.0),
    ],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "m", "1 m", "-1s", "1y", "s30"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.5, "500ms"),
        (30, "30s"),
        (90, "1m30s"),
        (120, "2m"),
        (3600, "1h"),
        (3661.5, "1h1m1s500ms"),
    ],
)
def test_prometheus_duration(seconds: float, text: str) -> None:
    assert prometheus_duration(seconds) == text
    assert seconds == 0 or parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("name", "camel"),
    [
        ("High Communication Overhead", "HighCommunicationOverhead"),
        ("Low GPU Utilization", "LowGPUUtilization"),
        ("Non-finite Loss", "NonFiniteLoss"),
        ("step time anomaly", "StepTimeAnomaly"),
        ("5xx errors", "Torshmon5xxErrors"),
    ],
)
def test_alert_name(name: str, camel: str) -> None:
    assert alert_name(name) == camel


def test_compare_is_never_true_for_nan() -> None:
    rule = Rule(name="A", kind="threshold", metric="loss", op="<", threshold=1.0)
    assert rule.compare(0.5)
    assert not rule.compare(1.5)
    assert not rule.compare(math.nan)


def test_default_summary_names_metric_condition_and_labels() -> None:
    rule = Rule(name="A", kind="threshold", metric="loss", op=">", threshold=3.0)
    summary = default_summary(rule)
    assert summary == "A: loss is {value:.4g} (> 3) on job={job}, rank={rank}"
    assert summary.format(value=4.25, job="j", rank="1") == "A: loss is 4.25 (> 3) on job=j, rank=1"
    grouped = Rule(
        name="B", kind="threshold", metric="loss", op=">", threshold=3.0, aggregate="max"
    )
    assert default_summary(grouped) == "B: loss is {value:.4g} (> 3)"
    assert default_summary(Rule(name="C", kind="straggler")) is None


def test_known_metrics_cover_what_the_aggregator_feeds() -> None:
    assert {
        "step_duration_seconds",
        "comm_wait_seconds",
        "compute_seconds",
        "communication_time_ratio",
        "training_efficiency_ratio",
        "input_wait_time_ratio",
        "throughput_samples_per_second",
        "loss",
        "cpu_utilization_ratio",
        "memory_utilization_ratio",
        "node_cpu_iowait_ratio",
        "gpu_utilization_ratio",
        "gpu_memory_utilization_ratio",
        "rank_memory_rss_bytes",
        "agent_silence_seconds",
        "collective_failures_total",
        "collective_duration_seconds",
    } == KNOWN_METRICS


def test_rendering_refuses_unbounded_specs_even_for_rules_built_in_code() -> None:
    assert render_template("{job:>8}|{value:.1%}", {"job": "j", "value": 0.25}) == "       j|25.0%"
    with pytest.raises(ValueError, match="width above 100"):
        render_template("{value:999999999}", {"value": 0.5})
    with pytest.raises(ValueError, match="must be a plain name"):
        render_template("{job.__class__}", {"job": "j"})
