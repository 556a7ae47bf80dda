"""Read-only SQL on the history database, enforced by the database itself.

SQLite: the file is opened ``mode=ro`` with ``PRAGMA query_only=ON`` and an
authorizer that allows only reading (no ATTACH, no writes, no pragma writes).
PostgreSQL: the query connects as a reader role (``torshmon.history.reader``) and is
refused when that role could do more than read the history (a superuser, the
tables' owner, ...): a superuser's read-only transaction still reads server files
and signals other sessions. The transaction is ``READ ONLY`` with a
``statement_timeout``. On both, one string is one statement: SQLite's driver refuses
several, and PostgreSQL parses the query as a prepared statement, which cannot hold
more than one command.

An answer is capped in size as well as in rows: a value over ``max_cell_bytes`` is
refused (SQLite's length limit refuses to make it; PostgreSQL measures each value
server-side and sends NULL instead), and rows stop once the answer passes
``max_answer_bytes`` (measured as the values' text, which is what PostgreSQL sends).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, Literal

import psycopg
import psycopg.errors
from psycopg import pq
from sqlalchemy.engine import make_url

from torshmon.history.db import (
    DatabaseConfigError,
    connect_sqlite_read_only,
    make_engine,
    normalize_url,
    sqlite_path,
)
from torshmon.history.reader import (
    DEFAULT_READER_ROLE,
    QUERY_DB_URL_ENV,
    privileges_beyond_reading,
)

log = logging.getLogger(__name__)

OutputFormat = Literal["table", "csv", "json"]
OUTPUT_FORMATS: Final[tuple[str, ...]] = ("table", "csv", "json")

#: The largest value an answer may hold, bytes (a step row is a few hundred).
DEFAULT_MAX_CELL_BYTES: Final = 4 * 1024 * 1024
#: The most an answer may hold in all, bytes: rows past it are cut (``truncated``).
DEFAULT_MAX_ANSWER_BYTES: Final = 64 * 1024 * 1024

#: Statement kinds a PostgreSQL query may be (its first keyword).
_PG_READ_STATEMENTS: Final = frozenset({"SELECT", "WITH", "VALUES", "TABLE", "EXPLAIN", "SHOW"})
#: Those that can be a subquery, so the server measures their values before sending.
_PG_MEASURED_STATEMENTS: Final = frozenset({"SELECT", "WITH", "VALUES", "TABLE"})

#: SQLite VM instructions between two checks of the deadline.
_PROGRESS_STEPS: Final = 10_000

#: The end of every refusal of a privileged role or a reader that cannot connect.
_READER_HINT: Final = (
    f"run `torshmon db upgrade` to create the reader role {DEFAULT_READER_ROLE}, "
    f"or give a reader's URL (--query-db, {QUERY_DB_URL_ENV})"
)


class QueryError(Exception):
    """A query that cannot run or was refused; the text says why, for the user."""


class HistoryUnreachable(QueryError):
    """The history cannot be reached at all (a bad URL, no such file, no connection),
    whatever the query; the text says why."""


class Interrupt:
    """Stops a running query from another thread: ``interrupt(reason)``, thread-safe.

    Given to ``run_query``, which binds it to the query's connection (SQLite's
    ``interrupt``, a PostgreSQL cancel request); the query then fails with a
    QueryError naming ``reason``. Interrupting before the query runs stops it as it
    starts; interrupting twice, or after it ended, does nothing.
    """

    __slots__ = ("_lock", "_reason", "_stop")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._stop: Callable[[], object] | None = None

    @property
    def reason(self) -> str | None:
        """Why the query was interrupted; None if it was not."""
        return self._reason

    def interrupt(self, reason: str) -> None:
        """Stop the query (if it runs) with ``reason``. On PostgreSQL this sends a cancel
        request (a connection to the server): call it off an event loop. Never raises:
        a cancel that fails leaves the query to its statement timeout."""
        with self._lock:  # so the connection cannot close under the stop call
            if self._reason is not None:
                return
            self._reason = reason
            if self._stop is not None:
                try:
                    self._stop()
                except Exception as exc:
                    log.warning("a history query could not be cancelled: %s", exc)

    def _bind(self, stop: Callable[[], object]) -> None:
        with self._lock:
            self._stop = stop
            if self._reason is not None:
                raise QueryError(f"query cancelled: {self._reason}")

    def _unbind(self) -> None:
        with self._lock:
            self._stop = None


@dataclass(frozen=True, slots=True)
class QueryResult:
    """Column names and rows of a query; ``truncated`` if rows beyond ``max_rows`` or
    ``max_answer_bytes`` were cut."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    truncated: bool


@dataclass(frozen=True, slots=True)
class _Limits:
    max_rows: int
    timeout_s: float
    max_cell_bytes: int
    max_answer_bytes: int


def run_query(
    url: str,
    sql: str,
    *,
    max_rows: int = 10000,
    timeout_s: float = 30,
    max_cell_bytes: int = DEFAULT_MAX_CELL_BYTES,
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    interrupt: Interrupt | None = None,
) -> QueryResult:
    """Run one read-only SQL statement on the history at ``url``.

    On PostgreSQL ``url`` is the query URL, a reader role's (``reader.query_db_url``).
    Returns at most ``max_rows`` rows and about ``max_answer_bytes`` of values; the
    statement is cancelled after ``timeout_s`` seconds, or when ``interrupt`` is
    interrupted (from another thread). The query opens a connection of its own and
    closes it before returning. Raises QueryError for a
    missing database, a privileged PostgreSQL role, a write, a value over
    ``max_cell_bytes``, a first row over ``max_answer_bytes``, or any other refused
    or failing statement (the message names what was refused); ValueError for a bad
    limit.
    """
    for name, value in (
        ("max_rows", max_rows),
        ("max_cell_bytes", max_cell_bytes),
        ("max_answer_bytes", max_answer_bytes),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if not sql.strip():
        raise QueryError("empty query: give one SQL statement, e.g. SELECT * FROM jobs")
    try:
        url = normalize_url(url)
    except DatabaseConfigError as exc:
        raise HistoryUnreachable(str(exc)) from exc
    limits = _Limits(max_rows, timeout_s, max_cell_bytes, max_answer_bytes)
    interrupt = Interrupt() if interrupt is None else interrupt
    if make_url(url).get_backend_name() == "sqlite":
        return _run_sqlite(url, sql, limits, interrupt)
    return _run_postgresql(url, sql, limits, interrupt)


def _run_sqlite(url: str, sql: str, limits: _Limits, interrupt: Interrupt) -> QueryResult:
    path = sqlite_path(url)
    if path is None:
        raise HistoryUnreachable(f"read-only queries need a SQLite file, not {url!r}")
    try:
        conn, denied = connect_sqlite_read_only(path)
    except FileNotFoundError as exc:
        raise HistoryUnreachable(
            f"no history database at {path}; run `torshmon db upgrade --db {path}` or "
            "name another --db"
        ) from exc
    except sqlite3.Error as exc:
        raise HistoryUnreachable(f"cannot open the history database at {path}: {exc}") from exc
    deadline = time.monotonic() + limits.timeout_s
    # The handler also ends an interrupted query: SQLite's own interrupt does nothing
    # when it comes before the statement runs (between ``_bind`` and ``execute``, or
    # between two fetches), and the query then ran on to its timeout (a CI run, stop 52).
    conn.set_progress_handler(
        lambda: int(interrupt.reason is not None or time.monotonic() > deadline),
        _PROGRESS_STEPS,
    )
    # SQLite then refuses to make any longer string or blob (randomblob, zeroblob,
    # group_concat, ...), so none is built in this process's memory.
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limits.max_cell_bytes)
    try:
        interrupt._bind(conn.interrupt)
        cursor = conn.execute(sql)
        columns = _names(cursor.description)
        sized = _sized_rows(cursor, limits)
        return _collect(columns, sized, limits)
    except sqlite3.Error as exc:
        raise _sqlite_error(exc, denied, limits, interrupt) from exc
    finally:
        interrupt._unbind()
        conn.close()


def _sqlite_error(
    exc: sqlite3.Error, denied: list[str], limits: _Limits, interrupt: Interrupt
) -> QueryError:
    text = str(exc)
    if interrupt.reason is not None and text == "interrupted":
        return QueryError(f"query cancelled: {interrupt.reason}")
    if denied:
        return QueryError(
            f"refused: the history is read-only and {denied[0]} is not allowed ({text})"
        )
    if "one statement at a time" in text:
        return QueryError("refused: give one SQL statement per query, not several")
    if text == "interrupted":
        return QueryError(f"query cancelled after the {limits.timeout_s:g} s timeout")
    if "readonly" in text or "read-only" in text or "query_only" in text:
        return QueryError(f"refused: the history is read-only ({text})")
    if "too big" in text or "too long" in text:
        return _cell_cap_error(limits.max_cell_bytes, text)
    return QueryError(f"query failed: {text}")


def _run_postgresql(url: str, sql: str, limits: _Limits, interrupt: Interrupt) -> QueryResult:
    keyword = _first_keyword(sql)
    if keyword not in _PG_READ_STATEMENTS:
        # A read-only transaction still allows a few things that are not reads of the
        # history (COPY ... TO a server file, LISTEN, ...): only queries may run.
        raise QueryError(
            f"refused: {keyword or 'this statement'} is not a query; the history is "
            f"read-only and takes {', '.join(sorted(_PG_READ_STATEMENTS))} statements"
        )
    engine = make_engine(url, read_only=True)
    try:
        try:
            raw = engine.raw_connection()
        except Exception as exc:
            raise _connect_error(url, exc) from exc
        try:
            conn = raw.driver_connection
            if not isinstance(conn, psycopg.Connection):
                raise QueryError(f"unexpected PostgreSQL driver connection {type(conn)!r}")
            interrupt._bind(conn.cancel)
            try:
                return _run_psycopg(conn, sql, keyword in _PG_MEASURED_STATEMENTS, limits)
            except QueryError:
                if interrupt.reason is not None:
                    raise QueryError(f"query cancelled: {interrupt.reason}") from None
                raise
            finally:
                interrupt._unbind()
        finally:
            # Close without the pool's reset: the connection may be mid-COPY or
            # cancelled, and closing it ends the transaction anyway.
            raw.invalidate()
    finally:
        engine.dispose()


def _connect_error(url: str, exc: Exception) -> HistoryUnreachable:
    user = make_url(url).username or "the default user"
    detail = " ".join(str(getattr(exc, "orig", None) or exc).split())
    hint = ""
    if "password authentication failed" in detail or (
        "role" in detail and "does not exist" in detail
    ):
        hint = "; " + _READER_HINT
    return HistoryUnreachable(f"cannot connect to the history database as {user}: {detail}{hint}")


def _run_psycopg(
    conn: psycopg.Connection[Any], sql: str, measured: bool, limits: _Limits
) -> QueryResult:
    try:
        with conn.cursor() as cursor:
            cursor.execute("SET TRANSACTION READ ONLY")
            timeout_ms = max(1, round(limits.timeout_s * 1000))
            cursor.execute(f"SET LOCAL statement_timeout = {timeout_ms}")
            # A read-only transaction may still turn read-write before its first
            # snapshot; this query takes it, so the user's statement cannot.
            cursor.execute("SELECT 1")
            refusal = privileges_beyond_reading(conn)
            if refusal is not None:
                raise QueryError(f"refused: queries would run as {refusal}; {_READER_HINT}")
            body, columns = _parsed(conn, sql)
            if measured and columns:
                statement = _measured_statement(body, len(columns), limits)
                sized: Iterable[tuple[tuple[Any, ...], int]] = _measured_rows(
                    cursor.stream(statement), limits
                )
            else:
                # EXPLAIN and SHOW cannot be a subquery: their rows are measured as they
                # arrive (a plan line may hold a constant the planner folded).
                sized = _sized_rows(cursor.stream(body), limits)
            return _collect(columns, sized, limits)
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        raise QueryError(f"refused: the history is read-only ({_pg_message(exc)})") from exc
    except psycopg.errors.InsufficientPrivilege as exc:
        raise QueryError(
            f"refused: queries may only read the history ({_pg_message(exc)})"
        ) from exc
    except psycopg.errors.QueryCanceled as exc:
        raise QueryError(f"query cancelled after the {limits.timeout_s:g} s timeout") from exc
    except psycopg.Error as exc:
        raise _pg_error(exc) from exc


def _pg_error(exc: psycopg.Error) -> QueryError:
    message = _pg_message(exc)
    if "multiple commands" in message:
        return QueryError("refused: give one SQL statement per query, not several")
    # Measured as a subquery, a data-modifying WITH is refused by the parser rather
    # than by the read-only transaction.
    if "data-modifying statement" in message:
        return QueryError(f"refused: the history is read-only ({message})")
    return QueryError(f"query failed: {message}")


def _parsed(conn: psycopg.Connection[Any], sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql`` without its final semicolon if that parses, else as it is; and its columns.

    Whichever is returned parsed as one statement of its own (see _measured_statement).
    """
    body = _without_final_semicolon(sql)
    if body != sql:
        try:
            with conn.transaction():  # a savepoint: a failed parse aborts the transaction
                return body, _describe(conn, body)
        except psycopg.Error:
            pass  # the semicolon cut was inside a string or a comment
    return sql, _describe(conn, sql)


def _describe(conn: psycopg.Connection[Any], body: str) -> tuple[str, ...]:
    """The column names of ``body``, parsed as one prepared statement but not run.

    Raises the server's error (a syntax error, several statements, ...).
    """
    encoding = conn.info.encoding
    result = conn.pgconn.prepare(b"", body.encode(encoding))
    if result.status == pq.ExecStatus.COMMAND_OK:
        result = conn.pgconn.describe_prepared(b"")
    if result.status != pq.ExecStatus.COMMAND_OK:
        raise psycopg.errors.error_from_result(result, encoding=encoding)
    return tuple((result.fname(i) or b"").decode(encoding) for i in range(result.nfields))


def _measured_statement(body: str, count: int, limits: _Limits) -> str:
    """``body`` as a subquery whose values are measured (as text) by the server.

    Each row comes with its size and its largest value's, and with its values NULL
    when either is over the caps, so no oversized value crosses the wire. ``body``
    parsed as a statement of its own (``_describe``), so its parentheses balance and
    it cannot close the subquery early. ``OFFSET 0`` keeps the subquery from being
    flattened, so a volatile value is measured as it is sent.
    """
    columns = ", ".join(f"c{i}" for i in range(1, count + 1))
    lengths = ", ".join(f"(octet_length(_q.c{i}::text))" for i in range(1, count + 1))
    cells = ", ".join(
        f"CASE WHEN _s.too_big THEN NULL ELSE _s.c{i} END" for i in range(1, count + 1)
    )
    return (
        f"SELECT {cells}, _s.row_bytes, _s.cell_bytes FROM (\n"
        f"SELECT _q.*, _z.row_bytes, _z.cell_bytes, (_z.cell_bytes > {limits.max_cell_bytes}"
        f" OR _z.row_bytes > {limits.max_answer_bytes}) AS too_big\n"
        f"FROM (SELECT * FROM (\n{body}\n) AS _u OFFSET 0) AS _q({columns})\n"
        f"CROSS JOIN LATERAL (SELECT coalesce(sum(l), 0) AS row_bytes,"
        f" coalesce(max(l), 0) AS cell_bytes FROM (VALUES {lengths}) AS _v(l)) AS _z\n"
        f") AS _s LIMIT {limits.max_rows + 1}"
    )


def _measured_rows(
    rows: Iterable[tuple[Any, ...]], limits: _Limits
) -> Iterator[tuple[tuple[Any, ...], int]]:
    for row in rows:
        *cells, row_bytes, cell_bytes = row
        if cell_bytes > limits.max_cell_bytes:
            raise _cell_cap_error(limits.max_cell_bytes, f"one is {cell_bytes} bytes")
        yield tuple(cells), row_bytes


def _collect(
    columns: tuple[str, ...], sized: Iterable[tuple[tuple[Any, ...], int]], limits: _Limits
) -> QueryResult:
    """The rows of ``sized`` (row, size in bytes) up to the row and answer caps.

    Stops reading at the first row past a cap. Raises QueryError when even the first
    row is over ``max_answer_bytes``.
    """
    rows: list[tuple[Any, ...]] = []
    total = 0
    for row, size in sized:
        total += size
        if len(rows) == limits.max_rows or total > limits.max_answer_bytes:
            if not rows:
                raise QueryError(
                    f"refused: one row of the answer is over the {_mib(limits.max_answer_bytes)}"
                    " cap on an answer; select fewer or smaller columns"
                )
            return QueryResult(columns=columns, rows=rows, truncated=True)
        rows.append(row)
    return QueryResult(columns=columns, rows=rows, truncated=False)


def _cell_cap_error(max_cell_bytes: int, detail: str) -> QueryError:
    return QueryError(
        f"refused: a value of the answer is over the {_mib(max_cell_bytes)} cap on one value"
        f" ({detail}); select a part of it, e.g. substr(column, 1, 1000)"
    )


def _mib(size_bytes: int) -> str:
    if size_bytes % (1024 * 1024) == 0:
        return f"{size_bytes // (1024 * 1024)} MiB"
    return f"{size_bytes} byte"


def _sized_rows(
    rows: Iterable[Sequence[Any]], limits: _Limits
) -> Iterator[tuple[tuple[Any, ...], int]]:
    """Each row and about its size as text (8 bytes for a number); QueryError for a
    value over ``max_cell_bytes``."""
    for row in rows:
        size = 0
        for value in row:
            cell = _cell_bytes(value)
            if cell > limits.max_cell_bytes:
                raise _cell_cap_error(limits.max_cell_bytes, f"one is {cell} bytes")
            size += cell
        yield tuple(row), size


def _cell_bytes(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode("utf-8", "replace"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    return 8


def _names(description: Sequence[Sequence[Any]] | None) -> tuple[str, ...]:
    return tuple(str(d[0]) for d in description) if description else ()


def _without_final_semicolon(sql: str) -> str:
    """``sql`` without final semicolons (and comments after them), to be a subquery.

    A semicolon inside a string or comment may be cut too; the text is then no
    statement any more, and parsing it says so (``_parsed``).
    """
    body = sql.rstrip()
    while (end := body.rfind(";")) >= 0 and not _skip_comments(body[end + 1 :]):
        body = body[:end].rstrip()
    return body


def _skip_comments(text: str) -> str:
    """``text`` after its leading white space and comments."""
    rest = text
    while True:
        rest = rest.lstrip()
        if rest.startswith("--"):
            rest = rest.partition("\n")[2]
        elif rest.startswith("/*"):
            rest = _skip_block_comment(rest)
        else:
            return rest


def _first_keyword(sql: str) -> str:
    """The statement's first keyword (upper case), after comments and parentheses."""
    rest = _skip_comments(sql)
    while rest.startswith("("):
        rest = _skip_comments(rest[1:])
    match = re.match(r"[A-Za-z_]+", rest)
    return match.group(0).upper() if match else ""


def _skip_block_comment(text: str) -> str:
    # PostgreSQL block comments nest.
    depth, i = 0, 0
    while i < len(text):
        if text.startswith("/*", i):
            depth, i = depth + 1, i + 2
        elif text.startswith("*/", i):
            depth, i = depth - 1, i + 2
            if depth == 0:
                return text[i:]
        else:
            i += 1
    return ""


def _pg_message(exc: psycopg.Error) -> str:
    return exc.diag.message_primary or str(exc).strip()


def format_result(result: QueryResult, fmt: str) -> str:
    """Render ``result`` as ``table`` (aligned text), ``csv`` or ``json`` (list of objects).

    Raises ValueError for another ``fmt``.
    """
    if fmt == "table":
        return _format_table(result)
    if fmt == "csv":
        return _format_csv(result)
    if fmt == "json":
        return _format_json(result)
    raise ValueError(f"unknown output format {fmt!r}; choose one of {', '.join(OUTPUT_FORMATS)}")


def _format_table(result: QueryResult) -> str:
    cells = [[_cell_text(v) for v in row] for row in result.rows]
    widths = [len(name) for name in result.columns]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    numeric = [
        bool(result.rows) and all(_is_number(row[i]) or row[i] is None for row in result.rows)
        for i in range(len(result.columns))
    ]

    def line(values: Sequence[str], align: bool) -> str:
        parts = [
            v.rjust(w) if align and num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return " | ".join(parts).rstrip()

    lines = [line(result.columns, align=False), "-+-".join("-" * w for w in widths)]
    lines.extend(line(row, align=True) for row in cells)
    count = len(result.rows)
    footer = f"({count} row{'' if count == 1 else 's'}"
    footer += ", truncated)" if result.truncated else ")"
    lines.append(footer)
    return "\n".join(lines) + "\n"


def _format_csv(result: QueryResult) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(result.columns)
    writer.writerows([["" if v is None else _cell_text(v) for v in row] for row in result.rows])
    return out.getvalue()


def _format_json(result: QueryResult) -> str:
    names = _unique_names(result.columns)
    objects = [
        {name: json_value(value) for name, value in zip(names, row, strict=True)}
        for row in result.rows
    ]
    return json.dumps(objects, indent=1, allow_nan=False) + "\n"


def _unique_names(columns: Sequence[str]) -> list[str]:
    """Column names as JSON keys: a repeated name (a join) gets ``_2``, ``_3``, ..."""
    seen: dict[str, int] = {}
    names = []
    for name in columns:
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return names


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, Decimal)) and not isinstance(value, bool)


def _cell_text(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def json_value(value: object) -> object:
    """A cell as strict JSON has it: NaN and infinities as null, bytes as hex, a
    Decimal as a number, anything else as its text (the CLI's and the HTTP API's ``json``)."""
    if value is None or isinstance(value, (bool, int, str, dict, list)):
        return value
    if isinstance(value, float):
        # JSON has no NaN or infinity.
        return value if math.isfinite(value) else None
    if isinstance(value, Decimal):
        return float(value) if value.is_finite() else None
    return _cell_text(value)
