"""Where ingest writes: the aggregator's writer thread, or an ingest process of its own.

Storing a POST (rows built from the wire records, then bulk-inserted) takes about as
much CPU as everything else the aggregator does with it (HTTP, detection, rules),
and in one process both share one interpreter lock. ``ProcessIngest`` runs
``IngestStore`` in a child process instead: the event loop hands it the POST body
as received, the child decodes it again, stores it in one transaction and answers
with a ``StoreSummary`` (what was new), from which the loop rebuilds the ``Stored``
for the live state out of its own decoded batch. Requests are pipelined over one
socket pair and answered in order, so the child never waits for the loop between
two POSTs.

A POST is acknowledged only after the child committed it, as before. If the child
dies, the requests it had not answered fail with ``StoreUnavailable`` (the agents
get 503 and resend; what had been committed de-duplicates) and the next request
starts a new child. The child exits when the aggregator closes the socket, or when
the aggregator itself dies (the socket closes with it).

``ThreadIngest`` stores on the aggregator's writer thread: for databases a second
process cannot open (in-memory SQLite), and for ``ingest_process: false``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, Final, Protocol

from sqlalchemy import exc as sa_exc

import torshmon
from torshmon.aggregator.core.stored import Stored, StoreSummary, rebuild
from torshmon.aggregator.ingest import IngestStore
from torshmon.history.db import make_engine
from torshmon.wire import Command, IngestBatch, decode_json

log = logging.getLogger(__name__)

#: Frame header: the payload's length in bytes.
_HEADER: Final = struct.Struct("!I")
#: How long ``aclose`` waits for the child to finish what it was given and exit.
STOP_TIMEOUT_S: Final = 30.0
#: Allocations between young collections for the daemons (CPython's default is 700).
DAEMON_GC_THRESHOLD: Final = (10_000, 20, 20)


def tune_gc_for_daemon() -> None:
    """Process-wide garbage-collector settings for the aggregator daemon and its ingest
    process, once started.

    What start-up left (modules, SQLAlchemy's compiled statements, the rules) is frozen
    out of every later collection, and young collections run every 10 000 allocations
    instead of 700: ingest allocates and frees many short-lived containers per request,
    and at the default threshold the collector took 5-6 % of the aggregator's CPU under
    load (benchmarks/ingest.py), about 1 % with these settings. For the daemon's process
    only (``run_aggregator``): a library user's process keeps its own settings.
    """
    gc.freeze()
    gc.set_threshold(*DAEMON_GC_THRESHOLD)


class StoreRefused(Exception):
    """The database refused a value of the batch (bad input: the POST gets a 4xx)."""


class StoreUnavailable(Exception):
    """The batch could not be stored now (database or ingest process gone: 503)."""


class IngestWriter(Protocol):
    """Stores one POST; raises StoreRefused or StoreUnavailable, others are bugs."""

    async def store(self, body: bytes, batch: IngestBatch, handed: Sequence[Command]) -> Stored: ...

    async def aclose(self) -> None: ...


def _store_or_raise(store: IngestStore, batch: IngestBatch, handed: Sequence[Command]) -> Stored:
    """``store.store`` with the database's refusals as this module's exceptions."""
    try:
        return store.store(batch, handed)
    except sa_exc.DataError as exc:
        # Values the schema let through but the database refused: bad input.
        raise StoreRefused(f"the database refused a value: {exc.orig}") from exc
    except sa_exc.OperationalError as exc:
        raise StoreUnavailable(f"history database unavailable: {exc.orig}") from exc


class ThreadIngest:
    """Stores on ``executor`` (the aggregator's one writer thread)."""

    def __init__(self, store: IngestStore, executor: Executor) -> None:
        self._store = store
        self._executor = executor

    async def store(self, body: bytes, batch: IngestBatch, handed: Sequence[Command]) -> Stored:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, _store_or_raise, self._store, batch, handed
        )

    async def aclose(self) -> None:
        # On the writer thread, after every write queued before it.
        await asyncio.get_running_loop().run_in_executor(self._executor, self._store.close)


# -- the ingest process ------------------------------------------------------------------
def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from ``sock``; None at a clean end of stream before the first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise EOFError("the aggregator closed the ingest socket mid-frame")
        got += k
    return bytes(buf)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _read_frame(sock: socket.socket) -> bytes | None:
    """The next frame's payload; None when the aggregator closed the socket."""
    header = _read_exact(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    payload = _read_exact(sock, size)
    if payload is None:
        raise EOFError("the aggregator closed the ingest socket mid-frame")
    return payload


def _drain(sock: socket.socket, requests: queue.SimpleQueue[bytes | None]) -> None:
    """Put every frame from ``sock`` on ``requests``, then None (closed or broken)."""
    try:
        while (payload := _read_frame(sock)) is not None:
            requests.put(payload)
    except (OSError, EOFError) as exc:
        log.error("ingest socket broke: %s", exc)
    finally:
        requests.put(None)


def serve(sock: socket.socket) -> None:
    """The ingest process: read the database URL and aggregator id, then store each
    request from ``sock`` and answer it, in order, until the aggregator closes it."""
    config = _read_frame(sock)
    if config is None:
        return
    db_url, aggregator_id = pickle.loads(config)
    engine = make_engine(db_url)
    store = IngestStore(engine, aggregator_id=aggregator_id)
    tune_gc_for_daemon()
    # A thread drains the socket while the main thread stores: the aggregator's event
    # loop only tops up a full socket buffer when it gets to it, which can be after a
    # whole rule evaluation, and this process would wait idle in between.
    requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    threading.Thread(target=_drain, args=(sock, requests), daemon=True).start()
    try:
        while True:
            payload = requests.get()
            if payload is None:
                return
            body, handed = pickle.loads(payload)
            reply: tuple[str, Any]
            try:
                batch = decode_json(body, IngestBatch)
                reply = ("ok", _store_or_raise(store, batch, handed).summary())
            except StoreRefused as exc:
                reply = ("refused", str(exc))
            except StoreUnavailable as exc:
                reply = ("unavailable", str(exc))
            except Exception as exc:  # a bug: answered, logged by the aggregator
                reply = ("error", f"{type(exc).__name__}: {exc}")
            _send_frame(sock, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        store.close()
        engine.dispose()
        sock.close()


class _Channel(asyncio.Protocol):
    """The aggregator's end of the socket: frames out, answers back in request order."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiting: deque[asyncio.Future[bytes]] = deque()
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(self, payload: bytes) -> None:
        """A frame that gets no answer (the configuration)."""
        if self.transport is None:
            raise StoreUnavailable("the ingest process is not running")
        self.transport.write(_HEADER.pack(len(payload)) + payload)

    def request(self, payload: bytes) -> asyncio.Future[bytes]:
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        if self.lost or self.transport is None:
            future.set_exception(StoreUnavailable("the ingest process is not running"))
            return future
        self._waiting.append(future)
        self.transport.write(_HEADER.pack(len(payload)) + payload)
        return future

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + size
            if len(buffer) < end:
                break
            payload = bytes(buffer[start + _HEADER.size : end])
            start = end
            future = self._waiting.popleft()
            if not future.done():  # a cancelled request's answer is dropped
                future.set_result(payload)
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(
                    StoreUnavailable("the ingest process stopped before answering")
                )


class ProcessIngest:
    """Stores in a child process (see the module's docstring). ``start`` first."""

    def __init__(self, db_url: str, aggregator_id: str) -> None:
        self._db_url = db_url
        self._aggregator_id = aggregator_id
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: _Channel | None = None
        self._starting: asyncio.Lock | None = None
        self._closed = False
        #: Children started, the first included (a restart after a crash adds one).
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        self._starting = asyncio.Lock()
        await self._spawn()

    async def _spawn(self) -> None:
        # A fresh interpreter, not multiprocessing: its spawn and forkserver children
        # run the parent's main script again, which a library user's script without a
        # __main__ guard does not survive. The same torshmon as this process's, first.
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(torshmon.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p
        )
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        _, channel = await asyncio.get_running_loop().create_unix_connection(_Channel, sock=ours)
        # The URL goes over the socket: on the command line, ps would show its password.
        channel.send(pickle.dumps((self._db_url, self._aggregator_id)))
        self._process, self._channel = process, channel
        self.starts += 1
        log.info("ingest process %s started", process.pid)

    async def _ready_channel(self) -> _Channel:
        channel = self._channel
        if channel is not None and not channel.lost:
            return channel
        if self._closed or self._starting is None:
            raise StoreUnavailable("the aggregator is stopping")
        async with self._starting:
            if self._channel is None or self._channel.lost:
                await self._reap()
                await self._spawn()
        assert self._channel is not None
        return self._channel

    async def store(self, body: bytes, batch: IngestBatch, handed: Sequence[Command]) -> Stored:
        channel = await self._ready_channel()
        payload = pickle.dumps((body, list(handed)), protocol=pickle.HIGHEST_PROTOCOL)
        outcome, value = pickle.loads(await channel.request(payload))
        if outcome == "ok":
            summary: StoreSummary = value
            return rebuild(batch, summary)
        if outcome == "refused":
            raise StoreRefused(value)
        if outcome == "unavailable":
            raise StoreUnavailable(value)
        raise RuntimeError(f"the ingest process failed: {value}")

    async def _reap(self) -> None:
        """Wait for a child whose socket closed; say how it ended."""
        process, self._process = self._process, None
        if process is None:
            return
        code = await _wait(process, 5.0)
        if code is None:
            process.kill()
            code = await _wait(process, 5.0)
        if not self._closed:
            log.error(
                "ingest process %s ended (exit code %s); starting a new one", process.pid, code
            )

    async def aclose(self) -> None:
        """Close the socket (the child stores what it has, then exits) and wait."""
        if self._closed:
            return
        self._closed = True
        channel, self._channel = self._channel, None
        if channel is not None and channel.transport is not None:
            channel.transport.close()
        process, self._process = self._process, None
        if process is None:
            return
        if await _wait(process, STOP_TIMEOUT_S) is None:
            log.error(
                "ingest process %s did not stop in %.0f s; killed", process.pid, STOP_TIMEOUT_S
            )
            process.kill()
            await _wait(process, 5.0)


async def _wait(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """``process``'s exit code, or None if it still runs after ``timeout_s``."""

    def wait() -> int | None:
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    return await asyncio.get_running_loop().run_in_executor(None, wait)


def main(argv: Sequence[str]) -> int:
    """``python -m torshmon.aggregator.writer FD``: the ingest process on socket FD."""
    # Ctrl-C reaches the whole process group; the aggregator decides when this stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m torshmon.aggregator.writer FD (started by the aggregator)")
        return 2
    serve(socket.socket(fileno=int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
