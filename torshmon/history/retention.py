"""Retention: downsample raw measurements into ``rollups``, then delete old rows.

``apply_retention`` does everything in one transaction. Raw rows of complete time
buckets past the watermark are rolled up (count, sum, min, max per key, rank, metric
and bucket) by one ``INSERT ... SELECT ... GROUP BY`` per source column; the
watermark in ``retention_state`` then moves to the end of the last bucket rolled up,
so a second run rolls up nothing twice. Raw rows older than the raw retention are
deleted, but never rows not yet rolled up. Rows that arrive for a bucket already
rolled up (a spool replayed long after) stay in the raw tables only; the
``rollup_delay_s`` grace period keeps that rare.

Two aggregators may run it at once on one PostgreSQL: the one that does not get the
transaction-scoped advisory lock skips (``RetentionReport.ran`` is False). On
SQLite the write lock, taken at BEGIN, serialises them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    String,
    delete,
    func,
    insert,
    literal,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine

from torshmon.history.db import begin_write, upsert
from torshmon.history.models import ROLLUP_SOURCES, Base, RollupSource

#: pg_try_advisory_xact_lock key of the retention job (any fixed bigint).
RETENTION_LOCK_KEY: Final = 0x746F7273686D6E02

#: Raw tables and the Unix-nanosecond column their age is judged by.
RAW_TABLES: Final[Mapping[str, str]] = {
    "steps": "end_unix_ns",
    "collectives": "end_unix_ns",
    "buckets": "end_unix_ns",
    "ddp_stats": "end_unix_ns",
    "node_samples": "ts_unix_ns",
    "gpu_samples": "ts_unix_ns",
    "rank_samples": "ts_unix_ns",
    "inflight_reports": "sent_unix_ns",
    "ingest_seqs": "received_unix_ns",
}

_NS_PER_S: Final = 1_000_000_000
#: The columns of ``rollups`` in the model's order, which ``_roll_up``'s SELECT follows.
_ROLLUP_COLUMNS: Final = tuple(Base.metadata.tables["rollups"].columns.keys())


@dataclass(frozen=True, slots=True)
class RetentionReport:
    """What one ``apply_retention`` run did.

    ``ran`` is False if another process was running it (nothing was changed).
    ``watermarks_unix_s``: per rollup source table, everything before it is rolled up.
    """

    ran: bool
    rollup_rows_written: int = 0
    raw_rows_deleted: Mapping[str, int] = field(default_factory=dict)
    rollup_rows_deleted: int = 0
    watermarks_unix_s: Mapping[str, float] = field(default_factory=dict)


def apply_retention(
    engine: Engine,
    *,
    now_unix_s: float,
    raw_retention_s: float = 86400,
    rollup_resolution_s: int = 60,
    rollup_retention_s: float = 30 * 86400,
    rollup_delay_s: float = 60,
) -> RetentionReport:
    """Roll up complete buckets, then delete raw rows and rollups past their retention.

    A bucket is complete once it ended ``rollup_delay_s`` seconds before
    ``now_unix_s`` (late rows get that long to arrive). Idempotent; safe to run from
    several processes at once. Raises ValueError naming a bad argument.
    """
    _check_arguments(
        now_unix_s, raw_retention_s, rollup_resolution_s, rollup_retention_s, rollup_delay_s
    )
    with begin_write(engine) as conn:
        if (
            conn.dialect.name == "postgresql"
            and not conn.execute(
                text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": RETENTION_LOCK_KEY}
            ).scalar_one()
        ):
            return RetentionReport(ran=False)
        end_s = math.floor((now_unix_s - rollup_delay_s) / rollup_resolution_s)
        end_s *= rollup_resolution_s
        written = 0
        watermarks: dict[str, float] = {}
        for source in ROLLUP_SOURCES.values():
            rows, watermarks[source.table] = _roll_up(conn, source, rollup_resolution_s, end_s)
            written += rows
        raw_cutoff_ns = int((now_unix_s - raw_retention_s) * _NS_PER_S)
        deleted = {
            table: _delete_raw(conn, table, column, raw_cutoff_ns, watermarks.get(table))
            for table, column in RAW_TABLES.items()
        }
        rollups = Base.metadata.tables["rollups"]
        rollups_deleted = conn.execute(
            delete(rollups).where(
                rollups.c.bucket_start_unix_s < math.floor(now_unix_s - rollup_retention_s)
            )
        ).rowcount
    return RetentionReport(
        ran=True,
        rollup_rows_written=written,
        raw_rows_deleted=deleted,
        rollup_rows_deleted=rollups_deleted,
        watermarks_unix_s=watermarks,
    )


def _check_arguments(
    now_unix_s: float,
    raw_retention_s: float,
    rollup_resolution_s: int,
    rollup_retention_s: float,
    rollup_delay_s: float,
) -> None:
    if not math.isfinite(now_unix_s) or now_unix_s < 0:
        raise ValueError(f"now_unix_s must be a finite Unix time, got {now_unix_s}")
    if isinstance(rollup_resolution_s, bool) or not isinstance(rollup_resolution_s, int):
        raise ValueError(f"rollup_resolution_s must be an int, got {rollup_resolution_s!r}")
    if rollup_resolution_s < 1:
        raise ValueError(f"rollup_resolution_s must be at least 1, got {rollup_resolution_s}")
    for name, value in (
        ("raw_retention_s", raw_retention_s),
        ("rollup_retention_s", rollup_retention_s),
    ):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if not rollup_delay_s >= 0:
        raise ValueError(f"rollup_delay_s must be zero or more, got {rollup_delay_s}")


def _watermark_name(source: RollupSource, resolution_s: int) -> str:
    return f"rollup:{source.table}:{resolution_s}"


def _roll_up(
    conn: Connection, source: RollupSource, resolution_s: int, end_s: int
) -> tuple[int, float]:
    """Roll up ``source`` from its watermark to ``end_s``; returns (rows written, watermark)."""
    state = Base.metadata.tables["retention_state"]
    name = _watermark_name(source, resolution_s)
    start = conn.execute(
        select(state.c.watermark_unix_s).where(state.c.name == name)
    ).scalar_one_or_none()
    if start is not None and start >= end_s:
        return 0, float(start)
    table = Base.metadata.tables[source.table]
    time_col = table.c[source.time_column]
    # Inline constants: the bucket expression must read the same in SELECT and GROUP BY.
    width_ns = literal(resolution_s * _NS_PER_S, BigInteger, literal_execute=True)
    bucket = (time_col // width_ns) * literal(resolution_s, BigInteger, literal_execute=True)
    key = table.c[source.key_column]
    rank: ColumnElement[int]
    if source.rank_column is not None:
        rank = table.c[source.rank_column]
        groups: list[ColumnElement[object]] = [key, rank, bucket]
    else:
        # Not grouped by: a constant integer in GROUP BY would mean a column position.
        rank = literal(-1, Integer, literal_execute=True)
        groups = [key, bucket]
    window = [time_col < end_s * _NS_PER_S]
    if start is not None:
        window.append(time_col >= int(start) * _NS_PER_S)
    written = 0
    for metric in source.metrics:
        value = table.c[metric]
        query = (
            select(  # one value per _ROLLUP_COLUMNS entry, in its order
                key,
                rank,
                literal(metric, String, literal_execute=True),
                literal(resolution_s, Integer, literal_execute=True),
                bucket,
                func.count(value),
                func.sum(value),
                func.min(value),
                func.max(value),
            )
            .where(*window, value.is_not(None))
            .group_by(*groups)
        )
        rollups = Base.metadata.tables["rollups"]
        result = conn.execute(
            insert(rollups).from_select(_ROLLUP_COLUMNS, query),
            execution_options={"preserve_rowcount": True},  # else -1 for INSERT on psycopg
        )
        written += result.rowcount
    conn.execute(
        upsert(conn, state, index_elements=["name"]),
        [{"name": name, "watermark_unix_s": float(end_s)}],
    )
    return written, float(end_s)


def _delete_raw(
    conn: Connection, table_name: str, column: str, cutoff_ns: int, watermark_s: float | None
) -> int:
    table = Base.metadata.tables[table_name]
    if table_name in ROLLUP_SOURCES:
        # Never delete what is not rolled up yet (a long outage, a large rollup delay).
        rolled_up_ns = 0 if watermark_s is None else int(watermark_s) * _NS_PER_S
        cutoff_ns = min(cutoff_ns, rolled_up_ns)
    condition = table.c[column] < cutoff_ns
    if table_name == "ingest_seqs":
        # Keep each agent's newest seq: it is how the ingest answers "stored up to".
        newer = table.alias("newer")
        newest = select(func.max(newer.c.seq)).where(newer.c.agent_id == table.c.agent_id)
        condition = condition & (table.c.seq < newest.scalar_subquery())
    return int(conn.execute(delete(table).where(condition)).rowcount)
