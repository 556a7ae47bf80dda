"""``steps.process_cpu_wait_s``: the run-queue delay of all a rank's threads during the
step, so a step a busy node held back (its communication threads waiting for a CPU,
its compute unchanged) can be told from a slower job in the stored history too.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COMMENT = (
    "Time all the rank's threads together were ready to run but waited for a CPU during "
    "the step (run-queue delay summed over its threads, communication threads included), "
    "seconds; NULL where the kernel does not report it."
)


def upgrade() -> None:
    # Nullable: rows from probes before this field (and non-Linux hosts) have none.
    with op.batch_alter_table("steps") as batch:
        batch.add_column(
            sa.Column("process_cpu_wait_s", sa.Float(), nullable=True, comment=_COMMENT)
        )


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("process_cpu_wait_s")
