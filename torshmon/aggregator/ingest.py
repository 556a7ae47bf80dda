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
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Table, and_, select, update
from sqlalchemy.engine import Connection, Engine

from torshmon.aggregator.commands import CommandBook
from torshmon.history.db import begin_write, insert_ignore, upsert
from torshmon.history.models import Base
from torshmon.wire import (
    Batch,
    Command,
    CommandAck,
    Hello,
    IngestBatch,
    NodeSample,
    StepRecord,
)

log = logging.getLogger(__name__)

_T = Base.metadata.tables

#: Numeric measurements one step record contributes (the unit of ingest throughput).
STEP_SAMPLE_FIELDS: tuple[str, ...] = (
    "duration_s",
    "comm_wait_s",
    "compute_s",
    "communication_time_ratio",
    "comm_busy_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "samples_per_s",
    "loss",
)


@dataclass(slots=True)
class Stored:
    """What one ``store`` call took in: the new data for the live state, in order."""

    acked_seq: int
    hellos: list[Hello] = field(default_factory=list)
    batches: list[tuple[Batch, str]] = field(default_factory=list)  # (batch, node)
    node_samples: list[NodeSample] = field(default_factory=list)
    command_acks: list[CommandAck] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    duplicates: int = 0
    samples: int = 0


@dataclass(slots=True)
class _Rows:
    """Rows of one transaction, per table, ready for executemany."""

    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, table: str, row: dict[str, Any]) -> None:
        rows = self.tables.get(table)
        if rows is None:
            rows = self.tables[table] = []
        rows.append(row)


class IngestStore:
    """Writes agent batches to the history database; not thread-safe (one writer thread).

    Pending commands of the jobs whose rank 0 the posting agent serves go back in
    the reply; they are marked ``sent`` in the same transaction that stores the
    batch, and in the command book once it commits.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        aggregator_id: str,
        commands: CommandBook | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.engine = engine
        self.aggregator_id = aggregator_id
        self._commands = commands
        self._clock_ns = clock_ns
        self._session_seq: dict[str, int] = {}
        self._agent_max_seq: dict[str, int] = {}
        self._known_jobs: set[str] = set()
        #: job -> the agent that last delivered its rank 0's batches (commands go there)
        self.rank0_agent: dict[str, str] = {}

    def store(self, batch: IngestBatch) -> Stored:
        """Store the records of ``batch`` not stored before; one transaction.

        Raises SQLAlchemy errors from the database as they come (the caller maps
        them to HTTP answers); on an error nothing of this batch is stored.
        """
        now_ns = self._clock_ns()
        with begin_write(self.engine) as conn:
            seen = self._seen_seqs(conn, batch)
            sessions = self._load_sessions(conn, batch)
            rows = _Rows()
            stored = Stored(acked_seq=self._agent_max_seq.get(batch.agent_id, 0))
            for item in batch.records:
                if item.seq in seen:
                    stored.duplicates += 1
                    continue
                seen.add(item.seq)
                rows.add(
                    "ingest_seqs",
                    {
                        "agent_id": batch.agent_id,
                        "seq": item.seq,
                        "node": batch.node,
                        "received_unix_ns": now_ns,
                    },
                )
                self._flatten(item.record.messages, batch.node, sessions, rows, stored, now_ns)
                for sample in item.record.node_samples:
                    _node_rows(sample, rows)
                    stored.node_samples.append(sample)
                stored.command_acks.extend(item.record.command_acks)
            for message in stored.hellos:
                _session_row(message, sessions, rows, now_ns)
            jobs = self._job_rows(stored, now_ns)
            self._write(conn, rows, sessions, jobs, stored, now_ns)
            if batch.records:
                stored.acked_seq = max(stored.acked_seq, max(r.seq for r in batch.records))
            else:
                stored.acked_seq = self._max_seq(conn, batch.agent_id)
            for hello in stored.hellos:
                if hello.rank == 0:
                    self.rank0_agent[hello.job] = batch.agent_id
            for probe_batch, _node in stored.batches:
                if probe_batch.rank == 0:
                    self.rank0_agent[probe_batch.job] = batch.agent_id
            if self._commands is not None:
                jobs_served = {j for j, a in self.rank0_agent.items() if a == batch.agent_id}
                if jobs_served:
                    stored.commands = self._commands.pending(jobs_served)
                    _mark_sent(conn, stored.commands, now_ns)
        # Only now, with the transaction committed, may the caches move on.
        self._agent_max_seq[batch.agent_id] = stored.acked_seq
        for session, info in sessions.items():
            self._session_seq[session] = info["last_seq"]
        self._known_jobs.update(jobs)
        if self._commands is not None:
            if stored.commands:
                self._commands.sent([c.id for c in stored.commands])
            for ack in stored.command_acks:
                self._commands.acked(ack)
        return stored

    # -- reads ---------------------------------------------------------------------------
    def _seen_seqs(self, conn: Connection, batch: IngestBatch) -> set[int]:
        if not batch.records:
            return set()
        seqs = [r.seq for r in batch.records]
        known = self._agent_max_seq.get(batch.agent_id)
        if known is not None and min(seqs) > known:
            return set()  # the usual case: all new, no query needed
        table = _T["ingest_seqs"]
        rows = conn.execute(
            select(table.c.seq).where(
                and_(
                    table.c.agent_id == batch.agent_id,
                    table.c.seq >= min(seqs),
                    table.c.seq <= max(seqs),
                )
            )
        )
        return {int(r[0]) for r in rows}

    def _max_seq(self, conn: Connection, agent_id: str) -> int:
        known = self._agent_max_seq.get(agent_id)
        if known is not None:
            return known
        table = _T["ingest_seqs"]
        from sqlalchemy import func

        value = conn.execute(
            select(func.max(table.c.seq)).where(table.c.agent_id == agent_id)
        ).scalar()
        return int(value or 0)

    def _load_sessions(self, conn: Connection, batch: IngestBatch) -> dict[str, dict[str, Any]]:
        """``last_seq`` (and whether the row exists) of every session in ``batch``."""
        wanted: set[str] = set()
        for item in batch.records:
            for message in item.record.messages:
                wanted.add(message.session)
        out: dict[str, dict[str, Any]] = {}
        missing = []
        for session in wanted:
            seq = self._session_seq.get(session)
            if seq is None:
                missing.append(session)
            else:
                out[session] = {"last_seq": seq, "exists": True, "dirty": False}
        if missing:
            table = _T["probe_sessions"]
            for name, last_seq in conn.execute(
                select(table.c.session, table.c.last_seq).where(table.c.session.in_(missing))
            ):
                out[name] = {"last_seq": int(last_seq), "exists": True, "dirty": False}
        return out

    # -- flattening ----------------------------------------------------------------------
    def _flatten(
        self,
        messages: Iterable[Hello | Batch],
        node: str,
        sessions: dict[str, dict[str, Any]],
        rows: _Rows,
        stored: Stored,
        now_ns: int,
    ) -> None:
        for message in messages:
            if isinstance(message, Hello):
                stored.hellos.append(message)
                info = sessions.setdefault(
                    message.session, {"last_seq": 0, "exists": False, "dirty": True}
                )
                info["hello"] = message
                continue
            info = sessions.setdefault(
                message.session, {"last_seq": 0, "exists": False, "dirty": True}
            )
            if message.seq <= info["last_seq"]:
                stored.duplicates += 1
                continue
            info["last_seq"] = message.seq
            info["dirty"] = True
            info["batch"] = message
            info["last_seen_unix_ns"] = now_ns
            stored.batches.append((message, node))
            stored.samples += _batch_rows(message, node, rows)

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
        sessions: dict[str, dict[str, Any]],
        jobs: dict[str, dict[str, Any]],
        stored: Stored,
        now_ns: int,
    ) -> None:
        if jobs:
            _write_jobs(conn, list(jobs.values()))
        seqs = rows.tables.pop("ingest_seqs", None)
        if seqs:
            # Plain INSERT: a concurrent duplicate must fail the transaction, not vanish.
            conn.execute(_T["ingest_seqs"].insert(), seqs)
        new_sessions = rows.tables.pop("probe_sessions", [])
        if new_sessions:
            conn.execute(
                upsert(
                    conn,
                    _T["probe_sessions"],
                    index_elements=["session"],
                    update_columns=[
                        "job",
                        "rank",
                        "local_rank",
                        "world_size",
                        "node",
                        "pid",
                        "backend",
                        "torch_version",
                        "probe_version",
                        "last_seen_unix_ns",
                    ],
                ),
                new_sessions,
            )
        _write_session_progress(conn, sessions, stored, now_ns)
        for name, table_rows in rows.tables.items():
            if table_rows:
                conn.execute(_T[name].insert(), table_rows)
        if stored.command_acks:
            _apply_acks(conn, stored.command_acks, now_ns)
        for batch, _node in stored.batches:
            for ack in batch.command_acks:
                stored.command_acks.append(ack)
            if batch.command_acks:
                _apply_acks(conn, batch.command_acks, now_ns)


def _write_jobs(conn: Connection, rows: list[dict[str, Any]]) -> None:
    table: Table = _T["jobs"]
    conn.execute(insert_ignore(conn, table), rows)
    for row in rows:
        values: dict[str, Any] = {"last_seen_unix_ns": row["last_seen_unix_ns"]}
        if row["world_size"] is not None:
            values["world_size"] = row["world_size"]
            values["backend"] = row["backend"]
        conn.execute(update(table).where(table.c.job == row["job"]).values(**values))


def _session_row(
    hello: Hello, sessions: dict[str, dict[str, Any]], rows: _Rows, now_ns: int
) -> None:
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
            "last_seq": info["last_seq"],
            "dropped_records_total": 0,
        },
    )
    info["exists"] = True


def _write_session_progress(
    conn: Connection, sessions: dict[str, dict[str, Any]], stored: Stored, now_ns: int
) -> None:
    """Advance ``last_seq`` of sessions that got batches; create rows for sessions whose
    hello this aggregator never saw (it was stored before a restart of the agent)."""
    table = _T["probe_sessions"]
    for session, info in sessions.items():
        batch: Batch | None = info.get("batch")
        if batch is None:
            continue
        if not info["exists"]:
            conn.execute(
                insert_ignore(conn, table),
                [
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
                ],
            )
            info["exists"] = True
        conn.execute(
            update(table)
            .where(table.c.session == session)
            .values(
                last_seq=info["last_seq"],
                last_seen_unix_ns=now_ns,
                dropped_records_total=batch.dropped_records_total,
            )
        )


def _apply_acks(conn: Connection, acks: Iterable[CommandAck], now_ns: int) -> None:
    table = _T["commands"]
    for ack in acks:
        conn.execute(
            update(table)
            .where(table.c.id == ack.id)
            .values(
                status=ack.status,
                reason=ack.reason,
                version=ack.version,
                effective_step=ack.effective_step,
                updated_unix_s=now_ns / 1e9,
            )
        )


def _mark_sent(conn: Connection, commands: list[Command], now_ns: int) -> None:
    if not commands:
        return
    table = _T["commands"]
    conn.execute(
        update(table)
        .where(table.c.id.in_([c.id for c in commands]))
        .where(table.c.status == "pending")
        .values(status="sent", updated_unix_s=now_ns / 1e9)
    )


def _finite(value: float | None) -> float | None:
    """SQL has no portable NaN: store a non-finite measurement as NULL."""
    if value is None or math.isfinite(value):
        return value
    return None


def _batch_rows(batch: Batch, node: str, rows: _Rows) -> int:
    """Rows of one probe batch; returns the number of measurements (samples) stored."""
    job, rank = batch.job, batch.rank
    samples = 0
    for step in batch.steps:
        rows.add("steps", _step_row(job, rank, node, step))
        samples += sum(1 for name in STEP_SAMPLE_FIELDS if getattr(step, name) is not None)
        for c in step.collectives:
            rows.add(
                "collectives",
                {
                    "job": job,
                    "rank": rank,
                    "step": step.step,
                    "end_unix_ns": step.end_unix_ns,
                    "op": c.op,
                    "pg": c.pg,
                    "dtype": c.dtype,
                    "count": c.count,
                    "size_bytes": c.size_bytes,
                    "duration_s": _finite(c.duration_s),
                    "max_duration_s": _finite(c.max_duration_s),
                    "algbw_bytes_per_s": _finite(c.algbw_bytes_per_s),
                    "busbw_bytes_per_s": _finite(c.busbw_bytes_per_s),
                },
            )
            samples += 4
        for b in step.buckets:
            rows.add(
                "buckets",
                {
                    "job": job,
                    "rank": rank,
                    "step": step.step,
                    "end_unix_ns": step.end_unix_ns,
                    "bucket_index": b.index,
                    "codec": b.codec,
                    "size_bytes": b.size_bytes,
                    "parameters": b.parameters,
                    "wire_bytes": b.wire_bytes,
                    "compression_ratio": _finite(b.compression_ratio),
                    "duration_s": _finite(b.duration_s),
                    "encode_s": _finite(b.encode_s),
                    "decode_s": _finite(b.decode_s),
                    "relative_error": _finite(b.relative_error),
                },
            )
            samples += 4
        if step.ddp is not None:
            d = step.ddp
            rows.add(
                "ddp_stats",
                {
                    "job": job,
                    "rank": rank,
                    "step": step.step,
                    "end_unix_ns": step.end_unix_ns,
                    "bucket_cap_bytes": d.bucket_cap_bytes,
                    "bucket_sizes_bytes": list(d.bucket_sizes_bytes),
                    "num_buckets_reduced": d.num_buckets_reduced,
                    "avg_forward_compute_s": _finite(d.avg_forward_compute_s),
                    "avg_backward_compute_s": _finite(d.avg_backward_compute_s),
                    "avg_backward_comm_s": _finite(d.avg_backward_comm_s),
                    "avg_backward_compute_comm_overlap_s": _finite(
                        d.avg_backward_compute_comm_overlap_s
                    ),
                },
            )
        applied = step.applied_config
        if applied is not None and rank == 0:
            rows.add(
                "configs",
                {
                    "job": job,
                    "version": applied.version,
                    "bucket_cap_bytes": applied.bucket_cap_bytes,
                    "first_bucket_cap_bytes": applied.first_bucket_cap_bytes,
                    "codec": applied.codec,
                    "codec_params": dict(applied.codec_params),
                    "effective_step": applied.effective_step,
                    "applied_unix_ns": step.end_unix_ns,
                },
            )
    for op in batch.inflight:
        rows.add(
            "inflight_reports",
            {
                "job": job,
                "rank": rank,
                "sent_unix_ns": batch.sent_unix_ns,
                "pg": op.pg,
                "seq": op.seq,
                "op": op.op,
                "size_bytes": op.size_bytes,
                "start_unix_ns": op.start_unix_ns,
                "age_s": _finite(op.age_s),
                "peer": op.peer,
            },
        )
    return samples


def _step_row(job: str, rank: int, node: str, s: StepRecord) -> dict[str, Any]:
    return {
        "job": job,
        "rank": rank,
        "node": node,
        "step": s.step,
        "end_unix_ns": s.end_unix_ns,
        "duration_s": _finite(s.duration_s),
        "comm_wait_s": _finite(s.comm_wait_s),
        "compute_s": _finite(s.compute_s),
        "communication_time_ratio": _finite(s.communication_time_ratio),
        "comm_busy_s": _finite(s.comm_busy_s),
        "forward_s": _finite(s.forward_s),
        "backward_s": _finite(s.backward_s),
        "optimizer_s": _finite(s.optimizer_s),
        "batch_size": s.batch_size,
        "samples_per_s": _finite(s.samples_per_s),
        "loss": _finite(s.loss),
        "loss_nonfinite": s.loss_nonfinite,
        "config_version": s.config_version,
    }


def _node_rows(sample: NodeSample, rows: _Rows) -> None:
    rows.add(
        "node_samples",
        {
            "node": sample.node,
            "ts_unix_ns": sample.ts_unix_ns,
            "cpu_utilization_ratio": _finite(sample.cpu_utilization_ratio),
            "memory_utilization_ratio": _finite(sample.memory_utilization_ratio),
            "memory_used_bytes": sample.memory_used_bytes,
            "io_wait_ratio": _finite(sample.io_wait_ratio),
            "net_rx_bytes_total": sample.net_rx_bytes_total,
            "net_tx_bytes_total": sample.net_tx_bytes_total,
            "disk_read_bytes_total": sample.disk_read_bytes_total,
            "disk_write_bytes_total": sample.disk_write_bytes_total,
        },
    )
    for gpu in sample.gpus:
        rows.add(
            "gpu_samples",
            {
                "node": sample.node,
                "ts_unix_ns": sample.ts_unix_ns,
                "gpu_index": gpu.index,
                "utilization_ratio": _finite(gpu.utilization_ratio),
                "memory_used_bytes": gpu.memory_used_bytes,
                "memory_total_bytes": gpu.memory_total_bytes,
            },
        )
    for proc in sample.ranks:
        rows.add(
            "rank_samples",
            {
                "node": sample.node,
                "ts_unix_ns": sample.ts_unix_ns,
                "job": proc.job,
                "rank": proc.rank,
                "pid": proc.pid,
                "rss_bytes": proc.rss_bytes,
            },
        )
