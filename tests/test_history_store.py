"""The aggregator's history store on a SQLite file: alert lifecycles, restore, jobs,
commands, listings, retention, and an unopened store that holds nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import select

from torshmon.aggregator.core.alert import Alert
from torshmon.history.models import Base
from torshmon.history.store import FilterError, HistoryStore, RunningJob

NOW = 1_700_000_000.0


def _alert(state: str, rank: str = "1", ends: float | None = None) -> Alert:
    return Alert(
        rule="Straggler",
        state=state,  # type: ignore[arg-type]
        severity="high",
        labels={"alertname": "Straggler", "job": "j", "rank": rank},
        annotations={"summary": f"rank {rank} is slow"},
        value=3.0,
        starts_at_unix_s=NOW,
        ends_at_unix_s=ends,
    )


def _store(path: Path, aggregator_id: str, writer: ThreadPoolExecutor) -> HistoryStore:
    return HistoryStore(f"sqlite:///{path}", aggregator_id=aggregator_id, writer=writer)


@pytest.fixture
async def writer() -> AsyncIterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(1)
    yield pool
    pool.shutdown(wait=True)


@pytest.fixture
async def store(tmp_path: Path, writer: ThreadPoolExecutor) -> AsyncIterator[HistoryStore]:
    store = _store(tmp_path / "h.db", "a1", writer)
    store.open()
    Base.metadata.create_all(store.engine)
    yield store
    store.close()


async def test_an_alert_is_one_row_through_its_transitions_with_an_event_each(
    store: HistoryStore,
) -> None:
    await store.record([], [_alert("pending")], NOW)
    await store.record([], [_alert("firing")], NOW + 10)
    await store.record([], [_alert("resolved", ends=NOW + 15)], NOW + 20)
    [row] = await store.rows("alerts", {"job": "j"}, 10)
    assert (row["state"], row["rank"], row["fired_at_unix_s"], row["ends_at_unix_s"]) == (
        "resolved",
        1,
        NOW + 10,
        NOW + 15,
    )
    assert row["aggregator_id"] == "a1" and row["labels"]["alertname"] == "Straggler"
    events = Base.metadata.tables["alert_events"]
    with store.engine.connect() as conn:
        states = conn.execute(select(events.c.state).order_by(events.c.id)).scalars().all()
    assert states == ["pending", "firing", "resolved"]
    # Fired again after it resolved: a new alert row.
    await store.record([], [_alert("pending"), _alert("firing")], NOW + 30)
    rows = await store.rows("alerts", {"job": "j"}, 10)
    assert [r["state"] for r in rows] == ["firing", "resolved"]


async def test_open_alerts_resume_in_the_same_rows_for_their_aggregator_only(
    tmp_path: Path, store: HistoryStore, writer: ThreadPoolExecutor
) -> None:
    await store.record([], [_alert("firing", rank="1"), _alert("pending", rank="2")], NOW)
    await store.record([], [_alert("resolved", rank="3")], NOW)
    other = _store(tmp_path / "h.db", "a2", writer)
    other.open()
    assert await other.open_alerts() == []
    other.close()
    again = _store(tmp_path / "h.db", "a1", writer)
    again.open()
    restored = await again.open_alerts()
    assert sorted((a.rank, a.state) for a in restored) == [("1", "firing"), ("2", "pending")]
    await again.record([], [_alert("resolved", rank="1")], NOW + 5)
    rows = await again.rows("alerts", {"state": "resolved"}, 10)
    assert sorted(r["rank"] for r in rows) == [1, 3]
    assert len(await again.rows("alerts", {}, 10)) == 3
    again.close()


async def test_running_jobs_are_this_aggregators_recent_jobs_with_a_size(
    store: HistoryStore,
) -> None:
    jobs = Base.metadata.tables["jobs"]

    def job(name: str, size: int | None, seen_s: float, owner: str = "a1") -> dict[str, object]:
        ns = int(seen_s * 1e9)
        return {
            "job": name,
            "world_size": size,
            "first_seen_unix_ns": ns,
            "last_seen_unix_ns": ns,
            "aggregator_id": owner,
        }

    with store.engine.begin() as conn:
        conn.execute(
            jobs.insert(),
            [
                job("recent", 4, NOW),
                job("idle", 4, NOW - 3600),
                job("unsized", None, NOW),
                job("foreign", 2, NOW, owner="a2"),
            ],
        )
    assert await store.running_jobs(NOW - 60) == [RunningJob("recent", 4, NOW)]
    # Its latest run comes with it, to label what it finds after the restart.
    runs = Base.metadata.tables["runs"]
    with store.engine.begin() as conn:
        conn.execute(
            runs.insert(),
            [
                {"job": "recent", "run_id": "old", "started_unix_ns": int(NOW * 1e9) - 9},
                {"job": "recent", "run_id": "new", "started_unix_ns": int(NOW * 1e9) - 5},
            ],
        )
    assert await store.running_jobs(NOW - 60) == [RunningJob("recent", 4, NOW, "new")]


async def test_commands_are_stored_pending_then_updated(store: HistoryStore) -> None:
    await store.add_command("c1", "j", "config", {"codec": "fp16"}, NOW)
    await store.set_command_status("c1", "expired", "no answer", NOW + 60)
    [row] = await store.rows("commands", {"id": "c1"}, 1)
    assert (row["status"], row["reason"], row["created_unix_s"], row["updated_unix_s"]) == (
        "expired",
        "no answer",
        NOW,
        NOW + 60,
    )
    assert row["args"] == {"codec": "fp16"} and row["aggregator_id"] == "a1"


async def test_a_filter_that_does_not_fit_its_column_names_it(store: HistoryStore) -> None:
    with pytest.raises(FilterError, match="trial_index must be an integer"):
        await store.rows("tuning_trials", {"trial_index": "x"}, 10)
    assert await store.rows("tuning_trials", {"trial_index": "3"}, 10) == []


async def test_retention_runs_through_the_store(store: HistoryStore) -> None:
    report = await store.apply_retention(NOW, raw_retention_s=86400, rollup_retention_s=86400)
    assert report is not None and report.ran


async def test_an_unopened_store_writes_nothing_and_finds_nothing(
    tmp_path: Path, writer: ThreadPoolExecutor
) -> None:
    store = _store(tmp_path / "never.db", "a1", writer)
    await store.record([], [_alert("firing")], NOW)
    await store.add_command("c1", "j", "config", {}, NOW)
    assert await store.open_alerts() == []
    assert await store.rows("alerts", {}, 10) == []
    assert await store.unfinished_tuning() == []
    assert await store.apply_retention(NOW, raw_retention_s=1, rollup_retention_s=1) is None
    with pytest.raises(RuntimeError, match="not open"):
        store.engine  # noqa: B018
    assert not (tmp_path / "never.db").exists()
    store.close()


async def test_a_command_is_stored_while_another_writer_commits(
    store: HistoryStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Storing a command reads the job's latest run, then inserts. Begun deferred, that
    transaction failed at once with "database is locked" when the ingest writer committed
    between the read and the insert (stop 53's CI, test_tuning: a 500 for a tune
    request); it now takes the write lock first, and the other writer waits for it."""
    import sqlite3

    import torshmon.history.store.state as state

    other_writes: list[str] = []

    def latest_run_meanwhile(conn: object, job: str) -> str | None:
        run = real_latest_run(conn, job)  # type: ignore[arg-type]
        other = sqlite3.connect(tmp_path / "h.db", timeout=0.2)
        try:
            with other:
                other.execute(
                    "INSERT INTO runs (job, run_id, started_unix_ns) VALUES ('other', 'r', 1)"
                )
            other_writes.append("committed")
        except sqlite3.OperationalError as exc:  # it waits for the command's transaction
            other_writes.append(str(exc))
        finally:
            other.close()
        return run

    real_latest_run = state.latest_run
    monkeypatch.setattr(state, "latest_run", latest_run_meanwhile)
    await store.add_command("c1", "j", "config", {"codec": "fp16"}, NOW)
    [row] = await store.rows("commands", {"id": "c1"}, 1)
    assert row["status"] == "pending"
    assert other_writes == ["database is locked"]
