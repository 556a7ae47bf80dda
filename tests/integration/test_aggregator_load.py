"""The aggregator under abuse on loopback: runaway queries, slow clients, hang-ups.

Each test asserts only what load on a shared machine cannot blur: nothing waits for
the 20 s statement timeout (pages, the API and a real job's ingest answer in a few
seconds at most), queries past the pool are refused at once, and slow clients'
sockets are closed within a few header timeouts. ``benchmarks/api_load.py`` measures
the same things and prints the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine, create_engine, text

from tests.integration.aggregator_thread import AggregatorThread
from tests.integration.multinode import train_until_stopped
from tests.pg import pg_url  # noqa: F401  (the fixture)
from torshmon.agent.daemon import Agent, AgentSettings
from torshmon.aggregator.service import INGEST_PATH
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

T = TypeVar("T")

TOKEN = "load-token"
#: The statement timeout: no answer below may come anywhere near it.
QUERY_TIMEOUT_S = 20.0
#: A bound far under the statement timeout, far over any answer of an idle server.
FAST_S = 5.0
HEADER_TIMEOUT_S = 1.0
RUNAWAY_PG = "SELECT pg_sleep(60)"
RUNAWAY_SQLITE = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
)


@dataclass
class Answer:
    status: int
    body: dict[str, object]
    headers: dict[str, str]
    elapsed_s: float


def call(
    port: int, method: str, path: str, payload: object = None, *, timeout_s: float = 60.0
) -> Answer:
    """One request on a fresh connection, timed from connecting to the last byte."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        body = None if payload is None else json.dumps(payload).encode()
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        answer_headers = {k.lower(): v for k, v in response.getheaders()}
        status = response.status
    finally:
        conn.close()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = {"raw": raw[:200].decode(errors="replace")}
    return Answer(status, parsed, answer_headers, time.monotonic() - started)


#: The real job: its name, its ranks, the environment they run in, and the pause after
#: each step (seconds), which leaves the machine's cores to the aggregator and the test.
JOB = "loadjob"
RANKS = 2
JOB_ENV = {"OMP_NUM_THREADS": "1"}
JOB_SLEEP_S = 0.05
#: How long the ranks may take to start (spawn, import torch, rendezvous) on a loaded
#: machine, and to stop once told, seconds.
JOB_START_S = 120.0
JOB_STOP_S = 30.0


@dataclass
class RealJob:
    """``RANKS`` gloo ranks running ``train_until_stopped``; ``stop`` ends them and
    returns each rank's steps."""

    ranks: Future[list[int]]
    stop_file: Path

    def stop(self) -> list[int]:
        self.stop_file.touch()
        return self.ranks.result(JOB_STOP_S)

    def check_running(self) -> None:
        """Raises the ranks' error (RankError) if they have ended."""
        if self.ranks.done():
            self.ranks.result()


@contextlib.contextmanager
def job_running(sock: str, tmp_path: Path) -> Iterator[RealJob]:
    """A real job reporting to the agent at ``sock``; stopped on leaving."""
    launcher = ThreadPoolExecutor(1)
    stop_file = tmp_path / "stop-job"
    ranks = launcher.submit(
        run_ranks,
        train_until_stopped,
        RANKS,
        str(stop_file),
        JOB_SLEEP_S,
        JOB,
        sock,
        timeout_s=JOB_START_S + JOB_STOP_S + QUERY_TIMEOUT_S,
        env=JOB_ENV,
    )
    try:
        yield RealJob(ranks, stop_file)
    finally:
        stop_file.touch()
        launcher.shutdown(wait=True)  # run_ranks' timeout bounds it


@contextlib.contextmanager
def agent_forwarding(url: str, tmp_path: Path) -> Iterator[Agent]:
    """A real agent forwarding to the aggregator at ``url``, on an event loop of its
    own (it is a process of its own in production)."""
    settings = AgentSettings(
        socket_path=str(tmp_path / "agent.sock"),
        metrics_port=0,
        aggregator_url=url,
        token=TOKEN,
        spool_path=str(tmp_path / "spool.db"),
        sample_interval_s=1.0,
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    try:
        agent = call(_started_agent(settings))
        try:
            yield agent
        finally:
            call(agent.aclose())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _started_agent(settings: AgentSettings) -> Agent:
    agent = Agent(settings, registry=CollectorRegistry())
    await agent.start()
    return agent


@dataclass(frozen=True)
class Stored:
    """One rank's rows in the ``steps`` table."""

    rows: int
    distinct_steps: int
    first_step: int
    last_step: int
    newest_end_unix_ns: int


def stored_steps(db: Engine) -> dict[int, Stored]:
    """The job's stored steps, by rank."""
    sql = text(
        "SELECT rank, count(*), count(DISTINCT step), min(step), max(step), max(end_unix_ns) "
        "FROM steps WHERE job = :job GROUP BY rank"
    )
    with db.connect() as conn:
        return {
            int(rank): Stored(*(int(v) for v in values))
            for rank, *values in conn.execute(sql, {"job": JOB})
        }


def wait_stored(
    db: Engine, job: RealJob, enough: Callable[[dict[int, Stored]], bool], timeout_s: float
) -> dict[int, Stored]:
    """The job's stored steps once ``enough`` of them are; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not enough(stored := stored_steps(db)):
        job.check_running()
        assert time.monotonic() < deadline, f"after {timeout_s} s the steps stored are {stored}"
        time.sleep(0.1)
    return stored


@pytest.fixture
def history_db(pg_url: str) -> Iterator[Engine]:  # noqa: F811
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()


def slow_client(port: int, head: bytes) -> socket.socket:
    """A connection that sends ``head`` (part of a request, or nothing) and stops."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if head:
        sock.sendall(head)
    return sock


def until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """What the server sent before closing ``sock``, and when it closed (monotonic);
    raises socket.timeout if it stays open past ``timeout_s``."""
    sock.settimeout(timeout_s)
    received = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return received, time.monotonic()
        received += chunk


def metric(port: int, name: str, labels: str = "") -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        text = response.read().decode()
    finally:
        conn.close()
    assert response.status == 200, f"/metrics answered {response.status}: {text[:300]}"
    series = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in /metrics")


def _settings(db_url: str, **overrides: object) -> AggregatorSettings:
    values: dict[str, object] = {
        "port": 0,
        "db_url": db_url,
        "token": TOKEN,
        "aggregator_id": "agg-load",
        "query_timeout_s": QUERY_TIMEOUT_S,
        "query_max_running": 4,
        # One loopback address is one client: let it fill the pool here.
        "query_max_per_client": 4,
        "http_header_timeout_s": HEADER_TIMEOUT_S,
        "http_body_timeout_s": 2.0,
        **overrides,
    }
    return AggregatorSettings(**values)  # type: ignore[arg-type]


def test_runaway_queries_and_slow_clients_stall_nothing_on_postgresql(
    pg_url: str,  # noqa: F811
    history_db: Engine,
    tmp_path: Path,
) -> None:
    """12 queries that would sleep past the 20 s statement timeout and 60 slow clients
    while a real job (2 gloo ranks, their agent forwarding) trains: 4 queries run, 8 are
    refused at once with Retry-After; pages and the API answer in seconds; the job's
    steps keep reaching the steps table, each within seconds of its end, and none is
    lost; the slow clients' sockets close after the 1 s header timeout, and stopping
    the aggregator cancels the sleeping queries."""
    with (
        AggregatorThread(_settings(pg_url)) as agg,
        agent_forwarding(agg.url, tmp_path) as agent,
        job_running(agent.settings.socket_path, tmp_path) as job,
    ):
        port = agg.aggregator.port
        assert port is not None and agent.forwarder is not None
        wait_stored(history_db, job, lambda s: len(s) == RANKS, JOB_START_S)
        slow = [slow_client(port, b"GET /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n")]
        slow += [slow_client(port, b"POST /api/v1/query HTT") for _ in range(29)]
        slow += [slow_client(port, b"") for _ in range(30)]
        opened = started = time.monotonic()
        pool = ThreadPoolExecutor(12)  # not a with block: its end would wait for them
        queries = [
            pool.submit(call, port, "POST", "/api/v1/query", {"sql": RUNAWAY_PG}) for _ in range(12)
        ]
        # The refused ones answer while the others sleep.
        refused = [f.result(FAST_S) for f in _first_done(queries, 8, FAST_S)]
        assert [a.status for a in refused] == [429] * 8, [a.body for a in refused]
        assert all(a.headers.get("retry-after") == "1" for a in refused)
        assert "query_max_running" in str(refused[0].body["error"])
        assert max(a.elapsed_s for a in refused) < FAST_S
        assert metric(port, "torshmon_queries_running") == 4
        before = stored_steps(history_db)
        for path in ("/api/v1/jobs", "/", f"/api/v1/jobs/{JOB}", "/healthz"):
            answer = call(port, "GET", path, timeout_s=QUERY_TIMEOUT_S)
            assert answer.status == 200, (path, answer.body)
            assert answer.elapsed_s < FAST_S, (path, answer.elapsed_s)
        for i, sock in enumerate(slow):
            received, closed = until_closed(sock, FAST_S)
            # A 408 to a client that sent part of a request; nothing to one that sent none.
            assert received.startswith(b"HTTP/1.1 408 ") if i < 30 else received == b""
            assert closed - opened < HEADER_TIMEOUT_S + FAST_S
            sock.close()
        timed_out = metric(port, "torshmon_http_client_timeouts_total", 'phase="headers"')
        assert timed_out == len(slow)
        # Left: the 4 queries', /metrics' and the agent's (if it is posting).
        assert 5 <= metric(port, "torshmon_http_connections") <= 6
        # The job's steps keep arriving while the queries sleep, each seconds after it ended.
        during = wait_stored(
            history_db,
            job,
            lambda s: all(s[r].rows >= before[r].rows + 2 for r in range(RANKS)),
            FAST_S,
        )
        behind_s = (time.time_ns() - max(s.newest_end_unix_ns for s in during.values())) / 1e9
        assert behind_s < FAST_S, during
        steps = job.stop()
        assert steps == [steps[0]] * RANKS
        # All of them stored, once each: none lost, none waiting in the agent's spool.
        final = wait_stored(
            history_db, job, lambda s: all(s[r].rows >= steps[r] for r in range(RANKS)), FAST_S
        )
        assert {
            r: (s.rows, s.distinct_steps, s.first_step, s.last_step) for r, s in final.items()
        } == {r: (steps[r], steps[r], 1, steps[r]) for r in range(RANKS)}
        assert agent.forwarder.failures_total == 0  # no ingest refused, failed or timed out
        running = [f for f in queries if not f.done()]
        assert len(running) == 4
    # Stopping the aggregator interrupted the queries still sleeping.
    cancelled = [f.result(FAST_S) for f in running]
    pool.shutdown()
    assert [a.status for a in cancelled] == [400] * 4
    assert all("aggregator is stopping" in str(a.body["error"]) for a in cancelled), cancelled
    assert time.monotonic() - started < QUERY_TIMEOUT_S


def _first_done(
    futures: list[Future[Answer]], count: int, timeout_s: float
) -> list[Future[Answer]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [f for f in futures if f.done()]
        if len(done) >= count:
            return done
        time.sleep(0.02)
    raise AssertionError(f"only {sum(f.done() for f in futures)} of {count} answered at once")


def test_runaway_queries_on_sqlite_take_their_clients_share_only(tmp_path: Path) -> None:
    """On SQLite (a recursive CTE that never ends), one client runs 2 queries of the
    pool's 4 and its next is refused at once; the API answers meanwhile, and stopping
    the aggregator interrupts the 2."""
    settings = _settings(f"sqlite:///{tmp_path / 'h.db'}", query_max_per_client=2)
    started = time.monotonic()
    pool = ThreadPoolExecutor(4)
    with AggregatorThread(settings) as agg:
        port = agg.aggregator.port
        assert port is not None
        queries = [
            pool.submit(call, port, "POST", "/api/v1/query", {"sql": RUNAWAY_SQLITE})
            for _ in range(4)
        ]
        refused = [f.result(FAST_S) for f in _first_done(queries, 2, FAST_S)]
        assert [a.status for a in refused] == [429, 429]
        assert "query_max_per_client" in str(refused[0].body["error"])
        assert metric(port, "torshmon_queries_refused_total", 'reason="client_busy"') == 2
        for path in ("/api/v1/jobs", "/api/v1/alerts", "/"):
            answer = call(port, "GET", path, timeout_s=QUERY_TIMEOUT_S)
            assert answer.status == 200 and answer.elapsed_s < FAST_S, (path, answer)
        running = [f for f in queries if not f.done()]
        assert len(running) == 2
    cancelled = [f.result(FAST_S) for f in running]
    pool.shutdown()
    assert [a.body["error"] for a in cancelled] == [
        "query cancelled: the aggregator is stopping"
    ] * 2
    assert time.monotonic() - started < QUERY_TIMEOUT_S


@pytest.fixture
def agg(tmp_path: Path) -> Iterator[AggregatorThread]:
    with AggregatorThread(
        _settings(f"sqlite:///{tmp_path / 'h.db'}", http_max_connections=20)
    ) as thread:
        yield thread


def _partial_post(port: int, path: str, sent: bytes, length: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode() + sent)
    return sock


def test_a_client_that_hangs_up_mid_body_is_one_line_not_a_traceback(
    agg: AggregatorThread, caplog: pytest.LogCaptureFixture
) -> None:
    port = agg.aggregator.port
    assert port is not None
    caplog.set_level(logging.WARNING)
    for path in (INGEST_PATH, "/api/v1/query", INGEST_PATH):
        for _ in range(5):
            sock = _partial_post(port, path, b'{"agent_id": "a', 10_000)
            time.sleep(0.05)  # the head is read and the handler waits for the body
            sock.close()
    assert call(port, "GET", "/healthz").status == 200  # and it has seen them all
    records = [r for r in caplog.records if r.name.startswith(("torshmon", "aiohttp"))]
    assert [r for r in records if r.exc_info or r.levelno >= logging.ERROR] == []
    # Rate-limited: at most one line in these 15 hang-ups (another test may have had it).
    lines = [r.getMessage() for r in records]
    assert len(lines) <= 1 and all("hung up" in line for line in lines), lines


def test_a_body_slower_than_its_timeout_gets_408_and_a_closed_socket(agg: AggregatorThread) -> None:
    port = agg.aggregator.port
    assert port is not None
    # Timed from before the connection: the server may start its clock at any point
    # after it, and a pause of this thread after sending must not make it look early.
    sent = time.monotonic()
    sock = _partial_post(port, "/api/v1/query", b'{"sql": "SEL', 100)
    received, closed = until_closed(sock, FAST_S + 2.0)
    sock.close()
    assert received.startswith(b"HTTP/1.1 408 "), received
    assert b"http_body_timeout_s" in received
    assert 2.0 <= closed - sent < 2.0 + FAST_S
    assert metric(port, "torshmon_http_client_timeouts_total", 'phase="body"') == 1


def test_connections_over_the_cap_get_503_until_some_close(agg: AggregatorThread) -> None:
    port = agg.aggregator.port
    assert port is not None
    held = [slow_client(port, b"GET /healthz HTTP/1.1\r\n") for _ in range(20)]
    time.sleep(0.2)  # all connected
    over = slow_client(port, b"")
    received, _ = until_closed(over, FAST_S)
    over.close()
    assert received.startswith(b"HTTP/1.1 503 "), received
    assert b"http_max_connections" in received and b"Retry-After: 1" in received
    for sock in held[:5]:
        sock.close()
    deadline = time.monotonic() + FAST_S
    while (answer := _try_health(port)) != 200:
        assert time.monotonic() < deadline, answer
        time.sleep(0.05)
    assert metric(port, "torshmon_http_connections_refused_total") >= 1
    for sock in held[5:]:
        sock.close()


def _try_health(port: int) -> int:
    try:
        return call(port, "GET", "/healthz", timeout_s=FAST_S).status
    except (OSError, http.client.HTTPException):
        return 0


def test_a_kept_alive_connection_has_the_header_timeout_from_its_next_byte(
    tmp_path: Path,
) -> None:
    """Idle between requests a connection waits for http_idle_timeout_s (3 s), not
    the 1 s header timeout; once the next request starts, its head has 1 s."""
    settings = _settings(f"sqlite:///{tmp_path / 'h.db'}", http_idle_timeout_s=3.0)
    with AggregatorThread(settings) as agg:
        port = agg.aggregator.port
        assert port is not None
        slow, idle = (http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in "ab")
        for conn in (slow, idle):
            conn.request("GET", "/healthz")
            assert conn.getresponse().read().startswith(b'{"status": "ok"')
        answered = time.monotonic()
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        assert slow.sock is not None and idle.sock is not None
        slow.sock.sendall(b"GET /healthz HTT")
        sent = time.monotonic()
        received, closed = until_closed(slow.sock, FAST_S)
        assert received.startswith(b"HTTP/1.1 408 "), received
        assert HEADER_TIMEOUT_S - 0.1 <= closed - sent < HEADER_TIMEOUT_S + FAST_S
        received, closed = until_closed(idle.sock, FAST_S + 3.0)
        assert received == b""
        assert 3.0 - 0.1 <= closed - answered < 3.0 + FAST_S
        slow.close()
        idle.close()


def test_a_client_that_hangs_up_frees_its_querys_slot(agg: AggregatorThread) -> None:
    """Its statement is interrupted, not left to run to the 20 s timeout."""
    port = agg.aggregator.port
    assert port is not None
    body = json.dumps({"sql": RUNAWAY_SQLITE}).encode()
    sock = _partial_post(port, "/api/v1/query", body, len(body))
    deadline = time.monotonic() + FAST_S
    while metric(port, "torshmon_queries_running") != 1:
        assert time.monotonic() < deadline, "the query never ran"
        time.sleep(0.05)
    sock.close()
    closed = time.monotonic()
    while metric(port, "torshmon_queries_running") != 0:
        assert time.monotonic() - closed < FAST_S, "the query ran on"
        time.sleep(0.05)
    answer = call(port, "POST", "/api/v1/query", {"sql": "SELECT 1 AS one"})
    assert (answer.status, answer.body["rows"]) == (200, [[1]])
