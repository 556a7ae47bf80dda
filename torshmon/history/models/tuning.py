"""Autotuning sessions and the configs they try."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
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
    _surrogate_id,
    _table,
)


class TuningSession(Base):
    __tablename__ = "tuning_sessions"
    __table_args__ = _table("One autotuning session of a job.", Index(None, "job"))

    id: Mapped[str] = mapped_column(String(64), primary_key=True, comment="Session id.")
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    run_id: Mapped[str | None] = mapped_column(String(64), comment=JOB_RUN_COMMENT)
    state: Mapped[str] = mapped_column(String(32), comment="The tuner's state.")
    trigger: Mapped[str] = mapped_column(String(200), comment="What started it (an alert, a user).")
    started_unix_s: Mapped[float] = mapped_column(Float, comment="Unix time in seconds.")
    ended_unix_s: Mapped[float | None] = mapped_column(Float, comment="Unix time in seconds.")
    baseline_config: Mapped[dict[str, Any]] = mapped_column(
        JSON, comment="Config before tuning, JSON object."
    )
    best_config: Mapped[dict[str, Any] | None] = mapped_column(
        JSON, comment="Best config found, JSON object."
    )
    baseline_score: Mapped[float | None] = mapped_column(
        Float, comment="Baseline throughput, samples per second."
    )
    best_score: Mapped[float | None] = mapped_column(
        Float, comment="Best throughput, samples per second."
    )
    reason: Mapped[str] = mapped_column(Text, default="", comment="Why it ended as it did.")
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that runs it."
    )
    state_blob: Mapped[dict[str, Any]] = mapped_column(
        JSON, comment="The tuner's resumable state, JSON object."
    )


class TuningTrial(Base):
    __tablename__ = "tuning_trials"
    __table_args__ = _table("One config tried by a tuning session.")

    id: Mapped[int] = _surrogate_id()
    session_id: Mapped[str] = mapped_column(
        String(64),
        ForeignKey("tuning_sessions.id"),
        index=True,
        comment="The session (tuning_sessions.id).",
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    run_id: Mapped[str | None] = mapped_column(String(64), comment=JOB_RUN_COMMENT)
    trial_index: Mapped[int] = mapped_column(Integer, comment="0-based trial number.")
    config: Mapped[dict[str, Any]] = mapped_column(JSON, comment="Config tried, JSON object.")
    command_id: Mapped[str | None] = mapped_column(
        String(64), comment="The command that applied it (commands.id)."
    )
    state: Mapped[str] = mapped_column(String(32), comment="The trial's state.")
    windows: Mapped[list[float]] = mapped_column(
        JSON, comment="Throughput per measured window, JSON list of samples per second."
    )
    score: Mapped[float | None] = mapped_column(
        Float, comment="Median of the windows, samples per second."
    )
    decision: Mapped[str | None] = mapped_column(
        String(32), comment="keep, rollback, ... once decided."
    )
    reason: Mapped[str] = mapped_column(Text, default="", comment="Why it was decided so.")
    started_unix_s: Mapped[float] = mapped_column(Float, comment="Unix time in seconds.")
    ended_unix_s: Mapped[float | None] = mapped_column(Float, comment="Unix time in seconds.")
