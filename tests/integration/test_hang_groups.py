"""Hangs in any process group, in real 4-rank gloo jobs: the probe reports each group's
members, and the aggregator names the rank that holds a collective up, not its victims."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import ReceiverThread
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

TIMEOUT_S = 120


def _make_groups(rank: int, world: int, sock: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torshmon

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
    for _ in range(3):
        with monitor.step():
            dist.all_reduce(torch.ones(4))
    monitor.close()
    return labels


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
            assert reported[pg][0] == ranks, (rank, name, reported)
        assert any(desc == "mesh_dp" for _, desc in reported.values()), reported
        # Only this rank's groups: the other pair's group is not in its reports.
        assert all(rank in ranks for ranks, _ in reported.values()), reported
