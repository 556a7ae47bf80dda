"""Runs: each launch of a job kept apart, from the probe's run id to the report."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestClient, TestServer
from alembic import command
from alembic.config import Config
from prometheus_client import CollectorRegistry

from tests.integration import wire_factory as wf
from tests.pg import pg_database
from tests.test_api import AUTH, TOKEN, Api
from torshmon.aggregator.core.alert_engine import AlertEngine
from torshmon.aggregator.core.live import LiveState
from torshmon.aggregator.core.rule_file import load_rules_text
from torshmon.aggregator.core.stored import Stored
from torshmon.aggregator.live_metrics import LiveCollector
from torshmon.aggregator.notify.alertmanager import (
    alertmanager_v2_alerts,
    alertmanager_webhook_payload,
)
from torshmon.history.db import make_engine
from torshmon.history.migrate import alembic_dir, upgrade
from torshmon.history.store import HistoryStore
from torshmon.history.store.ingest import upsert_sessions
from torshmon.history.store.report import UnknownRun, load_job_history, pick_run
from torshmon.probe.runid import agreed_run_id, env_run_id
from torshmon.report import from_json, render_text, report_from_aggregator, report_from_db
from torshmon.report.compare import render_comparison
from torshmon.report.source import ReportError
from torshmon.wire import Hello

S = 10**9
T0 = 1_800_000_000 * S


# -- the probe's run id --------------------------------------------------------------------
def test_torchruns_default_none_is_no_run_id_and_ours_comes_next() -> None:
    assert env_run_id({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert env_run_id({"TORCHELASTIC_RUN_ID": "none", "TORSHMON_RUN_ID": "r7"}) == "r7"
    assert env_run_id({"TORCHELASTIC_RUN_ID": "abc", "TORSHMON_RUN_ID": "r7"}) == "abc"
    assert env_run_id({}) is None


def test_every_rank_reads_the_id_rank_0_made_from_the_store() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    got: dict[int, str] = {}

    def rank(n: int) -> None:
        got[n] = agreed_run_id(n, store, timeout_s=10)

    threads = [threading.Thread(target=rank, args=(n,)) for n in (3, 2, 1)]
    for t in threads:
        t.start()
    rank(0)
    for t in threads:
        t.join()
    assert len(got[0]) == 16
    assert got == {0: got[0], 1: got[0], 2: got[0], 3: got[0]}
    # After a restart (torchrun's agent store outlives it) no rank reads the old id.
    again = agreed_run_id(0, store, attempt="1")
    assert again != got[0] and agreed_run_id(1, store, timeout_s=1, attempt="1") == again
    # A rank whose rank 0 never wrote waits its bound, then fails (attach falls back).
    with pytest.raises(RuntimeError):
        agreed_run_id(1, dist.HashStore(), timeout_s=0.2)


# -- the live state ------------------------------------------------------------------------
def test_a_new_run_id_gets_live_state_of_its_own_and_the_older_run_keeps_its() -> None:
    live = LiveState(idle_s=60.0)
    registry = CollectorRegistry()
    registry.register(LiveCollector(live))
    first = [msgspec.structs.replace(wf.hello("j", r, 2), run_id="a") for r in (0, 1)]
    steps = [wf.step(n) for n in range(1, 41)]
    live.observe(
        Stored(
            acked_seq=1, hellos=first, batches=[(wf.batch(h, 1, steps[:30]), "n") for h in first]
        ),
        now_unix_s=1000.0,
    )
    run_a = {"job": "j", "run": "a", "rank": "0"}
    assert registry.get_sample_value("torshmon_steps_total", run_a) == 30
    # The same run's hello again (a reconnect) keeps the state.
    live.observe(Stored(acked_seq=2, hellos=first[:1]), now_unix_s=1001.0)
    assert registry.get_sample_value("torshmon_steps_total", run_a) == 30
    second = [
        msgspec.structs.replace(wf.hello("j", r, 2), session=f"s2-{r}", run_id="b") for r in (0, 1)
    ]
    live.observe(
        Stored(
            acked_seq=3,
            hellos=second,
            batches=[(wf.batch(h, 1, steps[:5]), "n") for h in second],
        ),
        now_unix_s=1002.0,
    )
    run_b = {"job": "j", "run": "b", "rank": "0"}
    assert registry.get_sample_value("torshmon_steps_total", run_b) == 5
    # Both launches run: each is exported with its own run, the API shows the latest.
    assert registry.get_sample_value("torshmon_steps_total", run_a) == 30
    assert live.jobs["j"].run_id == "b" and live.live_runs("j") == ["a", "b"]
    # The first launch's ranks go on: their steps are a's, not b's.
    live.observe(
        Stored(acked_seq=4, batches=[(wf.batch(h, 2, steps[30:37]), "n") for h in first]),
        now_unix_s=1003.0,
    )
    assert registry.get_sample_value("torshmon_steps_total", run_b) == 5
    assert registry.get_sample_value("torshmon_steps_total", run_a) == 37
    # a's ranks fall silent past the idle bound while b's still report: a is forgotten.
    live.observe(
        Stored(acked_seq=5, batches=[(wf.batch(h, 2, steps[5:6]), "n") for h in second]),
        now_unix_s=1050.0,
    )
    live.expire(1064.0)
    assert registry.get_sample_value("torshmon_steps_total", run_a) is None
    assert registry.get_sample_value("torshmon_steps_total", run_b) == 6
    assert live.live_runs("j") == ["b"]


def test_a_restarted_aggregator_keeps_the_restored_runs_ranks_apart_from_a_new_launch() -> None:
    """After a restart the running launch's probes say no hello: their batches are the
    restored run's, and stay so when a new launch of the job says hello beside them."""
    live = LiveState(idle_s=60.0)
    live.restore_job("j", 3, 1000.0, "r1")
    r1, r2 = _launch("r1"), _launch("r2")
    live.observe(_steps(r1, range(1, 11), late_rank=None, seq=1), now_unix_s=1001.0)
    live.observe(Stored(acked_seq=2, hellos=r2), now_unix_s=1002.0)
    live.observe(_steps(r1, range(11, 21), late_rank=None, seq=2), now_unix_s=1003.0)
    live.observe(_steps(r2, range(1, 6), late_rank=None, seq=1), now_unix_s=1003.0)
    assert live.live_runs("j") == ["r1", "r2"]
    assert live.rank_summaries("j", "r1")[0]["steps_total"] == 20
    assert live.rank_summaries("j")[0]["steps_total"] == 5  # the latest: r2


STRAGGLER_RULE = """
rules:
  - name: Straggler
    kind: straggler
    severity: high
"""


def _launch(run_id: str) -> list[Hello]:
    """The hellos of a 3-rank launch of job j, run ``run_id``."""
    return [
        msgspec.structs.replace(wf.hello("j", r, 3), session=f"{run_id}-{r}", run_id=run_id)
        for r in range(3)
    ]


def _steps(hellos: list[Hello], numbers: range, *, late_rank: int | None, seq: int) -> Stored:
    """Steps ``numbers`` of every rank, ~0.1 s each; ``late_rank`` computes 0.2 s longer."""
    batches = []
    for h in hellos:
        steps = [
            wf.step(
                n,
                duration_s=0.1
                + 0.002 * ((n * (h.rank + 1)) % 5)
                + (0.2 if h.rank == late_rank else 0),
                comm_wait_s=0.01,
                end_unix_ns=1000 * S + n * 10**8,
            )
            for n in numbers
        ]
        batches.append((wf.batch(h, seq, steps), "n"))
    return Stored(acked_seq=seq, batches=batches)


def test_two_launches_of_one_job_at_once_are_each_judged_alerted_and_exported() -> None:
    """r2 starts while r1 runs: r1's straggler keeps being found and alerted as r1's,
    r2 (healthy) has none, both are exported, and r1 is forgotten once its ranks fall
    silent past the idle bound."""
    live = LiveState(idle_s=60.0)
    registry = CollectorRegistry()
    registry.register(LiveCollector(live))
    engine = AlertEngine(load_rules_text(STRAGGLER_RULE))
    r1, r2 = _launch("r1"), _launch("r2")
    live.observe(Stored(acked_seq=1, hellos=r1), now_unix_s=1000.0)
    live.observe(_steps(r1, range(1, 61), late_rank=1, seq=1), now_unix_s=1006.0)
    (alert,) = engine.evaluate(1006.0, live.series, live.findings(1006.0), runs=live.runs())
    assert (alert.state, alert.labels["run"], alert.labels["rank"]) == ("firing", "r1", "1")
    # r2 starts and runs healthy steps while r1 goes on with its straggler.
    live.observe(Stored(acked_seq=2, hellos=r2), now_unix_s=1007.0)
    live.observe(_steps(r2, range(1, 61), late_rank=None, seq=1), now_unix_s=1008.0)
    live.observe(_steps(r1, range(61, 121), late_rank=1, seq=2), now_unix_s=1012.0)
    found = live.findings(1012.0)
    stragglers = [(f.labels["run"], f.labels["rank"]) for f in found if f.kind == "straggler"]
    assert stragglers == [("r1", "1")]
    # Nothing resolved, nothing new: r1's alert fires on, r2 has none.
    assert engine.evaluate(1012.0, live.series, found, runs=live.runs()) == []
    (active,) = engine.active()
    assert (active.state, active.labels["run"]) == ("firing", "r1")
    assert active.fingerprint == alert.fingerprint
    # /metrics: both runs, each with its own steps; the straggler is r1's.
    steps_of = {
        run: registry.get_sample_value(
            "torshmon_steps_total", {"job": "j", "run": run, "rank": "0"}
        )
        for run in ("r1", "r2")
    }
    assert steps_of == {"r1": 120, "r2": 60}
    straggling = {"job": "j", "run": "r1", "rank": "1"}
    assert registry.get_sample_value("torshmon_straggler_active", straggling) == 1
    assert registry.get_sample_value("torshmon_straggler_paging", straggling) == 1
    assert (
        registry.get_sample_value("torshmon_straggler_active", {**straggling, "run": "r2"}) is None
    )
    # Commands (a tuning session's too) go to the latest run: r2's rank 0, not r1's.
    assert live.runs() == {"j": "r2"}
    assert not live.of_latest_run("j", r1[0].session) and live.of_latest_run("j", r2[0].session)
    # The API shows the latest run by default, and the older one when asked.
    assert live.job_summary("j") == live.job_summary("j", "r2") != live.job_summary("j", "r1")
    # r1's ranks fall silent; r2's go on. Past the idle bound only r2 is left.
    live.observe(_steps(r2, range(61, 62), late_rank=None, seq=2), now_unix_s=1070.0)
    live.expire(1075.0)
    assert live.live_runs("j") == ["r2"]
    assert (
        registry.get_sample_value("torshmon_steps_total", {"job": "j", "run": "r1", "rank": "0"})
        is None
    )
    # r1 ended: its straggler is gone, and its alert resolves with it.
    after = live.findings(1075.0)
    assert [f for f in after if f.labels.get("run") == "r1"] == []
    (ended,) = engine.evaluate(1075.0, live.series, after, runs=live.runs())
    assert (ended.state, ended.labels["run"]) == ("resolved", "r1")


LOSS_RULE = """
rules:
  - name: Loss Too High
    kind: threshold
    metric: loss
    op: ">"
    value: 50
    for: 0s
    severity: warning
"""


def test_an_alert_names_its_run_in_its_labels_and_payloads_and_keeps_it_on_restore() -> None:
    live = LiveState(idle_s=60.0)
    hellos = [msgspec.structs.replace(wf.hello("j", r, 2), run_id="r7") for r in (0, 1)]
    batches = [
        (wf.batch(h, 1, [wf.step(n, loss=100.0 if h.rank == 1 else 1.0) for n in (1, 2)]), "n")
        for h in hellos
    ]
    live.observe(Stored(acked_seq=1, hellos=hellos, batches=batches), now_unix_s=1000.0)
    rules = load_rules_text(LOSS_RULE)
    engine = AlertEngine(rules)
    now = batches[0][0].steps[-1].end_unix_ns / 1e9 + 1
    (alert,) = engine.evaluate(now, live.series, live.findings(now), runs=live.runs())
    assert alert.state == "firing"
    assert (alert.labels["run"], alert.labels["rank"]) == ("r7", "1")
    (sent,) = alertmanager_v2_alerts([alert], generator_url="http://a")
    assert sent["labels"]["run"] == "r7"
    hook = alertmanager_webhook_payload(
        [alert], receiver="r", group_key="k", external_url="http://a"
    )
    assert hook["alerts"][0]["labels"]["run"] == "r7"
    # A restarted aggregator learns the job's run from the history, not from hellos.
    restarted = LiveState(idle_s=60.0)
    restarted.restore_job("j", 2, 1000.0, "r7")
    assert restarted.runs() == {"j": "r7"}
    # Restored after a restart (the series alike, with no run): the same alert.
    again = AlertEngine(rules)
    again.restore([alert])
    assert again.evaluate(now + 1, live.series, [], runs={}) == []
    assert [a.labels["run"] for a in again.active()] == ["r7"]


# -- the history: runs chosen, rows split by run, migration -----------------------------
def test_pick_run_by_id_by_number_and_unknown() -> None:
    runs = [{"run_id": "a"}, {"run_id": "b"}, {"run_id": "c"}]
    assert pick_run(runs, None) == {"run_id": "c"}
    assert pick_run(runs, "a") == {"run_id": "a"}
    assert pick_run(runs, "2") == {"run_id": "b"}
    assert pick_run(runs, "-1") == {"run_id": "c"}
    assert pick_run([], None) is None
    with pytest.raises(UnknownRun, match="no run '4'; the job's runs, oldest first: a, b, c"):
        pick_run(runs, "4")
    with pytest.raises(UnknownRun):
        pick_run(runs, "0")


def _step(rank: int, step: int, at_ns: int, duration_s: float) -> dict[str, object]:
    return {
        "job": "j",
        "rank": rank,
        "node": "n0",
        "step": step,
        "end_unix_ns": at_ns,
        "duration_s": duration_s,
        "comm_wait_s": duration_s / 4,
        "compute_s": duration_s * 3 / 4,
        "communication_time_ratio": 0.25,
        "comm_busy_s": None,
        "forward_s": None,
        "backward_s": None,
        "optimizer_s": None,
        "batch_size": 8,
        "samples_per_s": 8 / duration_s,
        "loss": 1.0,
        "loss_nonfinite": False,
        "config_version": 0,
    }


def _upgrade_to(url: str, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(alembic_dir()))
    engine = make_engine(url)
    with engine.connect() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)
        conn.commit()
    engine.dispose()


def _two_launches(conn: sa.Connection, *, second_run: int = 40) -> None:
    """Job ``j`` ran twice: 60 steps of 0.1 s from T0, then ``second_run`` of 0.3 s
    from T0 + 100 s, on 2 ranks, with an alert in each launch."""
    meta = sa.MetaData()
    meta.reflect(conn)
    t = meta.tables
    conn.execute(
        t["jobs"].insert(),
        {
            "job": "j",
            "world_size": 2,
            "backend": "gloo",
            "first_seen_unix_ns": T0,
            "last_seen_unix_ns": T0 + 200 * S,
        },
    )
    steps = [_step(rank, n, T0 + n * S // 10, 0.1) for rank in (0, 1) for n in range(1, 61)] + [
        _step(rank, n, T0 + 100 * S + n * 3 * S // 10, 0.3)
        for rank in (0, 1)
        for n in range(1, second_run + 1)
    ]
    conn.execute(t["steps"].insert(), steps)
    for n, (start, ends) in enumerate([(T0, T0 + 7 * S), (T0 + 100 * S, T0 + 115 * S)]):
        for rank in (0, 1):
            conn.execute(
                t["probe_sessions"].insert(),
                {
                    "session": f"s{n}-{rank}",
                    "job": "j",
                    "rank": rank,
                    "started_unix_ns": start + S // 2,
                    "last_seen_unix_ns": ends,
                    "last_seq": 3,
                    "dropped_records_total": 0,
                },
            )
    for n, at in enumerate((T0 + 3 * S, T0 + 105 * S)):
        conn.execute(
            t["alerts"].insert(),
            {
                "fingerprint": f"f{n}",
                "rule": "Straggler" if n else "High Communication Overhead",
                "severity": "warning",
                "state": "resolved",
                "job": "j",
                "rank": 1 if n else None,
                "labels": {},
                "annotations": {},
                "value": 2.0,
                "starts_at_unix_s": at / 1e9,
                "fired_at_unix_s": at / 1e9,
                "ends_at_unix_s": at / 1e9 + 2,
                "updated_unix_s": at / 1e9 + 2,
            },
        )


@pytest.fixture(params=["sqlite", "postgresql"])
def history_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty history database of each dialect (PostgreSQL: the local test server)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'h.db'}"
    else:
        with pg_database() as url:
            yield url


def test_an_older_history_gets_one_run_per_launch_where_steps_start_over(
    history_url: str,
) -> None:
    url = history_url
    _upgrade_to(url, "0015")
    engine = make_engine(url)
    with engine.begin() as conn:
        _two_launches(conn)
    engine.dispose()
    upgrade(url)  # 0016: runs found from the steps

    engine = make_engine(url)
    with engine.connect() as conn:
        runs = conn.execute(sa.text("SELECT run_id, started_unix_ns FROM runs ORDER BY 2")).all()
        rows = conn.execute(sa.text("SELECT session, run_id FROM probe_sessions")).all()
        sessions: dict[str, str] = {r[0]: r[1] for r in rows}
        latest = load_job_history(conn, "j")
        first = load_job_history(conn, "j", run="legacy-1")
    engine.dispose()
    # Each run starts at its first step's start (a nanosecond before).
    assert [r[0] for r in runs] == ["legacy-1", "legacy-2"]
    assert runs[0][1] == T0 - 1  # its first step's start (its end less its 0.1 s)
    assert runs[1][1] == T0 + 100 * S - 1
    assert sessions == {
        "s0-0": "legacy-1",
        "s0-1": "legacy-1",
        "s1-0": "legacy-2",
        "s1-1": "legacy-2",
    }
    assert latest is not None and first is not None
    assert len(latest.steps["step"]) == 2 * 40
    assert sorted(set(latest.steps["step"])) == list(range(1, 41))
    assert len(first.steps["step"]) == 2 * 60
    assert [a["rule"] for a in latest.alerts] == ["Straggler"]
    assert [a["rule"] for a in first.alerts] == ["High Communication Overhead"]
    assert [s["session"] for s in latest.sessions] == ["s1-0", "s1-1"]


def _finding(n: int, at_s: float, rank: int) -> dict[str, object]:
    return {
        "kind": "straggler",
        "job": "j",
        "rank": rank,
        "summary": f"rank {rank} is slow",
        "recommendation": "",
        "severity": "warning",
        "since_unix_s": at_s,
        "detected_unix_s": at_s + n,
        "details": {},
    }


def test_a_history_at_0016_gets_the_run_id_of_each_row_by_its_runs_time(
    history_url: str,
) -> None:
    url = history_url
    _upgrade_to(url, "0015")
    engine = make_engine(url)
    with engine.begin() as conn:
        _two_launches(conn)
    _upgrade_to(url, "0016")
    with engine.begin() as conn:
        findings = sa.Table("findings", sa.MetaData(), autoload_with=conn)
        conn.execute(findings.insert(), [_finding(0, T0 / S + 4, 0), _finding(1, T0 / S + 110, 1)])
    engine.dispose()
    upgrade(url)  # 0017

    engine = make_engine(url)
    with engine.connect() as conn:
        steps = conn.execute(sa.text("SELECT run_id, rank, count(*) FROM steps GROUP BY 1, 2"))
        alerts = conn.execute(sa.text("SELECT run_id, rule FROM alerts"))
        found = conn.execute(sa.text("SELECT run_id, rank FROM findings"))
        by_run = (
            {(r[0], r[1]): r[2] for r in steps},
            set(map(tuple, alerts)),
            set(map(tuple, found)),
        )
        first = load_job_history(conn, "j", run="legacy-1")
    engine.dispose()
    assert by_run == (
        {("legacy-1", 0): 60, ("legacy-1", 1): 60, ("legacy-2", 0): 40, ("legacy-2", 1): 40},
        {("legacy-1", "High Communication Overhead"), ("legacy-2", "Straggler")},
        {("legacy-1", 0), ("legacy-2", 1)},
    )
    assert first is not None
    assert [(f["run_id"], f["rank"]) for f in first.findings] == [("legacy-1", 0)]


def test_report_shows_the_latest_run_lists_the_others_and_compares_two(history_url: str) -> None:
    url = history_url
    _upgrade_to(url, "0015")
    engine = make_engine(url)
    with engine.begin() as conn:
        _two_launches(conn)
    engine.dispose()
    upgrade(url)

    latest = report_from_db(url, "j", now_unix_s=T0 / 1e9 + 1000)
    assert latest.run_id == "legacy-2"
    assert [r.run_id for r in latest.runs] == ["legacy-1", "legacy-2"]
    assert {r.rank: r.steps for r in latest.ranks} == {0: 40, 1: 40}
    assert [s.step for s in latest.series][:1] == [tuple(range(1, 41))]
    assert [a.rule for a in latest.alerts] == ["Straggler"]
    text = render_text(latest)
    assert "run 2 of 2 (legacy-2)" in text
    assert "other runs: 1 legacy-1 (--run)" in text

    first = report_from_db(url, "j", run="1", now_unix_s=T0 / 1e9 + 1000)
    assert {r.rank: r.steps for r in first.ranks} == {0: 60, 1: 60}
    assert not first.running

    table = render_comparison(first, latest)
    lines = {line.split("  ")[0]: line for line in table.splitlines()}
    assert lines["step records"].split()[-2:] == ["120", "80"]
    assert lines["median step time"].split()[-5:] == ["100", "ms", "300", "ms", "+200%"]
    assert "Findings of run legacy-1:" in table and "Findings of run legacy-2:" in table

    with pytest.raises(ReportError, match="no run 'x'; the job's runs, oldest first"):
        report_from_db(url, "j", run="x")


# -- the aggregator's API and pages ----------------------------------------------------------
async def test_the_api_and_the_page_list_the_runs_and_take_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    _upgrade_to(url, "0015")
    engine = make_engine(url)
    with engine.begin() as conn:
        _two_launches(conn)
    engine.dispose()
    upgrade(url)  # 0016 finds the two runs
    writer = ThreadPoolExecutor(1)
    store = HistoryStore(url, aggregator_id="a1", writer=writer)
    store.open()
    try:
        api = Api(store)
        api.live.live_runs = {"legacy-2"}  # the older launch has ended
        async with TestClient(TestServer(api.app())) as client:

            async def get(path: str) -> tuple[int, bytes]:
                async with client.get(path, headers=AUTH) as response:
                    return response.status, await response.read()

            status, body = await get("/api/v1/jobs/j")
            job = json.loads(body)
            assert status == 200
            assert [r["run_id"] for r in job["runs"]] == ["legacy-1", "legacy-2"]
            assert job["run"]["run_id"] == "legacy-2"
            status, body = await get("/api/v1/jobs/j?run=legacy-1")
            assert status == 200 and json.loads(body)["run"]["run_id"] == "legacy-1"
            assert json.loads(body)["live"] is None  # an ended run has no live state
            status, body = await get("/api/v1/jobs/j?run=zz")
            assert status == 404
            assert json.loads(body)["error"] == (
                "job 'j': no run 'zz'; the job's runs, oldest first: legacy-1, legacy-2"
            )
            status, body = await get("/api/v1/jobs/j?run=-1")
            assert status == 200 and json.loads(body)["run"]["run_id"] == "legacy-2"
            assert json.loads(body)["live"] == {"last_step": 7}  # the latest run's

            status, body = await get("/api/v1/jobs/j/summary?run=legacy-1")
            assert status == 200
            assert {r.rank: r.steps for r in from_json(body).ranks} == {0: 60, 1: 60}
            status, body = await get("/api/v1/jobs/j/summary")
            assert {r.rank: r.steps for r in from_json(body).ranks} == {0: 40, 1: 40}
            status, body = await get("/api/v1/jobs/j/summary?run=zz")
            assert status == 404 and b"no run 'zz'" in body

            status, body = await get("/jobs/j")
            page = body.decode()
            assert status == 200
            assert "<strong>2 legacy-2 (shown)</strong>" in page
            assert '<a href="?run=legacy-1">1 legacy-1</a>' in page
            status, body = await get("/jobs/j?run=legacy-1")
            assert status == 200 and "<strong>1 legacy-1 (shown)</strong>" in body.decode()
            status, _ = await get("/jobs/j?run=zz")
            assert status == 404

            base = str(client.make_url("")).rstrip("/")
            first = await asyncio.to_thread(report_from_aggregator, base, "j", TOKEN, "1")
            assert first.run_id == "legacy-1"
    finally:
        writer.shutdown(wait=True)
        store.close()


def _session(name: str, rank: int, run_id: str | None, attached: int | None) -> dict[str, object]:
    return {
        "session": name,
        "job": "j",
        "rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "node": "n0",
        "pid": 1,
        "backend": "gloo",
        "torch_version": "t",
        "probe_version": "p",
        "started_unix_ns": T0 + 5 * S,
        "last_seen_unix_ns": T0 + 5 * S,
        "last_seq": 0,
        "dropped_records_total": 0,
        "run_id": run_id,
        "attached_unix_ns": attached,
    }


def test_a_run_starts_at_its_earliest_ranks_attach_whichever_hello_came_first(
    history_url: str,
) -> None:
    upgrade(history_url)
    engine = make_engine(history_url)
    with engine.begin() as conn:
        upsert_sessions(conn, [_session("a1", 1, "r1", T0 + 2 * S)])
        upsert_sessions(conn, [_session("a0", 0, "r1", T0 + S), _session("old", 0, None, None)])
        upsert_sessions(conn, [_session("a1", 1, "r1", T0 + 2 * S)])  # a reconnect
        rows = conn.execute(sa.text("SELECT job, run_id, started_unix_ns, world_size FROM runs"))
        runs = [tuple(r) for r in rows]
    engine.dispose()
    assert runs == [("j", "r1", T0 + S, 2)]
