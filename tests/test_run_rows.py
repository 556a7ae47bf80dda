"""The rows of a job's launch that are not per step (configs, commands, tuning) kept
with their run: a relaunch under the same job name numbers its configs from 1 again."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestClient, TestServer
from alembic import command
from alembic.config import Config

from tests.integration import wire_factory as wf
from tests.pg import pg_database
from tests.test_api import AUTH, Api
from torshmon.aggregator.ingest import IngestStore
from torshmon.history.db import make_engine
from torshmon.history.migrate import alembic_dir, upgrade
from torshmon.history.store import HistoryStore
from torshmon.history.store.report import load_job_history
from torshmon.history.store.rows import TuningSessionRow, TuningTrialRow, row_values
from torshmon.report import render_text, report_from_db
from torshmon.wire import SCHEMA_VERSION, AppliedConfig, IngestBatch, IngestRecord

S = 10**9
T0 = 1_800_000_000 * S
MIB = 1 << 20


@pytest.fixture(params=["sqlite", "postgresql"])
def history_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty history database of each dialect (PostgreSQL: the local test server)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'h.db'}"
    else:
        with pg_database() as url:
            yield url


def _applied(version: int, bucket_mib: int, step: int) -> AppliedConfig:
    return AppliedConfig(
        version=version,
        bucket_cap_bytes=bucket_mib * MIB,
        first_bucket_cap_bytes=MIB,
        codec="none",
        codec_params={},
        effective_step=step,
    )


def _launch(store: IngestStore, run_id: str, start_ns: int, caps_mib: tuple[int, int]) -> None:
    """One launch of job ``j`` (2 ranks, run ``run_id``) of 4 steps of 0.1 s from
    ``start_ns``; rank 0 applies config v1 at step 2 and v2 at step 3 (``caps_mib``)."""
    records = []
    for rank in (0, 1):
        hello = msgspec.structs.replace(
            wf.hello("j", rank, 2, session=f"{run_id}-{rank}"),
            run_id=run_id,
            attached_unix_ns=start_ns,
        )
        steps = []
        for n in range(1, 5):
            step = wf.step(n, end_unix_ns=start_ns + n * S // 10)
            if rank == 0 and n in (2, 3):
                config = _applied(n - 1, caps_mib[n - 2], n + 1)
                step = msgspec.structs.replace(step, applied_config=config)
            steps.append(step)
        records.append(wf.record(hello, wf.batch(hello, 1, steps)))
    batch = IngestBatch(
        v=SCHEMA_VERSION,
        agent_id=f"agent-{run_id}",
        node="node-a",
        records=[IngestRecord(seq=i + 1, record=r) for i, r in enumerate(records)],
    )
    store.store(batch)


def test_a_relaunch_keeps_each_runs_config_versions_apart(history_url: str) -> None:
    upgrade(history_url)
    engine = make_engine(history_url)
    store = IngestStore(engine, aggregator_id="t")
    _launch(store, "r1", T0, (8, 16))
    _launch(store, "r2", T0 + 100 * S, (32, 64))
    with engine.connect() as conn:
        first = load_job_history(conn, "j", run="r1")
        second = load_job_history(conn, "j", run="r2")
    engine.dispose()
    assert first is not None and second is not None
    caps = [
        [(c["version"], c["bucket_cap_bytes"] // MIB) for c in h.configs] for h in (first, second)
    ]
    assert caps == [[(1, 8), (2, 16)], [(1, 32), (2, 64)]]

    texts = [
        render_text(report_from_db(history_url, "j", run=run, now_unix_s=T0 / S + 1000))
        for run in ("r1", "r2")
    ]
    for text, (mine, theirs) in zip(texts, [((8, 16), (32, 64)), ((32, 64), (8, 16))], strict=True):
        changes = text.split("Config changes", 1)[1].split("\n\n", 1)[0]
        assert all(f"bucket {c} MB" in changes for c in mine), changes
        assert not any(f"bucket {c} MB" in changes for c in theirs), changes


def _tuning(session_id: str, started_s: float) -> tuple[TuningSessionRow, list[TuningTrialRow]]:
    config = {"bucket_cap_mb": 25, "codec": "none"}
    session = TuningSessionRow(
        id=session_id,
        job="j",
        state="trial_measure",
        trigger="user",
        started_unix_s=started_s,
        ended_unix_s=None,
        baseline_config=config,
        best_config=None,
        baseline_score=None,
        best_score=None,
        reason="",
        state_blob={},
    )
    trial = TuningTrialRow(
        session_id=session_id,
        job="j",
        trial_index=0,
        config=config,
        command_id=None,
        state="measuring",
        windows=[],
        score=None,
        decision=None,
        reason="",
        started_unix_s=started_s + 1,
        ended_unix_s=None,
    )
    return session, [trial]


async def test_commands_and_tuning_belong_to_the_run_they_were_made_in(
    history_url: str,
) -> None:
    """Launch r2 attached at +40 s while r1 still ran; the command and the tuning
    session made for the job at +50 s, before r2's hello came, are r1's (by time they
    would fall in r2's span), and the next ones r2's."""
    upgrade(history_url)
    writer = ThreadPoolExecutor(1)
    store = HistoryStore(history_url, aggregator_id="a1", writer=writer)
    store.open()
    try:
        ingest = IngestStore(store.engine, aggregator_id="a1")
        _launch(ingest, "r1", T0, (8, 16))
        await store.add_command("c1", "j", "config", {"bucket_cap_mb": 8}, T0 / S + 50)
        await store.save_tuning(*_tuning("t1", T0 / S + 50))
        _launch(ingest, "r2", T0 + 40 * S, (32, 64))
        await store.add_command("c2", "j", "config", {"bucket_cap_mb": 32}, T0 / S + 60)
        await store.save_tuning(*_tuning("t2", T0 / S + 60))
        await store.save_tuning(*_tuning("t1", T0 / S + 50))  # t1 goes on: still r1's
        with store.engine.connect() as conn:
            runs = {run: load_job_history(conn, "j", run=run) for run in ("r1", "r2")}
            trials = conn.execute(sa.text("SELECT session_id, run_id FROM tuning_trials"))
            trial_runs = sorted(map(tuple, trials))
        async with TestClient(TestServer(Api(store).app())) as client:

            async def ids(path: str, key: str, field: str = "id") -> list[object]:
                async with client.get(path, headers=AUTH) as response:
                    assert response.status == 200, await response.text()
                    return [row[field] for row in (await response.json())[key]]

            listed = (
                await ids("/api/v1/tuning/sessions?run_id=r1", "sessions"),
                await ids("/api/v1/tuning/trials?job=j&run_id=r2", "trials", "session_id"),
                await ids("/api/v1/tuning/sessions?job=j", "sessions", "run_id"),
            )
    finally:
        writer.shutdown(wait=True)
        store.close()
    shown = {
        run: (
            [c["id"] for c in h.commands],
            [t["id"] for t in h.tuning_sessions],
            [t["session_id"] for t in h.tuning_trials],
        )
        for run, h in runs.items()
        if h is not None
    }
    assert shown == {"r1": (["c1"], ["t1"], ["t1"]), "r2": (["c2"], ["t2"], ["t2"])}
    assert trial_runs == [("t1", "r1"), ("t2", "r2")]
    assert listed == (["t1"], ["t2"], ["r2", "r1"])  # the API: newest first


def _upgrade_to(url: str, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(alembic_dir()))
    engine = make_engine(url)
    with engine.connect() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)
        conn.commit()
    engine.dispose()


def _config_row(job: str, version: int, applied_s: int, bucket_mib: int) -> dict[str, object]:
    return {
        "job": job,
        "version": version,
        "bucket_cap_bytes": bucket_mib * MIB,
        "first_bucket_cap_bytes": MIB,
        "codec": "none",
        "codec_params": {},
        "effective_step": version * 10,
        "applied_unix_ns": T0 + applied_s * S,
    }


def _rows_at_0017(conn: sa.Connection) -> None:
    """Job ``j`` ran as r1 from T0 and as r2 from T0 + 100 s; job ``k`` has no runs."""
    meta = sa.MetaData()
    meta.reflect(conn)
    t = meta.tables
    conn.execute(
        t["jobs"].insert(),
        [
            {"job": job, "first_seen_unix_ns": T0, "last_seen_unix_ns": T0 + 200 * S}
            for job in ("j", "k")
        ],
    )
    conn.execute(
        t["runs"].insert(),
        [
            {"job": "j", "run_id": "r1", "started_unix_ns": T0, "world_size": 2},
            {"job": "j", "run_id": "r2", "started_unix_ns": T0 + 100 * S, "world_size": 2},
        ],
    )
    # Keyed (job, version): r2's v1 replaced r1's; r1's v2 is the one r2 never reached.
    conn.execute(
        t["configs"].insert(),
        [_config_row("j", 1, 110, 32), _config_row("j", 2, 50, 16), _config_row("k", 1, 5, 8)],
    )
    command = {"kind": "config", "args": {}, "status": "applied", "reason": ""}
    conn.execute(
        t["commands"].insert(),
        [
            {"id": f"c{n}", "job": job, "created_unix_s": T0 / S + at, "updated_unix_s": 0}
            | command
            for n, (job, at) in enumerate([("j", 2), ("j", 102), ("k", 3)])
        ],
    )
    session, trials = _tuning("t1", T0 / S + 5)
    conn.execute(t["tuning_sessions"].insert(), row_values(session))
    conn.execute(t["tuning_trials"].insert(), [row_values(x) for x in trials])
    conn.execute(
        t["evidence_captures"].insert(),
        {
            "id": "e1",
            "job": "j",
            "rule": "",
            "profile_ranks": [],
            "created_unix_s": T0 / S + 105,
        },
    )


def test_a_history_at_0017_gets_the_run_of_its_configs_commands_and_tuning(
    history_url: str,
) -> None:
    url = history_url
    _upgrade_to(url, "0017")
    engine = make_engine(url)
    with engine.begin() as conn:
        _rows_at_0017(conn)
    engine.dispose()
    upgrade(url)  # 0018

    engine = make_engine(url)
    with engine.begin() as conn:

        def runs(table: str, key: str) -> list[tuple[object, ...]]:
            rows = conn.execute(sa.text(f"SELECT job, {key}, run_id FROM {table} ORDER BY 1, 2"))
            return [tuple(r) for r in rows]

        assert runs("configs", "version") == [("j", 1, "r2"), ("j", 2, "r1"), ("k", 1, "")]
        assert runs("commands", "id") == [("j", "c0", "r1"), ("j", "c1", "r2"), ("k", "c2", None)]
        assert runs("tuning_sessions", "id") == [("j", "t1", "r1")]
        assert runs("tuning_trials", "session_id") == [("j", "t1", "r1")]
        assert runs("evidence_captures", "id") == [("j", "e1", "r2")]
        # The key now holds a version per run: r1's own v1 goes in beside r2's.
        configs = sa.Table("configs", sa.MetaData(), autoload_with=conn)
        conn.execute(configs.insert(), _config_row("j", 1, 1, 8) | {"run_id": "r1"})
        first = load_job_history(conn, "j", run="r1")
        unrun = load_job_history(conn, "k")
    assert first is not None and unrun is not None
    assert [(c["version"], c["bucket_cap_bytes"] // MIB) for c in first.configs] == [
        (1, 8),
        (2, 16),
    ]
    assert [c["id"] for c in first.commands] == ["c0"]
    assert [(c["version"], c["run_id"]) for c in unrun.configs] == [(1, "")]

    config = Config()
    config.set_main_option("script_location", str(alembic_dir()))
    with engine.connect() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0017")  # the latest applied of each version stays
        conn.commit()
        rows = conn.execute(sa.text("SELECT job, version, bucket_cap_bytes FROM configs"))
        kept = sorted((r[0], r[1], r[2] // MIB) for r in rows)
    engine.dispose()
    assert kept == [("j", 1, 32), ("j", 2, 16), ("k", 1, 8)]
