"""Slow node link benchmark: how fast a slow NIC is named by node when nodes run several
ranks, and what the link check measures per node pair.

Each run is the multi-node test harness (``tests/integration/multinode.py``): N
network namespaces as nodes on a bridge, one real ``torshmon agent`` per node, one
real aggregator (default rules) in the hub namespace, a gloo DDP job of K ranks per
node with the probe attached. Once the reference check has read the healthy links,
node 1's link (both directions) is set to the slow rate; the run ends when the Slow
Link alert fires (or after ``--timeout-s``).

Per run: the time from the rate change to the alert firing (the aggregator's
``fired_at``), the node the alert names, and the bandwidth per node pair (and within
each node) of the latest link check, in Mbit/s of payload. Two scenarios: node 1 at
100 Mbit/s with the others unshaped, and every node at 4x the slow rate (400 Mbit/s)
with node 1 at 1/4 of it. Prints one line per run, then one JSON object (the last line).

Needs root and iproute2. Usage::

    python benchmarks/node_link.py                       # 2x2 and 3x2, both scenarios
    python benchmarks/node_link.py --nodes 3 --runs 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.error
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.multinode import Cluster, train_until_stopped

SLOW_RATE = "100mbit"
HEALTHY_QUARTER = "400mbit"


def _reading(cluster: Cluster) -> dict[str, Any] | None:
    try:
        report = cluster.api(f"/api/v1/jobs/{cluster.job}/report")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
    reading: dict[str, Any] | None = report["link_check"]
    return reading


def _firing(cluster: Cluster) -> list[dict[str, Any]]:
    return [a for a in cluster.alerts() if a["rule"] == "Slow Link" and a["state"] == "firing"]


def _mbit(by_pair: dict[str, float]) -> dict[str, float]:
    return {pair: round(bw * 8 / 1e6, 1) for pair, bw in by_pair.items()}


def run(nodes: int, per_node: int, others: str | None, timeout_s: float) -> dict[str, Any]:
    """One run: node 1 slowed to SLOW_RATE while the other nodes run at ``others``."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        Cluster(Path(tmp), nodes=nodes, ranks_per_node=per_node, rate=others) as cluster,
    ):
        job = cluster.start_job(train_until_stopped, str(cluster.stop_file))
        try:
            healthy = cluster.wait(lambda: _reading(cluster), "the reference check", 120)
            onset = time.time()
            cluster.shape(1, SLOW_RATE)
            try:
                [alert] = cluster.wait(lambda: _firing(cluster), "the Slow Link alert", timeout_s)
            except AssertionError:
                alert = None
            slow = _reading(cluster) or {}
        finally:
            cluster.stop_job(job)
    nodes_reading = slow.get("nodes") or {}
    return {
        "nodes": nodes,
        "ranks_per_node": per_node,
        "others": others or "unshaped",
        "slow_node_rate": SLOW_RATE,
        "named": alert["labels"].get("node") if alert else None,
        "time_to_alert_s": round(alert["fired_at_unix_s"] - onset, 2) if alert else None,
        "healthy_mbit": _mbit((healthy.get("nodes") or {}).get("node_pairs", {})),
        "slow_mbit": _mbit(nodes_reading.get("node_pairs", {})),
        "intra_mbit": {
            node: _mbit(pairs) for node, pairs in nodes_reading.get("intra_node_pairs", {}).items()
        },
        "summary": alert["annotations"]["summary"] if alert else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, action="append", help="nodes (default: 2 and 3)")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1, help="runs per case")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    results = []
    for nodes in args.nodes or [2, 3]:
        for others in (None, HEALTHY_QUARTER):
            for _ in range(args.runs):
                result = run(nodes, args.ranks_per_node, others, args.timeout_s)
                results.append(result)
                print(
                    f"{nodes}x{args.ranks_per_node} others={result['others']:>8} "
                    f"node1={SLOW_RATE}: named {result['named']} after "
                    f"{result['time_to_alert_s']} s; node pairs (Mbit/s) healthy "
                    f"{result['healthy_mbit']} slow {result['slow_mbit']}; "
                    f"within nodes {result['intra_mbit']}",
                    flush=True,
                )
    print(json.dumps({"runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
