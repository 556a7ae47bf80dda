"""Where a report's data comes from: a history database, or an aggregator over HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import msgspec
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from torshmon.history.db import DatabaseConfigError, make_engine
from torshmon.history.store.report import UnknownRun, job_names, load_job_history
from torshmon.redact import redact_url
from torshmon.report.build import build_report
from torshmon.report.model import EvidenceLink, JobReport, from_json

#: The aggregator's route that answers a job's report as JSON (``to_json``).
REPORT_DATA_PATH: Final = "/api/v1/jobs/{job}/summary"
#: An evidence file's download route, as the history's links name it.
_EVIDENCE_PATH: Final = re.compile(r"/api/v1/evidence/([^/?#]+)/([0-9]+)/([^/?#]+)")
#: What a file of evidence is read with: the link's capture, rank and name in, the
#: stored (gzip) bytes out; OSError or ReportError when it cannot be had.
EvidenceReader = Callable[[str, int, str], bytes]


class HistoryReports:
    """Reports and the list of jobs from an open history engine, for the aggregator's
    pages (``pages.ReportSource``): each read runs in the default executor."""

    def __init__(self, engine: Callable[[], Engine]) -> None:
        self._engine = engine

    async def job_report(
        self, job: str, now_unix_s: float, run: str | None = None
    ) -> JobReport | None:
        """``job``'s report as of ``now_unix_s``, of its run ``run`` (the latest when
        None); None if the history has no such job, UnknownRun if no such run."""
        return await asyncio.get_running_loop().run_in_executor(
            None, self._job_report, job, now_unix_s, run
        )

    def _job_report(self, job: str, now_unix_s: float, run: str | None) -> JobReport | None:
        with self._engine().connect() as conn:
            history = load_job_history(conn, job, run=run)
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


def report_from_db(
    url: str, job: str, *, run: str | None = None, now_unix_s: float | None = None
) -> JobReport:
    """``job``'s report from the history at ``url``, opened read-only: of its run
    ``run`` (an id, or its number: 1 the first, -1 the latest), the latest when None."""
    shown = redact_url(url)
    try:
        engine = make_engine(url, read_only=True)
    except (DatabaseConfigError, FileNotFoundError) as exc:
        raise ReportError(str(exc)) from None
    try:
        with engine.connect() as conn:
            history = load_job_history(conn, job, run=run)
    except UnknownRun as exc:
        raise ReportError(f"job {job!r}: {exc}") from None
    except SQLAlchemyError as exc:
        orig = getattr(exc, "orig", None) or exc
        why = " ".join(f"{type(orig).__name__}: {orig}".split())
        raise ReportError(f"cannot read the history {shown}: {why}") from None
    finally:
        engine.dispose()
    if history is None:
        raise ReportError(f"no job {job!r} in the history {shown}")
    return build_report(history, time.time() if now_unix_s is None else now_unix_s)


def report_from_aggregator(
    base_url: str, job: str, token: str | None, run: str | None = None
) -> JobReport:
    """``job``'s report as the aggregator at ``base_url`` makes it from its history (of
    its run ``run``, the latest when None)."""
    path = REPORT_DATA_PATH.format(job=urllib.parse.quote(job, safe=""))
    if run is not None:
        path += "?" + urllib.parse.urlencode({"run": run})
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


@dataclasses.dataclass(frozen=True, slots=True)
class SavedEvidence:
    """What ``save_evidence`` did: the report with relative links, the folder, and the
    files that could not be had (``rank 1 profiler_trace.json: why``)."""

    report: JobReport
    folder: Path
    written: int
    missing: tuple[str, ...]


def evidence_folder(page: Path) -> Path:
    """Where an offline page's evidence goes: ``out_evidence/`` beside ``out.html``."""
    return page.with_name(f"{page.stem}_evidence")


def save_evidence(report: JobReport, page: Path, read: EvidenceReader) -> SavedEvidence:
    """Copy the evidence files ``report``'s alerts link to beside ``page`` (an offline
    HTML report): ``<stem>_evidence/<capture>/rank<rank>-<name>.gz``, gzip as stored,
    which Perfetto and HTA open. The report comes back with links relative to the page
    (a link to the aggregator's ``/api/v1/...`` leads nowhere from a file); a file that
    cannot be had loses its link and is named in ``missing``. OSError if the folder
    cannot be written."""
    folder = evidence_folder(page)
    copied: dict[str, str] = {}
    missing: list[str] = []
    alerts = []
    for alert in report.alerts:
        links = []
        for link in alert.evidence:
            if link.url not in copied:
                match = _EVIDENCE_PATH.fullmatch(link.url)
                if match is None:
                    missing.append(f"{link.name}: not an evidence link ({link.url})")
                    continue
                capture, rank, name = (urllib.parse.unquote(g) for g in match.groups())
                if not _safe_segment(capture) or not _safe_segment(name):
                    missing.append(f"{link.name}: not an evidence link ({link.url})")
                    continue
                try:
                    data = read(capture, int(rank), name)
                except (OSError, ReportError) as exc:
                    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                    missing.append(f"{link.name}: {why}")
                    continue
                relative = f"{capture}/rank{rank}-{name}.gz"
                target = folder / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                copied[link.url] = urllib.parse.quote(f"{folder.name}/{relative}")
            links.append(EvidenceLink(link.name, copied[link.url]))
        alerts.append(dataclasses.replace(alert, evidence=tuple(links)))
    local = dataclasses.replace(report, alerts=tuple(alerts))
    return SavedEvidence(local, folder, len(copied), tuple(missing))


def _safe_segment(text: str) -> bool:
    """A capture id or file name that stays one path segment under the folder."""
    return bool(text) and text not in (".", "..") and "/" not in text and "\\" not in text


def evidence_from_db(url: str, evidence_dir: str | None) -> EvidenceReader:
    """Reads evidence files as the aggregator keeps them for the history at ``url``:
    each row's ``path`` under ``evidence_dir`` (by default the aggregator's:
    ``$TORSHMON_EVIDENCE_DIR``, else beside a SQLite history)."""
    from torshmon.aggregator.settings import default_evidence_dir
    from torshmon.history.models import EvidenceFile

    folder = Path(
        evidence_dir or os.environ.get("TORSHMON_EVIDENCE_DIR") or default_evidence_dir(url)
    )

    def read(capture: str, rank: int, name: str) -> bytes:
        engine = make_engine(url, read_only=True)
        try:
            with engine.connect() as conn:
                files = EvidenceFile.__table__
                path = conn.execute(
                    select(files.c.path).where(
                        files.c.capture_id == capture, files.c.rank == rank, files.c.name == name
                    )
                ).scalar()
        finally:
            engine.dispose()
        if not path:
            raise ReportError("not in the history")
        target = folder / str(path)
        if not target.resolve().is_relative_to(folder.resolve()):
            raise ReportError(f"its path {path!r} leaves {folder}")
        return target.read_bytes()

    return read


def evidence_from_aggregator(base_url: str, token: str | None) -> EvidenceReader:
    """Reads evidence files from the aggregator at ``base_url`` (its download route)."""

    def read(capture: str, rank: int, name: str) -> bytes:
        path = "/".join(urllib.parse.quote(p, safe="") for p in (capture, str(rank), name))
        request = urllib.request.Request(f"{base_url.rstrip('/')}/api/v1/evidence/{path}")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as exc:
            raise ReportError(f"HTTP {exc.code}: {_error_text(exc)}") from None
        except urllib.error.URLError as exc:
            raise ReportError(f"cannot reach {redact_url(base_url)}: {exc.reason}") from None

    return read
