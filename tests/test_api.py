"""The HTTP API through its narrow interfaces: a history store on a SQLite file, fakes
for the live state, the command sink and the tuning manager, aiohttp's test client.
The request guard runs before every handler, as in the service."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Counter

from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.core.bottleneck import JobSnapshot, bottleneck_report, rank_findings
from torshmon.aggregator.core.commands import CommandBook, CommandStatus
from torshmon.aggregator.core.episodes import FindingChange
from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.tuner import TunerError
from torshmon.aggregator.http import api
from torshmon.aggregator.http.guard import RequestGuard
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.aggregator.tuning_manager import TuningConflict, TuningUnavailable
from torshmon.history.models import Base
from torshmon.history.store import HistoryStore, TuningSessionRow
from torshmon.report.source import HistoryReports

TOKEN = "api-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NOW = 1_700_000_000.0


class FakeLive:
    def __init__(self) -> None:
        self.findings: dict[str, list[Finding]] = {}
        self.tuning: dict[str, bool] = {}
        #: The runs of job j that are live (None: whichever is asked for).
        self.live_runs: set[str] | None = None

    def job_summary(self, job: str, run_id: str | None = None) -> dict[str, Any] | None:
        live = self.live_runs is None or run_id is None or run_id in self.live_runs
        return {"last_step": 7} if job == "j" and live else None

    def job_config(self, job: str, run_id: str | None = None) -> dict[str, Any] | None:
        return {"codec": "none"} if job == "j" else None

    def rank_summaries(self, job: str, run_id: str | None = None) -> dict[int, dict[str, Any]]:
        return {0: {"last_step": 7}} if job == "j" else {}

    def report(
        self, job: str, now_unix_s: float, run_id: str | None = None
    ) -> list[Finding] | None:
        return self.findings.get(job)

    def link_reading(self, job: str, run_id: str | None = None) -> dict[str, Any] | None:
        return None

    def set_tuning(self, job: str, active: bool) -> None:
        self.tuning[job] = active

    def job_kind(self, job: str, run_id: str | None = None) -> str | None:
        return "fsdp2" if job == "j" else None


class FakeCommands:
    """A real command book (validation, ids), without the store behind it."""

    def __init__(self) -> None:
        self.book = CommandBook(clock=lambda: NOW)
        self.link_checks: list[str] = []

    async def submit_command(
        self, job: str, kind: str, args: Mapping[str, object]
    ) -> CommandStatus:
        return self.book.add(self.book.new(job, kind, args))

    async def request_link_check(
        self, job: str, args: Mapping[str, object], reason: str = "requested"
    ) -> CommandStatus:
        status = await self.submit_command(job, "link_check", args)
        self.link_checks.append(reason)
        return status

    def status(self, command_id: str) -> CommandStatus | None:
        return self.book.get(command_id)


class FakeTuning:
    def __init__(self) -> None:
        self.started: list[tuple[str, int | None, list[str]]] = []
        self.error: Exception | None = None

    async def start_session(
        self,
        job: str,
        *,
        trigger: str,
        max_trials: int | None = None,
        pinned: Iterable[str] = (),
    ) -> str:
        if self.error is not None:
            raise self.error
        self.started.append((job, max_trials, list(pinned)))
        return "s1"

    async def abort_session(self, job: str, reason: str, *, restore: bool = True) -> bool:
        return False  # no session to abort


class Api:
    """The fakes behind the API, and a client of it (``serve``)."""

    def __init__(self, store: HistoryStore) -> None:
        self.store = store
        self.live = FakeLive()
        self.commands = FakeCommands()
        self.tuning = FakeTuning()
        self.client: TestClient[Any, Any]

    def app(self) -> web.Application:
        settings = AggregatorSettings(
            port=0, db_url=self.store.url, token=TOKEN, aggregator_id="a1"
        )
        registry = CollectorRegistry()
        Counter("torshmon_api_test", "A metric of this test", registry=registry).inc()
        return api.make_app(
            settings,
            guard=RequestGuard(settings),
            store=self.store,
            live=self.live,
            commands=self.commands,
            tuning=self.tuning,
            reports=HistoryReports(lambda: self.store.engine),
            registry=registry,
            clock=lambda: NOW,
        )

    async def get(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        async with self.client.get(path, headers=AUTH, **kwargs) as response:
            return response.status, await response.json()

    async def post(self, path: str, body: object) -> tuple[int, Any]:
        async with self.client.post(path, json=body, headers=AUTH) as response:
            return response.status, await response.json()


@pytest.fixture
async def a(store: HistoryStore) -> AsyncIterator[Api]:
    fakes = Api(store)
    async with TestClient(TestServer(fakes.app())) as client:
        fakes.client = client
        yield fakes


def _alert(rule: str, state: str, job: str = "j", rank: str = "1") -> Alert:
    return Alert(
        rule=rule,
        state=state,  # type: ignore[arg-type]
        severity="high",
        labels={"alertname": rule, "job": job, "rank": rank},
        annotations={"summary": f"{rule} on {job}"},
        value=2.5,
        starts_at_unix_s=NOW - 10,
    )


async def test_health_and_metrics_need_no_token(a: Api) -> None:
    async with a.client.get("/healthz") as response:
        assert response.status == 200
        assert await response.json() == {"status": "ok", "aggregator_id": "a1", "v": 1}
    async with a.client.get("/metrics") as response:
        assert response.status == 200
        assert "torshmon_api_test_total 1.0" in await response.text()


async def test_every_api_path_wants_the_token(a: Api) -> None:
    for path in ("/api/v1/jobs", "/api/v1/alerts", "/api/v1/commands/x", "/api/v1/jobs/j"):
        async with a.client.get(path) as response:
            assert response.status == 401, path
            assert await response.json() == {
                "error": "missing or wrong bearer token",
                "status": 401,
            }


async def test_the_guard_runs_before_every_handler(a: Api) -> None:
    async with a.client.get("/healthz", headers={"Host": "evil.example"}) as response:
        assert response.status == 421
    cross_site = {"Sec-Fetch-Site": "cross-site"}
    async with a.client.get("/healthz", headers=cross_site) as response:
        assert response.status == 403
    async with a.client.post(
        "/api/v1/jobs/j/commands", data=b"{}", headers={**AUTH, "Content-Type": "text/plain"}
    ) as response:
        assert response.status == 415
    assert a.commands.book.reserve(["j"]) == []


async def test_jobs_and_ranks_join_the_history_with_the_live_state(a: Api) -> None:
    with a.store.engine.begin() as conn:
        conn.execute(
            Base.metadata.tables["jobs"].insert(),
            [
                {"job": "j", "world_size": 2, "first_seen_unix_ns": 1, "last_seen_unix_ns": 5},
                {"job": "old", "world_size": 1, "first_seen_unix_ns": 1, "last_seen_unix_ns": 2},
            ],
        )
    status, body = await a.get("/api/v1/jobs")
    assert status == 200
    assert [(r["job"], r["live"]) for r in body["jobs"]] == [
        ("j", {"last_step": 7}),
        ("old", None),
    ]
    status, body = await a.get("/api/v1/jobs", params={"limit": "1"})
    assert [r["job"] for r in body["jobs"]] == ["j"]
    status, body = await a.get("/api/v1/jobs/j")
    assert status == 200 and body["world_size"] == 2 and body["config"] == {"codec": "none"}
    status, body = await a.get("/api/v1/jobs/nope")
    assert status == 404 and body["error"] == "no job 'nope'"
    status, body = await a.get("/api/v1/jobs/j/ranks")
    assert status == 200 and body == {"job": "j", "ranks": []}


async def test_alerts_and_anomalies_list_what_the_store_recorded(a: Api) -> None:
    finding = Finding(
        kind="straggler",
        labels={"job": "j", "rank": "1"},
        value=0.3,
        score=6.0,
        summary="rank 1 is slow",
        since_unix_s=NOW - 20,
        details={"peers": (0, 2)},
    )
    await a.store.record(
        [FindingChange("open", finding)], [_alert("Straggler", "pending")], NOW - 5
    )
    await a.store.record([], [_alert("Straggler", "firing"), _alert("Other", "firing", "k")], NOW)
    status, body = await a.get("/api/v1/alerts", params={"job": "j"})
    assert status == 200
    [row] = body["alerts"]
    assert (row["rule"], row["state"], row["rank"], row["fired_at_unix_s"]) == (
        "Straggler",
        "firing",
        1,
        NOW,
    )
    status, body = await a.get("/api/v1/alerts", params={"state": "firing"})
    assert [r["rule"] for r in body["alerts"]] == ["Other", "Straggler"]
    status, body = await a.get("/api/v1/anomalies", params={"kind": "straggler"})
    [row] = body["anomalies"]
    assert row["summary"] == "rank 1 is slow" and row["details"] == {"peers": [0, 2]}


async def test_bad_listing_parameters_are_400s_naming_them(a: Api) -> None:
    status, body = await a.get("/api/v1/alerts", params={"colour": "red"})
    assert status == 400
    assert body["error"] == (
        "unknown query parameter(s) colour; allowed: job, run_id, state, rule, severity, limit"
    )
    for limit, message in (("x", "limit must be an integer, got 'x'"), ("0", "1..10000")):
        status, body = await a.get("/api/v1/anomalies", params={"limit": limit})
        assert status == 400 and message in body["error"]


async def test_commands_are_queued_and_read_back_from_the_book_or_the_history(a: Api) -> None:
    status, body = await a.post("/api/v1/jobs/j/commands", {"args": {"bucket_cap_mb": 4}})
    assert status == 202 and body["status"] == "pending" and body["kind"] == "config"
    status, read = await a.get(f"/api/v1/commands/{body['id']}")
    assert status == 200 and read == body
    status, body = await a.post("/api/v1/jobs/j/commands", {"kind": "reboot"})
    assert status == 400 and "unknown command kind 'reboot'" in body["error"]
    status, body = await a.post("/api/v1/jobs/j/commands", {"args": []})
    assert status == 400
    # A command of an earlier process: only the history knows it.
    await a.store.add_command("old1", "j", "config", {"codec": "fp16"}, NOW - 100)
    status, body = await a.get("/api/v1/commands/old1")
    assert status == 200 and body["status"] == "pending" and body["args"] == {"codec": "fp16"}
    status, body = await a.get("/api/v1/commands/none")
    assert status == 404


async def test_link_checks_go_to_the_command_sink(a: Api) -> None:
    status, body = await a.post("/api/v1/jobs/j/link-check", {"size_bytes": 1024})
    assert status == 202 and body["kind"] == "link_check"
    assert a.commands.link_checks == ["requested"]
    status, body = await a.post("/api/v1/jobs/j/link-check", {"colour": 1})
    assert status == 400 and "unknown field(s) colour" in body["error"]


async def test_tune_answers_the_managers_refusals_with_their_status(a: Api) -> None:
    status, body = await a.post("/api/v1/jobs/j/tune", {"max_trials": 3, "pinned": ["codec"]})
    assert (status, body) == (201, {"session_id": "s1", "job": "j"})
    assert a.tuning.started == [("j", 3, ["codec"])]
    for error, expected in (
        (TuningConflict("busy"), 409),
        (TuningUnavailable("no data"), 404),
        (TunerError("bad knob"), 400),
    ):
        a.tuning.error = error
        status, body = await a.post("/api/v1/jobs/j/tune", {})
        assert (status, body["error"]) == (expected, str(error))
    a.tuning.error = None
    for bad in ({"max_trials": True}, {"pinned": "codec"}, {"seed": 1}):
        status, _ = await a.post("/api/v1/jobs/j/tune", bad)
        assert status == 400, bad
    assert len(a.tuning.started) == 1


async def test_tuning_sessions_list_a_summary_not_the_state(a: Api) -> None:
    row = TuningSessionRow(
        id="s1",
        job="j",
        state="finished",
        trigger="api",
        started_unix_s=NOW,
        ended_unix_s=NOW + 60,
        baseline_config={"codec": "none"},
        best_config=None,
        baseline_score=100.0,
        best_score=120.0,
        reason="done",
        state_blob={"summary": "kept fp16", "big": list(range(100))},
    )
    await a.store.save_tuning(row, [])
    status, body = await a.get("/api/v1/tuning/sessions")
    [session] = body["sessions"]
    assert session["summary"] == "kept fp16" and "state_blob" not in session
    status, body = await a.get("/api/v1/tuning/trials", params={"session_id": "s1"})
    assert (status, body) == (200, {"trials": []})


NO_LINKS: dict[str, Any] = dict.fromkeys(
    ("explained_by", "explained_by_name", "step_s", "what_if_step_s", "throughput_loss_ratio")
)


async def test_the_report_names_each_symptoms_cause_and_what_the_cause_costs(a: Api) -> None:
    """Peers compute 0.1 s and wait 0.07 s for rank 2 in a 0.18 s step: the straggler
    leads with the step time without it (0.11 s) and its loss; the wait and the roll-up
    name it."""
    snap = JobSnapshot(communication_time_ratio=0.42, training_efficiency_ratio=0.58, step_s=0.18)
    straggler = Finding(
        kind="straggler",
        labels={"job": "j", "rank": "2"},
        value=0.17,
        score=1.7,
        summary="rank 2 is slow",
        since_unix_s=NOW,
        severity="high",
        details={"slowdown_ratio": 1.7, "peer_median_s": 0.1, "phase": "compute"},
    )
    a.live.findings["j"] = rank_findings(bottleneck_report("j", snap, NOW), [straggler], snap)
    status, body = await a.get("/api/v1/jobs/j/report")
    assert status == 200
    cause, *symptoms = body["bottlenecks"]
    assert (cause["id"], cause["explained_by"]) == ("straggler:rank=2", None)
    assert cause["step_s"] == pytest.approx(0.18)
    assert cause["what_if_step_s"] == pytest.approx(0.11)
    assert cause["throughput_loss_ratio"] == pytest.approx(0.07 / 0.18)
    assert [(s["category"], s["explained_by"], s["explained_by_name"]) for s in symptoms] == [
        ("communication", "straggler:rank=2", "the straggler on rank 2"),
        ("efficiency", "straggler:rank=2", "the straggler on rank 2"),
    ]
    assert {s["what_if_step_s"] for s in symptoms} == {None}


async def test_the_report_lists_the_live_bottlenecks(a: Api) -> None:
    a.live.findings["j"] = [
        Finding(
            kind="bottleneck",
            labels={"job": "j", "category": "communication"},
            value=0.6,
            score=0.6,
            summary="communication takes 60 %",
            since_unix_s=NOW,
            recommendation="prefetch all-gathers",
            severity="critical",
            category="communication",
            priority=1,
            expected_gain_ratio=0.3,
            difficulty="medium",
        ),
        Finding(
            kind="straggler",
            labels={"job": "j", "rank": "2"},
            value=0.4,
            score=5.0,
            summary="rank 2 is slow",
            since_unix_s=NOW - 3,
            severity="high",
            category="straggler",
            priority=2,
            difficulty="medium",
        ),
    ]
    status, body = await a.get("/api/v1/jobs/j/report")
    assert status == 200
    assert body["job_kind"] == "fsdp2"
    assert body["bottlenecks"] == [
        {
            "kind": "bottleneck",
            "category": "communication",
            "severity": "critical",
            "priority": 1,
            "expected_gain_ratio": 0.3,
            "difficulty": "medium",
            "summary": "communication takes 60 %",
            "recommendation": "prefetch all-gathers",
            "value": 0.6,
            "rank": None,
            "labels": {"job": "j", "category": "communication"},
            "since_unix_s": NOW,
            "id": "bottleneck:category=communication",
            **NO_LINKS,
        },
        {
            "kind": "straggler",
            "category": "straggler",
            "severity": "high",
            "priority": 2,
            "expected_gain_ratio": None,
            "difficulty": "medium",
            "summary": "rank 2 is slow",
            "recommendation": "",
            "value": 0.4,
            "rank": 2,
            "labels": {"job": "j", "rank": "2"},
            "since_unix_s": NOW - 3,
            "id": "straggler:rank=2",
            **NO_LINKS,
        },
    ]
    assert body["link_check"] is None  # no check yet
    status, body = await a.get("/api/v1/jobs/k/report")
    assert status == 404


async def test_query_checks_its_body_and_runs_read_only_sql(a: Api) -> None:
    status, body = await a.post("/api/v1/query", {"sql": ""})
    assert status == 400 and body["error"] == 'expected {"sql": "SELECT ..."}'
    status, body = await a.post("/api/v1/query", {"sql": "SELECT 1", "format": "xml"})
    assert status == 400
    status, body = await a.post("/api/v1/query", {"sql": "SELECT count(*) AS n FROM jobs"})
    assert (status, body["columns"], body["rows"]) == (200, ["n"], [[0]])
    status, body = await a.post("/api/v1/query", {"sql": "DELETE FROM jobs"})
    assert status == 400


async def test_the_openapi_document_describes_the_rows(a: Api) -> None:
    status, body = await a.get("/api/v1/openapi.json")
    assert status == 200 and body["openapi"] == "3.1.0"
    assert "/api/v1/tuning/trials" in body["paths"]
    columns = {c.name for c in Base.metadata.tables["alerts"].columns}
    assert set(body["components"]["schemas"]["row_alerts"]["properties"]) == columns
