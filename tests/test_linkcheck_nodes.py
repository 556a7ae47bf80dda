"""Link checks of ranks that share hosts: read node by node, the slow node named with its
bandwidth next to the healthy nodes', pairs within a node kept apart."""

from __future__ import annotations

import itertools
import random
import socket
from typing import Any

import pytest

from torshmon.aggregator.core.linkcheck import LinkChecker, reading_json
from torshmon.aggregator.core.localization import (
    hosts_of,
    localize_nodes,
    pair_bandwidths,
    pair_link_bounds,
)
from torshmon.probe.linkcheck import host_key, rounds, schedule
from torshmon.wire import LinkCheckResult, LinkPeerResult

MB = 4 * 2**20
FAST = 600e6  # bytes/s between two healthy nodes
SLOW = 12e6  # bytes/s through a 100 Mbit/s NIC
LOOPBACK = 2e9  # bytes/s between two ranks of one host
TRIGGERED = "communication rose while compute did not"


def _hosts(nodes: int, per_node: int) -> list[str]:
    return [f"10.0.0.{rank // per_node + 1}" for rank in range(nodes * per_node)]


def _results(
    check_id: str,
    hosts: list[str],
    slow: frozenset[int] = frozenset(),
    busy: frozenset[int] = frozenset(),
) -> list[LinkCheckResult]:
    """What each rank measures in the probe's schedule: ``slow`` holds slow node indices;
    the ranks of ``busy`` nodes report CPU wait covering all but 1 % of each exchange."""
    rng = random.Random(check_id)
    node = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    peers: dict[int, list[LinkPeerResult]] = {rank: [] for rank in range(len(hosts))}
    for a, b in (pair for pairs in schedule(hosts) for pair in pairs):
        na, nb = node[hosts[a]], node[hosts[b]]
        bandwidth = LOOPBACK if na == nb else SLOW if {na, nb} & slow else FAST
        for rank, peer in ((a, b), (b, a)):
            duration = MB / (bandwidth * rng.uniform(0.8, 1.0))
            wait = 0.99 * duration if node[hosts[rank]] in busy else 0.0
            peers[rank].append(
                LinkPeerResult(peer=peer, size_bytes=MB, duration_s=duration, cpu_wait_s=wait)
            )
    return [
        LinkCheckResult(
            id=check_id, job="j", rank=r, step=9, duration_s=0.5, peers=p, host=hosts[r]
        )
        for r, p in peers.items()
    ]


# -- the probe's schedule -------------------------------------------------------------------


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (3, 2), (2, 3), (4, 8), (3, 1), (1, 4)])
def test_the_schedule_meets_every_representative_pair_and_every_pair_within_a_host(
    nodes: int, per_node: int
) -> None:
    hosts = _hosts(nodes, per_node)
    plan = schedule(hosts)
    met = sorted(pair for pairs in plan for pair in pairs)
    representatives = [n * per_node for n in range(nodes)]
    within = [
        pair
        for n in range(nodes)
        for pair in itertools.combinations(range(n * per_node, (n + 1) * per_node), 2)
    ]
    assert met == sorted([*itertools.combinations(representatives, 2), *within])
    for pairs in plan:
        ranks = [rank for pair in pairs for rank in pair]
        assert len(ranks) == len(set(ranks))
    # Pairs between hosts run first, alone on the NICs.
    crossing = [i for i, pairs in enumerate(plan) for a, b in pairs if hosts[a] != hosts[b]]
    local = [i for i, pairs in enumerate(plan) for a, b in pairs if hosts[a] == hosts[b]]
    if crossing and local:
        assert max(crossing) < min(local)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_one_rank_per_host_or_one_host_is_the_plain_tournament(world: int) -> None:
    assert schedule([f"h{r}" for r in range(world)]) == rounds(world)
    assert schedule(["h"] * world) == rounds(world)


# -- reading --------------------------------------------------------------------------------


def test_ranks_sharing_hosts_are_read_by_node_and_one_rank_per_host_by_rank() -> None:
    assert hosts_of(_results("c", _hosts(2, 2))) == dict(enumerate(_hosts(2, 2)))
    assert hosts_of(_results("c", _hosts(3, 1))) is None  # the demo: one rank per namespace
    assert hosts_of(_results("c", _hosts(1, 3))) is None  # one host: loopback only
    old_probe = [LinkCheckResult(id="c", job="j", rank=r, step=1, duration_s=0.1) for r in range(3)]
    assert hosts_of(old_probe) is None


def test_the_slow_node_is_named_with_inter_and_intra_node_bandwidth_apart() -> None:
    hosts = _hosts(3, 2)
    results = _results("c", hosts, frozenset({1}))
    nodes = {rank: f"node{rank // 2}" for rank in range(6)}
    reading = localize_nodes(nodes, pair_bandwidths(results))
    assert reading.nodes is not None
    assert reading.nodes.slow == ("node1",)
    assert set(reading.nodes.pairs) == {("node0", "node1"), ("node0", "node2"), ("node1", "node2")}
    assert reading.nodes.bandwidth_by_node["node1"] < 1.1 * SLOW
    assert reading.nodes.bandwidth_by_node["node0"] > 0.7 * FAST
    # Loopback pairs are another fabric: kept apart, and they do not hide the slow NIC.
    assert {n: list(p) for n, p in reading.nodes.intra.items()} == {
        "node0": [(0, 1)],
        "node1": [(2, 3)],
        "node2": [(4, 5)],
    }
    assert min(reading.nodes.intra["node1"].values()) > 0.7 * LOOPBACK
    assert reading.slow == ()  # no rank is named


def test_healthy_nodes_name_nobody() -> None:
    nodes = {rank: f"node{rank // 2}" for rank in range(6)}
    reading = localize_nodes(nodes, pair_bandwidths(_results("c", _hosts(3, 2))))
    assert reading.nodes is not None and reading.nodes.slow == ()


# -- the checker ----------------------------------------------------------------------------


def _checker(nodes: int, per_node: int) -> LinkChecker:
    checker = LinkChecker()
    world = nodes * per_node
    checker.set_world("j", world)
    for rank in range(world):
        checker.set_node("j", rank, f"node{rank // per_node}")
    for _ in range(40):
        for rank in range(world):
            checker.observe_step("j", rank, 0.01, 0.05)
    assert checker.due(100.0) == [("j", "reference")]
    _answer(checker, "ref", "reference", 100.0, _hosts(nodes, per_node))
    assert checker.active() == []
    return checker


def _answer(
    checker: LinkChecker,
    check_id: str,
    reason: str,
    now: float,
    hosts: list[str],
    slow: frozenset[int] = frozenset(),
) -> None:
    checker.sent("j", check_id, reason, now)
    for result in _results(check_id, hosts, slow):
        checker.observe_result(result, now)
    checker.evaluate(now)


def test_three_nodes_name_the_slow_node_with_the_healthy_nodes_bandwidth() -> None:
    checker = _checker(3, 2)
    _answer(checker, "c1", TRIGGERED, 120.0, _hosts(3, 2), frozenset({2}))
    assert checker.active() == []  # a suspect until the check confirm_after_s later
    assert checker.due(123.0) == [("j", "confirm")]
    _answer(checker, "c1b", "confirm", 123.0, _hosts(3, 2), frozenset({2}))
    [finding] = checker.active()
    assert dict(finding.labels) == {"job": "j", "node": "node2"}
    assert finding.summary.startswith("Slow network link at node node2 of job j: its link")
    assert "node0 " in finding.summary and "node1 " in finding.summary
    assert finding.value < 1.1 * SLOW
    details: dict[str, Any] = dict(finding.details)
    assert details["slow_nodes"] == ["node2"]
    assert set(details["node_pairs"]) == {"node0-node1", "node0-node2", "node1-node2"}
    assert details["intra_node_pairs"]["node2"].keys() == {"4-5"}
    assert details["ranks_by_node"] == {"node0": [0, 1], "node1": [2, 3], "node2": [4, 5]}
    # The recheck after recovery clears it.
    _answer(checker, "c2", "recheck", 130.0, _hosts(3, 2))
    assert checker.active() == []
    last = checker.last("j")
    assert last is not None
    assert reading_json(last)["nodes"]["slow_nodes"] == []  # type: ignore[index]


def test_two_nodes_name_their_link_once_a_second_check_agrees() -> None:
    checker = _checker(2, 2)
    assert checker.check_args("j") == {"repeats": 3}  # one representative pair carries it
    _answer(checker, "c1", TRIGGERED, 120.0, _hosts(2, 2), frozenset({1}))
    assert checker.active() == []
    assert checker.due(122.9) == []
    assert checker.due(123.0) == [("j", "confirm")]
    _answer(checker, "c2", "confirm", 123.0, _hosts(2, 2), frozenset({1}))
    [finding] = checker.active()
    assert dict(finding.labels) == {"job": "j", "node": "node0-node1"}
    assert "between node node0 and node node1" in finding.summary
    assert "cannot tell which end" in finding.summary


def test_hosts_whose_agent_names_are_not_distinct_are_named_by_host() -> None:
    checker = _checker(3, 2)
    for rank in range(6):
        checker.set_node("j", rank, "one-agent")
    _answer(checker, "c1", TRIGGERED, 120.0, _hosts(3, 2), frozenset({0}))
    _answer(checker, "c2", "confirm", 123.0, _hosts(3, 2), frozenset({0}))
    [finding] = checker.active()
    assert finding.labels["node"] == "10.0.0.1"


def test_host_key_is_the_address_towards_the_master(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert host_key() == "127.0.0.1"
    monkeypatch.delenv("MASTER_ADDR")
    assert host_key() == socket.gethostname()[:64]


def test_a_node_slow_only_while_its_ranks_waited_for_a_cpu_is_contended_not_named() -> None:
    hosts = _hosts(3, 2)
    results = _results("c", hosts, frozenset({1}), busy=frozenset({1}))
    nodes = dict(enumerate(hosts))
    reading = localize_nodes(nodes, pair_bandwidths(results), bounds=pair_link_bounds(results))
    assert reading.nodes is not None
    assert (reading.nodes.slow, reading.nodes.contended) == ((), ("10.0.0.2",))
    results = _results("c", hosts, frozenset({1}))
    reading = localize_nodes(nodes, pair_bandwidths(results), bounds=pair_link_bounds(results))
    assert reading.nodes is not None and reading.nodes.slow == ("10.0.0.2",)
