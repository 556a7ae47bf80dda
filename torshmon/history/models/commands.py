"""What the aggregator decides: commands sent to the ranks."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    Index,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from torshmon.history.models._base import (
    COMMAND_STATUSES,
    JOB_RUN_COMMENT,
    Base,
    _one_of,
    _table,
)


class Command(Base):
    __tablename__ = "commands"
    __table_args__ = _table(
        "Commands sent to a job's rank 0 and what became of them.",
        Index(None, "job", "status"),
        _one_of("status", COMMAND_STATUSES),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True, comment="Command id.")
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    run_id: Mapped[str | None] = mapped_column(String(64), comment=JOB_RUN_COMMENT)
    kind: Mapped[str] = mapped_column(String(64), comment="Command kind (config).")
    args: Mapped[dict[str, Any]] = mapped_column(JSON, comment="Arguments, JSON object.")
    status: Mapped[str] = mapped_column(
        String(16), comment="pending, sent, accepted, rejected, applied or expired."
    )
    reason: Mapped[str] = mapped_column(
        Text, default="", comment="Why rejected or expired; empty otherwise."
    )
    version: Mapped[int | None] = mapped_column(
        BigInteger, comment="Config version it became, once applied."
    )
    effective_step: Mapped[int | None] = mapped_column(
        BigInteger, comment="First step it applies to, once applied."
    )
    created_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it was created, Unix time in seconds."
    )
    updated_unix_s: Mapped[float] = mapped_column(
        Float, comment="Latest status change, Unix time in seconds."
    )
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that issued it."
    )
