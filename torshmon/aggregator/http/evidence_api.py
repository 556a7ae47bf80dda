"""The evidence routes of the API: captures by job or alert, file downloads, capture now.

``GET /api/v1/evidence`` (``job``, ``alert_id``, ``limit``) and
``GET /api/v1/alerts/{id}/evidence`` list captures with their files, each file with
the ``url`` it downloads from; ``GET /api/v1/evidence/{capture}/{rank}/{name}`` is
the file itself, gzip-compressed as stored (Perfetto and HTA open ``.json.gz``);
``POST /api/v1/jobs/{job}/evidence`` asks for a capture now. Same bearer token and
request guard as the rest of the API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from aiohttp import web

from torshmon.aggregator.core.commands import CommandError
from torshmon.aggregator.evidence import FILE_NAMES, EvidenceKeeper
from torshmon.aggregator.http.api import error, json_object
from torshmon.aggregator.http.guard import RequestGuard
from torshmon.history.store import Listing, Row

_MAX_LIMIT = 1000


class EvidenceRows(Protocol):
    """The history's evidence and alerts (``torshmon.history.store.HistoryStore``)."""

    async def evidence(
        self, *, job: str | None = None, alert_id: int | None = None, limit: int = 100
    ) -> list[Row]: ...

    async def evidence_file(self, capture_id: str, rank: int, name: str) -> Row | None: ...

    async def rows(self, listing: Listing, filters: dict[str, str], limit: int) -> list[Row]: ...


def add_routes(
    app: web.Application,
    *,
    guard: RequestGuard,
    store: EvidenceRows,
    keeper: EvidenceKeeper,
    max_body_bytes: int,
) -> None:
    """Add the evidence routes to the API's application (before it serves)."""
    h = _EvidenceHandlers(guard, store, keeper, max_body_bytes)
    r = app.router
    r.add_get("/api/v1/evidence", h.captures)
    r.add_get("/api/v1/alerts/{id}/evidence", h.alert_captures)
    r.add_get("/api/v1/evidence/{capture}/{rank}/{name}", h.download)
    r.add_post("/api/v1/jobs/{job}/evidence", h.capture)


def capture_json(capture: Row) -> dict[str, Any]:
    """A capture row with its files, each downloadable one with its ``url``."""
    out = {k: v for k, v in capture.items() if k != "files"}
    files = []
    for row in capture.get("files", ()):
        item = {k: v for k, v in row.items() if k != "path"}
        if row.get("path"):
            item["url"] = f"/api/v1/evidence/{row['capture_id']}/{row['rank']}/{row['name']}"
        files.append(item)
    out["files"] = files
    return out


class _EvidenceHandlers:
    def __init__(
        self,
        guard: RequestGuard,
        store: EvidenceRows,
        keeper: EvidenceKeeper,
        max_body_bytes: int,
    ) -> None:
        self._guard = guard
        self._store = store
        self._keeper = keeper
        self._max_body_bytes = max_body_bytes

    def _auth(self, request: web.Request) -> None:
        if not self._guard.authorized(request.headers):
            raise web.HTTPUnauthorized(text="missing or wrong bearer token")

    async def captures(self, request: web.Request) -> web.Response:
        self._auth(request)
        _only(request, ("job", "alert_id", "limit"))
        alert_id = request.query.get("alert_id")
        rows = await self._store.evidence(
            job=request.query.get("job"),
            alert_id=None if alert_id is None else _int("alert_id", alert_id),
            limit=_limit(request),
        )
        return web.json_response({"captures": [capture_json(r) for r in rows]})

    async def alert_captures(self, request: web.Request) -> web.Response:
        self._auth(request)
        text = request.match_info["id"]
        if not text.isdigit() or not await self._store.rows("alerts", {"id": text}, 1):
            return error(404, f"no alert {text!r}")
        rows = await self._store.evidence(alert_id=int(text), limit=_limit(request))
        return web.json_response(
            {"alert_id": int(text), "captures": [capture_json(r) for r in rows]}
        )

    async def download(self, request: web.Request) -> web.StreamResponse:
        # A read: the report page links here, so its session cookie is enough.
        if not self._guard.signed_in(request.headers, request.cookies):
            raise web.HTTPUnauthorized(text="missing or wrong bearer token")
        capture, rank, name = (request.match_info[k] for k in ("capture", "rank", "name"))
        if not rank.isdigit() or name not in FILE_NAMES:
            return error(404, f"no evidence file {capture}/{rank}/{name}")
        row = await self._store.evidence_file(capture, int(rank), name)
        if row is None:
            return error(404, f"no evidence file {capture}/{rank}/{name}")
        path = self._keeper.path(row)
        if path is None:
            why = row.get("error") or "its file is gone"
            return error(404, f"evidence file {capture}/{rank}/{name} is missing: {why}")
        filename = f"{capture}-rank{rank}-{name}.gz"
        return web.FileResponse(
            path,
            headers={
                "Content-Type": "application/gzip",
                "Content-Disposition": f'attachment; filename="{filename}"',
            },
        )

    async def capture(self, request: web.Request) -> web.Response:
        self._auth(request)
        body = await json_object(request, self._max_body_bytes)
        unknown = sorted(set(body) - {"profile_ranks"})
        if unknown:
            return error(400, f"unknown field(s) {', '.join(unknown)}; allowed: profile_ranks")
        ranks = body.get("profile_ranks")
        if ranks is not None and not _ranks(ranks):
            return error(400, f"profile_ranks must be a list of ranks, got {ranks!r}")
        try:
            capture_id = await self._keeper.capture(request.match_info["job"], profile_ranks=ranks)
        except CommandError as exc:
            return error(400, str(exc))
        return web.json_response({"id": capture_id}, status=202)


def _ranks(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 2**31 for r in value
    )


def _only(request: web.Request, names: Sequence[str]) -> None:
    unknown = sorted(set(request.query) - set(names))
    if unknown:
        raise web.HTTPBadRequest(
            text=f"unknown query parameter(s) {', '.join(unknown)}; allowed: {', '.join(names)}"
        )


def _int(name: str, text: str) -> int:
    if not text.isdigit():
        raise web.HTTPBadRequest(text=f"{name} must be an integer, got {text!r}")
    return int(text)


def _limit(request: web.Request) -> int:
    value = _int("limit", request.query.get("limit", "100"))
    if not 1 <= value <= _MAX_LIMIT:
        raise web.HTTPBadRequest(text=f"limit must be in 1..{_MAX_LIMIT}, got {value}")
    return value
