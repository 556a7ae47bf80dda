"""``probe_sessions.closed_unix_ns``: when a rank's probe said its monitoring ended
(``wire.Closing``, sent by ``close()`` or at process exit), so the history tells a job
that ended from one that runs without waiting out a silence.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COMMENT = (
    "When the probe said its monitoring ended (close() or process exit), Unix time in "
    "nanoseconds; NULL while it runs, or if it ended without a word."
)


def upgrade() -> None:
    # Nullable: sessions stored before this column, and probes that died, have none.
    with op.batch_alter_table("probe_sessions") as batch:
        batch.add_column(
            sa.Column("closed_unix_ns", sa.BigInteger(), nullable=True, comment=_COMMENT)
        )


def downgrade() -> None:
    with op.batch_alter_table("probe_sessions") as batch:
        batch.drop_column("closed_unix_ns")
