"""``steps.eval_s`` and ``steps.between_steps_comm_s``: the time between two steps split
into evaluation, collectives and input wait, so a trainer's evaluation and its logging
gathers are no longer stored as the data loader's time.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_EVAL = (
    "Evaluation before the step: forward passes of the job's model outside any step since "
    "the previous step's end (first start to last end), seconds; NULL for a job's first "
    "step and from probes that do not split that time."
)
_COMM = (
    "Collectives before the step, since the previous step's end and outside its evaluation "
    "(a trainer's logging gathers), seconds; NULL as eval_s."
)
_INPUT_WAIT = (
    "Input wait before the step (the previous step's end to this one's start, less eval_s "
    "and between_steps_comm_s: the data loader), seconds; NULL where the probe did not "
    "measure it."
)
_INPUT_WAIT_BEFORE = (
    "Input wait before the step (the previous step's end to this one's start: the data "
    "loader), seconds; NULL where the probe did not measure it."
)


def _input_wait_comment(before: str, after: str) -> None:
    # SQLite keeps no column comments: nothing to change there.
    if op.get_bind().dialect.name != "postgresql":
        return
    op.alter_column(
        "steps",
        "input_wait_s",
        existing_type=sa.Float(),
        existing_nullable=True,
        comment=after,
        existing_comment=before,
    )


def upgrade() -> None:
    # Nullable: rows from probes before this split have neither.
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("eval_s", sa.Float(), nullable=True, comment=_EVAL))
        batch.add_column(
            sa.Column("between_steps_comm_s", sa.Float(), nullable=True, comment=_COMM)
        )
    _input_wait_comment(_INPUT_WAIT_BEFORE, _INPUT_WAIT)


def downgrade() -> None:
    _input_wait_comment(_INPUT_WAIT, _INPUT_WAIT_BEFORE)
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("between_steps_comm_s")
        batch.drop_column("eval_s")
