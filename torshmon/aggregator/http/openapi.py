"""The OpenAPI 3.1 description of the aggregator's HTTP API (``/api/v1/openapi.json``).

Row schemas come from the SQLAlchemy models and the ingest schema from the wire
types, so the document, the tables and the API cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import msgspec
from sqlalchemy import Table
from sqlalchemy import types as sa_types

from torshmon.history.models import Base
from torshmon.wire import Command, IngestBatch, IngestReply

_T = Base.metadata.tables


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
        "silences",
        "evidence_captures",
        "evidence_files",
    ):
        schemas[f"row_{name}"] = _table_schema(_T[name])
    capture_schema = {
        "allOf": [
            _ref("row_evidence_captures"),
            {
                "type": "object",
                "properties": {
                    "files": {
                        "type": "array",
                        "description": "Its files; those kept have the url they download from "
                        "(path is left out).",
                        "items": _ref("row_evidence_files"),
                    }
                },
            },
        ]
    }
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
    id_param = {"name": "id", "in": "path", "required": True, "schema": {"type": "integer"}}
    run_param = {
        "name": "run",
        "in": "query",
        "required": False,
        "description": "One run (launch) of the job: its id, or its number (1 the first, "
        "-1 the latest); the latest when absent",
        "schema": {"type": "string"},
    }
    live_run_param = {
        "name": "run",
        "in": "query",
        "required": False,
        "description": "One live run (launch) of the job, by its id: two launches of a job "
        "that run at once are judged apart; the job's latest run when absent",
        "schema": {"type": "string"},
    }
    silence = {
        "allOf": [
            ref("row_silences"),
            {"properties": {"state": {"enum": ["active", "pending", "expired"]}}},
        ]
    }
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
                "summary": "One job with its runs (runs, the oldest first; run, the one "
                "asked for or the latest) and, where that run is live (the latest, or an "
                "older launch still running), its live summary and communication config",
                "parameters": [job_param, run_param],
                "responses": {
                    "200": _json_response(ref("row_jobs")),
                    "404": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/jobs/{job}/ranks": {
            "get": {
                "summary": "The ranks (probe sessions) of a job with their live summary "
                "(of the run asked for, else the latest)",
                "parameters": [job_param, live_run_param],
                "responses": {"200": _json_response({"type": "object"})},
            }
        },
        "/api/v1/jobs/{job}/report": {
            "get": {
                "summary": "Bottleneck report with recommendations, and the latest link check "
                "(bandwidth per rank, and per node pair when ranks share hosts), of one "
                "live run: the latest by default",
                "parameters": [job_param, live_run_param],
                "responses": {
                    "200": _json_response({"type": "object"}),
                    "404": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/jobs/{job}/summary": {
            "get": {
                "summary": "The job's report from the history, as torshmon report shows it: "
                "per-rank statistics, phases of a step, series, findings, alerts, tuning "
                "(the page of it is /jobs/{job}); of one run, the latest by default",
                "parameters": [job_param, run_param],
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
        "/api/v1/alerts": listing(
            "alerts", "row_alerts", ("job", "run_id", "state", "rule", "severity")
        ),
        "/api/v1/alerts/{id}/ack": {
            "post": {
                "summary": "Acknowledge a pending or firing alert (who and why are stored)",
                "parameters": [id_param],
                "requestBody": _json_body(
                    {"by": {"type": "string", "maxLength": 200}, "comment": {"type": "string"}},
                    ["by"],
                ),
                "responses": {
                    "200": _json_response(
                        {"type": "object", "properties": {"alert": ref("row_alerts")}}
                    ),
                    "400": _json_response(ref("Error")),
                    "404": _json_response(ref("Error")),
                    "409": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/silences": {
            "get": {
                "summary": "List silences, newest first, each with its state now",
                "parameters": [
                    {
                        "name": "state",
                        "in": "query",
                        "required": False,
                        "schema": {"enum": ["active", "pending", "expired"]},
                    }
                ],
                "responses": {
                    "200": _json_response(
                        {
                            "type": "object",
                            "properties": {"silences": {"type": "array", "items": silence}},
                        }
                    ),
                    "400": _json_response(ref("Error")),
                },
            },
            "post": {
                "summary": "Silence the notifications of alerts whose labels all match, "
                "for duration_s (or until ends_at_unix_s; at most 30 days)",
                "requestBody": _json_body(
                    {
                        "matchers": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                            "minProperties": 1,
                        },
                        "created_by": {"type": "string", "maxLength": 200},
                        "comment": {"type": "string"},
                        "duration_s": {"type": "number", "exclusiveMinimum": 0},
                        "starts_at_unix_s": {"type": "number"},
                        "ends_at_unix_s": {"type": "number"},
                    },
                    ["matchers", "created_by"],
                ),
                "responses": {
                    "201": _json_response({"type": "object", "properties": {"silence": silence}}),
                    "400": _json_response(ref("Error")),
                    "409": _json_response(ref("Error")),
                },
            },
        },
        "/api/v1/silences/{id}": {
            "delete": {
                "summary": "Expire a silence now",
                "parameters": [id_param],
                "responses": {
                    "200": _json_response({"type": "object", "properties": {"silence": silence}}),
                    "400": _json_response(ref("Error")),
                    "404": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/anomalies": listing(
            "anomalies", "row_findings", ("job", "run_id", "kind", "metric")
        ),
        "/api/v1/tuning/sessions": listing(
            "sessions", "row_tuning_sessions", ("job", "run_id", "state")
        ),
        "/api/v1/tuning/trials": listing(
            "trials", "row_tuning_trials", ("job", "run_id", "session_id")
        ),
        "/api/v1/evidence": {
            "get": {
                "summary": "Evidence captures (Flight Recorder dumps, profiler traces), newest "
                "first, each with its files",
                "parameters": [
                    {"name": p, "in": "query", "required": False, "schema": {"type": "string"}}
                    for p in ("job", "alert_id", "limit")
                ],
                "responses": {
                    "200": _json_response(
                        {
                            "type": "object",
                            "properties": {"captures": {"type": "array", "items": capture_schema}},
                        }
                    ),
                    "400": _json_response(ref("Error")),
                    "401": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/alerts/{id}/evidence": {
            "get": {
                "summary": "The evidence captures an alert episode (alerts.id) asked for",
                "parameters": [
                    {"name": "id", "in": "path", "required": True, "schema": {"type": "integer"}}
                ],
                "responses": {
                    "200": _json_response(
                        {
                            "type": "object",
                            "properties": {
                                "alert_id": {"type": "integer"},
                                "captures": {"type": "array", "items": capture_schema},
                            },
                        }
                    ),
                    "404": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/evidence/{capture}/{rank}/{name}": {
            "get": {
                "summary": "One evidence file as stored, gzip-compressed JSON",
                "parameters": [
                    {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                    for n in ("capture", "rank", "name")
                ],
                "responses": {
                    "200": {"description": "application/gzip"},
                    "404": _json_response(ref("Error")),
                },
            }
        },
        "/api/v1/jobs/{job}/evidence": {
            "post": {
                "summary": "Ask every rank of a job for evidence now (202 with the capture id)",
                "parameters": [job_param],
                "requestBody": {
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "profile_ranks": {"type": "array", "items": {"type": "integer"}}
                                },
                            }
                        }
                    }
                },
                "responses": {
                    "202": _json_response(
                        {"type": "object", "properties": {"id": {"type": "string"}}}
                    ),
                    "400": _json_response(ref("Error")),
                },
            }
        },
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
                    "429": {
                        **_json_response(ref("Error")),
                        "description": "query_max_running queries run, or "
                        "query_max_per_client of this client's: retry after Retry-After s",
                        "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                    },
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
                "application/json (415), a Content-Encoding other than gzip (415), a "
                "request whose head or body is slower than the http_*_timeout_s settings "
                "(408), a connection over http_max_connections (503)."
            ),
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }


def _json_body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "required": required, "properties": properties}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_response(schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": "JSON", "content": {"application/json": {"schema": schema}}}
