"""The initial history schema: every table of torshmon.history.models at version 1.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "alerts",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column(
            "fingerprint",
            sa.String(length=16),
            nullable=False,
            comment="Hash of rule and labels (16 hex digits).",
        ),
        sa.Column("rule", sa.String(length=200), nullable=False, comment="Rule name (alertname)."),
        sa.Column("severity", sa.String(length=32), nullable=False, comment="info .. critical."),
        sa.Column(
            "state", sa.String(length=16), nullable=False, comment="pending, firing or resolved."
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("rank", sa.Integer(), nullable=True, comment="Rank at fault, if one."),
        sa.Column("labels", sa.JSON(), nullable=False, comment="Alert labels, JSON object."),
        sa.Column(
            "annotations",
            sa.JSON(),
            nullable=False,
            comment="summary, description, recommendation, JSON object.",
        ),
        sa.Column("value", sa.Float(), nullable=True, comment="Value that triggered the rule."),
        sa.Column(
            "starts_at_unix_s",
            sa.Float(),
            nullable=False,
            comment="When the condition began, Unix time in seconds.",
        ),
        sa.Column(
            "fired_at_unix_s",
            sa.Float(),
            nullable=True,
            comment="When it started firing, Unix time in seconds.",
        ),
        sa.Column(
            "ends_at_unix_s",
            sa.Float(),
            nullable=True,
            comment="When it resolved, Unix time in seconds.",
        ),
        sa.Column(
            "updated_unix_s",
            sa.Float(),
            nullable=False,
            comment="Latest state change, Unix time in seconds.",
        ),
        sa.Column(
            "aggregator_id",
            sa.String(length=128),
            nullable=True,
            comment="The aggregator shard that evaluated it.",
        ),
        sa.CheckConstraint(
            "state IN ('pending', 'firing', 'resolved')", name=op.f("ck_alerts_state")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
        comment="One alert episode: pending, then firing, then resolved update the same row.",
    )
    op.create_index(op.f("ix_alerts_fingerprint"), "alerts", ["fingerprint"], unique=False)
    op.create_index(op.f("ix_alerts_job_state"), "alerts", ["job", "state"], unique=False)

    op.create_table(
        "buckets",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("rank", sa.Integer(), nullable=False, comment="Global rank."),
        sa.Column("step", sa.BigInteger(), nullable=False, comment="Step number."),
        sa.Column(
            "end_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="End of the step, Unix time in nanoseconds.",
        ),
        sa.Column("bucket_index", sa.BigInteger(), nullable=False, comment="DDP bucket index."),
        sa.Column(
            "codec",
            sa.String(length=64),
            nullable=False,
            comment="Compression codec (none, fp16, ...).",
        ),
        sa.Column(
            "size_bytes", sa.BigInteger(), nullable=False, comment="Gradient bytes in the bucket."
        ),
        sa.Column(
            "parameters", sa.BigInteger(), nullable=False, comment="Parameters in the bucket."
        ),
        sa.Column(
            "wire_bytes", sa.BigInteger(), nullable=False, comment="Bytes this rank sent for it."
        ),
        sa.Column(
            "compression_ratio",
            sa.Float(),
            nullable=True,
            comment="wire_bytes / size_bytes, ratio (1.0 uncompressed).",
        ),
        sa.Column(
            "duration_s",
            sa.Float(),
            nullable=True,
            comment="Hook start to reduced result, seconds.",
        ),
        sa.Column("encode_s", sa.Float(), nullable=True, comment="Codec encode time, seconds."),
        sa.Column("decode_s", sa.Float(), nullable=True, comment="Codec decode time, seconds."),
        sa.Column(
            "relative_error",
            sa.Float(),
            nullable=True,
            comment="||g - decode(encode(g))|| / ||g||, ratio; NULL on steps not sampled.",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_buckets")),
        comment="One DDP gradient bucket reduced by the probe's comm hook in one step of one rank.",
    )
    op.create_index(
        op.f("ix_buckets_job_end_unix_ns"), "buckets", ["job", "end_unix_ns"], unique=False
    )

    op.create_table(
        "collectives",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("rank", sa.Integer(), nullable=False, comment="Global rank."),
        sa.Column("step", sa.BigInteger(), nullable=False, comment="Step number."),
        sa.Column(
            "end_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="End of the step, Unix time in nanoseconds.",
        ),
        sa.Column(
            "op",
            sa.String(length=64),
            nullable=False,
            comment="Collective (all_reduce, broadcast, ...).",
        ),
        sa.Column("pg", sa.String(length=64), nullable=False, comment="Process group name."),
        sa.Column("dtype", sa.String(length=64), nullable=False, comment="Tensor dtype."),
        sa.Column("count", sa.BigInteger(), nullable=False, comment="Calls in the step (count)."),
        sa.Column(
            "size_bytes",
            sa.BigInteger(),
            nullable=False,
            comment="nccl-tests message size summed over calls, bytes.",
        ),
        sa.Column(
            "duration_s", sa.Float(), nullable=True, comment="Time summed over calls, seconds."
        ),
        sa.Column(
            "max_duration_s", sa.Float(), nullable=True, comment="Longest single call, seconds."
        ),
        sa.Column(
            "algbw_bytes_per_s",
            sa.Float(),
            nullable=True,
            comment="Algorithm bandwidth, bytes per second.",
        ),
        sa.Column(
            "busbw_bytes_per_s",
            sa.Float(),
            nullable=True,
            comment="Bus bandwidth (nccl-tests formula), bytes per second.",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_collectives")),
        comment="Collectives of one (op, process group, dtype) within one step of one rank.",
    )
    op.create_index(
        op.f("ix_collectives_job_end_unix_ns"), "collectives", ["job", "end_unix_ns"], unique=False
    )

    op.create_table(
        "commands",
        sa.Column("id", sa.String(length=64), nullable=False, comment="Command id."),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("kind", sa.String(length=64), nullable=False, comment="Command kind (config)."),
        sa.Column("args", sa.JSON(), nullable=False, comment="Arguments, JSON object."),
        sa.Column(
            "status",
            sa.String(length=16),
            nullable=False,
            comment="pending, sent, accepted, rejected, applied or expired.",
        ),
        sa.Column(
            "reason", sa.Text(), nullable=False, comment="Why rejected or expired; empty otherwise."
        ),
        sa.Column(
            "version",
            sa.BigInteger(),
            nullable=True,
            comment="Config version it became, once applied.",
        ),
        sa.Column(
            "effective_step",
            sa.BigInteger(),
            nullable=True,
            comment="First step it applies to, once applied.",
        ),
        sa.Column(
            "created_unix_s",
            sa.Float(),
            nullable=False,
            comment="When it was created, Unix time in seconds.",
        ),
        sa.Column(
            "updated_unix_s",
            sa.Float(),
            nullable=False,
            comment="Latest status change, Unix time in seconds.",
        ),
        sa.Column(
            "aggregator_id",
            sa.String(length=128),
            nullable=True,
            comment="The aggregator shard that issued it.",
        ),
        sa.CheckConstraint(
            "status IN ('pending', 'sent', 'accepted', 'rejected', 'applied', 'expired')",
            name=op.f("ck_commands_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_commands")),
        comment="Commands sent to a job's rank 0 and what became of them.",
    )
    op.create_index(op.f("ix_commands_job_status"), "commands", ["job", "status"], unique=False)

    op.create_table(
        "configs",
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column(
            "version",
            sa.BigInteger(),
            autoincrement=False,
            nullable=False,
            comment="Config version.",
        ),
        sa.Column(
            "bucket_cap_bytes", sa.BigInteger(), nullable=False, comment="DDP bucket cap, bytes."
        ),
        sa.Column(
            "first_bucket_cap_bytes",
            sa.BigInteger(),
            nullable=False,
            comment="Cap of DDP's first bucket, bytes.",
        ),
        sa.Column("codec", sa.String(length=64), nullable=False, comment="Compression codec."),
        sa.Column(
            "codec_params", sa.JSON(), nullable=False, comment="Codec parameters, JSON object."
        ),
        sa.Column(
            "effective_step",
            sa.BigInteger(),
            nullable=False,
            comment="First step that ran with this config.",
        ),
        sa.Column(
            "applied_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="When rank 0 applied it, Unix time in nanoseconds.",
        ),
        sa.PrimaryKeyConstraint("job", "version", name=op.f("pk_configs")),
        comment="Communication configs all ranks of a job applied.",
    )
    op.create_table(
        "ddp_stats",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("rank", sa.Integer(), nullable=False, comment="Global rank."),
        sa.Column("step", sa.BigInteger(), nullable=False, comment="Step number."),
        sa.Column(
            "end_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="End of the step, Unix time in nanoseconds.",
        ),
        sa.Column(
            "bucket_cap_bytes", sa.BigInteger(), nullable=False, comment="DDP bucket cap, bytes."
        ),
        sa.Column(
            "bucket_sizes_bytes",
            sa.JSON(),
            nullable=False,
            comment="Size of each bucket, JSON list of bytes.",
        ),
        sa.Column(
            "num_buckets_reduced",
            sa.BigInteger(),
            nullable=False,
            comment="Buckets reduced in the step (count).",
        ),
        sa.Column(
            "avg_forward_compute_s",
            sa.Float(),
            nullable=True,
            comment="DDP's average forward compute time, seconds.",
        ),
        sa.Column(
            "avg_backward_compute_s",
            sa.Float(),
            nullable=True,
            comment="DDP's average backward compute time, seconds.",
        ),
        sa.Column(
            "avg_backward_comm_s",
            sa.Float(),
            nullable=True,
            comment="DDP's average backward communication time, seconds.",
        ),
        sa.Column(
            "avg_backward_compute_comm_overlap_s",
            sa.Float(),
            nullable=True,
            comment="DDP's average backward compute/communication overlap, seconds.",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ddp_stats")),
        comment="DDP's own logging data (_get_ddp_logging_data), sampled.",
    )
    op.create_table(
        "findings",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column(
            "kind",
            sa.String(length=16),
            nullable=False,
            comment="anomaly, straggler, hang or bottleneck.",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("rank", sa.Integer(), nullable=True, comment="Rank at fault, if one."),
        sa.Column("metric", sa.String(length=64), nullable=True, comment="Metric, for anomalies."),
        sa.Column(
            "value",
            sa.Float(),
            nullable=True,
            comment="Observed value (a step time, a hang age, ...), in the metric's unit.",
        ),
        sa.Column(
            "score",
            sa.Float(),
            nullable=True,
            comment="Detector statistic (z-score, robust z, relative slowdown).",
        ),
        sa.Column("summary", sa.Text(), nullable=False, comment="One sentence: what and where."),
        sa.Column("recommendation", sa.Text(), nullable=False, comment="What to do."),
        sa.Column("severity", sa.String(length=32), nullable=False, comment="info .. critical."),
        sa.Column(
            "since_unix_s",
            sa.Float(),
            nullable=False,
            comment="When the condition began, Unix time in seconds.",
        ),
        sa.Column(
            "detected_unix_s",
            sa.Float(),
            nullable=False,
            comment="When it was detected, Unix time in seconds.",
        ),
        sa.Column(
            "details", sa.JSON(), nullable=False, comment="Detector-specific details, JSON object."
        ),
        sa.CheckConstraint(
            "kind IN ('anomaly', 'straggler', 'hang', 'bottleneck')", name=op.f("ck_findings_kind")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_findings")),
        comment="Detector conclusions (anomaly, straggler, hang, bottleneck) when first detected.",
    )
    op.create_table(
        "gpu_samples",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column("node", sa.String(length=200), nullable=False, comment="Host name of the node."),
        sa.Column(
            "ts_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="Sample time, Unix time in nanoseconds.",
        ),
        sa.Column("gpu_index", sa.BigInteger(), nullable=False, comment="NVML device index."),
        sa.Column("utilization_ratio", sa.Float(), nullable=True, comment="GPU busy, ratio 0..1."),
        sa.Column(
            "memory_used_bytes",
            sa.BigInteger(),
            nullable=False,
            comment="GPU memory in use, bytes.",
        ),
        sa.Column(
            "memory_total_bytes", sa.BigInteger(), nullable=False, comment="GPU memory, bytes."
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_samples")),
        comment="One sample of one GPU of a node (NVML).",
    )
    op.create_table(
        "inflight_reports",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("rank", sa.Integer(), nullable=False, comment="Global rank."),
        sa.Column(
            "sent_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="When the probe sent the batch, Unix time in nanoseconds.",
        ),
        sa.Column("pg", sa.String(length=64), nullable=False, comment="Process group name."),
        sa.Column(
            "seq",
            sa.BigInteger(),
            nullable=False,
            comment="Collective number within the process group.",
        ),
        sa.Column("op", sa.String(length=64), nullable=False, comment="Collective."),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False, comment="Message size, bytes."),
        sa.Column(
            "start_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="When the rank entered it, Unix time in nanoseconds.",
        ),
        sa.Column(
            "age_s", sa.Float(), nullable=True, comment="Time in the collective when sent, seconds."
        ),
        sa.Column("peer", sa.Integer(), nullable=True, comment="Peer rank of a point-to-point op."),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_inflight_reports")),
        comment="Oldest unfinished collective per process group, as reported in each probe batch.",
    )
    op.create_table(
        "ingest_seqs",
        sa.Column(
            "agent_id", sa.String(length=128), nullable=False, comment="Id of the forwarding agent."
        ),
        sa.Column(
            "seq",
            sa.BigInteger(),
            autoincrement=False,
            nullable=False,
            comment="The agent's sequence number of the spool record.",
        ),
        sa.Column("node", sa.String(length=200), nullable=False, comment="Node of the agent."),
        sa.Column(
            "received_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="When the aggregator stored it, Unix time in nanoseconds.",
        ),
        sa.PrimaryKeyConstraint("agent_id", "seq", name=op.f("pk_ingest_seqs")),
        comment="Agent spool records already stored: makes agent batches idempotent.",
    )
    op.create_table(
        "jobs",
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column(
            "world_size",
            sa.Integer(),
            nullable=True,
            comment="Number of ranks (NULL until a probe hello is seen).",
        ),
        sa.Column(
            "backend",
            sa.String(length=64),
            nullable=True,
            comment="torch.distributed backend (gloo, nccl).",
        ),
        sa.Column(
            "first_seen_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="First data from the job, Unix time in nanoseconds.",
        ),
        sa.Column(
            "last_seen_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="Latest data from the job, Unix time in nanoseconds.",
        ),
        sa.Column(
            "aggregator_id",
            sa.String(length=128),
            nullable=True,
            comment="The aggregator shard that owns the job.",
        ),
        sa.PrimaryKeyConstraint("job", name=op.f("pk_jobs")),
        comment="One row per training job seen by any aggregator.",
    )
    op.create_table(
        "node_samples",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column("node", sa.String(length=200), nullable=False, comment="Host name of the node."),
        sa.Column(
            "ts_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="Sample time, Unix time in nanoseconds.",
        ),
        sa.Column(
            "cpu_utilization_ratio",
            sa.Float(),
            nullable=True,
            comment="CPU busy since the previous sample, ratio 0..1.",
        ),
        sa.Column(
            "memory_utilization_ratio",
            sa.Float(),
            nullable=True,
            comment="Memory in use, ratio 0..1.",
        ),
        sa.Column(
            "memory_used_bytes", sa.BigInteger(), nullable=False, comment="Memory in use, bytes."
        ),
        sa.Column(
            "io_wait_ratio",
            sa.Float(),
            nullable=True,
            comment="CPU time waiting on I/O since the previous sample, ratio 0..1.",
        ),
        sa.Column(
            "net_rx_bytes_total",
            sa.BigInteger(),
            nullable=False,
            comment="Bytes received since boot (counter).",
        ),
        sa.Column(
            "net_tx_bytes_total",
            sa.BigInteger(),
            nullable=False,
            comment="Bytes sent since boot (counter).",
        ),
        sa.Column(
            "disk_read_bytes_total",
            sa.BigInteger(),
            nullable=False,
            comment="Bytes read from disk since boot (counter).",
        ),
        sa.Column(
            "disk_write_bytes_total",
            sa.BigInteger(),
            nullable=False,
            comment="Bytes written to disk since boot (counter).",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_samples")),
        comment="One sample of a node by its agent.",
    )
    op.create_index(
        op.f("ix_node_samples_node_ts_unix_ns"),
        "node_samples",
        ["node", "ts_unix_ns"],
        unique=False,
    )

    op.create_table(
        "probe_sessions",
        sa.Column(
            "session",
            sa.String(length=64),
            nullable=False,
            comment="Random id the probe picks at attach.",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("rank", sa.Integer(), nullable=False, comment="Global rank."),
        sa.Column("local_rank", sa.Integer(), nullable=True, comment="Rank within its node."),
        sa.Column("world_size", sa.Integer(), nullable=True, comment="Number of ranks."),
        sa.Column("node", sa.String(length=200), nullable=True, comment="Host name of the node."),
        sa.Column("pid", sa.BigInteger(), nullable=True, comment="Process id on the node."),
        sa.Column(
            "backend",
            sa.String(length=64),
            nullable=True,
            comment="torch.distributed backend (gloo, nccl).",
        ),
        sa.Column(
            "torch_version", sa.String(length=64), nullable=True, comment="torch.__version__."
        ),
        sa.Column(
            "probe_version", sa.String(length=64), nullable=True, comment="torshmon version."
        ),
        sa.Column(
            "started_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="When the session was first stored, Unix time in nanoseconds.",
        ),
        sa.Column(
            "last_seen_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="Latest batch from the session, Unix time in nanoseconds.",
        ),
        sa.Column(
            "last_seq",
            sa.BigInteger(),
            nullable=False,
            comment="Highest probe batch seq stored; later batches at or below it are duplicates.",
        ),
        sa.Column(
            "dropped_records_total",
            sa.BigInteger(),
            nullable=False,
            comment="Step records the probe dropped since attach (count).",
        ),
        sa.PrimaryKeyConstraint("session", name=op.f("pk_probe_sessions")),
        comment="One row per probe attach (one training process of one rank).",
    )
    op.create_index(
        op.f("ix_probe_sessions_job_rank"), "probe_sessions", ["job", "rank"], unique=False
    )

    op.create_table(
        "rank_samples",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column("node", sa.String(length=200), nullable=False, comment="Host name of the node."),
        sa.Column(
            "ts_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="Sample time, Unix time in nanoseconds.",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("rank", sa.Integer(), nullable=False, comment="Global rank."),
        sa.Column("pid", sa.BigInteger(), nullable=False, comment="Process id on the node."),
        sa.Column(
            "rss_bytes", sa.BigInteger(), nullable=False, comment="Resident set size, bytes."
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rank_samples")),
        comment="One sample of a training process by its node's agent.",
    )
    op.create_index(
        op.f("ix_rank_samples_job_rank_ts_unix_ns"),
        "rank_samples",
        ["job", "rank", "ts_unix_ns"],
        unique=False,
    )

    op.create_table(
        "retention_state",
        sa.Column(
            "name",
            sa.String(length=64),
            nullable=False,
            comment="Watermark name (rollup:<table>:<resolution>).",
        ),
        sa.Column(
            "watermark_unix_s",
            sa.Float(),
            nullable=False,
            comment="Everything before this is done, Unix time in seconds.",
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_retention_state")),
        comment="Progress of the retention job.",
    )
    op.create_table(
        "rollups",
        sa.Column(
            "key",
            sa.String(length=200),
            nullable=False,
            comment="Job name, or node name for node metrics.",
        ),
        sa.Column(
            "rank",
            sa.Integer(),
            autoincrement=False,
            nullable=False,
            comment="Global rank; -1 for a node.",
        ),
        sa.Column(
            "metric",
            sa.String(length=64),
            nullable=False,
            comment="Source column (duration_s, ...).",
        ),
        sa.Column(
            "resolution_s",
            sa.Integer(),
            autoincrement=False,
            nullable=False,
            comment="Bucket width, seconds.",
        ),
        sa.Column(
            "bucket_start_unix_s",
            sa.BigInteger(),
            autoincrement=False,
            nullable=False,
            comment="Start of the bucket, Unix time in seconds.",
        ),
        sa.Column(
            "count", sa.BigInteger(), nullable=False, comment="Non-NULL values in the bucket."
        ),
        sa.Column(
            "sum", sa.Float(), nullable=False, comment="Sum of the values, in the metric's unit."
        ),
        sa.Column(
            "min", sa.Float(), nullable=False, comment="Smallest value, in the metric's unit."
        ),
        sa.Column(
            "max", sa.Float(), nullable=False, comment="Largest value, in the metric's unit."
        ),
        sa.PrimaryKeyConstraint(
            "key", "rank", "metric", "resolution_s", "bucket_start_unix_s", name=op.f("pk_rollups")
        ),
        comment="Raw measurements downsampled into fixed time buckets (see ROLLUP_SOURCES).",
    )
    op.create_table(
        "steps",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("rank", sa.Integer(), nullable=False, comment="Global rank."),
        sa.Column("node", sa.String(length=200), nullable=False, comment="Node the rank runs on."),
        sa.Column("step", sa.BigInteger(), nullable=False, comment="Step number (0-based)."),
        sa.Column(
            "end_unix_ns",
            sa.BigInteger(),
            nullable=False,
            comment="End of the step, Unix time in nanoseconds.",
        ),
        sa.Column("duration_s", sa.Float(), nullable=True, comment="Step wall time, seconds."),
        sa.Column(
            "comm_wait_s",
            sa.Float(),
            nullable=True,
            comment="Communication the step waited for (not overlapped), seconds.",
        ),
        sa.Column(
            "compute_s", sa.Float(), nullable=True, comment="duration_s minus comm_wait_s, seconds."
        ),
        sa.Column(
            "communication_time_ratio",
            sa.Float(),
            nullable=True,
            comment="comm_wait_s / duration_s, ratio 0..1.",
        ),
        sa.Column(
            "comm_busy_s",
            sa.Float(),
            nullable=True,
            comment="Total time collectives ran, overlapped or not, seconds.",
        ),
        sa.Column("forward_s", sa.Float(), nullable=True, comment="Forward pass, seconds."),
        sa.Column("backward_s", sa.Float(), nullable=True, comment="Backward pass, seconds."),
        sa.Column("optimizer_s", sa.Float(), nullable=True, comment="Optimizer step, seconds."),
        sa.Column(
            "batch_size",
            sa.BigInteger(),
            nullable=True,
            comment="Samples in this rank's batch (count).",
        ),
        sa.Column(
            "samples_per_s",
            sa.Float(),
            nullable=True,
            comment="This rank's throughput, samples per second.",
        ),
        sa.Column(
            "loss",
            sa.Float(),
            nullable=True,
            comment="Training loss (NULL if not reported or not finite).",
        ),
        sa.Column(
            "loss_nonfinite",
            sa.Boolean(),
            nullable=False,
            comment="True if the loss was NaN or infinite.",
        ),
        sa.Column(
            "config_version",
            sa.BigInteger(),
            nullable=False,
            comment="Communication config version the step ran with.",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_steps")),
        comment="One training step of one rank.",
    )
    op.create_index(op.f("ix_steps_job_end_unix_ns"), "steps", ["job", "end_unix_ns"], unique=False)
    op.create_index(op.f("ix_steps_job_rank_step"), "steps", ["job", "rank", "step"], unique=False)

    op.create_table(
        "tuning_sessions",
        sa.Column("id", sa.String(length=64), nullable=False, comment="Session id."),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("state", sa.String(length=32), nullable=False, comment="The tuner's state."),
        sa.Column(
            "trigger",
            sa.String(length=200),
            nullable=False,
            comment="What started it (an alert, a user).",
        ),
        sa.Column("started_unix_s", sa.Float(), nullable=False, comment="Unix time in seconds."),
        sa.Column("ended_unix_s", sa.Float(), nullable=True, comment="Unix time in seconds."),
        sa.Column(
            "baseline_config",
            sa.JSON(),
            nullable=False,
            comment="Config before tuning, JSON object.",
        ),
        sa.Column(
            "best_config", sa.JSON(), nullable=True, comment="Best config found, JSON object."
        ),
        sa.Column(
            "baseline_score",
            sa.Float(),
            nullable=True,
            comment="Baseline throughput, samples per second.",
        ),
        sa.Column(
            "best_score", sa.Float(), nullable=True, comment="Best throughput, samples per second."
        ),
        sa.Column("reason", sa.Text(), nullable=False, comment="Why it ended as it did."),
        sa.Column(
            "aggregator_id",
            sa.String(length=128),
            nullable=True,
            comment="The aggregator shard that runs it.",
        ),
        sa.Column(
            "state_blob",
            sa.JSON(),
            nullable=False,
            comment="The tuner's resumable state, JSON object.",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tuning_sessions")),
        comment="One autotuning session of a job.",
    )
    op.create_index(op.f("ix_tuning_sessions_job"), "tuning_sessions", ["job"], unique=False)

    op.create_table(
        "alert_events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column(
            "alert_id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            nullable=False,
            comment="The episode (alerts.id).",
        ),
        sa.Column("state", sa.String(length=16), nullable=False, comment="State entered."),
        sa.Column(
            "ts_unix_s",
            sa.Float(),
            nullable=False,
            comment="When it was entered, Unix time in seconds.",
        ),
        sa.Column("value", sa.Float(), nullable=True, comment="Value at that moment."),
        sa.CheckConstraint(
            "state IN ('pending', 'firing', 'resolved')", name=op.f("ck_alert_events_state")
        ),
        sa.ForeignKeyConstraint(
            ["alert_id"], ["alerts.id"], name=op.f("fk_alert_events_alert_id_alerts")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_events")),
        comment="Each state transition of an alert episode.",
    )
    op.create_index(op.f("ix_alert_events_alert_id"), "alert_events", ["alert_id"], unique=False)

    op.create_table(
        "tuning_trials",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=False),
            nullable=False,
            comment="Surrogate key.",
        ),
        sa.Column(
            "session_id",
            sa.String(length=64),
            nullable=False,
            comment="The session (tuning_sessions.id).",
        ),
        sa.Column("job", sa.String(length=200), nullable=False, comment="Job name."),
        sa.Column("trial_index", sa.Integer(), nullable=False, comment="0-based trial number."),
        sa.Column("config", sa.JSON(), nullable=False, comment="Config tried, JSON object."),
        sa.Column(
            "command_id",
            sa.String(length=64),
            nullable=True,
            comment="The command that applied it (commands.id).",
        ),
        sa.Column("state", sa.String(length=32), nullable=False, comment="The trial's state."),
        sa.Column(
            "windows",
            sa.JSON(),
            nullable=False,
            comment="Throughput per measured window, JSON list of samples per second.",
        ),
        sa.Column(
            "score", sa.Float(), nullable=True, comment="Median of the windows, samples per second."
        ),
        sa.Column(
            "decision",
            sa.String(length=32),
            nullable=True,
            comment="keep, rollback, ... once decided.",
        ),
        sa.Column("reason", sa.Text(), nullable=False, comment="Why it was decided so."),
        sa.Column("started_unix_s", sa.Float(), nullable=False, comment="Unix time in seconds."),
        sa.Column("ended_unix_s", sa.Float(), nullable=True, comment="Unix time in seconds."),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["tuning_sessions.id"],
            name=op.f("fk_tuning_trials_session_id_tuning_sessions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tuning_trials")),
        comment="One config tried by a tuning session.",
    )
    op.create_index(
        op.f("ix_tuning_trials_session_id"), "tuning_trials", ["session_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_tuning_trials_session_id"), table_name="tuning_trials")
    op.drop_table("tuning_trials")
    op.drop_index(op.f("ix_alert_events_alert_id"), table_name="alert_events")
    op.drop_table("alert_events")
    op.drop_index(op.f("ix_tuning_sessions_job"), table_name="tuning_sessions")
    op.drop_table("tuning_sessions")
    op.drop_index(op.f("ix_steps_job_rank_step"), table_name="steps")
    op.drop_index(op.f("ix_steps_job_end_unix_ns"), table_name="steps")
    op.drop_table("steps")
    op.drop_table("rollups")
    op.drop_table("retention_state")
    op.drop_index(op.f("ix_rank_samples_job_rank_ts_unix_ns"), table_name="rank_samples")
    op.drop_table("rank_samples")
    op.drop_index(op.f("ix_probe_sessions_job_rank"), table_name="probe_sessions")
    op.drop_table("probe_sessions")
    op.drop_index(op.f("ix_node_samples_node_ts_unix_ns"), table_name="node_samples")
    op.drop_table("node_samples")
    op.drop_table("jobs")
    op.drop_table("ingest_seqs")
    op.drop_table("inflight_reports")
    op.drop_table("gpu_samples")
    op.drop_table("findings")
    op.drop_table("ddp_stats")
    op.drop_table("configs")
    op.drop_index(op.f("ix_commands_job_status"), table_name="commands")
    op.drop_table("commands")
    op.drop_index(op.f("ix_collectives_job_end_unix_ns"), table_name="collectives")
    op.drop_table("collectives")
    op.drop_index(op.f("ix_buckets_job_end_unix_ns"), table_name="buckets")
    op.drop_table("buckets")
    op.drop_index(op.f("ix_alerts_job_state"), table_name="alerts")
    op.drop_index(op.f("ix_alerts_fingerprint"), table_name="alerts")
    op.drop_table("alerts")
