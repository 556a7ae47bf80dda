"""Alert rules as data: ``Rule``, ``RuleSet``, the kinds, metrics and labels they may name.

A rule file (``rule_file``) builds them; the alert engine (``alert_engine``) evaluates
them; annotation templates are checked and rendered by ``templates``.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

RuleKind = Literal[
    "threshold",
    "rate",
    "increase",
    "nonfinite",
    "absent",
    "anomaly",
    "straggler",
    "hang",
    "slow_link",
    "bottleneck",
]
Op = Literal[">", ">=", "<", "<=", "==", "!="]
Aggregate = Literal["mean", "max", "min", "sum"]

KINDS: Final[tuple[str, ...]] = (
    "threshold",
    "rate",
    "increase",
    "nonfinite",
    "absent",
    "anomaly",
    "straggler",
    "hang",
    "slow_link",
    "bottleneck",
)
#: Kinds evaluated on the live series; the others on detector findings.
METRIC_KINDS: Final = frozenset({"threshold", "rate", "increase", "nonfinite", "absent"})
#: Kinds whose value is computed over the points of a window (``window``).
WINDOW_KINDS: Final = frozenset({"rate", "increase", "nonfinite"})
FINDING_KINDS: Final = frozenset({"anomaly", "straggler", "hang", "slow_link", "bottleneck"})
#: ``==`` and ``!=`` compare exactly: meant for counts, versions and 0/1 states.
OPS: Final[tuple[str, ...]] = (">", ">=", "<", "<=", "==", "!=")
AGGREGATES: Final[tuple[str, ...]] = ("mean", "max", "min", "sum")
#: What may act on an alert: the notifiers, the autotuner, the memory recommendation,
#: an evidence capture (Flight Recorder dumps and profiler traces of the job's ranks).
ACTIONS: Final[tuple[str, ...]] = ("notify", "autotune", "recommend_memory", "capture_evidence")

#: The series the aggregator keeps, by name without the ``torshmon_`` prefix, with
#: the labels each series carries.
METRIC_LABELS: Final[Mapping[str, tuple[str, ...]]] = {
    "step_duration_seconds": ("job", "rank"),
    "comm_wait_seconds": ("job", "rank"),
    "compute_seconds": ("job", "rank"),
    "communication_time_ratio": ("job", "rank"),
    "training_efficiency_ratio": ("job", "rank"),
    "input_wait_time_ratio": ("job", "rank"),
    "throughput_samples_per_second": ("job", "rank"),
    "loss": ("job", "rank"),
    "cpu_utilization_ratio": ("node",),
    "memory_utilization_ratio": ("node",),
    "node_cpu_iowait_ratio": ("node",),
    "gpu_utilization_ratio": ("node", "gpu"),
    "gpu_memory_utilization_ratio": ("node", "gpu"),
    "rank_memory_rss_bytes": ("job", "rank", "node"),
    "agent_silence_seconds": ("node",),
    "collective_duration_seconds": ("job", "op", "pg"),
    "collective_failures_total": ("job", "rank", "op", "pg"),
}
KNOWN_METRICS: Final = frozenset(METRIC_LABELS)
#: The series the rolling z-score detector watches, each in one direction: step time,
#: loss and communication wait up, throughput down. An ``anomaly`` rule names one.
ANOMALY_METRICS: Final[Mapping[str, str]] = {
    "step_duration_seconds": "up",
    "loss": "up",
    "comm_wait_seconds": "up",
    "throughput_samples_per_second": "down",
}
#: Labels the detectors put on their findings (``rank`` is missing where a whole
#: job is at fault; a template naming it then renders it empty).
FINDING_LABELS: Final[Mapping[str, tuple[str, ...]]] = {
    "anomaly": ("job", "rank", "metric"),
    "straggler": ("job", "rank"),
    "hang": ("job", "rank", "op", "pg"),
    "slow_link": ("job", "rank", "node"),
    "bottleneck": ("job", "category"),
}


LABEL_NAME: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_DURATION: Final = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+\Z")
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_S: Final[Mapping[str, float]] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_COMPARE: Final[Mapping[str, Callable[[float, float], bool]]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}
DEFAULT_WINDOW_S: Final = 60.0


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
    window_s: float = DEFAULT_WINDOW_S
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
    if rule.kind == "increase":
        return (
            f"{name}: {rule.metric} rose by {{value:.4g}} in the last "
            f"{prometheus_duration(rule.window_s)} ({rule.op} {rule.threshold:g}){where}"
        )
    if rule.kind == "nonfinite":
        return f"{name}: {rule.metric} is {{value}}{where}"
    return f"{name}: no {rule.metric} sample for {{value:.0f}} s{where}"


__all__ = [
    "ACTIONS",
    "AGGREGATES",
    "ANOMALY_METRICS",
    "DEFAULT_WINDOW_S",
    "FINDING_KINDS",
    "FINDING_LABELS",
    "KINDS",
    "KNOWN_METRICS",
    "LABEL_NAME",
    "METRIC_KINDS",
    "METRIC_LABELS",
    "OPS",
    "WINDOW_KINDS",
    "Aggregate",
    "Op",
    "Rule",
    "RuleError",
    "RuleKind",
    "RuleSet",
    "alert_name",
    "default_summary",
    "parse_duration",
    "prometheus_duration",
]
