"""The aggregator keeps the evidence files ranks send and serves them: listed by job and
alert, downloadable under the token, size-capped, 404 for what it does not hold."""

from __future__ import annotations

import gzip
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.integration import wire_factory as wf
from tests.integration.aggregator_thread import AggregatorThread
from torshmon.aggregator.evidence import EvidenceSettings
from torshmon.aggregator.http.guard import SESSION_COOKIE, session_cookie
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.wire import EvidenceFile

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"
CAP_BYTES = 4096


@pytest.fixture
def agg(tmp_path: Path) -> Iterator[AggregatorThread]:
    settings = AggregatorSettings(
        port=0,
        db_url=f"sqlite:///{tmp_path / 'history.db'}",
        token=TOKEN,
        aggregator_id="agg-test",
        eval_interval_s=0.1,
        evidence=EvidenceSettings(capture_max_bytes=CAP_BYTES, dir=str(tmp_path / "evidence")),
    )
    with AggregatorThread(settings) as thread:
        yield thread


def _download(
    agg: AggregatorThread, path: str, token: str = TOKEN, cookie: str | None = None
) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if cookie is None else {"Cookie": cookie}
    req = urllib.request.Request(agg.url + path, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _send(agg: AggregatorThread, seq: int, rank: int, *files: EvidenceFile) -> None:
    h = wf.hello("j", rank, 2, session=f"s{rank}")
    batch = wf.batch(h, seq)
    batch = msgspec.structs.replace(batch, evidence=list(files))
    status, body = agg.post_ingest(wf.ingest_body("agent-1", [(seq, wf.record(h, batch))]))
    assert status == 200, body


def _file(capture: str, name: str, payload: bytes) -> EvidenceFile:
    return EvidenceFile(
        id=capture,
        name=name,
        size_bytes=len(payload),
        data_gzip=gzip.compress(payload),
        created_unix_ns=time.time_ns(),
    )


def test_files_are_kept_listed_downloaded_and_capped(agg: AggregatorThread, tmp_path: Path) -> None:
    status, body = agg.post_json("/api/v1/jobs/j/evidence", {"profile_ranks": [1]})
    assert status == 202, body
    capture = body["id"]
    dump = json.dumps({"version": "2.10", "entries": [{"collective_seq_id": 7}]}).encode()
    _send(agg, 1, 0, _file(capture, "flight_recorder.json", dump))
    # A resend of the same batch (the agent's retry) stores nothing twice.
    _send(agg, 1, 0, _file(capture, "flight_recorder.json", dump))
    # Over the capture's cap: incompressible bytes, kept as a row saying why.
    noise = bytes(range(256)) * 40
    big = EvidenceFile(
        id=capture, name="profiler_trace.json", size_bytes=len(noise), data_gzip=b"\x1f\x8b" + noise
    )
    _send(agg, 2, 1, big)

    status, body = agg.get("/api/v1/evidence?job=j")
    assert status == 200, body
    [listed] = body["captures"]
    assert listed["id"] == capture and listed["profile_ranks"] == [1] and listed["rule"] == ""
    files = {(f["rank"], f["name"]): f for f in listed["files"]}
    assert sorted(files) == [(0, "flight_recorder.json"), (1, "profiler_trace.json")]
    kept = files[(0, "flight_recorder.json")]
    assert kept["size_bytes"] == len(dump) and kept["error"] == ""
    assert kept["url"] == f"/api/v1/evidence/{capture}/0/flight_recorder.json"
    capped = files[(1, "profiler_trace.json")]
    assert "url" not in capped and f"cap of {CAP_BYTES} bytes" in capped["error"]
    assert not list((tmp_path / "evidence" / capture).glob("rank1-*"))

    status, data = _download(agg, kept["url"])
    assert status == 200 and json.loads(gzip.decompress(data)) == json.loads(dump)
    assert _download(agg, kept["url"], token="wrong")[0] == 401
    # The report page links here: a browser signed in to the pages downloads with its
    # session cookie; a forged one is refused.
    status, data = _download(agg, kept["url"], cookie=f"{SESSION_COOKIE}={session_cookie(TOKEN)}")
    assert status == 200 and json.loads(gzip.decompress(data)) == json.loads(dump)
    assert _download(agg, kept["url"], cookie=f"{SESSION_COOKIE}={session_cookie('x')}")[0] == 401
    status, data = _download(agg, f"/api/v1/evidence/{capture}/1/profiler_trace.json")
    assert status == 404 and b"cap of" in data


def test_unknown_evidence_is_404_and_bad_input_400(agg: AggregatorThread) -> None:
    status, body = agg.post_json("/api/v1/jobs/j/evidence", {})
    assert status == 202
    capture = body["id"]
    # A file for a capture this aggregator never asked for is not kept.
    _send(agg, 1, 0, _file("0123456789abcdef", "flight_recorder.json", b"{}"))
    for path in (
        "/api/v1/evidence/0123456789abcdef/0/flight_recorder.json",
        f"/api/v1/evidence/{capture}/0/flight_recorder.json",
        f"/api/v1/evidence/{capture}/x/flight_recorder.json",
        f"/api/v1/evidence/{capture}/0/etc-passwd",
        "/api/v1/evidence/..%2f..%2fetc/0/flight_recorder.json",
        "/api/v1/alerts/999/evidence",
        "/api/v1/alerts/abc/evidence",
    ):
        status, body = agg.get(path)
        assert status == 404, (path, body)
        assert "Traceback" not in json.dumps(body)
    assert agg.get("/api/v1/evidence?job=nope")[1] == {"captures": []}
    assert agg.get("/api/v1/evidence?color=red")[0] == 400
    assert agg.get("/api/v1/evidence?alert_id=x")[0] == 400
    assert agg.post_json("/api/v1/jobs/j/evidence", {"profile_ranks": "all"})[0] == 400
    assert agg.post_json("/api/v1/jobs/j/evidence", {"steps": 3})[0] == 400
