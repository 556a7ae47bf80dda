"""Link checks in real 3-rank gloo DDP jobs: every rank runs the check at the same step,
beside a config change carried by the same consensus broadcast."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import ReceiverThread
from tests.integration.test_probe import _model, _param_bytes, _train
from torshmon.launch import run_ranks
from torshmon.probe.linkcheck import DEFAULT_SIZE_BYTES
from torshmon.wire import Command

pytestmark = pytest.mark.integration

TIMEOUT_S = 120
WORLD = 3
SIZE_BYTES = 256 * 1024


def _check_beside_a_config(rank: int, world: int, sock: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    monitor = torshmon.attach(ddp, job="lc", agent_socket=sock, flush_interval_s=0.05, sync_every=2)
    _train(ddp, 3, rank, monitor)
    if rank == 0:
        # As the agent relays them: a config and a check queued for the same sync step,
        # then a second check while the first is queued, and two bad ones.
        monitor._on_commands(
            [
                Command(id="cfg", job="lc", kind="config", args={"codec": "fp16"}),
                Command(
                    id="lc1",
                    job="lc",
                    kind="link_check",
                    args={"size_bytes": SIZE_BYTES, "repeats": 2},
                ),
                Command(id="lc2", job="lc", kind="link_check", args={}),
                Command(id="bad", job="lc", kind="link_check", args={"size_bytes": 1}),
                Command(id="odd", job="lc", kind="link_check", args={"rate": 1}),
            ]
        )
    _train(ddp, 6, rank, monitor)
    if rank == 0:
        monitor._on_commands([Command(id="lc3", job="lc", kind="link_check", args={})])
    _train(ddp, 6, rank, monitor)
    final = monitor.config
    monitor.close()
    return {"params": _param_bytes(ddp), "codec": final.codec if final else None}


def test_every_rank_checks_every_peer_at_the_same_step(receiver: ReceiverThread) -> None:
    results = run_ranks(
        _check_beside_a_config, WORLD, str(receiver.socket_path), timeout_s=TIMEOUT_S
    )
    assert len({r["params"] for r in results}) == 1  # ranks never diverged
    assert [r["codec"] for r in results] == ["fp16"] * WORLD

    checks = {
        rank: {c.id: c for b in receiver.batches(rank) for c in b.link_checks}
        for rank in range(WORLD)
    }
    for rank, by_id in checks.items():
        assert sorted(by_id) == ["lc1", "lc3"], rank
        for check in by_id.values():
            assert sorted(p.peer for p in check.peers) == [r for r in range(WORLD) if r != rank]
            assert all(p.duration_s > 0 for p in check.peers)
            # Linux's schedstat: the run-queue delay of the rank's threads meanwhile.
            assert all(p.cpu_wait_s is not None and p.cpu_wait_s >= 0 for p in check.peers)
            assert check.duration_s >= sum(p.duration_s for p in check.peers)
        assert {p.size_bytes for p in by_id["lc1"].peers} == {SIZE_BYTES}
        assert {p.size_bytes for p in by_id["lc3"].peers} == {DEFAULT_SIZE_BYTES}
    for check_id in ("lc1", "lc3"):
        assert len({checks[rank][check_id].step for rank in range(WORLD)}) == 1

    acks = {}
    for b in receiver.batches(0):
        for ack in b.command_acks:
            acks.setdefault(ack.id, []).append(ack)
    assert [a.status for a in acks["lc1"]] == ["accepted", "applied"]
    assert acks["lc1"][-1].effective_step == checks[0]["lc1"].step
    assert [a.status for a in acks["lc3"]] == ["accepted", "applied"]
    [lc2] = acks["lc2"]
    assert lc2.status == "rejected" and "'lc1' is already queued" in lc2.reason
    [bad] = acks["bad"]
    assert bad.status == "rejected" and "size_bytes must be in" in bad.reason
    [odd] = acks["odd"]
    assert odd.status == "rejected" and "unknown link_check field 'rate'" in odd.reason
    # The config of the same broadcast was applied at the very step the check ran.
    applied = [a for a in acks["cfg"] if a.status == "applied"]
    assert applied and applied[0].effective_step == checks[0]["lc1"].step + 1


def _gathered(rank: int, world: int, values: list[str]) -> list[str]:
    from torch.distributed import distributed_c10d as c10d

    from torshmon.probe import _torch_compat
    from torshmon.probe.linkcheck import gather_strings

    group = _torch_compat.side_group()
    try:
        return gather_strings(group, values[rank])
    finally:
        _torch_compat.release_side_group(group)
        assert c10d._get_default_group() is not None  # the job's group is left alone


def test_each_ranks_host_key_reaches_every_rank_in_rank_order() -> None:
    """The side group is not in torch's registry, so the host keys go through one
    all-gather of fixed slots: empty, non-ASCII and over-long (cut at 255 bytes) alike."""
    values = ["", "hôte-1", "x" * 300]
    for gathered in run_ranks(_gathered, WORLD, values, timeout_s=TIMEOUT_S):
        assert gathered == ["", "hôte-1", "x" * 255]
