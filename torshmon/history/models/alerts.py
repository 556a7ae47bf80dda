"""Alert episodes, their transitions, and silences."""

from __future__ import annotations

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
    ALERT_STATES,
    ID_TYPE,
    RUN_ID_COMMENT,
    Base,
    _one_of,
    _surrogate_id,
    _table,
)


class Alert(Base):
    __tablename__ = "alerts"
    __table_args__ = _table(
        "One alert episode: pending, then firing, then resolved update the same row.",
        Index(None, "job", "state"),
        Index(None, "job", "run_id"),
        _one_of("state", ALERT_STATES),
    )

    id: Mapped[int] = _surrogate_id()
    fingerprint: Mapped[str] = mapped_column(
        String(16), index=True, comment="Hash of rule and labels (16 hex digits)."
    )
    rule: Mapped[str] = mapped_column(String(200), comment="Rule name (alertname).")
    severity: Mapped[str] = mapped_column(String(32), comment="info .. critical.")
    state: Mapped[str] = mapped_column(String(16), comment="pending, firing or resolved.")
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    run_id: Mapped[str | None] = mapped_column(String(64), comment=RUN_ID_COMMENT)
    rank: Mapped[int | None] = mapped_column(Integer, comment="Rank at fault, if one.")
    labels: Mapped[dict[str, str]] = mapped_column(JSON, comment="Alert labels, JSON object.")
    annotations: Mapped[dict[str, str]] = mapped_column(
        JSON, comment="summary, description, recommendation (JSON); follow its figures while open."
    )
    value: Mapped[float | None] = mapped_column(Float, comment="Rule's value, latest while open.")
    starts_at_unix_s: Mapped[float] = mapped_column(
        Float, comment="When the condition began, Unix time in seconds."
    )
    fired_at_unix_s: Mapped[float | None] = mapped_column(
        Float, comment="When it started firing, Unix time in seconds."
    )
    ends_at_unix_s: Mapped[float | None] = mapped_column(
        Float, comment="When it resolved, Unix time in seconds."
    )
    updated_unix_s: Mapped[float] = mapped_column(
        Float, comment="Latest state change or rewrite of its text, Unix time in seconds."
    )
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that evaluated it."
    )
    acknowledged_by: Mapped[str | None] = mapped_column(
        String(200), comment="Who acknowledged it (NULL: nobody yet)."
    )
    acknowledged_unix_s: Mapped[float | None] = mapped_column(
        Float, comment="When it was acknowledged, Unix time in seconds."
    )
    acknowledged_comment: Mapped[str | None] = mapped_column(
        Text, comment="What the acknowledger said (may be empty)."
    )


class Silence(Base):
    __tablename__ = "silences"
    __table_args__ = _table(
        "Silences: alerts whose labels match are not notified between the start and end.",
        Index(None, "ends_at_unix_s"),
    )

    id: Mapped[int] = _surrogate_id()
    matchers: Mapped[dict[str, str]] = mapped_column(
        JSON, comment="Label name -> value; an alert matches when every one is equal."
    )
    starts_at_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it takes effect, Unix time in seconds."
    )
    ends_at_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it expires (or was expired early), Unix time in seconds."
    )
    created_by: Mapped[str] = mapped_column(String(200), comment="Who created it.")
    comment: Mapped[str] = mapped_column(Text, comment="Why (may be empty).")
    created_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it was created, Unix time in seconds."
    )


class AlertEvent(Base):
    __tablename__ = "alert_events"
    __table_args__ = _table(
        "Each state transition of an alert episode.", _one_of("state", ALERT_STATES)
    )

    id: Mapped[int] = _surrogate_id()
    alert_id: Mapped[int] = mapped_column(
        ID_TYPE, ForeignKey("alerts.id"), index=True, comment="The episode (alerts.id)."
    )
    state: Mapped[str] = mapped_column(String(16), comment="State entered.")
    ts_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it was entered, Unix time in seconds."
    )
    value: Mapped[float | None] = mapped_column(Float, comment="Value at that moment.")
