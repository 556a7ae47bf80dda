"""Namespaces as nodes: one agent per node, one aggregator, ranks spread over nodes as
torchrun spreads them; each rank is attributed to its node and local rank.

Needs root and iproute2 (``linkshape.available``), like ``test_slow_link.py``.
"""

from __future__ import annotations

import re
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from tests.integration.multinode import Cluster, train_until_stopped
from torshmon.linkshape import available, parse_rate

pytestmark = pytest.mark.integration

SLOW_RATE = "100mbit"


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


def _stepped_on(cluster: Cluster, before: dict[int, int], ranks: tuple[int, ...]) -> bool:
    """Whether each of ``ranks`` has a step past its ``before`` count (the live state
    restarts from zero with the aggregator, so the newest step number is compared)."""
    live = {r["rank"]: r["live"] or {} for r in _ranks(cluster)}
    return all(live.get(rank, {}).get("last_step", -1) > before[rank] for rank in ranks)


def test_each_rank_reports_its_node_and_local_rank(shaping: None, tmp_path: Path) -> None:
    with Cluster(tmp_path, nodes=2, ranks_per_node=2) as cluster:
        job = cluster.start_job(train_until_stopped, str(cluster.stop_file))
        try:
            rows = cluster.wait(lambda: _ranks_stepping(cluster), "every rank's steps")
            metrics = [cluster.agent_metrics(node) for node in range(2)]
            # The harness restarts an agent and the aggregator on their spool and database;
            # node 1's ranks are then seen stepping on.
            before = {r["rank"]: r["live"]["last_step"] for r in rows}
            cluster.kill_agent(1)
            cluster.start_agent(1)
            cluster.wait_agent(1)
            cluster.kill_aggregator()
            cluster.start_aggregator()
            cluster.wait(lambda: _stepped_on(cluster, before, (2, 3)), "node 1's ranks", 60)
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
        ranks = {
            match.group(1)
            for line in text.splitlines()
            if 'job="multinode"' in line
            for match in re.finditer(r'[{,]rank="(\d+)"', line)
        }
        assert ranks == {str(2 * node), str(2 * node + 1)}, text[:2000]


def _slow_link_alerts(cluster: Cluster) -> list[dict[str, Any]]:
    return [a for a in cluster.alerts() if a["rule"] == "Slow Link" and a["state"] == "firing"]


def _link_reading(cluster: Cluster) -> dict[str, Any] | None:
    """The job's latest link check from its report; None before the first (or the job)."""
    try:
        report = cluster.api(f"/api/v1/jobs/{cluster.job}/report")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # no live data for the job yet
            return None
        raise
    reading: dict[str, Any] | None = report["link_check"]
    return reading


@pytest.mark.parametrize(("nodes", "named"), [(3, "node1"), (2, "node0-node1")])
def test_a_slow_node_link_is_named_by_node(
    shaping: None, tmp_path: Path, nodes: int, named: str
) -> None:
    """Two ranks per node; node 1's link at 100 Mbit/s: the Slow Link alert names node 1
    (with two nodes, their link), and the report shows bandwidth per node pair."""
    with Cluster(tmp_path, nodes=nodes, ranks_per_node=2) as cluster:
        job = cluster.start_job(train_until_stopped, str(cluster.stop_file))
        try:
            cluster.wait(lambda: _link_reading(cluster), "the reference check", 90)
            # On 2 shared cores an unshaped reference reading can name a suspect node; only
            # a confirming check may turn it into an alert, and none may fire before shaping.
            assert _slow_link_alerts(cluster) == []
            cluster.shape(1, SLOW_RATE)
            [alert] = cluster.wait(lambda: _slow_link_alerts(cluster), "the Slow Link alert", 90)
            slow = _link_reading(cluster)
            series = cluster.aggregator_metrics()
        finally:
            steps = cluster.stop_job(job)
    assert len(set(steps)) == 1
    assert alert["labels"]["node"] == named
    assert f"of job {cluster.job}" in alert["annotations"]["summary"]
    assert slow is not None
    by_pair = slow["nodes"]["node_pairs"]
    rate_bytes = parse_rate(SLOW_RATE) / 8
    for pair, bandwidth in by_pair.items():
        if "node1" in pair.split("-"):
            assert 0.3 * rate_bytes < bandwidth < 1.3 * rate_bytes, by_pair
        else:
            assert bandwidth > 3 * rate_bytes, by_pair
    # Pairs within a node (loopback) are reported apart, and far faster.
    for node in range(nodes):
        [intra] = slow["nodes"]["intra_node_pairs"][f"node{node}"].values()
        assert intra > 3 * rate_bytes
    exposed = [
        line for line in series.splitlines()
        if line.startswith("torshmon_node_link_bandwidth_bytes_per_second{")
    ]  # fmt: skip
    assert len(exposed) == len(by_pair) + nodes, exposed  # node pairs, and each node's own
