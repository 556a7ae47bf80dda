"""Evidence captured on alert: evidence_captures and evidence_files.

Revision ID: 0006
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "evidence_captures",
        sa.Column(
            "id",
            sa.String(length=64),
            nullable=False,
            comment="Capture id (the evidence command's id).",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column(
            "alert_id",
            sa.BigInteger(),
            nullable=True,
            comment="The alert episode that asked for it (alerts.id), if one.",
        ),
        sa.Column(
            "alert_fingerprint",
            sa.String(length=16),
            nullable=True,
            comment="That alert's fingerprint (16 hex digits).",
        ),
        sa.Column(
            "rule",
            sa.String(length=200),
            nullable=False,
            comment="The rule whose alert asked for it; empty when asked by hand.",
        ),
        sa.Column(
            "profile_ranks",
            sa.JSON(),
            nullable=False,
            comment="Ranks asked for a profiler trace, JSON array.",
        ),
        sa.Column(
            "created_unix_s",
            sa.Float(),
            nullable=False,
            comment="When it was asked for, Unix time in seconds.",
        ),
        sa.Column(
            "aggregator_id",
            sa.String(length=128),
            nullable=True,
            comment="The aggregator shard that asked for it.",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evidence_captures")),
        comment="Evidence captures (Flight Recorder dumps, profiler traces) asked of a job.",
    )
    op.create_index(op.f("ix_evidence_captures_job"), "evidence_captures", ["job"], unique=False)
    op.create_index(
        op.f("ix_evidence_captures_alert_id"), "evidence_captures", ["alert_id"], unique=False
    )
    op.create_table(
        "evidence_files",
        sa.Column(
            "capture_id",
            sa.String(length=64),
            nullable=False,
            comment="The capture (evidence_captures.id).",
        ),
        sa.Column(
            "rank",
            sa.Integer(),
            autoincrement=False,
            nullable=False,
            comment="Global rank that took it.",
        ),
        sa.Column(
            "name",
            sa.String(length=64),
            nullable=False,
            comment="flight_recorder.json or profiler_trace.json.",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column(
            "size_bytes",
            sa.BigInteger(),
            nullable=False,
            comment="Size of the file uncompressed; 0 when missing.",
        ),
        sa.Column(
            "stored_bytes",
            sa.BigInteger(),
            nullable=False,
            comment="Size on disk (gzip); 0 when missing.",
        ),
        sa.Column(
            "path",
            sa.String(length=300),
            nullable=True,
            comment="Where it is, under the evidence folder; NULL when missing.",
        ),
        sa.Column(
            "error",
            sa.Text(),
            nullable=False,
            comment="Why it is missing (not taken, over a cap); empty otherwise.",
        ),
        sa.Column(
            "taken_unix_s",
            sa.Float(),
            nullable=False,
            comment="When the rank took it, Unix time in seconds.",
        ),
        sa.Column(
            "received_unix_s",
            sa.Float(),
            nullable=False,
            comment="When the aggregator stored it, Unix time in seconds.",
        ),
        sa.ForeignKeyConstraint(
            ["capture_id"],
            ["evidence_captures.id"],
            name=op.f("fk_evidence_files_capture_id_evidence_captures"),
        ),
        sa.PrimaryKeyConstraint("capture_id", "rank", "name", name=op.f("pk_evidence_files")),
        comment="Files of evidence captures, one per rank and kind, or why missing.",
    )


def downgrade() -> None:
    op.drop_table("evidence_files")
    op.drop_index(op.f("ix_evidence_captures_alert_id"), table_name="evidence_captures")
    op.drop_index(op.f("ix_evidence_captures_job"), table_name="evidence_captures")
    op.drop_table("evidence_captures")
