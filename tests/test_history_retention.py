from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, insert, select
from sqlalchemy.engine import Engine

from torshmon.history.db import make_engine
from torshmon.history.migrate import upgrade
from torshmon.history.models import ROLLUP_SOURCES, Base
from torshmon.history.retention import RAW_TABLES, RetentionReport, apply_retention

NS = 1_000_000_000
#: Start of the data: a multiple of 60 s, so minute m is the bucket T0 + 60 m.
T0 = 1_700_000_040
#: Raw retention that keeps rows from T0 + 90 s on when now is T0 + 240 s.
NOW = T0 + 240
RAW_RETENTION_S = 150
CUTOFF_NS = (T0 + 90) * NS
T = Base.metadata.tables


def fill(engine: Engine) -> None:
    """Three minutes of steps (2 ranks) and node samples, plus rows of every raw table."""
    steps, nodes = [], []
    for minute in range(3):
        for k in range(4):
            ts = T0 + 60 * minute + 15 * k
            for rank in range(2):
                duration = 0.1 * (minute + 1) + 0.01 * k + 0.001 * rank
                steps.append(
                    {
                        "job": "j",
                        "rank": rank,
                        "node": "n0",
                        "step": 4 * minute + k,
                        "end_unix_ns": ts * NS + 1234,
                        "duration_s": duration,
                        "comm_wait_s": duration / 4,
                        "compute_s": duration * 3 / 4,
                        "communication_time_ratio": 0.25,
                        "comm_busy_s": 0.5,
                        "batch_size": 8,
                        # NULL measurements are not counted.
                        "samples_per_s": None if k == 0 else 8 / duration,
                        "loss": 2.0 - 0.1 * k,
                        "loss_nonfinite": False,
                        "config_version": 0,
                    }
                )
            nodes.append(_node_row(ts, cpu=0.1 * (k + 1) + minute))
    ts_old, ts_new = (T0 + 30) * NS, (T0 + 150) * NS
    with engine.begin() as conn:
        conn.execute(insert(T["steps"]), steps)
        conn.execute(insert(T["node_samples"]), nodes)
        for ts in (ts_old, ts_new):
            conn.execute(insert(T["collectives"]), [_collective_row(ts)])
            conn.execute(insert(T["buckets"]), [_bucket_row(ts)])
            conn.execute(insert(T["ddp_stats"]), [_ddp_row(ts)])
            conn.execute(insert(T["gpu_samples"]), [_gpu_row(ts)])
            conn.execute(insert(T["rank_samples"]), [_rank_row(ts)])
            conn.execute(insert(T["inflight_reports"]), [_inflight_row(ts)])
        conn.execute(
            insert(T["ingest_seqs"]),
            [
                {"agent_id": "a", "seq": 1, "node": "n0", "received_unix_ns": ts_old},
                {"agent_id": "a", "seq": 2, "node": "n0", "received_unix_ns": ts_old},
                {"agent_id": "a", "seq": 3, "node": "n0", "received_unix_ns": ts_new},
                {"agent_id": "b", "seq": 7, "node": "n1", "received_unix_ns": ts_old},
            ],
        )
        # A rollup from 40 days ago: past the 30-day rollup retention.
        conn.execute(
            insert(T["rollups"]),
            [
                {
                    "key": "j",
                    "rank": 0,
                    "metric": "duration_s",
                    "resolution_s": 60,
                    "bucket_start_unix_s": T0 - 40 * 86400,
                    "count": 1,
                    "sum": 1.0,
                    "min": 1.0,
                    "max": 1.0,
                }
            ],
        )


def _node_row(ts: int, cpu: float) -> dict[str, Any]:
    return {
        "node": "n0",
        "ts_unix_ns": ts * NS,
        "cpu_utilization_ratio": cpu,
        "memory_utilization_ratio": 0.5,
        "memory_used_bytes": 1 << 30,
        "io_wait_ratio": None,
        "net_rx_bytes_total": 0,
        "net_tx_bytes_total": 0,
        "disk_read_bytes_total": 0,
        "disk_write_bytes_total": 0,
    }


def _collective_row(ts_ns: int) -> dict[str, Any]:
    return {
        "job": "j",
        "rank": 0,
        "step": 1,
        "end_unix_ns": ts_ns,
        "op": "all_reduce",
        "pg": "default",
        "dtype": "float32",
        "count": 1,
        "size_bytes": 4096,
        "duration_s": 0.001,
        "max_duration_s": 0.001,
        "algbw_bytes_per_s": 4.096e6,
        "busbw_bytes_per_s": 4.096e6,
    }


def _bucket_row(ts_ns: int) -> dict[str, Any]:
    return {
        "job": "j",
        "rank": 0,
        "step": 1,
        "end_unix_ns": ts_ns,
        "bucket_index": 0,
        "codec": "none",
        "size_bytes": 4096,
        "parameters": 1024,
        "wire_bytes": 4096,
        "compression_ratio": 1.0,
        "duration_s": 0.001,
        "encode_s": 0.0,
        "decode_s": 0.0,
        "relative_error": None,
    }


def _ddp_row(ts_ns: int) -> dict[str, Any]:
    return {
        "job": "j",
        "rank": 0,
        "step": 1,
        "end_unix_ns": ts_ns,
        "bucket_cap_bytes": 1 << 20,
        "bucket_sizes_bytes": [4096, 1024],
        "num_buckets_reduced": 2,
        "avg_forward_compute_s": 0.01,
        "avg_backward_compute_s": 0.02,
        "avg_backward_comm_s": 0.005,
        "avg_backward_compute_comm_overlap_s": 0.004,
    }


def _gpu_row(ts_ns: int) -> dict[str, Any]:
    return {
        "node": "n0",
        "ts_unix_ns": ts_ns,
        "gpu_index": 0,
        "utilization_ratio": 0.9,
        "memory_used_bytes": 1,
        "memory_total_bytes": 2,
    }


def _rank_row(ts_ns: int) -> dict[str, Any]:
    return {"node": "n0", "ts_unix_ns": ts_ns, "job": "j", "rank": 0, "pid": 1, "rss_bytes": 1}


def _inflight_row(ts_ns: int) -> dict[str, Any]:
    return {
        "job": "j",
        "rank": 0,
        "sent_unix_ns": ts_ns,
        "pg": "default",
        "seq": 4,
        "op": "all_reduce",
        "size_bytes": 4096,
        "start_unix_ns": ts_ns - NS,
        "age_s": 1.0,
        "peer": None,
    }


def expected_rollups(engine: Engine, end_s: int) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Rollups computed in Python from the raw rows (read before retention deletes any)."""
    out: dict[tuple[Any, ...], list[float]] = {}
    with engine.connect() as conn:
        for source in ROLLUP_SOURCES.values():
            table = T[source.table]
            for row in conn.execute(select(table)).mappings():
                bucket = row[source.time_column] // (60 * NS) * 60
                if bucket + 60 > end_s:
                    continue
                rank = row[source.rank_column] if source.rank_column else -1
                for metric in source.metrics:
                    if row[metric] is not None:
                        key = (row[source.key_column], rank, metric, 60, bucket)
                        out.setdefault(key, []).append(row[metric])
    return {k: (len(v), sum(v), min(v), max(v)) for k, v in out.items()}


def stored_rollups(engine: Engine) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    rollups = T["rollups"]
    with engine.connect() as conn:
        rows = conn.execute(select(rollups).where(rollups.c.bucket_start_unix_s >= T0))
        return {tuple(r[:5]): tuple(r[5:]) for r in rows}


def raw_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            name: conn.execute(select(func.count()).select_from(T[name])).scalar_one()
            for name in (*RAW_TABLES, "rollups")
        }


def check_retention(engine: Engine) -> None:
    """The full scenario; shared with the PostgreSQL integration test."""
    fill(engine)
    expected = expected_rollups(engine, end_s=T0 + 180)
    assert len(expected) == 2 * 6 * 3 + 2 * 3  # steps: ranks x metrics x minutes; node
    before = raw_counts(engine)

    report = apply_retention(engine, now_unix_s=NOW, raw_retention_s=RAW_RETENTION_S)

    assert report.ran
    assert report.rollup_rows_written == len(expected)
    assert report.watermarks_unix_s == {"steps": T0 + 180, "node_samples": T0 + 180}
    stored = stored_rollups(engine)
    assert stored.keys() == expected.keys()
    for key, (count, total, low, high) in expected.items():
        assert stored[key] == (count, pytest.approx(total), low, high), key
    # Steps before the cutoff (minute 0 and the first half of minute 1) are gone.
    with engine.connect() as conn:
        times = conn.execute(select(T["steps"].c.end_unix_ns)).scalars().all()
        seqs = conn.execute(
            select(T["ingest_seqs"].c.agent_id, T["ingest_seqs"].c.seq).order_by("agent_id")
        ).all()
    assert times and min(times) >= CUTOFF_NS
    assert len(times) == 2 * 6
    after = raw_counts(engine)
    assert after["node_samples"] == 6
    for name in ("collectives", "buckets", "ddp_stats", "gpu_samples", "rank_samples"):
        assert after[name] == 1, name
    assert after["inflight_reports"] == 1
    # Agent a keeps its newest seq only; agent b's one (old) seq is its newest, kept.
    assert [tuple(s) for s in seqs] == [("a", 3), ("b", 7)]
    assert report.raw_rows_deleted == {n: before[n] - after[n] for n in RAW_TABLES}
    assert report.rollup_rows_deleted == 1
    assert after["rollups"] == len(expected)

    again = apply_retention(engine, now_unix_s=NOW, raw_retention_s=RAW_RETENTION_S)
    assert again == RetentionReport(
        ran=True,
        raw_rows_deleted=dict.fromkeys(RAW_TABLES, 0),
        watermarks_unix_s=report.watermarks_unix_s,
    )
    assert raw_counts(engine) == after
    assert stored_rollups(engine) == stored


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    upgrade(url)
    return make_engine(url)


def test_rollups_deletes_and_idempotence_on_sqlite(engine: Engine) -> None:
    check_retention(engine)


def test_incremental_runs_roll_up_each_bucket_once(engine: Engine) -> None:
    fill(engine)
    expected = expected_rollups(engine, end_s=T0 + 180)
    keep = {"raw_retention_s": 10 * 86400}
    first = apply_retention(engine, now_unix_s=T0 + 60 + 60 + 5, **keep)  # minute 0 complete
    assert first.watermarks_unix_s["steps"] == T0 + 60
    assert {k[4] for k in stored_rollups(engine)} == {T0}
    # Late in minute 1 nothing new is complete.
    assert apply_retention(engine, now_unix_s=T0 + 60 + 119, **keep).rollup_rows_written == 0
    apply_retention(engine, now_unix_s=NOW, **keep)
    stored = stored_rollups(engine)
    assert stored.keys() == expected.keys()
    for key, (count, total, low, high) in expected.items():
        assert stored[key] == (count, pytest.approx(total), low, high), key


def test_rows_not_yet_rolled_up_are_never_deleted(engine: Engine) -> None:
    fill(engine)
    report = apply_retention(
        engine, now_unix_s=NOW, raw_retention_s=RAW_RETENTION_S, rollup_delay_s=10_000
    )
    assert report.rollup_rows_written == 0
    assert report.raw_rows_deleted["steps"] == 0
    assert report.raw_rows_deleted["node_samples"] == 0
    assert report.raw_rows_deleted["collectives"] == 1  # not a rollup source: age alone


def test_two_threads_at_once_roll_up_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    upgrade(url)
    fill(make_engine(url))
    expected = expected_rollups(make_engine(url), end_s=T0 + 180)
    reports: list[RetentionReport] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            reports.append(apply_retention(make_engine(url), now_unix_s=NOW))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(r.rollup_rows_written for r in reports) == len(expected)
    assert stored_rollups(make_engine(url)).keys() == expected.keys()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"now_unix_s": float("nan")}, "now_unix_s must be a finite Unix time"),
        ({"now_unix_s": 1.0, "rollup_resolution_s": 0}, "rollup_resolution_s must be at least 1"),
        ({"now_unix_s": 1.0, "rollup_resolution_s": 1.5}, "rollup_resolution_s must be an int"),
        ({"now_unix_s": 1.0, "raw_retention_s": 0}, "raw_retention_s must be positive, got 0"),
        ({"now_unix_s": 1.0, "rollup_retention_s": -1}, "rollup_retention_s must be positive"),
        ({"now_unix_s": 1.0, "rollup_delay_s": -1}, "rollup_delay_s must be zero or more"),
    ],
)
def test_bad_arguments_are_refused(engine: Engine, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_retention(engine, **kwargs)
