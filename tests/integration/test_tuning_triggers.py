"""What starts a tuning session, on a real 2-rank gloo job through agent + aggregator:
``torshmon tune JOB --wait`` (the CLI against the HTTP API) and the High Communication
Overhead rule's ``autotune`` action; and the OpenTelemetry span of every decision."""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from torshmon.aggregator.core.tuner import TunerSettings
from torshmon.aggregator.notify import otel
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.demo import DemoConfig, train_rank
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

SMALL = TunerSettings(warmup_steps=2, window_steps=5, windows=3, min_windows=3, max_trials=3)
SESSION_TIMEOUT_S = 150


@dataclass
class Running:
    aggregator: Aggregator
    base_url: str
    token_file: Path
    exporter: InMemorySpanExporter
    stop_file: Path


@asynccontextmanager
async def running_job(tmp_path: Path, job: str, rules: str | None = None) -> AsyncIterator[Running]:
    """Aggregator (spans to memory) + agent + a 2-rank demo job that runs until stopped."""
    from torshmon.agent.daemon import Agent, AgentSettings

    token = secrets.token_hex(8)
    token_file = tmp_path / "token"
    token_file.write_text(token)
    rules_path = None
    if rules is not None:
        rules_path = str(tmp_path / "rules.yaml")
        Path(rules_path).write_text(rules)
    settings = AggregatorSettings(
        port=0,
        db_url=f"sqlite:///{tmp_path / 'history.db'}",
        token=token,
        aggregator_id="triggers",
        eval_interval_s=0.2,
        rules_path=rules_path,
        tuner=SMALL,
    )
    stop_file = tmp_path / "stop"
    config = DemoConfig(
        world_size=2,
        steps=20_000,
        hidden=256,
        layers=3,
        step_sleep_s=0.005,
        job=job,
        stop_file=str(stop_file),
    )
    exporter = InMemorySpanExporter()
    async with Aggregator(
        settings,
        registry=CollectorRegistry(),
        targets=[],
        tracer=otel.Tracing(None, processor=SimpleSpanProcessor(exporter)),
    ) as aggregator:
        agent_settings = AgentSettings(
            socket_path=os.path.join(tmp_path, "agent.sock"),
            metrics_port=0,
            aggregator_url=f"http://127.0.0.1:{aggregator.port}",
            token=token,
            spool_path=os.path.join(tmp_path, "spool.db"),
            sample_interval_s=1.0,
        )
        async with Agent(agent_settings, registry=CollectorRegistry()):
            ranks = asyncio.ensure_future(
                asyncio.to_thread(
                    run_ranks, train_rank, 2, config, agent_settings.socket_path, timeout_s=240
                )
            )
            try:
                yield Running(
                    aggregator,
                    f"http://127.0.0.1:{aggregator.port}",
                    token_file,
                    exporter,
                    stop_file,
                )
            finally:
                stop_file.touch()
                await ranks


def _decision_spans(exporter: InMemorySpanExporter, session_id: str) -> list[Any]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.name.startswith("tune.")
        and (s.attributes or {}).get("torshmon.tuning.session") == session_id
    ]


async def test_tune_cli_waits_prints_trials_and_spans_record_each_decision(
    tmp_path: Path,
) -> None:
    async with running_job(tmp_path, "clijob") as run:
        # The job must have reported its config before a session can start.
        deadline = time.monotonic() + 60
        while (
            run.aggregator.live.job_summary("clijob") is None
            or (run.aggregator.live.job_summary("clijob") or {}).get("bucket_cap_bytes") is None
        ):
            assert time.monotonic() < deadline, "the job never reported DDP stats"
            await asyncio.sleep(0.2)
        cli = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "torshmon.cli",
            "tune",
            "clijob",
            "--url",
            run.base_url,
            "--token-file",
            str(run.token_file),
            "--max-trials",
            "3",
            "--wait",
            "--poll-s",
            "0.3",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(cli.communicate(), SESSION_TIMEOUT_S)
        stdout, stderr = out.decode(), err.decode()
        assert cli.returncode == 0, (stdout, stderr)
        session = run.aggregator.tuning.session("clijob")
        assert session is not None and session.done

    lines = stdout.splitlines()
    assert lines[0].startswith("tuning session ") and "started for job clijob" in lines[0]
    session_id = lines[0].split()[2]
    trial_lines = [line for line in lines if line.startswith("trial ")]
    # One line per decided trial, in order, each with its decision, as the session has them.
    decided = [t for t in session.trials if t.decision is not None]
    assert [line.split(":")[0] for line in trial_lines] == [f"trial {t.index}" for t in decided]
    for line, trial in zip(trial_lines, decided, strict=True):
        assert f": {trial.decision}" in line
        # The codec with its parameters, the score with its unit (issue 18).
        assert trial.config.codec in line
        for name, value in trial.config.codec_params.items():
            assert f"{name} {value:g}" in line, line
        if trial.score is not None:
            assert f"{trial.score:.4g} {session.unit}" in line, line
    assert session.unit in ("samples/s per rank", "steps/s")
    assert lines[-1] == f"session finished: {session.summary()}"
    assert "trials done, the baseline included" in lines[-1]

    # Every decision became a span: the baseline, each trial, and the end.
    spans = _decision_spans(run.exporter, session_id)
    names = [s.name for s in spans]
    assert names[0] == "tune.baseline"
    assert names[-1] == "tune.finish"
    assert names.count("tune.trial") == sum(1 for t in session.trials if t.kind == "trial")
    for span in spans:
        assert span.attributes["torshmon.job"] == "clijob"
    finish = spans[-1]
    assert finish.attributes["torshmon.tuning.summary"] == session.summary()
    trial_spans = [s for s in spans if s.name == "tune.trial"]
    assert [s.attributes["torshmon.tuning.config"] for s in trial_spans] == [
        t.config.describe() for t in session.trials if t.kind == "trial"
    ]


HIGH_COMM_RULES = """
rules:
  - name: High Communication Overhead
    kind: threshold
    metric: communication_time_ratio
    op: ">"
    value: 0.01
    aggregate: mean
    by: [job]
    for: 1s
    severity: high
    annotations:
      summary: "Communication takes {value:.0%} of step time in job {job}"
    actions: [notify, autotune]
"""


async def test_high_communication_overhead_alert_starts_a_session(tmp_path: Path) -> None:
    # The default rule's threshold (40 % for 120 s) with a lower bar and a short "for":
    # the real job's communication ratio is what fires it.
    async with running_job(tmp_path, "alertjob", rules=HIGH_COMM_RULES) as run:
        deadline = time.monotonic() + SESSION_TIMEOUT_S
        session = None
        # Ended: its last decision is made (done) and stored, which is when the manager
        # moves it from the active sessions to the ended ones (active() is None again).
        while session is None or not session.done or run.aggregator.tuning.active("alertjob"):
            assert time.monotonic() < deadline, "no tuning session started and ended"
            await asyncio.sleep(0.2)
            session = run.aggregator.tuning.session("alertjob")
        firing = [
            a
            for a in run.aggregator.alerts.active()
            if a.rule == "High Communication Overhead" and a.job == "alertjob"
        ]
        entry = run.aggregator.tuning._ended["alertjob"]
    assert firing, "the alert that started the session is not firing"
    assert entry.trigger == "alert: High Communication Overhead"
    assert session.phase == "finished", session.reason
    spans = _decision_spans(run.exporter, entry.session_id)
    names = [s.name for s in spans]
    assert names[0] == "tune.baseline"
    assert names[-1] == "tune.finish"
