"""``run_id`` on the rest of a launch's rows: configs, commands, tuning_sessions,
tuning_trials and evidence_captures. A relaunch under the same job name numbers its
config versions from 1 again, so configs are now keyed (job, run_id, version): until
now the second launch's versions replaced the first's, and each run's report showed
the latest launch's configs.

It also sets the comments of three alerts columns (annotations, value, updated_unix_s)
that the models changed without a revision, on PostgreSQL.

Existing rows get their run by time, as 0017 did: a job's run whose start is the
latest at or before the row's time (the first run also takes anything before its
start); a row of a job without runs keeps NULL (configs: empty, part of their key).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_CONFIG_COMMENT: Final = (
    "The run (launch) that applied it (runs.run_id); empty where its probe sent no run id."
)
_JOB_COMMENT: Final = (
    "The run (launch) of the job the row was made in (runs.run_id): the job's latest "
    "then, a tuning session's and its trials' the run it started in; NULL where none."
)
_CONFIGS_BEFORE: Final = "Communication configs all ranks of a job applied."
_CONFIGS_AFTER: Final = (
    "Communication configs all ranks of a job applied: each run (launch) numbers its "
    "versions from 1."
)
#: Comments of alerts' columns that changed with what an open alert's row holds (its
#: text and value follow the figures while it is open): (column, type, nullable,
#: before, after).
_ALERT_COMMENTS: Final = (
    (
        "annotations",
        sa.JSON(),
        False,
        "summary, description, recommendation, JSON object.",
        "summary, description, recommendation (JSON); follow its figures while open.",
    ),
    (
        "value",
        sa.Float(),
        True,
        "Value that triggered the rule.",
        "Rule's value, latest while open.",
    ),
    (
        "updated_unix_s",
        sa.Float(),
        False,
        "Latest state change, Unix time in seconds.",
        "Latest state change or rewrite of its text, Unix time in seconds.",
    ),
)
#: Each table and the column that dates its rows; the factor makes it nanoseconds.
_TABLES: Final[dict[str, tuple[str, float]]] = {
    "configs": ("applied_unix_ns", 1),
    "commands": ("created_unix_s", 1e-9),
    "tuning_sessions": ("started_unix_s", 1e-9),
    "tuning_trials": ("started_unix_s", 1e-9),
    "evidence_captures": ("created_unix_s", 1e-9),
}


def upgrade() -> None:
    with op.batch_alter_table("configs") as batch:
        batch.add_column(
            sa.Column(
                "run_id",
                sa.String(64),
                nullable=False,
                server_default="",
                comment=_CONFIG_COMMENT,
            )
        )
        batch.drop_constraint("pk_configs", type_="primary")
        batch.create_primary_key("pk_configs", ["job", "run_id", "version"])
    for table in _TABLES:
        if table != "configs":
            with op.batch_alter_table(table) as batch:
                batch.add_column(
                    sa.Column("run_id", sa.String(64), nullable=True, comment=_JOB_COMMENT)
                )
    _backfill(op.get_bind())
    _comments(after=True)


def _comments(*, after: bool) -> None:
    """The table and column comments this revision changes, to its own or back."""
    # SQLite keeps no comments: nothing to change there.
    if op.get_bind().dialect.name != "postgresql":
        return
    new, old = (_CONFIGS_AFTER, _CONFIGS_BEFORE) if after else (_CONFIGS_BEFORE, _CONFIGS_AFTER)
    op.create_table_comment("configs", new, existing_comment=old)
    for column, type_, nullable, before, now in _ALERT_COMMENTS:
        op.alter_column(
            "alerts",
            column,
            comment=now if after else before,
            existing_comment=before if after else now,
            existing_type=type_,
            existing_nullable=nullable,
        )


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
    _comments(after=False)
    for table in _TABLES:
        if table != "configs":
            # Not a batch: SQLite would copy tuning_sessions, which tuning_trials refers to
            # (its ALTER TABLE DROP COLUMN, 3.35 on, drops an unindexed column in place).
            op.drop_column(table, "run_id")
    # Each job's versions of its latest run stay: the key (job, version) holds one.
    conn = op.get_bind()
    configs = sa.Table("configs", sa.MetaData(), autoload_with=conn)
    _drop_older_versions(conn, configs)
    with op.batch_alter_table("configs") as batch:
        batch.drop_constraint("pk_configs", type_="primary")
        batch.create_primary_key("pk_configs", ["job", "version"])
        batch.drop_column("run_id")


def _drop_older_versions(conn: sa.Connection, configs: sa.Table) -> None:
    """Of the rows that share (job, version), all but the latest applied."""
    rows = conn.execute(
        sa.select(configs.c.job, configs.c.version, configs.c.run_id, configs.c.applied_unix_ns)
    ).all()
    kept: dict[tuple[str, int], tuple[int, str]] = {}
    for job, version, run_id, applied in rows:
        key = (job, int(version))
        if key not in kept or (int(applied), run_id) > kept[key]:
            kept[key] = (int(applied), run_id)
    for job, version, run_id, applied in rows:
        if kept[(job, int(version))] != (int(applied), run_id):
            conn.execute(
                configs.delete().where(
                    configs.c.job == job,
                    configs.c.version == version,
                    configs.c.run_id == run_id,
                )
            )
