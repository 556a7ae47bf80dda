"""Alert rule definitions and their YAML files.

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

- ``threshold``: the newest value of ``metric`` compared with ``value`` by ``op``;
  with ``aggregate`` (mean, max, min, sum) the newest values of the series that
  share the ``by`` labels are combined first (NaN values are left out).
- ``rate``: the change per second of ``metric`` over ``window`` (default 60s), the
  least-squares slope of the points, compared with ``value``. A slope needs at
  least 3 points spanning half the window. A single jump (a process start or an
  evaluation pass allocating its working set) tilts the slope for as long as it
  is inside the window, so give such rules a ``for`` longer than the window, or
  ``steady``: the fraction of consecutive points in the window that must rise (0.8:
  a steady climb such as a leak, where one jump between flat points rises once).
- ``nonfinite``: a value of ``metric`` within ``window`` (default 60s) is NaN or
  infinite (a diverged loss; the aggregator stores a non-finite loss as NaN). Any
  value of the window, not only the newest: one ingested batch can hold a NaN step
  and finite steps after it. The alert resolves a window after the last such value.
  Threshold comparisons are never true for NaN, which is why this is a kind of its own.
- ``anomaly``: an active anomaly Finding whose ``metric`` label is the rule's metric.
- ``straggler``, ``hang``: an active Finding of that kind.
- ``slow_link``: an active Finding of the link checker, which names the rank whose
  network link is slow by a pairwise link check (``rank`` is ``"0-1"`` at world
  size 2, where only the pair can be named); its value is that rank's best pair
  bandwidth in bytes/s.
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
``rules.yaml:14: rules[2].op: expected one of >, >=, <, <=, got '=>'``.
"""

from __future__ import annotations

import math
import operator
import os
import re
import string
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Final, Literal, TypeVar, cast

from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from torshmon import yamlfile
from torshmon.aggregator.core.findings import SEVERITIES

__all__ = [
    "ACTIONS",
    "AGGREGATES",
    "FINDING_KINDS",
    "FINDING_LABELS",
    "KINDS",
    "KNOWN_METRICS",
    "MAX_FORMAT_WIDTH",
    "METRIC_KINDS",
    "METRIC_LABELS",
    "OPS",
    "Rule",
    "RuleError",
    "RuleSet",
    "alert_name",
    "default_rules",
    "default_summary",
    "load_rules",
    "load_rules_text",
    "parse_duration",
    "prometheus_duration",
    "render_template",
]

RuleKind = Literal[
    "threshold", "rate", "nonfinite", "absent", "anomaly", "straggler", "hang", "slow_link"
]
Op = Literal[">", ">=", "<", "<="]
Aggregate = Literal["mean", "max", "min", "sum"]

KINDS: Final[tuple[str, ...]] = (
    "threshold",
    "rate",
    "nonfinite",
    "absent",
    "anomaly",
    "straggler",
    "hang",
    "slow_link",
)
#: Kinds evaluated on the live series; the others on detector findings.
METRIC_KINDS: Final = frozenset({"threshold", "rate", "nonfinite", "absent"})
FINDING_KINDS: Final = frozenset({"anomaly", "straggler", "hang", "slow_link"})
OPS: Final[tuple[str, ...]] = (">", ">=", "<", "<=")
AGGREGATES: Final[tuple[str, ...]] = ("mean", "max", "min", "sum")
#: What may act on an alert: the notifiers, the autotuner, the memory recommendation.
ACTIONS: Final[tuple[str, ...]] = ("notify", "autotune", "recommend_memory")

#: The series the aggregator keeps, by name without the ``torshmon_`` prefix, with
#: the labels each series carries.
METRIC_LABELS: Final[Mapping[str, tuple[str, ...]]] = {
    "step_duration_seconds": ("job", "rank"),
    "comm_wait_seconds": ("job", "rank"),
    "compute_seconds": ("job", "rank"),
    "communication_time_ratio": ("job", "rank"),
    "training_efficiency_ratio": ("job", "rank"),
    "throughput_samples_per_second": ("job", "rank"),
    "loss": ("job", "rank"),
    "cpu_utilization_ratio": ("node",),
    "memory_utilization_ratio": ("node",),
    "io_wait_time_ratio": ("node",),
    "gpu_utilization_ratio": ("node", "gpu"),
    "rank_memory_rss_bytes": ("job", "rank", "node"),
}
KNOWN_METRICS: Final = frozenset(METRIC_LABELS)
#: Labels the detectors put on their findings (``rank`` is missing where a whole
#: job is at fault; a template naming it then renders it empty).
FINDING_LABELS: Final[Mapping[str, tuple[str, ...]]] = {
    "anomaly": ("job", "rank", "metric"),
    "straggler": ("job", "rank"),
    "hang": ("job", "rank", "op", "pg"),
    "slow_link": ("job", "rank"),
}

_PREFIX: Final = "torshmon_"
_COMMON_KEYS: Final = frozenset(
    {"name", "kind", "severity", "for", "cooldown", "matchers", "labels", "annotations", "actions"}
)
_KIND_KEYS: Final[Mapping[str, frozenset[str]]] = {
    "threshold": frozenset({"metric", "op", "value", "aggregate", "by"}),
    "rate": frozenset({"metric", "op", "value", "window", "steady", "aggregate", "by"}),
    "nonfinite": frozenset({"metric", "window"}),
    "absent": frozenset({"metric"}),
    "anomaly": frozenset({"metric"}),
    "straggler": frozenset(),
    "hang": frozenset(),
    "slow_link": frozenset(),
}
_ALL_KIND_KEYS: Final = frozenset(key for keys in _KIND_KEYS.values() for key in keys)
_REQUIRED_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    "threshold": ("metric", "op", "value"),
    "rate": ("metric", "op", "value"),
    "nonfinite": ("metric",),
    "absent": ("metric", "for"),
    "anomaly": ("metric",),
    "straggler": (),
    "hang": (),
    "slow_link": (),
}
_RESERVED_LABELS: Final = frozenset({"alertname", "severity"})
_LABEL_NAME: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_DURATION: Final = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+\Z")
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_S: Final[Mapping[str, float]] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_COMPARE: Final[Mapping[str, Callable[[float, float], bool]]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}
_DEFAULT_WINDOW_S: Final = 60.0
#: The widest field and the most digits an annotation template may ask for: a width of
#: 10**9 would make one annotation a gigabyte (or a MemoryError) at each render.
MAX_FORMAT_WIDTH: Final = 100
#: Python's format-spec mini-language, for str and float values.
_FORMAT_SPEC: Final = re.compile(
    r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[,_]?(?:\.(?P<precision>\d+))?[bcdeEfFgGnosxX%]?\Z",
    re.DOTALL,
)

_T = TypeVar("_T")


class RuleError(ValueError):
    """A rule file is unreadable or invalid; ``errors`` holds one ``file:line: field: what``
    line per mistake."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors: tuple[str, ...] = tuple(errors)
        super().__init__("\n".join(self.errors))


@dataclass(frozen=True, slots=True)
class Rule:
    """One alert rule; build it with ``load_rules_text`` so that it is validated.

    ``threshold`` is the YAML ``value`` (per second for ``rate``). ``for_s``,
    ``cooldown_s`` and ``window_s`` are seconds. ``source`` is ``file:line``.
    """

    name: str
    kind: RuleKind
    severity: str = "warning"
    metric: str | None = None
    op: Op | None = None
    threshold: float | None = None
    aggregate: Aggregate | None = None
    by: tuple[str, ...] = ()
    matchers: Mapping[str, str] = field(default_factory=dict)
    for_s: float = 0.0
    cooldown_s: float = 0.0
    window_s: float = _DEFAULT_WINDOW_S
    #: ``rate`` only: the fraction of the window's consecutive points that must rise.
    steady: float | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    actions: tuple[str, ...] = ("notify",)
    source: str = ""

    @property
    def instance_labels(self) -> tuple[str, ...]:
        """Names of the labels that tell this rule's alert instances apart."""
        if self.kind in FINDING_LABELS:
            return FINDING_LABELS[self.kind]
        if self.aggregate is not None:
            return self.by
        return METRIC_LABELS.get(self.metric or "", ())

    def compare(self, value: float) -> bool:
        """Whether ``value op threshold`` holds (never for NaN, nor for rules without op)."""
        if self.op is None or self.threshold is None:
            return False
        return _COMPARE[self.op](value, self.threshold)

    def template_fields(self) -> frozenset[str]:
        """Names an annotation template of this rule may use."""
        names = {"value", "alertname", "severity", *self.instance_labels, *self.labels}
        if self.metric is not None:
            names.add("metric")
        return frozenset(names)


@dataclass(frozen=True, slots=True)
class RuleSet:
    """The rules of one file, in file order, names unique."""

    rules: tuple[Rule, ...]
    source: str = ""

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def get(self, name: str) -> Rule | None:
        """The rule called ``name``, or None."""
        for rule in self.rules:
            if rule.name == name:
                return rule
        return None


# -- durations and names ------------------------------------------------------------------


def parse_duration(text: str | float) -> float:
    """Seconds in ``500ms``, ``30s``, ``5m``, ``1h``, ``1d``, ``1m30s`` or a number of seconds.

    Raises ValueError naming the text for anything else or a negative number.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a duration such as 30s, 5m or 1h, got {text!r}")
    if isinstance(text, (int, float)):
        seconds = float(text)
    elif isinstance(text, str) and _DURATION.match(text.strip()):
        seconds = sum(
            float(amount) * _UNIT_S[unit] for amount, unit in _DURATION_PART.findall(text)
        )
    else:
        raise ValueError(f"expected a duration such as 30s, 5m or 1h, got {text!r}")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"expected a non-negative duration, got {text!r}")
    return seconds


def prometheus_duration(seconds: float) -> str:
    """A Prometheus duration for ``seconds`` (``2m``, ``1m30s``, ``500ms``; ``0s`` for 0)."""
    remaining_ms = round(seconds * 1000)
    if remaining_ms <= 0:
        return "0s"
    parts = []
    for unit, size_ms in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        count, remaining_ms = divmod(remaining_ms, size_ms)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def alert_name(rule_name: str) -> str:
    """The rule name in CamelCase, a valid Prometheus alert name ("High Memory" -> HighMemory)."""
    words = re.findall(r"[A-Za-z0-9]+", rule_name)
    camel = "".join(word[0].upper() + word[1:] for word in words)
    if not camel or camel[0].isdigit():
        camel = "Torshmon" + camel
    return camel


def default_summary(rule: Rule) -> str | None:
    """The summary template used when a metric rule has none (None for finding kinds,
    whose alerts take the finding's own summary)."""
    if rule.kind not in METRIC_KINDS:
        return None
    name = rule.name.replace("{", "{{").replace("}", "}}")
    where = ", ".join(f"{label}={{{label}}}" for label in rule.instance_labels)
    where = f" on {where}" if where else ""
    if rule.kind == "threshold":
        return f"{name}: {rule.metric} is {{value:.4g}} ({rule.op} {rule.threshold:g}){where}"
    if rule.kind == "rate":
        return (
            f"{name}: {rule.metric} changes by {{value:.4g}}/s over "
            f"{prometheus_duration(rule.window_s)} ({rule.op} {rule.threshold:g}){where}"
        )
    if rule.kind == "nonfinite":
        return f"{name}: {rule.metric} is {{value}}{where}"
    return f"{name}: no {rule.metric} sample for {{value:.0f}} s{where}"


# -- loading ------------------------------------------------------------------------------


def default_rules() -> RuleSet:
    """The rules shipped with torshmon (``default_rules.yaml``, DESIGN.md's table)."""
    shipped = resources.files("torshmon.aggregator.core").joinpath("default_rules.yaml")
    text = shipped.read_text("utf-8")
    return load_rules_text(text, source="default_rules.yaml")


def load_rules(path: str | os.PathLike[str]) -> RuleSet:
    """Load and validate a rule file; RuleError lists every mistake with file and line.

    Size, nesting and tags are bounded as ``torshmon.yamlfile`` says.
    """
    try:
        text = yamlfile.read_text(path, what="rule file")
    except yamlfile.YamlFileError as exc:
        raise RuleError([str(exc)]) from None
    return load_rules_text(text, source=os.fspath(path))


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
            window_s=_DEFAULT_WINDOW_S if window_s is None else window_s,
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
                if not _LABEL_NAME.match(label):
                    self.error(
                        at("matchers", label), f"{path}.matchers.{label}", "not a label name"
                    )
        if rule.kind == "absent" and "for" in entries and rule.for_s <= 0:
            self.error(at("for"), f"{path}.for", "an absent rule needs a positive duration")
        if rule.kind in ("rate", "nonfinite") and "window" in entries and rule.window_s <= 0:
            self.error(at("window"), f"{path}.window", "must be a positive duration")
        if rule.steady is not None and not 0 < rule.steady <= 1:
            self.error(
                at("steady"),
                f"{path}.steady",
                f"must be a fraction of the window's intervals in (0, 1], got {rule.steady:g}",
            )
        for label in rule.labels:
            label_path = f"{path}.labels.{label}"
            if not _LABEL_NAME.match(label):
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
            if not _LABEL_NAME.match(key):
                self.error(
                    at("annotations", key), f"{path}.annotations.{key}", "not an annotation name"
                )
                continue
            problem = _check_template(template, rule.template_fields())
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


def _check_template(template: str, fields: frozenset[str]) -> str | None:
    """Why ``template`` cannot be rendered with ``fields``, or None if it can."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        return f"invalid template: {exc} (write {{{{ and }}}} for literal braces)"
    known = ", ".join(sorted(fields))
    for _, field_name, spec, _ in parsed:
        if field_name is None:
            continue
        if not _LABEL_NAME.match(field_name):
            return f"template field {{{field_name}}} must be a plain name (known: {known})"
        if field_name not in fields:
            return f"template names unknown field {{{field_name}}} (known: {known})"
        if spec and "{" in spec:
            return f"template field {{{field_name}}} has a nested format spec"
        problem = _spec_problem(spec or "")
        if problem:
            return f"template field {{{field_name}}}: {problem}"
    sample: dict[str, object] = dict.fromkeys(fields, "x")
    sample["value"] = 0.5
    try:
        render_template(template, sample)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        return f"template cannot be rendered: {exc}"
    return None


def render_template(template: str, fields: Mapping[str, object]) -> str:
    """``template.format_map(fields)`` that refuses what could allocate without bound:
    a width or precision above MAX_FORMAT_WIDTH, and field names that are not plain
    names (``{job.__class__}``). Raises ValueError, KeyError as ``format_map`` does."""
    return _FORMATTER.vformat(template, (), fields)


def _spec_problem(spec: str) -> str | None:
    """Why a format spec is refused, or None (see ``render_template``)."""
    match = _FORMAT_SPEC.match(spec)
    if match is None:
        return f"format spec {spec!r} is not [[fill]align][sign][width][,][.precision][type]"
    for part in ("width", "precision"):
        digits = match[part]
        if digits and (len(digits) > 3 or int(digits) > MAX_FORMAT_WIDTH):
            return f"format spec {spec!r} has a {part} above {MAX_FORMAT_WIDTH}"
    return None


class _BoundedFormatter(string.Formatter):
    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if not _LABEL_NAME.match(field_name):
            raise ValueError(f"template field {{{field_name}}} must be a plain name")
        return super().get_field(field_name, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        problem = _spec_problem(format_spec)
        if problem:
            raise ValueError(problem)
        return super().format_field(value, format_spec)


_FORMATTER: Final = _BoundedFormatter()
