"""A job's report as data: per-rank statistics, phases, series, alerts, findings, tuning.

``build_report`` is pure: a job's history rows (``torshmon.history.store.report``) and
the report time in, a ``JobReport`` out. The same record is rendered for the terminal
(``torshmon.report.text``) and as a page (``torshmon.report.page``), and travels as
JSON from an aggregator to ``torshmon report --aggregator`` (``to_json``/``from_json``).
Times are Unix seconds, durations seconds, memory bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import numpy as np

from torshmon.aggregator.core.bottleneck import (
    JobSnapshot,
    Thresholds,
    bottleneck_report,
    loss_severity,
    phase_words,
    rank_findings,
    straggler_summary,
    symptom_advice,
    what_if_step_s,
)
from torshmon.aggregator.core.findings import (
    EXPLAINED_BY_KEY,
    EXPLAINED_BY_NAME_KEY,
    LOSS_KEY,
    SEVERITIES,
    STEP_KEY,
    WHAT_IF_KEY,
    cause_id,
    cause_name,
    loss_text,
    slowdown_text,
)
from torshmon.history.store.report import JobHistory

#: Points per rank in a time series; longer runs are reduced to medians of equal spans.
MAX_POINTS: Final = 600
#: A job silent for longer than this has ended: while a rank's process lives its probe
#: sends a batch at least every second (a heartbeat, in a hang too) and its agent
#: forwards it within a second, retrying an aggregator out of reach for up to 10 s.
ENDED_AFTER_S: Final = 15.0
#: The findings that explain others (their symptoms), by kind.
CAUSE_KINDS: Final = ("straggler", "hang", "slow_link")
#: The phases of a step, in the order they happen.
PHASES: Final[tuple[str, ...]] = (
    "input_wait",
    "forward",
    "backward",
    "comm_wait",
    "optimizer",
    "other",
)


@dataclass(frozen=True, slots=True)
class RankStats:
    """One rank's steps: counts, medians and the 95th percentile of step time."""

    rank: int
    node: str
    steps: int
    last_step: int
    median_step_s: float | None
    p95_step_s: float | None
    median_compute_s: float | None
    median_comm_wait_s: float | None
    median_comm_ratio: float | None
    median_samples_per_s: float | None


@dataclass(frozen=True, slots=True)
class StepPhases:
    """The median split of one rank's step into ``PHASES`` (seconds each).

    ``backward_s`` is backward compute: the probe's backward time less the
    communication the step waited for, which ``comm_wait_s`` shows on its own.
    ``input_wait_s`` (waiting for the next batch, before the step starts) is None where
    the probe did not measure it; the others add up to the step time.
    """

    rank: int
    input_wait_s: float | None
    forward_s: float | None
    backward_s: float | None
    comm_wait_s: float | None
    optimizer_s: float | None
    other_s: float | None


@dataclass(frozen=True, slots=True)
class RankSeries:
    """One rank over time (``MAX_POINTS`` at most): each point the median of its span."""

    rank: int
    time_unix_s: tuple[float, ...]
    step: tuple[int, ...]
    duration_s: tuple[float | None, ...]
    compute_s: tuple[float | None, ...]
    comm_ratio: tuple[float | None, ...]


@dataclass(frozen=True, slots=True)
class MemorySeries:
    """Memory over time of a node (``kind`` "node", ratio of the node's memory) or of a
    rank's process (``kind`` "rank", resident bytes)."""

    kind: str
    name: str
    time_unix_s: tuple[float, ...]
    value: tuple[float | None, ...]


@dataclass(frozen=True, slots=True)
class EvidenceLink:
    """A file captured for an alert (a profiler trace, a Flight Recorder dump)."""

    name: str
    url: str


@dataclass(frozen=True, slots=True)
class AlertItem:
    """One alert episode."""

    id: int
    rule: str
    severity: str
    state: str
    rank: int | None
    summary: str
    recommendation: str
    value: float | None
    starts_at_unix_s: float
    fired_at_unix_s: float | None
    ends_at_unix_s: float | None
    evidence: tuple[EvidenceLink, ...] = ()


@dataclass(frozen=True, slots=True)
class AlertGroup:
    """The episodes of one rule on one rank (a flapping rule is one line, not fifty);
    ``fired`` of them fired, the others stayed pending (resolved before their ``for``)."""

    rule: str
    rank: int | None
    severity: str
    episodes: int
    fired: int
    first_start_unix_s: float
    last_end_unix_s: float | None
    firing_s: float
    state: str
    summary: str
    recommendation: str
    evidence: tuple[EvidenceLink, ...]


def alert_groups(alerts: Sequence[AlertItem], until_unix_s: float) -> list[AlertGroup]:
    """``alerts`` grouped by rule and rank, the group that started first first.

    ``firing_s`` sums the time each episode fired, an open one until ``until_unix_s``;
    ``last_end_unix_s`` is None while an episode is open; ``state``, ``summary`` and
    ``recommendation`` are the latest episode's, ``severity`` the highest.
    """
    grouped: dict[tuple[str, int | None], list[AlertItem]] = {}
    for alert in sorted(alerts, key=lambda a: (a.starts_at_unix_s, a.id)):
        grouped.setdefault((alert.rule, alert.rank), []).append(alert)
    groups = []
    for (rule, rank), episodes in grouped.items():
        latest = episodes[-1]
        open_episode = any(a.ends_at_unix_s is None for a in episodes)
        groups.append(
            AlertGroup(
                rule=rule,
                rank=rank,
                severity=max((a.severity for a in episodes), key=_severity_rank),
                episodes=len(episodes),
                fired=sum(a.fired_at_unix_s is not None for a in episodes),
                first_start_unix_s=episodes[0].starts_at_unix_s,
                last_end_unix_s=None
                if open_episode
                else max(a.ends_at_unix_s or 0.0 for a in episodes),
                firing_s=sum(
                    max(0.0, (a.ends_at_unix_s or until_unix_s) - a.fired_at_unix_s)
                    for a in episodes
                    if a.fired_at_unix_s is not None
                ),
                state=latest.state,
                summary=latest.summary,
                recommendation=latest.recommendation,
                evidence=tuple(e for a in episodes for e in a.evidence),
            )
        )
    return groups


@dataclass(frozen=True, slots=True)
class FindingItem:
    """A detector's or the bottleneck report's conclusion with what to do about it.

    Stored episodes of one condition (kind, category, rank, metric) are one item:
    ``episodes`` of them, the latest's text, ``since_unix_s`` the first's start,
    ``ended_unix_s`` None while one is open. ``stored`` False: computed from the
    history's steps when the report was made. ``priority`` (1 = act first),
    ``category``, ``expected_gain_ratio`` (share of step time a fix may save) and
    ``difficulty`` are empty where the history does not record them.
    """

    kind: str
    severity: str
    rank: int | None
    summary: str
    recommendation: str
    value: float | None
    since_unix_s: float
    detected_unix_s: float
    ended_unix_s: float | None
    stored: bool
    category: str = ""
    priority: int | None = None
    expected_gain_ratio: float | None = None
    difficulty: str = ""
    episodes: int = 1
    #: A cause (straggler, hang, slow link): its id, which its symptoms name in
    #: ``explained_by`` (``findings.cause_id``); the job's mean step period over the
    #: cause's episode (``step_s``), that period without it (``what_if_step_s``,
    #: from the measured steps) and the share of throughput it costs (``loss_ratio``).
    cause_id: str = ""
    step_s: float | None = None
    what_if_step_s: float | None = None
    loss_ratio: float | None = None
    #: A straggler's ratio (``details["slowdown_ratio"]``) and the node of the rank.
    slowdown_ratio: float | None = None
    peer_median_s: float | None = None
    phase: str = "compute"
    node: str = ""
    #: A symptom: the id and the name (``the straggler on rank 1``) of its cause.
    explained_by: str = ""
    explained_by_name: str = ""


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """A config version the job applied (``configs``: the tuner's or ``request_config``'s)."""

    version: int
    effective_step: int
    applied_unix_s: float
    config_text: str


@dataclass(frozen=True, slots=True)
class TrialItem:
    """One config a tuning session tried, with its throughput and what was decided."""

    session_id: str
    trial_index: int
    codec: str
    bucket_cap_mb: float | None
    config_text: str
    score: float | None
    decision: str | None
    reason: str
    started_unix_s: float | None


@dataclass(frozen=True, slots=True)
class SessionItem:
    """One tuning session."""

    id: str
    state: str
    trigger: str
    started_unix_s: float
    ended_unix_s: float | None
    baseline_score: float | None
    best_score: float | None
    best_config_text: str
    unit: str
    summary: str
    reason: str


@dataclass(frozen=True, slots=True)
class RunItem:
    """One launch of the job (``runs``): its rows are those from its start to the next's."""

    run_id: str
    started_unix_s: float
    ended_unix_s: float | None
    world_size: int | None


@dataclass(frozen=True, slots=True)
class JobReport:
    """Everything ``torshmon report`` shows of one job."""

    job: str
    world_size: int | None
    backend: str | None
    first_seen_unix_s: float
    last_seen_unix_s: float
    generated_unix_s: float
    running: bool
    steps_read: int
    steps_truncated: bool
    ranks: tuple[RankStats, ...]
    phases: tuple[StepPhases, ...]
    series: tuple[RankSeries, ...]
    memory: tuple[MemorySeries, ...]
    alerts: tuple[AlertItem, ...]
    findings: tuple[FindingItem, ...]
    sessions: tuple[SessionItem, ...]
    trials: tuple[TrialItem, ...]
    #: One sentence: what the job suffers most from and what it costs (``headline``).
    headline: str = ""
    #: The run this report is of ("" for a history without runs), and all the job's
    #: runs, the oldest first (``ended_unix_s``: the next one's start).
    run_id: str = ""
    runs: tuple[RunItem, ...] = ()
    #: The config versions the job applied, the oldest first (the plots mark them).
    configs: tuple[ConfigChange, ...] = ()


def to_json(report: JobReport) -> bytes:
    """``report`` as JSON (NaN never appears: unknown values are null)."""
    return msgspec.json.encode(report)


def from_json(data: bytes) -> JobReport:
    """A report sent by ``to_json``; msgspec.ValidationError/DecodeError if it is not one."""
    return msgspec.json.decode(data, type=JobReport)


def is_running(last_seen_unix_s: float, now_unix_s: float, *, closed: bool = False) -> bool:
    """Whether a job last heard from at ``last_seen_unix_s`` still runs at ``now_unix_s``:
    its ranks have not all said they closed (``closed``, ``closed_of``) nor been silent
    past ``ENDED_AFTER_S`` (the one rule for the report, the job's page and the list of
    jobs)."""
    return not closed and now_unix_s - last_seen_unix_s <= ENDED_AFTER_S


def closed_of(sessions: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every rank's latest probe session (``probe_sessions`` rows) said it
    closed: the job's last launch has ended, however recently."""
    latest: dict[int, Mapping[str, Any]] = {}
    for s in sorted(sessions, key=lambda s: s["started_unix_ns"]):
        latest[s["rank"]] = s
    return bool(latest) and all(s.get("closed_unix_ns") is not None for s in latest.values())


def build_report(history: JobHistory, now_unix_s: float) -> JobReport:
    """The report of ``history`` as of ``now_unix_s``."""
    job = history.job
    steps = _steps_by_rank(history.steps)
    nodes = dict(zip(history.steps.get("rank", []), history.steps.get("node", []), strict=True))
    nodes.update({s["rank"]: s["node"] for s in history.sessions if s["node"]})
    last_seen = job["last_seen_unix_ns"] / 1e9
    findings = _stored_findings(history.findings)
    if not any(f.kind == "bottleneck" for f in findings):
        findings += _computed_bottlenecks(job["job"], history, now_unix_s)
    findings = _with_what_ifs(job["job"], findings, steps, nodes, last_seen)
    findings = reading_order(_linked(findings))
    alerts = [_alert(a, history.evidence.get(a["id"], ())) for a in history.alerts]
    return JobReport(
        job=job["job"],
        world_size=job["world_size"],
        backend=job["backend"],
        first_seen_unix_s=job["first_seen_unix_ns"] / 1e9,
        last_seen_unix_s=last_seen,
        generated_unix_s=now_unix_s,
        running=is_running(last_seen, now_unix_s, closed=closed_of(history.sessions)),
        steps_read=len(history.steps.get("step", [])),
        steps_truncated=history.steps_truncated,
        ranks=tuple(_rank_stats(r, cols, nodes.get(r, "")) for r, cols in steps.items()),
        phases=tuple(_phases(r, cols) for r, cols in steps.items()),
        series=tuple(_series(r, cols) for r, cols in steps.items()),
        memory=_memory(history),
        alerts=tuple(_alerts_of_findings(alerts, findings, last_seen)),
        findings=tuple(findings),
        sessions=tuple(_session(s) for s in history.tuning_sessions),
        trials=tuple(_trial(t) for t in history.tuning_trials),
        headline=headline(findings, steps),
        run_id="" if history.run is None else history.run["run_id"],
        runs=tuple(_run_item(r) for r in history.runs),
        configs=tuple(_config_change(c) for c in history.configs),
    )


def _config_change(row: Mapping[str, Any]) -> ConfigChange:
    config = {
        "codec": row["codec"],
        "codec_params": row["codec_params"],
        "bucket_cap_mb": row["bucket_cap_bytes"] / 2**20,
    }
    return ConfigChange(
        version=row["version"],
        effective_step=row["effective_step"],
        applied_unix_s=row["applied_unix_ns"] / 1e9,
        config_text=config_text(config),
    )


def _run_item(row: Mapping[str, Any]) -> RunItem:
    end = row["ended_unix_ns"]
    return RunItem(
        run_id=row["run_id"],
        started_unix_s=row["started_unix_ns"] / 1e9,
        ended_unix_s=None if end is None else end / 1e9,
        world_size=row["world_size"],
    )


#: Step columns the report computes with, as float arrays (NULL is NaN).
_STEP_FIELDS: Final = (
    "step",
    "end_unix_ns",
    "duration_s",
    "comm_wait_s",
    "compute_s",
    "communication_time_ratio",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "samples_per_s",
    "input_wait_s",
    "eval_s",
    "between_steps_comm_s",
)

Columns = dict[str, "np.ndarray[Any, Any]"]


def _columns(rows: Sequence[Mapping[str, Any]], names: Sequence[str]) -> Columns:
    """Each of ``names`` as a float array over ``rows`` (NULL and absent columns NaN)."""
    return {n: np.array([r.get(n) for r in rows], dtype=float) for n in names}


def _steps_by_rank(steps: Mapping[str, Sequence[Any]]) -> dict[int, Columns]:
    """Each rank's step columns in step order, ranks in order."""
    if not steps.get("step"):
        return {}
    count = len(steps["step"])
    cols = {
        n: np.array(steps[n] if n in steps else [None] * count, dtype=float)
        for n in ("rank", *_STEP_FIELDS)
    }
    order = np.lexsort((cols["end_unix_ns"], cols["step"], cols["rank"]))
    cols = {n: v[order] for n, v in cols.items()}
    ranks, starts = np.unique(cols["rank"], return_index=True)
    bounds = [*starts[1:], len(order)]
    return {
        int(rank): {n: v[start:end] for n, v in cols.items()}
        for rank, start, end in zip(ranks, starts, bounds, strict=True)
    }


def _median(values: np.ndarray[Any, Any]) -> float | None:
    """The median of the finite ``values``; None if there are none."""
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if finite.size else None


def _binned(values: np.ndarray[Any, Any], size: int) -> np.ndarray[Any, Any]:
    """Medians of ``values`` in consecutive bins of ``size`` (NaN for a bin of NaN)."""
    padded = np.concatenate([values, np.full((-len(values)) % size, np.nan)])
    with warnings.catch_warnings():  # a bin with no finite value is NaN, as meant
        warnings.simplefilter("ignore", RuntimeWarning)
        medians: np.ndarray[Any, Any] = np.nanmedian(padded.reshape(-1, size), axis=1)
    return medians


def _optional(values: np.ndarray[Any, Any]) -> tuple[float | None, ...]:
    return tuple(float(v) if np.isfinite(v) else None for v in values)


def _bin_size(count: int) -> int:
    return max(1, -(-count // MAX_POINTS))


def _rank_stats(rank: int, cols: Columns, node: str) -> RankStats:
    durations = cols["duration_s"][np.isfinite(cols["duration_s"])]
    return RankStats(
        rank=rank,
        node=node,
        steps=len(cols["step"]),
        last_step=int(cols["step"][-1]),
        median_step_s=float(np.median(durations)) if durations.size else None,
        p95_step_s=float(np.percentile(durations, 95)) if durations.size else None,
        median_compute_s=_median(cols["compute_s"]),
        median_comm_wait_s=_median(cols["comm_wait_s"]),
        median_comm_ratio=_median(cols["communication_time_ratio"]),
        median_samples_per_s=_median(_period_samples_per_s(cols)),
    )


def _period_samples_per_s(cols: Columns) -> np.ndarray[Any, Any]:
    """Each step's samples over its period: the step and the time since the previous one
    ended (input wait, evaluation, collectives between steps). In synchronous training
    every rank runs at the job's pace; a rank whose data loader makes the others wait
    has short steps, and its samples over its step time alone would make it the
    fastest."""
    duration = cols["duration_s"]
    between = np.nansum(
        np.stack([cols["input_wait_s"], cols["eval_s"], cols["between_steps_comm_s"]]), axis=0
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        period_samples: np.ndarray[Any, Any] = (
            cols["samples_per_s"] * duration / (duration + between)
        )
    return period_samples


def _phases(rank: int, cols: Columns) -> StepPhases:
    step, input_wait, forward, backward, comm, optimizer = (
        _median(cols[n])
        for n in ("duration_s", "input_wait_s", "forward_s", "backward_s", "comm_wait_s",
                  "optimizer_s")
    )  # fmt: skip
    if backward is not None and comm is not None:
        backward = max(0.0, backward - comm)
    # The input wait comes before the step (it is not in its duration).
    known = [v for v in (forward, backward, comm, optimizer) if v is not None]
    other = max(0.0, step - sum(known)) if step is not None else None
    return StepPhases(rank, input_wait, forward, backward, comm, optimizer, other)


def _series(rank: int, cols: Columns) -> RankSeries:
    size = _bin_size(len(cols["step"]))
    steps = np.concatenate([cols["step"], np.full((-len(cols["step"])) % size, np.nan)])
    return RankSeries(
        rank=rank,
        time_unix_s=tuple(float(t) / 1e9 for t in _binned(cols["end_unix_ns"], size)),
        step=tuple(int(s) for s in np.nanmax(steps.reshape(-1, size), axis=1)),
        duration_s=_optional(_binned(cols["duration_s"], size)),
        compute_s=_optional(_binned(cols["compute_s"], size)),
        comm_ratio=_optional(_binned(cols["communication_time_ratio"], size)),
    )


def _memory(history: JobHistory) -> tuple[MemorySeries, ...]:
    series: list[MemorySeries] = []
    for kind, rows, key, value in (
        ("node", history.node_samples, "node", "memory_utilization_ratio"),
        ("rank", history.rank_samples, "rank", "rss_bytes"),
    ):
        by_key: dict[Any, list[Mapping[str, Any]]] = {}
        for row in reversed(rows):  # oldest first
            by_key.setdefault(row[key], []).append(row)
        for name, of_key in sorted(by_key.items()):
            cols = _columns(of_key, ("ts_unix_ns", value))
            size = _bin_size(len(of_key))
            series.append(
                MemorySeries(
                    kind=kind,
                    name=str(name),
                    time_unix_s=tuple(float(t) / 1e9 for t in _binned(cols["ts_unix_ns"], size)),
                    value=_optional(_binned(cols[value], size)),
                )
            )
    return tuple(series)


def _alert(row: Mapping[str, Any], evidence: Sequence[Mapping[str, Any]]) -> AlertItem:
    annotations = row["annotations"] if isinstance(row["annotations"], dict) else {}
    return AlertItem(
        id=int(row["id"]),
        rule=str(row["rule"]),
        severity=str(row["severity"]),
        state=str(row["state"]),
        rank=row["rank"],
        summary=str(annotations.get("summary", "")),
        recommendation=str(annotations.get("recommendation", "")),
        value=_finite(row["value"]),
        starts_at_unix_s=float(row["starts_at_unix_s"]),
        fired_at_unix_s=row["fired_at_unix_s"],
        ends_at_unix_s=row["ends_at_unix_s"],
        evidence=tuple(EvidenceLink(str(e["name"]), str(e["url"])) for e in evidence),
    )


def _stored_findings(rows: Sequence[Mapping[str, Any]]) -> list[FindingItem]:
    """The stored episodes, one item per condition (see ``FindingItem``)."""
    grouped: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: (r["detected_unix_s"], r["id"])):
        key = (row["kind"], row.get("category"), row["rank"], row["metric"])
        grouped.setdefault(key, []).append(row)
    found = []
    for episodes in grouped.values():
        latest = episodes[-1]
        still_open = any(r.get("ended_unix_s") is None for r in episodes)
        found.append(
            FindingItem(
                kind=str(latest["kind"]),
                severity=max((str(r["severity"]) for r in episodes), key=_severity_rank),
                rank=latest["rank"],
                summary=str(latest["summary"]),
                recommendation=str(latest["recommendation"]),
                value=_finite(latest["value"]),
                since_unix_s=float(episodes[0]["since_unix_s"]),
                detected_unix_s=float(latest["detected_unix_s"]),
                ended_unix_s=None if still_open else latest.get("ended_unix_s"),
                stored=True,
                category=_text(latest.get("category")),
                priority=latest.get("priority"),
                expected_gain_ratio=_finite(latest.get("expected_gain_ratio")),
                difficulty=_text(latest.get("difficulty")),
                episodes=len(episodes),
                **_links(str(latest["kind"]), latest),
            )
        )
    return found


def _links(kind: str, row: Mapping[str, Any]) -> dict[str, Any]:
    """The ``FindingItem`` fields a stored row's details carry (see ``findings``)."""
    stored = row.get("details")
    details: Mapping[str, Any] = stored if isinstance(stored, dict) else {}
    out: dict[str, Any] = {
        "explained_by": _text(details.get(EXPLAINED_BY_KEY)),
        "explained_by_name": _text(details.get(EXPLAINED_BY_NAME_KEY)),
        "step_s": _finite(details.get(STEP_KEY)),
        "what_if_step_s": _finite(details.get(WHAT_IF_KEY)),
        "loss_ratio": _finite(details.get(LOSS_KEY)),
    }
    labels = {"node": str(details["node"])} if isinstance(details.get("node"), str) else {}
    if row.get("rank") is not None:
        labels["rank"] = str(row["rank"])
    if row.get("category"):
        labels["category"] = str(row["category"])
    out["cause_id"] = cause_id(kind, labels)
    if kind == "straggler":
        out["slowdown_ratio"] = _finite(details.get("slowdown_ratio", row.get("score")))
        out["peer_median_s"] = _finite(details.get("peer_median_s"))
        out["phase"] = _text(details.get("phase")) or "compute"
    return out


def _computed_bottlenecks(job: str, history: JobHistory, now: float) -> list[FindingItem]:
    """The bottleneck report (``bottleneck_report``, ranked) on the medians of the
    job's steps and the fullest of its nodes, for a history that stored none."""
    duration, comm, compute, input_wait = (
        _median(np.array(history.steps.get(n, []), dtype=float))
        for n in ("duration_s", "comm_wait_s", "compute_s", "input_wait_s")
    )
    period = (duration or 0.0) + (input_wait or 0.0)

    def share(value: float | None) -> float | None:
        """``value`` as a share of the step period (step time plus input wait)."""
        return _ratio(value / period) if value is not None and period > 0 else None

    nodes = _columns(history.node_samples, ("memory_utilization_ratio", "io_wait_ratio"))
    memory = nodes["memory_utilization_ratio"][np.isfinite(nodes["memory_utilization_ratio"])]
    snapshot = JobSnapshot(
        communication_time_ratio=share(comm),
        training_efficiency_ratio=share(compute),
        input_wait_ratio=share(input_wait),
        memory_utilization_ratio=_ratio(float(np.max(memory)) if memory.size else None),
        io_wait_ratio=_ratio(_median(nodes["io_wait_ratio"])),
        step_s=period or None,
    )
    since = history.job["first_seen_unix_ns"] / 1e9
    ranked = rank_findings(bottleneck_report(job, snapshot, now), [], snapshot)
    return [
        FindingItem(
            kind=f.kind,
            severity=f.severity,
            rank=None,
            summary=f.summary,
            recommendation=f.recommendation,
            value=f.value,
            since_unix_s=since,
            detected_unix_s=now,
            ended_unix_s=None,
            stored=False,
            category=f.category,
            priority=f.priority,
            expected_gain_ratio=f.expected_gain_ratio,
            difficulty=f.difficulty,
            **_links(f.kind, {"details": dict(f.details), "category": f.category}),
        )
        for f in ranked
    ]


# -- causes and their symptoms ------------------------------------------------------------

#: A straggler's sentence (``computes 2.40x slower``, ``waits 3x longer``, as the
#: straggler report writes it, or as its detector did): how the report knows an alert's
#: text for one (a slow link's ``0.25x the median`` is not).
_STRAGGLER_TEXT: Final = re.compile(r"\b\d+(?:\.\d+)?x (?:slower|longer)\b")
_ACTIONS: Final = {
    "straggler": "check its node",
    "hang": "see where it waits (py-spy dump, the Flight Recorder dump)",
    "slow_link": "check its network path (the link check)",
}


def _with_what_ifs(
    job: str,
    findings: Sequence[FindingItem],
    steps: Mapping[int, Columns],
    nodes: Mapping[int, str],
    last_seen: float,
) -> list[FindingItem]:
    """Each cause with the job's step time without it, from the measured steps (a
    straggler: over its episode, each step less its excess over its peers' median; a
    hang: over the run, its stalled steps at the median), what that costs, the
    severity that follows from it, and a straggler's sentence with that cost."""
    grid = _step_grid(steps) if any(f.kind in ("straggler", "hang") for f in findings) else None
    out = []
    for f in findings:
        node = nodes.get(f.rank, "") if f.rank is not None else ""
        measured: tuple[float, float] | None = None
        if f.kind == "straggler" and f.rank is not None:
            measured = _straggler_what_if(grid, f, last_seen)
        elif f.kind == "hang":
            measured = _hang_what_if(grid, f, last_seen)
        if measured is None:
            out.append(dataclasses.replace(f, node=str(node or "")))
            continue
        step_s, what_if = measured
        loss = min(1.0, max(0.0, 1.0 - what_if / step_s)) if step_s > 0 else 0.0
        summary = f.summary
        if f.kind == "straggler" and f.slowdown_ratio is not None and f.loss_ratio is not None:
            # A sentence written by the straggler's report: the same one, with the loss
            # the report measured over the whole episode.
            summary = straggler_summary(
                job, str(f.rank), f.slowdown_ratio, f.peer_median_s, f.phase, loss
            )
        out.append(
            dataclasses.replace(
                f,
                node=str(node or ""),
                step_s=step_s,
                what_if_step_s=what_if,
                loss_ratio=loss,
                expected_gain_ratio=loss,
                severity=loss_severity(loss) if f.kind != "hang" else f.severity,
                summary=summary,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class _StepGrid:
    """The history's steps as (step number x rank) arrays, NaN where a rank has no such
    step: ``period`` (step time plus input wait), ``compute``, ``input_wait``; and per
    step number the job's ``job_period`` (the ranks' median) and ``end_unix_s`` (the
    last rank's end)."""

    ranks: tuple[int, ...]
    period: np.ndarray[Any, Any]
    compute: np.ndarray[Any, Any]
    input_wait: np.ndarray[Any, Any]
    end_unix_s: np.ndarray[Any, Any]
    job_period: np.ndarray[Any, Any]


def _step_grid(steps: Mapping[int, Columns]) -> _StepGrid | None:
    if not steps:
        return None
    numbers = np.unique(np.concatenate([c["step"][np.isfinite(c["step"])] for c in steps.values()]))
    ranks = tuple(sorted(steps))
    shape = (len(numbers), len(ranks))
    grids = {n: np.full(shape, np.nan) for n in ("period", "compute", "input_wait", "end")}
    for j, rank in enumerate(ranks):
        cols = steps[rank]
        keep = np.isfinite(cols["step"]) & np.isfinite(cols["duration_s"])
        rows = np.searchsorted(numbers, cols["step"][keep])
        waited = np.nan_to_num(cols["input_wait_s"][keep], nan=0.0)
        grids["period"][rows, j] = cols["duration_s"][keep] + waited
        grids["compute"][rows, j] = cols["compute_s"][keep]
        grids["input_wait"][rows, j] = waited
        grids["end"][rows, j] = cols["end_unix_ns"][keep] / 1e9
    with warnings.catch_warnings():  # a step number no rank has is NaN, as meant
        warnings.simplefilter("ignore", RuntimeWarning)
        job_period = np.nanmedian(grids["period"], axis=1)
        end = np.nanmax(grids["end"], axis=1)
    return _StepGrid(ranks, grids["period"], grids["compute"], grids["input_wait"], end, job_period)


def _straggler_what_if(
    grid: _StepGrid | None, f: FindingItem, last_seen: float
) -> tuple[float, float] | None:
    """The job's mean step period over ``f``'s episode, and that period with the
    straggler's phase at its peers' median at each step (``what_if_step_s``)."""
    if grid is None or f.rank not in grid.ranks or len(grid.ranks) < 2:
        return None
    j = grid.ranks.index(f.rank)
    phase = grid.input_wait if f.phase == "input" else grid.compute
    until = f.ended_unix_s if f.ended_unix_s is not None else last_seen
    with warnings.catch_warnings():  # a step no peer has is NaN, left out below
        warnings.simplefilter("ignore", RuntimeWarning)
        peers = np.nanmedian(np.delete(phase, j, axis=1), axis=1)
    own = phase[:, j]
    with np.errstate(invalid="ignore"):
        episode = (
            np.isfinite(own)
            & np.isfinite(peers)
            & np.isfinite(grid.job_period)
            & (grid.end_unix_s >= f.since_unix_s)
            & (grid.end_unix_s <= until)
        )
    if not episode.any():
        return None
    periods = grid.job_period[episode]
    what_ifs = [
        what_if_step_s(float(p), float(e))
        for p, e in zip(periods, own[episode] - peers[episode], strict=True)
    ]
    return float(np.mean(periods)), float(np.mean(what_ifs))


def _hang_what_if(
    grid: _StepGrid | None, f: FindingItem, last_seen: float
) -> tuple[float, float] | None:
    """The job's mean step period over the run, and that period with the steps the hang
    stalled at the run's median (a hang still open at the end adds its stall)."""
    if grid is None:
        return None
    known = np.isfinite(grid.job_period)
    periods, ends = grid.job_period[known], grid.end_unix_s[known]
    if not periods.size:
        return None
    median = float(np.median(periods))
    if f.ended_unix_s is None and float(np.max(ends)) <= f.since_unix_s:
        stall = max(0.0, last_seen - f.since_unix_s)
        return (float(periods.sum()) + stall) / periods.size, float(periods.mean())
    end = (f.ended_unix_s if f.ended_unix_s is not None else last_seen) + median
    hung = (ends >= f.since_unix_s) & (ends <= end)
    return float(periods.mean()), float(np.where(hung, np.minimum(periods, median), periods).mean())


def _linked(findings: Sequence[FindingItem]) -> list[FindingItem]:
    """``findings`` with the symptoms a cause explains linked to it, for a history whose
    aggregator stored no links (or a report computed from the steps): the efficiency
    roll-up under the largest cause at the same time (else under the largest
    communication or input finding), the communication wait under a hang, or under a
    straggler or slow link without which it would be below the high threshold."""
    ids = {f.cause_id for f in findings if f.cause_id}
    causes = sorted(
        (f for f in findings if f.kind in CAUSE_KINDS),
        key=lambda f: (f.kind != "hang", -(f.loss_ratio or 0.0)),
    )
    out = []
    for f in findings:
        if f.kind != "bottleneck" or f.category not in ("communication", "efficiency"):
            out.append(f)
            continue
        if f.explained_by and f.explained_by in ids:
            out.append(f)
            continue
        cause = next((c for c in causes if _overlap(c, f) and _explains(c, f)), None)
        if cause is not None:
            name = cause_name(
                cause.kind, {"rank": str(cause.rank)} if cause.rank is not None else {}
            )
            out.append(_under(f, cause, name, symptom_advice(f.category, name), 0.0))
            continue
        others = [c for c in findings if c.category in ("communication", "input") and c is not f]
        if f.category == "efficiency" and others:
            top = max(others, key=lambda c: c.expected_gain_ratio or 0.0)
            out.append(_under(f, top, f"the {top.category} finding", f.recommendation, None))
            continue
        out.append(f)
    return out


def _explains(cause: FindingItem, symptom: FindingItem) -> bool:
    if symptom.category == "efficiency" or cause.kind == "hang":
        return True
    loss, comm = cause.loss_ratio, symptom.value
    if loss is None or comm is None or loss >= 1.0:
        return False
    return max(0.0, comm - loss) / (1.0 - loss) <= Thresholds().communication_high_ratio


def _overlap(a: FindingItem, b: FindingItem) -> bool:
    a_end = a.ended_unix_s if a.ended_unix_s is not None else math.inf
    b_end = b.ended_unix_s if b.ended_unix_s is not None else math.inf
    return a.since_unix_s <= b_end and b.since_unix_s <= a_end


def _under(
    symptom: FindingItem, cause: FindingItem, name: str, advice: str, gain: float | None
) -> FindingItem:
    """``symptom`` listed under ``cause``: named, no more severe than it."""
    severity = min(symptom.severity, cause.severity, key=_severity_rank)
    return dataclasses.replace(
        symptom,
        severity=severity,
        explained_by=cause.cause_id,
        explained_by_name=name,
        recommendation=advice,
        expected_gain_ratio=gain if gain is not None else symptom.expected_gain_ratio,
    )


def finding_tree(findings: Sequence[FindingItem]) -> list[tuple[FindingItem, int]]:
    """``findings`` (in ``reading_order``) with each one's depth: 0 for a cause or an
    independent finding, 1 for what it explains, 2 for what that explains."""
    ids = {f.cause_id: f for f in findings if f.cause_id}
    out = []
    for f in findings:
        depth, seen, parent = 0, {f.cause_id}, f.explained_by
        while parent in ids and parent not in seen and depth < 3:
            depth += 1
            seen.add(parent)
            parent = ids[parent].explained_by
        out.append((f, depth))
    return out


def reading_order(findings: Sequence[FindingItem]) -> list[FindingItem]:
    """``findings`` as a person reads them, ``priority`` renumbered 1..n to match:
    causes and independent findings open before ended, most severe, largest loss or
    gain first; each followed by what it explains (the efficiency roll-up last)."""
    ids = {f.cause_id for f in findings if f.cause_id}
    children: dict[str, list[FindingItem]] = {}
    top = []
    for f in findings:
        if f.explained_by and f.explained_by in ids and f.explained_by != f.cause_id:
            children.setdefault(f.explained_by, []).append(f)
        else:
            top.append(f)
    ordered: list[FindingItem] = []

    def visit(f: FindingItem, depth: int) -> None:
        ordered.append(f)
        below = sorted(
            children.pop(f.cause_id, []) if f.cause_id and depth < 3 else [],
            key=lambda c: (c.category == "efficiency", *_finding_order(c)),
        )
        for child in below:
            visit(child, depth + 1)

    for f in sorted(top, key=_finding_order):
        visit(f, 0)
    ordered.extend(f for rest in children.values() for f in rest)  # a cycle: never lost
    return [dataclasses.replace(f, priority=i) for i, f in enumerate(ordered, start=1)]


def _alerts_of_findings(
    alerts: Sequence[AlertItem], findings: Sequence[FindingItem], last_seen: float
) -> list[AlertItem]:
    """``alerts``, a straggler's with its finding's latest sentence: an alert's text is
    written when it fires (and when it resolves), while the ratio it quotes is measured
    over the whole episode, so a job that ends with the alert open would show the
    figure of its first steps beside the finding's."""
    stragglers = [f for f in findings if f.kind == "straggler" and f.rank is not None]
    out = []
    for alert in alerts:
        ends = alert.ends_at_unix_s if alert.ends_at_unix_s is not None else last_seen
        match = next(
            (
                f
                for f in stragglers
                if f.rank == alert.rank
                and f.since_unix_s <= ends
                and alert.starts_at_unix_s <= (f.ended_unix_s or math.inf)
            ),
            None,
        )
        if match is not None and _STRAGGLER_TEXT.search(alert.summary):
            alert = dataclasses.replace(alert, summary=match.summary)
        out.append(alert)
    return out


def headline(findings: Sequence[FindingItem], steps: Mapping[int, Columns]) -> str:
    """One sentence for the run: its first finding (in reading order) and what the job
    loses to it: ``rank 1 on node vm computes 1.70x slower than its peers: the job
    loses ~42% of its throughput; check its node``."""
    if not findings:
        durations = [c["duration_s"] for c in steps.values()]
        if not durations:
            return "no steps recorded yet"
        median = _median(np.concatenate(durations))
        step = f", median step {median * 1e3:.3g} ms" if median is not None else ""
        return f"no problem found: {len(steps)} ranks{step}"
    top = findings[0]
    ended = top.ended_unix_s is not None
    cost = ""
    if top.loss_ratio is not None:
        scope = " over the run" if top.kind == "hang" else (" while it lasted" if ended else "")
        lost = "lost" if ended else "loses"
        cost = f": the job {lost} {loss_text(top.loss_ratio)} of its throughput{scope}"
    action = _ACTIONS.get(top.kind, "")
    if top.kind == "straggler" and top.slowdown_ratio is not None:
        verb, comparative = phase_words(top.phase)
        on = f" on node {top.node}" if top.node else ""
        ratio = slowdown_text(top.slowdown_ratio)
        what = f"rank {top.rank}{on} {verb} {ratio} {comparative}"
        return f"{what}{cost}; {action}"
    if top.kind in CAUSE_KINDS:
        return f"{top.summary.split(': the job loses')[0]}{cost}" + (
            f"; {action}" if action else ""
        )
    gain = top.expected_gain_ratio
    saving = f": fixing it may save {gain:.0%} of the step time" if gain else ""
    return f"{top.summary}{saving}"


def _session(row: Mapping[str, Any]) -> SessionItem:
    blob = row["state_blob"] if isinstance(row["state_blob"], dict) else {}
    return SessionItem(
        id=str(row["id"]),
        state=str(row["state"]),
        trigger=str(row["trigger"]),
        started_unix_s=float(row["started_unix_s"]),
        ended_unix_s=row["ended_unix_s"],
        baseline_score=_finite(row["baseline_score"]),
        best_score=_finite(row["best_score"]),
        best_config_text=config_text(row["best_config"]) if row["best_config"] else "",
        unit=_text(blob.get("unit")),
        summary=_text(blob.get("summary")),
        reason=str(row["reason"] or ""),
    )


def _trial(row: Mapping[str, Any]) -> TrialItem:
    config = row["config"] if isinstance(row["config"], dict) else {}
    cap = config.get("bucket_cap_mb")
    return TrialItem(
        session_id=str(row["session_id"]),
        trial_index=int(row["trial_index"]),
        codec=_text(config.get("codec")),
        bucket_cap_mb=float(cap) if isinstance(cap, (int, float)) else None,
        config_text=config_text(config),
        score=_finite(row["score"]),
        decision=row["decision"],
        reason=str(row["reason"] or ""),
        started_unix_s=row["started_unix_s"],
    )


def config_text(config: Mapping[str, Any]) -> str:
    """``fp16, bucket 25 MB`` or ``powersgd rank 4, bucket 4 MB``: a config for people."""
    words = [_text(config.get("codec")) or "none"]
    params = config.get("codec_params")
    if isinstance(params, dict):
        words += [f"{name} {value:g}" for name, value in sorted(params.items())]
    cap = config.get("bucket_cap_mb")
    text = " ".join(words)
    return f"{text}, bucket {cap:.3g} MB" if isinstance(cap, (int, float)) else text


def _finding_order(f: FindingItem) -> tuple[float, ...]:
    """Open before ended, then most severe, largest expected gain, the report's priority."""
    gain = f.expected_gain_ratio if f.expected_gain_ratio is not None else -1.0
    priority = f.priority if f.priority is not None else 1_000_000
    return (f.ended_unix_s is not None, -_severity_rank(f.severity), -gain, priority)


def _severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity) if severity in SEVERITIES else -1


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _ratio(value: float | None) -> float | None:
    return min(1.0, max(0.0, value)) if value is not None else None


def _text(value: Any) -> str:
    return "" if value is None else str(value)
