"""The aggregator's pages, API and ingest under runaway queries, and what slow clients hold.

A real aggregator process (``torshmon aggregator``, fresh database, a token) on a
loopback port, while this process plays an agent that ingests one 2-rank job's steps
every 0.1 s, and a user who reloads the pages and the API in a loop:

1. *0 runaway*: latency of ``GET /api/v1/jobs``, ``GET /api/v1/jobs/{job}``, ``GET /``
   (the pages' index) and of each ingest POST, for ``--seconds``;
2. *12 runaway*: the same while 12 clients each keep one query in flight that runs to
   the statement timeout (a recursive CTE that never ends on SQLite, ``pg_sleep`` on
   PostgreSQL), re-sent as soon as it is answered or refused; the pool admits
   ``query_max_running`` (4) and refuses the rest at once with 429;
3. *slow clients* (the runaway queries still running): 150 connections that each
   send half a request and stop; how long the server held each (from its connect to
   the close), how many it held more than a second past the header timeout, and the
   server's ``torshmon_http_connections`` before and after.

``query_max_per_client`` is set to ``query_max_running`` here, so that the one
loopback address can fill the pool: the worst many clients can do together.

Prints one table of latencies (ms) per phase and endpoint, a line for the slow
clients, then (the last line of stdout) one JSON object.

Usage::

    python benchmarks/api_load.py                 # SQLite, about 45 s
    python benchmarks/api_load.py --db-url postgresql+psycopg://postgres@127.0.0.1/bench
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import format_table
from tests.integration import wire_factory as wf

TOKEN = "api-load-token"
JOB = "benchjob"
RUNAWAY = {
    "sqlite": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
    "SELECT count(*) FROM c",
    "postgresql": "SELECT pg_sleep(3600)",
}
PAGES = ("/api/v1/jobs", f"/api/v1/jobs/{JOB}", "/")
SLOW_CLIENTS = 150


def _request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, float]:
    """Status and seconds of one request on a fresh connection."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status, time.monotonic() - started
    except (OSError, http.client.HTTPException):
        return 0, time.monotonic() - started
    finally:
        conn.close()


@contextmanager
def aggregator(db_url: str, header_timeout_s: float, query_timeout_s: float) -> Iterator[int]:
    """A ``torshmon aggregator`` process; yields its port."""
    env = {
        **os.environ,
        "TORSHMON_TOKEN": TOKEN,
        "TORSHMON_AGGREGATOR_QUERY_TIMEOUT_S": str(query_timeout_s),
        "TORSHMON_AGGREGATOR_QUERY_MAX_RUNNING": "4",
        "TORSHMON_AGGREGATOR_QUERY_MAX_PER_CLIENT": "4",
        "TORSHMON_AGGREGATOR_HTTP_HEADER_TIMEOUT_S": str(header_timeout_s),
    }
    code = "import sys; from torshmon.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [sys.executable, "-c", code, "aggregator", "--port", "0", "--db", db_url]
    process = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"listening on http://[^:]+:(\d+)", line)
        if match is None:
            raise RuntimeError(f"the aggregator did not start (said {line!r})")
        yield int(match[1])
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Ingest:
    """One agent posting a step of both ranks every 0.1 s; the latency of each POST."""

    port: int
    latencies_s: list[float] = field(default_factory=list)
    failures: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        h0, h1 = wf.hello(JOB, 0, 2), wf.hello(JOB, 1, 2)
        self._post(wf.ingest_body("bench-agent", [(1, wf.record(h0, h1))]))
        seq = 1
        while not self.stop.wait(0.1):
            seq += 1
            steps = [wf.step(seq)]
            record = wf.record(wf.batch(h0, seq, steps), wf.batch(h1, seq, steps))
            self._post(wf.ingest_body("bench-agent", [(seq, record)]))

    def _post(self, body: bytes) -> None:
        status, elapsed = _request(self.port, "POST", "/api/v1/ingest", body)
        if status == 200:
            self.latencies_s.append(elapsed)
        else:
            self.failures += 1

    def window(self, start: int) -> list[float]:
        return self.latencies_s[start:]


@dataclass
class Runaway:
    """``clients`` threads, each keeping one runaway query in flight."""

    port: int
    sql: str
    clients: int
    answers: dict[int, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for _ in range(self.clients):
            threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        body = json.dumps({"sql": self.sql}).encode()
        while not self.stop.is_set():
            status, _ = _request(self.port, "POST", "/api/v1/query", body)
            with self._lock:
                self.answers[status] = self.answers.get(status, 0) + 1
            if status == 429:
                self.stop.wait(0.2)


@dataclass
class Row:
    phase: str
    what: str
    latencies_s: list[float]

    def ms(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank) in milliseconds; None without requests."""
        if not self.latencies_s:
            return None
        ordered = sorted(self.latencies_s)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def ms_text(self, q: float) -> str:
        value = self.ms(q)
        return "-" if value is None else f"{value:.1f}"


def measure_pages(port: int, seconds: float) -> dict[str, list[float]]:
    """Reload every page in turn for ``seconds``; each one's latencies."""
    latencies: dict[str, list[float]] = {path: [] for path in PAGES}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for path in PAGES:
            status, elapsed = _request(port, "GET", path)
            if status != 200:
                raise RuntimeError(f"GET {path} answered {status}")
            latencies[path].append(elapsed)
    return latencies


def slow_clients(port: int, header_timeout_s: float) -> dict[str, float]:
    """Open ``SLOW_CLIENTS`` half requests at once. Each one's hold is the time from
    its connect (a connect may wait while the listen backlog is full) until the server
    closed it; ``held_after_timeout`` counts those still open one second after their
    header timeout. The server's open connections are counted before and after."""
    before = _gauge(port, "torshmon_http_connections")
    socks: list[tuple[socket.socket, float]] = []
    for _ in range(SLOW_CLIENTS):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(b"POST /api/v1/query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        socks.append((sock, time.monotonic()))
    holds: list[float] = []
    pending = list(socks)
    deadline = max(at for _, at in socks) + header_timeout_s + 5.0
    while pending and time.monotonic() < deadline:
        for entry in list(pending):
            sock, connected = entry
            sock.setblocking(False)
            try:
                while sock.recv(4096):
                    pass
            except BlockingIOError:
                continue
            except ConnectionResetError:
                pass
            holds.append(time.monotonic() - connected)
            pending.remove(entry)
        time.sleep(0.02)
    after = _gauge(port, "torshmon_http_connections")
    for sock, _ in socks:
        sock.close()
    late = sum(h > header_timeout_s + 1.0 for h in holds) + len(pending)
    return {
        "slow_clients": SLOW_CLIENTS,
        "held_after_timeout": late,
        "server_connections_before": before,
        "server_connections_after": after,
        "hold_median_s": statistics.median(holds) if holds else float("nan"),
        "hold_max_s": max(holds) if holds else float("nan"),
        "connect_max_s": max(at for _, at in socks) - socks[0][1],
    }


def _gauge(port: int, name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{name} is not in /metrics")
    return float(match[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db-url", help="history database (default: a fresh SQLite file)")
    parser.add_argument("--seconds", type=float, default=8.0, help="each latency window")
    parser.add_argument("--runaway", type=int, default=12, help="runaway query clients")
    parser.add_argument("--header-timeout", type=float, default=10.0)
    parser.add_argument("--query-timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        db_url = args.db_url or f"sqlite:///{tmp}/history.db"
        backend = "postgresql" if db_url.startswith("postgresql") else "sqlite"
        with aggregator(db_url, args.header_timeout, args.query_timeout) as port:
            return _run(port, backend, args)


def _run(port: int, backend: str, args: argparse.Namespace) -> int:
    ingest = Ingest(port)
    threading.Thread(target=ingest.run, daemon=True).start()
    while not ingest.latencies_s:
        time.sleep(0.05)
    rows: list[Row] = []
    mark = len(ingest.latencies_s)
    for path, values in measure_pages(port, args.seconds).items():
        rows.append(Row("0 runaway", f"GET {path}", values))
    rows.append(Row("0 runaway", "POST ingest", ingest.window(mark)))
    runaway = Runaway(port, RUNAWAY[backend], args.runaway)
    runaway.start()
    time.sleep(1.0)  # the pool fills
    running = _gauge(port, "torshmon_queries_running")
    mark = len(ingest.latencies_s)
    phase = f"{args.runaway} runaway"
    for path, values in measure_pages(port, args.seconds).items():
        rows.append(Row(phase, f"GET {path}", values))
    rows.append(Row(phase, "POST ingest", ingest.window(mark)))
    refused = runaway.answers.get(429, 0)
    slow = slow_clients(port, args.header_timeout)
    runaway.stop.set()
    ingest.stop.set()
    columns = [
        ("phase", lambda r: r.phase),
        ("request", lambda r: r.what),
        ("n", lambda r: str(len(r.latencies_s))),
        ("median ms", lambda r: r.ms_text(0.5)),
        ("p95 ms", lambda r: r.ms_text(0.95)),
        ("max ms", lambda r: r.ms_text(1.0)),
    ]
    print(f"backend {backend}, statement timeout {args.query_timeout:g} s")
    print(format_table(columns, rows))
    print(
        f"runaway queries: {running:g} running, {refused} refused with 429 during the window; "
        f"ingest failures: {ingest.failures}"
    )
    print(
        f"slow clients: {slow['slow_clients']:g} half requests (connected within "
        f"{slow['connect_max_s']:.2f} s); held 1 s past the {args.header_timeout:g} s header "
        f"timeout: {slow['held_after_timeout']:g}; each held {slow['hold_median_s']:.2f} s "
        f"median, {slow['hold_max_s']:.2f} s max; server connections "
        f"{slow['server_connections_before']:g} before, {slow['server_connections_after']:g} "
        "after (the scrape's own included)"
    )
    summary = {
        "backend": backend,
        "latency_ms": {
            f"{r.phase}|{r.what}": {"median": r.ms(0.5), "p95": r.ms(0.95), "max": r.ms(1.0)}
            for r in rows
        },
        "queries_running": running,
        "queries_refused": refused,
        "ingest_failures": ingest.failures,
        **slow,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
