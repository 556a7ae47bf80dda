"""The pool that runs users' history queries (``POST /api/v1/query``), apart from the rest.

A user's statement may run until its statement timeout (30 s by default) and does
not need to be slow to be large. The queries run on threads of their own, at most
``max_running`` at once and ``max_per_client`` for one client (a peer address; the
token is shared, so it tells no one apart); one more is refused at once with a
``QueryBusy`` (the API's 429 with ``Retry-After``), never queued behind the running
ones. The pages and the API read on the default executor and ingest is stored on its
writer, and each query opens a database connection of its own (``run_query``), so
nothing else waits for a query: neither a thread nor a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections import Counter as Tally
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from torshmon.catalogue import metrics as catalogue
from torshmon.history.query import Interrupt

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What a refused client is told to wait, seconds: a slot frees when any query ends,
#: which for the usual short query is well under this.
RETRY_AFTER_S: Final = 1
#: How long ``aclose`` waits for interrupted queries to end, seconds.
_CLOSE_WAIT_S: Final = 5.0
#: How much lower (nice steps) query threads run than the aggregator. A query that
#: computes (a recursive CTE on SQLite) takes a core, and the event loop then waited for
#: one: benchmarks/api_load.py on 2 shared cores, 12 runaway SQLite queries (4 running),
#: page latency median 41-54 ms (p95 100-126 ms) at the same priority, 1.1-2.9 ms (p95
#: 11-17 ms) 10 steps lower; 1.0-1.1 ms with no query.
QUERY_NICE: Final = 10


class QueryBusy(Exception):
    """A query refused because the pool, or the client's share of it, is full (the
    HTTP ``status`` 429), or because the pool is closing (503); the text says which,
    ``retry_after_s`` when to try again."""

    def __init__(self, message: str, *, status: int = 429, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class QueryPool:
    """Runs queries on ``max_running`` threads of its own, at most ``max_per_client``
    of them for one client; ``run`` refuses the next at once.

    Event-loop thread only. A slot is taken from ``run``'s admission until the query's
    thread is done with it: a caller that goes away does not free it while the
    statement still runs (the API interrupts the query of a client that hangs up).
    ``aclose`` interrupts the running queries.
    """

    def __init__(
        self,
        *,
        max_running: int,
        max_per_client: int,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if max_running < 1 or max_per_client < 1:
            raise ValueError(
                f"max_running and max_per_client must be at least 1, got {max_running} "
                f"and {max_per_client}"
            )
        self.max_running = max_running
        self.max_per_client = min(max_per_client, max_running)
        self._executor = ThreadPoolExecutor(
            max_running, thread_name_prefix="torshmon-query", initializer=_lower_priority
        )
        self._running: dict[Future[Any], Interrupt] = {}
        self._per_client: Tally[str] = Tally()
        self._closed = False
        spec = catalogue.QUERIES_REFUSED_TOTAL
        self._refused = Counter(spec.family_name, spec.help, spec.labels, registry=registry)
        spec = catalogue.QUERIES_RUNNING
        self._gauge = Gauge(spec.name, spec.help, spec.labels, registry=registry)

    @property
    def running(self) -> int:
        """Queries admitted whose thread has not finished yet."""
        return len(self._running)

    async def run(
        self, client: str, query: Callable[[Interrupt], T], interrupt: Interrupt | None = None
    ) -> T:
        """``query(interrupt)`` on a thread of the pool, for ``client``; its result.
        ``interrupt`` (a new one if None) is also the one ``aclose`` interrupts.

        Raises QueryBusy at once when ``max_running`` queries run, or
        ``max_per_client`` of ``client``'s, or the pool is closed.
        """
        if self._closed:
            raise QueryBusy("the aggregator is stopping; retry later", status=503)
        if len(self._running) >= self.max_running:
            self._refused.labels("busy").inc()
            raise QueryBusy(
                f"{self.max_running} history queries are running, the most at once "
                "(query_max_running); retry later"
            )
        if self._per_client[client] >= self.max_per_client:
            self._refused.labels("client_busy").inc()
            raise QueryBusy(
                f"{self.max_per_client} of your history queries are running, the most one "
                "client may run at once (query_max_per_client); retry later"
            )
        interrupt = Interrupt() if interrupt is None else interrupt
        future = self._executor.submit(query, interrupt)
        self._running[future] = interrupt
        self._per_client[client] += 1
        self._gauge.set(len(self._running))
        loop = asyncio.get_running_loop()
        future.add_done_callback(lambda _: _call_soon(loop, self._release, future, client))
        return await asyncio.wrap_future(future, loop=loop)

    def _release(self, future: Future[Any], client: str) -> None:
        self._running.pop(future, None)
        self._per_client[client] -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]
        self._gauge.set(len(self._running))

    async def aclose(self) -> None:
        """Refuse new queries, interrupt the running ones and wait (a few seconds at
        most) for their threads; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        running = list(self._running.items())
        loop = asyncio.get_running_loop()
        for _, interrupt in running:  # a PostgreSQL cancel connects: off the loop
            await loop.run_in_executor(None, interrupt.interrupt, "the aggregator is stopping")
        if running:
            # gather retrieves the queries' errors: their handlers have them already.
            ended = asyncio.gather(
                *(asyncio.wrap_future(f) for f, _ in running), return_exceptions=True
            )
            done, _ = await asyncio.wait({ended}, timeout=_CLOSE_WAIT_S)
            if not done:
                ended.cancel()
                log.warning("history queries still ran when the aggregator stopped")
        self._executor.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """Run the calling (query) thread ``QUERY_NICE`` steps lower, where Linux allows it
    (a thread's id is a process id there); a query runs as well without it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + QUERY_NICE)
        )
    except OSError as exc:  # a sandbox that forbids it
        log.debug("history query thread priority unchanged: %s", exc)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)`` on ``loop`` from a pool thread; nothing if the loop has closed."""
    with contextlib.suppress(RuntimeError):  # the loop is closed, and the pool with it
        loop.call_soon_threadsafe(fn, *args)
