from __future__ import annotations

import re
import sqlite3
import threading
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import Float, create_mock_engine, func, insert, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from torshmon.history.db import (
    DEFAULT_DB_URL,
    DatabaseConfigError,
    WriterConnection,
    as_db_url,
    begin_write,
    db_url,
    insert_ignore,
    make_engine,
    normalize_url,
    schema_differences,
    upsert,
)
from torshmon.history.docs import main as docs_main
from torshmon.history.docs import render_tables_markdown
from torshmon.history.migrate import alembic_dir, upgrade
from torshmon.history.models import ROLLUP_SOURCES, Base, Step
from torshmon.history.query import run_query

REPO_ROOT = Path(__file__).resolve().parents[1]

#: The column names the ingest and the other components write by name (the contract).
CONTRACT: dict[str, list[str]] = {
    "jobs": [
        "job",
        "world_size",
        "backend",
        "first_seen_unix_ns",
        "last_seen_unix_ns",
        "aggregator_id",
    ],
    "runs": ["job", "run_id", "started_unix_ns", "world_size"],
    "probe_sessions": [
        "session",
        "job",
        "rank",
        "local_rank",
        "world_size",
        "node",
        "pid",
        "backend",
        "torch_version",
        "probe_version",
        "started_unix_ns",
        "last_seen_unix_ns",
        "last_seq",
        "dropped_records_total",
        "closed_unix_ns",
        "run_id",
        "attached_unix_ns",
    ],
    "ingest_seqs": ["agent_id", "seq", "node", "received_unix_ns"],
    "steps": [
        "id",
        "job",
        "run_id",
        "rank",
        "node",
        "step",
        "end_unix_ns",
        "duration_s",
        "comm_wait_s",
        "compute_s",
        "communication_time_ratio",
        "comm_busy_s",
        "forward_s",
        "backward_s",
        "optimizer_s",
        "input_wait_s",
        "batch_size",
        "samples_per_s",
        "loss",
        "loss_nonfinite",
        "config_version",
        "gpu_memory_allocated_bytes",
        "gpu_memory_reserved_bytes",
        "gpu_memory_peak_bytes",
        "cpu_wait_s",
        "process_cpu_wait_s",
        "eval_s",
        "between_steps_comm_s",
    ],
    "collectives": [
        "id",
        "job",
        "run_id",
        "rank",
        "step",
        "end_unix_ns",
        "op",
        "pg",
        "dtype",
        "count",
        "size_bytes",
        "duration_s",
        "max_duration_s",
        "algbw_bytes_per_s",
        "busbw_bytes_per_s",
    ],
    "buckets": [
        "id",
        "job",
        "run_id",
        "rank",
        "step",
        "end_unix_ns",
        "bucket_index",
        "codec",
        "size_bytes",
        "parameters",
        "wire_bytes",
        "compression_ratio",
        "duration_s",
        "encode_s",
        "decode_s",
        "relative_error",
    ],
    "ddp_stats": [
        "id",
        "job",
        "run_id",
        "rank",
        "step",
        "end_unix_ns",
        "bucket_cap_bytes",
        "bucket_sizes_bytes",
        "num_buckets_reduced",
        "avg_forward_compute_s",
        "avg_backward_compute_s",
        "avg_backward_comm_s",
        "avg_backward_compute_comm_overlap_s",
    ],
    "configs": [
        "job",
        "run_id",
        "version",
        "bucket_cap_bytes",
        "first_bucket_cap_bytes",
        "codec",
        "codec_params",
        "effective_step",
        "applied_unix_ns",
    ],
    "node_samples": [
        "id",
        "node",
        "ts_unix_ns",
        "cpu_utilization_ratio",
        "memory_utilization_ratio",
        "memory_used_bytes",
        "io_wait_ratio",
        "net_rx_bytes_total",
        "net_tx_bytes_total",
        "disk_read_bytes_total",
        "disk_write_bytes_total",
    ],
    "gpu_samples": [
        "id",
        "node",
        "ts_unix_ns",
        "gpu_index",
        "utilization_ratio",
        "memory_used_bytes",
        "memory_total_bytes",
        "power_watts",
        "temperature_celsius",
        "throttle_reasons",
        "ecc_uncorrected_errors_total",
        "xid_errors_total",
        "last_xid",
    ],
    "rank_samples": ["id", "node", "ts_unix_ns", "job", "rank", "pid", "rss_bytes"],
    "inflight_reports": [
        "id",
        "job",
        "run_id",
        "rank",
        "sent_unix_ns",
        "pg",
        "seq",
        "op",
        "size_bytes",
        "start_unix_ns",
        "age_s",
        "peer",
    ],
    "commands": [
        "id",
        "job",
        "run_id",
        "kind",
        "args",
        "status",
        "reason",
        "version",
        "effective_step",
        "created_unix_s",
        "updated_unix_s",
        "aggregator_id",
    ],
    "alerts": [
        "id",
        "fingerprint",
        "rule",
        "severity",
        "state",
        "job",
        "run_id",
        "rank",
        "labels",
        "annotations",
        "value",
        "starts_at_unix_s",
        "fired_at_unix_s",
        "ends_at_unix_s",
        "updated_unix_s",
        "aggregator_id",
        "acknowledged_by",
        "acknowledged_unix_s",
        "acknowledged_comment",
    ],
    "silences": [
        "id",
        "matchers",
        "starts_at_unix_s",
        "ends_at_unix_s",
        "created_by",
        "comment",
        "created_unix_s",
    ],
    "alert_events": ["id", "alert_id", "state", "ts_unix_s", "value"],
    "findings": [
        "id",
        "kind",
        "job",
        "run_id",
        "rank",
        "metric",
        "value",
        "score",
        "summary",
        "recommendation",
        "severity",
        "category",
        "priority",
        "expected_gain_ratio",
        "difficulty",
        "since_unix_s",
        "detected_unix_s",
        "updated_unix_s",
        "ended_unix_s",
        "aggregator_id",
        "details",
    ],
    "evidence_captures": [
        "id",
        "job",
        "run_id",
        "alert_id",
        "alert_fingerprint",
        "rule",
        "profile_ranks",
        "created_unix_s",
        "aggregator_id",
    ],
    "evidence_files": [
        "capture_id",
        "rank",
        "name",
        "job",
        "size_bytes",
        "stored_bytes",
        "path",
        "error",
        "taken_unix_s",
        "received_unix_s",
    ],
    "tuning_sessions": [
        "id",
        "job",
        "run_id",
        "state",
        "trigger",
        "started_unix_s",
        "ended_unix_s",
        "baseline_config",
        "best_config",
        "baseline_score",
        "best_score",
        "reason",
        "aggregator_id",
        "state_blob",
    ],
    "tuning_trials": [
        "id",
        "session_id",
        "job",
        "run_id",
        "trial_index",
        "config",
        "command_id",
        "state",
        "windows",
        "score",
        "decision",
        "reason",
        "started_unix_s",
        "ended_unix_s",
    ],
    "rollups": [
        "key",
        "rank",
        "metric",
        "resolution_s",
        "bucket_start_unix_s",
        "count",
        "sum",
        "min",
        "max",
    ],
    "retention_state": ["name", "watermark_unix_s"],
}


@pytest.fixture
def db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    upgrade(url)
    return url


@pytest.fixture
def engine(db: str) -> Engine:
    return make_engine(db)


def step_row(rank: int = 0, step: int = 0, **overrides: object) -> dict[str, object]:
    row: dict[str, object] = {
        "job": "j",
        "rank": rank,
        "node": "n0",
        "step": step,
        "end_unix_ns": 1_700_000_000_000_000_000 + step,
        "duration_s": 0.1,
        "comm_wait_s": 0.02,
        "compute_s": 0.08,
        "communication_time_ratio": 0.2,
        "comm_busy_s": 0.05,
        "forward_s": None,
        "backward_s": None,
        "optimizer_s": None,
        "batch_size": 32,
        "samples_per_s": 320.0,
        "loss": 1.5,
        "loss_nonfinite": False,
        "config_version": 0,
    }
    row.update(overrides)
    return row


def test_models_hold_the_contract_columns_in_order() -> None:
    tables = Base.metadata.tables
    assert sorted(tables) == sorted(CONTRACT)
    for name, columns in CONTRACT.items():
        assert list(tables[name].columns.keys()) == columns, name


def test_every_table_and_column_is_documented_with_a_comment() -> None:
    for table in Base.metadata.tables.values():
        assert table.comment, table.name
        for column in table.columns:
            assert column.comment, f"{table.name}.{column.name}"


def test_time_columns_have_unit_suffixed_types() -> None:
    for table in Base.metadata.tables.values():
        for column in table.columns:
            if column.name.endswith("_unix_ns"):
                assert column.type.python_type is int, f"{table.name}.{column.name}"
            elif column.name.endswith("_unix_s") and column.name != "bucket_start_unix_s":
                assert isinstance(column.type, Float), f"{table.name}.{column.name}"


def test_rollup_sources_name_float_columns_of_their_tables() -> None:
    assert set(ROLLUP_SOURCES) == {"steps", "node_samples"}
    for name, source in ROLLUP_SOURCES.items():
        table = Base.metadata.tables[name]
        assert source.table == name
        for column in (source.key_column, source.time_column, *source.metrics):
            assert column in table.columns, f"{name}.{column}"
        for metric in source.metrics:
            assert isinstance(table.c[metric].type, Float)
    assert ROLLUP_SOURCES["node_samples"].rank_column is None


def test_upgrade_empty_sqlite_gives_exactly_the_models_schema(db: str, engine: Engine) -> None:
    with engine.connect() as conn:
        assert schema_differences(conn) == []
        names = {r[0] for r in conn.execute(text("SELECT name FROM sqlite_master"))}
    assert set(Base.metadata.tables) | {"alembic_version"} <= names


def test_schema_differences_sees_a_drifted_database(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'drift.db'}")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE jobs (job VARCHAR(200) PRIMARY KEY)"))
    with engine.connect() as conn:
        diffs = schema_differences(conn)
    assert any(d[0] == "add_table" for d in diffs if isinstance(d, tuple))
    assert ("add_column", None, "jobs") in [d[:3] for d in diffs if isinstance(d, tuple)]


def _head() -> str | None:
    return ScriptDirectory(str(alembic_dir())).get_current_head()


def test_upgrade_twice_and_from_two_threads_at_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'race.db'}"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            upgrade(url)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    upgrade(url)
    with make_engine(url).connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == _head()
        assert schema_differences(conn) == []


def test_sqlite_engine_runs_wal_with_foreign_keys_and_busy_timeout(engine: Engine) -> None:
    with engine.connect() as conn:
        pragma = {
            name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()
            for name in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
        }
    assert pragma == {
        "journal_mode": "wal",
        "synchronous": 1,
        "foreign_keys": 1,
        "busy_timeout": 10000,
    }


def test_foreign_keys_and_check_constraints_are_enforced(engine: Engine) -> None:
    events = Base.metadata.tables["alert_events"]
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(insert(events), [{"alert_id": 999, "state": "firing", "ts_unix_s": 1.0}])
    commands = Base.metadata.tables["commands"]
    row = {
        "id": "c1",
        "job": "j",
        "kind": "config",
        "args": {"bucket_cap_bytes": 1 << 20},
        "status": "bogus",
        "created_unix_s": 1.0,
        "updated_unix_s": 1.0,
    }
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(insert(commands), [row])
    with engine.begin() as conn:
        conn.execute(insert(commands), [{**row, "status": "pending"}])
        stored = conn.execute(select(commands.c.args, commands.c.reason)).one()
    assert stored == ({"bucket_cap_bytes": 1 << 20}, "")


def test_bulk_insert_of_step_dicts_assigns_ids(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(Step.__table__), [step_row(step=i) for i in range(3)])
        conn.execute(
            insert(Step.__table__), [step_row(step=3, duration_s=None, loss_nonfinite=True)]
        )
        rows = conn.execute(select(Step.id, Step.step, Step.duration_s, Step.loss_nonfinite))
        assert [tuple(r) for r in rows] == [
            (1, 0, 0.1, False),
            (2, 1, 0.1, False),
            (3, 2, 0.1, False),
            (4, 3, None, True),
        ]


def test_insert_ignore_and_upsert_on_sqlite(engine: Engine) -> None:
    jobs = Base.metadata.tables["jobs"]
    first = {
        "job": "j",
        "world_size": 2,
        "backend": "gloo",
        "first_seen_unix_ns": 1,
        "last_seen_unix_ns": 1,
        "aggregator_id": None,
    }
    with engine.begin() as conn:
        conn.execute(insert_ignore(conn, jobs), [first])
        conn.execute(insert_ignore(conn, jobs), [{**first, "world_size": 8}])
        assert conn.execute(select(jobs.c.world_size)).scalar_one() == 2
        stmt = upsert(conn, jobs, update_columns=["last_seen_unix_ns"])
        conn.execute(stmt, [{**first, "world_size": 8, "last_seen_unix_ns": 5}])
        assert tuple(conn.execute(select(jobs.c.world_size, jobs.c.last_seen_unix_ns)).one()) == (
            2,
            5,
        )
        conn.execute(upsert(conn, jobs), [{**first, "world_size": 4, "last_seen_unix_ns": 9}])
        assert tuple(conn.execute(select(jobs.c.world_size, jobs.c.first_seen_unix_ns)).one()) == (
            4,
            1,
        )


def test_upsert_and_insert_ignore_refuse_bad_input(engine: Engine) -> None:
    jobs = Base.metadata.tables["jobs"]
    with pytest.raises(DatabaseConfigError, match="no column nope in table jobs"):
        upsert(engine, jobs, update_columns=["nope"])
    with pytest.raises(DatabaseConfigError, match="unsupported database dialect 'mysql'"):
        insert_ignore(create_mock_engine("mysql://", None), jobs)  # type: ignore[arg-type]


def test_begin_write_takes_the_sqlite_write_lock_at_begin(db: str, engine: Engine) -> None:
    path = db.removeprefix("sqlite:///")
    other = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        with begin_write(engine), pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
    finally:
        other.close()


def test_writer_connection_keeps_one_connection_and_replaces_it_after_a_failure(
    db: str, engine: Engine
) -> None:
    jobs = Base.metadata.tables["jobs"]
    row = {"job": "j", "first_seen_unix_ns": 1, "last_seen_unix_ns": 1, "aggregator_id": "a"}
    writer = WriterConnection(engine)
    with writer.begin() as first:
        first.execute(jobs.insert(), [row])
    with writer.begin() as second:
        assert second is first  # kept, not checked out again
        path = db.removeprefix("sqlite:///")
        other = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:  # a write transaction as begin_write's: the lock is taken at BEGIN
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        finally:
            other.close()
    with pytest.raises(IntegrityError), writer.begin() as conn:
        conn.execute(jobs.insert(), [row])  # the same job again
    assert first.closed
    with writer.begin() as fresh:
        assert fresh is not first
        assert fresh.execute(select(func.count()).select_from(jobs)).scalar_one() == 1
    writer.close()
    writer.close()


def test_db_url_prefers_explicit_then_environment_then_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORSHMON_DB_URL", raising=False)
    assert DEFAULT_DB_URL == "sqlite:///torshmon.db"
    assert db_url(None) == f"sqlite:///{tmp_path / 'torshmon.db'}"
    monkeypatch.setenv("TORSHMON_DB_URL", "sqlite:////srv/env.db")
    assert db_url(None) == "sqlite:////srv/env.db"
    assert db_url("sqlite:////srv/flag.db") == "sqlite:////srv/flag.db"
    monkeypatch.setenv("TORSHMON_DB_URL", "env.db")  # a path too (issue 18)
    assert db_url(None) == f"sqlite:///{tmp_path / 'env.db'}"


def test_a_db_is_a_url_or_a_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for path in ("h.db", "./h.db", "sub/../h.db", "sqlite:///h.db", "sqlite:///./h.db"):
        assert as_db_url(path) == f"sqlite:///{tmp_path / 'h.db'}", path
    assert as_db_url("~/h.db") == f"sqlite:///{tmp_path / 'home' / 'h.db'}"
    assert as_db_url("sqlite:///h.db?timeout=5") == f"sqlite:///{tmp_path / 'h.db'}?timeout=5"
    for url in ("sqlite:////srv/h.db", "sqlite://", "sqlite:///:memory:", "postgresql://h/d"):
        assert as_db_url(url) == url


def test_normalize_url_picks_psycopg_and_refuses_other_databases() -> None:
    assert normalize_url("postgresql://u:p%40ss@h:5/d") == "postgresql+psycopg://u:p%40ss@h:5/d"
    assert normalize_url("postgres://h/d") == "postgresql+psycopg://h/d"
    assert normalize_url("sqlite:///x.db") == "sqlite:///x.db"
    with pytest.raises(DatabaseConfigError, match="'mysql'; supported"):
        normalize_url("mysql://h/d")
    with pytest.raises(DatabaseConfigError, match="psycopg 3"):
        normalize_url("postgresql+asyncpg://h/d")
    with pytest.raises(DatabaseConfigError, match="invalid database URL"):
        normalize_url("not a url")


def test_the_migrations_are_found_inside_the_package() -> None:
    migrations = REPO_ROOT / "torshmon" / "history" / "migrations"
    assert alembic_dir() == migrations
    assert (migrations / "versions" / "0001_initial.py").is_file()


def test_docs_tables_md_is_the_current_rendering(tmp_path: Path) -> None:
    rendered = render_tables_markdown()
    assert (REPO_ROOT / "docs" / "tables.md").read_text(encoding="utf-8") == rendered, (
        "docs/tables.md is stale: run python -m torshmon.history.docs docs/tables.md"
    )
    assert docs_main([str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text(encoding="utf-8") == rendered
    for table in Base.metadata.tables.values():
        assert f"### `{table.name}`" in rendered
        for column in table.columns:
            assert f"| `{column.name}` |" in rendered
    assert "\\|\\|g - decode(encode(g))\\|\\|" in rendered  # pipes escaped in cells


def test_docs_example_queries_run_on_sqlite(db: str) -> None:
    queries = re.findall(r"```sql\n(.*?)```", render_tables_markdown(), flags=re.S)
    assert len(queries) >= 2
    for sql in queries:
        assert run_query(db, sql).rows == []
