"""The history-query pool (``http.queries``) and interrupting a query (``query.Interrupt``)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from torshmon.aggregator.http.queries import QUERY_NICE, QueryBusy, QueryPool
from torshmon.history.query import Interrupt, QueryError, run_query

RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


class Gate:
    """Queries that block until ``open``; ``started`` counts those that run."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.started = 0
        self._lock = threading.Lock()

    def query(self, _interrupt: Interrupt) -> str:
        with self._lock:
            self.started += 1
        if not self._open.wait(10):
            raise AssertionError("the gate was never opened")
        return "done"

    def open(self) -> None:
        self._open.set()


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def _settled(pool: QueryPool, running: int) -> None:
    for _ in range(200):
        if pool.running == running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{pool.running} queries run, expected {running}")


async def test_the_pool_refuses_at_once_past_its_size_and_each_clients_share() -> None:
    registry = CollectorRegistry()
    pool = QueryPool(max_running=3, max_per_client=2, registry=registry)
    gate = Gate()
    try:
        a1 = asyncio.ensure_future(pool.run("10.0.0.1", gate.query))
        a2 = asyncio.ensure_future(pool.run("10.0.0.1", gate.query))
        await asyncio.sleep(0)
        started = time.monotonic()
        with pytest.raises(QueryBusy, match="2 of your history queries") as client_busy:
            await pool.run("10.0.0.1", gate.query)
        b1 = asyncio.ensure_future(pool.run("10.0.0.2", gate.query))
        await asyncio.sleep(0)
        with pytest.raises(QueryBusy, match="3 history queries are running") as busy:
            await pool.run("10.0.0.3", gate.query)
        assert time.monotonic() - started < 0.5  # refused, not queued
        assert (client_busy.value.status, busy.value.status) == (429, 429)
        assert busy.value.retry_after_s == 1
        assert _value(registry, "torshmon_queries_running") == 3
        assert _value(registry, "torshmon_queries_refused_total", reason="busy") == 1
        assert _value(registry, "torshmon_queries_refused_total", reason="client_busy") == 1
        gate.open()
        assert list(await asyncio.gather(a1, a2, b1)) == ["done"] * 3
        await _settled(pool, 0)
        assert await pool.run("10.0.0.1", lambda _: 7) == 7
        assert gate.started == 3
        assert _value(registry, "torshmon_queries_running") == 0
    finally:
        gate.open()
        await pool.aclose()


async def test_a_slot_frees_when_the_query_ends_not_when_its_caller_goes() -> None:
    pool = QueryPool(max_running=1, max_per_client=1)
    gate = Gate()
    try:
        caller = asyncio.ensure_future(pool.run("c", gate.query))
        await asyncio.sleep(0.05)
        caller.cancel()  # the client hung up; its statement still runs
        with pytest.raises(asyncio.CancelledError):
            await caller
        with pytest.raises(QueryBusy):
            await pool.run("other", gate.query)
        gate.open()
        await _settled(pool, 0)
        assert await pool.run("other", lambda _: "next") == "next"
    finally:
        gate.open()
        await pool.aclose()


async def test_closing_the_pool_interrupts_a_runaway_sqlite_query(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    sqlite3.connect(path).close()
    pool = QueryPool(max_running=2, max_per_client=2)
    url = f"sqlite:///{path}"
    running = asyncio.ensure_future(
        pool.run("c", lambda i: run_query(url, RUNAWAY, timeout_s=60, interrupt=i))
    )
    await asyncio.sleep(0.3)
    assert not running.done()
    started = time.monotonic()
    await pool.aclose()
    with pytest.raises(QueryError, match=r"^query cancelled: the aggregator is stopping$"):
        await running
    assert time.monotonic() - started < 5
    with pytest.raises(QueryBusy, match="stopping") as refused:
        await pool.run("c", lambda _: None)
    assert refused.value.status == 503
    await pool.aclose()  # twice is safe


def test_an_interrupt_before_the_query_stops_it_as_it_starts(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    sqlite3.connect(path).close()
    interrupt = Interrupt()
    interrupt.interrupt("no longer wanted")
    interrupt.interrupt("a second reason is ignored")
    with pytest.raises(QueryError, match=r"^query cancelled: no longer wanted$"):
        run_query(f"sqlite:///{path}", "SELECT 1", interrupt=interrupt)


class _InterruptedOnceBound(Interrupt):
    """Interrupted right after the query binds it, before its statement runs."""

    def _bind(self, stop: Any) -> None:
        super()._bind(stop)
        self.interrupt("the client hung up")


def test_an_interrupt_between_binding_and_running_still_stops_the_query(tmp_path: Path) -> None:
    """SQLite's own interrupt is a no-op while no statement runs (stop 52 CI: the query
    ran on to its timeout); the query still ends at once."""
    path = tmp_path / "h.db"
    sqlite3.connect(path).close()
    started = time.monotonic()
    with pytest.raises(QueryError, match=r"^query cancelled: the client hung up$"):
        run_query(f"sqlite:///{path}", RUNAWAY, timeout_s=30, interrupt=_InterruptedOnceBound())
    assert time.monotonic() - started < 5


def test_a_statement_timeout_is_still_told_as_one(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    sqlite3.connect(path).close()
    with pytest.raises(QueryError, match=r"cancelled after the 0\.2 s timeout"):
        run_query(f"sqlite:///{path}", RUNAWAY, timeout_s=0.2, interrupt=Interrupt())


def test_the_pool_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        QueryPool(max_running=0, max_per_client=1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
async def test_queries_run_below_the_aggregators_priority() -> None:
    pool = QueryPool(max_running=1, max_per_client=1)
    try:
        ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        theirs = await pool.run(
            "c", lambda _: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        )
    finally:
        await pool.aclose()
    assert theirs == min(19, ours + QUERY_NICE)
