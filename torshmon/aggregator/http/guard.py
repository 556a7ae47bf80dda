"""What the aggregator's HTTP server lets in: known Host names, its own origin, JSON bodies.

A web page the operator opens can send requests to the aggregator: a "simple"
cross-site POST (``text/plain``, no preflight) changes state without reading the
answer, and DNS rebinding (a foreign name that resolves to the aggregator's address)
reads the answers too. Browsers cannot hide where such a request comes from: they
send ``Origin`` on every POST, ``Sec-Fetch-Site`` on every request, the page's own
name as ``Host``, and they cannot send ``application/json`` cross-site without a
preflight this server never grants. These checks stop web pages, not local users
or anyone who can reach the port: that is what the bearer token is for.

Bodies are read here too, not by aiohttp: a broken or unknown content coding is a 4xx
naming the problem, a client that hangs up mid-body a 400 nobody reads (the ingest logs
it as one rate-limited line), and a client's malformed HTTP a one-line warning, not an
error with a traceback.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import zlib
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from torshmon.aggregator.http.connections import CONNECTIONS, ClientDisconnected
from torshmon.aggregator.settings import HOST_NAME, AggregatorSettings
from torshmon.ratelog import LogLimiter

log = logging.getLogger(__name__)

#: Methods that change nothing; every other method must send a JSON body.
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
#: Paths that take a form a browser posts (the pages' sign-in), not only JSON.
FORM_PATHS: Final = frozenset({"/login"})
_FORM_TYPE: Final = "application/x-www-form-urlencoded"
_LOOPBACK_NAMES: Final = frozenset({"localhost", "127.0.0.1", "[::1]"})
_HOST_HEADER: Final = re.compile(rf"(?P<name>{HOST_NAME.pattern})(?::[0-9]*)?")
_GZIP_WBITS: Final = 16 + zlib.MAX_WBITS  # a gzip header and trailer, not zlib's
#: One line per 10 s for all rejections: a broken agent must not flood the logs.
_rejection_log: Final = LogLimiter(10.0)


def log_rejection(request: web.Request, reason: str) -> None:
    """Log a rejected request at most once per 10 s (a broken agent must not flood logs)."""
    _warn_rejected(f"{request.path} from {request.remote}", reason)


def _warn_rejected(what: str, reason: str) -> None:
    if _rejection_log.allow():
        log.warning("rejected %s: %s", what, reason)


class ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log (``AppRunner(logger=...)``) in which a client's malformed
    HTTP (no Host, broken chunked framing, a bad header) is a rejection like the
    others, one line, and not an error with a traceback: aiohttp answered it with a 400."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"))

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, (HttpProcessingError, web.RequestPayloadError)):
            reason = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
            _warn_rejected("a malformed HTTP request", " ".join(str(reason).split()))
            return
        super().exception(msg, *args, **kwargs)


#: The cookie a signed-in browser sends (the aggregator's pages set it once the token
#: was given in their sign-in form); its value is ``session_cookie(token)``.
SESSION_COOKIE: Final = "torshmon_session"


def session_cookie(token: str) -> str:
    """The session cookie's value for ``token``: an HMAC, not the token."""
    return hmac.new(token.encode(), b"torshmon page session v1", hashlib.sha256).hexdigest()


class RequestGuard:
    """Refuses requests a web page could have made: a Host that is not one of the
    aggregator's names (421), another origin (403), a body that is not JSON (415).

    ``check`` is pure (headers in, an ``HTTPException`` out); ``middleware`` applies it
    to every request before its handler.
    """

    def __init__(self, settings: AggregatorSettings) -> None:
        self._token = settings.token
        external = urlsplit(settings.external_url)
        names = {*_LOOPBACK_NAMES, *settings.allowed_hosts, _bracketed(settings.host)}
        if external.hostname:
            names.add(_bracketed(external.hostname))
        self._host_names = frozenset(n.lower() for n in names)
        self._external_origin = _origin_key(settings.external_url)

    def authorized(self, headers: Mapping[str, str]) -> bool:
        """Whether ``headers`` carry the bearer token (always, when none is configured)."""
        if self._token is None:
            return True
        given = headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode())

    def signed_in(self, headers: Mapping[str, str], cookies: Mapping[str, str]) -> bool:
        """Whether a browser's request may read: the bearer token, or the session cookie
        the sign-in page set (``SESSION_COOKIE``). Reads only: every change to a job
        still takes the bearer token."""
        if self.authorized(headers):
            return True
        cookie = cookies.get(SESSION_COOKIE, "")
        return self._token is not None and hmac.compare_digest(
            cookie.encode(), session_cookie(self._token).encode()
        )

    def check(self, method: str, headers: Mapping[str, str], path: str = "") -> None:
        """Raise the HTTP error that refuses a request with ``method`` and ``headers``
        (to ``path``); return if it may go on to its handler."""
        host = headers.get("Host")
        if host is not None:
            self._check_host(host, headers)
        self._check_origin(method, host, headers)
        if method not in _SAFE_METHODS:
            given = headers.get("Content-Type", "")
            allowed = (
                ("application/json", _FORM_TYPE) if path in FORM_PATHS else ("application/json",)
            )
            if given.partition(";")[0].strip().lower() not in allowed:
                raise web.HTTPUnsupportedMediaType(
                    text=f"{method} needs Content-Type: application/json, got {given or 'none'!r}"
                )

    def _check_host(self, host: str, headers: Mapping[str, str]) -> None:
        name = _host_name(host)
        if name is None:
            raise web.HTTPBadRequest(text=f"malformed Host header {host!r}")
        # An IP literal cannot be rebound, and a page that rebinds a name does not
        # know the token: agents reach a 0.0.0.0 aggregator by any name with theirs.
        if name in self._host_names or _is_ip(name) or (self._token and self.authorized(headers)):
            return
        raise web.HTTPMisdirectedRequest(
            text=f"Host {name!r} is not a name of this aggregator; allow it with --allowed-host "
            f"{name} (TORSHMON_ALLOWED_HOSTS, allowed_hosts in the config file)"
        )

    def _check_origin(self, method: str, host: str | None, headers: Mapping[str, str]) -> None:
        site = headers.get("Sec-Fetch-Site", "").lower()
        navigation = method in ("GET", "HEAD") and headers.get("Sec-Fetch-Mode") == "navigate"
        # Another port of the same host is "same-site": refused as well. A followed link
        # is allowed: its answer goes to the user, not to the page that linked it.
        if site in ("cross-site", "same-site") and not navigation:
            raise web.HTTPForbidden(
                text=f"cross-origin request refused (Sec-Fetch-Site: {site}); "
                "the API serves its own origin and non-browser clients"
            )
        origin = headers.get("Origin")
        if origin is None:
            return
        key = _origin_key(origin)
        own = _origin_key(f"http://{host}") if host is not None else None
        if key is None or key not in (own, self._external_origin):
            raise web.HTTPForbidden(
                text=f"cross-origin request refused (Origin: {origin!r}); "
                "the API serves its own origin and non-browser clients"
            )

    def middleware(self) -> Middleware:
        """An aiohttp middleware that runs ``check`` before every handler."""

        @web.middleware
        async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            try:
                self.check(request.method, request.headers, request.path)
            except web.HTTPException as exc:
                log_rejection(request, exc.text or exc.reason)
                raise
            return await handler(request)

        return guard


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The body of ``request``, gunzipped if it says ``Content-Encoding: gzip``.

    Raises 413 for a body, or a gzip stream that inflates, over ``max_bytes``; 415 for
    any other content coding; 400 for a broken gzip stream (corrupt, truncated, or
    followed by other bytes); 408 for a body slower than the application's
    ``Connections`` allow; ClientDisconnected (a 400 nobody reads) when the client
    hangs up before its body is in.
    """
    connections = request.app.get(CONNECTIONS)
    try:
        body = await (request.read() if connections is None else connections.read(request))
    except web.RequestPayloadError as exc:
        raise web.HTTPBadRequest(text=f"the body could not be read: {exc}") from None
    except ConnectionError:  # without Connections, which says so itself
        raise ClientDisconnected(text="the client hung up before its body was in") from None
    coding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if coding == "identity" or not body:
        return body
    if coding != "gzip":
        raise web.HTTPUnsupportedMediaType(
            text=f"Content-Encoding {coding!r} is not supported; send gzip or none"
        )
    return gunzip(body, max_bytes)


def gunzip(data: bytes, max_bytes: int) -> bytes:
    """One gzip stream inflated, at most ``max_bytes`` of it (a gzip bomb stops there).

    Raises 413 past ``max_bytes``, 400 for anything but exactly one gzip stream.
    """
    inflater = zlib.decompressobj(_GZIP_WBITS)
    try:
        out = inflater.decompress(data, max_bytes + 1)
    except zlib.error as exc:
        raise web.HTTPBadRequest(text=f"the body is not valid gzip: {exc}") from None
    if len(out) > max_bytes:
        raise web.HTTPRequestEntityTooLarge(
            max_bytes, len(out), text=f"the gzip body inflates to over {max_bytes} bytes"
        )
    if not inflater.eof:
        raise web.HTTPBadRequest(text="the gzip body is truncated")
    if inflater.unused_data:
        raise web.HTTPBadRequest(
            text=f"{len(inflater.unused_data)} bytes follow the end of the gzip body"
        )
    return out


def _host_name(host: str) -> str | None:
    """The name in a Host header value (``name[:port]``), lower case; None if malformed."""
    match = _HOST_HEADER.fullmatch(host.strip())
    return match["name"].lower() if match else None


def _bracketed(host: str) -> str:
    """``host`` as a Host header writes it: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def _origin_key(origin: str) -> tuple[str, int | None] | None:
    """(host, port) of an origin such as ``http://host:port``; None for ``null`` or junk.

    Browsers write origins, like Host headers, without a default port: the scheme
    is left out so that a TLS proxy in front (https origin, http Host) still matches.
    """
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return _bracketed(parts.hostname.lower()), port
