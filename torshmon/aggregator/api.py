"""The aggregator's HTTP API: jobs, ranks, alerts, anomalies, tuning, commands, query.

Every answer is JSON; every error is ``{"error": "...", "status": N}`` with a 4xx
status for bad input (a 5xx only for a fault of the aggregator itself). Rows come
from the SQLAlchemy models, so the API, the tables and the OpenAPI description
(``/api/v1/openapi.json``) share one schema definition.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler
from sqlalchemy import Table, select
from sqlalchemy import types as sa_types

from torshmon.aggregator.commands import CommandError, CommandStatus
from torshmon.aggregator.guard import read_body
from torshmon.aggregator.tuner import TunerError
from torshmon.aggregator.tuning import TuningConflict, TuningUnavailable
from torshmon.history.models import Base
from torshmon.history.query import QueryError, format_result, json_value, run_query
from torshmon.wire import Command, IngestBatch, IngestReply

if TYPE_CHECKING:
    from torshmon.aggregator.service import Aggregator

log = logging.getLogger(__name__)

_T = Base.metadata.tables
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


def add_routes(app: web.Application, aggregator: Aggregator) -> None:
    h = _Handlers(aggregator)
    r = app.router
    r.add_get("/healthz", h.healthz)
    r.add_get("/metrics", make_aiohttp_handler(aggregator.registry))
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


class _Handlers:
    def __init__(self, aggregator: Aggregator) -> None:
        self.a = aggregator

    def _auth(self, request: web.Request) -> None:
        if not self.a.authorized(request):
            raise web.HTTPUnauthorized(text="missing or wrong bearer token")

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        return await json_object(request, self.a.settings.max_body_bytes)

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "aggregator_id": self.a.settings.aggregator_id, "v": 1}
        )

    async def openapi(self, _request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    async def jobs(self, request: web.Request) -> web.Response:
        self._auth(request)
        rows = await self.a.read(self._rows, _T["jobs"], {}, "last_seen_unix_ns", _limit(request))
        for row in rows:
            row["live"] = self.a.live.job_summary(row["job"])
        return web.json_response({"jobs": rows})

    async def job(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        rows = await self.a.read(self._rows, _T["jobs"], {"job": job}, None, 1)
        if not rows:
            return error(404, f"no job {job!r}")
        row = rows[0]
        row["live"] = self.a.live.job_summary(job)
        row["config"] = self.a.live.job_config(job)
        return web.json_response(row)

    async def ranks(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        rows = await self.a.read(
            self._rows, _T["probe_sessions"], {"job": job}, "last_seen_unix_ns", _limit(request)
        )
        live = self.a.live.rank_summaries(job)
        for row in rows:
            row["live"] = live.get(row["rank"])
        return web.json_response({"job": job, "ranks": rows})

    async def report(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        findings = self.a.live.report(job, self.a.clock())
        if findings is None:
            return error(404, f"no live data for job {job!r}")
        return web.json_response(
            {
                "job": job,
                "bottlenecks": [
                    {
                        "severity": f.severity,
                        "summary": f.summary,
                        "recommendation": f.recommendation,
                        "value": f.value,
                        "labels": dict(f.labels),
                    }
                    for f in findings
                ],
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
                status = await self.a.request_link_check(job, args)
            else:
                status = await self.a.submit_command(job, kind, args)
        except CommandError as exc:
            return error(400, str(exc))
        return web.json_response(_command_json(status), status=202)

    async def link_check(self, request: web.Request) -> web.Response:
        self._auth(request)
        job = request.match_info["job"]
        body = await self._json_body(request) if request.can_read_body else {}
        try:
            status = await self.a.request_link_check(job, dict(body))
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
            session_id = await self.a.tuning.start_session(
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
        if not await self.a.tuning.abort_session(job, reason, restore=restore):
            return error(404, f"job {job!r} has no active tuning session")
        return web.json_response({"job": job, "aborted": True})

    async def command(self, request: web.Request) -> web.Response:
        self._auth(request)
        status = self.a.commands.get(request.match_info["id"])
        if status is None:
            rows = await self.a.read(
                self._rows, _T["commands"], {"id": request.match_info["id"]}, None, 1
            )
            if not rows:
                return error(404, f"no command {request.match_info['id']!r}")
            return web.json_response(rows[0])
        return web.json_response(_command_json(status))

    async def alerts(self, request: web.Request) -> web.Response:
        self._auth(request)
        where = _filters(request, ("job", "state", "rule", "severity"))
        rows = await self.a.read(self._rows, _T["alerts"], where, "id", _limit(request))
        return web.json_response({"alerts": rows})

    async def anomalies(self, request: web.Request) -> web.Response:
        self._auth(request)
        where = _filters(request, ("job", "kind", "metric"))
        rows = await self.a.read(self._rows, _T["findings"], where, "id", _limit(request))
        return web.json_response({"anomalies": rows})

    async def tuning_sessions(self, request: web.Request) -> web.Response:
        self._auth(request)
        where = _filters(request, ("job", "state"))
        rows = await self.a.read(
            self._rows, _T["tuning_sessions"], where, "started_unix_s", _limit(request)
        )
        for row in rows:
            blob = row.pop("state_blob", None)
            row["summary"] = blob.get("summary", "") if isinstance(blob, dict) else ""
        return web.json_response({"sessions": rows})

    async def tuning_trials(self, request: web.Request) -> web.Response:
        self._auth(request)
        where = _filters(request, ("job", "session_id"))
        rows = await self.a.read(self._rows, _T["tuning_trials"], where, "id", _limit(request))
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
        try:
            result = await self.a.read(run_query, self.a.settings.query_db_url, sql)
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

    def _rows(
        self, table: Table, where: dict[str, Any], order: str | None, limit: int
    ) -> list[dict[str, Any]]:
        engine = self.a.engine
        if engine is None:
            return []
        query = select(table)
        for name, value in where.items():
            column = table.c[name]
            if isinstance(column.type, (sa_types.Integer, sa_types.BigInteger)):
                try:
                    value = int(value)
                except ValueError:
                    raise web.HTTPBadRequest(text=f"{name} must be an integer") from None
            query = query.where(column == value)
        if order is not None:
            query = query.order_by(table.c[order].desc())
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(query.limit(limit)).mappings()]


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


# -- OpenAPI -------------------------------------------------------------------------------


def _column_schema(column: Any) -> dict[str, Any]:
    t = column.type
    if isinstance(t, sa_types.Boolean):
        schema: dict[str, Any] = {"type": "boolean"}
    elif isinstance(t, (sa_types.Integer, sa_types.BigInteger)):
        schema = {"type": "integer"}
    elif isinstance(t, (sa_types.Float, sa_types.Numeric)):
        schema = {"type": "number"}
    elif isinstance(t, sa_types.String):
        schema = {"type": "string"}
        if t.length:
            schema["maxLength"] = t.length
    else:
        schema = {}
    if column.nullable:
        schema = {"anyOf": [schema, {"type": "null"}]}
    if column.comment:
        schema["description"] = column.comment
    return schema


def _table_schema(table: Table) -> dict[str, Any]:
    return {
        "type": "object",
        "description": table.comment or f"A row of the {table.name} table.",
        "properties": {c.name: _column_schema(c) for c in table.columns},
    }


def _any_value_schema(t: type) -> dict[str, Any]:
    """``object`` (a command's free-form arguments) is any JSON value."""
    if t is object:
        return {"description": "any JSON value"}
    raise NotImplementedError(t)


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 description of this API, built from the wire schema and the models."""
    (batch_ref, reply_ref, command_ref), wire = msgspec.json.schema_components(
        [IngestBatch, IngestReply, Command],
        ref_template="#/components/schemas/{name}",
        schema_hook=_any_value_schema,
    )
    schemas: dict[str, Any] = dict(wire)
    for name in (
        "jobs",
        "probe_sessions",
        "alerts",
        "findings",
        "tuning_sessions",
        "tuning_trials",
        "commands",
    ):
        schemas[f"row_{name}"] = _table_schema(_T[name])
    schemas["Error"] = {
        "type": "object",
        "properties": {"error": {"type": "string"}, "status": {"type": "integer"}},
        "required": ["error", "status"],
    }

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    def listing(key: str, row: str, params: tuple[str, ...]) -> dict[str, Any]:
        return {
            "get": {
                "summary": f"List {key}, newest first",
                "parameters": [
                    {"name": p, "in": "query", "required": False, "schema": {"type": "string"}}
                    for p in (*params, "limit")
                ],
                "responses": {
                    "200": _json_response(
                        {
                            "type": "object",
                            "properties": {key: {"type": "array", "items": ref(row)}},
                        }
                    ),
                    "400": _json_response(ref("Error")),
                    "401": _json_response(ref("Error")),
                },
            }
        }

    job_param = {"name": "job", "in": "path", "required": True, "schema": {"type": "string"}}
    paths: dict[str, Any] = {
        "/api/v1/ingest": {
            "post": {
                "summary": "Agent ingest: spool records, idempotent by agent_id + seq (gzip JSON)",
                "requestBody": {"content": {"application/json": {"schema": batch_ref}}},
                "responses": {
                    "200": _json_response(reply_ref),
                    "400": _json_response(ref("Error")),
                    "401": _json_response(ref("Error")),
                    "413": _json_response(ref("Error")),
                    "503": _json_response(ref("Error")),
                },
            }
        },
        "/healthz": {"get": {"summary": "Liveness", "responses": {"200": _json_response({})}}},
        "/metrics": {
            "get": {
                "summary": "Prometheus exposition of the job-level and service metrics",
                "responses": {"200": {"description": "text exposition format"}},
            }
        },
        "/api/v1/jobs": listing("jobs", "row_jobs", ()),
        "/api/v1/jobs/{job}": {
            "get": {
                "summary": "One job with its live summary and communication config",
                "parameters": [job_param],
                "responses": {
                    "200": _json_response(ref("row_jobs")),
                    "404": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/jobs/{job}/ranks": {
            "get": {
                "summary": "The ranks (probe sessions) of a job with their live summary",
                "parameters": [job_param],
                "responses": {"200": _json_response({"type": "object"})},
            }
        },
        "/api/v1/jobs/{job}/report": {
            "get": {
                "summary": "Bottleneck report with recommendations",
                "parameters": [job_param],
                "responses": {
                    "200": _json_response({"type": "object"}),
                    "404": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/jobs/{job}/commands": {
            "post": {
                "summary": "Queue a command (kind 'config': request_config arguments) for rank 0",
                "parameters": [job_param],
                "requestBody": {
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "kind": {"type": "string"},
                                    "args": {"type": "object"},
                                },
                            }
                        }
                    }
                },
                "responses": {
                    "202": _json_response(command_ref),
                    "400": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/jobs/{job}/link-check": {
            "post": {
                "summary": (
                    "Run a pairwise link check on every rank of the job at one step; "
                    "a slow link becomes a slow_link finding naming the rank"
                ),
                "parameters": [job_param],
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "size_bytes": {
                                        "type": "integer",
                                        "description": "bytes each rank of a pair sends",
                                    },
                                    "repeats": {
                                        "type": "integer",
                                        "description": "exchanges per pair; the fastest counts",
                                    },
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "202": _json_response(command_ref),
                    "400": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/jobs/{job}/tune": {
            "post": {
                "summary": "Start an autotuning session for the job; returns its id",
                "parameters": [job_param],
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "max_trials": {"type": "integer", "minimum": 1},
                                    "pinned": {
                                        "type": "array",
                                        "items": {"enum": ["bucket_cap_mb", "codec"]},
                                    },
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "201": _json_response(
                        {
                            "type": "object",
                            "properties": {
                                "session_id": {"type": "string"},
                                "job": {"type": "string"},
                            },
                        }
                    ),
                    "400": _json_response(ref("Error")),
                    "404": _json_response(ref("Error")),
                    "409": _json_response(ref("Error")),
                },
            },
            "delete": {
                "summary": "Abort the job's active tuning session (restore: push the "
                "incumbent config back, the default)",
                "parameters": [job_param],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "reason": {"type": "string"},
                                    "restore": {"type": "boolean"},
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json_response(
                        {
                            "type": "object",
                            "properties": {
                                "job": {"type": "string"},
                                "aborted": {"type": "boolean"},
                            },
                        }
                    ),
                    "400": _json_response(ref("Error")),
                    "404": _json_response(ref("Error")),
                },
            },
        },
        "/api/v1/commands/{id}": {
            "get": {
                "summary": "Where a command stands (pending, sent, applied, rejected, ...)",
                "parameters": [
                    {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": _json_response(ref("row_commands")),
                    "404": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/alerts": listing("alerts", "row_alerts", ("job", "state", "rule", "severity")),
        "/api/v1/anomalies": listing("anomalies", "row_findings", ("job", "kind", "metric")),
        "/api/v1/tuning/sessions": listing("sessions", "row_tuning_sessions", ("job", "state")),
        "/api/v1/tuning/trials": listing("trials", "row_tuning_trials", ("job", "session_id")),
        "/api/v1/query": {
            "post": {
                "summary": "Read-only SQL on the history (enforced by the database)",
                "requestBody": {
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["sql"],
                                "properties": {
                                    "sql": {"type": "string"},
                                    "format": {"enum": ["json", "csv", "table"]},
                                },
                            }
                        }
                    }
                },
                "responses": {
                    "200": _json_response({"type": "object"}),
                    "400": _json_response(ref("Error")),
                },
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "torshmon aggregator",
            "version": "1",
            "description": (
                "Refused before any path: a Host that is not one of the aggregator's names "
                "(421; a request with the bearer token may use any), another Origin or "
                "Sec-Fetch-Site cross-site (403), a POST whose Content-Type is not "
                "application/json (415), a Content-Encoding other than gzip (415)."
            ),
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }


def _json_response(schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": "JSON", "content": {"application/json": {"schema": schema}}}
