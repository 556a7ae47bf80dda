"""Findings as episodes with a report's ranking, and each step's input wait.

``findings`` rows are opened, updated and closed (``updated_unix_s``,
``ended_unix_s``) instead of written once, and carry the bottleneck report's
``category``, ``priority``, ``expected_gain_ratio`` and ``difficulty``;
``steps.input_wait_s`` is the data-loading time before a step.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FINDINGS_BEFORE = (
    "Detector conclusions (anomaly, straggler, hang, bottleneck) when first detected."
)
_FINDINGS_AFTER = (
    "Detector conclusions (anomaly, straggler, hang, bottleneck, slow_link), one row per "
    "episode: opened when first detected, updated while it holds, closed (ended_unix_s) "
    "when it no longer does."
)
_METRIC_BEFORE = "Metric, for anomalies."
_METRIC_AFTER = "Metric, for anomalies and bottlenecks."
_KIND_BEFORE = "anomaly, straggler, hang or bottleneck."
_KIND_AFTER = "anomaly, straggler, hang, bottleneck or slow_link."
_DETECTED_BEFORE = "When it was detected, Unix time in seconds."
_DETECTED_AFTER = "When it was detected (the row opened), Unix time in seconds."


def _finding_columns() -> tuple[sa.Column[object], ...]:
    """Fresh columns each call: a Column belongs to one table once added."""
    return (
        sa.Column(
            "category",
            sa.String(length=32),
            nullable=True,
            comment="What the step time is lost to: communication, efficiency, input, memory, "
            "gpu_memory, gpu, network or straggler; NULL for anomalies and hangs.",
        ),
        sa.Column(
            "priority",
            sa.Integer(),
            nullable=True,
            comment="Order to act in within the job's report, 1 first; NULL if unranked.",
        ),
        sa.Column(
            "expected_gain_ratio",
            sa.Float(),
            nullable=True,
            comment="Estimated share of step time the recommendation saves, 0..1 "
            "(NULL where it prevents a failure rather than saving time).",
        ),
        sa.Column(
            "difficulty",
            sa.String(length=16),
            nullable=True,
            comment="Effort of the recommendation: easy, medium or hard.",
        ),
        sa.Column(
            "updated_unix_s",
            sa.Float(),
            nullable=True,
            comment="When value, severity or summary were last written, Unix seconds.",
        ),
        sa.Column(
            "ended_unix_s",
            sa.Float(),
            nullable=True,
            comment="When it stopped holding, Unix time in seconds; NULL while open.",
        ),
        sa.Column(
            "aggregator_id",
            sa.String(length=128),
            nullable=True,
            comment="The aggregator shard that detected it.",
        ),
    )


def _comments(after: bool) -> None:
    # SQLite keeps no comments: nothing to change there.
    if op.get_bind().dialect.name != "postgresql":
        return
    table = _FINDINGS_AFTER if after else _FINDINGS_BEFORE
    op.create_table_comment(
        "findings", table, existing_comment=_FINDINGS_BEFORE if after else _FINDINGS_AFTER
    )
    for column, type_, before, later in (
        ("metric", sa.String(length=64), _METRIC_BEFORE, _METRIC_AFTER),
        ("kind", sa.String(length=16), _KIND_BEFORE, _KIND_AFTER),
        ("detected_unix_s", sa.Float(), _DETECTED_BEFORE, _DETECTED_AFTER),
    ):
        op.alter_column(
            "findings",
            column,
            existing_type=type_,
            comment=later if after else before,
            existing_comment=before if after else later,
        )


def upgrade() -> None:
    op.add_column(
        "steps",
        sa.Column(
            "input_wait_s",
            sa.Float(),
            nullable=True,
            comment="Input wait before the step (the previous step's end to this one's "
            "start: the data loader), seconds; NULL where the probe did not measure it.",
        ),
    )
    for column in _finding_columns():
        op.add_column("findings", column)
    # Rows written before episodes existed were never closed: they end when detected.
    op.execute("UPDATE findings SET ended_unix_s = detected_unix_s")
    op.create_index(op.f("ix_findings_job_detected_unix_s"), "findings", ["job", "detected_unix_s"])
    _comments(after=True)


def downgrade() -> None:
    _comments(after=False)
    op.drop_index(op.f("ix_findings_job_detected_unix_s"), table_name="findings")
    with op.batch_alter_table("findings") as batch:
        for column in reversed(_finding_columns()):
            batch.drop_column(column.name)
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("input_wait_s")
