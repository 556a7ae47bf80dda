"""Alert rule files: YAML in, a checked ``RuleSet`` out (or every mistake at once).

This module parses text; reading a file (and the shipped ``default_rules.yaml``) is the
shell's, in ``torshmon.aggregator.rule_files``.

A rule file is a mapping with one key, ``rules``, holding a list of rules::

    rules:
      - name: High Communication Overhead
        kind: threshold
        metric: communication_time_ratio
        op: ">"
        value: 0.4
        aggregate: mean
        by: [job]
        for: 120s
        severity: high
        annotations:
          summary: "Communication takes {value:.0%} of step time in job {job}"
        actions: [notify, autotune]

Kinds (what makes the condition true, per series or per ``by`` group):

- ``threshold``: the newest value of ``metric`` compared with ``value`` by ``op``
  (``>``, ``>=``, ``<``, ``<=``; ``==`` and ``!=`` compare exactly, for counts and states);
  with ``aggregate`` (mean, max, min, sum) the newest values of the series that
  share the ``by`` labels are combined first (NaN values are left out).
- ``rate``: the change per second of ``metric`` over ``window`` (default 60s), the
  least-squares slope of the points, compared with ``value``. A slope needs at
  least 3 points spanning half the window. A single jump (a process start or an
  evaluation pass allocating its working set) tilts the slope for as long as it
  is inside the window, so give such rules a ``for`` longer than the window, or
  ``steady``: the fraction of consecutive points in the window that must rise (0.8:
  a steady climb such as a leak, where one jump between flat points rises once).
- ``increase``: how much the counter ``metric`` rose over ``window`` (default 60s),
  compared with ``value``, as Prometheus' ``increase()``: a drop is a reset (the
  process restarted), counted from 0. Needs two points in the window; for a counter
  that moves rarely (``collective_failures_total``) the aggregator writes a point when
  it changes, and the alert resolves a window after the last rise.
- ``nonfinite``: a value of ``metric`` within ``window`` (default 60s) is NaN or
  infinite (a diverged loss; the aggregator stores a non-finite loss as NaN). Any
  value of the window, not only the newest: one ingested batch can hold a NaN step
  and finite steps after it. The alert resolves a window after the last such value.
  Threshold comparisons are never true for NaN, which is why this is a kind of its own.
- ``anomaly``: an active anomaly Finding whose ``metric`` label is the rule's metric,
  one the rolling z-score watches: ``step_duration_seconds``, ``loss`` and
  ``comm_wait_seconds`` (rises) or ``throughput_samples_per_second`` (drops).
- ``straggler``, ``hang``: an active Finding of that kind.
- ``slow_link``: an active Finding of the link checker, which names the rank whose
  network link is slow by a pairwise link check (``rank`` is ``"0-1"`` at world
  size 2, where only the pair can be named); its value is that rank's best pair
  bandwidth in bytes/s. When ranks share hosts, the finding names a ``node``
  instead (``"nodeA-nodeB"`` with two nodes), valued at that node's best
  bandwidth to the other nodes.
- ``bottleneck``: a finding of the job's bottleneck report (labels ``job`` and
  ``category``: communication, efficiency, input, memory, gpu_memory, gpu); pick
  one with ``matchers: {category: input}``. Its value is the observed share (of the
  step, of memory, of GPU time), its summary and recommendation the report's.
- ``absent``: a series of ``metric`` that was seen has had no sample for ``for``
  (the ``for`` is the silence itself, so such an alert fires as soon as it holds).

Common keys: ``name`` and ``kind`` (required), ``severity`` (default warning),
``for`` and ``cooldown`` (durations, default 0: after an alert resolves the same
instance is not evaluated again for the cooldown), ``matchers`` (exact label
values the series or finding must have), ``labels`` (added to the alert),
``annotations`` (``str.format`` templates over the instance's labels, ``value``,
``alertname``, ``severity``, ``metric`` and the rule's labels) and ``actions``
(default ``[notify]``). Durations are ``500ms``, ``30s``, ``5m``, ``1h``, ``1m30s``
or a number of seconds. Metric names may carry the ``torshmon_`` prefix.

Every mistake is reported with file, line and field, all of them at once:
``rules.yaml:14: rules[2].op: expected one of >, >=, <, <=, ==, !=, got '=>'``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Final, TypeVar, cast

from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from torshmon import yamlfile
from torshmon.aggregator.core.findings import SEVERITIES
from torshmon.aggregator.core.rules import (
    ACTIONS,
    AGGREGATES,
    ANOMALY_METRICS,
    DEFAULT_WINDOW_S,
    KINDS,
    KNOWN_METRICS,
    LABEL_NAME,
    METRIC_KINDS,
    METRIC_LABELS,
    OPS,
    WINDOW_KINDS,
    Aggregate,
    Op,
    Rule,
    RuleError,
    RuleKind,
    RuleSet,
    alert_name,
    parse_duration,
)
from torshmon.aggregator.core.templates import check_template

_PREFIX: Final = "torshmon_"
_COMMON_KEYS: Final = frozenset(
    {"name", "kind", "severity", "for", "cooldown", "matchers", "labels", "annotations", "actions"}
)
_KIND_KEYS: Final[Mapping[str, frozenset[str]]] = {
    "threshold": frozenset({"metric", "op", "value", "aggregate", "by"}),
    "rate": frozenset({"metric", "op", "value", "window", "steady", "aggregate", "by"}),
    "increase": frozenset({"metric", "op", "value", "window", "aggregate", "by"}),
    "nonfinite": frozenset({"metric", "window"}),
    "absent": frozenset({"metric"}),
    "anomaly": frozenset({"metric"}),
    "straggler": frozenset(),
    "hang": frozenset(),
    "slow_link": frozenset(),
    "bottleneck": frozenset(),
}
_ALL_KIND_KEYS: Final = frozenset(key for keys in _KIND_KEYS.values() for key in keys)
_REQUIRED_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    "threshold": ("metric", "op", "value"),
    "rate": ("metric", "op", "value"),
    "increase": ("metric", "op", "value"),
    "nonfinite": ("metric",),
    "absent": ("metric", "for"),
    "anomaly": ("metric",),
    "straggler": (),
    "hang": (),
    "slow_link": (),
    "bottleneck": (),
}
_RESERVED_LABELS: Final = frozenset({"alertname", "severity"})

_T = TypeVar("_T")


# -- loading ------------------------------------------------------------------------------


def load_rules_text(text: str, *, source: str = "<string>") -> RuleSet:
    """Parse and validate rule YAML; ``source`` names it in errors. Raises RuleError."""
    try:
        root = yamlfile.compose(text, source)
    except yamlfile.YamlFileError as exc:
        raise RuleError([str(exc)]) from None
    parser = _Parser(source)
    rules = parser.parse_file(root)
    if parser.errors:
        raise RuleError(parser.errors)
    return RuleSet(rules=tuple(rules), source=source)


class _Parser:
    """Walks the composed YAML nodes (which keep their line numbers) into Rules,
    collecting every error instead of stopping at the first."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.errors: list[str] = []
        self._constructor = SafeConstructor()

    def error(self, node: Node, path: str, message: str) -> None:
        prefix = f"{path}: " if path else ""
        self.errors.append(f"{self.source}:{node.start_mark.line + 1}: {prefix}{message}")

    # -- structure ------------------------------------------------------------------------

    def parse_file(self, root: Node | None) -> list[Rule]:
        if root is None:
            self.errors.append(f"{self.source}:1: expected a mapping with a 'rules' list")
            return []
        entries = self.mapping(root, "")
        if entries is None:
            return []
        for key, (key_node, _) in entries.items():
            if key != "rules":
                self.error(key_node, key, "unknown key (a rule file holds only 'rules')")
        if "rules" not in entries:
            if not set(entries) - {"rules"}:  # else the unknown key is the likely typo
                self.error(root, "", "missing the 'rules' list")
            return []
        rules_node = entries["rules"][1]
        if not isinstance(rules_node, SequenceNode):
            self.error(rules_node, "rules", "expected a list of rules")
            return []
        rules: list[Rule] = []
        first_line: dict[str, int] = {}
        exported: dict[str, str] = {}
        for index, node in enumerate(rules_node.value):
            path = f"rules[{index}]"
            rule = self.rule(node, path)
            # Names are checked even for rules with other mistakes, so that one run
            # reports everything.
            name = rule.name if rule is not None else _peek_name(node)
            if name is None:
                continue
            if name in first_line:
                self.error(
                    node,
                    f"{path}.name",
                    f"duplicate rule name {name!r} (first defined at line {first_line[name]})",
                )
                continue
            camel = alert_name(name)
            if camel in exported:
                self.error(
                    node,
                    f"{path}.name",
                    f"{name!r} exports to the same Prometheus alert name {camel!r} "
                    f"as {exported[camel]!r}",
                )
                continue
            first_line[name] = node.start_mark.line + 1
            exported[camel] = name
            if rule is not None:
                rules.append(rule)
        return rules

    def mapping(self, node: Node, path: str) -> dict[str, tuple[Node, Node]] | None:
        """A mapping node's entries by key; duplicate and non-string keys are errors."""
        if not isinstance(node, MappingNode):
            self.error(node, path, f"expected a mapping, got {_describe(node)}")
            return None
        entries: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node)
            key_path = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                self.error(key_node, path, f"keys must be strings, got {key!r}")
            elif key in entries:
                self.error(key_node, key_path, "duplicate key")
            else:
                entries[key] = (key_node, value_node)
        return entries

    def rule(self, node: Node, path: str) -> Rule | None:
        entries = self.mapping(node, path)
        if entries is None:
            return None
        errors_before = len(self.errors)
        kind = self.kind(entries, node, path)
        allowed = _COMMON_KEYS | (_KIND_KEYS[kind] if kind else _ALL_KIND_KEYS)
        for key, (key_node, _) in entries.items():
            if key not in allowed:
                what = f"not allowed for kind {kind!r}" if key in _ALL_KIND_KEYS else "unknown key"
                listed = ", ".join(sorted(allowed))
                self.error(key_node, f"{path}.{key}", f"{what} (allowed: {listed})")
        for key in ("name", "kind", *(_REQUIRED_KEYS[kind] if kind else ())):
            if key not in entries:
                detail = f" for kind {kind!r}" if key not in ("name", "kind") else ""
                self.error(node, path, f"missing required key {key!r}{detail}")

        def get(key: str) -> tuple[Node, str] | None:
            if key in entries and key in allowed:
                return entries[key][1], f"{path}.{key}"
            return None

        name = self.with_node(get("name"), self.name)
        severity = self.with_node(get("severity"), lambda n, p: self.choice(n, p, SEVERITIES))
        metric = self.with_node(get("metric"), self.metric)
        op = self.with_node(get("op"), lambda n, p: self.choice(n, p, OPS))
        threshold = self.with_node(get("value"), self.number)
        aggregate = self.with_node(get("aggregate"), lambda n, p: self.choice(n, p, AGGREGATES))
        by = self.with_node(get("by"), self.label_names)
        matchers = self.with_node(get("matchers"), self.string_map)
        for_s = self.with_node(get("for"), self.duration)
        cooldown_s = self.with_node(get("cooldown"), self.duration)
        window_s = self.with_node(get("window"), self.duration)
        steady = self.with_node(get("steady"), self.number)
        labels = self.with_node(get("labels"), self.string_map)
        annotations = self.with_node(get("annotations"), self.string_map)
        actions = self.with_node(get("actions"), self.actions)
        if len(self.errors) > errors_before or kind is None or name is None:
            return None

        rule = Rule(
            name=name,
            kind=cast(RuleKind, kind),
            severity=severity or "warning",
            metric=metric,
            op=cast(Op | None, op),
            threshold=threshold,
            aggregate=cast(Aggregate | None, aggregate),
            by=tuple(by or ()),
            matchers=matchers or {},
            for_s=for_s or 0.0,
            cooldown_s=cooldown_s or 0.0,
            window_s=DEFAULT_WINDOW_S if window_s is None else window_s,
            steady=steady,
            labels=labels or {},
            annotations=annotations or {},
            actions=tuple(actions) if actions is not None else ("notify",),
            source=f"{self.source}:{node.start_mark.line + 1}",
        )
        self.check_rule(rule, entries, path)
        return None if len(self.errors) > errors_before else rule

    def kind(self, entries: dict[str, tuple[Node, Node]], node: Node, path: str) -> str | None:
        if "kind" not in entries:
            return None
        return self.choice(entries["kind"][1], f"{path}.kind", KINDS)

    def check_rule(self, rule: Rule, entries: dict[str, tuple[Node, Node]], path: str) -> None:
        """Checks that need several fields at once."""

        def at(key: str, entry: str | None = None) -> Node:
            """The node of ``key``, or of its mapping's ``entry`` where one is named."""
            node = entries[key][1]
            if entry is not None and isinstance(node, MappingNode):
                for key_node, value_node in node.value:
                    if isinstance(key_node, ScalarNode) and key_node.value == entry:
                        return cast(Node, value_node)
            return node

        metric_labels = METRIC_LABELS.get(rule.metric or "", ())
        if rule.by and rule.aggregate is None:
            self.error(at("by"), f"{path}.by", "needs 'aggregate' (mean, max, min or sum)")
        if rule.kind in METRIC_KINDS:
            for label in rule.by:
                if label not in metric_labels:
                    self.error(
                        at("by"),
                        f"{path}.by",
                        f"{rule.metric} has no label {label!r} (it has: "
                        f"{', '.join(metric_labels)})",
                    )
            for label in rule.matchers:
                if label not in metric_labels:
                    self.error(
                        at("matchers", label),
                        f"{path}.matchers.{label}",
                        f"{rule.metric} has no label {label!r} (it has: "
                        f"{', '.join(metric_labels)})",
                    )
        else:
            for label in rule.matchers:
                if not LABEL_NAME.match(label):
                    self.error(
                        at("matchers", label), f"{path}.matchers.{label}", "not a label name"
                    )
        if rule.kind == "anomaly" and rule.metric and rule.metric not in ANOMALY_METRICS:
            self.error(
                at("metric"),
                f"{path}.metric",
                f"no anomaly detector watches {rule.metric!r} (watched: "
                f"{', '.join(ANOMALY_METRICS)})",
            )
        if rule.kind == "absent" and "for" in entries and rule.for_s <= 0:
            self.error(at("for"), f"{path}.for", "an absent rule needs a positive duration")
        if rule.kind in WINDOW_KINDS and "window" in entries and rule.window_s <= 0:
            self.error(at("window"), f"{path}.window", "must be a positive duration")
        if rule.steady is not None and not 0 < rule.steady <= 1:
            self.error(
                at("steady"),
                f"{path}.steady",
                f"must be a fraction of the window's intervals in (0, 1], got {rule.steady:g}",
            )
        for label in rule.labels:
            label_path = f"{path}.labels.{label}"
            if not LABEL_NAME.match(label):
                self.error(
                    at("labels", label), label_path, "not a label name ([a-zA-Z_][a-zA-Z0-9_]*)"
                )
            elif label in _RESERVED_LABELS:
                self.error(
                    at("labels", label), label_path, "is set by torshmon; use the rule's keys"
                )
            elif label in rule.instance_labels:
                self.error(
                    at("labels", label),
                    label_path,
                    "would replace the label of the series or finding",
                )
        for key, template in rule.annotations.items():
            if not LABEL_NAME.match(key):
                self.error(
                    at("annotations", key), f"{path}.annotations.{key}", "not an annotation name"
                )
                continue
            problem = check_template(template, rule.template_fields())
            if problem:
                self.error(at("annotations", key), f"{path}.annotations.{key}", problem)

    # -- values ---------------------------------------------------------------------------

    def with_node(
        self, found: tuple[Node, str] | None, parse: Callable[[Node, str], _T | None]
    ) -> _T | None:
        if found is None:
            return None
        return parse(*found)

    def scalar(self, node: Node) -> object:
        if not isinstance(node, ScalarNode):
            return _Unscalar(node)
        return self._constructor.construct_object(node, deep=True)

    def string(self, node: Node, path: str) -> str | None:
        value = self.scalar(node)
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # A label value such as `gpu: 0` or `team: 1` is meant as text.
            return str(value)
        self.error(node, path, f"expected a string, got {_describe_value(value)}")
        return None

    def name(self, node: Node, path: str) -> str | None:
        value = self.string(node, path)
        if value is None:
            return None
        if not value.strip() or not re.search(r"[A-Za-z0-9]", value):
            self.error(node, path, f"expected a name with letters or digits, got {value!r}")
            return None
        return value.strip()

    def choice(self, node: Node, path: str, allowed: Sequence[str]) -> str | None:
        value = self.scalar(node)
        if isinstance(value, str) and value in allowed:
            return value
        self.error(
            node, path, f"expected one of {', '.join(allowed)}, got {_describe_value(value)}"
        )
        return None

    def metric(self, node: Node, path: str) -> str | None:
        value = self.string(node, path)
        if value is None:
            return None
        name = value.removeprefix(_PREFIX)
        if name not in KNOWN_METRICS:
            self.error(
                node,
                path,
                f"unknown metric {value!r} (known: {', '.join(sorted(KNOWN_METRICS))})",
            )
            return None
        return name

    def number(self, node: Node, path: str) -> float | None:
        value = self.scalar(node)
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # PyYAML reads `1e7` (no dot) as a string; accept what float() accepts.
            try:
                number = float(value)
            except ValueError:
                number = None
        if number is None or not math.isfinite(number):
            self.error(node, path, f"expected a finite number, got {_describe_value(value)}")
            return None
        return number

    def duration(self, node: Node, path: str) -> float | None:
        value = self.scalar(node)
        try:
            if isinstance(value, _Unscalar):
                raise ValueError(f"expected a duration such as 30s, 5m or 1h, got {value}")
            return parse_duration(cast("str | float", value))
        except ValueError as exc:
            self.error(node, path, str(exc))
            return None

    def string_list(self, node: Node, path: str) -> list[str] | None:
        if not isinstance(node, SequenceNode):
            self.error(node, path, f"expected a list, got {_describe(node)}")
            return None
        values = [self.string(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
        if any(value is None for value in values):
            return None
        return [value for value in values if value is not None]

    def label_names(self, node: Node, path: str) -> list[str] | None:
        names = self.string_list(node, path)
        if names is None:
            return None
        if len(set(names)) != len(names):
            self.error(node, path, f"lists a label twice: {names}")
            return None
        return names

    def actions(self, node: Node, path: str) -> list[str] | None:
        if not isinstance(node, SequenceNode):
            self.error(node, path, f"expected a list of actions, got {_describe(node)}")
            return None
        actions = [self.choice(item, f"{path}[{i}]", ACTIONS) for i, item in enumerate(node.value)]
        if any(action is None for action in actions):
            return None
        return list(dict.fromkeys(action for action in actions if action is not None))

    def string_map(self, node: Node, path: str) -> dict[str, str] | None:
        entries = self.mapping(node, path)
        if entries is None:
            return None
        result: dict[str, str] = {}
        for key, (_, value_node) in entries.items():
            value = self.string(value_node, f"{path}.{key}")
            if value is not None:
                result[key] = value
        return result if len(result) == len(entries) else None


class _Unscalar:
    """Stands for a list or mapping where a scalar was expected (for the message)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def __repr__(self) -> str:
        return _describe(self.node)


def _peek_name(node: Node) -> str | None:
    """The ``name`` of a rule node that failed validation, if it has a plain one."""
    if isinstance(node, MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, ScalarNode) and key_node.value == "name":
                if isinstance(value_node, ScalarNode) and value_node.value.strip():
                    return str(value_node.value).strip()
                return None
    return None


def _describe(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    return repr(node.value)


def _describe_value(value: object) -> str:
    if isinstance(value, _Unscalar):
        return repr(value)
    if value is None:
        return "nothing"
    return repr(value)


__all__ = [
    "load_rules_text",
]
