"""Ingest's statements: the per-request reads, upserts and bulk inserts of ``IngestStore``.

``torshmon.aggregator.ingest`` builds the rows from the wire records (column lists
from the models) and runs one transaction per request; these functions are the SQL
it runs in it, on the connection it passes. The per-step tables are the hot path
(about 10^4 rows a second for a large job): their rows go through the DBAPI
cursor's ``executemany`` on SQLite and ``COPY`` on PostgreSQL, and the per-request
statements are compiled once per dialect from the models (``_driver_sql``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from sqlalchemy import Table, and_, bindparam, func, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.sql.dml import Insert, Update

from torshmon.history.db import DatabaseConfigError, insert_ignore, upsert
from torshmon.history.models import Base
from torshmon.wire import CommandAck

_T = Base.metadata.tables

#: Columns of ``probe_sessions`` that a hello does not refresh: the first sighting
#: and the progress, which the batches move (``advance_sessions``).
_SESSION_KEPT: Final = frozenset(
    {"session", "started_unix_ns", "last_seq", "dropped_records_total"}
)


# -- reads ---------------------------------------------------------------------------------
def stored_seqs(conn: Connection, agent_id: str, first: int, last: int) -> set[int]:
    """The seqs of ``agent_id`` from ``first`` to ``last`` already stored."""
    table = _T["ingest_seqs"]
    rows = conn.execute(
        select(table.c.seq).where(
            and_(table.c.agent_id == agent_id, table.c.seq >= first, table.c.seq <= last)
        )
    )
    return {int(r[0]) for r in rows}


def max_seq(conn: Connection, agent_id: str) -> int:
    """The highest seq stored for ``agent_id``; 0 for none."""
    table = _T["ingest_seqs"]
    value = conn.execute(select(func.max(table.c.seq)).where(table.c.agent_id == agent_id)).scalar()
    return int(value or 0)


def session_seqs(conn: Connection, sessions: Sequence[str]) -> dict[str, tuple[int, str | None]]:
    """``last_seq`` and ``run_id`` of those probe sessions that have a row."""
    table = _T["probe_sessions"]
    query = select(table.c.session, table.c.last_seq, table.c.run_id)
    rows = conn.execute(query.where(table.c.session.in_(sessions)))
    return {name: (int(last_seq), run_id) for name, last_seq, run_id in rows}


def latest_run(conn: Connection, job: str) -> str | None:
    """``job``'s run that started last (the one the aggregator sends its commands to
    and tunes); None for a job without runs."""
    runs = _T["runs"]
    query = (
        select(runs.c.run_id)
        .where(runs.c.job == job)
        .order_by(runs.c.started_unix_ns.desc(), runs.c.run_id.desc())
        .limit(1)
    )
    value = conn.execute(query).scalar()
    return None if value is None else str(value)


# -- writes --------------------------------------------------------------------------------
def upsert_jobs(conn: Connection, jobs: list[dict[str, Any]]) -> None:
    """Insert each job, or refresh ``last_seen`` (and world size and backend, if known)."""
    _executemany(conn, _driver_sql("jobs_upsert", conn.dialect), jobs)


def upsert_sessions(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert the probe sessions of hellos, or refresh what a hello tells of them."""
    table = _T["probe_sessions"]
    refreshed = [c.name for c in table.columns if c.name not in _SESSION_KEPT]
    conn.execute(upsert(conn, table, index_elements=["session"], update_columns=refreshed), rows)
    _note_runs(conn, rows)


def _note_runs(conn: Connection, sessions: Sequence[Mapping[str, Any]]) -> None:
    """The runs these sessions belong to: a new one is stored; a known one starts at
    its earliest rank's attach."""
    table = _T["runs"]
    starts: dict[tuple[str, str], tuple[int, int | None]] = {}
    for row in sessions:
        if not row.get("run_id"):
            continue
        key = (row["job"], row["run_id"])
        start = int(row.get("attached_unix_ns") or row["started_unix_ns"])
        known = starts.get(key)
        starts[key] = (min(start, known[0]) if known else start, row.get("world_size"))
    for (job, run_id), (start, world_size) in starts.items():
        # Kept if another writer stored it first; then its start moves to the earliest.
        conn.execute(
            insert_ignore(conn, table),
            [{"job": job, "run_id": run_id, "started_unix_ns": start, "world_size": world_size}],
        )
        conn.execute(
            update(table)
            .where(table.c.job == job, table.c.run_id == run_id)
            .where(table.c.started_unix_ns > start)
            .values(started_unix_ns=start)
        )


def add_missing_sessions(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Rows for sessions whose hello this aggregator never saw (kept if they exist)."""
    conn.execute(insert_ignore(conn, _T["probe_sessions"]), rows)


def advance_sessions(conn: Connection, progress: Sequence[Mapping[str, Any]]) -> None:
    """Move ``last_seq``, ``last_seen`` and the drop count of sessions (one executemany);
    each mapping holds ``b_session``, ``b_last_seq``, ``b_now`` and ``b_dropped``."""
    _executemany(conn, _driver_sql("session_progress", conn.dialect), progress)


def upsert_configs(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """The configs jobs applied, each run's apart (a job relaunched under the same
    name numbers its configs from 1 again); a version the run sent before is replaced."""
    keys = ["job", "run_id", "version"]
    conn.execute(upsert(conn, _T["configs"], index_elements=keys), rows)


def insert(conn: Connection, table: str, rows: list[dict[str, Any]]) -> None:
    """Plain INSERT of row dicts (the few rows that are not bulk)."""
    conn.execute(_T[table].insert(), rows)


def bulk_insert(
    conn: Connection, table: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]
) -> None:
    """Insert ``rows`` (values of ``columns``, in order) into ``table`` in the
    connection's transaction: ``executemany`` on SQLite, ``COPY`` on PostgreSQL."""
    if not rows:
        return
    dialect = conn.dialect.name
    if dialect == "sqlite":
        _executemany(conn, _insert_sql(table, columns), rows)
    elif dialect == "postgresql":
        _copy(conn, table, columns, rows)
    else:
        raise DatabaseConfigError(
            f"unsupported database dialect {dialect!r}; use sqlite or postgresql"
        )


@functools.cache
def _insert_sql(table: str, columns: tuple[str, ...]) -> str:
    return "INSERT INTO {} ({}) VALUES ({})".format(
        table, ", ".join(columns), ", ".join("?" * len(columns))
    )


def _executemany(conn: Connection, sql: str, rows: Sequence[Any]) -> None:
    """The DBAPI cursor's ``executemany`` on the connection's driver connection (its
    transaction), without SQLAlchemy's per-statement work: the hot path of ingest.

    Database errors are raised as SQLAlchemy's, as ``execute`` would raise them.
    """
    driver = conn.connection.driver_connection
    if driver is None:
        raise RuntimeError("the connection has no driver connection to execute on")
    dbapi_error: type[Exception] = conn.dialect.loaded_dbapi.Error
    try:
        cursor = driver.cursor()
        try:
            cursor.executemany(sql, rows)
        finally:
            cursor.close()
    except dbapi_error as exc:
        raise sa_exc.DBAPIError.instance(sql, None, exc, dbapi_error, dialect=conn.dialect) from exc


def _copy(
    conn: Connection, table: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]
) -> None:
    """``COPY ... FROM STDIN`` on the connection's psycopg connection (its transaction).

    Database errors are raised as SQLAlchemy's (DataError, IntegrityError, ...), as
    ``execute`` would raise them, so callers map them the same way.
    """
    sql = f"COPY {table} ({', '.join(columns)}) FROM STDIN"
    driver = conn.connection.driver_connection
    if driver is None:
        raise RuntimeError("the connection has no driver connection to COPY on")
    dbapi_error: type[Exception] = conn.dialect.loaded_dbapi.Error
    try:
        with driver.cursor() as cursor, cursor.copy(sql) as copy:
            write = copy.write_row
            for row in rows:
                write(row)
    except dbapi_error as exc:
        raise sa_exc.DBAPIError.instance(sql, None, exc, dbapi_error, dialect=conn.dialect) from exc


@functools.cache
def _driver_sql(statement: str, dialect: Dialect) -> str:
    """The SQL of one of ingest's per-request statements for the DBAPI driver of
    ``dialect``, with named parameters (``:name`` for sqlite3, ``%(name)s`` for psycopg),
    compiled once per engine by SQLAlchemy from the models.

    Raises RuntimeError if a parameter needs SQLAlchemy's conversion on its way in (the
    driver would then get the wrong value): such a statement must go through ``execute``.
    """
    compiler_dialect = sqlite.dialect(paramstyle="named") if dialect.name == "sqlite" else dialect
    built = _jobs_upsert(dialect.name) if statement == "jobs_upsert" else _SESSION_PROGRESS
    compiled = built.compile(dialect=compiler_dialect)
    for name, bind in compiled.binds.items():
        if bind.type.bind_processor(compiler_dialect) is not None:
            raise RuntimeError(f"parameter {name} of {statement} needs SQLAlchemy's conversion")
    return compiled.string


@functools.cache
def _jobs_upsert(dialect: str) -> Insert:
    """Insert each job, or refresh ``last_seen`` and, where a hello told them, world
    size and backend (a batch alone does not know them)."""
    table: Table = _T["jobs"]
    if dialect == "postgresql":
        stmt: postgresql.Insert | sqlite.Insert = postgresql.insert(table)
    elif dialect == "sqlite":
        stmt = sqlite.insert(table)
    else:
        raise DatabaseConfigError(
            f"unsupported database dialect {dialect!r}; use sqlite or postgresql"
        )
    return stmt.on_conflict_do_update(
        index_elements=["job"],
        set_={
            "last_seen_unix_ns": stmt.excluded.last_seen_unix_ns,
            "world_size": func.coalesce(stmt.excluded.world_size, table.c.world_size),
            "backend": func.coalesce(stmt.excluded.backend, table.c.backend),
        },
    )


def _session_progress() -> Update:
    table = _T["probe_sessions"]
    return (
        update(table)
        .where(table.c.session == bindparam("b_session"))
        .values(
            last_seq=bindparam("b_last_seq"),
            last_seen_unix_ns=bindparam("b_now"),
            dropped_records_total=bindparam("b_dropped"),
            # The batch that says the probe closed (wire.Closing) sets it; none unsets it.
            closed_unix_ns=func.coalesce(bindparam("b_closed"), table.c.closed_unix_ns),
        )
    )


# Built once: a statement rebuilt per call pays SQLAlchemy's cache-key work each time.
_SESSION_PROGRESS: Final = _session_progress()


def apply_acks(conn: Connection, acks: Iterable[CommandAck], now_ns: int) -> None:
    """Store the probes' acknowledgements of commands."""
    table = _T["commands"]
    for ack in acks:
        conn.execute(
            update(table)
            .where(table.c.id == ack.id)
            .values(
                status=ack.status,
                reason=ack.reason,
                version=ack.version,
                effective_step=ack.effective_step,
                updated_unix_s=now_ns / 1e9,
            )
        )


def mark_sent(conn: Connection, command_ids: list[str], now_ns: int) -> None:
    """Pending commands that went out in an ingest reply are sent."""
    if not command_ids:
        return
    table = _T["commands"]
    conn.execute(
        update(table)
        .where(table.c.id.in_(command_ids))
        .where(table.c.status == "pending")
        .values(status="sent", updated_unix_s=now_ns / 1e9)
    )
