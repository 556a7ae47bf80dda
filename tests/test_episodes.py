"""Findings stored as episodes: the pure tracker, then its rows in a real SQLite file and
a real PostgreSQL database migrated to head (time ranges, updates, closing, restart)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from tests.pg import pg_database
from torshmon.aggregator.core.episodes import FindingEpisodes
from torshmon.aggregator.core.findings import Finding
from torshmon.history.migrate import upgrade
from torshmon.history.models import Base
from torshmon.history.store import HistoryStore

T0 = 1_700_000_000.0


def _input(severity: str = "high", value: float = 0.5) -> Finding:
    return Finding(
        kind="bottleneck",
        labels={"job": "j", "category": "input"},
        value=value,
        score=value - 0.4,
        summary=f"job j waits for input data {value:.0%} of its step time",
        since_unix_s=T0,
        recommendation="raise DataLoader num_workers",
        severity=severity,
        details={"metric": "input_wait_time_ratio", "gain_basis": "all of the input wait"},
        category="input",
        priority=1,
        expected_gain_ratio=value,
        difficulty="easy",
    )


def _straggler() -> Finding:
    return Finding(
        kind="straggler",
        labels={"job": "j", "rank": "2"},
        value=0.3,
        score=6.0,
        summary="rank 2 of job j is slow",
        since_unix_s=T0,
        category="straggler",
        priority=2,
        difficulty="medium",
    )


def _changes(episodes: FindingEpisodes, findings: Sequence[Finding], now: float) -> list[Any]:
    return [(c.change, c.finding.kind) for c in episodes.evaluate(findings, now)]


def test_an_episode_opens_is_rewritten_sparingly_and_closes() -> None:
    episodes = FindingEpisodes(update_every_s=30.0)
    assert _changes(episodes, [_input(), _input()], T0) == [("open", "bottleneck")]
    assert _changes(episodes, [_input(value=0.6)], T0 + 10) == []  # value moves: no write
    assert _changes(episodes, [_input(value=0.6)], T0 + 30) == [("update", "bottleneck")]
    assert _changes(episodes, [_input("critical")], T0 + 31) == [("update", "bottleneck")]
    assert _changes(episodes, [_straggler()], T0 + 40) == [
        ("open", "straggler"),
        ("close", "bottleneck"),
    ]
    assert episodes.open_count() == 1
    assert _changes(episodes, [], T0 + 50) == [("close", "straggler")]
    assert _changes(episodes, [], T0 + 60) == []


def test_a_negative_update_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="update_every_s"):
        FindingEpisodes(update_every_s=-1.0)


async def _ticks(store: HistoryStore, episodes: FindingEpisodes) -> None:
    """The evaluation ticks of one scenario, written as the service writes them."""
    ticks: list[tuple[float, list[Finding]]] = [
        (T0, [_input()]),
        (T0 + 10, [_input(value=0.55), _straggler()]),
        (T0 + 45, [_input(value=0.7)]),  # past update_every_s: rewritten
        (T0 + 60, []),
        (T0 + 70, [_input()]),  # a new episode
    ]
    for now, findings in ticks:
        await store.record(episodes.evaluate(findings, now), [], now)


def _rows(store: HistoryStore) -> list[dict[str, Any]]:
    table = Base.metadata.tables["findings"]
    with store.engine.connect() as conn:
        rows = conn.execute(select(table).order_by(table.c.id)).mappings()
        return [dict(row) for row in rows]


def _check_rows(rows: list[dict[str, Any]]) -> None:
    first, straggler, second = rows
    assert (first["kind"], first["category"], first["metric"]) == (
        "bottleneck",
        "input",
        "input_wait_time_ratio",
    )
    assert (first["detected_unix_s"], first["updated_unix_s"], first["ended_unix_s"]) == (
        T0,
        T0 + 60,
        T0 + 60,
    )
    assert first["value"] == pytest.approx(0.7)  # the update at T0 + 45
    assert (first["priority"], first["difficulty"]) == (1, "easy")
    assert first["expected_gain_ratio"] == pytest.approx(0.7)
    assert first["details"]["gain_basis"] == "all of the input wait"
    assert (straggler["rank"], straggler["category"], straggler["expected_gain_ratio"]) == (
        2,
        "straggler",
        None,
    )
    assert (straggler["detected_unix_s"], straggler["ended_unix_s"]) == (T0 + 10, T0 + 45)
    assert (second["detected_unix_s"], second["ended_unix_s"]) == (T0 + 70, None)
    assert {row["aggregator_id"] for row in rows} == {"a1"}


def test_episodes_are_rows_with_time_ranges_in_sqlite(tmp_path: Path) -> None:
    asyncio.run(_scenario(f"sqlite:///{tmp_path / 'h.db'}"))


def test_episodes_are_rows_with_time_ranges_in_postgresql() -> None:
    with pg_database() as url:
        asyncio.run(_scenario(url))


async def _scenario(url: str) -> None:
    upgrade(url)  # the migrations, 0004 included, not create_all
    writer = ThreadPoolExecutor(1)
    store = HistoryStore(url, aggregator_id="a1", writer=writer)
    other = HistoryStore(url, aggregator_id="a2", writer=writer)
    store.open()
    other.open()
    try:
        await other.record(FindingEpisodes().evaluate([_straggler()], T0), [], T0)
        await _ticks(store, FindingEpisodes())
        rows = _rows(store)
        _check_rows([row for row in rows if row["aggregator_id"] == "a1"])
        # A restarted a1 closes what it left open, and only that.
        restarted = HistoryStore(url, aggregator_id="a1", writer=writer)
        restarted.open()
        try:
            assert await restarted.close_open_findings(T0 + 100) == 1
        finally:
            restarted.close()
        ended = {(row["aggregator_id"], row["id"]): row["ended_unix_s"] for row in _rows(store)}
        assert sorted(ended.values(), key=lambda v: (v is None, v)) == [
            T0 + 45,
            T0 + 60,
            T0 + 100,
            None,  # a2's straggler stays open
        ]
    finally:
        store.close()
        other.close()
        writer.shutdown(wait=True)
