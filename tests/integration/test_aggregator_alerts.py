"""Alerts through the real service: stored in SQL, resumed after a restart, traced."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import create_engine, text

from tests.integration import wire_factory as wf
from tests.integration.aggregator_thread import AggregatorThread
from torshmon.aggregator.notify import otel
from torshmon.aggregator.settings import AggregatorSettings

pytestmark = pytest.mark.integration


def _steps(
    agg: AggregatorThread, hellos: list, first: int, n: int, slow_rank: int | None, seq: int
) -> int:
    """Post ``n`` steps of every rank; ``slow_rank`` computes 1.3x longer, so its peers
    wait for it and every rank's step time stays the same (DDP runs in lockstep).
    Returns the next seq."""
    now = time.time_ns()
    rng = random.Random(first)
    for i in range(n):
        step = first + i
        batches = []
        duration = 0.06 * rng.uniform(0.99, 1.01)
        for h in hellos:
            compute = (0.057 if h.rank == slow_rank else 0.044) * rng.uniform(0.99, 1.01)
            wait = duration - compute
            batches.append(
                wf.batch(
                    h,
                    step,
                    [
                        wf.step(
                            step,
                            duration_s=compute + wait,
                            comm_wait_s=wait,
                            end_unix_ns=now + step * 10**7,
                        )
                    ],
                )
            )
        assert agg.post_ingest(wf.ingest_body("agent", [(seq, wf.record(*batches))]))[0] == 200
        seq += 1
    return seq


def _settings(tmp_path: Path, **overrides: Any) -> AggregatorSettings:
    """Aggregator ``a1`` on any free port, its history in ``tmp_path/h.db``."""
    url = f"sqlite:///{tmp_path / 'h.db'}"
    return AggregatorSettings(port=0, db_url=url, token="t", aggregator_id="a1", **overrides)


def _rows(url: str) -> list[tuple[object, ...]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [
                tuple(r)
                for r in conn.execute(
                    text(
                        "SELECT rule, rank, state, fired_at_unix_s IS NOT NULL "
                        "FROM alerts ORDER BY id"
                    )
                )
            ]
    finally:
        engine.dispose()


def test_a_firing_alert_survives_a_restart_and_resolves_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    # The test evaluates when it chooses.
    settings = _settings(tmp_path, eval_interval_s=60, eval_on_finding=False)
    hellos = [
        wf.hello("j", 0, 3, session="s0"),
        wf.hello("j", 1, 3, session="s1"),
        wf.hello("j", 2, 3, session="s2"),
    ]
    with AggregatorThread(settings) as agg:
        assert agg.post_ingest(wf.ingest_body("agent", [(1, wf.record(*hellos))]))[0] == 200
        # The straggler detector learns the peers' noise first (about 30 steps), then
        # pages a rank slower than its peers in 16 of its last 28 steps.
        seq = _steps(agg, hellos, 1, 40, None, 2)
        seq = _steps(agg, hellos, 41, 20, 1, seq)
        transitions = agg.call(agg.aggregator.evaluate())
        assert [(a.rule, a.state, a.labels.get("rank")) for a in transitions] == [
            ("Straggler", "firing", "1")
        ]
    assert _rows(url) == [("Straggler", 1, "firing", True)]

    with AggregatorThread(settings) as agg:
        assert [(a.rule, a.state) for a in agg.aggregator.alerts.active()] == [
            ("Straggler", "firing")
        ]
        # Restored from SQL: the finding is gone with the old process, and no one fires twice.
        # Normal steps again: the alert resolves, in the same row.
        # Back in line for 25 steps: resolved.
        seq = _steps(agg, hellos, 61, 30, None, seq)
        transitions = agg.call(agg.aggregator.evaluate())
        assert [(a.rule, a.state) for a in transitions] == [("Straggler", "resolved")]
    assert _rows(url) == [("Straggler", 1, "resolved", True)]
    engine = create_engine(url)
    with engine.connect() as conn:
        events = [r[0] for r in conn.execute(text("SELECT state FROM alert_events ORDER BY id"))]
    engine.dispose()
    assert events == ["firing", "resolved"]


def test_steps_and_alerts_become_opentelemetry_spans(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    settings = _settings(tmp_path, eval_interval_s=60, eval_on_finding=False)
    hellos = [wf.hello("j", 0, 3), wf.hello("j", 1, 3), wf.hello("j", 2, 3)]
    with AggregatorThread(settings) as agg:
        agg.aggregator.tracer = otel.Tracing(None, processor=SimpleSpanProcessor(exporter))
        agg.post_ingest(wf.ingest_body("agent", [(1, wf.record(*hellos))]))
        seq = _steps(agg, hellos, 1, 40, None, 2)
        _steps(agg, hellos, 41, 20, 2, seq)
        agg.call(agg.aggregator.evaluate())
    spans = exporter.get_finished_spans()
    steps = [s for s in spans if s.name == "train.step"]
    assert len(steps) == 60  # rank 0's steps stand for the job's
    assert {s.attributes["torshmon.job"] for s in steps} == {"j"}
    phases = [s for s in spans if s.name == "train.forward"]
    assert phases and phases[0].parent is not None
    fired = [s for s in spans if s.name == "alert.firing"]
    assert fired and fired[0].attributes["torshmon.label.rank"] == "2"


def test_a_new_finding_is_evaluated_at_once_not_on_the_timer(tmp_path: Path) -> None:
    settings = _settings(tmp_path, eval_interval_s=60)  # the timer never comes in the test
    hellos = [wf.hello("j", 0, 3), wf.hello("j", 1, 3), wf.hello("j", 2, 3)]
    with AggregatorThread(settings) as agg:
        agg.post_ingest(wf.ingest_body("agent", [(1, wf.record(*hellos))]))
        seq = _steps(agg, hellos, 1, 40, None, 2)
        assert agg.aggregator.alerts.active() == []
        _steps(agg, hellos, 41, 16, 1, seq)
        deadline = time.monotonic() + 5.0
        while not agg.aggregator.alerts.active() and time.monotonic() < deadline:
            time.sleep(0.02)
        fired = [(a.rule, a.state, a.labels.get("rank")) for a in agg.aggregator.alerts.active()]
    assert fired == [("Straggler", "firing", "1")]


def test_after_a_restart_running_jobs_keep_their_straggler_detection(tmp_path: Path) -> None:
    """The probes said hello to the old process only; the new one takes the job's world
    size from SQL, so a straggler after the restart is still named."""
    settings = _settings(tmp_path, eval_interval_s=0.1)
    hellos = [wf.hello("j", 0, 3), wf.hello("j", 1, 3), wf.hello("j", 2, 3)]
    with AggregatorThread(settings) as agg:
        agg.post_ingest(wf.ingest_body("agent", [(1, wf.record(*hellos))]))
        seq = _steps(agg, hellos, 1, 20, None, 2)
    with AggregatorThread(settings) as agg:
        assert agg.aggregator.live.jobs["j"].world_size == 3
        seq = _steps(agg, hellos, 21, 40, None, seq)
        _steps(agg, hellos, 61, 16, 2, seq)
        deadline = time.monotonic() + 5.0
        while not agg.aggregator.alerts.active() and time.monotonic() < deadline:
            time.sleep(0.02)
        fired = [(a.rule, a.labels.get("rank")) for a in agg.aggregator.alerts.active()]
    assert fired == [("Straggler", "2")]
