"""The aggregator's HTTP service with a real SQLite file: ingest, API, commands, query."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.integration import wire_factory as wf
from tests.integration.aggregator_thread import AggregatorThread, count, request
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.wire import CommandAck

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"


@pytest.fixture
def agg(tmp_path: Path) -> Iterator[AggregatorThread]:
    settings = AggregatorSettings(
        port=0,
        db_url=f"sqlite:///{tmp_path / 'history.db'}",
        token=TOKEN,
        aggregator_id="agg-test",
        eval_interval_s=0.1,
    )
    with AggregatorThread(settings) as thread:
        yield thread


def test_ingest_stores_every_row_once(agg: AggregatorThread) -> None:
    h0, h1 = wf.hello("j", 0, 2), wf.hello("j", 1, 2)
    body = wf.ingest_body(
        "agent-1",
        [
            (1, wf.record(h0, h1, samples=[wf.node_sample("j", 2)])),
            (
                2,
                wf.record(
                    wf.batch(h0, 1, [wf.step(1), wf.step(2)]),
                    wf.batch(h1, 1, [wf.step(1), wf.step(2)]),
                ),
            ),
            (3, wf.record(wf.batch(h0, 2, [wf.step(3)]), wf.batch(h1, 2, [wf.step(3)]))),
        ],
    )
    status, reply = agg.post_ingest(body)
    assert status == 200, reply
    assert reply["acked_seq"] == 3
    url = agg.settings.db_url
    assert count(url, "steps") == 6
    assert count(url, "collectives") == 6
    assert count(url, "node_samples") == 1
    assert count(url, "rank_samples") == 2
    assert count(url, "probe_sessions") == 2

    # The same body again (a lost reply): acknowledged, nothing stored twice.
    status, reply = agg.post_ingest(body)
    assert status == 200 and reply["acked_seq"] == 3
    assert count(url, "steps") == 6

    # An agent that restarted resends its probe's last batch under a new agent seq.
    resent = wf.ingest_body("agent-1", [(4, wf.record(wf.batch(h0, 2, [wf.step(3)])))])
    status, reply = agg.post_ingest(resent)
    assert status == 200 and reply["acked_seq"] == 4
    assert count(url, "steps") == 6

    # The API sees the job and its ranks.
    status, jobs = agg.get("/api/v1/jobs")
    assert status == 200 and [j["job"] for j in jobs["jobs"]] == ["j"]
    assert jobs["jobs"][0]["world_size"] == 2
    assert jobs["jobs"][0]["live"]["last_step"] == 3
    status, ranks = agg.get("/api/v1/jobs/j/ranks")
    assert status == 200 and sorted(r["rank"] for r in ranks["ranks"]) == [0, 1]


def test_bad_input_is_a_clear_4xx_and_loses_nothing(agg: AggregatorThread) -> None:
    h0 = wf.hello("j", 0, 1)
    good = wf.ingest_body("agent-1", [(1, wf.record(h0, wf.batch(h0, 1, [wf.step(1)])))])
    assert agg.post_ingest(good)[0] == 200
    url = agg.settings.db_url

    status, reply = agg.post_ingest(good, token="wrong")
    assert status == 401 and "token" in reply["error"]
    status, reply = agg.post_ingest(b"{not json")
    assert status == 400 and "IngestBatch" in reply["error"]
    wrong_type = json.loads(good)
    wrong_type["records"][0]["seq"] = "seven"
    status, reply = agg.post_ingest(json.dumps(wrong_type).encode())
    assert status == 400 and "$.records[0].seq" in reply["error"]
    too_big = json.loads(good)
    too_big["records"][0]["seq"] = 2**70
    status, reply = agg.post_ingest(json.dumps(too_big).encode())
    assert status == 400 and "seq" in reply["error"]
    long_job = json.loads(good)
    long_job["records"][0]["record"]["messages"][0]["job"] = "x" * 500
    status, reply = agg.post_ingest(json.dumps(long_job).encode())
    assert status == 400 and "job" in reply["error"]
    status, reply = agg.post_ingest(b"\x1f\x8b not really gzip", compress=False)
    assert 400 <= status < 500
    headers = {
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
        "Authorization": f"Bearer {TOKEN}",
    }
    status, reply = request(agg.url + "/api/v1/ingest", b"\x1f\x8b\x08\x00garbage", headers)
    assert 400 <= status < 500, reply
    huge = b'{"v":1,"agent_id":"a","node":"n","records":[' + b" " * (70 * 1024 * 1024) + b"]}"
    status, reply = agg.post_ingest(huge)
    assert status == 413
    future = json.loads(good)
    future["v"] = 99
    status, reply = agg.post_ingest(json.dumps(future).encode())
    assert status == 400 and "version" in reply["error"]

    assert count(url, "steps") == 1
    assert agg.get("/healthz")[0] == 200
    h1 = wf.hello("j", 0, 1)
    later = wf.ingest_body("agent-1", [(2, wf.record(h1, wf.batch(h1, 1, [wf.step(2)])))])
    assert agg.post_ingest(later)[0] == 200
    assert count(url, "steps") == 2


def test_commands_go_to_the_rank0_agent_and_acks_come_back(agg: AggregatorThread) -> None:
    h0, h1 = wf.hello("j", 0, 2), wf.hello("j", 1, 2)
    # rank 1 is served by agent-b, rank 0 by agent-a
    assert (
        agg.post_ingest(
            wf.ingest_body("agent-b", [(1, wf.record(h1, wf.batch(h1, 1, [wf.step(1)])))])
        )[0]
        == 200
    )
    assert (
        agg.post_ingest(
            wf.ingest_body("agent-a", [(1, wf.record(h0, wf.batch(h0, 1, [wf.step(1)])))])
        )[0]
        == 200
    )

    status, command = agg.post_json(
        "/api/v1/jobs/j/commands", {"kind": "config", "args": {"codec": "fp16"}}
    )
    assert status == 202 and command["status"] == "pending"
    status, reply = agg.post_json("/api/v1/jobs/j/commands", {"kind": "reboot", "args": {}})
    assert status == 400 and "reboot" in reply["error"]

    # agent-b polls: nothing for it. agent-a polls: the command, once.
    status, reply = agg.post_ingest(wf.ingest_body("agent-b", []))
    assert status == 200 and reply["commands"] == [] and reply["acked_seq"] == 1
    status, reply = agg.post_ingest(wf.ingest_body("agent-a", []))
    assert [c["id"] for c in reply["commands"]] == [command["id"]]
    assert reply["commands"][0]["args"] == {"codec": "fp16"}
    status, reply = agg.post_ingest(wf.ingest_body("agent-a", []))
    assert reply["commands"] == []
    assert agg.get(f"/api/v1/commands/{command['id']}")[1]["status"] == "sent"

    ack = CommandAck(id=command["id"], job="j", status="applied", version=1, effective_step=10)
    body = wf.ingest_body("agent-a", [(2, wf.record(wf.batch(h0, 2, [wf.step(2)], acks=[ack])))])
    assert agg.post_ingest(body)[0] == 200
    status, got = agg.get(f"/api/v1/commands/{command['id']}")
    assert got["status"] == "applied" and got["effective_step"] == 10
    engine = create_engine(agg.settings.db_url)
    with engine.connect() as conn:
        row = conn.execute(text("SELECT status, effective_step FROM commands")).one()
    engine.dispose()
    assert tuple(row) == ("applied", 10)


def test_query_api_is_read_only(agg: AggregatorThread) -> None:
    h0 = wf.hello("j", 0, 1)
    agg.post_ingest(
        wf.ingest_body("a", [(1, wf.record(h0, wf.batch(h0, 1, [wf.step(1), wf.step(2)])))])
    )
    status, result = agg.post_json(
        "/api/v1/query", {"sql": "SELECT rank, count(*) AS n FROM steps GROUP BY rank"}
    )
    assert status == 200 and result["columns"] == ["rank", "n"] and result["rows"] == [[0, 2]]
    for sql in (
        "DELETE FROM steps",
        "DROP TABLE steps",
        "ATTACH DATABASE ':memory:' AS x",
        "PRAGMA user_version=3",
    ):
        status, reply = agg.post_json("/api/v1/query", {"sql": sql})
        assert status == 400, (sql, reply)
        assert reply["error"]
    assert count(agg.settings.db_url, "steps") == 2
    status, reply = agg.post_json("/api/v1/query", {"sql": "SELECT 1", "format": "xml"})
    assert status == 400 and "format" in reply["error"]


def test_query_api_answers_strict_json_for_any_value(agg: AggregatorThread) -> None:
    """An infinity, a NaN, a blob: JSON has no infinity or NaN (null) and no bytes (hex),
    as the CLI's json output has them; Python's own json would write Infinity."""
    body = json.dumps({"sql": "SELECT 9e999 AS inf, -9e999 AS ninf, x'00ff' AS blob, 1.5 AS x"})
    req = urllib.request.Request(
        agg.url + "/api/v1/query",
        data=body.encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        raw = resp.read()

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    reply = json.loads(raw, parse_constant=refuse)
    assert reply["columns"] == ["inf", "ninf", "blob", "x"]
    assert reply["rows"] == [[None, None, "00ff", 1.5]]


def test_link_check_arguments_are_checked_on_either_endpoint(agg: AggregatorThread) -> None:
    """The link-check endpoint and the generic commands endpoint refuse the same bad
    arguments with the same 400, and queue nothing for them."""
    bad = [
        ({"size_bytes": "big"}, "size_bytes must be an integer, got 'big'"),
        ({"repeats": True}, "repeats must be an integer, got True"),
        ({"bogus": 1}, "unknown field(s) bogus; allowed: size_bytes, repeats"),
    ]
    for args, message in bad:
        for path, payload in (
            ("/api/v1/jobs/j/link-check", args),
            ("/api/v1/jobs/j/commands", {"kind": "link_check", "args": args}),
        ):
            status, reply = agg.post_json(path, payload)
            assert (status, reply["error"]) == (400, message), (path, args)
    assert count(agg.settings.db_url, "commands") == 0
    status, reply = agg.post_json(
        "/api/v1/jobs/j/commands", {"kind": "link_check", "args": {"size_bytes": 1024}}
    )
    assert status == 202, reply
    assert count(agg.settings.db_url, "commands") == 1


def test_api_errors_and_openapi(agg: AggregatorThread) -> None:
    status, doc = request(agg.url + "/api/v1/openapi.json", None, {})
    assert status == 200 and doc["openapi"].startswith("3.")
    assert "IngestBatch" in doc["components"]["schemas"]
    assert "/api/v1/alerts" in doc["paths"] and "/api/v1/ingest" in doc["paths"]
    # Row schemas come from the models: columns, types and their comments.
    jobs_row = doc["components"]["schemas"]["row_jobs"]["properties"]
    assert jobs_row["world_size"]["anyOf"][0] == {"type": "integer"}
    assert jobs_row["job"]["type"] == "string" and jobs_row["job"]["maxLength"] == 200
    assert agg.get("/api/v1/jobs/nope")[0] == 404
    assert agg.get("/api/v1/alerts?limit=0")[0] == 400
    assert agg.get("/api/v1/alerts?colour=red")[0] == 400
    assert request(agg.url + "/api/v1/alerts", None, {})[0] == 401
    assert request(agg.url + "/metrics", None, {})[0] == 200


def test_metrics_are_valid_exposition_with_design_names(agg: AggregatorThread) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    h0, h1 = wf.hello("j", 0, 2), wf.hello("j", 1, 2)
    agg.post_ingest(
        wf.ingest_body(
            "a",
            [
                (
                    1,
                    wf.record(
                        h0,
                        h1,
                        wf.batch(h0, 1, [wf.step(1)]),
                        wf.batch(h1, 1, [wf.step(1)]),
                        samples=[wf.node_sample("j", 2)],
                    ),
                )
            ],
        )
    )
    import urllib.request

    with urllib.request.urlopen(agg.url + "/metrics", timeout=10) as resp:
        exposition = resp.read().decode()
    names = {f.name for f in text_string_to_metric_families(exposition)}
    for name in (
        "torshmon_communication_time_ratio",
        "torshmon_step_seconds",
        "torshmon_comm_wait_seconds",
        "torshmon_compute_seconds",
        "torshmon_training_efficiency_ratio",
        "torshmon_throughput_samples_per_second",
        "torshmon_step_duration_seconds",
        "torshmon_collective_duration_seconds",
        "torshmon_ingest_samples",
    ):
        assert name in names, name
    assert 'torshmon_step_duration_seconds_count{job="j",rank="1"} 1.0' in exposition
    # Node series are the agents' to export, even though the aggregator keeps the samples.
    assert "torshmon_memory_utilization_ratio" not in names


def test_the_ingest_sample_counter_counts_the_time_between_steps(agg: AggregatorThread) -> None:
    """eval_s and between_steps_comm_s are measurements: /metrics counts them."""
    import msgspec
    from prometheus_client.parser import text_string_to_metric_families

    h0 = wf.hello("j", 0, 1)
    step = msgspec.structs.replace(
        wf.step(1, collectives=False), eval_s=1.5, between_steps_comm_s=0.25
    )
    body = wf.ingest_body("a", [(1, wf.record(h0, wf.batch(h0, 1, [step])))])
    assert agg.post_ingest(body)[0] == 200
    with urllib.request.urlopen(agg.url + "/metrics", timeout=10) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    (sample,) = families["torshmon_ingest_samples"].samples[:1]
    # The factory's 10 (step time to loss) and the two between the steps.
    assert sample.name == "torshmon_ingest_samples_total" and sample.value == 12


def test_plain_json_bodies_are_accepted_too(agg: AggregatorThread) -> None:
    h0 = wf.hello("j", 0, 1)
    body = wf.ingest_body("a", [(1, wf.record(h0, wf.batch(h0, 1, [wf.step(1)])))])
    assert agg.post_ingest(body, compress=False) == (200, {"v": 1, "acked_seq": 1, "commands": []})
    assert count(agg.settings.db_url, "steps") == 1


def test_2000_distinct_ops_groups_and_codecs_leave_metrics_small(agg: AggregatorThread) -> None:
    """Past the cap of distinct values per job, op, pg and codec fold into 'other'."""
    from prometheus_client.parser import text_string_to_metric_families

    from torshmon.labels import MAX_LABEL_VALUES

    h = wf.hello("wide", 0, 1)
    batch = wf.batch(h, 1, [wf.step_naming(1, 2000)])
    status, reply = agg.post_ingest(wf.ingest_body("a", [(1, wf.record(h, batch))]))
    assert status == 200, reply
    with urllib.request.urlopen(agg.url + "/metrics", timeout=10) as resp:
        exposition = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(exposition)}
    busbw = families["torshmon_collective_busbw_bytes_per_second"].samples
    assert len([s for s in busbw if s.labels["job"] == "wide"]) == MAX_LABEL_VALUES + 1
    ratios = families["torshmon_compression_ratio"].samples
    assert len([s for s in ratios if s.labels["job"] == "wide"]) == MAX_LABEL_VALUES + 1
    folded = {
        s.labels["label"]: s.value
        for s in families["torshmon_label_values_folded"].samples
        if s.name.endswith("_total") and s.labels["job"] == "wide"
    }
    assert folded == {"op": 1936, "pg": 1936, "codec": 1936}
    assert len(exposition) < 256 * 1024
    # History rows are not labels: every collective is stored under its own name.
    assert count(agg.settings.db_url, "collectives") == 2000
