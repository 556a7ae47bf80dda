"""Alembic environment of the torshmon history schema.

``torshmon.history.migrate.upgrade`` passes an open connection in
``config.attributes["connection"]`` (holding its lock); the alembic command line
connects to ``TORSHMON_DB_URL`` or, failing that, ``sqlalchemy.url`` of alembic.ini.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection

from torshmon.history.db import make_engine, normalize_url
from torshmon.history.models import Base

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and "connection" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode copies the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )


def run_migrations_offline() -> None:
    url = os.environ.get("TORSHMON_DB_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: set TORSHMON_DB_URL or sqlalchemy.url")
    context.configure(
        url=normalize_url(url),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = os.environ.get("TORSHMON_DB_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: set TORSHMON_DB_URL or sqlalchemy.url")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
