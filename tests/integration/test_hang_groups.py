"""Hangs in any process group, in real 4-rank gloo jobs: the probe reports each group's
members, and the aggregator names the rank that holds a collective up, not its victims."""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.aggregator_thread import AggregatorThread
from tests.integration.conftest import ReceiverThread
from tests.integration.test_agent import AgentProcess
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

TIMEOUT_S = 400  # four ranks importing torch take over a minute on 2 loaded cores


def _make_groups(rank: int, world: int, sock: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torshmon
    from torshmon.probe.collectives import DESCRIBERS

    before = dist.new_group([2, 3])  # before attach: found in torch's registry
    monitor = torshmon.attach(None, job="groups", agent_socket=sock, flush_interval_s=0.05)
    pairs, _ = dist.new_subgroups(2)  # {0, 1} and {2, 3}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    labels = {}
    for name, group in (("pairs", pairs), ("dp", mesh.get_group("dp"))):
        dist.all_reduce(torch.ones(4), group=group)
        labels[name] = (dist.get_process_group_ranks(group), group.group_name)
    if rank in (2, 3):
        dist.all_reduce(torch.ones(4), group=before)
        labels["before"] = ([2, 3], before.group_name)
        # batch_isend_irecv names the peer by its rank in the group; reports use global ranks
        peer = DESCRIBERS["isend"](torch.ones(1), group=before, group_dst=3 - rank)[4]
        labels["peer"] = ([5 - rank], str(peer))
    for _ in range(3):
        with monitor.step():
            dist.all_reduce(torch.ones(4))
    monitor.close()
    return labels


@pytest.mark.timeout(600)
def test_the_probe_reports_every_group_it_belongs_to_with_its_members(
    receiver: ReceiverThread,
) -> None:
    made = run_ranks(_make_groups, 4, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    for rank, labels in enumerate(made):
        reported = {
            g.pg: (g.ranks, g.desc) for batch in receiver.batches(rank) for g in batch.groups
        }
        assert reported["default"][0] == [0, 1, 2, 3]
        for name, (ranks, pg) in labels.items():
            if name == "peer":
                assert [int(pg)] == ranks  # the other one of ranks 2 and 3
                continue
            assert reported[pg][0] == ranks, (rank, name, reported)
        assert any(desc == "mesh_dp" for _, desc in reported.values()), reported
        # Only this rank's groups: the other pair's group is not in its reports.
        assert all(rank in ranks for ranks, _ in reported.values()), reported


# -- end to end: a real job, the real agent and aggregator -------------------------------


class _Stack:
    """A real aggregator (its own thread, loopback port, SQLite history) and a real
    ``torshmon agent`` process forwarding to it."""

    def __init__(self, aggregator: AggregatorThread, agent: AgentProcess, tmp_path: Path) -> None:
        self.aggregator = aggregator
        self.agent = agent
        self.release = tmp_path / "release"

    def hang_alerts(self, job: str) -> list[dict[str, Any]]:
        status, body = self.aggregator.get(f"/api/v1/alerts?job={job}&rule=Hung%20Collective")
        assert status == 200, body
        return list(body["alerts"])


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[_Stack]:
    settings = AggregatorSettings(
        port=0,
        db_url=f"sqlite:///{tmp_path / 'history.db'}",
        token="t",
        aggregator_id="a1",
        eval_interval_s=0.2,
    )
    with AggregatorThread(settings) as aggregator:
        agent = AgentProcess(tmp_path, aggregator.url, "t").start()
        try:
            yield _Stack(aggregator, agent, tmp_path)
        finally:
            agent.stop()


def _hold(release: str, timeout_s: float = 120.0) -> None:
    """The injected fault: this rank stops (in Python, outside any collective) until
    the test releases it, or ``timeout_s`` passes. ``release + ".held"`` tells the
    test it has begun."""
    Path(release + ".held").touch()
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)


def _subgroup_hang(rank: int, world: int, sock: str, release: str) -> str:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    pairs, _ = dist.new_subgroups(2)  # {0, 1} and {2, 3}
    monitor = torshmon.attach(model, job="subgroup-hang", agent_socket=sock, flush_interval_s=0.1)
    for step in range(16):
        with monitor.step(batch_size=8):
            loss = model(torch.randn(8, 64)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 3 and step == 8:
                _hold(release)  # rank 2 waits in the pair all-reduce, 0 and 1 in DDP's next
            dist.all_reduce(torch.ones(4), group=pairs)
        time.sleep(0.1)  # the job's pace; leaves CPU to the daemons on a small machine
    monitor.close(timeout_s=10)
    return str(pairs.group_name)


def _p2p_hang(rank: int, world: int, sock: str, release: str) -> None:
    import torch
    import torch.distributed as dist

    import torshmon

    monitor = torshmon.attach(None, job="p2p-hang", agent_socket=sock, flush_interval_s=0.1)
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    for step in range(16):
        with monitor.step(batch_size=8):
            dist.all_reduce(torch.ones(4))
            buffer = torch.zeros(16)
            if rank % 2 == 0:  # 0 receives from 1, 2 from 3 (as a pipeline's backward)
                ops = [dist.P2POp(dist.irecv, buffer, peer)]
            else:
                if rank == 1 and step == 8:
                    _hold(release)  # rank 0 waits in its recv, 2 and 3 in the next all-reduce
                ops = [dist.P2POp(dist.isend, torch.ones(16), peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        time.sleep(0.1)
    monitor.close(timeout_s=10)


def _run_until_named(
    stack: _Stack, target: Callable[..., Any], job: str, rank: int
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Run the 4-rank job; once a Hung Collective alert names ``rank`` (or 60 s after
    the held rank stopped) release it. Returns the job's alerts and the ranks' results."""
    args = (str(stack.agent.socket), str(stack.release))
    held = Path(str(stack.release) + ".held")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_ranks, target, 4, *args, timeout_s=TIMEOUT_S + 80)
        try:
            while not held.exists() and not running.done():
                time.sleep(0.2)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not running.done():
                fired = [a for a in stack.hang_alerts(job) if a["state"] == "firing"]
                if any(a["rank"] == rank for a in fired):
                    break
                time.sleep(0.2)
        finally:
            stack.release.touch()
        results = running.result()
    # The alert resolves once the job goes on.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alerts = stack.hang_alerts(job)
        if alerts and all(a["state"] == "resolved" for a in alerts):
            break
        time.sleep(0.2)
    return alerts, results


@pytest.mark.timeout(600)
def test_a_subgroup_hang_names_the_rank_that_never_entered_not_its_victims(
    stack: _Stack,
) -> None:
    alerts, results = _run_until_named(stack, _subgroup_hang, "subgroup-hang", 3)
    pair_23 = results[3]
    assert alerts, "no Hung Collective alert"
    # Only rank 3 is blamed: rank 2 waits in the pair all-reduce, ranks 0 and 1 in DDP's
    # next reduction; nothing says every rank joined.
    assert {a["rank"] for a in alerts} == {3}, alerts
    (alert,) = alerts
    assert alert["labels"]["op"] == "all_reduce"
    assert alert["labels"]["pg"] == pair_23
    summary = alert["annotations"]["summary"]
    assert summary.startswith(
        f"rank 3 of job subgroup-hang never joined all_reduce #9 on pg {pair_23} "
        "(members: ranks 2, 3) that rank 2 entered"
    ), summary
    assert "ranks 0, 1 wait behind it in ddp_reduce" in summary
    assert alert["state"] == "resolved"


@pytest.mark.timeout(600)
def test_a_point_to_point_hang_names_the_peer_that_never_posted_its_send(
    stack: _Stack,
) -> None:
    alerts, _ = _run_until_named(stack, _p2p_hang, "p2p-hang", 1)
    assert {a["rank"] for a in alerts} == {1}, alerts
    (alert,) = alerts
    assert (alert["labels"]["op"], alert["labels"]["pg"]) == ("irecv", "default")
    summary = alert["annotations"]["summary"]
    assert summary.startswith(
        "rank 1 of job p2p-hang never posted the send matching rank 0's irecv #9"
    ), summary
    assert "ranks 2, 3 wait behind it in all_reduce" in summary
    assert alert["state"] == "resolved"
