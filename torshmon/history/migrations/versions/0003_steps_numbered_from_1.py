"""steps.step is numbered from 1, as the probe numbers steps: say so in its comment.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = "Step number (0-based)."
_AFTER = "Step number, from 1 (the probe counts a step when it ends)."


def _comment(comment: str, existing: str) -> None:
    # SQLite keeps no column comments: nothing to change there.
    if op.get_bind().dialect.name != "postgresql":
        return
    op.alter_column(
        "steps",
        "step",
        existing_type=sa.BigInteger(),
        existing_nullable=False,
        comment=comment,
        existing_comment=existing,
    )


def upgrade() -> None:
    _comment(_AFTER, _BEFORE)


def downgrade() -> None:
    _comment(_BEFORE, _AFTER)
