"""``steps.cpu_wait_s`` and ``process_cpu_wait_s`` are also NULL for a job attached with
``cpu_wait=False``: say so in their comments.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_WAS = "NULL where the kernel does not report it."
_IS = "NULL where the kernel does not report it or the job attached with cpu_wait=False."
_THREAD = (
    "Time the training thread was ready to run but waited for a CPU during the step's "
    "compute (its run-queue delay, /proc/thread-self/schedstat, outside its communication "
    "waits), seconds; "
)
_PROCESS = (
    "Time all the rank's threads together were ready to run but waited for a CPU during "
    "the step (run-queue delay summed over its threads, communication threads included), "
    "seconds; "
)


def _comments(before: str, after: str) -> None:
    # SQLite keeps no column comments: nothing to change there.
    if op.get_bind().dialect.name != "postgresql":
        return
    for column, text in (("cpu_wait_s", _THREAD), ("process_cpu_wait_s", _PROCESS)):
        op.alter_column(
            "steps",
            column,
            existing_type=sa.Float(),
            existing_nullable=True,
            comment=text + after,
            existing_comment=text + before,
        )


def upgrade() -> None:
    _comments(_WAS, _IS)


def downgrade() -> None:
    _comments(_IS, _WAS)
