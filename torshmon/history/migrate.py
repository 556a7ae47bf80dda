"""Migrations: ``upgrade`` takes a history database to the newest schema (Alembic head)
and, on PostgreSQL, sets up the reader role history queries run as.

Apart from ``db`` (engines, connections) and ``reader`` (the reader role) so that
neither of those two needs the other's internals; this module uses both.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Final

import psycopg
from sqlalchemy import text
from sqlalchemy.engine import Connection

from torshmon.history.db import (
    BEGIN_IMMEDIATE,
    DEFAULT_READER_ROLE,
    DatabaseConfigError,
    make_engine,
    normalize_url,
)
from torshmon.history.reader import ReaderSetup, ensure_reader_role

log = logging.getLogger(__name__)

#: pg_advisory_lock key serialising ``upgrade`` across processes (any fixed bigint).
UPGRADE_LOCK_KEY: Final = 0x746F7273686D6E01

_UPGRADE_THREAD_LOCK: Final = threading.Lock()


def alembic_dir() -> Path:
    """The package's Alembic migrations (``torshmon/history/migrations``), shipped in the
    wheel; DatabaseConfigError if an install lost them."""
    path = Path(__file__).resolve().parent / "migrations"
    if not (path / "env.py").is_file():
        raise DatabaseConfigError(
            f"no Alembic migrations at {path}: the torshmon install is incomplete; reinstall it"
        )
    return path


def upgrade(
    url: str,
    *,
    reader_role: str | None = DEFAULT_READER_ROLE,
    reader_password: str | None = None,
) -> ReaderSetup | None:
    """Migrate the database at ``url`` to the newest schema (Alembic head).

    On PostgreSQL it then makes ``reader_role`` (unless None) a login role that can
    only read the history tables, with ``reader_password`` if given, and returns what
    it did and what an administrator has to do because this user may not (see
    ``reader.ensure_reader_role``); on SQLite it returns None.

    Safe on an up-to-date database, and concurrently from several processes: on
    PostgreSQL a session advisory lock serialises them, on SQLite the write lock.
    Threads of one process take turns (Alembic's ``context`` is process-global).
    """
    from alembic import command
    from alembic.config import Config

    url = normalize_url(url)
    config = Config()
    config.set_main_option("script_location", str(alembic_dir()))
    engine = make_engine(url)
    setup = None
    try:
        with _UPGRADE_THREAD_LOCK, engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": UPGRADE_LOCK_KEY})
                conn.commit()
                try:
                    _run_alembic(command, config, conn)
                    if reader_role is not None:
                        setup = ensure_reader_role(
                            _psycopg_connection(conn), reader_role, password=reader_password
                        )
                finally:
                    if conn.in_transaction():
                        conn.rollback()  # a failed migration left it aborted
                    conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": UPGRADE_LOCK_KEY})
                    conn.commit()
            else:
                conn = conn.execution_options(**{BEGIN_IMMEDIATE: True})
                _run_alembic(command, config, conn)
    finally:
        engine.dispose()
    return setup


def _psycopg_connection(conn: Connection) -> psycopg.Connection[Any]:
    driver = conn.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise DatabaseConfigError(f"unexpected PostgreSQL driver connection {type(driver)!r}")
    return driver


def _run_alembic(command: Any, config: Any, conn: Connection) -> None:
    config.attributes["connection"] = conn
    command.upgrade(config, "head")
    if conn.in_transaction():
        conn.commit()
    log.info("history database at Alembic head")


__all__ = ["UPGRADE_LOCK_KEY", "alembic_dir", "upgrade"]
