"""The aggregator's HTTP API against web pages and malformed requests, on a real server.

A page the operator opens can POST to 127.0.0.1 cross-site, and DNS rebinding lets it
read the answers; neither may work without a token. Whatever arrives, the answer is
never a 5xx and nothing is logged as an error.
"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration import wire_factory as wf
from tests.integration.aggregator_thread import AggregatorThread, count, request
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import AggregatorSettings, SettingsError

pytestmark = pytest.mark.integration

TOKEN = "guard-token"
JSON = {"Content-Type": "application/json"}
CONFIG = json.dumps({"kind": "config", "args": {"codec": "fp16"}}).encode()


def _settings(tmp_path: Path, **overrides: object) -> AggregatorSettings:
    return AggregatorSettings(
        port=0,
        db_url=f"sqlite:///{tmp_path / 'history.db'}",
        aggregator_id="agg-guard",
        eval_interval_s=0.2,
        **overrides,  # type: ignore[arg-type]
    )


@pytest.fixture
def open_agg(tmp_path: Path) -> Iterator[AggregatorThread]:
    """The default: loopback, no token."""
    with AggregatorThread(_settings(tmp_path)) as thread:
        yield thread


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        f"{r.levelname} {r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.ERROR or r.exc_info
    ]


def test_a_cross_site_post_queues_nothing(open_agg: AggregatorThread) -> None:
    """What a page can send without a preflight: text/plain, a form, an empty body,
    each with a foreign Origin or without one; nothing of it reaches the commands."""
    url = open_agg.url + "/api/v1/jobs/j/commands"
    for headers in (
        {"Content-Type": "text/plain", "Origin": "http://evil.example"},
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/x-www-form-urlencoded", "Sec-Fetch-Site": "cross-site"},
        {**JSON, "Origin": "http://evil.example"},
        {**JSON, "Origin": "null"},
        {**JSON, "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},
    ):
        status, reply = request(url, CONFIG, headers)
        assert status in (403, 415), (headers, status, reply)
        assert reply["status"] == status and reply["error"]
    for path in ("/api/v1/jobs/j/tune", "/api/v1/jobs/j/link-check"):
        status, reply = request(open_agg.url + path, b"", {"Content-Type": "text/plain"})
        assert status == 415 and "application/json" in reply["error"], (path, reply)
    status, reply = request(open_agg.url + "/api/v1/query", b'{"sql": "SELECT 1"}', {})
    assert status == 415, reply
    assert open_agg.aggregator.commands.reserve(["j"]) == []
    assert count(open_agg.settings.db_url, "commands") == 0

    # The same command from a non-browser client, or from the API's own origin, is queued.
    own = {**JSON, "Origin": open_agg.url, "Sec-Fetch-Site": "same-origin"}
    assert request(url, CONFIG, own)[0] == 202
    assert request(url, CONFIG, JSON)[0] == 202
    assert count(open_agg.settings.db_url, "commands") == 2


def test_a_foreign_host_is_refused_and_the_token_vouches_for_agents(tmp_path: Path) -> None:
    """DNS rebinding: the page's own name as Host. Refused without the token, on every
    path; agents on other nodes name the aggregator as they like, with the token."""
    (tmp_path / "open").mkdir()
    with AggregatorThread(_settings(tmp_path / "open", allowed_hosts=("agg.lan",))) as agg:
        port = agg.aggregator.port
        for path in ("/api/v1/jobs", "/metrics", "/healthz"):
            status, reply = request(agg.url + path, None, {"Host": f"evil.example:{port}"})
            assert status == 421, (path, reply)
        assert "--allowed-host evil.example" in reply["error"]
        status, reply = request(
            agg.url + "/api/v1/query",
            b'{"sql": "SELECT 1"}',
            {
                **JSON,
                "Host": f"rebound.evil.example:{port}",
            },
        )
        assert status == 421, reply
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"agg.lan:{port}", "10.9.8.7"):
            assert request(agg.url + "/api/v1/jobs", None, {"Host": host})[0] == 200, host

    (tmp_path / "token").mkdir()
    with AggregatorThread(_settings(tmp_path / "token", token=TOKEN)) as agg:
        name = {"Host": f"aggregator.cluster:{agg.aggregator.port}"}
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert request(agg.url + "/api/v1/jobs", None, {**name, **bearer})[0] == 200
        h0 = wf.hello("j", 0, 1)
        body = wf.ingest_body("agent-1", [(1, wf.record(h0, wf.batch(h0, 1, [wf.step(1)])))])
        ingest = {**name, **bearer, **JSON, "Content-Encoding": "gzip"}
        status, reply = request(agg.url + "/api/v1/ingest", gzip.compress(body), ingest)
        assert status == 200 and reply["acked_seq"] == 1
        assert request(agg.url + "/metrics", None, name)[0] == 421
        wrong = {**name, "Authorization": "Bearer guess"}
        assert request(agg.url + "/api/v1/jobs", None, wrong)[0] == 421


def test_malformed_bodies_are_a_4xx_naming_the_problem_and_log_no_error(
    open_agg: AggregatorThread, caplog: pytest.LogCaptureFixture
) -> None:
    plain = b'{"sql": "SELECT 1"}'
    deep = b"[" * 100_000 + b"]" * 100_000
    cases: list[tuple[bytes, dict[str, str], int, str]] = [
        (b'{"kind": "config", "args": ' + deep + b"}", JSON, 400, "nested too deep"),
        (b'{"kind": "config", "args": {"codec": "\xff"}}', JSON, 400, "UTF-8"),
        (b'{"sql": "\\ud800"}', JSON, 400, "not valid JSON"),  # a lone surrogate
        (b'{"sql": NaN}', JSON, 400, "not valid JSON"),
        (b"[1, 2]", JSON, 400, "must be a JSON object"),
        (plain, {**JSON, "Content-Encoding": "gzip"}, 400, "not valid gzip"),
        (gzip.compress(plain), {**JSON, "Content-Encoding": "deflate"}, 415, "deflate"),
        (zlib.compress(plain), {**JSON, "Content-Encoding": "br"}, 415, "'br' is not supported"),
        (gzip.compress(plain) + b"junk", {**JSON, "Content-Encoding": "gzip"}, 400, "follow"),
        (gzip.compress(plain)[:-4], {**JSON, "Content-Encoding": "gzip"}, 400, "truncated"),
        (gzip.compress(b"\0" * (80 << 20)), {**JSON, "Content-Encoding": "gzip"}, 413, "over"),
    ]
    for path in ("/api/v1/jobs/j/commands", "/api/v1/query", "/api/v1/ingest"):
        for body, headers, status, reason in cases:
            got, reply = request(open_agg.url + path, body, headers)
            if path == "/api/v1/ingest" and "Content-Encoding" not in headers:
                # The wire schema says what is wrong there (an IngestBatch is expected).
                assert got == 400 and "IngestBatch" in reply["error"], (path, reason, reply)
                continue
            assert (got, reply["status"]) == (status, status), (path, reason, reply)
            assert reason in reply["error"], (path, reply)
    assert count(open_agg.settings.db_url, "commands") == 0
    assert _errors(caplog) == []


def test_malformed_http_is_a_400_and_logs_no_error(
    open_agg: AggregatorThread, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp answers these itself; its log said "Error handling request" with a
    traceback for each (a client's fault, not the aggregator's)."""
    port = open_agg.aggregator.port or 0
    no_host = b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"
    bad_chunk = (
        b"POST /api/v1/query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
    )
    for raw in (no_host, bad_chunk):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(raw)
            answer = sock.recv(4096)
        assert answer.split(b" ", 2)[1] == b"400", answer
    assert _errors(caplog) == []


def test_a_non_loopback_address_without_a_token_does_not_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORSHMON_")}
    done = subprocess.run(
        [sys.executable, "-m", "torshmon.cli", "aggregator", "--host", "0.0.0.0", "--port", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torshmon aggregator: host '0.0.0.0'")
    assert "--token-file" in lines[0] and "TORSHMON_TOKEN" in lines[0]
    assert not (tmp_path / "torshmon.db").exists()
    # The settings refuse, so no Aggregator can be built to listen there either.
    with pytest.raises(SettingsError, match="TORSHMON_TOKEN"):
        Aggregator(_settings(tmp_path, host="0.0.0.0"))


# -- fuzz ------------------------------------------------------------------------------

PATHS = (
    "/api/v1/ingest",
    "/api/v1/jobs/j/commands",
    "/api/v1/jobs/j/tune",
    "/api/v1/jobs/j/link-check",
    "/api/v1/query",
    "/api/v1/jobs",
    "/api/v1/alerts?limit=5",
    "/metrics",
    "/healthz",
    "/nowhere",
)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
payloads = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"kind": st.sampled_from(["config", "link_check", "x"]), "args": json_values}
    ).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"sql": st.sampled_from(["SELECT 1", "DELETE FROM steps", "x"])}).map(
        lambda v: json.dumps(v).encode()
    ),
    st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
    st.binary(max_size=200),
    st.just(b""),
)


@st.composite
def encoded(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """A payload and the Content-Encoding it is sent with (None: no header); the two
    agree, disagree, or the bytes are damaged."""
    body = draw(payloads)
    how = draw(st.sampled_from(["plain", "gzip", "gzip-junk", "gzip-cut", "zlib", "gzip2"]))
    if how == "gzip":
        body = gzip.compress(body)
    elif how == "gzip-junk":
        body = gzip.compress(body) + draw(st.binary(min_size=1, max_size=20))
    elif how == "gzip-cut":
        packed = gzip.compress(body)
        body = packed[: draw(st.integers(0, len(packed) - 1))]
    elif how == "zlib":
        body = zlib.compress(body)
    elif how == "gzip2":
        body = gzip.compress(gzip.compress(body))
    coding = draw(
        st.sampled_from([None, "gzip", "GZIP", "identity", "deflate", "br", "zstd", "gzip, br"])
        | header_text
    )
    return body, coding


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, str, bytes | None, dict[str, str]]:
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]))
    path = draw(st.sampled_from(PATHS))
    headers: dict[str, str] = {}
    body: bytes | None = None
    if method != "GET" or draw(st.booleans()):
        body, coding = draw(encoded())
        if coding is not None:
            headers["Content-Encoding"] = coding
    content_type = draw(
        st.sampled_from(
            [
                "application/json",
                "application/json; charset=latin-1",
                "application/json; charset=bogus",
                "text/plain",
                "application/x-www-form-urlencoded",
                None,
            ]
        )
        | header_text
    )
    if content_type is not None:
        headers["Content-Type"] = content_type
    optional = {
        "Host": st.sampled_from(["127.0.0.1", "localhost:1", "evil.example", "[::1]", "", "a@b"])
        | header_text,
        "Origin": st.sampled_from(["null", "http://evil.example", "http://127.0.0.1"])
        | header_text,
        "Sec-Fetch-Site": st.sampled_from(["cross-site", "same-site", "same-origin", "none"]),
        "Sec-Fetch-Mode": st.sampled_from(["navigate", "cors", "no-cors"]),
        "Authorization": st.sampled_from(["Bearer x", "Basic Zm9v"]) | header_text,
    }
    for name, values in optional.items():
        if draw(st.booleans()):
            headers[name] = draw(values)
    return method, path, body, headers


def _send(port: int, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        # Headers go as drawn (a Host of their own, or none at all: skip_host).
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.fixture
def fuzz_agg(tmp_path: Path) -> Iterator[AggregatorThread]:
    with AggregatorThread(_settings(tmp_path, max_body_bytes=1 << 20)) as thread:
        yield thread


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(http_requests())
def test_fuzzed_requests_never_get_a_5xx_nor_log_an_error(
    fuzz_agg: AggregatorThread,
    caplog: pytest.LogCaptureFixture,
    drawn: tuple[str, str, bytes | None, dict[str, str]],
) -> None:
    caplog.clear()
    method, path, body, headers = drawn
    status = _send(fuzz_agg.aggregator.port or 0, method, path, body, headers)
    assert status < 500, (status, drawn)
    assert _errors(caplog) == [], drawn
