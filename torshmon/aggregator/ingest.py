"""Ingest: agent batches in, rows in SQL out, exactly once.

An agent POSTs an ``IngestBatch`` of spool records, each numbered by the agent
(``agent_id``, ``seq``). ``IngestStore.store`` runs in the aggregator's one writer
thread and, in ONE transaction, records the new sequence numbers, upserts the
jobs and probe sessions seen, bulk-inserts the step, collective, bucket, node
and in-flight rows, applies command acknowledgements, and marks the commands
handed back to the agent as sent. Records stored before (a reply that was lost)
are skipped; so are probe batches at or below their session's stored ``last_seq``
(an agent that restarted resends what its probe had not seen acknowledged).
Nothing is cached before the transaction commits, so a failed write leaves no
trace and the agent's retry starts from the same state.

The per-step tables are the hot path (about 10^4 rows a second for a large job):
their rows are plain tuples read from the wire records by the column names of the
models, inserted with the DBAPI cursor's ``executemany`` on SQLite and ``COPY`` on
PostgreSQL, inside the same transaction as everything else. This module builds the
rows and runs the transaction; the statements are ``torshmon.history.store.ingest``.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Final

import msgspec
from sqlalchemy import JSON, Float, Integer
from sqlalchemy.engine import Connection, Engine

from torshmon.aggregator.core.stored import Stored
from torshmon.history.db import WriterConnection
from torshmon.history.models import Base
from torshmon.history.store import ingest as sql
from torshmon.wire import (
    Batch,
    BucketStat,
    CollectiveStat,
    Command,
    DdpStats,
    GpuSample,
    Hello,
    InflightOp,
    IngestBatch,
    NodeSample,
    RankProcess,
    StepRecord,
)

log = logging.getLogger(__name__)

_T = Base.metadata.tables

#: Measurements one collective (count, size, duration, bus bandwidth) and one bucket
#: (size, wire bytes, duration, compression ratio) contribute.
SAMPLES_PER_COLLECTIVE: Final = 4
SAMPLES_PER_BUCKET: Final = 4

#: How many Nones a tuple holds (C-level, for ``map``).
_count_none: Callable[[tuple[Any, ...]], int] = operator.methodcaller("count", None)

#: A table's rows as (column names, value tuples).
TableRows = tuple[tuple[str, ...], list[tuple[Any, ...]]]


class _BulkTable:
    """A bulk-inserted table: columns the caller supplies (job, rank, ...), then the
    model's other columns, read from one ``record`` of the wire by name (``renames``:
    column -> attribute where they differ).

    The column list comes from the model, and the model is the one definition the wire
    record is checked against at import: a context name that is not a column, a column
    the wire record lacks, or a field of the record that is neither a column nor in
    ``elsewhere`` (field -> where it goes instead) fails, naming them. JSON columns are
    written as JSON text (as SQLAlchemy's JSON type writes them).
    """

    __slots__ = (
        "_float_at",
        "_floats",
        "_json_at",
        "_values",
        "columns",
        "name",
        "record_columns",
    )

    def __init__(
        self,
        name: str,
        context: tuple[str, ...],
        record: type[msgspec.Struct] | None,
        renames: Mapping[str, str] | None = None,
        elsewhere: Mapping[str, str] | None = None,
    ) -> None:
        table = _T[name]
        self.name = name
        insertable = [c.name for c in table.columns if c.identity is None]
        record_columns = tuple(c for c in insertable if c not in context)
        self.record_columns = record_columns
        self.columns = (*context, *record_columns)
        renames, elsewhere = renames or {}, elsewhere or {}
        fields = record.__struct_fields__ if record is not None else ()
        lacking = [c for c in record_columns if renames.get(c, c) not in fields]
        unknown = sorted(set(context) - set(insertable))
        stored = {renames.get(c, c) for c in record_columns}
        unplaced = [f for f in fields if f not in stored and f not in elsewhere]
        stale = sorted(f for f in elsewhere if f in stored or f not in fields)
        problems = {
            "unknown context columns": unknown,
            "columns the wire record lacks": lacking,
            "fields of the wire record neither columns nor stored elsewhere": unplaced,
            "fields said to be stored elsewhere that are columns or not fields": stale,
            "context columns named twice": sorted({c for c in context if context.count(c) > 1}),
        }
        if any(problems.values()):
            found = "; ".join(f"{what} {items}" for what, items in problems.items() if items)
            raise RuntimeError(f"ingest rows of {name} do not match its model: {found}")
        self._values = _tuple_getter(
            operator.attrgetter, [renames.get(c, c) for c in record_columns]
        )
        float_at = [i for i, c in enumerate(record_columns) if isinstance(table.c[c].type, Float)]
        self._float_at = frozenset(float_at)
        self._floats = _tuple_getter(operator.itemgetter, float_at)
        self._json_at = frozenset(
            i for i, c in enumerate(record_columns) if isinstance(table.c[c].type, JSON)
        )

    def row(self, context: tuple[Any, ...], record: Any) -> tuple[Any, ...]:
        """``context`` followed by the record's values; non-finite floats become None."""
        return self.rows(context, [self._values(record)])[0]

    def values(self, records: Iterable[Any]) -> list[tuple[Any, ...]]:
        """The records' values, as they are (``rows`` makes them storable)."""
        return list(map(self._values, records))

    def rows(
        self, context: tuple[Any, ...], values: list[tuple[Any, ...]]
    ) -> list[tuple[Any, ...]]:
        """``context`` followed by each of ``values`` (from ``values``); non-finite floats
        become None, JSON values JSON text."""
        # The common case in C-level passes: a finite sum means every float is finite
        # (an infinity or NaN anywhere makes it non-finite; an overflow only costs the
        # slow path, which decides value by value and leaves finite values as they are).
        floats = chain.from_iterable(map(self._floats, values))
        if self._json_at or not math.isfinite(sum(filter(None, floats))):
            float_at, json_at = self._float_at, self._json_at
            values = [
                tuple(
                    _finite(v) if i in float_at else json.dumps(v) if i in json_at else v
                    for i, v in enumerate(row)
                )
                for row in values
            ]
        return list(map(context.__add__, values))


def _tuple_getter(
    kind: Callable[..., Callable[[Any], Any]], keys: list[Any]
) -> Callable[[Any], tuple[Any, ...]]:
    """``kind(*keys)`` (attrgetter, itemgetter), always returning a tuple."""
    if len(keys) > 1:
        getter: Callable[[Any], tuple[Any, ...]] = kind(*keys)
        return getter
    if keys:
        one = kind(keys[0])
        return lambda item: (one(item),)
    return lambda _item: ()


_SEQS = _BulkTable("ingest_seqs", ("agent_id", "seq", "node", "received_unix_ns"), None)
#: A step record's fields that are not columns of ``steps``, and where each goes.
STEP_FIELDS_ELSEWHERE: Final[Mapping[str, str]] = {
    "collectives": "rows of collectives",
    "buckets": "rows of buckets",
    "ddp": "a row of ddp_stats",
    "applied_config": "a row of configs (rank 0's)",
    "config_rejections": "not stored: the rejected command's ack says why (commands)",
    "collective_clock": "not stored: the history does not say which clock timed a step",
}
#: A probe row's context: its job and run (the session's, from its hello), then where.
_STEP_AT: Final = ("job", "run_id", "rank", "step", "end_unix_ns")
_STEPS = _BulkTable(
    "steps", ("job", "run_id", "rank", "node"), StepRecord, elsewhere=STEP_FIELDS_ELSEWHERE
)
_COLLECTIVES = _BulkTable(
    "collectives",
    _STEP_AT,
    CollectiveStat,
    elsewhere={"duration_hist": "not stored: the live duration histogram"},
)
_BUCKETS = _BulkTable("buckets", _STEP_AT, BucketStat, {"bucket_index": "index"})
_DDP = _BulkTable("ddp_stats", _STEP_AT, DdpStats)
_INFLIGHT = _BulkTable("inflight_reports", ("job", "run_id", "rank", "sent_unix_ns"), InflightOp)
_NODES = _BulkTable(
    "node_samples",
    (),
    NodeSample,
    elsewhere={
        "gpus": "rows of gpu_samples",
        "ranks": "rows of rank_samples",
        "interfaces": "not stored: the agent's /metrics (the totals are columns)",
    },
)
_GPUS = _BulkTable(
    "gpu_samples",
    ("node", "ts_unix_ns"),
    GpuSample,
    {"gpu_index": "index"},
    elsewhere={"uuid": "not stored: a label of the agent's /metrics"},
)
_RANK_SAMPLES = _BulkTable(
    "rank_samples",
    ("node", "ts_unix_ns"),
    RankProcess,
    elsewhere={
        "cpu_s_total": "not stored: the agent's /metrics",
        "gpu": "not stored: the live state (which GPUs a job uses)",
    },
)
#: The step's numbers that are not measurements: which step it is, and the settings
#: it ran with.
_STEP_NOT_MEASURED: Final = frozenset({"step", "end_unix_ns", "batch_size", "config_version"})
#: Measurements one step record contributes (the unit of ingest throughput,
#: ``torshmon_ingest_samples_total``): the numeric columns of ``steps`` the record fills,
#: read from the model so that a measurement added there is counted.
STEP_SAMPLE_FIELDS: Final[tuple[str, ...]] = tuple(
    c
    for c in _STEPS.record_columns
    if c not in _STEP_NOT_MEASURED and isinstance(_T["steps"].c[c].type, Float | Integer)
)
#: A step's values (``_STEPS.values``) of ``STEP_SAMPLE_FIELDS``.
_step_samples = _tuple_getter(
    operator.itemgetter, [_STEPS.record_columns.index(f) for f in STEP_SAMPLE_FIELDS]
)
#: Insert order: the seqs first, so a concurrent duplicate fails before the bulk work.
_BULK: Final = (
    _SEQS,
    _STEPS,
    _COLLECTIVES,
    _BUCKETS,
    _DDP,
    _INFLIGHT,
    _NODES,
    _GPUS,
    _RANK_SAMPLES,
)


@dataclass(slots=True)
class _Session:
    """A probe session within one transaction: its highest stored batch seq, whether its
    row exists, the newest batch of it stored now (None: none), and its run (None: its
    probe sent no run id)."""

    last_seq: int
    exists: bool
    batch: Batch | None = None
    run_id: str | None = None


@dataclass(slots=True)
class _Rows:
    """Rows of one transaction: tuples per bulk table, dicts for the other tables."""

    bulk: dict[str, list[tuple[Any, ...]]] = field(
        default_factory=lambda: {t.name: [] for t in _BULK}
    )
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, table: str, row: dict[str, Any]) -> None:
        rows = self.tables.get(table)
        if rows is None:
            rows = self.tables[table] = []
        rows.append(row)


class IngestStore:
    """Writes agent batches to the history database; not thread-safe (one writer).

    It keeps one connection for its transactions (``WriterConnection``); ``close``
    closes it. It runs on the aggregator's writer thread, or alone in the ingest
    process (``torshmon.aggregator.writer``).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        aggregator_id: str,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.engine = engine
        self._writer = WriterConnection(engine)
        self.aggregator_id = aggregator_id
        self._clock_ns = clock_ns
        self._session_seq: dict[str, int] = {}
        self._session_run: dict[str, str | None] = {}
        self._agent_max_seq: dict[str, int] = {}

    def store(self, batch: IngestBatch, handed: Sequence[Command] = ()) -> Stored:
        """Store the records of ``batch`` not stored before; one transaction.

        ``handed`` are the commands going back in the reply to this POST: they are
        marked sent in the same transaction. Raises SQLAlchemy errors from the database
        as they come (the caller maps them to HTTP answers); on an error nothing of
        this batch is stored.
        """
        now_ns = self._clock_ns()
        with self._writer.begin() as conn:
            seen = self._seen_seqs(conn, batch)
            sessions = self._load_sessions(conn, batch)
            rows = _Rows()
            seq_rows = rows.bulk[_SEQS.name]
            stored = Stored(acked_seq=self._agent_max_seq.get(batch.agent_id, 0))
            for i, item in enumerate(batch.records):
                if item.seq in seen:
                    stored.duplicates += 1
                    stored.skipped_records.append(i)
                    continue
                seen.add(item.seq)
                stored.records += 1
                seq_rows.append((batch.agent_id, item.seq, batch.node, now_ns))
                self._flatten(i, item.record.messages, batch.node, sessions, rows, stored)
                for sample in item.record.node_samples:
                    _node_rows(sample, rows)
                    stored.node_samples.append(sample)
            for message in stored.hellos:
                _session_row(message, sessions, rows, now_ns)
            jobs = self._job_rows(stored, now_ns)
            self._write(conn, rows, sessions, jobs, stored, now_ns)
            if batch.records:
                stored.acked_seq = max(stored.acked_seq, max(r.seq for r in batch.records))
            else:
                stored.acked_seq = self._max_seq(conn, batch.agent_id)
            stored.commands = list(handed)
            sql.mark_sent(conn, [c.id for c in stored.commands], now_ns)
        # Only now, with the transaction committed, may the caches move on.
        self._agent_max_seq[batch.agent_id] = stored.acked_seq
        for session, info in sessions.items():
            self._session_seq[session] = info.last_seq
            self._session_run[session] = info.run_id
        return stored

    def close(self) -> None:
        """Close the connection ``store`` keeps (on the writer thread; safe to repeat)."""
        self._writer.close()

    # -- reads ---------------------------------------------------------------------------
    def _seen_seqs(self, conn: Connection, batch: IngestBatch) -> set[int]:
        if not batch.records:
            return set()
        seqs = [r.seq for r in batch.records]
        known = self._agent_max_seq.get(batch.agent_id)
        if known is not None and min(seqs) > known:
            return set()  # the usual case: all new, no query needed
        return sql.stored_seqs(conn, batch.agent_id, min(seqs), max(seqs))

    def _max_seq(self, conn: Connection, agent_id: str) -> int:
        known = self._agent_max_seq.get(agent_id)
        if known is not None:
            return known
        return sql.max_seq(conn, agent_id)

    def _load_sessions(self, conn: Connection, batch: IngestBatch) -> dict[str, _Session]:
        """``last_seq`` (and whether the row exists) of every session in ``batch``."""
        wanted: set[str] = set()
        for item in batch.records:
            for message in item.record.messages:
                wanted.add(message.session)
        out: dict[str, _Session] = {}
        missing = []
        for session in wanted:
            seq = self._session_seq.get(session)
            if seq is None:
                missing.append(session)
            else:
                out[session] = _Session(seq, exists=True, run_id=self._session_run.get(session))
        if missing:
            for name, (last_seq, run_id) in sql.session_seqs(conn, missing).items():
                out[name] = _Session(last_seq, exists=True, run_id=run_id)
        return out

    # -- flattening ----------------------------------------------------------------------
    def _flatten(
        self,
        record_at: int,
        messages: Iterable[Hello | Batch],
        node: str,
        sessions: dict[str, _Session],
        rows: _Rows,
        stored: Stored,
    ) -> None:
        for j, message in enumerate(messages):
            info = sessions.get(message.session)
            if info is None:
                info = sessions[message.session] = _Session(0, exists=False)
            if isinstance(message, Hello):
                stored.hellos.append(message)
                info.run_id = message.run_id or None
                continue
            if message.seq <= info.last_seq:
                stored.duplicates += 1
                stored.skipped_batches.append((record_at, j))
                continue
            info.last_seq = message.seq
            info.batch = message
            stored.batches.append((message, node))
            stored.samples += _batch_rows(message, node, rows, info.run_id)

    def _job_rows(self, stored: Stored, now_ns: int) -> dict[str, dict[str, Any]]:
        jobs: dict[str, dict[str, Any]] = {}
        for hello in stored.hellos:
            jobs[hello.job] = {
                "job": hello.job,
                "world_size": hello.world_size,
                "backend": hello.backend,
            }
        for batch, _node in stored.batches:
            jobs.setdefault(batch.job, {"job": batch.job, "world_size": None, "backend": None})
        for row in jobs.values():
            row["first_seen_unix_ns"] = now_ns
            row["last_seen_unix_ns"] = now_ns
            row["aggregator_id"] = self.aggregator_id
        return jobs

    # -- writes --------------------------------------------------------------------------
    def _write(
        self,
        conn: Connection,
        rows: _Rows,
        sessions: dict[str, _Session],
        jobs: dict[str, dict[str, Any]],
        stored: Stored,
        now_ns: int,
    ) -> None:
        if jobs:
            sql.upsert_jobs(conn, list(jobs.values()))
        # Plain INSERT: a concurrent duplicate must fail the transaction, not vanish.
        sql.bulk_insert(conn, _SEQS.name, _SEQS.columns, rows.bulk[_SEQS.name])
        new_sessions = rows.tables.pop("probe_sessions", [])
        if new_sessions:
            sql.upsert_sessions(conn, new_sessions)
        _write_session_progress(conn, sessions, now_ns)
        configs = rows.tables.pop("configs", None)
        if configs:
            sql.upsert_configs(conn, configs)
        for name, table_rows in rows.tables.items():
            if table_rows:
                sql.insert(conn, name, table_rows)
        for bulk in _BULK[1:]:
            sql.bulk_insert(conn, bulk.name, bulk.columns, rows.bulk[bulk.name])
        for batch, _node in stored.batches:
            stored.command_acks.extend(batch.command_acks)
        if stored.command_acks:
            sql.apply_acks(conn, stored.command_acks, now_ns)


def insert_rows(batch: IngestBatch, now_ns: int) -> dict[str, TableRows]:
    """The rows ``IngestStore.store`` inserts for ``batch`` when none of it was stored
    before, per table; without the upserts and updates of jobs, sessions and commands.

    For benchmarks and checks: the same row builders as ``store``.
    """
    rows = _Rows()
    runs: dict[str, str | None] = {}
    for item in batch.records:
        rows.bulk[_SEQS.name].append((batch.agent_id, item.seq, batch.node, now_ns))
        for message in item.record.messages:
            if isinstance(message, Hello):
                runs[message.session] = message.run_id or None
            else:
                _batch_rows(message, batch.node, rows, runs.get(message.session))
        for sample in item.record.node_samples:
            _node_rows(sample, rows)
    out: dict[str, TableRows] = {}
    for bulk in _BULK:
        if rows.bulk[bulk.name]:
            out[bulk.name] = (bulk.columns, rows.bulk[bulk.name])
    for name, dicts in rows.tables.items():
        if dicts:
            columns = tuple(dicts[0])
            out[name] = (columns, [tuple(d[c] for c in columns) for d in dicts])
    return out


def _session_row(hello: Hello, sessions: dict[str, _Session], rows: _Rows, now_ns: int) -> None:
    info = sessions[hello.session]
    rows.add(
        "probe_sessions",
        {
            "session": hello.session,
            "job": hello.job,
            "rank": hello.rank,
            "local_rank": hello.local_rank,
            "world_size": hello.world_size,
            "node": hello.node,
            "pid": hello.pid,
            "backend": hello.backend,
            "torch_version": hello.torch_version,
            "probe_version": hello.probe_version,
            "started_unix_ns": now_ns,
            "last_seen_unix_ns": now_ns,
            "last_seq": info.last_seq,
            "dropped_records_total": 0,
            "run_id": hello.run_id or None,
            "attached_unix_ns": hello.attached_unix_ns or None,
        },
    )
    info.exists = True


def _write_session_progress(conn: Connection, sessions: dict[str, _Session], now_ns: int) -> None:
    """Advance ``last_seq`` of sessions that got batches (one executemany); create rows
    for sessions whose hello this aggregator never saw (stored before a restart of the
    agent)."""
    missing: list[dict[str, Any]] = []
    progress: list[dict[str, Any]] = []
    for session, info in sessions.items():
        batch = info.batch
        if batch is None:
            continue
        if not info.exists:
            missing.append(
                {
                    "session": session,
                    "job": batch.job,
                    "rank": batch.rank,
                    "local_rank": None,
                    "world_size": None,
                    "node": None,
                    "pid": None,
                    "backend": None,
                    "torch_version": None,
                    "probe_version": None,
                    "started_unix_ns": now_ns,
                    "last_seen_unix_ns": now_ns,
                    "last_seq": batch.seq,
                    "dropped_records_total": batch.dropped_records_total,
                }
            )
            info.exists = True
        progress.append(
            {
                "b_session": session,
                "b_last_seq": info.last_seq,
                "b_now": now_ns,
                "b_dropped": batch.dropped_records_total,
                "b_closed": batch.closing.end_unix_ns if batch.closing is not None else None,
            }
        )
    if missing:
        sql.add_missing_sessions(conn, missing)
    if progress:
        sql.advance_sessions(conn, progress)


def _finite(value: float | None) -> float | None:
    """SQL has no portable NaN: store a non-finite measurement as NULL."""
    if value is None or math.isfinite(value):
        return value
    return None


def _batch_rows(batch: Batch, node: str, rows: _Rows, run_id: str | None = None) -> int:
    """Rows of one probe batch of run ``run_id``; returns the number of measurements
    (samples) stored."""
    job, rank = batch.job, batch.rank
    bulk = rows.bulk
    steps = batch.steps
    values = _STEPS.values(steps)
    # Samples are the wire values present (a non-finite one counts, stored as NULL).
    samples = len(values) * len(STEP_SAMPLE_FIELDS) - sum(
        map(_count_none, map(_step_samples, values))
    )
    bulk["steps"].extend(_STEPS.rows((job, run_id, rank, node), values))
    for step in steps:
        if step.collectives or step.buckets:
            at = (job, run_id, rank, step.step, step.end_unix_ns)
            if step.collectives:
                bulk["collectives"].extend(
                    _COLLECTIVES.rows(at, _COLLECTIVES.values(step.collectives))
                )
                samples += SAMPLES_PER_COLLECTIVE * len(step.collectives)
            if step.buckets:
                bulk["buckets"].extend(_BUCKETS.rows(at, _BUCKETS.values(step.buckets)))
                samples += SAMPLES_PER_BUCKET * len(step.buckets)
        if step.ddp is not None:
            at = (job, run_id, rank, step.step, step.end_unix_ns)
            bulk["ddp_stats"].append(_DDP.row(at, step.ddp))
        applied = step.applied_config
        if applied is not None and rank == 0:
            rows.add(
                "configs",
                {
                    "job": job,
                    "run_id": run_id or "",
                    "version": applied.version,
                    "bucket_cap_bytes": applied.bucket_cap_bytes,
                    "first_bucket_cap_bytes": applied.first_bucket_cap_bytes,
                    "codec": applied.codec,
                    "codec_params": dict(applied.codec_params),
                    "effective_step": applied.effective_step,
                    "applied_unix_ns": step.end_unix_ns,
                },
            )
    closing = batch.closing
    if closing is not None and closing.collectives:
        # Run after the rank's last step: filed under the step that never ended.
        at = (job, run_id, rank, closing.step, closing.end_unix_ns)
        bulk["collectives"].extend(_COLLECTIVES.rows(at, _COLLECTIVES.values(closing.collectives)))
        samples += SAMPLES_PER_COLLECTIVE * len(closing.collectives)
    if batch.inflight:
        bulk["inflight_reports"].extend(
            _INFLIGHT.rows(
                (job, run_id, rank, batch.sent_unix_ns), _INFLIGHT.values(batch.inflight)
            )
        )
    return samples


def _node_rows(sample: NodeSample, rows: _Rows) -> None:
    bulk = rows.bulk
    bulk["node_samples"].append(_NODES.row((), sample))
    at = (sample.node, sample.ts_unix_ns)
    bulk["gpu_samples"].extend(_GPUS.rows(at, _GPUS.values(sample.gpus)))
    bulk["rank_samples"].extend(_RANK_SAMPLES.rows(at, _RANK_SAMPLES.values(sample.ranks)))
