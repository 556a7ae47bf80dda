"""A minimal probe-facing server: validates frames, records them, acknowledges batches.

It speaks the real wire protocol (``torshmon.wire``) and is what the full agent
builds on; on its own it appends every accepted message to a JSON-lines file
and/or hands it to a callback. Batches are de-duplicated by session and
sequence number, so a probe resending after a reconnect stores nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO

from torshmon.wire import (
    FRAME_HEADER,
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


class ProbeReceiver:
    """Unix-socket server for any number of probes of any number of jobs.

    ``store(message, payload)`` (awaited; ``payload`` is the validated JSON the
    probe sent) makes a new message durable before the probe gets its ack;
    ``on_message`` sees every new message; ``commands_for`` names the commands
    to hand to a probe with its next ack. ``async with`` or start()/aclose().
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        out_path: str | os.PathLike[str] | None = None,
        on_message: Callable[[ProbeMessage], None] | None = None,
        store: Callable[[ProbeMessage, bytes], Awaitable[None]] | None = None,
        commands_for: Callable[[Hello], list[Command]] | None = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self._out_path = Path(out_path) if out_path is not None else None
        self._on_message = on_message
        self._store = store
        self._commands_for = commands_for
        self._hellos: dict[asyncio.Task[None], Hello] = {}
        self._out: IO[bytes] | None = None
        self._server: asyncio.base_events.Server | None = None
        self._last_seq: dict[str, int] = {}
        self._last_reject_log = 0.0
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self.frames_accepted = 0
        self.frames_rejected = 0
        self.duplicates = 0

    @property
    def probes(self) -> list[Hello]:
        """The probes connected now (their hello messages)."""
        return list(self._hellos.values())

    async def start(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        if self._out_path is not None:
            self._out = self._out_path.open("ab")
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path))

    async def aclose(self) -> None:
        """Stop serving; safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            # Closing the transports ends each handler's read; cancelling the
            # handler tasks instead makes asyncio log spurious CancelledErrors.
            for writer in list(self._connections.values()):
                writer.close()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        out, self._out = self._out, None
        if out is not None:
            out.close()

    async def __aenter__(self) -> ProbeReceiver:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections[task] = writer
        try:
            while True:
                header = await reader.readexactly(FRAME_HEADER.size)
                try:
                    length = frame_length(header)
                except WireError as exc:
                    # The stream cannot be re-synchronised after a bad length: drop it.
                    self._reject(exc)
                    return
                payload = await reader.readexactly(length)
                try:
                    message = decode_probe_message(payload)
                except WireError as exc:
                    self._reject(exc)
                    continue
                if isinstance(message, Hello) and task is not None:
                    self._hellos[task] = message
                if self._accept(message, payload) and self._store is not None:
                    try:
                        await self._store(message, payload)
                    except Exception:
                        # Not acknowledged: the probe keeps the batch and resends it.
                        log.exception("could not store a probe message; dropping the connection")
                        return
                if isinstance(message, Batch):
                    await self._ack(writer, message, self._hellos.get(task) if task else None)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if task is not None:
                self._connections.pop(task, None)
                self._hellos.pop(task, None)
            writer.close()

    async def _ack(self, writer: asyncio.StreamWriter, batch: Batch, hello: Hello | None) -> None:
        commands = []
        if hello is not None and self._commands_for is not None:
            commands = self._commands_for(hello)
        writer.write(encode_frame(Ack(v=SCHEMA_VERSION, seq=batch.seq, commands=commands)))
        await writer.drain()

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
            self._on_message(message)
        return True

    def _reject(self, exc: Exception) -> None:
        self.frames_rejected += 1
        now = time.monotonic()
        if now - self._last_reject_log >= _REJECT_LOG_INTERVAL_S:
            self._last_reject_log = now
            log.warning("rejected a probe frame (%d so far): %s", self.frames_rejected, exc)


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
