"""torshmon rules as a Prometheus rule file, and the ``torshmon rules`` commands.

``to_prometheus`` writes one rule group that ``promtool check rules`` accepts, with
expressions over the series the agents and the aggregator export:

- threshold: ``torshmon_<m>{matchers} > v``; with ``aggregate``:
  ``avg by (job) (torshmon_<m>) > v``. A per-step mean has no series of its own:
  ``step_duration_seconds`` (a histogram) is ``rate(_sum[1m]) / rate(_count[1m])``,
  ``comm_wait_seconds`` and ``compute_seconds`` are their ``_seconds_total``
  counters' rates over ``torshmon_steps_total``'s (a mean by group divides the
  summed rates, which weighs every step equally). Node series come from the
  agents, training series from the aggregator: each exactly once.
- rate: ``deriv(torshmon_<m>[window]) > v``; with ``steady``, ``and`` the rises
  (``changes - resets``: resets counts every decrease) at least that fraction of the
  window's intervals.
- increase: ``increase(torshmon_<m>[window]) > v``.
- nonfinite: ``torshmon_<m> != torshmon_<m>`` (true only for NaN) ``or`` an
  infinite absolute value.
- anomaly: ``torshmon_anomaly_paging{metric="<m>"} > 0``; straggler:
  ``torshmon_straggler_paging > 0`` (``_paging``, not ``_active``: a finding too short
  yet to page is shown, not alerted, as in torshmon); hang:
  ``torshmon_hung_collective_age_seconds > 0``;
  slow_link: ``torshmon_slow_link_bandwidth_bytes_per_second > 0`` (exported only
  while the link is found slow, so ``$value`` is the bandwidth, as in torshmon);
  bottleneck: ``torshmon_bottleneck_active{category="<c>"} > 0``.
- absent: ``absent_over_time(torshmon_<m>[for])`` with ``for: 0s``. Prometheus can
  only tell that *no* series matched, so unlike torshmon's own per-series check it
  fires when every series of the metric is silent.

Alert names are the rule names in CamelCase, as the aggregator names the alerts it
pushes; the labels are the ones the aggregator's alert carries too (``severity``, the
rule's labels, the series' or finding's labels): ``instance``, which the scrape adds,
is removed (an empty label value removes a label), and so is the scrape job's ``job``
on rules over node series, which have no training job. Alertmanager then holds one
alert when both send it. Annotation templates are translated:
``{job}`` becomes ``{{ $labels.job }}``; ``{value:.0%}`` becomes
``{{ $value | humanizePercentage }}``, a float spec such as ``{value:.2f}``
``{{ printf "%.2f" $value }}``, any other spec is dropped. Fields that are constant
for a rule (``alertname``, ``severity``, the rule's labels, a metric rule's
``metric``) are written out literally. Rules on findings that have no summary get
one naming the job and rank (in torshmon they carry the detector's summary).
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Final

import yaml

from torshmon.aggregator.core.rules import (
    Rule,
    RuleSet,
    alert_name,
    default_summary,
    prometheus_duration,
)
from torshmon.catalogue import metrics as catalogue

__all__ = [
    "FORMATS",
    "PER_STEP_MEANS",
    "expression",
    "to_prometheus",
]

#: Export formats ``torshmon rules export --format`` accepts.
FORMATS: Final[tuple[str, ...]] = ("prometheus",)

_PREFIX: Final = catalogue.PREFIX
#: Rule metrics (names without the prefix) whose value is a per-step mean over the
#: last minute: the rate of the first series over the rate of the second.
PER_STEP_MEANS: Final[Mapping[str, tuple[str, str]]] = {
    **{
        spec.name.removeprefix(_PREFIX): (f"{spec.name}_sum", f"{spec.name}_count")
        for spec in catalogue.METRICS.values()
        if spec.kind == "histogram"
    },
    "comm_wait_seconds": (catalogue.COMM_WAIT_SECONDS_TOTAL.name, catalogue.STEPS_TOTAL.name),
    "compute_seconds": (catalogue.COMPUTE_SECONDS_TOTAL.name, catalogue.STEPS_TOTAL.name),
}
_PROM_AGGREGATE: Final[Mapping[str, str]] = {
    "mean": "avg",
    "max": "max",
    "min": "min",
    "sum": "sum",
}
_FINDING_METRIC: Final[Mapping[str, str]] = {
    "anomaly": catalogue.ANOMALY_PAGING.name,
    "straggler": catalogue.STRAGGLER_PAGING.name,
    "hang": catalogue.HUNG_COLLECTIVE_AGE_SECONDS.name,
    "slow_link": catalogue.SLOW_LINK_BANDWIDTH_BYTES_PER_SECOND.name,
    "bottleneck": catalogue.BOTTLENECK_ACTIVE.name,
}
_FINDING_SUMMARY: Final[Mapping[str, str]] = {
    "anomaly": "{alertname}: {metric} is anomalous in job {job} rank {rank}",
    "straggler": "{alertname}: rank {rank} of job {job} is straggling",
    "hang": "{alertname}: rank {rank} of job {job} is stuck in {op} on group {pg}",
    "slow_link": "{alertname}: slow network link in job {job} (rank: {rank}, node: {node})",
    "bottleneck": "{alertname}: job {job} has a bottleneck in {category} (torshmon report)",
}
#: Target labels every scrape adds (``job`` only where the series has none of its own).
_SCRAPE_LABELS: Final = ("instance", "job")
_FLOAT_SPEC: Final = re.compile(r"(\d*)(\.\d+)?([eEfFgG])\Z")


def to_prometheus(ruleset: RuleSet, *, group: str = "torshmon") -> str:
    """A Prometheus rule file (YAML) with one group holding every rule of ``ruleset``."""
    rules = [_prometheus_rule(rule) for rule in ruleset]
    document = {"groups": [{"name": group, "rules": rules}]}
    header = (
        f"# Generated by `torshmon rules export --format prometheus` from {ruleset.source}.\n"
        "# Alert names and labels are those of the alerts the aggregator pushes, so that\n"
        "# Alertmanager keeps one of each; an empty label value removes a scrape label.\n"
    )
    # No line folding: a folded template is still valid, but hard to read and to grep.
    text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=2**16)
    return header + text


def expression(rule: Rule) -> str:
    """The PromQL expression that is true when ``rule``'s condition holds."""
    if rule.kind in _FINDING_METRIC:
        selector = _FINDING_METRIC[rule.kind] + _matchers(
            {"metric": rule.metric, **rule.matchers} if rule.kind == "anomaly" else rule.matchers
        )
        return f"{selector} > 0"
    metric = rule.metric or ""
    mean = PER_STEP_MEANS.get(metric)
    if rule.kind == "absent":
        name = mean[1] if mean is not None else _PREFIX + metric
        return (
            f"absent_over_time({name}{_matchers(rule.matchers)}[{prometheus_duration(rule.for_s)}])"
        )
    if rule.kind == "nonfinite":
        value = _value(rule)
        return f"({value} != {value}) or (abs({value}) == +Inf)"
    comparison = f"{rule.op} {rule.threshold!r}"
    if rule.kind == "increase":
        window = prometheus_duration(rule.window_s)
        inner = f"increase({_PREFIX}{metric}{_matchers(rule.matchers)}[{window}])"
        return f"{_aggregated(rule, inner)} {comparison}"
    if rule.kind == "rate":
        window = prometheus_duration(rule.window_s)
        if mean is not None:
            # deriv() needs a range of samples; a subquery gives one for the ratio.
            inner = f"deriv(({_value(rule)})[{window}:])"
        else:
            inner = f"deriv({_PREFIX}{metric}{_matchers(rule.matchers)}[{window}])"
        expr = f"{_aggregated(rule, inner)} {comparison}"
        if rule.steady is not None and rule.aggregate is None and mean is None:
            # Rises = value changes - decreases (resets() counts every decrease).
            series = f"{_PREFIX}{metric}{_matchers(rule.matchers)}[{window}]"
            expr += (
                f" and (changes({series}) - resets({series})) >= "
                f"{rule.steady!r} * (count_over_time({series}) - 1)"
            )
        return expr
    if rule.aggregate == "mean" and mean is not None:
        by = _by(rule)
        match = _matchers(rule.matchers)
        return (
            f"sum{by} (rate({mean[0]}{match}[1m])) / "
            f"sum{by} (rate({mean[1]}{match}[1m])) {comparison}"
        )
    return f"{_aggregated(rule, _value(rule))} {comparison}"


def _value(rule: Rule) -> str:
    """The per-series value of a metric rule's metric."""
    metric = rule.metric or ""
    match = _matchers(rule.matchers)
    mean = PER_STEP_MEANS.get(metric)
    if mean is not None:
        return f"rate({mean[0]}{match}[1m]) / rate({mean[1]}{match}[1m])"
    return _PREFIX + metric + match


def _aggregated(rule: Rule, inner: str) -> str:
    if rule.aggregate is None:
        return inner
    return f"{_PROM_AGGREGATE[rule.aggregate]}{_by(rule)} ({inner})"


def _by(rule: Rule) -> str:
    # A job's series carry its run: grouped by job they keep it, as the engine's alerts do.
    names: list[str] = []
    for name in rule.by:
        names.append(name)
        if name == "job" and "run" not in rule.by:
            names.append("run")
    return f" by ({', '.join(names)})" if names else ""


def _matchers(matchers: Mapping[str, str | None]) -> str:
    if not matchers:
        return ""
    parts = [f'{name}="{_escape(value or "")}"' for name, value in matchers.items()]
    return "{" + ", ".join(parts) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _prometheus_rule(rule: Rule) -> dict[str, object]:
    entry: dict[str, object] = {"alert": alert_name(rule.name), "expr": expression(rule)}
    if rule.kind != "absent" and rule.for_s > 0:
        entry["for"] = prometheus_duration(rule.for_s)
    entry["labels"] = {**rule.labels, "severity": rule.severity, **_scrape_labels_removed(rule)}
    templates = dict(rule.annotations)
    if rule.kind == "absent":
        # Prometheus knows only that nothing matched: no labels, no age to show.
        summary: str | None = (
            f"{{alertname}}: no {rule.metric} sample for {prometheus_duration(rule.for_s)}"
        )
    else:
        summary = default_summary(rule) or _FINDING_SUMMARY.get(rule.kind)
    if "summary" not in templates and summary is not None:
        templates = {"summary": summary, **templates}
    constants = {"alertname": rule.name, "severity": rule.severity, **rule.labels}
    if rule.metric is not None:
        constants["metric"] = rule.metric
    entry["annotations"] = {
        key: _go_template(template, constants) for key, template in templates.items()
    }
    return entry


def _scrape_labels_removed(rule: Rule) -> dict[str, str]:
    """The labels the scrape adds that the aggregator's alert lacks, each set empty
    (which removes it) so both alerts carry the same label set. An aggregation's or
    ``absent_over_time``'s result has only the labels it names: none to remove."""
    if rule.aggregate is not None or rule.kind == "absent":
        return {}
    kept = {*rule.instance_labels, *rule.labels}
    return {name: "" for name in _SCRAPE_LABELS if name not in kept}


def _go_template(template: str, constants: Mapping[str, str]) -> str:
    """A ``str.format`` template as a Prometheus (Go) annotation template."""
    out: list[str] = []
    # parse() splits literal text at every escaped brace, so "{{" arrives as two
    # chunks; join the literal text between fields before escaping it for Go.
    literal: list[str] = []
    for text, field, spec, _ in string.Formatter().parse(template):
        literal.append(text)
        if field is None:
            continue
        if field in constants:
            literal.append(constants[field])
            continue
        out.append(_go_literal("".join(literal)))
        literal.clear()
        out.append(_go_value(spec or "") if field == "value" else f"{{{{ $labels.{field} }}}}")
    out.append(_go_literal("".join(literal)))
    return "".join(out)


def _go_literal(text: str) -> str:
    # "{{" would open a Go template action; print it as a string instead.
    return text.replace("{{", '{{ "{{" }}')


def _go_value(spec: str) -> str:
    if spec.endswith("%"):
        return "{{ $value | humanizePercentage }}"
    if _FLOAT_SPEC.match(spec):
        return f'{{{{ printf "%{spec}" $value }}}}'
    return "{{ $value }}"
