"""Silence is not a hang (issue 23): namespaces as nodes, one real agent per node, one
real aggregator, ranks spread as torchrun spreads them.

An agent killed and restarted mid-run raises Agent Down on its node (and resolves it),
never a Hung Collective, and loses no row; an aggregator killed and restarted mid-run
raises no Hung Collective either. Needs root and iproute2, like ``test_multinode.py``.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.multinode import Cluster, train_until_stopped
from torshmon.linkshape import available

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def shaping() -> None:
    ok, reason = available()
    if not ok:
        pytest.skip(reason)


def _steps_by_rank(cluster: Cluster) -> dict[int, int]:
    """Each rank's live step count, once every rank has sent steps (else {})."""
    rows: list[dict[str, Any]] = cluster.api(f"/api/v1/jobs/{cluster.job}/ranks")["ranks"]
    counts = {r["rank"]: (r["live"] or {}).get("steps_total", 0) for r in rows}
    return counts if len(counts) == cluster.world_size and all(counts.values()) else {}


def _settled(cluster: Cluster) -> dict[int, int]:
    """Each rank's live step count once every rank has run 200 steps (else {}): by then
    the job's typical step is known and its collective timeout down to its 2 s floor,
    the setting in which a dead agent's last reports used to be read as a hang."""
    counts = _steps_by_rank(cluster)
    return counts if counts and min(counts.values()) >= 200 else {}


def _stepped_past(cluster: Cluster, floor: dict[int, int], ranks: range | None = None) -> bool:
    """Whether the live step count of every rank in ``ranks`` (None: all) has moved
    past ``floor``."""
    counts = _steps_by_rank(cluster)
    ranks = ranks if ranks is not None else range(cluster.world_size)
    return bool(counts) and all(counts[r] > floor.get(r, 0) for r in ranks)


def _caught_up(cluster: Cluster) -> bool:
    """Whether every rank's live step count is within a second of steps of the others'."""
    counts = _steps_by_rank(cluster).values()
    return bool(counts) and max(counts) - min(counts) <= 50


def _alerts(cluster: Cluster, rule: str) -> list[dict[str, Any]]:
    return [a for a in cluster.alerts() if a["rule"] == rule]


def _stored_steps(cluster: Cluster) -> dict[int, tuple[int, int]]:
    """Per rank: (step rows, distinct steps) in the history database."""
    with sqlite3.connect(f"file:{cluster.db_path}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT rank, COUNT(*), COUNT(DISTINCT step) FROM steps WHERE job = ? GROUP BY rank",
            (cluster.job,),
        ).fetchall()
    return {rank: (n, distinct) for rank, n, distinct in rows}


def _every_step_stored(cluster: Cluster, steps: int) -> dict[int, tuple[int, int]]:
    """The stored steps once every rank has ``steps`` of them, or after 60 s."""
    deadline = time.monotonic() + 60.0
    while True:
        stored = _stored_steps(cluster)
        done = len(stored) == cluster.world_size and all(d >= steps for _, d in stored.values())
        if done or time.monotonic() > deadline:
            return stored
        time.sleep(0.2)


def test_an_agent_restart_raises_agent_down_not_a_hang_and_loses_no_row(
    shaping: None, tmp_path: Path
) -> None:
    with Cluster(tmp_path, nodes=2, ranks_per_node=2) as cluster:
        # No pause between steps: the ranks spend most of their time in collectives, so
        # the agent's last POST most likely shows node 1's ranks inside one.
        job = cluster.start_job(train_until_stopped, str(cluster.stop_file), 0.0)
        try:
            before = cluster.wait(lambda: _settled(cluster), "200 steps of every rank", 120)
            cluster.kill_agent(1)
            down = cluster.wait(
                lambda: [a for a in _alerts(cluster, "Agent Down") if a["state"] == "firing"],
                "Agent Down to fire",
            )
            # Node 0's ranks go on training (node 1's too, unseen until its agent is back).
            cluster.wait(lambda: _stepped_past(cluster, before, range(2)), "node 0's steps")
            cluster.start_agent(1)
            cluster.wait_agent(1)
            # Node 1's probes resend what they buffered meanwhile, one batch per ack:
            # wait until its ranks have caught up with node 0's. (A job that ended first
            # would lose the rest: a probe's close flushes for 5 s at most.)
            cluster.wait(lambda: _caught_up(cluster), "node 1's buffered steps", 120)
            cluster.wait(
                lambda: [a for a in _alerts(cluster, "Agent Down") if a["state"] == "resolved"],
                "Agent Down to resolve",
            )
            # Before the job ends: the outage and the catch-up are what is judged here.
            hangs = _alerts(cluster, "Hung Collective")
        finally:
            steps = cluster.stop_job(job)
        stored = _every_step_stored(cluster, steps[0])
    assert len(set(steps)) == 1
    assert [(a["labels"]["node"], a["severity"]) for a in down] == [("node1", "high")]
    assert "node1" in down[0]["annotations"]["summary"]
    assert hangs == [], hangs
    # No lost row, and none stored twice: the restarted agent sent on its spool.
    assert stored == {rank: (steps[0], steps[0]) for rank in range(4)}, stored


def test_an_aggregator_restart_raises_no_hang(shaping: None, tmp_path: Path) -> None:
    with Cluster(tmp_path, nodes=2, ranks_per_node=2) as cluster:
        job = cluster.start_job(train_until_stopped, str(cluster.stop_file))
        try:
            cluster.wait(lambda: _settled(cluster), "200 steps of every rank", 120)
            cluster.kill_aggregator()
            # The agents spool meanwhile and send it all on; the ranks keep training.
            cluster.start_aggregator()
            after = cluster.wait(lambda: _steps_by_rank(cluster), "every rank's steps")
            cluster.wait(lambda: _stepped_past(cluster, after), "steps after the restart")
            cluster.wait(lambda: _caught_up(cluster), "every rank's spooled steps", 120)
            hangs = _alerts(cluster, "Hung Collective")  # before the job ends
        finally:
            steps = cluster.stop_job(job)
        stored = _every_step_stored(cluster, steps[0])
    assert len(set(steps)) == 1
    assert hangs == [], hangs
    assert stored == {rank: (steps[0], steps[0]) for rank in range(4)}, stored
