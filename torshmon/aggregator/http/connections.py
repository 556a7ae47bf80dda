"""The aggregator's open HTTP connections: how many, and how long a client may take.

aiohttp bounds a kept-alive connection's idle time (``keepalive_timeout``) but not
the time a client takes to send a request: a connection that sends half a request
line and stops is held for as long as the client likes, and nothing bounds how many
there are. ``Connections`` adds what is missing, around aiohttp's own protocol:

- at most ``max_connections`` open; one more is answered 503 and closed at once;
- a request's head must be in within ``header_timeout_s`` of the connection's opening,
  or of the request's first byte on a kept-alive one; else the client gets a 408 (a
  connection that sent nothing is closed without one) and its socket is closed;
- a request's body must be in within ``body_timeout_s`` of its head (``read``); else
  408, and the connection is closed once the answer is written.

Each slow client is counted in ``torshmon_http_client_timeouts_total``. Event-loop
thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CollectorRegistry, Counter, Gauge

from torshmon.catalogue import metrics as catalogue

#: How the server answers a client that breaks a limit before a request of its own
#: exists, written straight to the socket (JSON like every other error).
_RAW_ANSWER: Final = (
    "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
    "Content-Length: {length}\r\nConnection: close\r\n{extra}\r\n{body}"
)


#: Connections the kernel completes before the server accepts them (aiohttp's default).
_BACKLOG: Final = 128


def _raw_answer(status: int, reason: str, message: str, extra: str = "") -> bytes:
    body = json.dumps({"error": message, "status": status})
    text = _RAW_ANSWER.format(
        status=status, reason=reason, length=len(body), extra=extra, body=body
    )
    return text.encode()


class ClientDisconnected(web.HTTPBadRequest):
    """The client hung up before its body was in (nobody reads the answer)."""


class Connections:
    """The open connections of one server and their limits (see the module's text).

    ``site`` serves with them; ``middleware`` must run first (outermost) on every
    request, and bodies are read with ``read``.
    """

    def __init__(
        self,
        *,
        max_connections: int,
        header_timeout_s: float,
        body_timeout_s: float,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self._open: dict[asyncio.BaseTransport | None, _Connection] = {}
        self._accepting = 0  # made by the factory, not connected yet
        spec = catalogue.HTTP_CLIENT_TIMEOUTS_TOTAL
        self._timeouts = Counter(spec.family_name, spec.help, spec.labels, registry=registry)
        spec = catalogue.HTTP_CONNECTIONS_REFUSED_TOTAL
        self._refused = Counter(spec.family_name, spec.help, spec.labels, registry=registry)
        spec = catalogue.HTTP_CONNECTIONS
        gauge = Gauge(spec.name, spec.help, spec.labels, registry=registry)
        gauge.set_function(lambda: len(self._open))

    @property
    def open(self) -> int:
        """Connections open now (those being refused not counted)."""
        return len(self._open)

    def site(self, runner: web.BaseRunner, host: str, port: int) -> web.BaseSite:
        """A TCP site of ``runner`` (set up) whose connections are these."""
        return _Site(runner, host, port, self._protocol)

    def _protocol(self, server: web.Server) -> asyncio.Protocol:
        # Counted from here, not from connection_made: the loop accepts a burst of
        # connections (up to the backlog) before any of them is connected. A plain TCP
        # transport calls connection_made right after its protocol is made.
        if len(self._open) + self._accepting >= self.max_connections:
            self._refused.inc()
            return _Refused(self.max_connections)
        self._accepting += 1
        return _Connection(self, server())

    def middleware(self) -> Middleware:
        """Marks each request's connection busy while its handler runs (no header
        deadline then), and closes a connection ``read`` gave up on once its answer
        is written."""

        @web.middleware
        async def connections(request: web.Request, handler: Handler) -> web.StreamResponse:
            conn = self._open.get(request.transport)
            if conn is None:  # not a connection of ours (a test client)
                return await handler(request)
            conn.request_started()
            try:
                response = await handler(request)
                if conn.close_after_answer:
                    with contextlib.suppress(ConnectionError):  # the client went already
                        await response.prepare(request)
                        await response.write_eof()
                    # Not lingering to read the rest of a body it was too slow to send.
                    request.protocol.force_close()
                return response
            finally:
                conn.request_finished()

        return connections

    @contextlib.contextmanager
    def on_hang_up(self, request: web.Request, callback: Callable[[], object]) -> Iterator[None]:
        """Within the block, ``callback()`` runs (on the event loop) if ``request``'s
        client closes its connection; at once if it is closed already."""
        if request.transport is None:  # closed already
            callback()
        conn = self._open.get(request.transport)
        if conn is None:  # closed, or not a connection of ours (a test client)
            yield
            return
        conn.hang_up_callbacks.append(callback)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                conn.hang_up_callbacks.remove(callback)

    async def read(self, request: web.Request) -> bytes:
        """The body of ``request``, in within ``body_timeout_s``.

        Raises 408 (and the connection closes after the answer) when it takes longer;
        ClientDisconnected when the client hangs up first.
        """
        try:
            return await asyncio.wait_for(request.read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            self._timeouts.labels("body").inc()
            conn = self._open.get(request.transport)
            if conn is not None:
                conn.close_after_answer = True
            raise web.HTTPRequestTimeout(
                text=f"the body did not arrive within {self.body_timeout_s:g} s "
                "(http_body_timeout_s)",
                headers={"Connection": "close"},
            ) from None
        except ConnectionError:
            raise ClientDisconnected(text="the client hung up before its body was in") from None

    def _connected(self, conn: _Connection) -> None:
        self._accepting -= 1
        self._open[conn.transport] = conn

    def _timed_out(self) -> None:
        self._timeouts.labels("headers").inc()

    def _closed(self, conn: _Connection) -> None:
        if self._open.get(conn.transport) is conn:
            del self._open[conn.transport]


#: Where an application keeps its ``Connections`` (``read_body`` reads bodies with it).
CONNECTIONS: Final = web.AppKey("connections", Connections)


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, with a deadline on each request's head.

    The deadline runs from the opening, and on a kept-alive connection from the first
    byte after a request's handler ended, until the next handler starts.
    """

    def __init__(self, owner: Connections, inner: asyncio.Protocol) -> None:
        self._owner = owner
        self._inner = inner
        self.transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._busy = False
        self._received = False  # bytes of the next request came since the deadline was set
        self.close_after_answer = False
        #: Called when the client closes the connection (``Connections.on_hang_up``).
        self.hang_up_callbacks: list[Callable[[], object]] = []

    # -- asyncio.Protocol, passed on ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not isinstance(transport, asyncio.Transport):
            raise TypeError(f"expected a stream transport, got {type(transport)!r}")
        self.transport = transport
        self._owner._connected(self)
        self._set_deadline()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            self._received = True
            if self._deadline is None:
                self._set_deadline()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._clear_deadline()
        self._owner._closed(self)
        self._inner.connection_lost(exc)
        callbacks, self.hang_up_callbacks = self.hang_up_callbacks, []
        for callback in callbacks:
            callback()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # -- requests -------------------------------------------------------------------------
    def request_started(self) -> None:
        self._busy = True
        self._clear_deadline()

    def request_finished(self) -> None:
        self._busy = False
        self._received = False

    def _set_deadline(self) -> None:
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self._owner.header_timeout_s, self._expire)

    def _clear_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        transport = self.transport
        if transport is None or transport.is_closing() or self._busy:
            return
        self._owner._timed_out()
        if self._received:
            seconds = f"{self._owner.header_timeout_s:g}"
            transport.write(
                _raw_answer(
                    408,
                    "Request Timeout",
                    f"the request's head did not arrive within {seconds} s (http_header_timeout_s)",
                )
            )
        transport.close()


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 and closed before it is read."""

    def __init__(self, limit: int) -> None:
        self._limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.Transport):
            message = (
                f"{self._limit} connections are open, the most this aggregator takes "
                "(http_max_connections); retry later"
            )
            transport.write(
                _raw_answer(503, "Service Unavailable", message, extra="Retry-After: 1\r\n")
            )
        transport.close()


class _Site(web.BaseSite):
    """aiohttp's TCP site with the connections made by ``protocol``."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        protocol: Callable[[web.Server], asyncio.Protocol],
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._protocol = protocol

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        if server is None:
            raise RuntimeError("the runner is not set up")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: self._protocol(server), self._host, self._port, backlog=_BACKLOG
        )
