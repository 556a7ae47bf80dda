"""Ingest's row building and writes: what a batch leaves in SQL (SQLite here; the same
writes on PostgreSQL run in tests/integration/test_aggregator_pg.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from tests.integration import wire_factory as wf
from torshmon.aggregator.core.stored import rebuild
from torshmon.aggregator.ingest import IngestStore, insert_rows
from torshmon.history.db import make_engine
from torshmon.history.migrate import upgrade
from torshmon.history.models import Base
from torshmon.wire import SCHEMA_VERSION, DdpStats, IngestBatch, IngestRecord, SpoolRecord

T = Base.metadata.tables


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    upgrade(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


def _batch() -> IngestBatch:
    hello = wf.hello("j", 0, 1)
    ddp = DdpStats(
        bucket_cap_bytes=25 << 20,
        bucket_sizes_bytes=[25 << 20, 1234],
        num_buckets_reduced=2,
        avg_forward_compute_s=0.01,
        avg_backward_compute_s=math.inf,
        avg_backward_comm_s=0.02,
        avg_backward_compute_comm_overlap_s=0.005,
    )
    steps = [
        wf.step(1, end_unix_ns=10**18),
        msgspec.structs.replace(wf.step(2, end_unix_ns=10**18 + 1), ddp=ddp, forward_s=math.inf),
        msgspec.structs.replace(wf.step(3, end_unix_ns=10**18 + 2, collectives=False), loss=None),
    ]
    record = SpoolRecord(messages=[hello, wf.batch(hello, 1, steps)], node_samples=[])
    return IngestBatch(
        v=SCHEMA_VERSION, agent_id="a", node="node-a", records=[IngestRecord(seq=1, record=record)]
    )


def test_steps_collectives_and_ddp_statistics_are_stored_as_sent(engine: Engine) -> None:
    stored = IngestStore(engine, aggregator_id="t").store(_batch())
    # 10 + 10 + 9 (no loss) step values, 4 per collective: an infinite value is a
    # measurement too, stored as NULL (SQL has no portable infinity).
    assert stored.samples == 29 + 2 * 4
    with engine.connect() as conn:
        steps = conn.execute(select(T["steps"]).order_by(T["steps"].c.step)).mappings().all()
        ddp = conn.execute(select(T["ddp_stats"])).mappings().one()
        collectives = conn.execute(select(T["collectives"].c.step)).scalars().all()
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["forward_s"] for s in steps] == [0.03, None, 0.03]
    assert steps[2]["loss"] is None
    assert sorted(collectives) == [1, 2]
    assert ddp["step"] == 2 and ddp["rank"] == 0
    assert ddp["bucket_sizes_bytes"] == [25 << 20, 1234]  # JSON, read back as a list
    assert ddp["avg_backward_compute_s"] is None
    assert ddp["avg_forward_compute_s"] == 0.01


def test_the_time_between_steps_is_stored_and_counted(engine: Engine) -> None:
    """eval_s and between_steps_comm_s (migration 0015) are measurements like the rest:
    stored, and counted in torshmon_ingest_samples_total (``Stored.samples``)."""
    hello = wf.hello("j", 0, 1)
    plain = wf.step(1, end_unix_ns=10**18, collectives=False)
    split = msgspec.structs.replace(
        wf.step(2, end_unix_ns=10**18 + 1, collectives=False),
        input_wait_s=0.125,
        eval_s=2.5,
        between_steps_comm_s=0.0625,
    )
    record = SpoolRecord(messages=[hello, wf.batch(hello, 1, [plain, split])], node_samples=[])
    batch = IngestBatch(
        v=SCHEMA_VERSION, agent_id="a", node="node-a", records=[IngestRecord(seq=1, record=record)]
    )
    stored = IngestStore(engine, aggregator_id="t").store(batch)
    # The factory's step carries 10 measurements (step time, comm wait, compute, ratio,
    # busy, forward, backward, optimizer, throughput, loss); the second 3 more.
    assert stored.samples == 10 + 13
    columns = T["steps"].c
    query = select(columns.input_wait_s, columns.eval_s, columns.between_steps_comm_s)
    with engine.connect() as conn:
        rows = conn.execute(query.order_by(columns.step)).all()
    assert [tuple(row) for row in rows] == [(None, None, None), (0.125, 2.5, 0.0625)]


def test_insert_rows_are_the_rows_store_writes(engine: Engine) -> None:
    batch = _batch()
    rows = insert_rows(batch, 5)
    IngestStore(engine, aggregator_id="t", clock_ns=lambda: 5).store(batch)
    with engine.connect() as conn:
        for table, (columns, expected) in rows.items():
            got = conn.execute(select(*(T[table].c[c] for c in columns))).all()
            if table == "ddp_stats":
                i = columns.index("bucket_sizes_bytes")  # JSON: compared as compact text
                got = [(*r[:i], msgspec.json.encode(r[i]).decode(), *r[i + 1 :]) for r in got]
                expected = [(*r[:i], r[i].replace(" ", ""), *r[i + 1 :]) for r in expected]
            assert sorted(map(tuple, got)) == sorted(expected), table


def test_rebuild_from_the_summary_is_what_store_returned(engine: Engine) -> None:
    """The ingest process sends back a summary; the loop rebuilds ``Stored`` from it and
    its own decoded batch: the same messages, in the same order, duplicates left out."""
    h0, h1 = wf.hello("j", 0, 2), wf.hello("j", 1, 2)
    first = IngestBatch(
        v=SCHEMA_VERSION,
        agent_id="a",
        node="n",
        records=[
            IngestRecord(seq=1, record=wf.record(h0, h1, wf.batch(h0, 1, [wf.step(1)]))),
            IngestRecord(seq=2, record=wf.record(wf.batch(h1, 1, [wf.step(1)]))),
        ],
    )
    store = IngestStore(engine, aggregator_id="t")
    store.store(first)
    # Record 1 again (skipped whole); a new record holding h0's batch 1 again (a resend
    # after an agent restart: skipped) and new batches of both ranks with a node sample.
    again = IngestBatch(
        v=SCHEMA_VERSION,
        agent_id="a",
        node="n",
        records=[
            first.records[0],
            IngestRecord(
                seq=3,
                record=wf.record(
                    wf.batch(h0, 1, [wf.step(1)]),
                    wf.batch(h0, 2, [wf.step(2)]),
                    h1,
                    wf.batch(h1, 2, [wf.step(2)]),
                    samples=[wf.node_sample("j", 2)],
                ),
            ),
        ],
    )
    stored = store.store(again)
    assert stored.skipped_records == [0]
    assert stored.skipped_batches == [(1, 0)]
    assert stored.duplicates == 2 and stored.records == 1
    rebuilt = rebuild(again, stored.summary())
    assert rebuilt == stored
    assert [(b.rank, b.seq) for b, _ in rebuilt.batches] == [(0, 2), (1, 2)]
