"""Evidence captured on alert: captures and their files."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from torshmon.history.models._base import (
    JOB_RUN_COMMENT,
    Base,
    _table,
)


class EvidenceCapture(Base):
    __tablename__ = "evidence_captures"
    __table_args__ = _table(
        "Evidence captures (Flight Recorder dumps, profiler traces) asked of a job.",
        Index(None, "job"),
        Index(None, "alert_id"),
    )

    id: Mapped[str] = mapped_column(
        String(64), primary_key=True, comment="Capture id (the evidence command's id)."
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    run_id: Mapped[str | None] = mapped_column(String(64), comment=JOB_RUN_COMMENT)
    alert_id: Mapped[int | None] = mapped_column(
        BigInteger, comment="The alert episode that asked for it (alerts.id), if one."
    )
    alert_fingerprint: Mapped[str | None] = mapped_column(
        String(16), comment="That alert's fingerprint (16 hex digits)."
    )
    rule: Mapped[str] = mapped_column(
        String(200), comment="The rule whose alert asked for it; empty when asked by hand."
    )
    profile_ranks: Mapped[list[int]] = mapped_column(
        JSON, comment="Ranks asked for a profiler trace, JSON array."
    )
    created_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it was asked for, Unix time in seconds."
    )
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that asked for it."
    )


class EvidenceFile(Base):
    __tablename__ = "evidence_files"
    __table_args__ = _table("Files of evidence captures, one per rank and kind, or why missing.")

    capture_id: Mapped[str] = mapped_column(
        String(64),
        ForeignKey("evidence_captures.id"),
        primary_key=True,
        comment="The capture (evidence_captures.id).",
    )
    rank: Mapped[int] = mapped_column(
        Integer, primary_key=True, autoincrement=False, comment="Global rank that took it."
    )
    name: Mapped[str] = mapped_column(
        String(64),
        primary_key=True,
        comment="flight_recorder.json or profiler_trace.json.",
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    size_bytes: Mapped[int] = mapped_column(
        BigInteger, comment="Size of the file uncompressed; 0 when missing."
    )
    stored_bytes: Mapped[int] = mapped_column(
        BigInteger, comment="Size on disk (gzip); 0 when missing."
    )
    path: Mapped[str | None] = mapped_column(
        String(300), comment="Where it is, under the evidence folder; NULL when missing."
    )
    error: Mapped[str] = mapped_column(
        Text, default="", comment="Why it is missing (not taken, over a cap); empty otherwise."
    )
    taken_unix_s: Mapped[float] = mapped_column(
        Float, comment="When the rank took it, Unix time in seconds."
    )
    received_unix_s: Mapped[float] = mapped_column(
        Float, comment="When the aggregator stored it, Unix time in seconds."
    )
