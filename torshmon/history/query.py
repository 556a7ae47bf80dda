"""Read-only SQL on the history database, enforced by the database itself.

SQLite: the file is opened ``mode=ro`` with ``PRAGMA query_only=ON`` and an
authorizer that allows only reading (no ATTACH, no writes, no pragma writes).
PostgreSQL: the transaction is ``READ ONLY`` (and so is the connection's default)
with a ``statement_timeout``. On both, one string is one statement: SQLite's driver
refuses several, and PostgreSQL is given the query as a prepared statement, which
cannot hold more than one command.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, Literal

import psycopg
import psycopg.errors
from sqlalchemy.engine import make_url

from torshmon.history.db import (
    DatabaseConfigError,
    connect_sqlite_read_only,
    make_engine,
    normalize_url,
    sqlite_path,
)

OutputFormat = Literal["table", "csv", "json"]
OUTPUT_FORMATS: Final[tuple[str, ...]] = ("table", "csv", "json")

#: Statement kinds a PostgreSQL query may be (its first keyword).
_PG_READ_STATEMENTS: Final = frozenset({"SELECT", "WITH", "VALUES", "TABLE", "EXPLAIN", "SHOW"})

#: SQLite VM instructions between two checks of the deadline.
_PROGRESS_STEPS: Final = 10_000


class QueryError(Exception):
    """A query that cannot run or was refused; the text says why, for the user."""


@dataclass(frozen=True, slots=True)
class QueryResult:
    """Column names and rows of a query; ``truncated`` if rows beyond ``max_rows`` were cut."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    truncated: bool


def run_query(url: str, sql: str, *, max_rows: int = 10000, timeout_s: float = 30) -> QueryResult:
    """Run one read-only SQL statement on the history at ``url``.

    Returns at most ``max_rows`` rows; the statement is cancelled after ``timeout_s``
    seconds. Raises QueryError for a missing database, a write or any other refused or
    failing statement (the message names what was refused), ValueError for a bad
    ``max_rows`` or ``timeout_s``.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if not sql.strip():
        raise QueryError("empty query: give one SQL statement, e.g. SELECT * FROM jobs")
    try:
        url = normalize_url(url)
    except DatabaseConfigError as exc:
        raise QueryError(str(exc)) from exc
    if make_url(url).get_backend_name() == "sqlite":
        return _run_sqlite(url, sql, max_rows, timeout_s)
    return _run_postgresql(url, sql, max_rows, timeout_s)


def _run_sqlite(url: str, sql: str, max_rows: int, timeout_s: float) -> QueryResult:
    path = sqlite_path(url)
    if path is None:
        raise QueryError(f"read-only queries need a SQLite file, not {url!r}")
    try:
        conn, denied = connect_sqlite_read_only(path)
    except FileNotFoundError as exc:
        raise QueryError(f"no history database at {path}") from exc
    except sqlite3.Error as exc:
        raise QueryError(f"cannot open the history database at {path}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
    try:
        cursor = conn.execute(sql)
        return _fetch(cursor.description, cursor.fetchmany(max_rows + 1), max_rows)
    except sqlite3.Error as exc:
        raise _sqlite_error(exc, denied, timeout_s) from exc
    finally:
        conn.close()


def _sqlite_error(exc: sqlite3.Error, denied: list[str], timeout_s: float) -> QueryError:
    text = str(exc)
    if denied:
        return QueryError(
            f"refused: the history is read-only and {denied[0]} is not allowed ({text})"
        )
    if "one statement at a time" in text:
        return QueryError("refused: give one SQL statement per query, not several")
    if text == "interrupted":
        return QueryError(f"query cancelled after the {timeout_s:g} s timeout")
    if "readonly" in text or "read-only" in text or "query_only" in text:
        return QueryError(f"refused: the history is read-only ({text})")
    return QueryError(f"query failed: {text}")


def _run_postgresql(url: str, sql: str, max_rows: int, timeout_s: float) -> QueryResult:
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
            raise QueryError(f"cannot connect to the history database: {exc}") from exc
        try:
            conn = raw.driver_connection
            if not isinstance(conn, psycopg.Connection):
                raise QueryError(f"unexpected PostgreSQL driver connection {type(conn)!r}")
            return _run_psycopg(conn, sql, max_rows, timeout_s)
        finally:
            # Close without the pool's reset: the connection may be mid-COPY or
            # cancelled, and closing it ends the transaction anyway.
            raw.invalidate()
    finally:
        engine.dispose()


def _run_psycopg(
    conn: psycopg.Connection[Any], sql: str, max_rows: int, timeout_s: float
) -> QueryResult:
    try:
        with conn.cursor() as cursor:
            cursor.execute("SET TRANSACTION READ ONLY")
            cursor.execute(f"SET LOCAL statement_timeout = {max(1, round(timeout_s * 1000))}")
            # A read-only transaction may still turn read-write before its first
            # snapshot; this query takes it, so the user's statement cannot.
            cursor.execute("SELECT 1")
            # prepare=True: a prepared statement holds exactly one command.
            cursor.execute(sql, prepare=True)
            if cursor.description is None:
                return QueryResult(columns=(), rows=[], truncated=False)
            return _fetch(cursor.description, cursor.fetchmany(max_rows + 1), max_rows)
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        raise QueryError(f"refused: the history is read-only ({_pg_message(exc)})") from exc
    except psycopg.errors.QueryCanceled as exc:
        raise QueryError(f"query cancelled after the {timeout_s:g} s timeout") from exc
    except psycopg.Error as exc:
        message = _pg_message(exc)
        if "multiple commands" in message:
            raise QueryError("refused: give one SQL statement per query, not several") from exc
        raise QueryError(f"query failed: {message}") from exc


def _first_keyword(sql: str) -> str:
    """The statement's first keyword (upper case), after comments and parentheses."""
    rest = sql
    while True:
        rest = rest.lstrip().lstrip("(")
        if rest.startswith("--"):
            rest = rest.partition("\n")[2]
        elif rest.startswith("/*"):
            rest = _skip_block_comment(rest)
        else:
            break
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


def _fetch(
    description: Sequence[Sequence[Any]] | None, rows: list[Any], max_rows: int
) -> QueryResult:
    columns = tuple(str(d[0]) for d in description) if description else ()
    return QueryResult(
        columns=columns,
        rows=[tuple(r) for r in rows[:max_rows]],
        truncated=len(rows) > max_rows,
    )


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
