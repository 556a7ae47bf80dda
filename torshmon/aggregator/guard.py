"""What the aggregator's HTTP server lets in: request bodies it can read.

Bodies are read here, not by aiohttp: a broken or unknown content coding is a 4xx
naming the problem, and a client's malformed HTTP a one-line warning, not an error
with a traceback.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any, Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

log = logging.getLogger(__name__)

_GZIP_WBITS: Final = 16 + zlib.MAX_WBITS  # a gzip header and trailer, not zlib's
_last_rejection_log = 0.0


def log_rejection(request: web.Request, reason: str) -> None:
    """Log a rejected request at most once per 10 s (a broken agent must not flood logs)."""
    _warn_rejected(f"{request.path} from {request.remote}", reason)


def _warn_rejected(what: str, reason: str) -> None:
    global _last_rejection_log
    now = time.monotonic()
    if now - _last_rejection_log >= 10.0:
        _last_rejection_log = now
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


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The body of ``request``, gunzipped if it says ``Content-Encoding: gzip``.

    Raises 413 for a body, or a gzip stream that inflates, over ``max_bytes``; 415 for
    any other content coding; 400 for a broken gzip stream (corrupt, truncated, or
    followed by other bytes).
    """
    try:
        body = await request.read()
    except web.RequestPayloadError as exc:
        raise web.HTTPBadRequest(text=f"the body could not be read: {exc}") from None
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
