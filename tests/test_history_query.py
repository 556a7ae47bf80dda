from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from sqlalchemy import insert, text
from sqlalchemy.exc import DatabaseError

from torshmon.history.db import make_engine
from torshmon.history.migrate import upgrade
from torshmon.history.models import Base
from torshmon.history.query import QueryError, QueryResult, format_result, run_query

JOBS = [
    ("j1", 2, "gloo", 1, 2, None),
    ("j2", 8, "nccl", 3, 4, "agg-a"),
]
SELECT_JOBS = "SELECT job, world_size, backend FROM jobs ORDER BY job"

#: Statements that must be refused, and words the refusal must contain.
REFUSED = [
    ("INSERT INTO jobs VALUES ('x', 1, 'gloo', 1, 1, NULL)", "INSERT on jobs"),
    ("UPDATE jobs SET world_size = 3", "UPDATE on jobs"),
    ("DELETE FROM jobs", "DELETE on jobs"),
    ("DROP TABLE jobs", "schema change"),
    ("CREATE TABLE x (a INTEGER)", "schema change"),
    ("CREATE TEMP TABLE x (a INTEGER)", "schema change"),
    ("ATTACH DATABASE '{other}' AS other", "ATTACH"),
    ("PRAGMA journal_mode=DELETE", "PRAGMA journal_mode = DELETE"),
    ("PRAGMA user_version=5", "PRAGMA user_version = 5"),
    ("PRAGMA query_only=OFF", "PRAGMA query_only = OFF"),
    ("VACUUM INTO '{other}'", "ATTACH"),
    ("REINDEX", "REINDEX"),
    ("BEGIN IMMEDIATE", "TRANSACTION"),
    ("SELECT 1; DELETE FROM jobs", "one SQL statement"),
    (
        "WITH d AS (SELECT 1) INSERT INTO jobs SELECT 'x', 1, 'g', 1, 1, NULL FROM d",
        "INSERT on jobs",
    ),
]


@pytest.fixture
def db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    upgrade(url)
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(
            insert(Base.metadata.tables["jobs"]),
            [
                dict(zip(Base.metadata.tables["jobs"].columns.keys(), row, strict=True))
                for row in JOBS
            ],
        )
    engine.dispose()
    return url


def snapshot(url: str) -> tuple[list[tuple[object, ...]], list[str], int, str]:
    """Everything a refused statement might have changed."""
    engine = make_engine(url)
    with engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(text("SELECT * FROM jobs ORDER BY job"))]
        schema = [r[0] for r in conn.execute(text("SELECT sql FROM sqlite_master ORDER BY name"))]
        version = conn.exec_driver_sql("PRAGMA user_version").scalar_one()
        mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar_one()
    engine.dispose()
    return rows, schema, version, mode


def test_select_returns_columns_and_rows(db: str) -> None:
    result = run_query(db, SELECT_JOBS)
    assert result == QueryResult(
        columns=("job", "world_size", "backend"),
        rows=[("j1", 2, "gloo"), ("j2", 8, "nccl")],
        truncated=False,
    )


def test_read_only_pragmas_and_recursive_ctes_are_allowed(db: str) -> None:
    assert run_query(db, "PRAGMA journal_mode").rows == [("wal",)]
    names = [r[1] for r in run_query(db, "PRAGMA table_info(jobs)").rows]
    assert names == [c.name for c in Base.metadata.tables["jobs"].columns]
    counted = run_query(
        db,
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 5) "
        "SELECT sum(x) FROM c",
    )
    assert counted.rows == [(15,)]


@pytest.mark.parametrize(("sql", "expected"), REFUSED)
def test_writes_are_refused_by_sqlite_and_change_nothing(
    db: str, tmp_path: Path, sql: str, expected: str
) -> None:
    other = tmp_path / "other.db"
    before = snapshot(db)
    with pytest.raises(QueryError, match="refused") as info:
        run_query(db, sql.format(other=other))
    assert expected in str(info.value)
    assert snapshot(db) == before
    assert not other.exists()


def test_missing_database_is_a_query_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.db"
    with pytest.raises(QueryError, match=f"no history database at {missing}"):
        run_query(f"sqlite:///{missing}", "SELECT 1")
    assert not missing.exists()  # read-only open never creates the file


def test_bad_input_is_refused_with_a_clear_message(db: str) -> None:
    with pytest.raises(QueryError, match="empty query"):
        run_query(db, "  \n")
    with pytest.raises(QueryError, match="no such table: nope"):
        run_query(db, "SELECT * FROM nope")
    with pytest.raises(QueryError, match="SQLite file"):
        run_query("sqlite://", "SELECT 1")
    with pytest.raises(QueryError, match="'mysql'; supported"):
        run_query("mysql://h/d", "SELECT 1")
    with pytest.raises(ValueError, match="max_rows must be at least 1, got 0"):
        run_query(db, "SELECT 1", max_rows=0)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        run_query(db, "SELECT 1", timeout_s=0)


def test_max_rows_truncates_and_says_so(db: str) -> None:
    result = run_query(db, SELECT_JOBS, max_rows=1)
    assert result.rows == [("j1", 2, "gloo")]
    assert result.truncated
    assert not run_query(db, SELECT_JOBS, max_rows=2).truncated
    assert format_result(result, "table").endswith("(1 row, truncated)\n")


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT randomblob(50000000)",
        "SELECT zeroblob(50000000)",
        "SELECT length(zeroblob(50000000))",  # not even made on the way to a small answer
        "SELECT hex(randomblob(3000000))",  # 3 MB is allowed, its 6 MB of hex is not
        "WITH RECURSIVE c(s) AS (SELECT 'x' UNION ALL SELECT s || s FROM c) SELECT s FROM c",
    ],
)
def test_a_value_over_the_cell_cap_is_refused_by_sqlite(db: str, sql: str) -> None:
    with pytest.raises(QueryError, match=r"over the 4 MiB cap on one value"):
        run_query(db, sql, timeout_s=10)
    assert run_query(db, "SELECT length(randomblob(4000000))").rows == [(4000000,)]


def test_the_answer_size_cap_truncates_or_refuses(db: str) -> None:
    rows = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 100) "
    result = run_query(db, rows + "SELECT x, zeroblob(1000) FROM c", max_answer_bytes=10_500)
    # Each row is a 1000-byte blob and an integer (counted as 8 bytes).
    assert [r[0] for r in result.rows] == list(range(1, 11))
    assert result.truncated
    assert not run_query(db, rows + "SELECT x FROM c", max_answer_bytes=10_500).truncated
    with pytest.raises(QueryError, match="over the 500 byte cap on an answer"):
        run_query(db, "SELECT zeroblob(1000)", max_answer_bytes=500)
    with pytest.raises(QueryError, match="over the 100 byte cap on one value"):
        run_query(db, "SELECT zeroblob(101)", max_cell_bytes=100)
    with pytest.raises(ValueError, match="max_answer_bytes must be at least 1"):
        run_query(db, "SELECT 1", max_answer_bytes=0)


def test_a_runaway_query_is_cancelled_at_the_timeout(db: str) -> None:
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
    with pytest.raises(QueryError, match=r"cancelled after the 0\.2 s timeout"):
        run_query(db, endless, timeout_s=0.2)


def test_format_table_aligns_columns_and_right_aligns_numbers(db: str) -> None:
    out = format_result(run_query(db, "SELECT job, world_size, aggregator_id FROM jobs"), "table")
    assert out == (
        "job | world_size | aggregator_id\n"
        "----+------------+--------------\n"
        "j1  |          2 | NULL\n"
        "j2  |          8 | agg-a\n"
        "(2 rows)\n"
    )


def test_format_csv_quotes_and_leaves_null_empty() -> None:
    result = QueryResult(
        columns=("a", "b"), rows=[("x,y", None), ('say "hi"', 1.5)], truncated=False
    )
    out = format_result(result, "csv")
    assert out == 'a,b\n"x,y",\n"say ""hi""",1.5\n'
    assert list(csv.reader(io.StringIO(out))) == [["a", "b"], ["x,y", ""], ['say "hi"', "1.5"]]


def test_format_json_is_a_list_of_objects(db: str) -> None:
    out = format_result(run_query(db, SELECT_JOBS), "json")
    assert json.loads(out) == [
        {"job": "j1", "world_size": 2, "backend": "gloo"},
        {"job": "j2", "world_size": 8, "backend": "nccl"},
    ]
    odd = QueryResult(
        columns=("v", "v", "b"), rows=[(float("nan"), float("inf"), b"\x01\xff")], truncated=False
    )
    assert json.loads(format_result(odd, "json")) == [{"v": None, "v_2": None, "b": "01ff"}]


def test_format_rejects_unknown_formats() -> None:
    result = QueryResult(columns=(), rows=[], truncated=False)
    with pytest.raises(ValueError, match="unknown output format 'xml'; choose one of table"):
        format_result(result, "xml")


def test_read_only_sqlite_engine_reads_and_refuses_writes(db: str) -> None:
    engine = make_engine(db, read_only=True)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 2
        with pytest.raises(DatabaseError, match="not authorized"):
            conn.execute(text("DELETE FROM jobs"))
    engine.dispose()
    assert run_query(db, "SELECT count(*) FROM jobs").rows == [(2,)]
    with pytest.raises(FileNotFoundError, match="no history database at"):
        make_engine(db + "-missing", read_only=True)
