"""What ``torshmon report`` reads of one job's history: the statements, built from the models.

``load_job_history`` runs a handful of SELECTs on one connection and returns the rows
as plain dicts keyed by column name; ``torshmon.report`` turns them into a report.
Columns that a newer schema adds (``steps.input_wait_s``) are read when the table
has them, so a report works on a history of any schema version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import quote

from sqlalchemy import MetaData, Table, column, inspect, select
from sqlalchemy.engine import Connection

from torshmon.history.models import Base

_T = Base.metadata.tables

#: Steps read for one report, the newest first: a bound on memory and time for a job
#: that ran for days (about 50 MB of Python objects at this size).
MAX_STEPS: Final = 200_000
#: Node and process samples read for one report, the newest first.
MAX_SAMPLES: Final = 50_000

#: Step columns the report uses; the optional ones are read only where the table has them.
STEP_COLUMNS: Final[tuple[str, ...]] = (
    "rank",
    "node",
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
    "config_version",
)
OPTIONAL_STEP_COLUMNS: Final[tuple[str, ...]] = ("input_wait_s", "eval_s", "between_steps_comm_s")


@dataclass(frozen=True, slots=True)
class JobHistory:
    """One job's rows, each a dict keyed by column name; ``steps`` by column instead
    (column name -> values, newest step first: a job's steps are many, and a list per
    column is several times cheaper to read and to compute on than a dict per row)."""

    job: dict[str, Any]
    sessions: list[dict[str, Any]]
    steps: dict[str, list[Any]]
    steps_truncated: bool
    node_samples: list[dict[str, Any]]
    rank_samples: list[dict[str, Any]]
    alerts: list[dict[str, Any]]
    findings: list[dict[str, Any]]
    configs: list[dict[str, Any]]
    tuning_sessions: list[dict[str, Any]]
    tuning_trials: list[dict[str, Any]]
    evidence: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


def job_names(conn: Connection, limit: int = 1000) -> list[dict[str, Any]]:
    """The jobs of the history, the most recently seen first."""
    jobs = _T["jobs"]
    query = select(jobs).order_by(jobs.c.last_seen_unix_ns.desc()).limit(limit)
    return [dict(r) for r in conn.execute(query).mappings()]


def load_job_history(
    conn: Connection, job: str, *, max_steps: int = MAX_STEPS, max_samples: int = MAX_SAMPLES
) -> JobHistory | None:
    """Everything the report shows of ``job``; None when the history has no such job."""
    jobs = _T["jobs"]
    row = conn.execute(select(jobs).where(jobs.c.job == job)).mappings().first()
    if row is None:
        return None
    sessions = _all(conn, _T["probe_sessions"], job, "rank")
    steps = _steps(conn, job, max_steps + 1)
    read = len(next(iter(steps.values()), []))
    nodes = sorted({s["node"] for s in sessions if s["node"]})
    alerts = _all(conn, _T["alerts"], job, "starts_at_unix_s")
    return JobHistory(
        job=dict(row),
        sessions=sessions,
        steps={name: values[:max_steps] for name, values in steps.items()},
        steps_truncated=read > max_steps,
        node_samples=_node_samples(conn, nodes, row, max_samples),
        rank_samples=_rank_samples(conn, job, max_samples),
        alerts=alerts,
        findings=_all(conn, _T["findings"], job, "detected_unix_s"),
        configs=_all(conn, _T["configs"], job, "version"),
        tuning_sessions=_all(conn, _T["tuning_sessions"], job, "started_unix_s"),
        tuning_trials=_all(conn, _T["tuning_trials"], job, "id"),
        evidence=evidence_links(conn, alerts),
    )


def evidence_links(
    conn: Connection, alerts: Sequence[Mapping[str, Any]]
) -> dict[int, list[dict[str, Any]]]:
    """The evidence files captured for each of ``alerts`` (``alerts`` rows), by
    ``alerts.id``: each a dict with ``name`` (``rank 1 profile.json``) and ``url`` (the
    aggregator's download path, ``/api/v1/evidence/{capture}/{rank}/{name}``).

    A capture belongs to an alert by its ``alert_id``, or, asked for before the alert's
    row was written, by the alert's fingerprint while the episode was open. Files
    that could not be taken (no ``path``) are left out. Empty while the history has no
    evidence tables (a schema before them): they are read by reflection, so this
    module does not depend on their models.
    """
    if not alerts or not inspect(conn).has_table("evidence_captures"):
        return {}
    meta = MetaData()
    captures = Table("evidence_captures", meta, autoload_with=conn)
    files = Table("evidence_files", meta, autoload_with=conn)
    jobs = {a["job"] for a in alerts}
    rows = conn.execute(select(captures).where(captures.c.job.in_(jobs))).mappings().all()
    owner: dict[str, int] = {}
    for capture in rows:
        for alert in alerts:
            end = alert["ends_at_unix_s"]
            during = alert["starts_at_unix_s"] <= capture["created_unix_s"] and (
                end is None or capture["created_unix_s"] <= end
            )
            if capture["alert_id"] == alert["id"] or (
                capture["alert_id"] is None
                and capture["alert_fingerprint"] == alert["fingerprint"]
                and during
            ):
                owner[capture["id"]] = alert["id"]
                break
    links: dict[int, list[dict[str, Any]]] = {}
    if not owner:
        return links
    query = (
        select(files.c.capture_id, files.c.rank, files.c.name)
        .where(files.c.capture_id.in_(list(owner)))
        .where(files.c.path.is_not(None))
        .order_by(files.c.capture_id, files.c.rank, files.c.name)
    )
    for capture_id, rank, name in conn.execute(query):
        links.setdefault(owner[capture_id], []).append(
            {
                "name": f"rank {rank} {name}",
                "url": f"/api/v1/evidence/{quote(capture_id, safe='')}/{rank}/"
                f"{quote(name, safe='')}",
            }
        )
    return links


def _all(conn: Connection, table: Table, job: str, order: str) -> list[dict[str, Any]]:
    query = select(table).where(table.c.job == job).order_by(table.c[order])
    return [dict(r) for r in conn.execute(query).mappings()]


def _steps(conn: Connection, job: str, limit: int) -> dict[str, list[Any]]:
    steps = _T["steps"]
    present = {c["name"] for c in inspect(conn).get_columns("steps")}
    names = [*STEP_COLUMNS, *(c for c in OPTIONAL_STEP_COLUMNS if c in present)]
    # The model may not know an optional column yet: name it as the table has it.
    columns = [steps.c[n] if n in steps.c else column(n) for n in names]
    query = (
        select(*columns)
        .select_from(steps)
        .where(steps.c.job == job)
        .order_by(steps.c.end_unix_ns.desc())
        .limit(limit)
    )
    rows = conn.execute(query).all()
    return {name: [row[i] for row in rows] for i, name in enumerate(names)}


def _node_samples(
    conn: Connection, nodes: Sequence[str], job: Any, limit: int
) -> list[dict[str, Any]]:
    samples = _T["node_samples"]
    query = (
        select(
            samples.c.node,
            samples.c.ts_unix_ns,
            samples.c.memory_utilization_ratio,
            samples.c.memory_used_bytes,
            samples.c.cpu_utilization_ratio,
            samples.c.io_wait_ratio,
        )
        .where(samples.c.node.in_(nodes))
        .where(samples.c.ts_unix_ns.between(job["first_seen_unix_ns"], job["last_seen_unix_ns"]))
        .order_by(samples.c.ts_unix_ns.desc())
        .limit(limit)
    )
    return [dict(r) for r in conn.execute(query).mappings()]


def _rank_samples(conn: Connection, job: str, limit: int) -> list[dict[str, Any]]:
    samples = _T["rank_samples"]
    query = (
        select(samples.c.rank, samples.c.ts_unix_ns, samples.c.rss_bytes)
        .where(samples.c.job == job)
        .order_by(samples.c.ts_unix_ns.desc())
        .limit(limit)
    )
    return [dict(r) for r in conn.execute(query).mappings()]
