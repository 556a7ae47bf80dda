"""The bottleneck report in the running aggregator: steps with input wait POSTed over
HTTP become a stored finding episode that opens, shows in the report API and in
``/metrics``, and closes once the job recovers; input wait lands in ``steps``."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from sqlalchemy import create_engine, text

from tests.integration import wire_factory as wf
from tests.integration.aggregator_thread import AggregatorThread
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.wire import StepRecord

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"


@pytest.fixture
def agg(tmp_path: Path) -> Iterator[AggregatorThread]:
    settings = AggregatorSettings(
        port=0,
        db_url=f"sqlite:///{tmp_path / 'history.db'}",
        token=TOKEN,
        aggregator_id="agg-findings",
        eval_interval_s=0.1,
    )
    with AggregatorThread(settings) as thread:
        yield thread


def _steps(first: int, count: int, input_wait_s: float) -> list[StepRecord]:
    now = time.time_ns()
    return [
        msgspec.structs.replace(
            wf.step(n, end_unix_ns=now - (first + count - n) * 10**8), input_wait_s=input_wait_s
        )
        for n in range(first, first + count)
    ]


def _rows(url: str, sql: str) -> list[dict[str, Any]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [dict(row) for row in conn.execute(text(sql)).mappings()]
    finally:
        engine.dispose()


def _wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_an_input_bound_job_opens_reports_exports_and_closes_a_finding(
    agg: AggregatorThread,
) -> None:
    url = agg.settings.db_url
    h0, h1 = wf.hello("j", 0, 2), wf.hello("j", 1, 2)
    starved = [(1, wf.record(h0, h1))] + [
        (seq, wf.record(wf.batch(h, seq, _steps(seq * 10 - 19, 10, 0.12))))
        for seq in range(2, 6)
        for h in (h0, h1)
    ]
    for seq, record in starved:
        status, reply = agg.post_ingest(
            wf.ingest_body(f"agent-{record.messages[0].rank}", [(seq, record)])
        )
        assert status == 200, reply
    opened = _wait_for(
        "an open input finding",
        lambda: _rows(
            url,
            "SELECT * FROM findings WHERE kind = 'bottleneck' AND category = 'input' "
            "AND ended_unix_s IS NULL",
        ),
    )
    (row,) = opened
    assert (row["job"], row["metric"], row["difficulty"], row["aggregator_id"]) == (
        "j",
        "input_wait_time_ratio",
        "easy",
        "agg-findings",
    )
    assert row["value"] == pytest.approx(0.12 / 0.22, rel=0.01)
    assert row["expected_gain_ratio"] == pytest.approx(0.12 / 0.22, rel=0.01)
    assert row["priority"] == 1
    inputs = _rows(url, "SELECT count(*) AS n FROM steps WHERE input_wait_s = 0.12")
    assert inputs == [{"n": 80}]

    status, report = agg.get("/api/v1/jobs/j/report")
    assert status == 200
    assert report["job_kind"] == "ddp"
    first = report["bottlenecks"][0]
    assert (first["category"], first["priority"], first["severity"]) == ("input", 1, "high")
    assert "num_workers" in first["recommendation"]

    req = urllib.request.Request(agg.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as response:
        exposition = response.read().decode()
    assert 'torshmon_bottleneck_active{category="input",job="j"} 1.0' in exposition

    # The loader catches up: 60 steps without input wait push the starved ones out of
    # the recent window, and the episode closes.
    for seq in range(6, 12):
        for h in (h0, h1):
            body = wf.ingest_body(
                f"agent-{h.rank}",
                [(seq, wf.record(wf.batch(h, seq, _steps(seq * 10 - 19, 10, 0.0))))],
            )
            status, reply = agg.post_ingest(body)
            assert status == 200, reply
    (closed,) = _wait_for(
        "the input finding to close",
        lambda: _rows(
            url,
            "SELECT * FROM findings WHERE category = 'input' AND ended_unix_s IS NOT NULL",
        ),
    )
    assert closed["id"] == row["id"]
    # An episode seen at one evaluation only (the steps came between two) has no length.
    assert closed["detected_unix_s"] <= closed["ended_unix_s"]
    assert _rows(url, "SELECT count(*) AS n FROM findings WHERE category = 'input'") == [{"n": 1}]
