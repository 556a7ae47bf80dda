"""Per-step measurements from the probe: steps, collectives, buckets, DDP, configs."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    Index,
    Integer,
    String,
)
from sqlalchemy.orm import Mapped, mapped_column

from torshmon.history.models._base import (
    RUN_ID_COMMENT,
    Base,
    _surrogate_id,
    _table,
)


class Step(Base):
    __tablename__ = "steps"
    __table_args__ = _table(
        "One training step of one rank.",
        Index(None, "job", "end_unix_ns"),
        Index(None, "job", "rank", "step"),
        Index(None, "job", "run_id", "end_unix_ns"),
    )

    id: Mapped[int] = _surrogate_id()
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    run_id: Mapped[str | None] = mapped_column(String(64), comment=RUN_ID_COMMENT)
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
    run_id: Mapped[str | None] = mapped_column(String(64), comment=RUN_ID_COMMENT)
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
    run_id: Mapped[str | None] = mapped_column(String(64), comment=RUN_ID_COMMENT)
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
    run_id: Mapped[str | None] = mapped_column(String(64), comment=RUN_ID_COMMENT)
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
    __table_args__ = _table(
        "Communication configs all ranks of a job applied: each run (launch) numbers its "
        "versions from 1."
    )

    job: Mapped[str] = mapped_column(String(200), primary_key=True, comment="Job name.")
    run_id: Mapped[str] = mapped_column(
        String(64),
        primary_key=True,
        server_default="",
        comment="The run (launch) that applied it (runs.run_id); empty where its probe "
        "sent no run id.",
    )
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
    run_id: Mapped[str | None] = mapped_column(String(64), comment=RUN_ID_COMMENT)
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
