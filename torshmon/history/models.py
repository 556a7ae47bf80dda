"""The history schema: SQLAlchemy models, the one definition of every table.

Alembic migrations, the table documentation (``docs/tables.md``) and the ingest's
bulk inserts all derive from these models. Column names are a contract with the
ingest (``insert(Step.__table__)`` with dicts keyed by column name). Times are Unix
nanoseconds (``*_unix_ns``, integers) where they come from the probe or agent, and
Unix seconds (``*_unix_s``, floats) where the aggregator makes them. A measurement
that was not finite (NaN, inf) is stored as NULL, since SQL has no portable NaN.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, get_args

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from torshmon.aggregator.core.alert import AlertState
from torshmon.aggregator.core.findings import FindingKind

#: Surrogate key type: SQLite's INTEGER PRIMARY KEY is its rowid (fast); PostgreSQL bigint.
ID_TYPE: Final = BigInteger().with_variant(Integer, "sqlite")

COMMAND_STATUSES: Final[tuple[str, ...]] = (
    "pending",
    "sent",
    "accepted",
    "rejected",
    "applied",
    "expired",
)
ALERT_STATES: Final[tuple[str, ...]] = get_args(AlertState)
FINDING_KINDS: Final[tuple[str, ...]] = get_args(FindingKind)

# Named constraints and indexes make migrations reproducible across backends.
NAMING_CONVENTION: Final[dict[str, str]] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _one_of(column: str, values: tuple[str, ...]) -> CheckConstraint:
    allowed = ", ".join(f"'{v}'" for v in values)
    return CheckConstraint(f"{column} IN ({allowed})", name=column)


def _table(comment: str, *items: Any) -> tuple[Any, ...]:
    return (*items, {"comment": comment})


def _surrogate_id() -> Mapped[int]:
    # Identity: PostgreSQL gets a bigint identity column; SQLite ignores it (rowid alias).
    return mapped_column(ID_TYPE, Identity(), primary_key=True, comment="Surrogate key.")


class Base(DeclarativeBase):
    """Declarative base of every history table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


# -- jobs and their processes -------------------------------------------------------------


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
        "One row per launch of a job: the rows of the job from its start to the next "
        "run's start belong to it (steps, collectives, alerts, findings, samples)."
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


# -- per-step measurements from the probe ---------------------------------------------------


class Step(Base):
    __tablename__ = "steps"
    __table_args__ = _table(
        "One training step of one rank.",
        Index(None, "job", "end_unix_ns"),
        Index(None, "job", "rank", "step"),
    )

    id: Mapped[int] = _surrogate_id()
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    rank: Mapped[int] = mapped_column(Integer, comment="Global rank.")
    node: Mapped[str] = mapped_column(String(200), comment="Node the rank runs on.")
    step: Mapped[int] = mapped_column(
        BigInteger, comment="Step number, from 1 (the probe counts a step when it ends)."
    )
    end_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="End of the step, Unix time in nanoseconds."
    )
    duration_s: Mapped[float | None] = mapped_column(Float, comment="Step wall time, seconds.")
    comm_wait_s: Mapped[float | None] = mapped_column(
        Float, comment="Communication the step waited for (not overlapped), seconds."
    )
    compute_s: Mapped[float | None] = mapped_column(
        Float, comment="duration_s minus comm_wait_s, seconds."
    )
    communication_time_ratio: Mapped[float | None] = mapped_column(
        Float, comment="comm_wait_s / duration_s, ratio 0..1."
    )
    comm_busy_s: Mapped[float | None] = mapped_column(
        Float, comment="Total time collectives ran, overlapped or not, seconds."
    )
    forward_s: Mapped[float | None] = mapped_column(Float, comment="Forward pass, seconds.")
    backward_s: Mapped[float | None] = mapped_column(Float, comment="Backward pass, seconds.")
    optimizer_s: Mapped[float | None] = mapped_column(Float, comment="Optimizer step, seconds.")
    input_wait_s: Mapped[float | None] = mapped_column(
        Float,
        comment="Input wait before the step (the previous step's end to this one's start, "
        "less eval_s and between_steps_comm_s: the data loader), seconds; NULL where the "
        "probe did not measure it.",
    )
    batch_size: Mapped[int | None] = mapped_column(
        BigInteger, comment="Samples in this rank's batch (count)."
    )
    samples_per_s: Mapped[float | None] = mapped_column(
        Float, comment="This rank's throughput, samples per second."
    )
    loss: Mapped[float | None] = mapped_column(
        Float, comment="Training loss (NULL if not reported or not finite)."
    )
    loss_nonfinite: Mapped[bool] = mapped_column(
        Boolean, comment="True if the loss was NaN or infinite."
    )
    config_version: Mapped[int] = mapped_column(
        BigInteger, comment="Communication config version the step ran with."
    )
    gpu_memory_allocated_bytes: Mapped[int | None] = mapped_column(
        BigInteger, comment="CUDA memory allocated at the step's end, bytes (NULL off CUDA)."
    )
    gpu_memory_reserved_bytes: Mapped[int | None] = mapped_column(
        BigInteger, comment="CUDA memory reserved by the caching allocator, bytes."
    )
    gpu_memory_peak_bytes: Mapped[int | None] = mapped_column(
        BigInteger, comment="Peak CUDA memory allocated since start or the job's reset, bytes."
    )
    cpu_wait_s: Mapped[float | None] = mapped_column(
        Float,
        comment="Time the training thread was ready to run but waited for a CPU during "
        "the step's compute (its run-queue delay, /proc/thread-self/schedstat, outside "
        "its communication waits), seconds; NULL where the kernel does not report it "
        "or the job attached with cpu_wait=False.",
    )
    process_cpu_wait_s: Mapped[float | None] = mapped_column(
        Float,
        comment="Time all the rank's threads together were ready to run but waited for a "
        "CPU during the step (run-queue delay summed over its threads, communication "
        "threads included), seconds; NULL where the kernel does not report it or the job "
        "attached with cpu_wait=False.",
    )
    eval_s: Mapped[float | None] = mapped_column(
        Float,
        comment="Evaluation before the step: forward passes of the job's model outside any "
        "step since the previous step's end (first start to last end), seconds; NULL for "
        "a job's first step and from probes that do not split that time.",
    )
    between_steps_comm_s: Mapped[float | None] = mapped_column(
        Float,
        comment="Collectives before the step, since the previous step's end and outside its "
        "evaluation (a trainer's logging gathers), seconds; NULL as eval_s.",
    )


class Collective(Base):
    __tablename__ = "collectives"
    __table_args__ = _table(
        "Collectives of one (op, process group, dtype) within one step of one rank.",
        Index(None, "job", "end_unix_ns"),
    )

    id: Mapped[int] = _surrogate_id()
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    rank: Mapped[int] = mapped_column(Integer, comment="Global rank.")
    step: Mapped[int] = mapped_column(BigInteger, comment="Step number.")
    end_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="End of the step, Unix time in nanoseconds."
    )
    op: Mapped[str] = mapped_column(String(64), comment="Collective (all_reduce, broadcast, ...).")
    pg: Mapped[str] = mapped_column(String(64), comment="Process group name.")
    dtype: Mapped[str] = mapped_column(String(64), comment="Tensor dtype.")
    count: Mapped[int] = mapped_column(BigInteger, comment="Calls in the step (count).")
    size_bytes: Mapped[int] = mapped_column(
        BigInteger, comment="nccl-tests message size summed over calls, bytes."
    )
    duration_s: Mapped[float | None] = mapped_column(
        Float, comment="Time summed over calls, seconds."
    )
    max_duration_s: Mapped[float | None] = mapped_column(
        Float, comment="Longest single call, seconds."
    )
    algbw_bytes_per_s: Mapped[float | None] = mapped_column(
        Float, comment="Algorithm bandwidth, bytes per second."
    )
    busbw_bytes_per_s: Mapped[float | None] = mapped_column(
        Float, comment="Bus bandwidth (nccl-tests formula), bytes per second."
    )


class Bucket(Base):
    __tablename__ = "buckets"
    __table_args__ = _table(
        "One DDP gradient bucket reduced by the probe's comm hook in one step of one rank.",
        Index(None, "job", "end_unix_ns"),
    )

    id: Mapped[int] = _surrogate_id()
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    rank: Mapped[int] = mapped_column(Integer, comment="Global rank.")
    step: Mapped[int] = mapped_column(BigInteger, comment="Step number.")
    end_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="End of the step, Unix time in nanoseconds."
    )
    bucket_index: Mapped[int] = mapped_column(BigInteger, comment="DDP bucket index.")
    codec: Mapped[str] = mapped_column(String(64), comment="Compression codec (none, fp16, ...).")
    size_bytes: Mapped[int] = mapped_column(BigInteger, comment="Gradient bytes in the bucket.")
    parameters: Mapped[int] = mapped_column(BigInteger, comment="Parameters in the bucket.")
    wire_bytes: Mapped[int] = mapped_column(BigInteger, comment="Bytes this rank sent for it.")
    compression_ratio: Mapped[float | None] = mapped_column(
        Float, comment="wire_bytes / size_bytes, ratio (1.0 uncompressed)."
    )
    duration_s: Mapped[float | None] = mapped_column(
        Float, comment="Hook start to reduced result, seconds."
    )
    encode_s: Mapped[float | None] = mapped_column(Float, comment="Codec encode time, seconds.")
    decode_s: Mapped[float | None] = mapped_column(Float, comment="Codec decode time, seconds.")
    relative_error: Mapped[float | None] = mapped_column(
        Float,
        comment="||g - decode(encode(g))|| / ||g||, ratio; NULL on steps not sampled.",
    )


class DdpStat(Base):
    __tablename__ = "ddp_stats"
    __table_args__ = _table("DDP's own logging data (_get_ddp_logging_data), sampled.")

    id: Mapped[int] = _surrogate_id()
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    rank: Mapped[int] = mapped_column(Integer, comment="Global rank.")
    step: Mapped[int] = mapped_column(BigInteger, comment="Step number.")
    end_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="End of the step, Unix time in nanoseconds."
    )
    bucket_cap_bytes: Mapped[int] = mapped_column(BigInteger, comment="DDP bucket cap, bytes.")
    bucket_sizes_bytes: Mapped[list[int]] = mapped_column(
        JSON, comment="Size of each bucket, JSON list of bytes."
    )
    num_buckets_reduced: Mapped[int] = mapped_column(
        BigInteger, comment="Buckets reduced in the step (count)."
    )
    avg_forward_compute_s: Mapped[float | None] = mapped_column(
        Float, comment="DDP's average forward compute time, seconds."
    )
    avg_backward_compute_s: Mapped[float | None] = mapped_column(
        Float, comment="DDP's average backward compute time, seconds."
    )
    avg_backward_comm_s: Mapped[float | None] = mapped_column(
        Float, comment="DDP's average backward communication time, seconds."
    )
    avg_backward_compute_comm_overlap_s: Mapped[float | None] = mapped_column(
        Float, comment="DDP's average backward compute/communication overlap, seconds."
    )


class Config(Base):
    __tablename__ = "configs"
    __table_args__ = _table("Communication configs all ranks of a job applied.")

    job: Mapped[str] = mapped_column(String(200), primary_key=True, comment="Job name.")
    version: Mapped[int] = mapped_column(
        BigInteger, primary_key=True, autoincrement=False, comment="Config version."
    )
    bucket_cap_bytes: Mapped[int] = mapped_column(BigInteger, comment="DDP bucket cap, bytes.")
    first_bucket_cap_bytes: Mapped[int] = mapped_column(
        BigInteger, comment="Cap of DDP's first bucket, bytes."
    )
    codec: Mapped[str] = mapped_column(String(64), comment="Compression codec.")
    codec_params: Mapped[dict[str, Any]] = mapped_column(
        JSON, comment="Codec parameters, JSON object."
    )
    effective_step: Mapped[int] = mapped_column(
        BigInteger, comment="First step that ran with this config."
    )
    applied_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="When rank 0 applied it, Unix time in nanoseconds."
    )


class InflightReport(Base):
    __tablename__ = "inflight_reports"
    __table_args__ = _table(
        "Oldest unfinished collective per process group, as reported in each probe batch."
    )

    id: Mapped[int] = _surrogate_id()
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    rank: Mapped[int] = mapped_column(Integer, comment="Global rank.")
    sent_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="When the probe sent the batch, Unix time in nanoseconds."
    )
    pg: Mapped[str] = mapped_column(String(64), comment="Process group name.")
    seq: Mapped[int] = mapped_column(
        BigInteger, comment="Collective number within the process group."
    )
    op: Mapped[str] = mapped_column(String(64), comment="Collective.")
    size_bytes: Mapped[int] = mapped_column(BigInteger, comment="Message size, bytes.")
    start_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="When the rank entered it, Unix time in nanoseconds."
    )
    age_s: Mapped[float | None] = mapped_column(
        Float, comment="Time in the collective when sent, seconds."
    )
    peer: Mapped[int | None] = mapped_column(Integer, comment="Peer rank of a point-to-point op.")


# -- node samples from the agent -----------------------------------------------------------


class NodeSample(Base):
    __tablename__ = "node_samples"
    __table_args__ = _table("One sample of a node by its agent.", Index(None, "node", "ts_unix_ns"))

    id: Mapped[int] = _surrogate_id()
    node: Mapped[str] = mapped_column(String(200), comment="Host name of the node.")
    ts_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="Sample time, Unix time in nanoseconds."
    )
    cpu_utilization_ratio: Mapped[float | None] = mapped_column(
        Float, comment="CPU busy since the previous sample, ratio 0..1."
    )
    memory_utilization_ratio: Mapped[float | None] = mapped_column(
        Float, comment="Memory in use, ratio 0..1."
    )
    memory_used_bytes: Mapped[int] = mapped_column(BigInteger, comment="Memory in use, bytes.")
    io_wait_ratio: Mapped[float | None] = mapped_column(
        Float, comment="CPU time waiting on I/O since the previous sample, ratio 0..1."
    )
    net_rx_bytes_total: Mapped[int] = mapped_column(
        BigInteger, comment="Bytes received since boot (counter)."
    )
    net_tx_bytes_total: Mapped[int] = mapped_column(
        BigInteger, comment="Bytes sent since boot (counter)."
    )
    disk_read_bytes_total: Mapped[int] = mapped_column(
        BigInteger, comment="Bytes read from disk since boot (counter)."
    )
    disk_write_bytes_total: Mapped[int] = mapped_column(
        BigInteger, comment="Bytes written to disk since boot (counter)."
    )


class GpuSample(Base):
    __tablename__ = "gpu_samples"
    __table_args__ = _table("One sample of one GPU of a node (NVML).")

    id: Mapped[int] = _surrogate_id()
    node: Mapped[str] = mapped_column(String(200), comment="Host name of the node.")
    ts_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="Sample time, Unix time in nanoseconds."
    )
    gpu_index: Mapped[int] = mapped_column(BigInteger, comment="NVML device index.")
    utilization_ratio: Mapped[float | None] = mapped_column(Float, comment="GPU busy, ratio 0..1.")
    memory_used_bytes: Mapped[int] = mapped_column(BigInteger, comment="GPU memory in use, bytes.")
    memory_total_bytes: Mapped[int] = mapped_column(BigInteger, comment="GPU memory, bytes.")
    power_watts: Mapped[float | None] = mapped_column(Float, comment="Board power draw, watts.")
    temperature_celsius: Mapped[float | None] = mapped_column(
        Float, comment="GPU core temperature, degrees Celsius."
    )
    throttle_reasons: Mapped[int | None] = mapped_column(
        BigInteger, comment="NVML bitmask of clock event (throttle) reasons active; 0 none."
    )
    ecc_uncorrected_errors_total: Mapped[int | None] = mapped_column(
        BigInteger, comment="Uncorrected ECC errors since the driver loaded (NULL: no ECC)."
    )
    xid_errors_total: Mapped[int | None] = mapped_column(
        BigInteger, comment="Xid errors the agent has seen on this GPU since it started."
    )
    last_xid: Mapped[int | None] = mapped_column(
        BigInteger, comment="Latest Xid code seen; 0 none."
    )


class RankSample(Base):
    __tablename__ = "rank_samples"
    __table_args__ = _table(
        "One sample of a training process by its node's agent.",
        Index(None, "job", "rank", "ts_unix_ns"),
    )

    id: Mapped[int] = _surrogate_id()
    node: Mapped[str] = mapped_column(String(200), comment="Host name of the node.")
    ts_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="Sample time, Unix time in nanoseconds."
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    rank: Mapped[int] = mapped_column(Integer, comment="Global rank.")
    pid: Mapped[int] = mapped_column(BigInteger, comment="Process id on the node.")
    rss_bytes: Mapped[int] = mapped_column(BigInteger, comment="Resident set size, bytes.")


# -- what the aggregator decides -----------------------------------------------------------


class Command(Base):
    __tablename__ = "commands"
    __table_args__ = _table(
        "Commands sent to a job's rank 0 and what became of them.",
        Index(None, "job", "status"),
        _one_of("status", COMMAND_STATUSES),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True, comment="Command id.")
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    kind: Mapped[str] = mapped_column(String(64), comment="Command kind (config).")
    args: Mapped[dict[str, Any]] = mapped_column(JSON, comment="Arguments, JSON object.")
    status: Mapped[str] = mapped_column(
        String(16), comment="pending, sent, accepted, rejected, applied or expired."
    )
    reason: Mapped[str] = mapped_column(
        Text, default="", comment="Why rejected or expired; empty otherwise."
    )
    version: Mapped[int | None] = mapped_column(
        BigInteger, comment="Config version it became, once applied."
    )
    effective_step: Mapped[int | None] = mapped_column(
        BigInteger, comment="First step it applies to, once applied."
    )
    created_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it was created, Unix time in seconds."
    )
    updated_unix_s: Mapped[float] = mapped_column(
        Float, comment="Latest status change, Unix time in seconds."
    )
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that issued it."
    )


class Alert(Base):
    __tablename__ = "alerts"
    __table_args__ = _table(
        "One alert episode: pending, then firing, then resolved update the same row.",
        Index(None, "job", "state"),
        _one_of("state", ALERT_STATES),
    )

    id: Mapped[int] = _surrogate_id()
    fingerprint: Mapped[str] = mapped_column(
        String(16), index=True, comment="Hash of rule and labels (16 hex digits)."
    )
    rule: Mapped[str] = mapped_column(String(200), comment="Rule name (alertname).")
    severity: Mapped[str] = mapped_column(String(32), comment="info .. critical.")
    state: Mapped[str] = mapped_column(String(16), comment="pending, firing or resolved.")
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    rank: Mapped[int | None] = mapped_column(Integer, comment="Rank at fault, if one.")
    labels: Mapped[dict[str, str]] = mapped_column(JSON, comment="Alert labels, JSON object.")
    annotations: Mapped[dict[str, str]] = mapped_column(
        JSON, comment="summary, description, recommendation (JSON); follow its figures while open."
    )
    value: Mapped[float | None] = mapped_column(Float, comment="Rule's value, latest while open.")
    starts_at_unix_s: Mapped[float] = mapped_column(
        Float, comment="When the condition began, Unix time in seconds."
    )
    fired_at_unix_s: Mapped[float | None] = mapped_column(
        Float, comment="When it started firing, Unix time in seconds."
    )
    ends_at_unix_s: Mapped[float | None] = mapped_column(
        Float, comment="When it resolved, Unix time in seconds."
    )
    updated_unix_s: Mapped[float] = mapped_column(
        Float, comment="Latest state change or rewrite of its text, Unix time in seconds."
    )
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that evaluated it."
    )
    acknowledged_by: Mapped[str | None] = mapped_column(
        String(200), comment="Who acknowledged it (NULL: nobody yet)."
    )
    acknowledged_unix_s: Mapped[float | None] = mapped_column(
        Float, comment="When it was acknowledged, Unix time in seconds."
    )
    acknowledged_comment: Mapped[str | None] = mapped_column(
        Text, comment="What the acknowledger said (may be empty)."
    )


class Silence(Base):
    __tablename__ = "silences"
    __table_args__ = _table(
        "Silences: alerts whose labels match are not notified between the start and end.",
        Index(None, "ends_at_unix_s"),
    )

    id: Mapped[int] = _surrogate_id()
    matchers: Mapped[dict[str, str]] = mapped_column(
        JSON, comment="Label name -> value; an alert matches when every one is equal."
    )
    starts_at_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it takes effect, Unix time in seconds."
    )
    ends_at_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it expires (or was expired early), Unix time in seconds."
    )
    created_by: Mapped[str] = mapped_column(String(200), comment="Who created it.")
    comment: Mapped[str] = mapped_column(Text, comment="Why (may be empty).")
    created_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it was created, Unix time in seconds."
    )


class AlertEvent(Base):
    __tablename__ = "alert_events"
    __table_args__ = _table(
        "Each state transition of an alert episode.", _one_of("state", ALERT_STATES)
    )

    id: Mapped[int] = _surrogate_id()
    alert_id: Mapped[int] = mapped_column(
        ID_TYPE, ForeignKey("alerts.id"), index=True, comment="The episode (alerts.id)."
    )
    state: Mapped[str] = mapped_column(String(16), comment="State entered.")
    ts_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it was entered, Unix time in seconds."
    )
    value: Mapped[float | None] = mapped_column(Float, comment="Value at that moment.")


class Finding(Base):
    __tablename__ = "findings"
    __table_args__ = _table(
        "Detector conclusions (anomaly, straggler, hang, bottleneck, slow_link), one row per "
        "episode: opened when first detected, updated while it holds, closed (ended_unix_s) "
        "when it no longer does.",
        _one_of("kind", FINDING_KINDS),
        Index(None, "job", "detected_unix_s"),
    )

    id: Mapped[int] = _surrogate_id()
    kind: Mapped[str] = mapped_column(
        String(16), comment="anomaly, straggler, hang, bottleneck or slow_link."
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    rank: Mapped[int | None] = mapped_column(Integer, comment="Rank at fault, if one.")
    metric: Mapped[str | None] = mapped_column(
        String(64), comment="Metric, for anomalies and bottlenecks."
    )
    value: Mapped[float | None] = mapped_column(
        Float, comment="Observed value (a step time, a hang age, ...), in the metric's unit."
    )
    score: Mapped[float | None] = mapped_column(
        Float, comment="Detector statistic (z-score, robust z, relative slowdown)."
    )
    summary: Mapped[str] = mapped_column(Text, comment="One sentence: what and where.")
    recommendation: Mapped[str] = mapped_column(Text, comment="What to do.")
    severity: Mapped[str] = mapped_column(String(32), comment="info .. critical.")
    category: Mapped[str | None] = mapped_column(
        String(32),
        comment="What the step time is lost to: communication, efficiency, input, memory, "
        "gpu_memory, gpu, network or straggler; NULL for anomalies and hangs.",
    )
    priority: Mapped[int | None] = mapped_column(
        Integer, comment="Order to act in within the job's report, 1 first; NULL if unranked."
    )
    expected_gain_ratio: Mapped[float | None] = mapped_column(
        Float,
        comment="Estimated share of step time the recommendation saves, 0..1 "
        "(NULL where it prevents a failure rather than saving time).",
    )
    difficulty: Mapped[str | None] = mapped_column(
        String(16), comment="Effort of the recommendation: easy, medium or hard."
    )
    since_unix_s: Mapped[float] = mapped_column(
        Float, comment="When the condition began, Unix time in seconds."
    )
    detected_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it was detected (the row opened), Unix time in seconds."
    )
    updated_unix_s: Mapped[float | None] = mapped_column(
        Float, comment="When value, severity or summary were last written, Unix seconds."
    )
    ended_unix_s: Mapped[float | None] = mapped_column(
        Float, comment="When it stopped holding, Unix time in seconds; NULL while open."
    )
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that detected it."
    )
    details: Mapped[dict[str, Any]] = mapped_column(
        JSON, comment="Detector-specific details, JSON object."
    )


class TuningSession(Base):
    __tablename__ = "tuning_sessions"
    __table_args__ = _table("One autotuning session of a job.", Index(None, "job"))

    id: Mapped[str] = mapped_column(String(64), primary_key=True, comment="Session id.")
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    state: Mapped[str] = mapped_column(String(32), comment="The tuner's state.")
    trigger: Mapped[str] = mapped_column(String(200), comment="What started it (an alert, a user).")
    started_unix_s: Mapped[float] = mapped_column(Float, comment="Unix time in seconds.")
    ended_unix_s: Mapped[float | None] = mapped_column(Float, comment="Unix time in seconds.")
    baseline_config: Mapped[dict[str, Any]] = mapped_column(
        JSON, comment="Config before tuning, JSON object."
    )
    best_config: Mapped[dict[str, Any] | None] = mapped_column(
        JSON, comment="Best config found, JSON object."
    )
    baseline_score: Mapped[float | None] = mapped_column(
        Float, comment="Baseline throughput, samples per second."
    )
    best_score: Mapped[float | None] = mapped_column(
        Float, comment="Best throughput, samples per second."
    )
    reason: Mapped[str] = mapped_column(Text, default="", comment="Why it ended as it did.")
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that runs it."
    )
    state_blob: Mapped[dict[str, Any]] = mapped_column(
        JSON, comment="The tuner's resumable state, JSON object."
    )


class TuningTrial(Base):
    __tablename__ = "tuning_trials"
    __table_args__ = _table("One config tried by a tuning session.")

    id: Mapped[int] = _surrogate_id()
    session_id: Mapped[str] = mapped_column(
        String(64),
        ForeignKey("tuning_sessions.id"),
        index=True,
        comment="The session (tuning_sessions.id).",
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    trial_index: Mapped[int] = mapped_column(Integer, comment="0-based trial number.")
    config: Mapped[dict[str, Any]] = mapped_column(JSON, comment="Config tried, JSON object.")
    command_id: Mapped[str | None] = mapped_column(
        String(64), comment="The command that applied it (commands.id)."
    )
    state: Mapped[str] = mapped_column(String(32), comment="The trial's state.")
    windows: Mapped[list[float]] = mapped_column(
        JSON, comment="Throughput per measured window, JSON list of samples per second."
    )
    score: Mapped[float | None] = mapped_column(
        Float, comment="Median of the windows, samples per second."
    )
    decision: Mapped[str | None] = mapped_column(
        String(32), comment="keep, rollback, ... once decided."
    )
    reason: Mapped[str] = mapped_column(Text, default="", comment="Why it was decided so.")
    started_unix_s: Mapped[float] = mapped_column(Float, comment="Unix time in seconds.")
    ended_unix_s: Mapped[float | None] = mapped_column(Float, comment="Unix time in seconds.")


# -- evidence captured on alert -----------------------------------------------------------


class EvidenceCapture(Base):
    __tablename__ = "evidence_captures"
    __table_args__ = _table(
        "Evidence captures (Flight Recorder dumps, profiler traces) asked of a job.",
        Index(None, "job"),
        Index(None, "alert_id"),
    )

    id: Mapped[str] = mapped_column(
        String(64), primary_key=True, comment="Capture id (the evidence command's id)."
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    alert_id: Mapped[int | None] = mapped_column(
        BigInteger, comment="The alert episode that asked for it (alerts.id), if one."
    )
    alert_fingerprint: Mapped[str | None] = mapped_column(
        String(16), comment="That alert's fingerprint (16 hex digits)."
    )
    rule: Mapped[str] = mapped_column(
        String(200), comment="The rule whose alert asked for it; empty when asked by hand."
    )
    profile_ranks: Mapped[list[int]] = mapped_column(
        JSON, comment="Ranks asked for a profiler trace, JSON array."
    )
    created_unix_s: Mapped[float] = mapped_column(
        Float, comment="When it was asked for, Unix time in seconds."
    )
    aggregator_id: Mapped[str | None] = mapped_column(
        String(128), comment="The aggregator shard that asked for it."
    )


class EvidenceFile(Base):
    __tablename__ = "evidence_files"
    __table_args__ = _table("Files of evidence captures, one per rank and kind, or why missing.")

    capture_id: Mapped[str] = mapped_column(
        String(64),
        ForeignKey("evidence_captures.id"),
        primary_key=True,
        comment="The capture (evidence_captures.id).",
    )
    rank: Mapped[int] = mapped_column(
        Integer, primary_key=True, autoincrement=False, comment="Global rank that took it."
    )
    name: Mapped[str] = mapped_column(
        String(64),
        primary_key=True,
        comment="flight_recorder.json or profiler_trace.json.",
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    size_bytes: Mapped[int] = mapped_column(
        BigInteger, comment="Size of the file uncompressed; 0 when missing."
    )
    stored_bytes: Mapped[int] = mapped_column(
        BigInteger, comment="Size on disk (gzip); 0 when missing."
    )
    path: Mapped[str | None] = mapped_column(
        String(300), comment="Where it is, under the evidence folder; NULL when missing."
    )
    error: Mapped[str] = mapped_column(
        Text, default="", comment="Why it is missing (not taken, over a cap); empty otherwise."
    )
    taken_unix_s: Mapped[float] = mapped_column(
        Float, comment="When the rank took it, Unix time in seconds."
    )
    received_unix_s: Mapped[float] = mapped_column(
        Float, comment="When the aggregator stored it, Unix time in seconds."
    )


# -- downsampled history ------------------------------------------------------------------


class Rollup(Base):
    __tablename__ = "rollups"
    __table_args__ = _table(
        "Raw measurements downsampled into fixed time buckets (see ROLLUP_SOURCES)."
    )

    key: Mapped[str] = mapped_column(
        String(200), primary_key=True, comment="Job name, or node name for node metrics."
    )
    rank: Mapped[int] = mapped_column(
        Integer, primary_key=True, autoincrement=False, comment="Global rank; -1 for a node."
    )
    metric: Mapped[str] = mapped_column(
        String(64), primary_key=True, comment="Source column (duration_s, ...)."
    )
    resolution_s: Mapped[int] = mapped_column(
        Integer, primary_key=True, autoincrement=False, comment="Bucket width, seconds."
    )
    bucket_start_unix_s: Mapped[int] = mapped_column(
        BigInteger,
        primary_key=True,
        autoincrement=False,
        comment="Start of the bucket, Unix time in seconds.",
    )
    count: Mapped[int] = mapped_column(BigInteger, comment="Non-NULL values in the bucket.")
    sum: Mapped[float] = mapped_column(Float, comment="Sum of the values, in the metric's unit.")
    min: Mapped[float] = mapped_column(Float, comment="Smallest value, in the metric's unit.")
    max: Mapped[float] = mapped_column(Float, comment="Largest value, in the metric's unit.")


class RetentionState(Base):
    __tablename__ = "retention_state"
    __table_args__ = _table("Progress of the retention job.")

    name: Mapped[str] = mapped_column(
        String(64), primary_key=True, comment="Watermark name (rollup:<table>:<resolution>)."
    )
    watermark_unix_s: Mapped[float] = mapped_column(
        Float, comment="Everything before this is done, Unix time in seconds."
    )


@dataclass(frozen=True, slots=True)
class RollupSource:
    """Which columns of a raw table are rolled up, and how a row is keyed and timed.

    ``rank_column`` None means node-level rows (rank -1); ``time_column`` is Unix ns.
    """

    table: str
    key_column: str
    rank_column: str | None
    time_column: str
    metrics: tuple[str, ...]


#: Raw tables whose measurements ``apply_retention`` rolls up, by table name.
ROLLUP_SOURCES: Final[Mapping[str, RollupSource]] = MappingProxyType(
    {
        "steps": RollupSource(
            table="steps",
            key_column="job",
            rank_column="rank",
            time_column="end_unix_ns",
            metrics=(
                "duration_s",
                "comm_wait_s",
                "compute_s",
                "communication_time_ratio",
                "samples_per_s",
                "loss",
            ),
        ),
        "node_samples": RollupSource(
            table="node_samples",
            key_column="node",
            rank_column=None,
            time_column="ts_unix_ns",
            metrics=("cpu_utilization_ratio", "memory_utilization_ratio", "io_wait_ratio"),
        ),
    }
)
