"""The aggregator on the real PostgreSQL server: ingest, read-only query, two shards."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import create_engine, text

from tests.integration import wire_factory as wf
from tests.integration.aggregator_thread import AggregatorThread
from tests.pg import pg_url  # noqa: F401  (the fixture)
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.history.retention import apply_retention

pytestmark = pytest.mark.integration


def _scalar(url: str, sql: str) -> object:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql)).scalar()
    finally:
        engine.dispose()


def test_ingest_and_read_only_query_on_postgresql(pg_url: str) -> None:  # noqa: F811
    settings = AggregatorSettings(port=0, db_url=pg_url, token="t", aggregator_id="pg-1")
    with AggregatorThread(settings) as agg:
        h0, h1 = wf.hello("pgjob", 0, 2), wf.hello("pgjob", 1, 2)
        body = wf.ingest_body(
            "agent-pg",
            [
                (1, wf.record(h0, h1, samples=[wf.node_sample("pgjob", 2)])),
                (
                    2,
                    wf.record(
                        wf.batch(h0, 1, [wf.step(1), wf.step(2)]),
                        wf.batch(h1, 1, [wf.step(1), wf.step(2)]),
                    ),
                ),
            ],
        )
        assert agg.post_ingest(body) == (200, {"v": 1, "acked_seq": 2, "commands": []})
        assert agg.post_ingest(body)[0] == 200
        assert _scalar(pg_url, "SELECT count(*) FROM steps") == 4
        long_name = wf.hello("p" * 300, 0, 1)
        status, reply = agg.post_ingest(wf.ingest_body("agent-pg", [(3, wf.record(long_name))]))
        assert status == 400 and "job" in reply["error"]
        # A value the schema lets through but PostgreSQL refuses (text cannot hold NUL):
        # the ingest process answers it as bad input, 400, and keeps storing.
        nul = wf.hello("pg\x00job", 0, 1)
        status, reply = agg.post_ingest(wf.ingest_body("agent-pg", [(3, wf.record(nul))]))
        assert status == 400 and "refused a value" in reply["error"], reply
        assert agg.post_ingest(body)[0] == 200

        status, result = agg.post_json(
            "/api/v1/query",
            {"sql": "SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank"},
        )
        assert status == 200 and result["rows"] == [[0, 2], [1, 2]]
        for sql in (
            "DELETE FROM steps",
            "DROP TABLE steps",
            "CREATE TABLE x (a int)",
            "UPDATE jobs SET world_size = 9",
        ):
            status, reply = agg.post_json("/api/v1/query", {"sql": sql})
            assert status == 400 and "read-only" in reply["error"], (sql, reply)
        # Queries connect as the reader role that starting the aggregator made.
        status, reply = agg.post_json(
            "/api/v1/query", {"sql": "SELECT pg_read_file('/etc/passwd')"}
        )
        assert status == 400 and "permission denied for function pg_read_file" in reply["error"]
        assert _scalar(pg_url, "SELECT count(*) FROM steps") == 4
        assert _scalar(pg_url, "SELECT world_size FROM jobs") == 2


def test_two_aggregators_share_one_postgresql_each_owning_its_jobs(pg_url: str) -> None:  # noqa: F811
    shards: list[AggregatorThread] = []
    errors: list[BaseException] = []

    def start(name: str) -> None:
        # Both start (and migrate) at the same time: the advisory lock serialises them.
        try:
            settings = AggregatorSettings(port=0, db_url=pg_url, token="t", aggregator_id=name)
            shards.append(AggregatorThread(settings).__enter__())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(n,)) for n in ("shard-a", "shard-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        by_id = {s.settings.aggregator_id: s for s in shards}
        for shard_id, job, agent in (
            ("shard-a", "job-a", "agent-1"),
            ("shard-b", "job-b", "agent-2"),
        ):
            h = wf.hello(job, 0, 1)
            for seq in range(1, 4):
                records = [
                    (seq, wf.record(*([h] if seq == 1 else []), wf.batch(h, seq, [wf.step(seq)])))
                ]
                assert by_id[shard_id].post_ingest(wf.ingest_body(agent, records))[0] == 200
        # Same agent sequence numbers on both shards, different agents: no clash.
        assert _scalar(pg_url, "SELECT count(*) FROM ingest_seqs") == 6
        assert _scalar(pg_url, "SELECT count(*) FROM steps") == 6
        assert _scalar(pg_url, "SELECT aggregator_id FROM jobs WHERE job = 'job-a'") == "shard-a"
        assert _scalar(pg_url, "SELECT aggregator_id FROM jobs WHERE job = 'job-b'") == "shard-b"
        # Each shard's commands go to its own job's agent.
        status, command = by_id["shard-b"].post_json(
            "/api/v1/jobs/job-b/commands", {"args": {"codec": "fp16"}}
        )
        assert status == 202
        assert (
            by_id["shard-b"].post_ingest(wf.ingest_body("agent-2", []))[1]["commands"][0]["id"]
            == command["id"]
        )
        assert by_id["shard-a"].post_ingest(wf.ingest_body("agent-1", []))[1]["commands"] == []
        # Either shard answers history queries over both.
        status, result = by_id["shard-a"].post_json(
            "/api/v1/query", {"sql": "SELECT job, count(*) FROM steps GROUP BY job ORDER BY job"}
        )
        assert result["rows"] == [["job-a", 3], ["job-b", 3]]
        # Retention on both at once, ten minutes on (so every step is old enough to roll
        # up): neither fails, and the rollups count each step once.
        later = time.time() + 600
        with ThreadPoolExecutor(2) as pool:
            engines = [s.aggregator.store.engine for s in shards]
            reports = list(pool.map(lambda e: apply_retention(e, now_unix_s=later), engines))
        assert any(r.ran for r in reports), reports
        rolled = _scalar(pg_url, "SELECT sum(count) FROM rollups WHERE metric = 'duration_s'")
        assert rolled == 6
    finally:
        for shard in shards:
            shard.__exit__(None, None, None)
