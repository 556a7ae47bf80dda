"""Where a report's data comes from: a history database, or an aggregator over HTTP."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, Final

import msgspec
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from torshmon.history.db import DatabaseConfigError, make_engine
from torshmon.history.store.report import job_names, load_job_history
from torshmon.redact import redact_url
from torshmon.report.model import JobReport, build_report, from_json

#: The aggregator's route that answers a job's report as JSON (``to_json``).
REPORT_DATA_PATH: Final = "/api/v1/jobs/{job}/summary"


class HistoryReports:
    """Reports and the list of jobs from an open history engine, for the aggregator's
    pages (``pages.ReportSource``): each read runs in the default executor."""

    def __init__(self, engine: Callable[[], Engine]) -> None:
        self._engine = engine

    async def job_report(self, job: str, now_unix_s: float) -> JobReport | None:
        """``job``'s report as of ``now_unix_s``; None if the history has no such job."""
        return await asyncio.get_running_loop().run_in_executor(
            None, self._job_report, job, now_unix_s
        )

    def _job_report(self, job: str, now_unix_s: float) -> JobReport | None:
        with self._engine().connect() as conn:
            history = load_job_history(conn, job)
        return build_report(history, now_unix_s) if history is not None else None

    async def job_list(self) -> list[dict[str, Any]]:
        """The jobs of the history, the most recently seen first."""
        return await asyncio.get_running_loop().run_in_executor(None, self._job_list)

    def _job_list(self) -> list[dict[str, Any]]:
        with self._engine().connect() as conn:
            return job_names(conn)


class ReportError(Exception):
    """The report cannot be made (no such job, a database or aggregator out of
    reach); the text says why in one line."""


def report_from_db(url: str, job: str, *, now_unix_s: float | None = None) -> JobReport:
    """``job``'s report from the history at ``url``, opened read-only."""
    shown = redact_url(url)
    try:
        engine = make_engine(url, read_only=True)
    except (DatabaseConfigError, FileNotFoundError) as exc:
        raise ReportError(str(exc)) from None
    try:
        with engine.connect() as conn:
            history = load_job_history(conn, job)
    except SQLAlchemyError as exc:
        orig = getattr(exc, "orig", None) or exc
        why = " ".join(f"{type(orig).__name__}: {orig}".split())
        raise ReportError(f"cannot read the history {shown}: {why}") from None
    finally:
        engine.dispose()
    if history is None:
        raise ReportError(f"no job {job!r} in the history {shown}")
    return build_report(history, time.time() if now_unix_s is None else now_unix_s)


def report_from_aggregator(base_url: str, job: str, token: str | None) -> JobReport:
    """``job``'s report as the aggregator at ``base_url`` makes it from its history."""
    path = REPORT_DATA_PATH.format(job=urllib.parse.quote(job, safe=""))
    request = urllib.request.Request(base_url.rstrip("/") + path)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    shown = redact_url(base_url)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        raise ReportError(f"{shown} answered HTTP {exc.code}: {_error_text(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise ReportError(f"cannot reach {shown}: {why}") from None
    try:
        return from_json(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ReportError(f"{shown} did not answer a report: {exc}") from None


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        payload = json.loads(exc.read() or b"{}")
    except ValueError:
        return exc.reason or ""
    return str(payload.get("error", "")) if isinstance(payload, dict) else ""
