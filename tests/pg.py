"""Throwaway PostgreSQL databases and schemas for tests.

The server is ``$TORSHMON_TEST_PG_URL`` (default: the local trust-auth server,
database ``test``). Each helper makes a uniquely named database or schema, yields a
SQLAlchemy URL pointing at it, and drops it afterwards, even when the test fails::

    from tests.pg import pg_database

    def test_x() -> None:
        with pg_database() as url:  # "postgresql+psycopg://.../torshmon_t_1a2b..."
            upgrade(url)

or, as fixtures, ``from tests.pg import pg_url, pg_schema_url  # noqa: F401`` and
take ``pg_url`` / ``pg_schema_url`` as arguments. A database is fully isolated
(about 0.3 s to make); a schema is cheaper and sets the connection's
``search_path``, so unqualified table names land in it. A server that cannot be
reached fails the test (under CI a skip would count as a failure anyway).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

PG_URL: Final = os.environ.get("TORSHMON_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _conninfo(database: str | None = None) -> str:
    """psycopg conninfo of the test server (optionally another database on it)."""
    url = make_url(PG_URL).set(drivername="postgresql")
    if database is not None:
        url = url.set(database=database)
    return url.render_as_string(hide_password=False)


def _connect(database: str | None = None) -> psycopg.Connection[tuple[object, ...]]:
    try:
        return psycopg.connect(_conninfo(database), autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL test server at {PG_URL} is not reachable: {exc}")


def unique_name(prefix: str = "torshmon_t") -> str:
    """A fresh lower-case identifier: ``prefix`` plus 12 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


@contextmanager
def pg_database(prefix: str = "torshmon_t") -> Iterator[str]:
    """Create an empty database, yield its SQLAlchemy URL, then drop it (FORCE)."""
    name = unique_name(prefix)
    with _connect() as admin:
        # template0 accepts no connections, so concurrent CREATE DATABASE never collides.
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
    try:
        yield (
            make_url(PG_URL)
            .set(drivername="postgresql+psycopg", database=name)
            .render_as_string(hide_password=False)
        )
    finally:
        with _connect() as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@contextmanager
def pg_schema(prefix: str = "torshmon_t") -> Iterator[str]:
    """Create a schema in the test database, yield a URL whose search_path is it, drop it."""
    name = unique_name(prefix)
    with _connect() as admin:
        admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    try:
        url = make_url(PG_URL).set(
            drivername="postgresql+psycopg", query={"options": f"-csearch_path={name}"}
        )
        yield url.render_as_string(hide_password=False)
    finally:
        with _connect() as admin:
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def pg_url() -> Iterator[str]:
    """SQLAlchemy URL of a throwaway PostgreSQL database, dropped after the test."""
    with pg_database() as url:
        yield url


@pytest.fixture
def pg_schema_url() -> Iterator[str]:
    """SQLAlchemy URL of a throwaway schema in the test database, dropped after the test."""
    with pg_schema() as url:
        yield url
