"""Reading the evidence captured on alert: captures with their files, by job or alert.

The aggregator's API answers with it (``GET /api/v1/evidence``,
``GET /api/v1/alerts/{id}/evidence``), and the report reads a history with it
directly (``evidence_of``). A file's ``path`` is relative to the aggregator's
evidence folder (its ``evidence_dir`` setting).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from torshmon.history.db import make_engine
from torshmon.history.models import Base

_T = Base.metadata.tables


def list_evidence(
    conn: Connection, *, job: str | None = None, alert_id: int | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Evidence captures (``evidence_captures`` rows), newest first, each with its
    ``files`` (``evidence_files`` rows, by rank and name): of ``job``, and/or of alert
    episode ``alert_id`` (asked for while it was open); none for an unknown alert."""
    captures, files, alerts = _T["evidence_captures"], _T["evidence_files"], _T["alerts"]
    query = select(captures)
    if job is not None:
        query = query.where(captures.c.job == job)
    if alert_id is not None:
        alert = conn.execute(select(alerts).where(alerts.c.id == alert_id)).mappings().first()
        if alert is None:
            return []
        # The id, or the fingerprint within the episode (a capture asked for before the
        # alert's row was written).
        during = captures.c.created_unix_s >= alert["starts_at_unix_s"]
        if alert["ends_at_unix_s"] is not None:
            during = during & (captures.c.created_unix_s <= alert["ends_at_unix_s"])
        query = query.where(
            (captures.c.alert_id == alert_id)
            | (
                captures.c.alert_id.is_(None)
                & (captures.c.alert_fingerprint == alert["fingerprint"])
                & during
            )
        )
    query = query.order_by(captures.c.created_unix_s.desc()).limit(limit)
    out = [dict(r) for r in conn.execute(query).mappings()]
    by_capture: dict[str, list[dict[str, Any]]] = {r["id"]: [] for r in out}
    if by_capture:
        rows = conn.execute(
            select(files)
            .where(files.c.capture_id.in_(list(by_capture)))
            .order_by(files.c.rank, files.c.name)
        ).mappings()
        for r in rows:
            by_capture[r["capture_id"]].append(dict(r))
    for capture in out:
        capture["files"] = by_capture[capture["id"]]
    return out


def evidence_of(
    url: str, *, job: str | None = None, alert_id: int | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """``list_evidence`` on the history at ``url`` (a SQLAlchemy URL), read-only."""
    engine = make_engine(url, read_only=True)
    try:
        with engine.connect() as conn:
            return list_evidence(conn, job=job, alert_id=alert_id, limit=limit)
    finally:
        engine.dispose()
