"""A job's report as data: the records ``build_report`` fills and the pages render.

The same ``JobReport`` is rendered for the terminal (``torshmon.report.text``) and as
a page (``torshmon.report.page``), and travels as JSON from an aggregator to
``torshmon report --aggregator`` (``to_json``/``from_json``). ``torshmon.report.build``
makes one from a job's history rows. Times are Unix seconds, durations seconds,
memory bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from torshmon.aggregator.core.findings import SEVERITIES

#: Each span's largest value and the step it was at (None, 0 for a span with no value).
Peaks = tuple[tuple[float | None, int], ...]
#: A job silent for longer than this has ended: while a rank's process lives its probe
#: sends a batch at least every second (a heartbeat, in a hang too) and its agent
#: forwards it within a second, retrying an aggregator out of reach for up to 10 s.
ENDED_AFTER_S: Final = 15.0
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
    """One rank over time (``series.MAX_POINTS`` at most): each point the median of its
    span. Where a point spans several steps, ``duration_peak`` and ``compute_peak`` keep
    each span's longest step (its time and step number), so a one-step hang in a long
    run still shows; empty where each point is one step."""

    rank: int
    time_unix_s: tuple[float, ...]
    step: tuple[int, ...]
    duration_s: tuple[float | None, ...]
    compute_s: tuple[float | None, ...]
    comm_ratio: tuple[float | None, ...]
    duration_peak: Peaks = ()
    compute_peak: Peaks = ()


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
                severity=max((a.severity for a in episodes), key=severity_rank),
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
    """A config version the job applied (``configs``) and who asked for it
    (``requested_by``): ``autotuner trial 2``, ``the autotuner`` (its closing or restoring
    config), ``you, via the API`` (a config command) or ``you, in the training script``
    (``request_config``); empty where the history cannot tell."""

    version: int
    effective_step: int
    applied_unix_s: float
    config_text: str
    requested_by: str = ""


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


def config_text(config: Mapping[str, Any]) -> str:
    """``fp16, bucket 25 MB`` or ``powersgd rank 4, bucket 4 MB``: a config for people."""
    words = [as_text(config.get("codec")) or "none"]
    params = config.get("codec_params")
    if isinstance(params, dict):
        words += [f"{name} {value:g}" for name, value in sorted(params.items())]
    cap = config.get("bucket_cap_mb")
    text = " ".join(words)
    return f"{text}, bucket {cap:.3g} MB" if isinstance(cap, (int, float)) else text


def severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity) if severity in SEVERITIES else -1


def finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite number, else None."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def as_text(value: Any) -> str:
    """``value`` as a string, None as the empty one."""
    return "" if value is None else str(value)
