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
    #: The run shown (a ``runs`` row), None for a history that has no runs of the job.
    run: dict[str, Any] | None = None
    #: All the job's runs, the oldest first, each a ``runs`` row with ``ended_unix_ns``
    #: (the next run's start; None for the latest).
    runs: list[dict[str, Any]] = field(default_factory=list)
    #: The commands sent to the job (``commands`` rows, the oldest first): which config
    #: version the API or the autotuner asked for.
    commands: list[dict[str, Any]] = field(default_factory=list)


class UnknownRun(LookupError):
    """The run asked for is not one of the job's; the text names those it has."""


#: Bounds of all time: a job without runs is read whole.
_NO_BOUNDS: Final = (-(2**62), 2**62)


def job_runs(conn: Connection, job: str) -> list[dict[str, Any]]:
    """``job``'s runs, the oldest first, each with ``ended_unix_ns``: the next run's
    start (a run's rows are those from its start to the next's), None for the latest.
    Empty where the history has no runs (a schema before them, or probes before them)."""
    if not inspect(conn).has_table("runs"):
        return []
    runs = _T["runs"]
    query = select(runs).where(runs.c.job == job).order_by(runs.c.started_unix_ns, runs.c.run_id)
    rows = [dict(r) for r in conn.execute(query).mappings()]
    for i, row in enumerate(rows):
        row["ended_unix_ns"] = rows[i + 1]["started_unix_ns"] if i + 1 < len(rows) else None
    return rows


def pick_run(runs: Sequence[Mapping[str, Any]], run: str | None) -> Mapping[str, Any] | None:
    """The run ``run`` names (its id, or ``-1`` for the latest, ``1`` for the first), the
    latest when None; None when there are no runs; UnknownRun for a run not among them."""
    if not runs:
        if run is None:
            return None
        raise UnknownRun(f"the history has no runs of this job, so no run {run!r}")
    if run is None:
        return runs[-1]
    for row in runs:
        if row["run_id"] == run:
            return row
    if run.lstrip("-").isdigit() and 1 <= abs(int(run)) <= len(runs) and int(run) != 0:
        n = int(run)
        return runs[n - 1] if n > 0 else runs[n]
    names = ", ".join(r["run_id"] for r in runs)
    raise UnknownRun(f"no run {run!r}; the job's runs, oldest first: {names}")


def job_names(conn: Connection, limit: int = 1000) -> list[dict[str, Any]]:
    """The jobs of the history, the most recently seen first."""
    jobs = _T["jobs"]
    query = select(jobs).order_by(jobs.c.last_seen_unix_ns.desc()).limit(limit)
    return [dict(r) for r in conn.execute(query).mappings()]


def load_job_history(
    conn: Connection,
    job: str,
    *,
    run: str | None = None,
    max_steps: int = MAX_STEPS,
    max_samples: int = MAX_SAMPLES,
) -> JobHistory | None:
    """Everything the report shows of one run of ``job`` (``run``: its id, the latest
    when None; see ``pick_run``); None when the history has no such job, UnknownRun
    when it has no such run. A job without runs in the history is read whole.

    Steps, alerts, findings, configs, commands and tuning sessions are the run's by
    their ``run_id`` (two launches that ran at once keep theirs apart, and a relaunch's
    config versions, which start at 1 again, are its own); samples, and the rows
    without a run id (a schema before it, rows stored before it), by the run's time,
    from its start to the next's."""
    jobs = _T["jobs"]
    row = conn.execute(select(jobs).where(jobs.c.job == job)).mappings().first()
    if row is None:
        return None
    runs = job_runs(conn, job)
    chosen = pick_run(runs, run)
    job_row = dict(row)
    bounds = _NO_BOUNDS
    sessions = _all(conn, _T["probe_sessions"], job, "rank")
    if chosen is not None:
        end = chosen["ended_unix_ns"]
        bounds = (chosen["started_unix_ns"], _NO_BOUNDS[1] if end is None else end)
        sessions = [s for s in sessions if s.get("run_id") == chosen["run_id"]]
        job_row["world_size"] = chosen["world_size"] or job_row["world_size"]
        job_row["first_seen_unix_ns"] = chosen["started_unix_ns"]
        if sessions:
            job_row["last_seen_unix_ns"] = max(s["last_seen_unix_ns"] for s in sessions)
        elif end is not None:
            job_row["last_seen_unix_ns"] = min(job_row["last_seen_unix_ns"], end)
    run_id = _run_id(conn, chosen)
    steps = _steps(conn, job, max_steps + 1, bounds, run_id)
    read = len(next(iter(steps.values()), []))
    nodes = sorted({s["node"] for s in sessions if s["node"]})
    seconds = (bounds[0] / 1e9, bounds[1] / 1e9)
    alerts = _all(conn, _T["alerts"], job, "starts_at_unix_s", seconds, run_id)
    made_in = None if chosen is None else str(chosen["run_id"])
    tuning = _run_rows(conn, "tuning_sessions", job, "started_unix_s", made_in, seconds)
    tuned = {t["id"] for t in tuning}
    return JobHistory(
        job=job_row,
        sessions=sessions,
        steps={name: values[:max_steps] for name, values in steps.items()},
        steps_truncated=read > max_steps,
        node_samples=_node_samples(conn, nodes, job_row, max_samples),
        rank_samples=_rank_samples(conn, job, max_samples, bounds),
        alerts=alerts,
        findings=_all(conn, _T["findings"], job, "detected_unix_s", seconds, run_id),
        configs=_run_rows(conn, "configs", job, "applied_unix_ns", made_in, bounds, "version"),
        tuning_sessions=tuning,
        tuning_trials=[
            t for t in _all(conn, _T["tuning_trials"], job, "id") if t["session_id"] in tuned
        ],
        evidence=evidence_links(conn, alerts),
        run=None if chosen is None else dict(chosen),
        runs=runs,
        commands=_run_rows(conn, "commands", job, "created_unix_s", made_in, seconds),
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


def _run_id(conn: Connection, chosen: Mapping[str, Any] | None) -> str | None:
    """The id the rows of ``chosen`` carry; None to read by time instead (no run
    chosen, or a schema before ``run_id``)."""
    if chosen is None:
        return None
    present = {c["name"] for c in inspect(conn).get_columns("steps")}
    return str(chosen["run_id"]) if "run_id" in present else None


def _all(
    conn: Connection,
    table: Table,
    job: str,
    order: str,
    bounds: tuple[float, float] | None = None,
    run_id: str | None = None,
) -> list[dict[str, Any]]:
    """``job``'s rows of ``table`` by ``order``: those of run ``run_id``, else with
    ``bounds`` those whose ``order`` is in [start, end)."""
    query = select(table).where(table.c.job == job).order_by(table.c[order])
    if run_id is not None:
        query = query.where(table.c.run_id == run_id)
    elif bounds is not None:
        query = query.where(table.c[order] >= bounds[0], table.c[order] < bounds[1])
    return [dict(r) for r in conn.execute(query).mappings()]


def _run_rows(
    conn: Connection,
    name: str,
    job: str,
    when: str,
    run_id: str | None,
    bounds: tuple[float, float],
    order: str | None = None,
) -> list[dict[str, Any]]:
    """``job``'s rows of table ``name`` by ``order`` (default ``when``): those of run
    ``run_id`` and those of no run (NULL or empty ``run_id``, or a schema before it)
    whose ``when`` is in [start, end) of ``bounds``; all of them where ``run_id`` is
    None (a job without runs). The columns are those the table has."""
    table = _T[name]
    present = {c["name"] for c in inspect(conn).get_columns(name)}
    query = select(*(c for c in table.c if c.name in present)).where(table.c.job == job)
    if run_id is not None:
        in_time = (table.c[when] >= bounds[0]) & (table.c[when] < bounds[1])
        if "run_id" in present:
            unrun = table.c.run_id.is_(None) | (table.c.run_id == "")
            query = query.where((table.c.run_id == run_id) | (unrun & in_time))
        else:
            query = query.where(in_time)
    query = query.order_by(table.c[order or when])
    return [dict(r) for r in conn.execute(query).mappings()]


def _steps(
    conn: Connection,
    job: str,
    limit: int,
    bounds: tuple[int, int] = _NO_BOUNDS,
    run_id: str | None = None,
) -> dict[str, list[Any]]:
    steps = _T["steps"]
    present = {c["name"] for c in inspect(conn).get_columns("steps")}
    names = [*STEP_COLUMNS, *(c for c in OPTIONAL_STEP_COLUMNS if c in present)]
    # The model may not know an optional column yet: name it as the table has it.
    columns = [steps.c[n] if n in steps.c else column(n) for n in names]
    query = select(*columns).select_from(steps).where(steps.c.job == job)
    if run_id is not None:
        query = query.where(steps.c.run_id == run_id)
    else:
        query = query.where(steps.c.end_unix_ns >= bounds[0], steps.c.end_unix_ns < bounds[1])
    rows = conn.execute(query.order_by(steps.c.end_unix_ns.desc()).limit(limit)).all()
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


def _rank_samples(
    conn: Connection, job: str, limit: int, bounds: tuple[int, int] = _NO_BOUNDS
) -> list[dict[str, Any]]:
    samples = _T["rank_samples"]
    query = (
        select(samples.c.rank, samples.c.ts_unix_ns, samples.c.rss_bytes)
        .where(samples.c.job == job)
        .where(samples.c.ts_unix_ns >= bounds[0], samples.c.ts_unix_ns < bounds[1])
        .order_by(samples.c.ts_unix_ns.desc())
        .limit(limit)
    )
    return [dict(r) for r in conn.execute(query).mappings()]
