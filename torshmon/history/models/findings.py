"""Detector conclusions, one row per episode."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    Float,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from torshmon.history.models._base import (
    FINDING_KINDS,
    RUN_ID_COMMENT,
    Base,
    _one_of,
    _surrogate_id,
    _table,
)


class Finding(Base):
    __tablename__ = "findings"
    __table_args__ = _table(
        "Detector conclusions (anomaly, straggler, hang, bottleneck, slow_link), one row per "
        "episode: opened when first detected, updated while it holds, closed (ended_unix_s) "
        "when it no longer does.",
        _one_of("kind", FINDING_KINDS),
        Index(None, "job", "detected_unix_s"),
        Index(None, "job", "run_id"),
    )

    id: Mapped[int] = _surrogate_id()
    kind: Mapped[str] = mapped_column(
        String(16), comment="anomaly, straggler, hang, bottleneck or slow_link."
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    run_id: Mapped[str | None] = mapped_column(String(64), comment=RUN_ID_COMMENT)
    rank: Mapped[int | None] = mapped_column(Integer, comment="Rank at fault, if one.")
    metric: Mapped[str | None] = mapped_column(
        String(64), comment="Metric, for anomalies and bottlenecks."
    )
    value: Mapped[float | None] = mapped_column(
        Float, comment="Observed value (a step time, a hang age, ...), in the metric's unit."
    )
    score: Mapped[float | None] = mapped_column(
        Float, comment="Detector statistic (z-score, robust z, relative slowdown)."
    )
    summary: Mapped[str] = mapped_column(Text, comment="One sentence: what and where.")
    recommendation: Mapped[str] = mapped_column(Text, comment="What to do.")
    severity: Mapped[str] = mapped_column(String(32), comment="info .. critical.")
    category: Mapped[str | None] = mapped_column(
        String(32),
        comment="What the step time is lost to: communication, efficiency, input, memory, "
        "gpu_memory, gpu, network or straggler; NULL for anomalies and hangs.",
    )
    priority: Mapped[int | None] = mapped_column(
        Integer, comment="Order to act in within the job's report, 1 first; NULL if unranked."
    )
    expected_gain_ratio: Mapped[float | None] = mapped_column(
        Float,
        comment="Estimated share of step time the recommendation saves, 0..1 "
        "(NULL where it prevents a failure rather than saving time).",
    )
    difficulty: Mapped[str | None] = mapped_column(
        String(16), comment="Effort of the recommendation: easy, medium or hard."
    )
    since_unix_s: Mapped[float] = mapped_column(
        Float, comment="When the condition began, Unix time in seconds."
    )
    detected_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it was detected (the row opened), Unix time in seconds."
    )
    updated_unix_s: Mapped[float | None] = mapped_column(
        Float, comment="When value, severity or summary were last written, Unix seconds."
    )
    ended_unix_s: Mapped[float | None] = mapped_column(
        Float, comment="When it stopped holding, Unix time in seconds; NULL while open."
    )
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that detected it."
    )
    details: Mapped[dict[str, Any]] = mapped_column(
        JSON, comment="Detector-specific details, JSON object."
    )
