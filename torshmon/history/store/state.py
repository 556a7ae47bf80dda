"""The aggregator's state in SQL: every statement its service, API and autotuner run.

One ``HistoryStore`` per aggregator. Its methods are coroutines that say which
thread runs them: writes go to the aggregator's one writer thread (SQLite takes one
writer at a time, and the order of writes is the order of calls), reads to the
default executor. Rows in and out are frozen dataclasses, or the aggregator's own
``Alert`` and ``Finding``; their fields are checked against the SQLAlchemy models
at import, so a column added to a model and not here fails loudly, naming it.

Beside it: ingest's statements (``torshmon.history.store.ingest``, run by the ingest
store on this store's engine or in the ingest process) and the retention job's
(``torshmon.history.retention``, called from here).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Literal, TypeVar

from sqlalchemy import Table, delete, func, select, update
from sqlalchemy import types as sa_types
from sqlalchemy.engine import Connection, Engine

from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.core.episodes import FindingChange, FindingKey
from torshmon.aggregator.core.silences import Silence, SilenceRequest
from torshmon.history.db import begin_write, insert_ignore, make_engine, upsert
from torshmon.history.models import Base
from torshmon.history.retention import RetentionReport, apply_retention
from torshmon.history.store.evidence import list_evidence
from torshmon.history.store.ingest import latest_run
from torshmon.history.store.rows import (
    LISTING_ORDER,
    EvidenceCaptureRow,
    EvidenceFileRow,
    FilterError,
    Listing,
    Row,
    RunningJob,
    TuningSessionRow,
    TuningTrialRow,
    finding_row,
    label_rank,
    row_values,
)

T = TypeVar("T")
_T = Base.metadata.tables


class HistoryStore:
    """The history as the aggregator reads and writes it (see the module's docstring).

    ``open`` before use and ``close`` after; until ``open`` the store holds nothing:
    writes do nothing and reads find nothing. ``writer`` is the one thread that writes.
    """

    def __init__(self, url: str, *, aggregator_id: str, writer: Executor) -> None:
        self.url = url
        self.aggregator_id = aggregator_id
        self._writer = writer
        self._engine: Engine | None = None
        self._alert_rows: dict[str, int] = {}  # fingerprint -> alerts.id of open alerts
        self._finding_rows: dict[FindingKey, int] = {}  # key -> findings.id of open episodes

    def open(self) -> None:
        """Make the engine (no connection yet); raises DatabaseConfigError for a bad URL."""
        if self._engine is None:
            self._engine = make_engine(self.url)

    def close(self) -> None:
        """Close the engine's connections; safe to call twice."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.dispose()

    @property
    def engine(self) -> Engine:
        """The open engine, shared with the ingest store; RuntimeError before ``open``."""
        if self._engine is None:
            raise RuntimeError("the history store is not open")
        return self._engine

    async def _write(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # -- alerts and findings -----------------------------------------------------------

    async def record(
        self,
        findings: Sequence[FindingChange],
        alerts: Sequence[Alert],
        now_unix_s: float,
        revised: Sequence[Alert] = (),
    ) -> None:
        """Open, update and close finding episodes and store alert transitions, then
        rewrite the text and value of the open alerts in ``revised`` (no event: their
        state did not change), in one transaction (a failed write can be retried whole,
        in the same order)."""
        await self._write(self._record, list(findings), list(alerts), now_unix_s, list(revised))

    def _record(
        self,
        findings: list[FindingChange],
        alerts: list[Alert],
        now: float,
        revised: list[Alert] | None = None,
    ) -> None:
        if self._engine is None:
            return
        rows: dict[FindingKey, int | None] = {}
        with begin_write(self._engine) as conn:
            for change in findings:
                key = change.finding.key()
                rows[key] = self._record_finding(conn, change, now, rows)
            opened: dict[str, int | None] = {}
            for alert in alerts:
                opened[alert.fingerprint] = self._record_alert(conn, alert, now, opened)
            for alert in revised or ():
                self._revise_alert(conn, alert, now, opened)
        # Only once committed: a failed write is retried whole with the next tick's.
        for key, finding_id in rows.items():
            if finding_id is None:
                self._finding_rows.pop(key, None)
            else:
                self._finding_rows[key] = finding_id
        for fingerprint, row_id in opened.items():
            if row_id is None:
                self._alert_rows.pop(fingerprint, None)
            else:
                self._alert_rows[fingerprint] = row_id

    def _record_finding(
        self,
        conn: Connection,
        change: FindingChange,
        now: float,
        rows: Mapping[FindingKey, int | None],
    ) -> int | None:
        """Write one episode change; the episode's row id while it is open."""
        table = _T["findings"]
        key = change.finding.key()
        row_id = rows[key] if key in rows else self._finding_rows.get(key)
        if change.change == "close":
            if row_id is not None:
                ended = change.ended_unix_s if change.ended_unix_s is not None else now
                conn.execute(
                    update(table)
                    .where(table.c.id == row_id)
                    .values(ended_unix_s=ended, updated_unix_s=now)
                )
            return None
        values = finding_row(change.finding, now)
        if row_id is None:  # opened, or updated after its row was lost: open one
            values.update(detected_unix_s=now, aggregator_id=self.aggregator_id)
            result = conn.execute(table.insert().values(**values))
            inserted = result.inserted_primary_key
            if inserted is None:
                raise RuntimeError("the database returned no id for a new finding row")
            return int(inserted[0])
        conn.execute(update(table).where(table.c.id == row_id).values(**values))
        return row_id

    async def close_open_findings(self, now_unix_s: float) -> int:
        """Close the episodes this aggregator left open when it stopped (a finding that
        still holds opens a new one); returns how many."""
        return await self._write(self._close_open_findings, now_unix_s)

    def _close_open_findings(self, now: float) -> int:
        if self._engine is None:
            return 0
        table = _T["findings"]
        with begin_write(self._engine) as conn:
            result = conn.execute(
                update(table)
                .where(table.c.ended_unix_s.is_(None), table.c.aggregator_id == self.aggregator_id)
                .values(ended_unix_s=now, updated_unix_s=now)
            )
        self._finding_rows.clear()
        return int(result.rowcount or 0)

    def _record_alert(
        self, conn: Connection, alert: Alert, now: float, opened: Mapping[str, int | None]
    ) -> int | None:
        """Insert or update ``alert``'s row and add its event; its row id while open."""
        table = _T["alerts"]
        fingerprint = alert.fingerprint
        row_id = opened[fingerprint] if fingerprint in opened else self._alert_rows.get(fingerprint)
        values: dict[str, Any] = {
            "state": alert.state,
            "value": alert.value,
            "annotations": dict(alert.annotations),
            "updated_unix_s": now,
        }
        if alert.state == "firing":
            values["fired_at_unix_s"] = now
        if alert.state == "resolved":
            values["ends_at_unix_s"] = alert.ends_at_unix_s or now
        if row_id is None:
            result = conn.execute(
                table.insert().values(
                    fingerprint=fingerprint,
                    rule=alert.rule,
                    severity=alert.severity,
                    job=alert.labels.get("job", ""),
                    run_id=alert.labels.get("run") or None,
                    rank=label_rank(alert.labels),
                    labels=dict(alert.labels),
                    starts_at_unix_s=alert.starts_at_unix_s,
                    aggregator_id=self.aggregator_id,
                    **values,
                )
            )
            key = result.inserted_primary_key
            if key is None:
                raise RuntimeError("the database returned no id for a new alert row")
            row_id = int(key[0])
        else:
            conn.execute(update(table).where(table.c.id == row_id).values(**values))
        conn.execute(
            _T["alert_events"]
            .insert()
            .values(alert_id=row_id, state=alert.state, ts_unix_s=now, value=alert.value)
        )
        return None if alert.state == "resolved" else row_id

    def _revise_alert(
        self, conn: Connection, alert: Alert, now: float, opened: Mapping[str, int | None]
    ) -> None:
        """Rewrite the annotations and value of ``alert``'s open row (none: nothing)."""
        fingerprint = alert.fingerprint
        row_id = opened[fingerprint] if fingerprint in opened else self._alert_rows.get(fingerprint)
        if row_id is None:
            return
        table = _T["alerts"]
        conn.execute(
            update(table)
            .where(table.c.id == row_id)
            .values(annotations=dict(alert.annotations), value=alert.value, updated_unix_s=now)
        )

    async def open_alerts(self) -> list[Alert]:
        """The pending and firing alerts this aggregator left, to resume them."""
        return await self._write(self._open_alerts)

    def _open_alerts(self) -> list[Alert]:
        if self._engine is None:
            return []
        table = _T["alerts"]
        alerts = []
        with self._engine.connect() as conn:
            rows = conn.execute(
                select(table).where(
                    table.c.state.in_(["pending", "firing"]),
                    table.c.aggregator_id == self.aggregator_id,
                )
            ).mappings()
            for row in rows:
                self._alert_rows[row["fingerprint"]] = int(row["id"])
                alerts.append(
                    Alert(
                        rule=row["rule"],
                        state=row["state"],
                        severity=row["severity"],
                        labels=dict(row["labels"] or {}),
                        annotations=dict(row["annotations"] or {}),
                        value=row["value"],
                        starts_at_unix_s=row["starts_at_unix_s"],
                    )
                )
        return alerts

    # -- silences and acknowledgements ------------------------------------------------------

    async def add_silence(self, request: SilenceRequest, now_unix_s: float) -> Silence:
        """Store a new silence; the stored one, with its id."""
        return await self._write(self._add_silence, request, now_unix_s)

    def _add_silence(self, request: SilenceRequest, now: float) -> Silence:
        with self.engine.begin() as conn:
            result = conn.execute(
                _T["silences"]
                .insert()
                .values(
                    matchers=dict(request.matchers),
                    starts_at_unix_s=request.starts_at_unix_s,
                    ends_at_unix_s=request.ends_at_unix_s,
                    created_by=request.created_by,
                    comment=request.comment,
                    created_unix_s=now,
                )
            )
            key = result.inserted_primary_key
        if key is None:
            raise RuntimeError("the database returned no id for a new silence")
        return Silence(
            id=int(key[0]),
            matchers=dict(request.matchers),
            starts_at_unix_s=request.starts_at_unix_s,
            ends_at_unix_s=request.ends_at_unix_s,
            created_by=request.created_by,
            comment=request.comment,
        )

    async def expire_silence(self, silence_id: int, now_unix_s: float) -> Row | None:
        """End a silence now (one that already ended keeps its end); its row, or None
        if there is no such silence."""
        return await self._write(self._expire_silence, silence_id, now_unix_s)

    def _expire_silence(self, silence_id: int, now: float) -> Row | None:
        table = _T["silences"]
        with self.engine.begin() as conn:
            conn.execute(
                update(table)
                .where(table.c.id == silence_id, table.c.ends_at_unix_s > now)
                .values(ends_at_unix_s=now)
            )
            row = conn.execute(select(table).where(table.c.id == silence_id)).mappings().first()
        return None if row is None else dict(row)

    async def open_silences(self, now_unix_s: float) -> list[Silence]:
        """The silences that have not ended (active, or starting later)."""
        return await self._write(self._open_silences, now_unix_s)

    def _open_silences(self, now: float) -> list[Silence]:
        if self._engine is None:
            return []
        table = _T["silences"]
        with self._engine.connect() as conn:
            rows = conn.execute(select(table).where(table.c.ends_at_unix_s > now)).mappings()
            return [
                Silence(
                    id=int(row["id"]),
                    matchers=dict(row["matchers"] or {}),
                    starts_at_unix_s=row["starts_at_unix_s"],
                    ends_at_unix_s=row["ends_at_unix_s"],
                    created_by=row["created_by"],
                    comment=row["comment"],
                )
                for row in rows
            ]

    async def acknowledge(
        self, alert_id: int, who: str, comment: str, now_unix_s: float
    ) -> tuple[Literal["ok", "missing", "resolved"], Row | None]:
        """Mark a pending or firing alert acknowledged by ``who``; ("ok", row), or why not
        ("missing": no such alert; "resolved": it is over, with its row). Acknowledging
        again replaces who and when."""
        return await self._write(self._acknowledge, alert_id, who, comment, now_unix_s)

    def _acknowledge(
        self, alert_id: int, who: str, comment: str, now: float
    ) -> tuple[Literal["ok", "missing", "resolved"], Row | None]:
        table = _T["alerts"]
        with self.engine.begin() as conn:
            done = conn.execute(
                update(table)
                .where(table.c.id == alert_id, table.c.state.in_(["pending", "firing"]))
                .values(acknowledged_by=who, acknowledged_unix_s=now, acknowledged_comment=comment)
            )
            row = conn.execute(select(table).where(table.c.id == alert_id)).mappings().first()
        if row is None:
            return "missing", None
        return ("ok" if done.rowcount else "resolved"), dict(row)

    # -- jobs ----------------------------------------------------------------------------

    async def running_jobs(self, since_unix_s: float) -> list[RunningJob]:
        """This aggregator's jobs with a known world size, seen since ``since_unix_s``."""
        return await self._write(self._running_jobs, since_unix_s)

    def _running_jobs(self, since_unix_s: float) -> list[RunningJob]:
        if self._engine is None:
            return []
        table, runs = _T["jobs"], _T["runs"]
        latest_run = (
            select(runs.c.run_id)
            .where(runs.c.job == table.c.job)
            .order_by(runs.c.started_unix_ns.desc())
            .limit(1)
            .scalar_subquery()
        )
        with self._engine.connect() as conn:
            columns = (table.c.job, table.c.world_size, table.c.last_seen_unix_ns, latest_run)
            rows = conn.execute(
                select(*columns).where(
                    table.c.aggregator_id == self.aggregator_id,
                    table.c.world_size.is_not(None),
                    table.c.last_seen_unix_ns >= int(since_unix_s * 1e9),
                )
            ).all()
        return [
            RunningJob(job, int(size), seen_ns / 1e9, run_id or "")
            for job, size, seen_ns, run_id in rows
        ]

    # -- commands ------------------------------------------------------------------------

    async def add_command(
        self, command_id: str, job: str, kind: str, args: Mapping[str, object], now_unix_s: float
    ) -> None:
        """Store a new command as pending (before it can be sent)."""
        await self._write(self._add_command, command_id, job, kind, dict(args), now_unix_s)

    def _add_command(
        self, command_id: str, job: str, kind: str, args: dict[str, object], now: float
    ) -> None:
        if self._engine is None:
            return
        with begin_write(self._engine) as conn:
            conn.execute(
                _T["commands"]
                .insert()
                .values(
                    id=command_id,
                    job=job,
                    run_id=latest_run(conn, job),
                    kind=kind,
                    args=args,
                    status="pending",
                    reason="",
                    created_unix_s=now,
                    updated_unix_s=now,
                    aggregator_id=self.aggregator_id,
                )
            )

    async def set_command_status(
        self, command_id: str, status: str, reason: str, updated_unix_s: float
    ) -> None:
        """Store where a command stands now (expired, ...)."""
        await self._write(self._set_command_status, command_id, status, reason, updated_unix_s)

    def _set_command_status(
        self, command_id: str, status: str, reason: str, updated_unix_s: float
    ) -> None:
        if self._engine is None:
            return
        table = _T["commands"]
        with begin_write(self._engine) as conn:
            conn.execute(
                update(table)
                .where(table.c.id == command_id)
                .values(status=status, reason=reason, updated_unix_s=updated_unix_s)
            )

    # -- tuning --------------------------------------------------------------------------

    async def save_tuning(
        self, session: TuningSessionRow, trials: Sequence[TuningTrialRow]
    ) -> None:
        """Insert or update a tuning session and its trials in one transaction."""
        await self._write(self._save_tuning, session, list(trials))

    def _save_tuning(self, session: TuningSessionRow, trials: list[TuningTrialRow]) -> None:
        if self._engine is None:
            return
        sessions, trials_table = _T["tuning_sessions"], _T["tuning_trials"]
        with begin_write(self._engine) as conn:
            # The run it started in; a resumed session keeps it.
            stored = select(sessions.c.run_id).where(sessions.c.id == session.id)
            run_id = conn.execute(stored).scalar() or latest_run(conn, session.job)
            row = row_values(session) | {"aggregator_id": self.aggregator_id, "run_id": run_id}
            conn.execute(upsert(conn, sessions).values(**row))
            existing = {
                int(r.trial_index): int(r.id)
                for r in conn.execute(
                    select(trials_table.c.id, trials_table.c.trial_index).where(
                        trials_table.c.session_id == session.id
                    )
                )
            }
            for trial in trials:
                values = row_values(trial) | {"run_id": run_id}
                row_id = existing.get(trial.trial_index)
                if row_id is None:
                    conn.execute(trials_table.insert().values(**values))
                else:
                    if values["command_id"] is None:
                        del values["command_id"]  # known before a restart, not after
                    conn.execute(
                        update(trials_table).where(trials_table.c.id == row_id).values(**values)
                    )

    async def unfinished_tuning(self) -> list[TuningSessionRow]:
        """This aggregator's sessions that neither finished nor aborted, oldest first."""
        return await self._write(self._unfinished_tuning)

    def _unfinished_tuning(self) -> list[TuningSessionRow]:
        if self._engine is None:
            return []
        table = _T["tuning_sessions"]
        names = [f.name for f in dataclasses.fields(TuningSessionRow)]
        with self._engine.connect() as conn:
            rows = conn.execute(
                select(*(table.c[n] for n in names))
                .where(
                    table.c.aggregator_id == self.aggregator_id,
                    table.c.state.not_in(["finished", "aborted"]),
                )
                .order_by(table.c.started_unix_s)
            ).mappings()
            return [
                TuningSessionRow(**{n: r[n] for n in names} | {"state_blob": r["state_blob"] or {}})
                for r in rows
            ]

    async def abort_tuning(self, session_id: str, reason: str, now_unix_s: float) -> None:
        """Mark a stored session aborted (one that cannot or must not be resumed)."""
        await self._write(self._abort_tuning, session_id, reason, now_unix_s)

    def _abort_tuning(self, session_id: str, reason: str, now: float) -> None:
        if self._engine is None:
            return
        table = _T["tuning_sessions"]
        with begin_write(self._engine) as conn:
            conn.execute(
                update(table)
                .where(table.c.id == session_id)
                .values(state="aborted", reason=reason, ended_unix_s=now)
            )

    # -- evidence ------------------------------------------------------------------------

    async def add_evidence_capture(self, capture: EvidenceCaptureRow) -> None:
        """Store a new evidence capture; ``alert_id`` None takes the open alert's row of
        ``alert_fingerprint`` where there is one."""
        await self._write(self._add_evidence_capture, capture)

    def _add_evidence_capture(self, capture: EvidenceCaptureRow) -> None:
        if self._engine is None:
            return
        row = row_values(capture)
        if row["alert_id"] is None and capture.alert_fingerprint is not None:
            row["alert_id"] = self._alert_rows.get(capture.alert_fingerprint)
        with begin_write(self._engine) as conn:
            row["run_id"] = latest_run(conn, capture.job)
            conn.execute(
                _T["evidence_captures"].insert().values(aggregator_id=self.aggregator_id, **row)
            )

    async def add_evidence_file(self, file: EvidenceFileRow) -> bool:
        """Store one evidence file's row; False when the capture is unknown here or the
        file was stored before (an agent's resend)."""
        return await self._write(self._add_evidence_file, file)

    def _add_evidence_file(self, file: EvidenceFileRow) -> bool:
        if self._engine is None:
            return False
        captures = _T["evidence_captures"]
        with begin_write(self._engine) as conn:
            known = conn.execute(
                select(captures.c.id).where(captures.c.id == file.capture_id)
            ).first()
            if known is None:
                return False
            result = conn.execute(insert_ignore(conn, _T["evidence_files"]), [row_values(file)])
            return bool(result.rowcount)

    async def evidence_file(self, capture_id: str, rank: int, name: str) -> Row | None:
        """The row of one evidence file, or None."""
        return await self._read(self._evidence_file, capture_id, rank, name)

    def _evidence_file(self, capture_id: str, rank: int, name: str) -> Row | None:
        if self._engine is None:
            return None
        files = _T["evidence_files"]
        query = select(files).where(
            files.c.capture_id == capture_id, files.c.rank == rank, files.c.name == name
        )
        with self._engine.connect() as conn:
            row = conn.execute(query).mappings().first()
        return None if row is None else dict(row)

    async def evidence(
        self, *, job: str | None = None, alert_id: int | None = None, limit: int = 100
    ) -> list[Row]:
        """Evidence captures, newest first, each with its ``files`` (rows); of ``job``,
        or of alert episode ``alert_id`` (asked for while it was open)."""
        return await self._read(self._evidence, job, alert_id, limit)

    def _evidence(self, job: str | None, alert_id: int | None, limit: int) -> list[Row]:
        if self._engine is None:
            return []
        with self._engine.connect() as conn:
            return list_evidence(conn, job=job, alert_id=alert_id, limit=limit)

    async def evidence_bytes(self, capture_id: str | None = None) -> int:
        """Bytes of evidence stored on disk, in all or in one capture."""
        return await self._read(self._evidence_bytes, capture_id)

    def _evidence_bytes(self, capture_id: str | None) -> int:
        if self._engine is None:
            return 0
        files = _T["evidence_files"]
        query = select(func.coalesce(func.sum(files.c.stored_bytes), 0))
        if capture_id is not None:
            query = query.where(files.c.capture_id == capture_id)
        with self._engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    async def prune_evidence(self, before_unix_s: float, max_bytes: int) -> list[Row]:
        """Delete the captures asked for before ``before_unix_s``, then the oldest ones
        until the rest hold at most ``max_bytes`` on disk; returns the rows of the files
        deleted (the caller removes them from disk)."""
        return await self._write(self._prune_evidence, before_unix_s, max_bytes)

    def _prune_evidence(self, before_unix_s: float, max_bytes: int) -> list[Row]:
        if self._engine is None:
            return []
        captures, files = _T["evidence_captures"], _T["evidence_files"]
        sizes = (
            select(
                captures.c.id,
                captures.c.created_unix_s,
                func.coalesce(func.sum(files.c.stored_bytes), 0).label("bytes"),
            )
            .select_from(captures.outerjoin(files, files.c.capture_id == captures.c.id))
            .group_by(captures.c.id, captures.c.created_unix_s)
            .order_by(captures.c.created_unix_s.desc())
        )
        with begin_write(self._engine) as conn:
            kept_bytes = 0
            doomed = []
            for capture_id, created, size in conn.execute(sizes):
                kept_bytes += int(size)
                if created < before_unix_s or kept_bytes > max_bytes:
                    doomed.append(capture_id)
            if not doomed:
                return []
            gone = [
                dict(r)
                for r in conn.execute(
                    select(files).where(files.c.capture_id.in_(doomed))
                ).mappings()
            ]
            conn.execute(delete(files).where(files.c.capture_id.in_(doomed)))
            conn.execute(delete(captures).where(captures.c.id.in_(doomed)))
        return gone

    # -- listings and retention ----------------------------------------------------------

    async def rows(self, listing: Listing, filters: Mapping[str, str], limit: int) -> list[Row]:
        """Up to ``limit`` rows of ``listing`` whose columns equal ``filters``, newest
        first. FilterError names a filter value that does not fit its column."""
        return await self._read(self._rows, _T[listing], dict(filters), limit)

    def _rows(self, table: Table, filters: dict[str, str], limit: int) -> list[Row]:
        if self._engine is None:
            return []
        query = select(table)
        for name, text in filters.items():
            column = table.c[name]
            value: object = text
            if isinstance(column.type, (sa_types.Integer, sa_types.BigInteger)):
                try:
                    value = int(text)
                except ValueError:
                    raise FilterError(f"{name} must be an integer") from None
            query = query.where(column == value)
        query = query.order_by(table.c[LISTING_ORDER[table.name]].desc()).limit(limit)
        with self._engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    async def apply_retention(
        self, now_unix_s: float, *, raw_retention_s: float, rollup_retention_s: float
    ) -> RetentionReport | None:
        """Roll up and delete old rows (``torshmon.history.retention``); None unopened."""
        return await self._write(
            self.apply_retention_now, now_unix_s, raw_retention_s, rollup_retention_s
        )

    def apply_retention_now(
        self, now_unix_s: float, raw_retention_s: float, rollup_retention_s: float
    ) -> RetentionReport | None:
        """``apply_retention`` on the calling thread."""
        if self._engine is None:
            return None
        return apply_retention(
            self._engine,
            now_unix_s=now_unix_s,
            raw_retention_s=raw_retention_s,
            rollup_retention_s=rollup_retention_s,
        )
