"""Engines, migrations and dialect-aware statements for the history database.

SQLite (the embedded default) and PostgreSQL (the scale path) are supported. SQLite
connections run in WAL mode with ``synchronous=NORMAL``, a busy timeout and foreign
keys on; SQLAlchemy, not the ``sqlite3`` module, emits ``BEGIN`` so that a
transaction's reads and writes see one snapshot (``begin_write`` takes the write
lock up front). PostgreSQL goes through psycopg 3.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final
from urllib.parse import quote

from sqlalchemy import Table, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import ConnectionPoolEntry, NullPool
from sqlalchemy.sql.dml import Insert

from torshmon.redact import Redactor, redact_url, url_secrets

log = logging.getLogger(__name__)

DEFAULT_DB_URL: Final = "sqlite:///torshmon.db"
DB_URL_ENV: Final = "TORSHMON_DB_URL"

#: The PostgreSQL login role history queries connect as (see torshmon.history.reader).
DEFAULT_READER_ROLE: Final = "torshmon_reader"

#: How long a SQLite connection waits for another writer's lock, milliseconds.
SQLITE_BUSY_TIMEOUT_MS: Final = 10_000

#: Execution option that makes SQLite start the transaction with BEGIN IMMEDIATE.
BEGIN_IMMEDIATE: Final = "torshmon_sqlite_begin_immediate"

#: Pragmas a read-only SQLite connection may still run with an argument: they only read.
_READ_PRAGMAS: Final = frozenset(
    {
        "table_info",
        "table_xinfo",
        "table_list",
        "index_list",
        "index_info",
        "index_xinfo",
        "foreign_key_list",
        "function_list",
        "pragma_list",
        "collation_list",
        "database_list",
        "module_list",
    }
)

#: Authorizer action codes a read-only SQLite connection allows; all others are denied.
_SQLITE_READ_ACTIONS: Final = frozenset(
    {
        sqlite3.SQLITE_SELECT,
        sqlite3.SQLITE_READ,
        sqlite3.SQLITE_FUNCTION,
        sqlite3.SQLITE_RECURSIVE,
    }
)

_SQLITE_ACTIONS: Final = (
    "ALTER_TABLE",
    "ANALYZE",
    "ATTACH",
    "CREATE_INDEX",
    "CREATE_TABLE",
    "CREATE_TEMP_INDEX",
    "CREATE_TEMP_TABLE",
    "CREATE_TEMP_TRIGGER",
    "CREATE_TEMP_VIEW",
    "CREATE_TRIGGER",
    "CREATE_VIEW",
    "CREATE_VTABLE",
    "DELETE",
    "DETACH",
    "DROP_INDEX",
    "DROP_TABLE",
    "DROP_TEMP_INDEX",
    "DROP_TEMP_TABLE",
    "DROP_TEMP_TRIGGER",
    "DROP_TEMP_VIEW",
    "DROP_TRIGGER",
    "DROP_VIEW",
    "DROP_VTABLE",
    "INSERT",
    "PRAGMA",
    "REINDEX",
    "SAVEPOINT",
    "TRANSACTION",
    "UPDATE",
)
_SQLITE_ACTION_NAMES: Final[dict[int, str]] = {
    getattr(sqlite3, "SQLITE_" + name): name.replace("_", " ") for name in _SQLITE_ACTIONS
}


class DatabaseConfigError(ValueError):
    """A database URL or setup that cannot work; the text names the value and what is allowed."""


def db_url(explicit: str | None) -> str:
    """The history database URL: ``explicit``, else ``$TORSHMON_DB_URL``, else the
    default ``./torshmon.db``; each a URL or a file path (``as_db_url``)."""
    return as_db_url(explicit or os.environ.get(DB_URL_ENV) or DEFAULT_DB_URL)


def as_db_url(text: str) -> str:
    """``--db`` and ``TORSHMON_DB_URL`` as a URL: a URL (``sqlite:///x.db``,
    ``postgresql://...``) as given but a relative SQLite file made absolute, anything
    else a SQLite file path (``./torshmon.db``, ``~/h.db``) as ``sqlite:////abs/path``.

    Absolute, so that what a daemon reports and what a query opens is one file
    wherever the command runs.
    """
    if "://" not in text:
        return f"sqlite:///{os.path.abspath(os.path.expanduser(text))}"
    prefix, sep, rest = text.partition(":///")
    if sep and prefix in ("sqlite", "sqlite+pysqlite") and rest and not rest.startswith("/"):
        path, query_sep, query = rest.partition("?")
        if path and path != ":memory:" and not path.startswith("file:"):
            return f"{prefix}:///{os.path.abspath(path)}{query_sep}{query}"
    return text


def normalize_url(url: str) -> str:
    """``url`` with ``postgresql://`` (and ``postgres://``) mapped to the psycopg 3 driver.

    Raises DatabaseConfigError for a URL that is not SQLite or PostgreSQL; its text
    shows the URL without its password.
    """
    shown = redact_url(url)
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        reason = Redactor(url_secrets(url))(str(exc))
        raise DatabaseConfigError(f"invalid database URL {shown}: {reason}") from None
    # Split the driver name by hand: SQLAlchemy would try to load an unknown dialect.
    backend, _, driver = parsed.drivername.partition("+")
    if backend in ("postgresql", "postgres"):
        if driver not in ("", "psycopg"):
            raise DatabaseConfigError(
                f"database URL {shown} names driver {driver!r}; use postgresql:// "
                "or postgresql+psycopg:// (psycopg 3)"
            )
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif backend == "sqlite":
        if driver not in ("", "pysqlite"):
            raise DatabaseConfigError(
                f"database URL {shown}: use sqlite:///PATH (the sqlite3 driver)"
            )
    else:
        raise DatabaseConfigError(
            f"database URL {shown} is {backend!r}; supported: sqlite:///PATH, postgresql://..."
        )
    return parsed.render_as_string(hide_password=False)


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL; None for an in-memory database or a non-SQLite URL."""
    parsed = make_url(normalize_url(url))
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def make_engine(url: str, *, read_only: bool = False) -> Engine:
    """An Engine for ``url`` (SQLite or PostgreSQL), set up for torshmon.

    ``read_only``: the database itself refuses writes. SQLite opens the file with
    ``mode=ro``, ``PRAGMA query_only=ON`` and an authorizer that denies every action
    but reading (ATTACH, writes, pragma writes); PostgreSQL connections default to
    read-only transactions. Read-only engines do not pool, so no session state a
    query may set outlives its connection. Raises DatabaseConfigError for a bad URL,
    FileNotFoundError for a read-only SQLite file that does not exist.
    """
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(url, read_only=read_only)
    if read_only:
        # Keep options the URL already has (a search_path, say) and add read-only.
        options = str(parsed.query.get("options", ""))
        options = (options + " -c default_transaction_read_only=on").strip()
        return create_engine(url, poolclass=NullPool, connect_args={"options": options})
    return create_engine(url, pool_pre_ping=True)


def _sqlite_engine(url: str, *, read_only: bool) -> Engine:
    path = sqlite_path(url)
    if not read_only:
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    if path is None:
        raise DatabaseConfigError(
            f"a read-only database needs a SQLite file, not {url!r}; use sqlite:///PATH"
        )
    if not path.is_file():
        raise FileNotFoundError(f"no history database at {path}")
    return create_engine(
        "sqlite://", creator=lambda: connect_sqlite_read_only(path)[0], poolclass=NullPool
    )


def connect_sqlite_read_only(path: Path) -> tuple[sqlite3.Connection, list[str]]:
    """Open ``path`` so that SQLite itself refuses every write; see ``make_engine``.

    Returns the connection and the list the authorizer appends denied actions to.
    Raises FileNotFoundError if there is no such file (``mode=ro`` never creates one).
    """
    if not path.is_file():
        raise FileNotFoundError(f"no history database at {path}")
    uri = f"file:{quote(str(path.resolve()))}?mode=ro"
    conn = sqlite3.connect(
        uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000, check_same_thread=False
    )
    # No implicit BEGIN from sqlite3 (the authorizer would deny it); reads autocommit.
    conn.isolation_level = None
    conn.execute("PRAGMA query_only=ON")
    return conn, set_read_only_authorizer(conn)


def set_read_only_authorizer(conn: sqlite3.Connection) -> list[str]:
    """Deny every action on ``conn`` except reads; returns the list the denials go to.

    Each denied action is appended (e.g. ``"INSERT on steps"``) so the caller can name
    it in its error, since sqlite3 only says "not authorized".
    """
    denied: list[str] = []

    def authorize(
        action: int, arg1: str | None, arg2: str | None, _db: str | None, _src: str | None
    ) -> int:
        if action in _SQLITE_READ_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and (arg2 is None or arg1 in _READ_PRAGMAS):
            return sqlite3.SQLITE_OK
        name = _SQLITE_ACTION_NAMES.get(action, f"action {action}")
        if action == sqlite3.SQLITE_PRAGMA:
            denied.append(f"PRAGMA {arg1} = {arg2}")
        elif arg1 in ("sqlite_master", "sqlite_temp_master", "sqlite_schema"):
            # CREATE/DROP reach the authorizer first as a write to the schema table.
            denied.append(f"schema change ({name} on {arg1})")
        elif arg1:
            denied.append(f"{name} on {arg1}")
        else:
            denied.append(name)
        return sqlite3.SQLITE_DENY

    conn.set_authorizer(authorize)
    return denied


def _sqlite_on_connect(dbapi_conn: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    # sqlite3's own transaction handling skips BEGIN before SELECT; SQLAlchemy emits it
    # instead (see _sqlite_on_begin), as its SQLite documentation recommends.
    dbapi_conn.isolation_level = None
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _sqlite_on_begin(conn: Connection) -> None:
    if conn.get_execution_options().get(BEGIN_IMMEDIATE):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("BEGIN")


@contextmanager
def begin_write(engine: Engine) -> Iterator[Connection]:
    """A transaction that will write: on SQLite it takes the write lock at BEGIN.

    A deferred SQLite transaction that reads and then writes fails with "database is
    locked" (no waiting) when another writer committed in between; BEGIN IMMEDIATE
    waits for the lock instead. On PostgreSQL this is ``engine.begin()``.
    """
    with engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            conn = conn.execution_options(**{BEGIN_IMMEDIATE: True})
        with conn.begin():
            yield conn


class WriterConnection:
    """One connection that a single writer keeps for its write transactions, each as
    ``begin_write`` would run it: no pool checkout per transaction and, on PostgreSQL,
    no pre-ping round trip. Not thread-safe: one writer thread uses it.

    A transaction that fails closes the connection and the next one opens a fresh
    connection, so a lost database server costs the write that found out (its caller
    answers 503 and the agent retries), not every later one.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._conn: Connection | None = None

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A write transaction on the kept connection (opened if there is none)."""
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = self._conn = self._open()
        try:
            with conn.begin():
                yield conn
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the kept connection (safe to call twice, and with none open)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _open(self) -> Connection:
        conn = self.engine.connect()
        if conn.dialect.name == "sqlite":
            conn = conn.execution_options(**{BEGIN_IMMEDIATE: True})
        return conn


def schema_differences(conn: Connection) -> list[object]:
    """How the database's schema differs from the models; empty when they match.

    Alembic's autogenerate comparison (tables, columns, types, nullability, indexes,
    keys, comments), plus the names of CHECK constraints, which it does not compare:
    ``("check_constraints", table, in_database, in_models)``.
    """
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import CheckConstraint, inspect

    from torshmon.history.models import Base

    context = MigrationContext.configure(conn, opts={"compare_type": True})
    diffs: list[object] = list(compare_metadata(context, Base.metadata))
    inspector = inspect(conn)
    for table in Base.metadata.tables.values():
        if not inspector.has_table(table.name):
            continue
        in_db = sorted(str(c["name"]) for c in inspector.get_check_constraints(table.name))
        in_models = sorted(str(c.name) for c in table.constraints if isinstance(c, CheckConstraint))
        if in_db != in_models:
            diffs.append(("check_constraints", table.name, in_db, in_models))
    return diffs


def insert_ignore(dialect_source: Engine | Connection, table: Table) -> Insert:
    """``INSERT ... ON CONFLICT DO NOTHING`` into ``table`` for the source's dialect.

    Execute it with a list of row dicts. Raises DatabaseConfigError for a dialect other
    than sqlite or postgresql.
    """
    stmt = _dialect_insert(dialect_source, table)
    return stmt.on_conflict_do_nothing()


def upsert(
    dialect_source: Engine | Connection,
    table: Table,
    *,
    index_elements: Sequence[str] | None = None,
    update_columns: Iterable[str] | None = None,
) -> Insert:
    """``INSERT ... ON CONFLICT (index_elements) DO UPDATE SET col = excluded.col``.

    ``index_elements`` defaults to the primary key, ``update_columns`` to every other
    column. Raises DatabaseConfigError naming an unknown column or dialect.
    """
    keys = list(index_elements or [c.name for c in table.primary_key.columns])
    updates = (
        list(update_columns)
        if update_columns is not None
        else [c.name for c in table.columns if c.name not in keys]
    )
    unknown = [name for name in (*keys, *updates) if name not in table.columns]
    if unknown:
        raise DatabaseConfigError(
            f"no column {', '.join(unknown)} in table {table.name}; "
            f"columns: {', '.join(table.columns.keys())}"
        )
    stmt = _dialect_insert(dialect_source, table)
    if not updates:
        return stmt.on_conflict_do_nothing(index_elements=keys)
    return stmt.on_conflict_do_update(
        index_elements=keys, set_={name: stmt.excluded[name] for name in updates}
    )


def _dialect_insert(
    dialect_source: Engine | Connection, table: Table
) -> postgresql.Insert | sqlite.Insert:
    name = dialect_source.dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise DatabaseConfigError(f"unsupported database dialect {name!r}; use sqlite or postgresql")
