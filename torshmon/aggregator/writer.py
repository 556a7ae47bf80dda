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
import contextlib
import logging
import multiprocessing
import pickle
import signal
import socket
import struct
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any, Final, Protocol

from sqlalchemy import exc as sa_exc

from torshmon.aggregator.ingest import IngestStore, Stored, StoreSummary, rebuild
from torshmon.history.db import make_engine
from torshmon.wire import Command, IngestBatch, decode_json

log = logging.getLogger(__name__)

#: Frame header: the payload's length in bytes.
_HEADER: Final = struct.Struct("!I")
#: How long ``aclose`` waits for the child to finish what it was given and exit.
STOP_TIMEOUT_S: Final = 30.0


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


def serve(sock: socket.socket, db_url: str, aggregator_id: str) -> None:
    """The ingest process: store each request from ``sock`` and answer it, in order,
    until the aggregator closes the socket."""
    # Ctrl-C reaches the whole process group; the aggregator decides when this stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from torshmon.aggregator.service import tune_gc_for_daemon

    engine = make_engine(db_url)
    store = IngestStore(engine, aggregator_id=aggregator_id)
    tune_gc_for_daemon()
    try:
        while True:
            header = _read_exact(sock, _HEADER.size)
            if header is None:
                return
            (size,) = _HEADER.unpack(header)
            payload = _read_exact(sock, size)
            if payload is None:
                raise EOFError("the aggregator closed the ingest socket mid-frame")
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
        self._process: multiprocessing.process.BaseProcess | None = None
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
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        ours, theirs = socket.socketpair()
        try:
            process = ctx.Process(
                target=serve,
                args=(theirs, self._db_url, self._aggregator_id),
                name="torshmon-ingest",
                daemon=True,
            )
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, process.start)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        _, channel = await asyncio.get_running_loop().create_unix_connection(_Channel, sock=ours)
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
        await asyncio.get_running_loop().run_in_executor(None, process.join, 5.0)
        if process.exitcode is None:
            process.kill()
            await asyncio.get_running_loop().run_in_executor(None, process.join, 5.0)
        if not self._closed:
            log.error(
                "ingest process %s ended (exit code %s); starting a new one",
                process.pid,
                process.exitcode,
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
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, process.join, STOP_TIMEOUT_S)
        if process.exitcode is None:
            log.error(
                "ingest process %s did not stop in %.0f s; killed", process.pid, STOP_TIMEOUT_S
            )
            process.kill()
            with contextlib.suppress(Exception):
                await loop.run_in_executor(None, process.join, 5.0)
