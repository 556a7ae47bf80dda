"""Silences and acknowledgements through the real aggregator, its HTTP API and the CLI.

A real webhook receiver on loopback counts what the aggregator tells; the alert comes
from a threshold rule on data posted through the ingest, so the test decides when it
fires and resolves; ``torshmon silence`` / ``torshmon alerts`` run as a user runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.integration import wire_factory as wf
from tests.integration.aggregator_thread import AggregatorThread, request
from torshmon.aggregator.notify.targets import WebhookTarget
from torshmon.aggregator.settings import AggregatorSettings

pytestmark = pytest.mark.integration

TOKEN = "lifecycle-token-1234"
RULES = """\
rules:
  - name: Comm Heavy
    kind: threshold
    metric: communication_time_ratio
    op: ">"
    value: 0.5
    for: 0s
    severity: warning
    actions: [notify]
"""


class Hook:
    """A webhook endpoint on 127.0.0.1 that keeps every alert it is told, in order."""

    def __init__(self) -> None:
        self.alerts: list[tuple[str, str]] = []  # (status, alertname)
        self.changed = threading.Condition()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with hook.changed:
                    hook.alerts += [(a["status"], a["labels"]["alertname"]) for a in body["alerts"]]
                    hook.changed.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def wait_for(self, count: int, timeout_s: float = 10.0) -> list[tuple[str, str]]:
        with self.changed:
            self.changed.wait_for(lambda: len(self.alerts) >= count, timeout_s)
            return list(self.alerts)


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook()
    yield h
    h.server.shutdown()


def _settings(tmp_path: Path) -> AggregatorSettings:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    return AggregatorSettings(
        port=0,
        db_url=f"sqlite:///{tmp_path / 'h.db'}",
        token=TOKEN,
        aggregator_id="a1",
        rules_path=str(rules),
        eval_interval_s=60,  # the test evaluates when it chooses
        eval_on_finding=False,
    )


class Job:
    """Two ranks posting steps through the ingest; ``heavy`` steps wait 80% in comm
    (``wait_s`` of their 0.1 s, where given)."""

    def __init__(self, agg: AggregatorThread) -> None:
        self.agg = agg
        self.hellos = [wf.hello("j", 0, 2), wf.hello("j", 1, 2)]
        self.seq = 1
        self.step = 1
        self._post(*self.hellos)

    def _post(self, *messages: Any) -> None:
        body = wf.ingest_body("agent", [(self.seq, wf.record(*messages))])
        assert self.agg.post_ingest(body)[0] == 200
        self.seq += 1

    def steps(self, n: int, *, heavy: bool, wait_s: float | None = None) -> None:
        for _ in range(n):
            wait = wait_s if wait_s is not None else 0.08 if heavy else 0.01
            self._post(
                *(
                    wf.batch(h, self.step, [wf.step(self.step, duration_s=0.1, comm_wait_s=wait)])
                    for h in self.hellos
                )
            )
            self.step += 1

    def evaluate(self) -> list[tuple[str, str]]:
        return [
            (a.state, a.labels.get("rank", ""))
            for a in self.agg.call(self.agg.aggregator.evaluate())
        ]


def _cli(agg: AggregatorThread, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    env = {**os.environ, "TORSHMON_AGGREGATOR_URL": agg.url, "TORSHMON_TOKEN_FILE": str(token_file)}
    env.pop("TORSHMON_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "torshmon.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _api(agg: AggregatorThread, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    import urllib.request

    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(agg.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _silenced_total(agg: AggregatorThread) -> float:
    _status, body = request(agg.url + "/metrics", None, {"Authorization": f"Bearer {TOKEN}"})
    raw = body["raw"] if isinstance(body, dict) else ""
    lines = [ln for ln in raw.splitlines() if ln.startswith("torshmon_alerts_silenced_total{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_a_silence_holds_back_notifications_until_it_is_expired(tmp_path: Path, hook: Hook) -> None:
    target = WebhookTarget(hook.url, name="ops")
    with AggregatorThread(_settings(tmp_path), targets=[target]) as agg:
        job = Job(agg)
        done = _cli(
            agg, tmp_path, "silence", "add", "job=j", "alertname=CommHeavy", "--for", "1h",
            "--by", "alice", "--comment", "known slow link",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("silence 1 until ")

        job.steps(3, heavy=True)
        assert sorted(job.evaluate()) == [("firing", "0"), ("firing", "1")]
        # Evaluated and stored as usual, but nobody is told.
        assert _silenced_total(agg) == 2
        status, listed = _api(agg, "GET", "/api/v1/alerts?state=firing")
        assert status == 200 and len(listed["alerts"]) == 2
        alert_id = listed["alerts"][0]["id"]

        done = _cli(agg, tmp_path, "alerts", "ack", str(alert_id), "--by", "bob")
        assert done.returncode == 0, done.stderr
        done = _cli(agg, tmp_path, "alerts", "list", "--state", "firing")
        assert done.returncode == 0 and "ack: bob" in done.stdout

        done = _cli(agg, tmp_path, "silence", "list", "--state", "active")
        assert done.returncode == 0 and "alice" in done.stdout and "known slow link" in done.stdout
        done = _cli(agg, tmp_path, "silence", "expire", "1")
        assert done.returncode == 0, done.stderr
        job.evaluate()  # released: told late rather than never
        assert hook.wait_for(2) == [("firing", "CommHeavy"), ("firing", "CommHeavy")]

        job.steps(3, heavy=False)
        assert sorted(job.evaluate()) == [("resolved", "0"), ("resolved", "1")]
        assert hook.wait_for(4)[2:] == [("resolved", "CommHeavy"), ("resolved", "CommHeavy")]

    engine = create_engine(f"sqlite:///{tmp_path / 'h.db'}")
    with engine.connect() as conn:
        acked = conn.execute(
            text("SELECT acknowledged_by FROM alerts WHERE id = :i"), {"i": alert_id}
        )
        assert acked.scalar_one() == "bob"
    engine.dispose()


def test_an_alert_that_fires_and_resolves_under_a_silence_is_never_told(
    tmp_path: Path, hook: Hook
) -> None:
    settings = _settings(tmp_path)
    with AggregatorThread(settings, targets=[WebhookTarget(hook.url, name="ops")]) as agg:
        status, made = _api(
            agg,
            "POST",
            "/api/v1/silences",
            {"matchers": {"job": "j", "rank": 1}, "duration_s": 3600, "created_by": "carol"},
        )
        assert status == 201 and made["silence"]["state"] == "active"
    # A silence outlives the aggregator: it is in SQL, not only in memory.
    with AggregatorThread(settings, targets=[WebhookTarget(hook.url, name="ops")]) as agg:
        job = Job(agg)
        job.steps(3, heavy=True)
        assert sorted(job.evaluate()) == [("firing", "0"), ("firing", "1")]
        job.steps(3, heavy=False)
        assert sorted(job.evaluate()) == [("resolved", "0"), ("resolved", "1")]
        # Rank 0's alert was told twice; rank 1's (silenced) neither time.
        assert hook.wait_for(2) == [("firing", "CommHeavy"), ("resolved", "CommHeavy")]
        assert _silenced_total(agg) == 2


def test_an_open_alerts_stored_text_follows_its_value_and_nobody_is_told_again(
    tmp_path: Path, hook: Hook
) -> None:
    """The API serves an open alert's latest figure, not the one it fired with; the
    webhook hears the firing once, the revision never."""
    with AggregatorThread(
        _settings(tmp_path), targets=[WebhookTarget(hook.url, name="ops")]
    ) as agg:
        agg.aggregator.alerts.revise_every_s = 0.0  # revise at every evaluation
        job = Job(agg)
        job.steps(3, heavy=True)
        assert sorted(job.evaluate()) == [("firing", "0"), ("firing", "1")]
        status, listed = _api(agg, "GET", "/api/v1/alerts?state=firing")
        assert status == 200
        assert [a["annotations"]["summary"].split(" (")[0] for a in listed["alerts"]] == [
            "Comm Heavy: communication_time_ratio is 0.8"
        ] * 2

        job.steps(3, heavy=True, wait_s=0.095)
        assert job.evaluate() == []  # no transition: the value moved, the state did not
        status, listed = _api(agg, "GET", "/api/v1/alerts?state=firing")
        assert status == 200
        summaries = sorted(a["annotations"]["summary"] for a in listed["alerts"])
        assert [s.split(" (")[0] for s in summaries] == [
            "Comm Heavy: communication_time_ratio is 0.95"
        ] * 2
        assert [a["value"] for a in listed["alerts"]] == [pytest.approx(0.95)] * 2
        assert "rank=1" in summaries[1]
        assert hook.wait_for(2) == [("firing", "CommHeavy"), ("firing", "CommHeavy")]
        job.steps(1, heavy=True, wait_s=0.09)
        job.evaluate()
        assert len(hook.wait_for(3, timeout_s=1.0)) == 2  # still told once each


def test_bad_requests_get_a_4xx_that_names_the_problem(tmp_path: Path) -> None:
    with AggregatorThread(_settings(tmp_path)) as agg:
        cases: list[tuple[str, str, Any, int, str]] = [
            ("POST", "/api/v1/silences", {"matchers": {}, "duration_s": 60, "created_by": "x"},
             400, "matchers"),
            ("POST", "/api/v1/silences", {"matchers": {"job": "j"}, "duration_s": 60}, 400,
             "created_by"),
            ("POST", "/api/v1/silences",
             {"matchers": {"job": "j"}, "duration_s": -1, "created_by": "x"}, 400, "duration_s"),
            ("POST", "/api/v1/silences",
             {"matchers": {"job": "j"}, "duration_s": 90 * 86400, "created_by": "x"}, 400,
             "at most"),
            ("POST", "/api/v1/silences",
             {"matchers": {"bad-label": "j"}, "duration_s": 60, "created_by": "x"}, 400,
             "label name"),
            ("POST", "/api/v1/silences",
             {"matchers": {"job": "j"}, "duration_s": 60, "created_by": "x", "x": 1}, 400,
             "unknown field"),
            ("GET", "/api/v1/silences?state=nope", None, 400, "state"),
            ("DELETE", "/api/v1/silences/abc", None, 400, "positive integer"),
            ("DELETE", "/api/v1/silences/99", None, 404, "no silence"),
            ("POST", "/api/v1/alerts/99/ack", {"by": "x"}, 404, "no alert"),
            ("POST", "/api/v1/alerts/1/ack", {}, 400, "by"),
        ]  # fmt: skip
        for method, path, body, want, words in cases:
            status, reply = _api(agg, method, path, body)
            assert (status, words in reply.get("error", "")) == (want, True), (path, body, reply)

        job = Job(agg)
        job.steps(3, heavy=True)
        job.evaluate()
        job.steps(3, heavy=False)
        job.evaluate()
        status, reply = _api(agg, "POST", "/api/v1/alerts/1/ack", {"by": "dave"})
        assert status == 409 and "resolved" in reply["error"]

        status, _ = request(agg.url + "/api/v1/silences", None, {})
        assert status == 401

        done = _cli(agg, tmp_path, "silence", "add", "job=j", "--for", "soon")
        assert done.returncode == 2 and done.stderr.count("\n") <= 4
        assert "expected a duration" in done.stderr and "Traceback" not in done.stderr
        done = _cli(agg, tmp_path, "silence", "expire", "12345")
        assert done.returncode == 2 and "no silence 12345" in done.stderr
