"""The aggregator's HTTP API: jobs, ranks, alerts, anomalies, tuning, commands, query.

Every answer is JSON; every error is ``{"error": "...", "status": N}`` with a 4xx
status for bad input (a 5xx only for a fault of the aggregator itself). Rows come
from the SQLAlchemy models, so the API, the tables and the OpenAPI description
(``/api/v1/openapi.json``) share one schema definition.

``make_app`` builds the application from narrow interfaces (a store, a view of the
live state, a command sink, the tuning manager, a registry, a clock), each a
Protocol below; the request guard runs before every handler.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

from torshmon.aggregator.core.commands import CommandError, CommandStatus
from torshmon.aggregator.core.findings import (
    EXPLAINED_BY_KEY,
    EXPLAINED_BY_NAME_KEY,
    LOSS_KEY,
    STEP_KEY,
    WHAT_IF_KEY,
    Finding,
    cause_id,
)
from torshmon.aggregator.core.tuner import TunerError
from torshmon.aggregator.http.connections import CONNECTIONS, Connections
from torshmon.aggregator.http.guard import RequestGuard, read_body
from torshmon.aggregator.http.openapi import openapi_document
from torshmon.aggregator.http.pages import Pages, ReportSource
from torshmon.aggregator.http.queries import QueryBusy, QueryPool
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.aggregator.tuning_manager import TuningConflict, TuningUnavailable
from torshmon.history.query import (
    Interrupt,
    QueryError,
    QueryResult,
    format_result,
    json_value,
    run_query,
)
from torshmon.history.store import FilterError, Listing, Row
from torshmon.history.store.report import UnknownRun, pick_run

log = logging.getLogger(__name__)

_MAX_LIMIT = 10_000

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn aiohttp's HTTP errors into JSON and keep faults of ours a logged 500."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error(exc.status, _text(exc))
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return error(500, "internal error; see the aggregator's log")


def _text(exc: web.HTTPException) -> str:
    text = exc.text or exc.reason
    return text.removeprefix(f"{exc.status}: ")


class RowStore(Protocol):
    """The history's listings (``torshmon.history.store.HistoryStore``)."""

    async def rows(self, listing: Listing, filters: Mapping[str, str], limit: int) -> list[Row]: ...


class LiveView(Protocol):
    """What the live state says of jobs and ranks (``live.LiveState``): of one live run
    of a job (``run_id``), its latest when None."""

    def job_summary(self, job: str, run_id: str | None = None) -> dict[str, Any] | None: ...

    def job_config(self, job: str, run_id: str | None = None) -> dict[str, Any] | None: ...

    def rank_summaries(self, job: str, run_id: str | None = None) -> dict[int, dict[str, Any]]: ...

    def report(
        self, job: str, now_unix_s: float, run_id: str | None = None
    ) -> list[Finding] | None: ...

    def link_reading(self, job: str, run_id: str | None = None) -> dict[str, Any] | None: ...

    def job_kind(self, job: str, run_id: str | None = None) -> str | None: ...


class CommandSink(Protocol):
    """Queues commands and knows where they stand (``dispatch.CommandDispatch``)."""

    async def submit_command(
        self, job: str, kind: str, args: Mapping[str, object]
    ) -> CommandStatus: ...

    async def request_link_check(
        self, job: str, args: Mapping[str, object], reason: str = ...
    ) -> CommandStatus: ...

    def status(self, command_id: str) -> CommandStatus | None: ...


class Tuning(Protocol):
    """Starts and aborts tuning sessions (``tuning.TuningManager``)."""

    async def start_session(
        self,
        job: str,
        *,
        trigger: str,
        max_trials: int | None = ...,
        pinned: Iterable[str] = ...,
    ) -> str: ...

    async def abort_session(self, job: str, reason: str, *, restore: bool = ...) -> bool: ...


def make_app(
    settings: AggregatorSettings,
    *,
    guard: RequestGuard,
    store: RowStore,
    live: LiveView,
    commands: CommandSink,
    tuning: Tuning,
    reports: ReportSource,
    registry: CollectorRegistry,
    clock: Callable[[], float],
    connections: Connections | None = None,
    queries: QueryPool | None = None,
) -> web.Application:
    """The API's application: JSON errors, ``guard`` before every handler, every route,
    and the pages (``/``, ``/jobs/{job}``; ``torshmon.aggregator.http.pages``).

    Served with ``connections`` (their site; bodies are read within their timeout);
    history queries run in ``queries``. Either, when not given, is made from
    ``settings`` with its metrics in ``registry`` (a pool made here closes with the
    application). The caller may add routes (the ingest) before it starts serving.
    """
    if connections is None:
        connections = Connections(
            max_connections=settings.http_max_connections,
            header_timeout_s=settings.http_header_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            registry=registry,
        )
    own_pool = queries is None
    if queries is None:
        queries = QueryPool(
            max_running=settings.query_max_running,
            max_per_client=settings.query_max_per_client,
            registry=registry,
        )
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[connections.middleware(), error_middleware, guard.middleware()],
    )
    app[CONNECTIONS] = connections
    if own_pool:
        pool = queries

        async def close_pool(_app: web.Application) -> None:
            await pool.aclose()

        app.on_cleanup.append(close_pool)
    h = _Handlers(settings, guard, store, live, commands, tuning, clock, queries, connections)
    r = app.router
    r.add_get("/healthz", h.healthz)
    r.add_get("/metrics", make_aiohttp_handler(registry))
    r.add_get("/api/v1/openapi.json", h.openapi)
    r.add_get("/api/v1/jobs", h.jobs)
    r.add_get("/api/v1/jobs/{job}", h.job)
    r.add_get("/api/v1/jobs/{job}/ranks", h.ranks)
    r.add_get("/api/v1/jobs/{job}/report", h.report)
    r.add_post("/api/v1/jobs/{job}/commands", h.post_command)
    r.add_post("/api/v1/jobs/{job}/tune", h.tune)
    r.add_delete("/api/v1/jobs/{job}/tune", h.abort_tuning)
    r.add_post("/api/v1/jobs/{job}/link-check", h.link_check)
    r.add_get("/api/v1/commands/{id}", h.command)
    r.add_get("/api/v1/alerts", h.alerts)
    r.add_get("/api/v1/anomalies", h.anomalies)
    r.add_get("/api/v1/tuning/sessions", h.tuning_sessions)
    r.add_get("/api/v1/tuning/trials", h.tuning_trials)
    r.add_post("/api/v1/query", h.query)
    Pages(settings.token, guard, reports, clock).add_routes(r)
    return app


class _Handlers:
    def __init__(
        self,
        settings: AggregatorSettings,
        guard: RequestGuard,
        store: RowStore,
        live: LiveView,
        commands: CommandSink,
        tuning: Tuning,
        clock: Callable[[], float],
        queries: QueryPool,
        connections: Connections,
    ) -> None:
        self._settings = settings
        self._queries = queries
        self._connections = connections
        self._guard = guard
        self._store = store
        self._live = live
        self._commands = commands
        self._tuning = tuning
        self._clock = clock

    def _auth(self, request: web.Request) -> None:
        if not self._guard.authorized(request.headers):
            raise web.HTTPUnauthorized(text="missing or wrong bearer token")

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        return await json_object(request, self._settings.max_body_bytes)

    async def _rows(self, listing: Listing, filters: Mapping[str, str], limit: int) -> list[Row]:
        try:
            return await self._store.rows(listing, filters, limit)
        except FilterError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "aggregator_id": self._settings.aggregator_id, "v": 1}
        )

    async def openapi(self, _request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    async def jobs(self, request: web.Request) -> web.Response:
        self._auth(request)
        rows = await self._rows("jobs", {}, _limit(request))
        for row in rows:
            row["live"] = self._live.job_summary(row["job"])
        return web.json_response({"jobs": rows})

    async def job(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        rows = await self._rows("jobs", {"job": job}, 1)
        if not rows:
            return error(404, f"no job {job!r}")
        row = rows[0]
        # Its runs, the oldest first; the one asked for (?run=: id or number), else the latest.
        runs = list(reversed(await self._rows("runs", {"job": job}, 10_000)))
        try:
            chosen = pick_run(runs, request.query.get("run") or None)
        except UnknownRun as exc:
            return error(404, f"job {job!r}: {exc}")
        row["runs"] = runs
        row["run"] = chosen
        # The live state of the run asked for: the latest's, or an older launch's that
        # still runs (each live run is judged apart); None for a run that ended.
        run_id = None if chosen is None else chosen.get("run_id")
        run_id = run_id if isinstance(run_id, str) else None
        row["live"] = self._live.job_summary(job, run_id)
        row["config"] = self._live.job_config(job, run_id)
        return web.json_response(row)

    async def ranks(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        rows = await self._rows("probe_sessions", {"job": job}, _limit(request))
        live = self._live.rank_summaries(job, request.query.get("run") or None)
        for row in rows:
            row["live"] = live.get(row["rank"])
        return web.json_response({"job": job, "ranks": rows})

    async def report(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        run = request.query.get("run") or None
        findings = self._live.report(job, self._clock(), run)
        if findings is None:
            which = "" if run is None else f" run {run!r} of"
            return error(404, f"no live data for{which} job {job!r}")
        return web.json_response(
            {
                "job": job,
                "job_kind": self._live.job_kind(job, run),
                "bottlenecks": [finding_json(f) for f in findings],
                "link_check": self._live.link_reading(job, run),
            }
        )

    async def post_command(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        body = await self._json_body(request)
        kind = body.get("kind", "config")
        args = body.get("args", {})
        if not isinstance(kind, str) or not isinstance(args, dict):
            return error(400, 'expected {"kind": str, "args": object}')
        try:
            if kind == "link_check":
                status = await self._commands.request_link_check(job, args)
            else:
                status = await self._commands.submit_command(job, kind, args)
        except CommandError as exc:
            return error(400, str(exc))
        return web.json_response(_command_json(status), status=202)

    async def link_check(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        body = await self._json_body(request) if request.can_read_body else {}
        try:
            status = await self._commands.request_link_check(job, dict(body))
        except CommandError as exc:
            return error(400, str(exc))
        return web.json_response(_command_json(status), status=202)

    async def tune(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        body = await self._json_body(request) if request.can_read_body else {}
        unknown = sorted(set(body) - {"max_trials", "pinned"})
        if unknown:
            return error(400, f"unknown field(s) {', '.join(unknown)}; allowed: max_trials, pinned")
        max_trials = body.get("max_trials")
        pinned = body.get("pinned", [])
        if max_trials is not None and (
            isinstance(max_trials, bool) or not isinstance(max_trials, int)
        ):
            return error(400, f"max_trials must be an integer, got {max_trials!r}")
        if not isinstance(pinned, list) or not all(isinstance(p, str) for p in pinned):
            return error(400, f"pinned must be a list of knob names, got {pinned!r}")
        try:
            session_id = await self._tuning.start_session(
                job, trigger="api", max_trials=max_trials, pinned=pinned
            )
        except TuningConflict as exc:
            return error(409, str(exc))
        except TuningUnavailable as exc:
            return error(404, str(exc))
        except TunerError as exc:
            return error(400, str(exc))
        return web.json_response({"session_id": session_id, "job": job}, status=201)

    async def abort_tuning(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        body = await self._json_body(request)
        unknown = sorted(set(body) - {"reason", "restore"})
        if unknown:
            return error(400, f"unknown field(s) {', '.join(unknown)}; allowed: reason, restore")
        reason = body.get("reason", "aborted through the API")
        restore = body.get("restore", True)
        if not isinstance(reason, str) or not isinstance(restore, bool):
            return error(400, 'expected {"reason": str, "restore": bool}')
        if not await self._tuning.abort_session(job, reason, restore=restore):
            return error(404, f"job {job!r} has no active tuning session")
        return web.json_response({"job": job, "aborted": True})

    async def command(self, request: web.Request) -> web.Response:
        self._auth(request)
        status = self._commands.status(request.match_info["id"])
        if status is None:
            rows = await self._rows("commands", {"id": request.match_info["id"]}, 1)
            if not rows:
                return error(404, f"no command {request.match_info['id']!r}")
            return web.json_response(rows[0])
        return web.json_response(_command_json(status))

    async def alerts(self, request: web.Request) -> web.Response:
        self._auth(request)
        where = _filters(request, ("job", "run_id", "state", "rule", "severity"))
        rows = await self._rows("alerts", where, _limit(request))
        return web.json_response({"alerts": rows})

    async def anomalies(self, request: web.Request) -> web.Response:
        self._auth(request)
        where = _filters(request, ("job", "run_id", "kind", "metric"))
        rows = await self._rows("findings", where, _limit(request))
        return web.json_response({"anomalies": rows})

    async def tuning_sessions(self, request: web.Request) -> web.Response:
        self._auth(request)
        where = _filters(request, ("job", "run_id", "state"))
        rows = await self._rows("tuning_sessions", where, _limit(request))
        for row in rows:
            blob = row.pop("state_blob", None)
            state = blob if isinstance(blob, dict) else {}
            row["summary"] = state.get("summary", "")
            row["unit"] = state.get("unit", "")  # of the trials' windows and scores
        return web.json_response({"sessions": rows})

    async def tuning_trials(self, request: web.Request) -> web.Response:
        self._auth(request)
        where = _filters(request, ("job", "run_id", "session_id"))
        rows = await self._rows("tuning_trials", where, _limit(request))
        return web.json_response({"trials": rows})

    async def query(self, request: web.Request) -> web.Response:
        self._auth(request)
        body = await self._json_body(request)
        sql = body.get("sql")
        fmt = body.get("format", "json")
        if not isinstance(sql, str) or not sql.strip():
            return error(400, 'expected {"sql": "SELECT ..."}')
        if fmt not in ("json", "csv", "table"):
            return error(400, f"format must be json, csv or table, got {fmt!r}")
        url, timeout_s = self._settings.query_db_url, self._settings.query_timeout_s

        def query(interrupt: Interrupt) -> QueryResult:
            return run_query(url, sql, timeout_s=timeout_s, interrupt=interrupt)

        # A client that hangs up stops its query: it would hold a slot to its timeout.
        interrupt = Interrupt()
        loop = asyncio.get_running_loop()

        def hung_up() -> None:
            loop.run_in_executor(None, interrupt.interrupt, "the client hung up")

        try:
            with self._connections.on_hang_up(request, hung_up):
                result = await self._queries.run(request.remote or "unknown", query, interrupt)
        except QueryBusy as exc:
            return web.json_response(
                {"error": str(exc), "status": exc.status},
                status=exc.status,
                headers={"Retry-After": str(exc.retry_after_s)},
            )
        except QueryError as exc:
            return error(400, str(exc))
        if fmt == "json":
            return web.json_response(
                {
                    "columns": list(result.columns),
                    "rows": [[json_value(v) for v in r] for r in result.rows],
                    "truncated": result.truncated,
                },
                dumps=functools.partial(json.dumps, allow_nan=False),
            )
        content_type = "text/csv" if fmt == "csv" else "text/plain"
        return web.Response(text=format_result(result, fmt), content_type=content_type)


def _limit(request: web.Request) -> int:
    text = request.query.get("limit", "100")
    try:
        value = int(text)
    except ValueError:
        raise web.HTTPBadRequest(text=f"limit must be an integer, got {text!r}") from None
    if not 1 <= value <= _MAX_LIMIT:
        raise web.HTTPBadRequest(text=f"limit must be in 1..{_MAX_LIMIT}, got {value}")
    return value


def _filters(request: web.Request, names: tuple[str, ...]) -> dict[str, Any]:
    unknown = sorted(set(request.query) - set(names) - {"limit"})
    if unknown:
        raise web.HTTPBadRequest(
            text=f"unknown query parameter(s) {', '.join(unknown)}; allowed: "
            + ", ".join((*names, "limit"))
        )
    return {n: request.query[n] for n in names if n in request.query}


async def json_object(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The body of ``request``, a JSON object of at most ``max_bytes`` (inflated).

    Raises a 4xx naming the problem: not JSON, not UTF-8, nested too deep, not an object
    (``read_body`` adds those of size and content coding).
    """
    body = await read_body(request, max_bytes)
    try:
        value = msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise web.HTTPBadRequest(text=f"the body is not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise web.HTTPBadRequest(text="the body is not valid JSON: a string is not UTF-8") from None
    except RecursionError:
        raise web.HTTPBadRequest(text="the body is not valid JSON: nested too deep") from None
    if not isinstance(value, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return value


def _command_json(status: CommandStatus) -> dict[str, Any]:
    return {
        "id": status.command.id,
        "job": status.command.job,
        "kind": status.command.kind,
        "args": dict(status.command.args),
        "status": status.status,
        "reason": status.reason,
        "version": status.version,
        "effective_step": status.effective_step,
        "created_unix_s": status.created_unix_s,
        "updated_unix_s": status.updated_unix_s,
    }


def finding_json(f: Finding) -> dict[str, Any]:
    """A finding of the bottleneck report as the API answers it (priority order): a
    symptom names the ``id`` of its cause in ``explained_by``; a cause carries the job's
    step time with and without it and the share of throughput it costs."""
    rank = f.labels.get("rank", "")
    details = f.details
    return {
        "kind": f.kind,
        "category": f.category or None,
        "severity": f.severity,
        "priority": f.priority,
        "expected_gain_ratio": f.expected_gain_ratio,
        "difficulty": f.difficulty or None,
        "summary": f.summary,
        "recommendation": f.recommendation,
        "value": f.value if math.isfinite(f.value) else None,
        "rank": int(rank) if rank.isdecimal() else None,
        "labels": dict(f.labels),
        "since_unix_s": f.since_unix_s,
        "id": cause_id(f.kind, f.labels),
        "explained_by": _text_or_none(details.get(EXPLAINED_BY_KEY)),
        "explained_by_name": _text_or_none(details.get(EXPLAINED_BY_NAME_KEY)),
        "step_s": _finite_or_none(details.get(STEP_KEY)),
        "what_if_step_s": _finite_or_none(details.get(WHAT_IF_KEY)),
        "throughput_loss_ratio": _finite_or_none(details.get(LOSS_KEY)),
    }


def _finite_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _text_or_none(value: object) -> str | None:
    return str(value) if value else None
