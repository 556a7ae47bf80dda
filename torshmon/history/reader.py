"""The PostgreSQL reader role that history queries connect as.

A read-only transaction and a keyword filter are no privilege boundary for a
superuser (it reads server files, signals backends, reaches other databases through
dblink), and neither is ``SET ROLE`` (the query can set the role back). So queries
connect as a login role that can only read the history tables: ``torshmon db
upgrade`` makes it (``ensure_reader_role``), the query URL defaults to the history
URL with that user (``query_db_url``), and the query path refuses a connection
whose role could do more (``privileges_beyond_reading``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import psycopg
import psycopg.errors
from psycopg import sql
from sqlalchemy.engine import URL, make_url

from torshmon.history.db import DEFAULT_READER_ROLE, normalize_url

__all__ = [
    "DEFAULT_READER_ROLE",
    "PRIVILEGED_ROLES",
    "QUERY_DB_URL_ENV",
    "ReaderSetup",
    "ensure_reader_role",
    "privileges_beyond_reading",
    "query_db_url",
    "reader_of",
    "reader_url",
]

QUERY_DB_URL_ENV: Final = "TORSHMON_QUERY_DB_URL"

#: How the reader role is made; ALTER ROLE takes the same options.
_ROLE_OPTIONS: Final = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"

#: Built-in roles whose members can reach past the history: server files and
#: programs, other sessions (signals, their query text), every table of the cluster.
PRIVILEGED_ROLES: Final[tuple[str, ...]] = (
    "pg_read_server_files",
    "pg_write_server_files",
    "pg_execute_server_program",
    "pg_signal_backend",
    "pg_monitor",
    "pg_read_all_stats",
    "pg_read_all_settings",
    "pg_read_all_data",
    "pg_write_all_data",
)

#: Errors of a role or grant statement that a concurrent ``upgrade`` (another database
#: of the same cluster: roles are cluster-wide) explains; the setup is then redone.
_CONFLICTS: Final = (
    psycopg.errors.UniqueViolation,
    psycopg.errors.DuplicateObject,
    psycopg.errors.InternalError_,  # "tuple concurrently updated"
)

_ATTEMPTS: Final = 3


def history_tables() -> tuple[str, ...]:
    """The names of the history tables (those of the models, not Alembic's own)."""
    from torshmon.history.models import Base

    return tuple(Base.metadata.tables)


def reader_url(history_url: str, role: str = DEFAULT_READER_ROLE) -> str:
    """``history_url`` with its user replaced by ``role`` and its password dropped.

    A SQLite URL is returned as it is: SQLite enforces reading by how it opens the file.
    Raises DatabaseConfigError for a URL that is neither.
    """
    url = normalize_url(history_url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return url
    # Not parsed.set(): it leaves a field given as None unchanged, the password too.
    reader = URL.create(
        parsed.drivername,
        username=role,
        host=parsed.host,
        port=parsed.port,
        database=parsed.database,
        query=parsed.query,
    )
    return reader.render_as_string(hide_password=False)


def query_db_url(explicit: str | None, history_url: str) -> str:
    """The URL queries connect with: ``explicit``, else ``$TORSHMON_QUERY_DB_URL``,
    else the history URL as the reader role (``reader_url``)."""
    if explicit:
        return explicit
    return os.environ.get(QUERY_DB_URL_ENV) or reader_url(history_url)


def reader_of(history_url: str, query_url: str) -> tuple[str | None, str | None]:
    """The role (and password) that ``upgrade`` should make a reader for queries
    through ``query_url``: its user and password when it is a PostgreSQL URL whose
    user is not the history URL's; (None, None) otherwise (SQLite, no user, or the
    history user itself, whom queries refuse)."""
    history, query = make_url(normalize_url(history_url)), make_url(normalize_url(query_url))
    if query.get_backend_name() != "postgresql" or not query.username:
        return None, None
    if query.username == history.username:
        return None, None
    return query.username, query.password


@dataclass(frozen=True, slots=True)
class ReaderSetup:
    """What ``ensure_reader_role`` did (``done``) and what it was not allowed to do
    (``for_admin``: statements an administrator should run, passwords left out);
    ``refused`` says why it did nothing to a role that must not become a reader."""

    role: str
    done: tuple[str, ...]
    for_admin: tuple[str, ...]
    refused: str | None = None


class _NotAReader(Exception):
    """The role named must not be made a reader; the text says why."""


@dataclass(frozen=True, slots=True)
class _Statement:
    run: str
    shown: str


def ensure_reader_role(
    conn: psycopg.Connection[Any],
    role: str = DEFAULT_READER_ROLE,
    *,
    password: str | None = None,
    tables: Sequence[str] | None = None,
) -> ReaderSetup:
    """Make ``role`` a reader of the history ``tables`` (found on the search path).

    The role logs in, is no superuser, cannot create databases or roles, replicate or
    bypass row security, defaults to read-only transactions, may connect to this
    database, use the tables' schema and SELECT the tables, and nothing else is
    granted. Only what is missing is done, so this is idempotent and cheap. Statements
    refused for want of privilege (no CREATEROLE, not the tables' owner) are returned
    in ``for_admin`` instead of raised. ``conn`` must not be in a transaction.
    A superuser, or the user ``conn`` is connected as, is left as it is (``refused``).
    """
    tables = history_tables() if tables is None else tuple(tables)
    for attempt in range(_ATTEMPTS):
        try:
            return _ensure(conn, role, password, tables)
        except _CONFLICTS:
            if attempt == _ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _ensure(
    conn: psycopg.Connection[Any], role: str, password: str | None, tables: Sequence[str]
) -> ReaderSetup:
    done: list[str] = []
    for_admin: list[str] = []
    try:
        with conn.transaction():
            missing = _missing(conn, role, password, tables)
    except _NotAReader as exc:
        return ReaderSetup(role=role, done=(), for_admin=(), refused=str(exc))
    with conn.transaction():
        for statement in missing:
            try:
                with conn.transaction():
                    conn.execute(statement.run)
            except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedObject):
                # UndefinedObject: the role is missing because we may not create it.
                for_admin.append(statement.shown)
            else:
                done.append(statement.shown)
    return ReaderSetup(role=role, done=tuple(done), for_admin=tuple(for_admin))


def _missing(
    conn: psycopg.Connection[Any], role: str, password: str | None, tables: Sequence[str]
) -> list[_Statement]:
    state = conn.execute(
        """
        SELECT r.oid IS NOT NULL,
               coalesce(r.rolcanlogin AND NOT (r.rolsuper OR r.rolcreatedb OR r.rolcreaterole
                        OR r.rolreplication OR r.rolbypassrls), false),
               coalesce('default_transaction_read_only=on' = ANY(s.setconfig), false),
               coalesce(has_database_privilege(r.oid, current_database(), 'CONNECT'), false),
               current_database(),
               coalesce(r.rolsuper, false),
               r.rolname = current_user
        FROM (SELECT 1) AS one
        LEFT JOIN pg_roles AS r ON r.rolname = %(role)s
        LEFT JOIN pg_db_role_setting AS s ON s.setrole = r.oid AND s.setdatabase = 0
        """,
        {"role": role},
    ).fetchone()
    if state is None:
        raise AssertionError("a SELECT without FROM returned no row")
    exists, safe, read_only, can_connect, database, superuser, is_self = state
    if superuser or is_self:
        # Making it a reader would strip an administrator's (or our own) powers.
        what = "a superuser" if superuser else "the user running the upgrade"
        raise _NotAReader(f"refused to make role {role} a reader: it is {what}")
    ident = sql.Identifier(role)
    statements: list[sql.Composable] = []
    shown: list[sql.Composable] = []
    if not exists:
        statements.append(sql.SQL("CREATE ROLE {} " + _ROLE_OPTIONS).format(ident))
    elif not safe:
        statements.append(sql.SQL("ALTER ROLE {} " + _ROLE_OPTIONS).format(ident))
    if not read_only:
        statements.append(
            sql.SQL("ALTER ROLE {} SET default_transaction_read_only = on").format(ident)
        )
    shown.extend(statements)
    if password is not None:
        statements.append(sql.SQL("ALTER ROLE {} PASSWORD {}").format(ident, sql.Literal(password)))
        shown.append(sql.SQL("-- and set its password: \\password {}").format(ident))
    if not can_connect:
        grant = sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
            sql.Identifier(database), ident
        )
        statements.append(grant)
        shown.append(grant)
    grants = _ungranted(conn, role, tables)
    statements.extend(grants)
    shown.extend(grants)
    return [
        _Statement(run=s.as_string(conn), shown=v.as_string(conn))
        for s, v in zip(statements, shown, strict=True)
    ]


def _ungranted(
    conn: psycopg.Connection[Any], role: str, tables: Sequence[str]
) -> list[sql.Composable]:
    """GRANT statements for the schemas and tables the role cannot read yet."""
    # A missing role has no oid: the (strict) privilege functions then give NULL.
    rows = conn.execute(
        """
        SELECT n.nspname, c.relname,
               coalesce(has_schema_privilege(r.oid, n.oid, 'USAGE'), false),
               coalesce(has_table_privilege(r.oid, c.oid, 'SELECT'), false)
        FROM unnest(%(tables)s::text[]) AS t(name)
        JOIN pg_class AS c ON c.oid = to_regclass(quote_ident(t.name))
        JOIN pg_namespace AS n ON n.oid = c.relnamespace
        LEFT JOIN pg_roles AS r ON r.rolname = %(role)s
        ORDER BY n.nspname, c.relname
        """,
        {"role": role, "tables": list(tables)},
    ).fetchall()
    ident = sql.Identifier(role)
    grants: list[sql.Composable] = []
    schemas_done: set[str] = set()
    for schema, table, has_usage, has_select in rows:
        if not has_usage and schema not in schemas_done:
            schemas_done.add(schema)
            grants.append(
                sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), ident)
            )
        if not has_select:
            grants.append(
                sql.SQL("GRANT SELECT ON TABLE {} TO {}").format(
                    sql.Identifier(schema, table), ident
                )
            )
    return grants


def privileges_beyond_reading(
    conn: psycopg.Connection[Any], tables: Sequence[str] | None = None
) -> str | None:
    """Why the role ``conn`` is connected as could do more than read the history, or
    None when it is a plain reader: a superuser, a role that creates roles, replicates
    or bypasses row security, a member of a built-in role that reaches server files,
    other sessions or all data (``PRIVILEGED_ROLES``), the owner of a history table or
    its schema, or a role that may write one. Runs one query in ``conn``'s transaction.
    """
    tables = history_tables() if tables is None else tuple(tables)
    row = conn.execute(
        """
        SELECT r.rolname, r.rolsuper, r.rolcreaterole, r.rolreplication, r.rolbypassrls,
               ARRAY(SELECT b.rolname FROM pg_roles AS b
                     WHERE b.rolname = ANY(%(builtin)s) AND pg_has_role(r.oid, b.oid, 'MEMBER')
                     ORDER BY b.rolname),
               ARRAY(SELECT c.relname FROM unnest(%(tables)s::text[]) AS t(name)
                     JOIN pg_class AS c ON c.oid = to_regclass(quote_ident(t.name))
                     JOIN pg_namespace AS n ON n.oid = c.relnamespace
                     WHERE pg_has_role(r.oid, c.relowner, 'MEMBER')
                        OR pg_has_role(r.oid, n.nspowner, 'MEMBER')
                     ORDER BY c.relname),
               ARRAY(SELECT c.relname FROM unnest(%(tables)s::text[]) AS t(name)
                     JOIN pg_class AS c ON c.oid = to_regclass(quote_ident(t.name))
                     WHERE has_table_privilege(r.oid, c.oid,
                                               'INSERT, UPDATE, DELETE, TRUNCATE, TRIGGER')
                     ORDER BY c.relname)
        FROM pg_roles AS r WHERE r.rolname = current_user
        """,
        {"builtin": list(PRIVILEGED_ROLES), "tables": list(tables)},
    ).fetchone()
    if row is None:
        return "its role is not in pg_roles"
    name, superuser, createrole, replication, bypassrls, members, owned, writable = row
    if superuser:
        return f"superuser {name}"
    for flag, what in (
        (createrole, "CREATEROLE"),
        (replication, "REPLICATION"),
        (bypassrls, "BYPASSRLS"),
    ):
        if flag:
            return f"{name}, a role with {what}"
    if members:
        return f"{name}, a member of {', '.join(members)}"
    if owned:
        return f"{name}, the owner of table {owned[0]} (or of its schema)"
    if writable:
        return f"{name}, who may write table {writable[0]}"
    return None
