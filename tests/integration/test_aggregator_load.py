"""The aggregator under abuse on loopback: runaway queries, slow clients, hang-ups.

Each test asserts only what load on a shared machine cannot blur: nothing waits for
the 20 s statement timeout (pages, the API and ingest answer in a few seconds at
most), queries past the pool are refused at once, and slow clients' sockets are
closed within a few header timeouts. ``benchmarks/api_load.py`` measures the same
things and prints the figures.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration import wire_factory as wf
from tests.integration.aggregator_thread import AggregatorThread
from tests.pg import pg_url  # noqa: F401  (the fixture)
from torshmon.aggregator.service import INGEST_PATH
from torshmon.aggregator.settings import AggregatorSettings

pytestmark = pytest.mark.integration

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


@dataclass
class Ingest:
    """Posts one agent's batches (one step of 2 ranks each) until stopped, timing each."""

    port: int
    latencies_s: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        h0, h1 = wf.hello("loadjob", 0, 2), wf.hello("loadjob", 1, 2)
        seq = 1
        self._post(wf.ingest_body("agent-load", [(seq, wf.record(h0, h1))]))
        while not self._stop.wait(0.1):
            seq += 1
            steps = [wf.step(seq)]
            record = wf.record(wf.batch(h0, seq, steps), wf.batch(h1, seq, steps))
            self._post(wf.ingest_body("agent-load", [(seq, record)]))

    def _post(self, body: bytes) -> None:
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
            conn.request("POST", INGEST_PATH, body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            self.statuses.append(response.status)
        except OSError:
            self.statuses.append(0)  # the server stopped (a test's end), or failed
        finally:
            conn.close()
        self.latencies_s.append(time.monotonic() - started)

    def wait_stored(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.statuses.count(200) < count:
            assert time.monotonic() < deadline, f"ingest answered {self.statuses}"
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()


@pytest.fixture
def ingest_running() -> Iterator[Callable[[int], Ingest]]:
    threads: list[tuple[Ingest, threading.Thread]] = []

    def start(port: int) -> Ingest:
        ingest = Ingest(port)
        thread = threading.Thread(target=ingest.run, daemon=True)
        thread.start()
        threads.append((ingest, thread))
        return ingest

    yield start
    for ingest, thread in threads:
        ingest.stop()
        thread.join(30)


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
    ingest_running: Callable[[int], Ingest],
) -> None:
    """12 queries that would sleep past the 20 s statement timeout, 60 slow clients and
    a running ingest: 4 queries run, 8 are refused at once with Retry-After; pages,
    API and ingest answer in seconds; the slow clients' sockets close after the 1 s
    header timeout, and stopping the aggregator cancels the sleeping queries."""
    started = time.monotonic()
    with AggregatorThread(_settings(pg_url)) as agg:
        port = agg.aggregator.port
        assert port is not None
        ingest = ingest_running(port)
        ingest.wait_stored(2, 30)
        slow = [slow_client(port, b"GET /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n")]
        slow += [slow_client(port, b"POST /api/v1/query HTT") for _ in range(29)]
        slow += [slow_client(port, b"") for _ in range(30)]
        opened = time.monotonic()
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
        for path in ("/api/v1/jobs", "/", "/api/v1/jobs/loadjob", "/healthz"):
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
        # Left: the 4 queries', /metrics' and the ingest's (if it is posting).
        assert 5 <= metric(port, "torshmon_http_connections") <= 6
        ingest.stop()
        assert set(ingest.statuses) == {200}
        assert max(ingest.latencies_s) < FAST_S, ingest.latencies_s
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
    sock = _partial_post(port, "/api/v1/query", b'{"sql": "SEL', 100)
    sent = time.monotonic()
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
