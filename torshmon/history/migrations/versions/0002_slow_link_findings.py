"""Findings of kind slow_link (the link checker's slow-network-link localisation).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = "kind IN ('anomaly', 'straggler', 'hang', 'bottleneck')"
_AFTER = "kind IN ('anomaly', 'straggler', 'hang', 'bottleneck', 'slow_link')"


def _replace_kind_check(condition: str) -> None:
    # SQLite cannot alter a constraint: batch mode copies the table with the new one.
    with op.batch_alter_table("findings", recreate="auto") as batch:
        batch.drop_constraint(op.f("ck_findings_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_findings_kind"), condition)


def upgrade() -> None:
    _replace_kind_check(_AFTER)


def downgrade() -> None:
    op.execute("DELETE FROM findings WHERE kind = 'slow_link'")
    _replace_kind_check(_BEFORE)
