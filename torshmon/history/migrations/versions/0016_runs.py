"""``runs``: each launch of a job, and ``probe_sessions.run_id`` / ``attached_unix_ns``,
so two launches under one job name are kept apart (their steps, alerts and findings
no longer merged into one).

A history from before runs gets its runs from its steps: a job's first run starts at
its first data, and a new run wherever the step numbers of its lowest rank start over
(``legacy-1``, ``legacy-2``, ...); each probe session joins the run under way when it
was first stored.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    runs = op.create_table(
        "runs",
        sa.Column("job", sa.String(200), nullable=False, comment="Job name."),
        sa.Column(
            "run_id",
            sa.String(64),
            nullable=False,
            comment="The launch's id, the same on every rank (torchrun's run id, "
            "$TORSHMON_RUN_ID, or one made at attach; 'legacy-N' for runs found by migration).",
        ),
        sa.Column(
            "started_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="When its first rank attached (the probe's clock), Unix time in nanoseconds.",
        ),
        sa.Column("world_size", sa.Integer(), nullable=True, comment="Number of ranks."),
        sa.PrimaryKeyConstraint("job", "run_id", name=op.f("pk_runs")),
        comment="One row per launch of a job: the rows of the job from its start to the next "
        "run's start belong to it (steps, collectives, alerts, findings, samples).",
    )
    with op.batch_alter_table("probe_sessions") as batch:
        batch.add_column(
            sa.Column(
                "run_id",
                sa.String(64),
                nullable=True,
                comment="The run (launch) of the job this process belongs to; NULL from "
                "probes before runs.",
            )
        )
        batch.add_column(
            sa.Column(
                "attached_unix_ns",
                sa.BigInteger(),
                nullable=True,
                comment="When the probe attached (its clock), Unix time in nanoseconds; "
                "NULL from probes before runs.",
            )
        )
    _backfill(op.get_bind(), runs)


def _backfill(conn: sa.Connection, runs: sa.Table) -> None:
    meta = sa.MetaData()
    jobs = sa.Table("jobs", meta, autoload_with=conn)
    steps = sa.Table("steps", meta, autoload_with=conn)
    sessions = sa.Table("probe_sessions", meta, autoload_with=conn)
    rows: list[dict[str, Any]] = []
    for job, first_seen, world_size in conn.execute(
        sa.select(jobs.c.job, jobs.c.first_seen_unix_ns, jobs.c.world_size)
    ):
        starts = _run_starts(conn, steps, job, int(first_seen))
        for n, start in enumerate(starts, 1):
            rows.append(
                {
                    "job": job,
                    "run_id": f"legacy-{n}",
                    "started_unix_ns": start,
                    "world_size": world_size,
                }
            )
        for n in range(len(starts), 0, -1):
            # From the newest run back: a session joins the run under way at its start.
            conn.execute(
                sessions.update()
                .where(sessions.c.job == job, sessions.c.run_id.is_(None))
                .where(sessions.c.started_unix_ns >= (starts[n - 1] if n > 1 else -(2**62)))
                .values(run_id=f"legacy-{n}")
            )
    if rows:
        conn.execute(runs.insert(), rows)


def _run_starts(conn: sa.Connection, steps: sa.Table, job: str, first_seen: int) -> list[int]:
    """Where each run of ``job`` starts: its first data, then each step of its lowest
    rank whose number is not above the one before (the job started over)."""
    lowest = conn.execute(sa.select(sa.func.min(steps.c.rank)).where(steps.c.job == job)).scalar()
    if lowest is None:
        return [first_seen]
    query = (
        sa.select(steps.c.step, steps.c.end_unix_ns, steps.c.duration_s)
        .where(steps.c.job == job, steps.c.rank == lowest)
        .order_by(steps.c.end_unix_ns, steps.c.id)
    )
    starts: list[int] = []
    previous: int | None = None
    for step, end_ns, duration_s in conn.execute(query):
        begin = int(end_ns) - int((duration_s or 0.0) * 1e9) - 1
        if previous is None:
            starts.append(min(first_seen, begin))
        elif step <= previous:
            starts.append(begin)
        previous = int(step)
    return starts


def downgrade() -> None:
    with op.batch_alter_table("probe_sessions") as batch:
        batch.drop_column("attached_unix_ns")
        batch.drop_column("run_id")
    op.drop_table("runs")
