"""``run_id`` on the rows that belong to one launch (steps, collectives, buckets,
ddp_stats, inflight_reports, alerts, findings), so two launches of one job that run
at the same time keep their rows apart; until now a run's rows were those between
its start and the next run's, and overlapping launches mixed.

Existing rows get their run by that same time split: a job's run whose start is the
latest at or before the row's time (the first run also takes anything before its
start); a row of a job without runs keeps NULL.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COMMENT: Final = (
    "The run (launch) of the job the row belongs to (runs.run_id); NULL where its probe "
    "sent no run id."
)
#: Each table and the column that dates its rows; the factor makes it nanoseconds.
_TABLES: Final[dict[str, tuple[str, float]]] = {
    "steps": ("end_unix_ns", 1),
    "collectives": ("end_unix_ns", 1),
    "buckets": ("end_unix_ns", 1),
    "ddp_stats": ("end_unix_ns", 1),
    "inflight_reports": ("sent_unix_ns", 1),
    "alerts": ("starts_at_unix_s", 1e-9),
    "findings": ("detected_unix_s", 1e-9),
}
_RUNS_BEFORE: Final = (
    "One row per launch of a job: the rows of the job from its start to the next "
    "run's start belong to it (steps, collectives, alerts, findings, samples)."
)
_RUNS_AFTER: Final = (
    "One row per launch of a job: the rows that carry its run_id belong to it (steps, "
    "collectives, alerts, findings, ...), and the job's samples from its start to the "
    "next run's start."
)
#: Indexes for the per-run reads (the report, the pages): (table, columns).
_INDEXES: Final = (
    ("steps", ("job", "run_id", "end_unix_ns")),
    ("alerts", ("job", "run_id")),
    ("findings", ("job", "run_id")),
)


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("run_id", sa.String(64), nullable=True, comment=_COMMENT))
    _backfill(op.get_bind())
    for table, columns in _INDEXES:
        op.create_index(op.f(f"ix_{table}_{'_'.join(columns)}"), table, list(columns))
    _runs_comment(_RUNS_AFTER, _RUNS_BEFORE)


def _runs_comment(comment: str, before: str) -> None:
    # SQLite keeps no table comments: nothing to change there.
    if op.get_bind().dialect.name == "postgresql":
        op.create_table_comment("runs", comment, existing_comment=before)


def _backfill(conn: sa.Connection) -> None:
    """Each run's rows: from its start (the first run: from any time) to the next's."""
    meta = sa.MetaData()
    runs = sa.Table("runs", meta, autoload_with=conn)
    tables = {name: sa.Table(name, meta, autoload_with=conn) for name in _TABLES}
    by_job: dict[str, list[tuple[str, int]]] = {}
    query = sa.select(runs.c.job, runs.c.run_id, runs.c.started_unix_ns).order_by(
        runs.c.job, runs.c.started_unix_ns, runs.c.run_id
    )
    for job, run_id, started in conn.execute(query):
        by_job.setdefault(job, []).append((run_id, int(started)))
    for job, job_runs in by_job.items():
        for i, (run_id, started) in enumerate(job_runs):
            start = None if i == 0 else started
            end = job_runs[i + 1][1] if i + 1 < len(job_runs) else None
            for name, (time_column, scale) in _TABLES.items():
                table = tables[name]
                when = table.c[time_column]
                update = table.update().where(table.c.job == job).values(run_id=run_id)
                if start is not None:
                    update = update.where(when >= start * scale)
                if end is not None:
                    update = update.where(when < end * scale)
                conn.execute(update)


def downgrade() -> None:
    _runs_comment(_RUNS_BEFORE, _RUNS_AFTER)
    for table, columns in _INDEXES:
        op.drop_index(op.f(f"ix_{table}_{'_'.join(columns)}"), table_name=table)
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("run_id")
