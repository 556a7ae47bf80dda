"""A minimal probe-facing server: validates frames, records them, acknowledges batches.

It speaks the real wire protocol (``torshmon.wire``) and is what the full agent
builds on; on its own it appends every accepted message to a JSON-lines file
and/or hands it to a callback. Batches are de-duplicated by session and
sequence number, so a probe resending after a reconnect stores nothing twice.

Reading is batched when ``read_window_s`` is set: the first frame to arrive
opens a window, and when it closes every connection is read in one pass. Probes
of many ranks send at independent times, so reacting to each frame woke the
agent about as often as frames came (64 ranks: 128 times a second), and waking
an idle process costs more than the frame itself; a window of the agent's group
commit (0.1 s) wakes it twice per window instead, for the same ack latency. While a
probe's last batch was urgent (its fast lane is open: a step a detector is waiting
for) the window is ``urgent_window_s`` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import selectors
import socket
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO

from torshmon.ratelog import LogLimiter
from torshmon.wire import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    SCHEMA_VERSION,
    Ack,
    Batch,
    Command,
    Hello,
    ProbeMessage,
    WireError,
    decode_probe_message,
    encode_frame,
    frame_length,
)

log = logging.getLogger(__name__)

_REJECT_LOG_INTERVAL_S = 10.0
_RECV_BYTES = 256 * 1024
#: A connection stops being read while it holds this much unhandled data (it only
#: happens to a peer that sends without waiting for its acks).
_MAX_BUFFERED_BYTES = MAX_FRAME_BYTES + FRAME_HEADER.size + _RECV_BYTES
_LISTEN_BACKLOG = 128


class ProbeReceiver:
    """Unix-socket server for any number of probes of any number of jobs.

    ``store(message, payload)`` (``payload`` is the validated JSON the probe sent)
    returns an awaitable that completes once a new message is durable; the probe
    gets its ack only then. A future (one per group commit, say) is waited on
    without a task; a coroutine gets a task. ``on_message`` sees every new
    message; ``commands_for`` names the commands to hand to a probe with its next
    ack. ``read_window_s`` > 0 reads all connections together once per window
    (see the module docstring); 0 handles each frame as it arrives. The socket
    file gets ``socket_mode`` (0600: this user only) and, when given, the group
    ``socket_gid``, whatever the umask.
    ``async with`` or start()/aclose(); everything runs on the loop of start().
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        out_path: str | os.PathLike[str] | None = None,
        on_message: Callable[[ProbeMessage], None] | None = None,
        store: Callable[[ProbeMessage, bytes], Awaitable[None]] | None = None,
        commands_for: Callable[[Hello], list[Command]] | None = None,
        read_window_s: float = 0.0,
        urgent_window_s: float | None = None,
        socket_mode: int = 0o600,
        socket_gid: int | None = None,
    ) -> None:
        if not read_window_s >= 0.0:
            raise ValueError(f"read_window_s must be >= 0, got {read_window_s}")
        if urgent_window_s is not None and not urgent_window_s >= 0.0:
            raise ValueError(f"urgent_window_s must be >= 0, got {urgent_window_s}")
        if socket_mode & ~0o660:
            raise ValueError(
                f"socket_mode may grant read/write to owner and group only, got {socket_mode:04o}"
            )
        self.socket_path = Path(socket_path)
        self.socket_mode = socket_mode
        self.socket_gid = socket_gid
        self.read_window_s = read_window_s
        self.urgent_window_s = read_window_s if urgent_window_s is None else urgent_window_s
        self._out_path = Path(out_path) if out_path is not None else None
        self._on_message = on_message
        self._store = store
        self._commands_for = commands_for
        self._out: IO[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        # The connections' own selector, watched by the loop through its file
        # descriptor: one readiness event for all of them, and none while paused.
        self._selector: selectors.BaseSelector | None = None
        self._selector_fd = -1
        self._window: asyncio.TimerHandle | None = None
        self._last_seq: dict[str, int] = {}
        self._reject_log = LogLimiter(_REJECT_LOG_INTERVAL_S)
        # A dict, not a set: ``probes`` lists them in the order they connected.
        self._connections: dict[_ProbeConnection, None] = {}
        self._waiting: dict[asyncio.Future[None], list[tuple[_ProbeConnection, int | None]]] = {}
        # Batches whose store has started but not finished, by (session, seq): a resend
        # of one is acknowledged with that store, and a failed store forgets its seqs.
        self._in_flight: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._on_message_log = LogLimiter()  # once
        self.frames_accepted = 0
        self.frames_rejected = 0
        self.duplicates = 0

    @property
    def probes(self) -> list[Hello]:
        """The probes connected now (their hello messages)."""
        return [c.hello for c in self._connections if c.hello is not None]

    async def start(self) -> None:
        if self._listener is not None:
            raise RuntimeError("ProbeReceiver.start() called twice")
        self.socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound = False
        try:
            # Linux gives the socket file this mode at bind (less the umask), so it is
            # never open wider, not even until the chmod below; elsewhere it may fail.
            with contextlib.suppress(OSError):
                os.fchmod(listener.fileno(), self.socket_mode)
            listener.bind(str(self.socket_path))
            bound = True
            if self.socket_gid is not None:
                os.chown(self.socket_path, -1, self.socket_gid)
            os.chmod(self.socket_path, self.socket_mode)
            listener.listen(_LISTEN_BACKLOG)
            listener.setblocking(False)
        except OSError:
            listener.close()
            if bound:  # a group we may not give it, say: leave no socket behind
                with contextlib.suppress(OSError):
                    self.socket_path.unlink()
            raise
        if self._out_path is not None:
            self._out = self._out_path.open("ab")
        self._loop = asyncio.get_running_loop()
        self._listener = listener
        self._selector, self._selector_fd = _new_selector()
        self._loop.add_reader(listener.fileno(), self._accept_ready)
        self._loop.add_reader(self._selector_fd, self._on_ready)

    async def aclose(self) -> None:
        """Stop serving; safe to call twice.

        Messages handed to ``store`` before the close are waited for, so what the
        probes sent is stored (their acks may not reach them: they resend).
        """
        listener, self._listener = self._listener, None
        selector, self._selector = self._selector, None
        loop = self._loop
        if listener is not None and selector is not None and loop is not None:
            loop.remove_reader(listener.fileno())
            loop.remove_reader(self._selector_fd)
            window, self._window = self._window, None
            if window is not None:
                window.cancel()
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            connections = list(self._connections)
            for connection in connections:
                connection.close()
            selector.close()
            pending = {c.storing for c in connections if c.storing is not None}
            if pending:
                # wait(), not gather(): a store future may be shared (a group commit),
                # and a cancelled gather() would cancel it for everyone.
                await asyncio.wait(pending)
        out, self._out = self._out, None
        if out is not None:
            out.close()

    async def __aenter__(self) -> ProbeReceiver:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- the loop's callbacks ---------------------------------------------------------
    def _accept_ready(self) -> None:
        listener, selector = self._listener, self._selector
        if listener is None or selector is None:
            return
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Out of file descriptors, say: the probe retries, so do not spin.
                log.warning("cannot accept a probe connection: %s", exc)
                return
            sock.setblocking(False)
            connection = _ProbeConnection(self, sock)
            self._connections[connection] = None
            connection.watch_reads()

    def _on_ready(self) -> None:
        """Some connection is readable (or writable again)."""
        loop, selector = self._loop, self._selector
        if loop is None or selector is None:
            return
        if self.read_window_s <= 0.0:
            self._read_all()
            return
        # Stop watching until the window closes: the data waits in the sockets. While
        # a probe sends urgent batches the window is short: a step a detector waits
        # for should not wait for the group commit too.
        loop.remove_reader(self._selector_fd)
        window = self.read_window_s
        if any(c.urgent for c in self._connections):
            window = min(window, self.urgent_window_s)
        self._window = loop.call_later(window, self._close_window)

    def _close_window(self) -> None:
        self._window = None
        try:
            self._read_all()
        finally:
            # Whatever happened, go on watching: a lost reader would stop every probe.
            if self._loop is not None and self._selector is not None:
                self._loop.add_reader(self._selector_fd, self._on_ready)

    def _read_all(self) -> None:
        selector = self._selector
        if selector is None:
            return
        for key, events in selector.select(0):
            connection: _ProbeConnection = key.data
            try:
                if events & selectors.EVENT_WRITE:
                    connection.send_pending()
                if events & selectors.EVENT_READ:
                    connection.read()
            except Exception:
                # A bug must cost one connection (its probe resends), not all of them.
                log.exception("serving a probe failed; dropping its connection")
                connection.close()

    def _watch(self, connection: _ProbeConnection, sock: socket.socket, old: int, new: int) -> None:
        """Change what the selector watches a connection's socket for (0: nothing)."""
        selector = self._selector
        if selector is None:
            return
        if old and new:
            selector.modify(sock, new, connection)
        elif new:
            selector.register(sock, new, connection)
        elif old:
            selector.unregister(sock)

    def _forget(self, connection: _ProbeConnection, sock: socket.socket, events: int) -> None:
        self._connections.pop(connection, None)
        self._watch(connection, sock, events, 0)

    def _wait_for_store(self, connection: _ProbeConnection, seq: int | None) -> None:
        """Ack ``seq`` on ``connection`` once its store is done.

        Connections waiting on one future (a group commit) share one done
        callback, which acks them all in one pass.
        """
        future = connection.storing
        if future is None:
            return
        waiting = self._waiting.get(future)
        if waiting is None:
            waiting = self._waiting[future] = []
            future.add_done_callback(self._stored)
        waiting.append((connection, seq))

    def _stored(self, future: asyncio.Future[None]) -> None:
        done = [key for key, pending in self._in_flight.items() if pending is future]
        failed = future.cancelled() or future.exception() is not None
        for session, batch_seq in done:
            del self._in_flight[session, batch_seq]
            if failed and self._last_seq.get(session, 0) >= batch_seq:
                # Not stored: the probe's resend of this batch must be taken again.
                self._last_seq[session] = batch_seq - 1
        for connection, seq in self._waiting.pop(future, ()):
            try:
                connection.stored(seq, future)
            except Exception:
                log.exception("acknowledging a probe failed; dropping its connection")
                connection.close()

    # -- messages ---------------------------------------------------------------------
    def _ack_frame(self, seq: int, hello: Hello | None) -> bytes:
        commands: list[Command] = []
        if hello is not None and self._commands_for is not None:
            commands = self._commands_for(hello)
        return encode_frame(Ack(v=SCHEMA_VERSION, seq=seq, commands=commands))

    def _accept(self, message: ProbeMessage, payload: bytes) -> bool:
        """Count and record a message; False for a batch already received."""
        if isinstance(message, Batch):
            if message.seq <= self._last_seq.get(message.session, 0):
                self.duplicates += 1
                return False
            self._last_seq[message.session] = message.seq
        self.frames_accepted += 1
        if self._out is not None:
            self._out.write(payload + b"\n")
            self._out.flush()
        if self._on_message is not None:
            try:
                self._on_message(message)
            except Exception:
                # Watching (metrics, progress) must not cost the data: it is still stored.
                if self._on_message_log.allow():
                    log.exception("on_message failed (logged once); the message is kept")
        return True

    def _reject(self, exc: Exception) -> None:
        self.frames_rejected += 1
        if self._reject_log.allow():
            log.warning("rejected a probe frame (%d so far): %s", self.frames_rejected, exc)


class _ProbeConnection:
    """One probe's non-blocking socket: frames are cut from a byte buffer as data arrives.

    Frames are handled strictly in order; while one waits for ``store`` the rest
    wait in the buffer. An ack the socket does not take at once waits in
    ``_unsent``, and no further frame is handled until it is gone.
    """

    __slots__ = (
        "_buffer",
        "_eof",
        "_events",
        "_gone",
        "_server",
        "_unsent",
        "hello",
        "sock",
        "storing",
        "urgent",
    )

    def __init__(self, server: ProbeReceiver, sock: socket.socket) -> None:
        self._server = server
        self.sock: socket.socket | None = sock
        self._buffer = bytearray()
        self._unsent = b""
        self._eof = False  # nothing more to read: close once the buffer is handled
        self._gone = False  # the peer cannot take acks any more: drop them
        self._events = 0
        self.hello: Hello | None = None
        #: The store this connection waits for before acking (and reading on).
        self.storing: asyncio.Future[None] | None = None
        #: Its latest batch was urgent (the probe's fast lane is open): the next
        #: read window is ``urgent_window_s``.
        self.urgent = False

    def close(self) -> None:
        """Close the socket; safe to call twice. A pending store still completes."""
        sock, self.sock = self.sock, None
        if sock is None:
            return
        self._server._forget(self, sock, self._events)
        self._events = 0
        self._buffer.clear()
        sock.close()

    def read(self) -> None:
        """Take what the socket holds, then handle every whole frame."""
        sock = self.sock
        buffer = self._buffer
        while sock is not None and len(buffer) < _MAX_BUFFERED_BYTES:
            try:
                chunk = sock.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                # What came before the end is still handled (stored, though not acked:
                # a probe that reconnects resends it and it is de-duplicated).
                self._eof = True
                break
            buffer += chunk
            if len(chunk) < _RECV_BYTES:
                break  # the socket is (most likely) empty: spare the EAGAIN round trip
        self._process()

    def watch_reads(self) -> None:
        """Start being read (a new connection)."""
        self._update_watch()

    def send_pending(self) -> None:
        """The socket takes data again: send the rest of the acks, then go on reading."""
        self._write()
        self._process()

    def _process(self) -> None:
        """Handle whole frames until one has to wait for its store or its ack."""
        buffer = self._buffer
        header_size = FRAME_HEADER.size
        while self.sock is not None and self.storing is None and not self._unsent:
            if len(buffer) < header_size:
                break
            try:
                length = frame_length(bytes(buffer[:header_size]))
            except WireError as exc:
                # The stream cannot be re-synchronised after a bad length: drop it.
                self._server._reject(exc)
                self.close()
                return
            end = header_size + length
            if len(buffer) < end:
                break
            with memoryview(buffer) as view:
                payload = bytes(view[header_size:end])
            del buffer[:end]
            self._handle(payload)
        self._update_watch()

    def _update_watch(self) -> None:
        sock = self.sock
        if sock is None:
            return
        if self._eof and self.storing is None and not self._unsent:
            self.close()
            return
        events = selectors.EVENT_WRITE if self._unsent else 0
        blocked = self.storing is not None or self._unsent
        if not self._eof and not (blocked and len(self._buffer) >= _MAX_BUFFERED_BYTES):
            events |= selectors.EVENT_READ
        if events != self._events:
            self._server._watch(self, sock, self._events, events)
            self._events = events

    def _handle(self, payload: bytes) -> None:
        server = self._server
        try:
            message = decode_probe_message(payload)
        except WireError as exc:
            server._reject(exc)
            return
        if isinstance(message, Hello):
            self.hello = message
        else:
            self.urgent = message.urgent
            if (pending := server._in_flight.get((message.session, message.seq))) is not None:
                # A resend (after a reconnect) of a batch still being stored: it is
                # acknowledged when that store is durable, not before.
                server.duplicates += 1
                self.storing = pending
                server._wait_for_store(self, message.seq)
                return
        if server._accept(message, payload) and server._store is not None:
            try:
                self.storing = asyncio.ensure_future(server._store(message, payload))
            except Exception as exc:
                if isinstance(message, Batch):
                    server._last_seq[message.session] = message.seq - 1
                self._store_failed(exc)
                return
            if isinstance(message, Batch):
                server._in_flight[message.session, message.seq] = self.storing
            # Only the seq waits with it: the decoded batch can be freed at once
            # instead of living (and being traced by the GC) until the commit.
            server._wait_for_store(self, message.seq if isinstance(message, Batch) else None)
        elif isinstance(message, Batch):
            self._send(server._ack_frame(message.seq, self.hello))

    def stored(self, seq: int | None, future: asyncio.Future[None]) -> None:
        """Its store is done: acknowledge batch ``seq`` (None: a hello) and read on."""
        self.storing = None
        exc = asyncio.CancelledError() if future.cancelled() else future.exception()
        if exc is not None:
            self._store_failed(exc)
            return
        if seq is not None and self.sock is not None:
            self._send(self._server._ack_frame(seq, self.hello))
        self._process()

    def _store_failed(self, exc: BaseException) -> None:
        # Not acknowledged: the probe keeps the batch and resends it.
        log.warning("could not store a probe message (%r); dropping the connection", exc)
        self.storing = None
        self.close()

    def _send(self, frame: bytes) -> None:
        if self._gone:
            return
        self._unsent += frame
        if len(self._unsent) == len(frame):
            self._write()

    def _write(self) -> None:
        sock = self.sock
        if sock is None or not self._unsent:
            return
        try:
            sent = sock.send(self._unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            # The probe went away: no more acks, but what it sent is still stored.
            self._unsent = b""
            self._eof = self._gone = True
            return
        self._unsent = self._unsent[sent:]


def _new_selector() -> tuple[selectors.BaseSelector, int]:
    """A selector with a descriptor of its own (epoll, kqueue) and that descriptor."""
    selector = selectors.DefaultSelector()
    fileno: Callable[[], int] | None = getattr(selector, "fileno", None)
    if fileno is None:
        selector.close()
        raise RuntimeError(f"the probe receiver needs epoll or kqueue, not {selector!r}")
    return selector, fileno()


def read_messages(path: str | os.PathLike[str]) -> list[ProbeMessage]:
    """Every message of a receiver's JSON-lines file, validated."""
    with open(path, "rb") as f:
        return [decode_probe_message(line) for line in f if line.strip()]


__all__ = ["ProbeReceiver", "read_messages"]


class ThreadedReceiver:
    """A ProbeReceiver on its own event loop in a daemon thread, for synchronous code.

    For tests, benchmarks and tools that run ranks from a plain thread.
    ``on_message`` runs on the receiver's thread. ``with`` or start()/stop().
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        on_message: Callable[[ProbeMessage], None] | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="torshmon-receiver", daemon=True
        )
        self.receiver = ProbeReceiver(socket_path, on_message=on_message)

    @property
    def socket_path(self) -> Path:
        return self.receiver.socket_path

    def start(self) -> ThreadedReceiver:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.receiver.start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        """Stop serving and end the thread; safe to call twice."""
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.receiver.aclose(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> ThreadedReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
