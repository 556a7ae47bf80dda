"""``build_report``: a job's history rows (``torshmon.history.store.report``) and the
report time in, a ``JobReport`` out (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from torshmon.history.store.report import JobHistory
from torshmon.report.findings import (
    alerts_of_findings,
    computed_bottlenecks,
    headline,
    linked,
    reading_order,
    stored_findings,
)
from torshmon.report.model import (
    AlertItem,
    ConfigChange,
    EvidenceLink,
    JobReport,
    RunItem,
    SessionItem,
    TrialItem,
    as_text,
    closed_of,
    config_text,
    finite,
    is_running,
)
from torshmon.report.series import (
    memory_series,
    rank_series,
    rank_stats,
    step_phases,
    steps_by_rank,
)
from torshmon.report.what_if import with_what_ifs


def build_report(history: JobHistory, now_unix_s: float) -> JobReport:
    """The report of ``history`` as of ``now_unix_s``."""
    job = history.job
    steps = steps_by_rank(history.steps)
    nodes = dict(zip(history.steps.get("rank", []), history.steps.get("node", []), strict=True))
    nodes.update({s["rank"]: s["node"] for s in history.sessions if s["node"]})
    last_seen = job["last_seen_unix_ns"] / 1e9
    findings = stored_findings(history.findings)
    if not any(f.kind == "bottleneck" for f in findings):
        findings += computed_bottlenecks(job["job"], history, now_unix_s)
    findings = with_what_ifs(job["job"], findings, steps, nodes, last_seen)
    findings = reading_order(linked(findings))
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
        ranks=tuple(rank_stats(r, cols, nodes.get(r, "")) for r, cols in steps.items()),
        phases=tuple(step_phases(r, cols) for r, cols in steps.items()),
        series=tuple(rank_series(r, cols) for r, cols in steps.items()),
        memory=memory_series(history),
        alerts=tuple(alerts_of_findings(alerts, findings, last_seen)),
        findings=tuple(findings),
        sessions=tuple(_session(s) for s in history.tuning_sessions),
        trials=tuple(_trial(t) for t in history.tuning_trials),
        headline=headline(findings, steps),
        run_id="" if history.run is None else history.run["run_id"],
        runs=tuple(_run_item(r) for r in history.runs),
        configs=tuple(_config_change(c, history) for c in history.configs),
    )


def _config_change(row: Mapping[str, Any], history: JobHistory) -> ConfigChange:
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
        requested_by=_requested_by(row, history),
    )


#: A command the tuner sends after its last trial (the best config, or a restore) comes
#: as its session ends, within this long (the session's row is written after it).
_SESSION_TAIL_S: Final = 10.0


def _requested_by(row: Mapping[str, Any], history: JobHistory) -> str:
    """Who asked for config ``row`` (see ``ConfigChange.requested_by``): the config
    command that became its version, the tuning trial that sent it or the session it
    came in; no command: the training script's own ``request_config``."""
    if not row["version"]:
        return ""  # the config the job started with
    applied_s = row["applied_unix_ns"] / 1e9
    command = next(
        (
            c
            for c in reversed(history.commands)
            if c["kind"] == "config"
            and c["version"] == row["version"]
            and c["created_unix_s"] <= applied_s
        ),
        None,
    )
    trials = history.tuning_trials
    if command is None:  # a history from before commands were kept: the trial's start
        trial = next(
            (
                t
                for t in trials
                if t["started_unix_s"] is not None and abs(t["started_unix_s"] - applied_s) < 5
            ),
            None,
        )
        return "you, in the training script" if trial is None else _trial_words(trial)
    trial = next((t for t in trials if t["command_id"] == command["id"]), None)
    if trial is not None:
        return _trial_words(trial)
    sent_s = command["created_unix_s"]
    if any(
        s["started_unix_s"] <= sent_s <= (s["ended_unix_s"] or math.inf) + _SESSION_TAIL_S
        for s in history.tuning_sessions
    ):
        return "the autotuner"
    return "you, via the API"


def _trial_words(trial: Mapping[str, Any]) -> str:
    return f"autotuner trial {trial['trial_index']}"


def _run_item(row: Mapping[str, Any]) -> RunItem:
    end = row["ended_unix_ns"]
    return RunItem(
        run_id=row["run_id"],
        started_unix_s=row["started_unix_ns"] / 1e9,
        ended_unix_s=None if end is None else end / 1e9,
        world_size=row["world_size"],
    )


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
        value=finite(row["value"]),
        starts_at_unix_s=float(row["starts_at_unix_s"]),
        fired_at_unix_s=row["fired_at_unix_s"],
        ends_at_unix_s=row["ends_at_unix_s"],
        evidence=tuple(EvidenceLink(str(e["name"]), str(e["url"])) for e in evidence),
    )


def _session(row: Mapping[str, Any]) -> SessionItem:
    blob = row["state_blob"] if isinstance(row["state_blob"], dict) else {}
    return SessionItem(
        id=str(row["id"]),
        state=str(row["state"]),
        trigger=str(row["trigger"]),
        started_unix_s=float(row["started_unix_s"]),
        ended_unix_s=row["ended_unix_s"],
        baseline_score=finite(row["baseline_score"]),
        best_score=finite(row["best_score"]),
        best_config_text=config_text(row["best_config"]) if row["best_config"] else "",
        unit=as_text(blob.get("unit")),
        summary=as_text(blob.get("summary")),
        reason=str(row["reason"] or ""),
    )


def _trial(row: Mapping[str, Any]) -> TrialItem:
    config = row["config"] if isinstance(row["config"], dict) else {}
    cap = config.get("bucket_cap_mb")
    return TrialItem(
        session_id=str(row["session_id"]),
        trial_index=int(row["trial_index"]),
        codec=as_text(config.get("codec")),
        bucket_cap_mb=float(cap) if isinstance(cap, (int, float)) else None,
        config_text=config_text(config),
        score=finite(row["score"]),
        decision=row["decision"],
        reason=str(row["reason"] or ""),
        started_unix_s=row["started_unix_s"],
    )
