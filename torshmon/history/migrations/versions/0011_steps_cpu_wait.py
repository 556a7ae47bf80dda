"""``steps.cpu_wait_s``: the training thread's run-queue delay during the step's
compute (time it was ready to run but other processes held the CPUs), so a rank its
node kept from a CPU can be told from a slow one in the stored history too.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COMMENT = (
    "Time the training thread was ready to run but waited for a CPU during the step's "
    "compute (its run-queue delay, /proc/thread-self/schedstat, outside its "
    "communication waits), seconds; NULL where the kernel does not report it."
)


def upgrade() -> None:
    # Nullable: rows from probes before this field (and non-Linux hosts) have none.
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("cpu_wait_s", sa.Float(), nullable=True, comment=_COMMENT))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("cpu_wait_s")
