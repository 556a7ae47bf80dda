"""The API's alert lifecycle routes: silences and acknowledgements.

- ``GET /api/v1/silences`` lists silences, newest first (``?state=active|pending|expired``
  filters; each row carries its ``state`` at the time of the request).
- ``POST /api/v1/silences`` creates one (body: ``silences.parse_request``): 201 with the
  silence; a bad body is a 400 naming what is wrong.
- ``DELETE /api/v1/silences/{id}`` expires one now: 200 with it, 404 if there is none.
- ``POST /api/v1/alerts/{id}/ack`` acknowledges a pending or firing alert (body:
  ``by`` (required), ``comment``): 200 with the alert row, 404 if there is none, 409
  once it has resolved.

Same bearer token as the rest of the API; the request guard (Host, Origin, content
type) runs before them as before every route.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Protocol

from aiohttp import web

from torshmon.aggregator.core.silences import (
    MAX_ACTIVE,
    Silence,
    SilenceBook,
    SilenceRequest,
    parse_request,
)
from torshmon.aggregator.http.api import error, json_object
from torshmon.aggregator.http.guard import RequestGuard
from torshmon.history.store import Row

__all__ = ["SilenceStore", "add_alerting_routes"]

_STATES: Final = ("active", "pending", "expired")
_MAX_LISTED: Final = 1000


class SilenceStore(Protocol):
    """Where silences and acknowledgements are kept (``HistoryStore``)."""

    async def add_silence(self, request: SilenceRequest, now_unix_s: float) -> Silence: ...

    async def expire_silence(self, silence_id: int, now_unix_s: float) -> Row | None: ...

    async def acknowledge(
        self, alert_id: int, who: str, comment: str, now_unix_s: float
    ) -> tuple[str, Row | None]: ...

    async def rows(self, listing: Any, filters: Any, limit: int) -> list[Row]: ...


def add_alerting_routes(
    app: web.Application,
    *,
    guard: RequestGuard,
    store: SilenceStore,
    book: SilenceBook,
    clock: Callable[[], float],
    max_body_bytes: int,
    changed: Callable[[], None],
) -> None:
    """Add the routes above; ``changed`` is called after a silence is added or expired
    (the service then re-evaluates which alerts to notify)."""
    h = _Handlers(guard, store, book, clock, max_body_bytes, changed)
    r = app.router
    r.add_get("/api/v1/silences", h.list_silences)
    r.add_post("/api/v1/silences", h.add_silence)
    r.add_delete("/api/v1/silences/{id}", h.expire_silence)
    r.add_post("/api/v1/alerts/{id}/ack", h.acknowledge)


def silence_state(row: Row, now_unix_s: float) -> str:
    """``pending`` (starts later), ``active`` or ``expired``."""
    if row["ends_at_unix_s"] <= now_unix_s:
        return "expired"
    return "pending" if row["starts_at_unix_s"] > now_unix_s else "active"


class _Handlers:
    def __init__(
        self,
        guard: RequestGuard,
        store: SilenceStore,
        book: SilenceBook,
        clock: Callable[[], float],
        max_body_bytes: int,
        changed: Callable[[], None],
    ) -> None:
        self._guard = guard
        self._store = store
        self._book = book
        self._clock = clock
        self._max_body_bytes = max_body_bytes
        self._changed = changed

    def _auth(self, request: web.Request) -> None:
        if not self._guard.authorized(request.headers):
            raise web.HTTPUnauthorized(text="missing or wrong bearer token")

    async def list_silences(self, request: web.Request) -> web.Response:
        self._auth(request)
        unknown = sorted(set(request.query) - {"state", "limit"})
        if unknown:
            return error(400, f"unknown query parameter(s) {', '.join(unknown)}; allowed: state")
        wanted = request.query.get("state")
        if wanted is not None and wanted not in _STATES:
            return error(400, f"state must be one of {', '.join(_STATES)}")
        now = self._clock()
        rows = await self._store.rows("silences", {}, _MAX_LISTED)
        out = []
        for row in rows:
            row["state"] = silence_state(row, now)
            if wanted is None or row["state"] == wanted:
                out.append(row)
        return web.json_response({"silences": out})

    async def add_silence(self, request: web.Request) -> web.Response:
        self._auth(request)
        body = await json_object(request, self._max_body_bytes)
        now = self._clock()
        try:
            parsed = parse_request(body, now)
        except ValueError as exc:
            return error(400, str(exc))
        self._book.prune(now)
        if len(self._book) >= MAX_ACTIVE:
            return error(409, f"{MAX_ACTIVE} silences are already in force; expire some first")
        silence = await self._store.add_silence(parsed, now)
        self._book.add(silence)
        self._changed()
        return web.json_response({"silence": _silence_json(silence, now)}, status=201)

    async def expire_silence(self, request: web.Request) -> web.Response:
        self._auth(request)
        silence_id = _id(request)
        now = self._clock()
        row = await self._store.expire_silence(silence_id, now)
        if row is None:
            return error(404, f"no silence {silence_id}")
        self._book.expire(silence_id)
        self._changed()
        row["state"] = silence_state(row, now)
        return web.json_response({"silence": row})

    async def acknowledge(self, request: web.Request) -> web.Response:
        self._auth(request)
        alert_id = _id(request)
        body = await json_object(request, self._max_body_bytes)
        unknown = sorted(set(body) - {"by", "comment"})
        if unknown:
            return error(400, f"unknown field(s): {', '.join(unknown)}")
        who, comment = body.get("by"), body.get("comment", "")
        if not isinstance(who, str) or not who.strip() or len(who) > 200:
            return error(400, "by: say who acknowledges (a string of 1..200 characters)")
        if not isinstance(comment, str) or len(comment) > 1000:
            return error(400, "comment: a string of at most 1000 characters")
        outcome, row = await self._store.acknowledge(alert_id, who.strip(), comment, self._clock())
        if outcome == "missing":
            return error(404, f"no alert {alert_id}")
        if outcome == "resolved":
            return error(409, f"alert {alert_id} has resolved; there is nothing to acknowledge")
        return web.json_response({"alert": row})


def _id(request: web.Request) -> int:
    text = request.match_info["id"]
    if not text.isdigit() or len(text) > 18:
        raise web.HTTPBadRequest(text=f"id must be a positive integer, got {text[:40]!r}")
    return int(text)


def _silence_json(silence: Silence, now_unix_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": silence.id,
        "matchers": dict(silence.matchers),
        "starts_at_unix_s": silence.starts_at_unix_s,
        "ends_at_unix_s": silence.ends_at_unix_s,
        "created_by": silence.created_by,
        "comment": silence.comment,
    }
    row["state"] = silence_state(row, now_unix_s)
    return row
