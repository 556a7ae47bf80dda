"""Alert silences (table ``silences``) and acknowledgements (columns on ``alerts``).

Revision ID: 0008
Revises: 0006
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "silences",
        sa.Column("id", _ID, sa.Identity(always=False), nullable=False, comment="Surrogate key."),
        sa.Column(
            "matchers",
            sa.JSON(),
            nullable=False,
            comment="Label name -> value; an alert matches when every one is equal.",
        ),
        sa.Column(
            "starts_at_unix_s",
            sa.Float(),
            nullable=False,
            comment="When it takes effect, Unix time in seconds.",
        ),
        sa.Column(
            "ends_at_unix_s",
            sa.Float(),
            nullable=False,
            comment="When it expires (or was expired early), Unix time in seconds.",
        ),
        sa.Column("created_by", sa.String(length=200), nullable=False, comment="Who created it."),
        sa.Column("comment", sa.Text(), nullable=False, comment="Why (may be empty)."),
        sa.Column(
            "created_unix_s",
            sa.Float(),
            nullable=False,
            comment="When it was created, Unix time in seconds.",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_silences")),
        comment="Silences: alerts whose labels match are not notified between the start and end.",
    )
    op.create_index(
        op.f("ix_silences_ends_at_unix_s"), "silences", ["ends_at_unix_s"], unique=False
    )
    with op.batch_alter_table("alerts") as batch:
        batch.add_column(
            sa.Column(
                "acknowledged_by",
                sa.String(length=200),
                nullable=True,
                comment="Who acknowledged it (NULL: nobody yet).",
            )
        )
        batch.add_column(
            sa.Column(
                "acknowledged_unix_s",
                sa.Float(),
                nullable=True,
                comment="When it was acknowledged, Unix time in seconds.",
            )
        )
        batch.add_column(
            sa.Column(
                "acknowledged_comment",
                sa.Text(),
                nullable=True,
                comment="What the acknowledger said (may be empty).",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("alerts") as batch:
        batch.drop_column("acknowledged_comment")
        batch.drop_column("acknowledged_unix_s")
        batch.drop_column("acknowledged_by")
    op.drop_index(op.f("ix_silences_ends_at_unix_s"), table_name="silences")
    op.drop_table("silences")
