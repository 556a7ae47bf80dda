"""Namespaces as nodes: one agent per node, one aggregator, ranks spread over nodes as
torchrun spreads them; each rank is attributed to its node and local rank.

Needs root and iproute2 (``linkshape.available``), like ``test_slow_link.py``.
"""

from __future__ import annotations

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


def _ranks(cluster: Cluster) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = cluster.api(f"/api/v1/jobs/{cluster.job}/ranks")["ranks"]
    return rows


def _ranks_stepping(cluster: Cluster) -> list[dict[str, Any]]:
    """The ranks API's rows once every rank has sent steps, else []."""
    rows = _ranks(cluster)
    stepping = [r for r in rows if (r["live"] or {}).get("steps_total", 0) > 0]
    return rows if len(stepping) == cluster.world_size else []


def test_each_rank_reports_its_node_and_local_rank(shaping: None, tmp_path: Path) -> None:
    with Cluster(tmp_path, nodes=2, ranks_per_node=2) as cluster:
        job = cluster.start_job(train_until_stopped, str(cluster.stop_file))
        try:
            rows = cluster.wait(lambda: _ranks_stepping(cluster), "every rank's steps")
            metrics = [cluster.agent_metrics(node) for node in range(2)]
        finally:
            steps = cluster.stop_job(job)
    assert len(set(steps)) == 1
    seen = sorted((r["rank"], r["local_rank"], r["node"], r["live"]["node"]) for r in rows)
    assert seen == [
        (0, 0, "node0", "node0"),
        (1, 1, "node0", "node0"),
        (2, 0, "node1", "node1"),
        (3, 1, "node1", "node1"),
    ]
    # Each agent serves its own node's ranks only.
    for node, text in enumerate(metrics):
        ranks = {line.split('rank="')[1].split('"')[0] for line in text.splitlines()
                 if 'job="multinode"' in line and 'rank="' in line}  # fmt: skip
        assert ranks == {str(2 * node), str(2 * node + 1)}, text[:2000]
