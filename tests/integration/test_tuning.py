"""The autotuner wired into the aggregator: a real 2-rank gloo job tuned end to end,
and a session that outlives its aggregator."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import create_engine, text

from tests.integration import wire_factory as wf
from torshmon.aggregator.core.commands import CommandStatus
from torshmon.aggregator.core.stored import Stored
from torshmon.aggregator.core.tuner import TunerSettings, TuningSession
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.demo import DemoConfig, train_rank
from torshmon.launch import run_ranks
from torshmon.wire import DdpStats

pytestmark = pytest.mark.integration


def _report_bucket_cap(aggregator: Aggregator, job: str, cap_bytes: int) -> None:
    """As if rank 0 of ``job`` had reported DDP's bucket cap (no job runs in these tests)."""
    ddp = DdpStats(
        bucket_cap_bytes=cap_bytes,
        bucket_sizes_bytes=[cap_bytes],
        num_buckets_reduced=1,
        avg_forward_compute_s=0.01,
        avg_backward_compute_s=0.02,
        avg_backward_comm_s=0.01,
        avg_backward_compute_comm_overlap_s=0.0,
    )
    hello = wf.hello(job, 0, 1)
    step = msgspec.structs.replace(wf.step(1), ddp=ddp)
    stored = Stored(acked_seq=0, hellos=[hello], batches=[(wf.batch(hello, 1, [step]), "n")])
    aggregator.live.observe(stored, aggregator.clock())


SMALL = TunerSettings(warmup_steps=2, window_steps=5, windows=3, min_windows=3, max_trials=3)


def _rows(db_url: str, sql: str) -> list[dict[str, Any]]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(text(sql)).mappings()]
    finally:
        engine.dispose()


async def _post_tune(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


async def test_tunes_a_real_job_end_to_end(tmp_path: Path) -> None:
    from torshmon.agent.daemon import Agent, AgentSettings

    db_url = f"sqlite:///{tmp_path / 'history.db'}"
    token = secrets.token_hex(8)
    settings = AggregatorSettings(
        port=0,
        db_url=db_url,
        token=token,
        aggregator_id="tune-it",
        eval_interval_s=0.2,
        tuner=SMALL,
    )
    # The job runs until the session is over (a busy machine slows the tuning loop as much
    # as the job), then every rank stops at the same step.
    stop_file = str(tmp_path / "stop")
    config = DemoConfig(
        world_size=2,
        steps=20_000,
        hidden=256,
        layers=3,
        step_sleep_s=0.005,
        job="tunejob",
        stop_file=stop_file,
    )
    headers = {"Authorization": f"Bearer {token}"}
    async with Aggregator(settings, registry=CollectorRegistry(), targets=[]) as aggregator:
        agent_settings = AgentSettings(
            socket_path=os.path.join(tmp_path, "agent.sock"),
            metrics_port=0,
            aggregator_url=f"http://127.0.0.1:{aggregator.port}",
            token=token,
            spool_path=os.path.join(tmp_path, "spool.db"),
            sample_interval_s=1.0,
        )
        base = f"http://127.0.0.1:{aggregator.port}"
        async with Agent(agent_settings, registry=CollectorRegistry()):
            job = asyncio.ensure_future(
                asyncio.to_thread(
                    run_ranks, train_rank, 2, config, agent_settings.socket_path, timeout_s=240
                )
            )
            async with aiohttp.ClientSession(headers=headers) as http:
                url = f"{base}/api/v1/jobs/tunejob/tune"
                status, reply = 404, {}
                while status == 404 and not job.done():
                    await asyncio.sleep(0.2)
                    status, reply = await _post_tune(http, url, {})
                assert status == 201, reply
                session_id = reply["session_id"]
                again, conflict = await _post_tune(http, url, {"max_trials": 2})
                assert again == 409 and session_id in conflict["error"]
                deadline = time.monotonic() + 150
                while aggregator.tuning.active("tunejob") is not None and not job.done():
                    assert time.monotonic() < deadline, "the tuning session did not end"
                    await asyncio.sleep(0.2)
                Path(stop_file).touch()
                async with http.get(f"{base}/metrics") as response:
                    metrics = await response.text()
                async with http.get(f"{base}/api/v1/tuning/sessions?job=tunejob") as response:
                    sessions = (await response.json())["sessions"]
            await job

    [session] = sessions
    assert session["id"] == session_id
    assert session["state"] == "finished", session
    assert session["summary"] and session["reason"]
    assert session["baseline_score"] is not None and session["best_config"] is not None

    trials = _rows(db_url, f"SELECT * FROM tuning_trials WHERE session_id = '{session_id}'")
    assert [t["trial_index"] for t in sorted(trials, key=lambda t: t["trial_index"])] == list(
        range(len(trials))
    )
    assert len(trials) >= 3  # the baseline, two trials, perhaps a verification
    assert all(t["decision"] for t in trials), trials
    assert all(t["command_id"] for t in trials)

    # Every config was applied at the same step on both ranks.
    steps = _rows(db_url, "SELECT step, rank, config_version FROM steps WHERE job = 'tunejob'")
    by_step: dict[int, set[int]] = defaultdict(set)
    ranks: dict[int, set[int]] = defaultdict(set)
    for row in steps:
        by_step[row["step"]].add(row["config_version"])
        ranks[row["step"]].add(row["rank"])
    both = [s for s in by_step if ranks[s] == {0, 1}]
    assert len(both) > 100
    assert all(len(by_step[s]) == 1 for s in both)
    assert max(v for s in both for v in by_step[s]) >= 3  # several configs were applied

    # One config in flight: each command was created after the previous one was answered.
    commands = _rows(
        db_url,
        "SELECT status, created_unix_s, updated_unix_s FROM commands "
        "WHERE job = 'tunejob' AND kind = 'config' ORDER BY created_unix_s",
    )
    assert len(commands) >= len(trials)
    for earlier, later in itertools.pairwise(commands):
        assert earlier["status"] in ("applied", "rejected", "expired")
        assert later["created_unix_s"] >= earlier["updated_unix_s"]

    assert 'torshmon_tuner_state{job="tunejob",state="finished"} 1.0' in metrics
    assert 'torshmon_tuner_trials_total{decision="kept",job="tunejob"}' in metrics
    assert 'torshmon_tuner_best_score{job="tunejob"}' in metrics


async def test_session_survives_an_aggregator_restart(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'history.db'}"
    now = [1000.0]
    fast = TunerSettings(
        warmup_steps=1, window_steps=2, windows=3, min_windows=3, max_trials=2, apply_timeout_s=5
    )
    settings = AggregatorSettings(port=0, db_url=db_url, aggregator_id="shard-a", tuner=fast)

    def clock() -> float:
        return now[0]

    async with Aggregator(settings, registry=CollectorRegistry(), targets=[], clock=clock) as first:
        # No job: pretend rank 0 reported DDP's bucket cap, then start by hand.
        _report_bucket_cap(first, "nojob", 25 * 2**20)
        session_id = await first.tuning.start_session("nojob", trigger="test")
        pending = first.tuning._active["nojob"].command_id
        assert pending is not None
        [row] = _rows(db_url, "SELECT state, state_blob FROM tuning_sessions")
        assert row["state"] == "applying"

    # A new process of the same shard resumes the session and asks for the config again.
    async with Aggregator(
        settings, registry=CollectorRegistry(), targets=[], clock=clock
    ) as second:
        assert second.tuning.active("nojob") == session_id
        entry = second.tuning._active["nojob"]
        assert entry.command_id is not None and entry.command_id != pending
        blob = _rows(db_url, "SELECT state_blob FROM tuning_sessions")[0]["state_blob"]
        restored = TuningSession.from_state(json.loads(blob))
        assert restored.phase == "applying"
        # Nobody answers: after apply_timeout_s the baseline counts as refused, which
        # ends the session cleanly (aborted, with its reason stored).
        now[0] += 10.0
        await second.evaluate()
        for _ in range(50):
            if second.tuning.active("nojob") is None:
                break
            await asyncio.sleep(0.02)
        assert second.tuning.active("nojob") is None

    [row] = _rows(db_url, "SELECT state, reason, ended_unix_s FROM tuning_sessions")
    assert row["state"] == "aborted"
    assert "refused" in row["reason"]
    assert row["ended_unix_s"] == 1010.0
    [trial] = _rows(db_url, "SELECT decision, reason FROM tuning_trials")
    assert trial["decision"] == "failed"

    # A third start finds nothing to resume.
    async with Aggregator(settings, registry=CollectorRegistry(), targets=[], clock=clock) as third:
        assert third.tuning.active("nojob") is None


async def test_acks_route_only_the_awaited_command(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'history.db'}"
    now = [2000.0]
    settings = AggregatorSettings(port=0, db_url=db_url, aggregator_id="shard-b", tuner=SMALL)
    async with Aggregator(
        settings, registry=CollectorRegistry(), targets=[], clock=lambda: now[0]
    ) as agg:
        _report_bucket_cap(agg, "j", 25 * 2**20)
        await agg.tuning.start_session("j", trigger="test")
        entry = agg.tuning._active["j"]
        awaited = agg.commands.get(entry.command_id or "")
        assert awaited is not None
        # Another command of the same job is answered: the session must not move.
        other = await agg.dispatch.submit_command("j", "config", {"bucket_cap_mb": 4.0})
        agg.tuning._on_command(
            CommandStatus(other.command, "applied", now[0], now[0], version=7, effective_step=3)
        )
        assert entry.session.phase == "applying"
        agg.tuning._on_command(
            CommandStatus(awaited.command, "applied", now[0], now[0], version=1, effective_step=5)
        )
        assert entry.session.phase == "measuring"
        assert entry.session.trials[0].version == 1


async def test_abort_session_ends_it_cleanly_and_keeps_it_readable(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'history.db'}"
    settings = AggregatorSettings(port=0, db_url=db_url, aggregator_id="shard-c")
    async with Aggregator(
        settings, registry=CollectorRegistry(), targets=[], clock=lambda: 3000.0
    ) as agg:
        _report_bucket_cap(agg, "j", 25 * 2**20)
        session_id = await agg.tuning.start_session("j", trigger="test")
        commands_before = len(_rows(db_url, "SELECT id FROM commands"))
        assert await agg.tuning.abort_session("j", "the job stopped", restore=False)
        assert agg.tuning.active("j") is None
        ended = agg.tuning.session("j")
        assert ended is not None and ended.phase == "aborted"
        assert ended.reason == "the job stopped"
        assert not await agg.tuning.abort_session("j", "again")
    [row] = _rows(db_url, "SELECT id, state, reason FROM tuning_sessions")
    assert row == {"id": session_id, "state": "aborted", "reason": "the job stopped"}
    # restore=False: nothing was pushed to a job that is gone.
    assert len(_rows(db_url, "SELECT id FROM commands")) == commands_before


async def test_the_api_aborts_a_session(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'history.db'}"
    token = secrets.token_hex(8)
    settings = AggregatorSettings(port=0, db_url=db_url, token=token, aggregator_id="shard-d")
    async with (
        Aggregator(settings, registry=CollectorRegistry(), targets=[], clock=lambda: 4000.0) as agg,
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http,
    ):
        url = f"http://127.0.0.1:{agg.port}/api/v1/jobs/j/tune"
        _report_bucket_cap(agg, "j", 25 * 2**20)
        async with http.post(url, json={}) as response:
            assert response.status == 201
            session_id = (await response.json())["session_id"]
        commands_before = len(_rows(db_url, "SELECT id FROM commands"))
        body = {"reason": "the job stopped", "restore": False}
        async with http.delete(url, json=body) as response:
            assert response.status == 200, await response.text()
            assert await response.json() == {"job": "j", "aborted": True}
        async with http.delete(url, json=body) as response:
            assert response.status == 404
        async with http.delete(url, json={"restore": "yes"}) as response:
            assert response.status == 400
        async with http.delete(url, json={"colour": "red"}) as response:
            assert response.status == 400
    [row] = _rows(db_url, "SELECT id, state, reason FROM tuning_sessions")
    assert row == {"id": session_id, "state": "aborted", "reason": "the job stopped"}
    assert len(_rows(db_url, "SELECT id FROM commands")) == commands_before
