"""The history layer on the real PostgreSQL server: migrations, read-only queries, retention."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import insert, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from tests.pg import pg_database, pg_schema_url, pg_url  # noqa: F401  (fixtures)
from tests.test_history_retention import NOW, T0, check_retention, expected_rollups, fill
from torshmon.history.db import insert_ignore, make_engine, schema_differences, upsert
from torshmon.history.migrate import UPGRADE_LOCK_KEY, alembic_dir, upgrade
from torshmon.history.models import Base
from torshmon.history.query import QueryError, format_result, run_query
from torshmon.history.reader import reader_url
from torshmon.history.retention import RETENTION_LOCK_KEY, RetentionReport, apply_retention

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
T = Base.metadata.tables
JOBS = [
    {
        "job": "j1",
        "world_size": 2,
        "backend": "gloo",
        "first_seen_unix_ns": 1,
        "last_seen_unix_ns": 2,
        "aggregator_id": None,
    },
    {
        "job": "j2",
        "world_size": 8,
        "backend": "nccl",
        "first_seen_unix_ns": 3,
        "last_seen_unix_ns": 4,
        "aggregator_id": "agg-a",
    },
]

#: Refused statements and words the refusal must contain. The first group never reaches
#: the server (not a query); the second is refused by the server: by the read-only
#: transaction, or by the parser where the query is measured as a subquery.
REFUSED = [
    ("INSERT INTO jobs VALUES ('x', 1, 'gloo', 1, 1, NULL)", "INSERT is not a query"),
    ("UPDATE jobs SET world_size = 3", "UPDATE is not a query"),
    ("DELETE FROM jobs", "DELETE is not a query"),
    ("DROP TABLE jobs", "DROP is not a query"),
    ("CREATE TABLE x (a int)", "CREATE is not a query"),
    ("ATTACH DATABASE 'x' AS x", "ATTACH is not a query"),
    ("PRAGMA journal_mode=DELETE", "PRAGMA is not a query"),
    ("PRAGMA user_version=5", "PRAGMA is not a query"),
    ("COPY jobs TO '/tmp/torshmon-copy-test'", "COPY is not a query"),
    ("SET default_transaction_read_only = off", "SET is not a query"),
    ("/* hidden */ -- comment\n DELETE FROM jobs", "DELETE is not a query"),
    ("SELECT 1; DELETE FROM jobs", "one SQL statement"),
    (
        "WITH d AS (DELETE FROM jobs RETURNING *) SELECT * FROM d",
        "read-only (WITH clause containing a data-modifying statement",
    ),
    (
        "EXPLAIN ANALYZE INSERT INTO jobs VALUES ('x', 1, 'gloo', 1, 1, NULL)",
        "cannot execute INSERT in a read-only transaction",
    ),
    ("SELECT * INTO jobs_copy FROM jobs", "cannot execute SELECT INTO in a read-only"),
    ("SELECT * FROM jobs FOR UPDATE", "cannot execute SELECT FOR UPDATE in a read-only"),
    # The reader role may not use the sequence (a superuser would be told read-only).
    ("SELECT nextval('steps_id_seq')", "permission denied for sequence steps_id_seq"),
]


@pytest.fixture(scope="module")
def history_db() -> Iterator[str]:
    """One upgraded database with two jobs, shared by the read-only query tests; the
    URL of its owner (a superuser)."""
    with pg_database() as url:
        upgrade(url)
        engine = make_engine(url)
        with engine.begin() as conn:
            conn.execute(insert(T["jobs"]), JOBS)
        engine.dispose()
        yield url


@pytest.fixture
def query_db(history_db: str) -> str:
    """The query URL of ``history_db``: its reader role's."""
    return reader_url(history_db)


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:  # noqa: F811
    upgrade(pg_url)
    engine = make_engine(pg_url)
    try:
        yield engine
    finally:
        engine.dispose()


def snapshot(url: str) -> tuple[object, ...]:
    """Everything a refused statement might have changed."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return (
                conn.execute(text("SELECT * FROM jobs ORDER BY job")).all(),
                conn.execute(
                    text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
                ).all(),
                conn.execute(text("SELECT last_value, is_called FROM steps_id_seq")).all(),
            )
    finally:
        engine.dispose()


# -- migrations --------------------------------------------------------------------------


def test_upgrade_empty_database_gives_exactly_the_models_schema(engine: Engine) -> None:
    with engine.connect() as conn:
        assert schema_differences(conn) == []
        identity = conn.execute(
            text(
                "SELECT data_type, is_identity FROM information_schema.columns "
                "WHERE table_name = 'steps' AND column_name = 'id'"
            )
        ).one()
    assert tuple(identity) == ("bigint", "YES")
    upgrade(engine.url.render_as_string(hide_password=False))  # again: a no-op


def test_upgrade_from_two_processes_at_once(pg_url: str) -> None:  # noqa: F811
    code = "import sys; from torshmon.history.migrate import upgrade; upgrade(sys.argv[1])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, pg_url],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            head = ScriptDirectory(str(alembic_dir())).get_current_head()
            assert conn.execute(text("SELECT version_num FROM alembic_version")).all() == [(head,)]
            assert schema_differences(conn) == []
            # The session lock was given back.
            assert conn.execute(
                text("SELECT pg_try_advisory_lock(:k)"), {"k": UPGRADE_LOCK_KEY}
            ).scalar_one()
    finally:
        engine.dispose()


def test_upgrade_into_a_throwaway_schema(pg_schema_url: str) -> None:  # noqa: F811
    upgrade(pg_schema_url)
    engine = make_engine(pg_schema_url)
    try:
        with engine.connect() as conn:
            schema = conn.execute(text("SELECT current_schema()")).scalar_one()
            assert schema.startswith("torshmon_t_")
            tables = conn.execute(
                text("SELECT tablename FROM pg_tables WHERE schemaname = :s"), {"s": schema}
            ).scalars()
            assert set(tables) == set(T) | {"alembic_version"}
            assert schema_differences(conn) == []
    finally:
        engine.dispose()
    # Read-only connections, as the reader role, keep the schema's search_path.
    assert run_query(reader_url(pg_schema_url), "SELECT count(*) FROM jobs").rows == [(0,)]


def test_bulk_insert_insert_ignore_and_upsert(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert_ignore(conn, T["jobs"]), JOBS)
        conn.execute(insert_ignore(conn, T["jobs"]), [{**JOBS[0], "world_size": 99}])
        conn.execute(
            upsert(conn, T["jobs"], update_columns=["last_seen_unix_ns"]),
            [{**JOBS[0], "world_size": 99, "last_seen_unix_ns": 50}],
        )
        row = conn.execute(
            select(T["jobs"].c.world_size, T["jobs"].c.last_seen_unix_ns).where(
                T["jobs"].c.job == "j1"
            )
        ).one()
        assert tuple(row) == (2, 50)
        fill_steps = [
            {
                "job": "j1",
                "rank": 0,
                "node": "n",
                "step": i,
                "end_unix_ns": i,
                "loss_nonfinite": False,
                "config_version": 0,
            }
            for i in range(3)
        ]
        conn.execute(insert(T["steps"]), fill_steps)
        assert conn.execute(select(T["steps"].c.id).order_by("id")).scalars().all() == [1, 2, 3]


# -- read-only queries -------------------------------------------------------------------


def test_select_in_every_format(query_db: str) -> None:
    result = run_query(query_db, "SELECT job, world_size, aggregator_id FROM jobs ORDER BY job")
    assert result.columns == ("job", "world_size", "aggregator_id")
    assert result.rows == [("j1", 2, None), ("j2", 8, "agg-a")]
    assert format_result(result, "table") == (
        "job | world_size | aggregator_id\n"
        "----+------------+--------------\n"
        "j1  |          2 | NULL\n"
        "j2  |          8 | agg-a\n"
        "(2 rows)\n"
    )
    assert format_result(result, "csv") == "job,world_size,aggregator_id\nj1,2,\nj2,8,agg-a\n"
    assert json.loads(format_result(result, "json")) == [
        {"job": "j1", "world_size": 2, "aggregator_id": None},
        {"job": "j2", "world_size": 8, "aggregator_id": "agg-a"},
    ]
    typed = run_query(
        query_db, """SELECT '{"a": [1]}'::json AS j, 1.5::numeric AS n, '100%' AS p"""
    )
    assert json.loads(format_result(typed, "json")) == [{"j": {"a": [1]}, "n": 1.5, "p": "100%"}]
    assert run_query(query_db, "SELECT * FROM jobs", max_rows=1).truncated


@pytest.mark.parametrize(("sql", "expected"), REFUSED)
def test_writes_are_refused_and_change_nothing(
    history_db: str, query_db: str, sql: str, expected: str
) -> None:
    before = snapshot(history_db)
    with pytest.raises(QueryError, match="refused") as info:
        run_query(query_db, sql)
    assert expected in str(info.value)
    assert snapshot(history_db) == before


def test_read_only_engine_is_enforced_by_the_server(query_db: str) -> None:
    engine = make_engine(query_db, read_only=True)
    try:
        with pytest.raises(DBAPIError) as info, engine.connect() as conn:
            conn.execute(text("DELETE FROM jobs"))
        assert isinstance(info.value.orig, psycopg.errors.ReadOnlySqlTransaction)
    finally:
        engine.dispose()
    assert len(run_query(query_db, "SELECT * FROM jobs").rows) == 2


def test_query_errors_name_the_problem(query_db: str) -> None:
    with pytest.raises(QueryError, match=r"cancelled after the 0\.3 s timeout"):
        run_query(query_db, "SELECT pg_sleep(5)", timeout_s=0.3)
    with pytest.raises(QueryError, match='relation "nope" does not exist'):
        run_query(query_db, "SELECT * FROM nope")
    with pytest.raises(QueryError, match="cannot connect to the history database"):
        run_query("postgresql://postgres@127.0.0.1:1/none", "SELECT 1")


# -- retention ---------------------------------------------------------------------------


def test_retention_rolls_up_deletes_and_is_idempotent(engine: Engine) -> None:
    check_retention(engine)


def test_retention_skips_while_another_process_holds_the_lock(engine: Engine) -> None:
    fill(engine)
    with engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": RETENTION_LOCK_KEY})
        assert apply_retention(engine, now_unix_s=NOW) == RetentionReport(ran=False)
        holder.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": RETENTION_LOCK_KEY})
        holder.commit()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM rollups")).scalar_one() == 1  # old one
    assert apply_retention(engine, now_unix_s=NOW).ran


def test_retention_from_several_threads_at_once_counts_each_row_once(engine: Engine) -> None:
    fill(engine)
    expected = expected_rollups(engine, end_s=T0 + 180)
    url = engine.url.render_as_string(hide_password=False)
    reports: list[RetentionReport] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def run() -> None:
        own = make_engine(url)
        try:
            start.wait()
            reports.append(apply_retention(own, now_unix_s=NOW))
        except BaseException as exc:
            errors.append(exc)
        finally:
            own.dispose()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(r.rollup_rows_written for r in reports) == len(expected)
    with engine.connect() as conn:
        total = conn.execute(
            text("SELECT sum(count) FROM rollups WHERE bucket_start_unix_s >= :t0"), {"t0": T0}
        ).scalar_one()
    assert total == sum(v[0] for v in expected.values())
