"""Jobs, their runs (launches) and their processes (probe sessions)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Index,
    Integer,
    String,
)
from sqlalchemy.orm import Mapped, mapped_column

from torshmon.history.models._base import (
    Base,
    _table,
)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = _table("One row per training job seen by any aggregator.")

    job: Mapped[str] = mapped_column(String(200), primary_key=True, comment="Job name.")
    world_size: Mapped[int | None] = mapped_column(
        Integer, comment="Number of ranks (NULL until a probe hello is seen)."
    )
    backend: Mapped[str | None] = mapped_column(
        String(64), comment="torch.distributed backend (gloo, nccl)."
    )
    first_seen_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="First data from the job, Unix time in nanoseconds."
    )
    last_seen_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="Latest data from the job, Unix time in nanoseconds."
    )
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that owns the job."
    )


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = _table(
        "One row per launch of a job: the rows that carry its run_id belong to it (steps, "
        "collectives, alerts, findings, ...), and the job's samples from its start to the "
        "next run's start."
    )

    job: Mapped[str] = mapped_column(String(200), primary_key=True, comment="Job name.")
    run_id: Mapped[str] = mapped_column(
        String(64),
        primary_key=True,
        comment="The launch's id, the same on every rank (torchrun's run id, "
        "$TORSHMON_RUN_ID, or one made at attach; 'legacy-N' for runs found by migration).",
    )
    started_unix_ns: Mapped[int] = mapped_column(
        BigInteger,
        comment="When its first rank attached (the probe's clock), Unix time in nanoseconds.",
    )
    world_size: Mapped[int | None] = mapped_column(Integer, comment="Number of ranks.")


class ProbeSession(Base):
    __tablename__ = "probe_sessions"
    __table_args__ = _table(
        "One row per probe attach (one training process of one rank).",
        Index(None, "job", "rank"),
    )

    session: Mapped[str] = mapped_column(
        String(64), primary_key=True, comment="Random id the probe picks at attach."
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    rank: Mapped[int] = mapped_column(Integer, comment="Global rank.")
    local_rank: Mapped[int | None] = mapped_column(Integer, comment="Rank within its node.")
    world_size: Mapped[int | None] = mapped_column(Integer, comment="Number of ranks.")
    node: Mapped[str | None] = mapped_column(String(200), comment="Host name of the node.")
    pid: Mapped[int | None] = mapped_column(BigInteger, comment="Process id on the node.")
    backend: Mapped[str | None] = mapped_column(
        String(64), comment="torch.distributed backend (gloo, nccl)."
    )
    torch_version: Mapped[str | None] = mapped_column(String(64), comment="torch.__version__.")
    probe_version: Mapped[str | None] = mapped_column(String(64), comment="torshmon version.")
    started_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="When the session was first stored, Unix time in nanoseconds."
    )
    last_seen_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="Latest batch from the session, Unix time in nanoseconds."
    )
    last_seq: Mapped[int] = mapped_column(
        BigInteger,
        comment="Highest probe batch seq stored; later batches at or below it are duplicates.",
    )
    dropped_records_total: Mapped[int] = mapped_column(
        BigInteger, comment="Step records the probe dropped since attach (count)."
    )
    closed_unix_ns: Mapped[int | None] = mapped_column(
        BigInteger,
        comment="When the probe said its monitoring ended (close() or process exit), Unix "
        "time in nanoseconds; NULL while it runs, or if it ended without a word.",
    )
    run_id: Mapped[str | None] = mapped_column(
        String(64),
        comment="The run (launch) of the job this process belongs to; NULL from probes "
        "before runs.",
    )
    attached_unix_ns: Mapped[int | None] = mapped_column(
        BigInteger,
        comment="When the probe attached (its clock), Unix time in nanoseconds; NULL from "
        "probes before runs.",
    )


class IngestSeq(Base):
    __tablename__ = "ingest_seqs"
    __table_args__ = _table("Agent spool records already stored: makes agent batches idempotent.")

    agent_id: Mapped[str] = mapped_column(
        String(128), primary_key=True, comment="Id of the forwarding agent."
    )
    seq: Mapped[int] = mapped_column(
        BigInteger,
        primary_key=True,
        autoincrement=False,
        comment="The agent's sequence number of the spool record.",
    )
    node: Mapped[str] = mapped_column(String(200), comment="Node of the agent.")
    received_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="When the aggregator stored it, Unix time in nanoseconds."
    )
