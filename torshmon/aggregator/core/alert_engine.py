"""The alert state machine: rules over live series and findings in, transitions out.

Each rule yields alert instances, one per series, ``by`` group or finding. An
instance moves ``inactive -> pending -> firing -> resolved``:

- condition true, no instance: it becomes pending (a ``pending`` transition). When
  it has already held for the rule's ``for`` (``for: 0``, or a finding or silence
  that began long enough ago) it goes straight to firing in the same evaluation
  and only the ``firing`` transition is emitted.
- pending and the condition has held for ``for``: ``firing``. A firing alert's
  ``starts_at_unix_s`` is when it began firing (Alertmanager's ``startsAt``); a
  pending alert's is when the condition began.
- firing and the condition is false: ``resolved`` with ``ends_at_unix_s``, carrying
  the rule's actions. Then, for the rule's ``cooldown``, the same instance is not
  evaluated at all (no pending either), so a flapping condition notifies once.
- pending and the condition is false: a ``resolved`` transition with no actions
  (``actions == ()``). It closes the pending record in storage; notifiers and the
  autotuner act only on the actions an alert carries, so nobody is told about an
  alert that never fired. Cooldown does not apply. (A ``pending`` transition
  carries the rule's actions for information only: act on firing and resolved.)

A series that expires from the store (its ``retention_s``) or is forgotten (a
finished job) is no longer seen: an ``absent`` alert on it resolves then.

While an alert is open its stored text follows what it quotes: ``revised`` gives the
open alerts whose annotations changed (a straggler's ratio, a threshold's value), at
most every ``revise_every_s`` each, for the store to rewrite. They are no transitions:
nobody is notified of a figure that moved.

Metric rules ignore series whose newest point is older than ``stale_after_s``
(a rank that stopped reporting must not hold a threshold alert forever; the
``absent`` kind is for silence). ``Alert.value`` is never NaN or infinite (it is
None then, e.g. for a non-finite loss) so records store and serialise cleanly;
annotation templates still see the real value.

Pure and synchronous: given the same rules, evaluation times, series and findings
it returns the same transitions in the same order (rules in file order).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import operator
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, NamedTuple

from torshmon.aggregator.core.alert import Alert, AlertState
from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.rules import (
    FINDING_KINDS,
    Rule,
    RuleSet,
    alert_name,
    default_summary,
)
from torshmon.aggregator.core.series import Cursor, LabelSet, SeriesStore, labelset_from
from torshmon.aggregator.core.templates import render_template
from torshmon.catalogue.metrics import METRICS, PREFIX

log = logging.getLogger(__name__)

__all__ = ["AlertEngine"]

_RESERVED: Final = frozenset({"alertname", "severity"})
#: Rule metrics Prometheus scrapes from the agents, whose series carry no run: an alert
#: on them names none either, so it is one alert whichever path sends it.
_AGENT_METRICS: Final = frozenset(
    name.removeprefix(PREFIX) for name, spec in METRICS.items() if spec.exporter == "agent"
)
_AGGREGATE: Final[Mapping[str, Callable[[list[float]], float]]] = {
    "mean": statistics.fmean,
    "max": max,
    "min": min,
    "sum": math.fsum,
}


class _Hit(NamedTuple):
    """The condition of one instance holds: with this value, since this time."""

    value: float
    since_s: float
    finding: Finding | None


@dataclass(slots=True)
class _Newest:
    """A threshold rule's view of its metric's newest points, brought up to date at each
    evaluation from ``SeriesStore.changes``: ``rows`` holds the matching series whose
    newest value counts (meets the condition; with ``aggregate``, is a number) as
    ``serial: (labels, ts_unix_s, value)``, ``order`` their serials sorted (the store's
    order)."""

    cursor: Cursor | None = None
    rows: dict[int, tuple[LabelSet, float, float]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Slopes:
    """A rate rule's results, brought up to date at each evaluation: ``rows`` holds
    every matching series as ``serial: (labels, ts_unix_s of its newest point, due,
    slope)``; a result holds while the window keeps the same points, that is until a
    new point comes (``SeriesStore.changes``) or the window's start passes ``due``, the
    time of the oldest point in it (``dues``: a heap of ``(due, serial)``, entries
    whose due is no longer the row's left to go by). ``order``: the serials of the rows
    with a slope, sorted (the store's order)."""

    cursor: Cursor | None = None
    window_start_s: float = -math.inf
    rows: dict[int, tuple[LabelSet, float, float, float | None]] = field(default_factory=dict)
    dues: list[tuple[float, int]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Instance:
    """One pending or firing alert instance."""

    rule: Rule
    labels: dict[str, str]
    state: Literal["pending", "firing"]
    active_since_s: float
    fired_at_s: float | None
    value: float
    finding: Finding | None
    base_annotations: Mapping[str, str]
    #: The annotations last handed out for storage (a transition or a revision), and when.
    stored_annotations: Mapping[str, str] = field(default_factory=dict)
    stored_at_s: float = -math.inf


class _Fields(dict[str, object]):
    """Template fields; a label the instance lacks (``rank`` of a whole-job finding)
    renders empty instead of failing."""

    def __missing__(self, key: str) -> str:
        return ""


class AlertEngine:
    """Evaluates a RuleSet about once a second and tracks every alert instance.

    ``stale_after_s``: metric rules ignore series with no point for this long.
    ``revise_every_s``: an open alert's stored text is revised at most this often (a
    threshold's summary quotes a value that moves at every evaluation).
    Not thread safe: one engine belongs to the aggregator's event loop.
    Raises ValueError for a non-positive ``stale_after_s`` or a negative ``revise_every_s``.
    """

    def __init__(
        self, rules: RuleSet, *, stale_after_s: float = 300.0, revise_every_s: float = 10.0
    ) -> None:
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be positive, got {stale_after_s}")
        if not revise_every_s >= 0:
            raise ValueError(f"revise_every_s must be >= 0 seconds, got {revise_every_s}")
        self.rules = rules
        self.stale_after_s = stale_after_s
        self.revise_every_s = revise_every_s
        self._by_name = {rule.name: rule for rule in rules}
        self._instances: dict[str, dict[LabelSet, _Instance]] = {rule.name: {} for rule in rules}
        self._cooldown_until: dict[tuple[str, LabelSet], float] = {}
        self._orphans: dict[str, Alert] = {}
        self._templates = {rule.name: _templates(rule) for rule in rules}
        self._render_failed: set[tuple[str, str]] = set()
        # Per rate rule: each series' result and how long it holds.
        self._slopes: dict[str, _Slopes] = {}
        # Per aggregating rule: the ``by`` group of each series (by serial) seen at the
        # last evaluation.
        self._groups: dict[str, dict[int, LabelSet]] = {}
        # Per threshold rule: what it knows of its series' newest points.
        self._newest: dict[str, _Newest] = {}
        # Per job: when its config last switched, and its run (as given to ``evaluate``).
        self._switched: Mapping[str, float] = {}
        self._runs: Mapping[str, str] = {}

    # -- evaluation -----------------------------------------------------------------------

    def evaluate(
        self,
        now_unix_s: float,
        series: SeriesStore,
        findings: Sequence[Finding],
        config_switched_unix_s: Mapping[str, float] | None = None,
        runs: Mapping[str, str] | None = None,
    ) -> list[Alert]:
        """Evaluate every rule at ``now_unix_s``; returns this evaluation's transitions.

        ``findings`` are the detectors' currently active findings.
        ``config_switched_unix_s``: per job, when its communication config last changed
        (an autotuner trial). A ``rate`` rule does not judge a job's series while the
        switch is in its window: a new bucket layout or codec allocates its buffers over
        the first steps, a rise that is the switch's, not a trend.
        ``runs``: per job, its current run; a new alert of the job is labelled ``run``.
        """
        self._switched = config_switched_unix_s or {}
        self._runs = runs or {}
        now = now_unix_s
        transitions: list[Alert] = []
        for alert in self._orphans.values():
            transitions.append(_resolved_orphan(alert, now))
        self._orphans.clear()
        self._cooldown_until = {
            key: until for key, until in self._cooldown_until.items() if until > now
        }
        by_kind: dict[str, list[Finding]] = {}
        for finding in findings:
            by_kind.setdefault(finding.kind, []).append(finding)
        for rule in self.rules:
            hits = self._conditions(rule, now, series, by_kind)
            self._advance(rule, hits, now, transitions)
        return transitions

    def _advance(
        self, rule: Rule, hits: dict[LabelSet, _Hit], now: float, transitions: list[Alert]
    ) -> None:
        instances = self._instances[rule.name]
        # The absent kind's `for` is the silence itself, already part of its condition.
        pending_for_s = 0.0 if rule.kind == "absent" else rule.for_s
        for key, hit in hits.items():
            instance = instances.get(key)
            if instance is not None and _new_episode(rule, instance, hit):
                # The detector let the rank go and named it again between two
                # evaluations (one ingest carried both): the alert of the first episode
                # resolves, and the second gets an alert of its own.
                del instances[key]
                transitions.append(self._alert(instance, "resolved", now))
                instance = None
                if rule.cooldown_s > 0:
                    self._cooldown_until[(rule.name, key)] = now + rule.cooldown_s
            is_new = instance is None
            if instance is None:
                if (rule.name, key) in self._cooldown_until:
                    continue
                instance = instances[key] = _Instance(
                    rule=rule,
                    labels=_alert_labels(rule, key, self._runs),
                    state="pending",
                    active_since_s=min(hit.since_s, now),
                    fired_at_s=None,
                    value=hit.value,
                    finding=hit.finding,
                    base_annotations={},
                )
            instance.value = hit.value
            if hit.finding is not None:
                instance.finding = hit.finding
            if instance.state == "pending" and now - instance.active_since_s >= pending_for_s:
                instance.state = "firing"
                instance.fired_at_s = now
                transitions.append(self._stored(instance, "firing", now))
            elif is_new:
                transitions.append(self._stored(instance, "pending", now))
        gone = [key for key in instances if key not in hits]
        for key in gone:
            instance = instances.pop(key)
            transitions.append(self._alert(instance, "resolved", now))
            if instance.state == "firing" and rule.cooldown_s > 0:
                self._cooldown_until[(rule.name, key)] = now + rule.cooldown_s

    # -- conditions -----------------------------------------------------------------------

    def _conditions(
        self,
        rule: Rule,
        now: float,
        series: SeriesStore,
        findings: Mapping[str, list[Finding]],
    ) -> dict[LabelSet, _Hit]:
        if rule.kind in FINDING_KINDS:
            return _finding_hits(rule, findings.get(rule.kind, ()), now)
        metric = rule.metric or ""
        fresh_after = now - self.stale_after_s
        # Tested as `not matchers or ...`: issubset builds a set of each key it is given.
        matchers = frozenset(rule.matchers.items())
        if rule.kind == "absent":
            hits: dict[LabelSet, _Hit] = {}
            for key, last_s in series.last_seen(metric).items():
                age_s = now - last_s
                if age_s >= rule.for_s and (not matchers or matchers.issubset(key)):
                    hits[key] = _Hit(age_s, last_s + rule.for_s, None)
            return hits
        if rule.kind == "nonfinite":
            # Any value of the window: one ingested batch can hold a NaN step and the
            # finite steps after it, so the newest value alone would miss it.
            start = now - rule.window_s
            return {
                key: _Hit(math.nan, now, None)
                for key, nonfinite_s in series.newest_nonfinite(metric).items()
                if nonfinite_s >= start and (not matchers or matchers.issubset(key))
            }
        if rule.kind in ("rate", "increase"):
            values = self._rates(rule, now, series, fresh_after, matchers)
            if self._switched and rule.kind == "rate":
                values = self._settled(values, now - rule.window_s)
        else:
            values = self._fresh_newest(rule, series, fresh_after, matchers)
        if rule.aggregate is None:
            pairs = [(key, value) for _, key, value in values]
        else:
            pairs = self._aggregate(rule, values)
        return {key: _Hit(value, now, None) for key, value in pairs if rule.compare(value)}

    def _settled(
        self, values: list[tuple[int, LabelSet, float]], window_start_s: float
    ) -> list[tuple[int, LabelSet, float]]:
        """``values`` without the series of jobs whose config switched inside the window."""
        switched = self._switched
        kept = []
        for row in values:
            job = dict(row[1]).get("job")
            if job is None or switched.get(job, -math.inf) < window_start_s:
                kept.append(row)
        return kept

    def _fresh_newest(
        self,
        rule: Rule,
        series: SeriesStore,
        fresh_after: float,
        matchers: frozenset[tuple[str, str]],
    ) -> list[tuple[int, LabelSet, float]]:
        """``(serial, labels, value)`` of the newest point of every fresh matching series
        of a threshold rule whose value counts (``_Newest``), in the store's order.

        Only the series whose newest point changed since the last evaluation are looked
        at (at 5 000 ranks most have not: the agents sample about once a second, the
        engine evaluates more often); staleness is the one test of every kept series."""
        view = self._newest.get(rule.name)
        if view is None:
            view = self._newest[rule.name] = _Newest()
        view.cursor, every, changed = series.changes(rule.metric or "", view.cursor)
        rows = view.rows
        if every:
            rows.clear()
        counts = rule.compare if rule.aggregate is None else _is_number
        reorder = every
        for serial, key, ts_s, value in changed:
            if counts(value) and (not matchers or matchers.issubset(key)):
                if serial not in rows:
                    reorder = True
                rows[serial] = (key, ts_s, value)
            elif rows.pop(serial, None) is not None:
                reorder = True
        if reorder:
            view.order = sorted(rows)
        return [
            (serial, row[0], row[2])
            for serial in view.order
            if (row := rows[serial])[1] >= fresh_after
        ]

    def _rates(
        self,
        rule: Rule,
        now: float,
        series: SeriesStore,
        fresh_after: float,
        matchers: frozenset[tuple[str, str]],
    ) -> list[tuple[int, LabelSet, float]]:
        """``(serial, labels, slope)`` of every fresh matching series of a ``rate`` rule
        that has a slope and rises steadily enough, in the store's order.

        A series' result is computed again only once its window holds other points
        (``_Slopes``): the agents sample about once a second, the engine evaluates more
        often, and most series have no new point and lost none since the last time."""
        metric = rule.metric or ""
        window_start = now - rule.window_s
        view = self._slopes.get(rule.name)
        if view is None:
            view = self._slopes[rule.name] = _Slopes()
        rows, dues = view.rows, view.dues
        view.cursor, every, changed = series.changes(metric, view.cursor)
        todo: dict[int, tuple[LabelSet, float]] = {}
        # Due times hold for a window that only moves forward: a clock that steps back
        # starts again from every series (``changed`` holds them all when ``every``).
        if every or window_start < view.window_start_s:
            if not every:
                todo = {serial: (row[0], row[1]) for serial, row in rows.items()}
            rows.clear()
            dues.clear()
            view.order = []
        view.window_start_s = window_start
        for serial, key, last_s, _ in changed:
            if not matchers or matchers.issubset(key):
                todo[serial] = (key, last_s)
        passed = set()  # the series whose entry in ``dues`` came out
        while dues and dues[0][0] < window_start:
            due, serial = heapq.heappop(dues)
            row = rows.get(serial)
            if row is not None and row[2] == due:
                passed.add(serial)
                todo.setdefault(serial, (row[0], row[1]))
        min_span_s = rule.window_s / 2
        reorder = False
        for serial, (key, last_s) in todo.items():
            ts, vs = series.columns(metric, key, window_start)
            slope = (
                _increase(vs)
                if rule.kind == "increase"
                else _steady_slope(ts, vs, min_span_s, rule.steady)
            )
            due = ts[0] if ts else math.inf  # no point in the window: only new ones count
            if due != due:
                due = -math.inf  # a NaN time: due at every evaluation
            old = rows.get(serial)
            if (old is None or old[2] != due or serial in passed) and due < math.inf:
                heapq.heappush(dues, (due, serial))
            if (old is None or old[3] is None) != (slope is None):
                reorder = True
            rows[serial] = (key, last_s, due, slope)
        if reorder:
            view.order = sorted(serial for serial, row in rows.items() if row[3] is not None)
        values = []
        for serial in view.order:
            key, last_s, _, slope = rows[serial]
            if last_s >= fresh_after and slope is not None:
                values.append((serial, key, slope))
        return values

    def _aggregate(
        self, rule: Rule, values: list[tuple[int, LabelSet, float]]
    ) -> list[tuple[LabelSet, float]]:
        """Combine values per ``by`` group (NaN values are left out)."""
        names = sorted(rule.by)
        # Each series' group, kept from the last evaluation (the same series come back).
        known = self._groups.get(rule.name, {})
        seen: dict[int, LabelSet] = {}
        groups: dict[LabelSet, list[float]] = {}
        for serial, key, value in values:
            if math.isnan(value):
                continue
            group = known.get(serial)
            if group is None:
                labels = dict(key)
                group = tuple((name, labels[name]) for name in names if name in labels)
            seen[serial] = group
            members = groups.get(group)
            if members is None:
                groups[group] = [value]
            else:
                members.append(value)
        self._groups[rule.name] = seen
        combine = _AGGREGATE[rule.aggregate or "mean"]
        return [(group, float(combine(members))) for group, members in groups.items()]

    # -- records --------------------------------------------------------------------------

    def _alert(self, instance: _Instance, state: AlertState, now: float | None) -> Alert:
        rule = instance.rule
        fired = instance.state == "firing"
        starts_s = instance.fired_at_s if fired and instance.fired_at_s is not None else None
        value = instance.value
        return Alert(
            rule=rule.name,
            state=state,
            severity=instance.labels.get("severity", rule.severity),
            labels=dict(instance.labels),
            annotations=self._annotations(instance),
            value=value if math.isfinite(value) else None,
            starts_at_unix_s=instance.active_since_s if starts_s is None else starts_s,
            ends_at_unix_s=now,
            # Only an alert that fired has anything to act on: a pending one (or one that
            # resolves without ever firing) carries no actions, so no consumer must filter.
            actions=rule.actions if fired else (),
        )

    def _stored(self, instance: _Instance, state: AlertState, now: float) -> Alert:
        """``instance``'s alert as it goes to storage, its text noted for ``revised``."""
        alert = self._alert(instance, state, None)
        instance.stored_annotations, instance.stored_at_s = alert.annotations, now
        return alert

    def revised(self, now_unix_s: float) -> list[Alert]:
        """The open alerts whose text changed since it was last stored, each at most every
        ``revise_every_s``: to rewrite their stored annotations and value, never to notify
        (their state is unchanged). Call after ``evaluate``."""
        out = []
        for instances in self._instances.values():
            for instance in instances.values():
                if now_unix_s - instance.stored_at_s < self.revise_every_s:
                    continue
                alert = self._alert(instance, instance.state, None)
                if alert.annotations != instance.stored_annotations:
                    instance.stored_annotations, instance.stored_at_s = (
                        alert.annotations,
                        now_unix_s,
                    )
                    out.append(alert)
        return out

    def _annotations(self, instance: _Instance) -> dict[str, str]:
        rule = instance.rule
        annotations = dict(instance.base_annotations)
        finding = instance.finding
        if finding is not None:
            annotations["summary"] = finding.summary
            if finding.recommendation:
                annotations["recommendation"] = finding.recommendation
        fields = _Fields(instance.labels)
        fields["alertname"] = rule.name  # the title, as the exported rule writes it
        fields["value"] = instance.value
        fields.setdefault("metric", rule.metric or "")
        for key, template in self._templates[rule.name].items():
            try:
                annotations[key] = render_template(template, fields)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                # Load-time checks make this rare (a label value the spec cannot take);
                # the alert still goes out with the raw template.
                annotations[key] = template
                if (rule.name, key) not in self._render_failed:
                    self._render_failed.add((rule.name, key))
                    log.warning("rule %r: cannot render annotation %r: %s", rule.name, key, exc)
        return annotations

    def active(self) -> list[Alert]:
        """Every pending and firing alert, with its latest value."""
        return [
            self._alert(instance, instance.state, None)
            for instances in self._instances.values()
            for instance in instances.values()
        ]

    def restore(self, alerts: Iterable[Alert]) -> None:
        """Resume after a restart from stored alerts (the latest record per instance).

        Pending and firing alerts become instances again, keeping their labels and
        times; a resolved one restores its cooldown. Alerts of rules no longer in the
        rule set are resolved at the next evaluation.
        """
        for alert in alerts:
            rule = self._by_name.get(alert.rule)
            if rule is None:
                if alert.state == "resolved":
                    self._orphans.pop(alert.fingerprint, None)
                else:
                    self._orphans[alert.fingerprint] = alert
                continue
            key = labelset_from(
                {
                    name: value
                    for name, value in alert.labels.items()
                    if name not in _RESERVED
                    and name not in rule.labels
                    # A run's series and findings carry its run in their key; a
                    # rule's ``by`` group has it only where the rule names it.
                    and (name != "run" or not rule.by or "run" in rule.by)
                }
            )
            instances = self._instances[rule.name]
            if alert.state == "resolved":
                instances.pop(key, None)
                if rule.cooldown_s > 0 and alert.ends_at_unix_s is not None:
                    self._cooldown_until[(rule.name, key)] = alert.ends_at_unix_s + rule.cooldown_s
                continue
            self._cooldown_until.pop((rule.name, key), None)
            instances[key] = _Instance(
                rule=rule,
                labels=dict(alert.labels),
                state=alert.state,
                active_since_s=alert.starts_at_unix_s,
                fired_at_s=alert.starts_at_unix_s if alert.state == "firing" else None,
                value=math.nan if alert.value is None else alert.value,
                finding=None,
                base_annotations=dict(alert.annotations),
                stored_annotations=dict(alert.annotations),
            )


def _is_number(value: float) -> bool:
    return not math.isnan(value)


def _templates(rule: Rule) -> dict[str, str]:
    summary = default_summary(rule)
    if summary is None or "summary" in rule.annotations:
        return dict(rule.annotations)
    return {"summary": summary, **rule.annotations}


def _alert_labels(rule: Rule, key: LabelSet, runs: Mapping[str, str]) -> dict[str, str]:
    labels = dict(rule.labels)
    labels.update(key)
    run = runs.get(labels.get("job", ""))
    if run and "run" not in labels and rule.metric not in _AGENT_METRICS:
        labels["run"] = run
    # The name Prometheus gives the exported rule's alert, so that Alertmanager sees
    # one alert whichever path sends it (the rule's own name stays the title).
    labels["alertname"] = alert_name(rule.name)
    labels["severity"] = rule.severity
    return labels


def _finding_hits(rule: Rule, findings: Iterable[Finding], now: float) -> dict[LabelSet, _Hit]:
    hits: dict[LabelSet, _Hit] = {}
    for finding in findings:
        labels = finding.labels
        if rule.kind == "anomaly" and labels.get("metric") != rule.metric:
            continue
        if any(labels.get(name) != value for name, value in rule.matchers.items()):
            continue
        if finding.details.get("page") is False:
            continue  # shown on the pages, but too short-lived yet to wake anybody
        key = labelset_from(labels)
        if key not in hits:
            hits[key] = _Hit(finding.value, min(finding.since_unix_s, now), finding)
    return hits


def _increase(values: Sequence[float]) -> float | None:
    """How much a counter rose over ``values`` (Prometheus' ``increase()`` without the
    extrapolation): each drop is a reset, after which the counter counts from 0. None with
    fewer than 2 finite values."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return None
    rose = 0.0
    for before, after in itertools.pairwise(finite):
        rose += after - before if after >= before else after
    return rose


def _new_episode(rule: Rule, instance: _Instance, hit: _Hit) -> bool:
    """Whether ``hit`` is a later episode of a straggler finding than the one ``instance``
    fires for. A straggler finding's ``since_unix_s`` is set once, when the detector names
    the rank, so a later one means it was cleared in between. (Other kinds' ``since`` is
    not kept so strictly: their alerts resolve only when an evaluation sees them gone.)"""
    return (
        rule.kind == "straggler"
        and instance.state == "firing"
        and hit.finding is not None
        and instance.finding is not None
        and hit.finding.since_unix_s > instance.finding.since_unix_s
    )


def _steady_slope(
    ts: Sequence[float], values: Sequence[float], min_span_s: float, steady: float | None
) -> float | None:
    """``_slope`` of the finite points, or None as well when they rise between fewer
    than ``steady`` of consecutive points (``_rising``)."""
    if not math.isfinite(sum(values)):  # finite only if every value is
        finite = [(t, v) for t, v in zip(ts, values, strict=True) if math.isfinite(v)]
        ts, values = [t for t, _ in finite], [v for _, v in finite]
    # The cheap test first: most series (no leak) stop here.
    if steady is not None and _rising(values) < steady:
        return None
    return _slope(ts, values, min_span_s)


def _slope(ts: Sequence[float], values: Sequence[float], min_span_s: float) -> float | None:
    """Least-squares slope (value per second) of finite points, or None with fewer than
    3 of them or a span shorter than ``min_span_s``."""
    n = len(ts)
    if n < 3 or ts[-1] - ts[0] < min_span_s:
        return None
    # Centre the times: Unix seconds squared would lose the precision of the slope.
    mean_t = math.fsum(ts) / n
    mean_v = math.fsum(values) / n
    dts = [t - mean_t for t in ts]
    sxx = math.fsum([dt**2 for dt in dts])
    if sxx <= 0:
        return None
    return math.fsum([dt * (v - mean_v) for dt, v in zip(dts, values, strict=True)]) / sxx


def _rising(values: Sequence[float]) -> float:
    """The fraction of consecutive values (finite ones) where the value rose."""
    if len(values) < 2:
        return 0.0
    rises: int = sum(map(operator.lt, values, itertools.islice(values, 1, None)))
    return rises / (len(values) - 1)


def _resolved_orphan(alert: Alert, now: float) -> Alert:
    """Resolve a restored alert whose rule is gone (no actions unless it was firing)."""
    return Alert(
        rule=alert.rule,
        state="resolved",
        severity=alert.severity,
        labels=dict(alert.labels),
        annotations=dict(alert.annotations),
        value=alert.value,
        starts_at_unix_s=alert.starts_at_unix_s,
        ends_at_unix_s=now,
        actions=alert.actions if alert.state == "firing" else (),
        fingerprint=alert.fingerprint,
    )
