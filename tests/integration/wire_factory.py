"""Valid wire records for aggregator tests: hellos, step batches, ingest bodies."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import msgspec

from torshmon.wire import (
    SCHEMA_VERSION,
    Batch,
    BucketStat,
    CollectiveStat,
    CommandAck,
    Hello,
    InflightOp,
    IngestBatch,
    IngestRecord,
    NodeSample,
    RankProcess,
    SpoolRecord,
    StepRecord,
    encode_json,
)


def hello(job: str, rank: int, world_size: int, session: str | None = None) -> Hello:
    return Hello(
        v=SCHEMA_VERSION,
        session=session or uuid.uuid4().hex,
        job=job,
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        node="node-a",
        pid=1000 + rank,
        backend="gloo",
        torch_version="2.13.0",
        probe_version="0.1.0",
    )


def step(
    n: int,
    *,
    duration_s: float = 0.1,
    comm_wait_s: float = 0.02,
    end_unix_ns: int | None = None,
    loss: float | None = 1.0,
    collectives: bool = True,
) -> StepRecord:
    end = end_unix_ns if end_unix_ns is not None else time.time_ns()
    stats = (
        [
            CollectiveStat(
                op="all_reduce",
                pg="0",
                dtype="float32",
                count=1,
                size_bytes=4_000_000,
                duration_s=comm_wait_s,
                max_duration_s=comm_wait_s,
                algbw_bytes_per_s=4e6 / comm_wait_s,
                busbw_bytes_per_s=4e6 / comm_wait_s,
                duration_hist=[0] * 6 + [1] + [0] * 8,
            )
        ]
        if collectives
        else []
    )
    return StepRecord(
        step=n,
        end_unix_ns=end,
        duration_s=duration_s,
        comm_wait_s=comm_wait_s,
        compute_s=duration_s - comm_wait_s,
        communication_time_ratio=comm_wait_s / duration_s,
        comm_busy_s=comm_wait_s,
        forward_s=0.03,
        backward_s=0.05,
        optimizer_s=0.01,
        batch_size=64,
        samples_per_s=64 / duration_s,
        loss=loss,
        collectives=stats,
    )


def step_naming(n: int, distinct: int) -> StepRecord:
    """A step whose collectives and buckets name ``distinct`` ops, process groups and
    codecs, a new one each, as a buggy or hostile probe could."""
    collectives = [
        CollectiveStat(
            op=f"op-{i}",
            pg=f"pg-{i}",
            dtype="float32",
            count=1,
            size_bytes=1000,
            duration_s=0.001,
            max_duration_s=0.001,
            algbw_bytes_per_s=1e6,
            busbw_bytes_per_s=1e6,
            duration_hist=[0] * 4 + [1] + [0] * 10,
        )
        for i in range(distinct)
    ]
    buckets = [
        BucketStat(
            index=i,
            size_bytes=1000,
            parameters=10,
            duration_s=0.001,
            codec=f"codec-{i}",
            wire_bytes=500,
            compression_ratio=0.5,
        )
        for i in range(distinct)
    ]
    return msgspec.structs.replace(
        step(n, collectives=False), collectives=collectives, buckets=buckets
    )


def batch(
    h: Hello,
    seq: int,
    steps: Sequence[StepRecord] = (),
    *,
    inflight: Sequence[InflightOp] = (),
    acks: Sequence[CommandAck] = (),
) -> Batch:
    return Batch(
        v=SCHEMA_VERSION,
        session=h.session,
        seq=seq,
        job=h.job,
        rank=h.rank,
        sent_unix_ns=time.time_ns(),
        dropped_records_total=0,
        steps=list(steps),
        inflight=list(inflight),
        command_acks=list(acks),
    )


def node_sample(job: str, ranks: int) -> NodeSample:
    return NodeSample(
        ts_unix_ns=time.time_ns(),
        node="node-a",
        cpu_utilization_ratio=0.5,
        memory_utilization_ratio=0.4,
        memory_used_bytes=8 << 30,
        io_wait_ratio=0.01,
        net_rx_bytes_total=1000,
        net_tx_bytes_total=2000,
        disk_read_bytes_total=3000,
        disk_write_bytes_total=4000,
        ranks=[RankProcess(job=job, rank=r, pid=1000 + r, rss_bytes=1 << 30) for r in range(ranks)],
    )


def ingest_body(
    agent_id: str, records: Sequence[tuple[int, SpoolRecord]], node: str = "node-a"
) -> bytes:
    return encode_json(
        IngestBatch(
            v=SCHEMA_VERSION,
            agent_id=agent_id,
            node=node,
            records=[IngestRecord(seq=seq, record=record) for seq, record in records],
        )
    )


def record(*messages: Hello | Batch, samples: Sequence[NodeSample] = ()) -> SpoolRecord:
    return SpoolRecord(messages=list(messages), node_samples=list(samples))
