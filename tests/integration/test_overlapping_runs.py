"""Two launches of one job name that overlap in time, real probes on real gloo ranks
writing to one aggregator on loopback: each launch's steps, alerts and report are its
own (until run ids were stored on the rows, a run was a time range, and the second
launch took the first one's later steps and alerts)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.loopback import aggregator_and_agent
from torshmon.aggregator.service import Aggregator
from torshmon.history.query import run_query
from torshmon.launch import run_ranks
from torshmon.report import report_from_db

pytestmark = pytest.mark.integration

JOB = "overlap"
TIMEOUT_S = 240.0
#: The loss the launch's loud rank reports (the others report 1): over the rule's 50.
LOUD_LOSS = 100.0
SECOND_STEPS = 40
RULES = """
rules:
  - name: Loss Too High
    kind: threshold
    metric: loss
    op: ">"
    value: 50
    for: 0s
    severity: warning
    annotations:
      summary: "Loss of job {job} rank {rank} is {value}"
"""
ENV = {"OMP_NUM_THREADS": "1"}


def _train(rank: int, world: int, sock: str, loud_rank: int, steps: int, stop: str) -> int:
    """DDP steps until ``steps`` or, every rank agreeing, until the file ``stop`` exists;
    rank ``loud_rank`` reports a loss of ``LOUD_LOSS``. Returns the steps taken."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torshmon
    from tests.integration.test_probe import _model

    ddp = DistributedDataParallel(_model())
    monitor = torshmon.attach(ddp, job=JOB, agent_socket=sock, flush_interval_s=0.1)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    done = 0
    while done < steps:
        with monitor.step(batch_size=4, loss=LOUD_LOSS if rank == loud_rank else 1.0):
            time.sleep(0.05)
            optimizer.zero_grad()
            ddp(torch.randn(4, 32)).sum().backward()
            optimizer.step()
        done += 1
        flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
    monitor.close(timeout_s=10)
    return done


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 150.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


def _firing(aggregator: Aggregator, run: str) -> list[dict[str, str]]:
    return [
        dict(a.labels)
        for a in aggregator.alerts.active()
        if a.state == "firing" and a.labels.get("run") == run
    ]


def _alerts_of(aggregator: Aggregator, run: str) -> list[tuple[str, str, float]]:
    """The active alerts of ``run``: (fingerprint, state, since when)."""
    return [
        (a.fingerprint, a.state, a.starts_at_unix_s)
        for a in aggregator.alerts.active()
        if a.labels.get("run") == run
    ]


def _runs_exported(aggregator: Aggregator) -> set[str]:
    """The ``run`` label values of every job series the aggregator exports now."""
    return {
        sample.labels["run"]
        for family in aggregator.registry.collect()
        for sample in family.samples
        if sample.labels.get("job") == JOB and "run" in sample.labels
    }


def _launch(sock: str, run: str, loud_rank: int, steps: int, stop: Path) -> Any:
    env = {**ENV, "TORSHMON_RUN_ID": run}
    return asyncio.create_task(
        asyncio.to_thread(
            run_ranks, _train, 2, sock, loud_rank, steps, str(stop), timeout_s=TIMEOUT_S, env=env
        )
    )


async def test_two_overlapping_launches_keep_their_steps_alerts_and_reports(
    tmp_path: Path,
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    stop_first = tmp_path / "stop-first"
    async with aggregator_and_agent(tmp_path, "runs", rules_path=str(rules)) as (agg, agent):
        first = _launch(agent.socket_path, "launch-a", 1, 100_000, stop_first)
        await _until(lambda: bool(_firing(agg, "launch-a")), "the first launch's alert")
        assert [a["rank"] for a in _firing(agg, "launch-a")] == ["1"]
        (first_alert,) = _alerts_of(agg, "launch-a")
        second = _launch(agent.socket_path, "launch-b", 0, SECOND_STEPS, tmp_path / "never")
        await _until(lambda: bool(_firing(agg, "launch-b")), "the second launch's alert")
        assert not first.done(), "the first launch must still run: the launches overlap"
        assert [a["rank"] for a in _firing(agg, "launch-b")] == ["0"]
        # The first launch is still judged while the second runs: its alert fires on,
        # the same one (not resolved and fired again), and both are exported live.
        await agg.evaluate()
        assert _alerts_of(agg, "launch-a") == [first_alert]
        assert _runs_exported(agg) == {"launch-a", "launch-b"}
        second_steps = await second
        stop_first.touch()
        first_steps = await first
    assert second_steps == [SECOND_STEPS, SECOND_STEPS]
    assert first_steps[0] == first_steps[1]

    url = f"sqlite:///{tmp_path / 'history.db'}"
    counted = run_query(
        url, f"SELECT run_id, rank, count(*) FROM steps WHERE job = '{JOB}' GROUP BY 1, 2"
    ).rows
    assert {(run, rank): n for run, rank, n in counted} == {
        ("launch-a", 0): first_steps[0],
        ("launch-a", 1): first_steps[1],
        ("launch-b", 0): SECOND_STEPS,
        ("launch-b", 1): SECOND_STEPS,
    }
    stored = run_query(
        url,
        f"SELECT run_id, rank, labels FROM alerts WHERE job = '{JOB}' AND rule = 'Loss Too High'",
    ).rows
    assert {(run, rank) for run, rank, _ in stored} == {("launch-a", 1), ("launch-b", 0)}
    for run, _rank, labels in stored:
        assert f'"run": "{run}"' in labels or f'"run":"{run}"' in labels, labels

    latest = report_from_db(url, JOB)
    first_report = report_from_db(url, JOB, run="launch-a")
    assert latest.run_id == "launch-b"
    assert {r.rank: r.steps for r in latest.ranks} == {0: SECOND_STEPS, 1: SECOND_STEPS}
    assert {r.rank: r.steps for r in first_report.ranks} == {0: first_steps[0], 1: first_steps[1]}
    assert {(a.rule, a.rank) for a in latest.alerts} == {("Loss Too High", 0)}
    assert {(a.rule, a.rank) for a in first_report.alerts} == {("Loss Too High", 1)}
